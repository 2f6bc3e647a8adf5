// A chat page on the Vercel AI SDK's own chat client (AbstractChat + DefaultChatTransport,
// what useChat wraps) pointed at tokenrelay: the POST goes to a worker's /v1/chat, the
// resume (on load, like useChat({resume: true})) to a relay's /v1/chat/{id}/stream.
// Bundle: npx esbuild page/chat.js --bundle --format=esm --outfile=chat.bundle.js
// The URL fragment carries the session and its token: #session=<sid>&token=<token>.
// Stop, the way the SDK's docs ask for resumable streams: chat.stop() ends this page's
// request, and a POST to the session's cancel endpoint stops the generation itself
// (every screen gets the turn's done frame, finish_reason "cancelled"). Regenerate is
// the SDK's regenerate(); a reload starts from the stored conversation
// (GET /v1/sessions/{id}/messages?format=ui, the SDK's UI messages), then resumes.
import { AbstractChat, DefaultChatTransport } from "ai";
import { cancel, loadMessages } from "../../js/tokenrelay.js";

/** The state AbstractChat keeps its messages in; every change re-renders. */
class PageState {
  constructor(onChange, messages = []) {
    this.onChange = onChange;
    this._messages = messages;
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
  constructor({ onChange, messages, ...init }) {
    super({ ...init, state: new PageState(onChange, messages) });
  }
}

const $ = (id) => document.getElementById(id);
const textOf = (m) => m.parts.filter((p) => p.type === "text").map((p) => p.text).join("");

function render(chat) {
  $("status").textContent = chat.status;
  const busy = chat.status === "submitted" || chat.status === "streaming";
  $("stop").hidden = !busy;
  $("regenerate").hidden = busy || !chat.messages.some((m) => m.role === "assistant");
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
  let stored = [];
  try {
    stored = (await loadMessages(location.origin, session, token, { ui: true })).messages;
  } catch (err) { /* a new session has none; anything else shows on the first send */ }
  let chat = null;
  chat = new PageChat({
    id: session,
    messages: stored,
    onChange: () => chat && render(chat),
    transport: new DefaultChatTransport({
      api: "/v1/chat",
      headers: { Authorization: `Bearer ${token}` },
      // the session's history lives in Redis: send only the new message
      // (trigger and messageId say a regenerate or an edit)
      prepareSendMessagesRequest: ({ id, messages, trigger, messageId }) => ({
        body: { id, messages: messages.slice(-1), trigger, messageId },
      }),
    }),
  });
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("message").value.trim();
    if (text) { $("message").value = ""; chat.sendMessage({ text }); }
  });
  $("stop").addEventListener("click", async () => {
    await chat.stop();
    try { await cancel(location.origin, session, token); } catch (err) { $("error").textContent = err.message; }
  });
  $("regenerate").addEventListener("click", () => chat.regenerate());
  window.tokenrelayChat = chat;
  render(chat);
  await chat.resumeStream();  // a turn running on another screen streams here too
  document.body.dataset.ready = "1";
}

main().catch((err) => { $("error").textContent = String(err); });
