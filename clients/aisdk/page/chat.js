// A chat page on the Vercel AI SDK's own chat client (AbstractChat + DefaultChatTransport,
// what useChat wraps) pointed at tokenrelay: the POST goes to a worker's /v1/chat, the
// resume (on load, like useChat({resume: true})) to a relay's /v1/chat/{id}/stream.
// Bundle: npx esbuild page/chat.js --bundle --format=esm --outfile=chat.bundle.js
// The URL fragment carries the session and its token: #session=<sid>&token=<token>.
import { AbstractChat, DefaultChatTransport } from "ai";

/** The state AbstractChat keeps its messages in; every change re-renders. */
class PageState {
  constructor(onChange) {
    this.onChange = onChange;
    this._messages = [];
    this._status = "ready";
    this.error = undefined;
  }
  get messages() { return this._messages; }
  set messages(m) { this._messages = m; this.onChange(); }
  get status() { return this._status; }
  set status(s) { this._status = s; this.onChange(); }
  pushMessage(m) { this._messages = this._messages.concat(m); this.onChange(); }
  popMessage() { this._messages = this._messages.slice(0, -1); this.onChange(); }
  replaceMessage(i, m) { this._messages = [...this._messages.slice(0, i), m, ...this._messages.slice(i + 1)]; this.onChange(); }
  snapshot(thing) { return structuredClone(thing); }
}

class PageChat extends AbstractChat {
  constructor({ onChange, ...init }) {
    super({ ...init, state: new PageState(onChange) });
  }
}

const $ = (id) => document.getElementById(id);
const textOf = (m) => m.parts.filter((p) => p.type === "text").map((p) => p.text).join("");

function render(chat) {
  $("status").textContent = chat.status;
  $("messages").replaceChildren(...chat.messages.map((m) => {
    const el = document.createElement("div");
    el.className = `msg ${m.role}`;
    el.dataset.id = m.id;
    el.textContent = textOf(m);
    return el;
  }));
  if (chat.error) $("error").textContent = chat.error.message;
}

async function main() {
  const hash = new URLSearchParams(location.hash.slice(1));
  let session = hash.get("session");
  let token = hash.get("token");
  if (!session) {
    ({ session, token } = await (await fetch("/v1/sessions", { method: "POST" })).json());
    history.replaceState(null, "", `#session=${session}&token=${encodeURIComponent(token)}`);
  }
  let chat = null;
  chat = new PageChat({
    id: session,
    onChange: () => chat && render(chat),
    transport: new DefaultChatTransport({
      api: "/v1/chat",
      headers: { Authorization: `Bearer ${token}` },
      // the session's history lives in Redis: send only the new message
      prepareSendMessagesRequest: ({ id, messages }) => ({ body: { id, messages: messages.slice(-1) } }),
    }),
  });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("message").value.trim();
    if (text) { $("message").value = ""; chat.sendMessage({ text }); }
  });
  window.tokenrelayChat = chat;
  render(chat);
  await chat.resumeStream();  // a turn running on another screen streams here too
  document.body.dataset.ready = "1";
}

main().catch((err) => { $("error").textContent = String(err); });
