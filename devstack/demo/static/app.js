// tokenrelay multi-screen page: no build step. The stream comes from the browser client
// (tokenrelay.js, the same file as clients/js/tokenrelay.js): resume, reconnect with
// jittered backoff, duplicate and hole checks, the done frame's integrity check.
// The address bar shows the session only (#session=<sid>); the tab keeps its token in
// sessionStorage, so a copied address bar shares no token. A link carries one
// (#session=<sid>&token=<token>): the page takes it into the tab and out of the address.
// The creator's page holds a write token (it may send, stop, regenerate, and refreshes its
// token before it expires). "Open on another screen" offers two links: a watch link (a
// watch token: the screen watches, its input is disabled and says why) and a collaborate
// link (a write token: that screen may do everything this one does). A reload restores
// the conversation from the worker's stored messages and watches on from where they end.
import { cancel, framePart, loadMessages, watch } from "./tokenrelay.js";

const $ = (id) => document.getElementById(id);
const state = {
  sid: null, token: null, transport: "sse", watcher: null, problems: 0, turns: new Map(),
  refreshTimer: null, canWrite: false, running: null, lastDone: null,
  carried: { frames: 0, duplicates: 0, gaps: 0, reconnects: 0 },  // earlier watchers' counts
};
const TOKEN = "tokenrelay-token:";  // sessionStorage key prefix: this tab's token per session

function keepToken(sid, token) { sessionStorage.setItem(TOKEN + sid, token); }

// The claims of a JWT (not verified here: the servers do), or null.
function claims(token) {
  try {
    const part = token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/");
    return JSON.parse(atob(part + "=".repeat((4 - (part.length % 4)) % 4)));
  } catch (e) { return null; }
}

async function mint(scope) {
  const r = await fetch(`/v1/sessions/${state.sid}/tokens`, {
    method: "POST",
    headers: { "Content-Type": "application/json", "Authorization": `Bearer ${state.token}` },
    body: JSON.stringify({ scope }),
  });
  return r.status === 201 ? (await r.json()).token : null;
}

// A write token: a watch link and a collaborate link (a second write token), and a fresh
// write token a minute before expiry. A watch token: its input is disabled, and says why.
async function manageTokens() {
  clearTimeout(state.refreshTimer);
  const c = claims(state.token || "");
  // no claims: auth is off (a token all the same); no token: none in this tab
  state.canWrite = !!state.sid && !!state.token && (!c || c.scope === "write");
  $("message").disabled = $("send").disabled = $("job").disabled = $("tools").disabled = !state.canWrite;
  $("message").placeholder = state.canWrite
    ? "Type a message; every screen on this session sees the reply"
    : !state.sid ? "Press New session first"
    : !state.token ? "No token for this session in this tab: open the link you were given"
    : "This screen only watches (its link holds a watch token); open a collaborate link to type here";
  $("share").hidden = $("collaborate").hidden = !(state.sid && state.canWrite);
  controls();
  if (!c || c.scope !== "write") return;
  const link = (t) => `${location.pathname}#session=${state.sid}&token=${encodeURIComponent(t)}`;
  const [watchToken, writeToken] = await Promise.all([mint("watch"), mint("write")]);
  if (watchToken) $("share").href = link(watchToken);
  if (writeToken) $("collaborate").href = link(writeToken);
  const wait = Math.max(5, c.exp - 60 - Date.now() / 1000) * 1000;
  state.refreshTimer = setTimeout(async () => {
    const fresh = await mint("write");
    if (!fresh) return;
    state.token = fresh;  // the open stream ends at the old token's expiry; reconnects use this
    keepToken(state.sid, fresh);
    manageTokens();
  }, Math.min(wait, 2 ** 31 - 1));
}

function params() {
  const p = new URLSearchParams(location.hash.slice(1));
  return { sid: p.get("session"), token: p.get("token"), transport: p.get("transport") };
}

function setState(text, kind = text.split(" ")[0]) {
  const el = $("state");
  el.textContent = text;
  el.className = "state " + kind;
}

// Why a watch ended, in words: the client's reason is the API's ("401 token_missing no
// token: send Authorization: Bearer <token> or ?token="), which says nothing to a reader.
function inWords(reason) {
  const r = String(reason || "");
  if (state.sid && !state.token) return "this tab has no token for this session: open the watch or collaborate link you were given";
  if (/^401\b|token_missing/.test(r)) return "this tab has no token for this session: open the watch or collaborate link you were given";
  if (/token_expired|\b4401\b/.test(r)) return "this screen's token has expired: ask for a new link";
  if (/^403\b|token_/.test(r)) return "this screen's token was not accepted (another session's, or damaged): ask for a new link";
  if (/^410\b|session_deleted|\b4410\b/.test(r)) return "this session was deleted: press New session";
  if (/^400\b/.test(r)) return "this address names no valid session: press New session";
  return `stopped (${r})`;
}

// The counters of this screen's session: the current watcher's plus those of the ones
// before it (a switch of transport starts a new watcher and must not reset them).
function counters() {
  const w = state.watcher;
  const now = w ? w.stats : { frames: 0, duplicates: 0, gaps: 0, reconnects: 0 };
  const st = {};
  for (const k of Object.keys(state.carried)) st[k] = state.carried[k] + (now[k] || 0);
  $("offset").textContent = w && w.last !== null ? w.last : 0;
  $("frames").textContent = st.frames;
  $("dups").textContent = st.duplicates;
  $("problems").textContent = state.problems;  // skipped offsets, overlaps, bad merges, integrity
  $("gaps").textContent = st.gaps;
  $("reconnects").textContent = st.reconnects;
}

function turnEl(turn) {
  let t = state.turns.get(turn);
  if (!t) {
    const root = document.createElement("div");
    root.className = "turn";
    root.dataset.turn = turn;
    const user = document.createElement("div");
    user.className = "user";
    user.hidden = true;
    const parts = document.createElement("div");  // reasoning, tool calls, sources, data
    parts.className = "parts";
    const reply = document.createElement("div");
    reply.className = "assistant streaming";
    const footer = document.createElement("div");
    footer.className = "footer";
    root.append(user, parts, reply, footer);
    $("log").append(root);
    t = { root, user, parts, partEls: new Map(), reply, footer, engine: "", preferred: "",
          cached: null, prompt: null, cache: "", trimmed: 0 };
    state.turns.set(turn, t);
  }
  return t;
}

// A reply's parts (docs/PROTOCOL.md, "Parts"): reasoning collapsed, each tool call with
// its arguments as they stream and its result, sources as links, data parts as JSON.
function partEl(t, kind, id, make) {
  const key = `${kind}\n${id}`;
  let el = t.partEls.get(key);
  if (!el) { el = make(); t.partEls.set(key, el); t.parts.append(el); }
  return el;
}

function showPart(t, p, phase, text) {
  if (p.part === "reasoning") {
    const el = partEl(t, "reasoning", p.id, () => {
      const d = document.createElement("details");
      d.className = "reasoning";
      d.innerHTML = `<summary>${p.summary ? "Reasoning summary" : "Reasoning"}</summary><div class="body"></div>`;
      return d;
    });
    if (text) el.querySelector(".body").textContent += text;
  } else if (p.part === "tool-call" || p.part === "tool-result") {
    const el = partEl(t, "tool", p.id, () => {
      const d = document.createElement("div");
      d.className = "tool";
      d.innerHTML = `🔧 <b class="name"></b>(<code class="args"></code>) <span class="result"></span>`;
      return d;
    });
    if (p.name) el.querySelector(".name").textContent = p.name;
    if (p.part === "tool-call" && text) el.querySelector(".args").textContent += text;
    if (p.part === "tool-call" && phase === "end") el.classList.add("called");
    if (p.part === "tool-result") {
      el.querySelector(".result").textContent = `→ ${p.error ? "error: " : ""}${text}`;
      el.classList.toggle("failed", !!p.error);
    }
  } else if (p.part === "source") {
    let v = {};
    try { v = JSON.parse(text); } catch { /* shown as it came */ }
    const a = document.createElement("a");
    a.className = "source";
    a.href = typeof v.url === "string" && /^https?:/.test(v.url) ? v.url : "#";
    a.textContent = v.title || v.url || text;
    a.rel = "noopener noreferrer";
    a.target = "_blank";
    t.parts.append(a);
  } else if (p.part.startsWith("data-")) {
    const c = document.createElement("code");
    c.className = "data";
    c.textContent = `${p.part}: ${text}`;
    t.parts.append(c);
  }
}

function describe(t, extra) {
  const parts = [];
  if (t.engine) parts.push(`engine <b>${t.engine}</b>`);
  if (t.preferred && t.preferred !== t.engine) parts.push(`(ring preferred ${t.preferred}: spilled)`);
  if (t.cached !== null) {
    // cached of prompt tokens: a chat template's default system prompt alone is cached
    // on every turn, so "hit" says little without the share
    const of = t.prompt !== null ? ` of ${t.prompt}` : "";
    const cls = t.cached > 0 ? "hit" : "miss";
    parts.push(`<span class="${cls}">cached ${t.cached}${of} prompt tokens</span>`);
  } else if (t.cache === "unknown") {
    parts.push(`cache: not reported by the engine`);
  }
  if (t.trimmed > 0) parts.push(`${t.trimmed} oldest messages left out (engine context)`);
  if (extra) parts.push(extra);
  t.footer.innerHTML = parts.join(" · ");
}

// Stop while a turn generates, Regenerate on the last reply: on writing screens only.
function controls() {
  $("stop").hidden = !(state.canWrite && state.running !== null);
  $("regenerate").hidden = !(state.canWrite && state.running === null && state.lastDone !== null);
}

function dropTurnsFrom(turn) {  // a regenerate or an edit replaced them (meta.replaces)
  for (const [n, t] of state.turns) if (n >= turn) { t.root.remove(); state.turns.delete(n); }
}

function onFrame(f) {
  const m = f.meta || {};
  if (f.kind === "presence") {
    $("screens").textContent = String(m.screens ?? "?");
    return;
  }
  if (f.kind === "meta") {
    if (Number.isInteger(m.replaces)) dropTurnsFrom(m.replaces);
    state.running = f.turn;
    controls();
    const t = turnEl(f.turn);
    const msg = (m.message ?? m.user ?? "") + (m.message_truncated ? " …" : "");
    if (msg) { t.user.textContent = msg; t.user.hidden = false; }
    t.engine = m.engine || t.engine;
    t.preferred = m.preferred || t.preferred;
    if (typeof m.cached_tokens === "number") t.cached = m.cached_tokens;
    if (typeof m.prompt_tokens === "number") t.prompt = m.prompt_tokens;
    if (typeof m.trimmed_messages === "number") t.trimmed = m.trimmed_messages;
    describe(t, "generating…");
  } else if (f.kind === "token") {
    turnEl(f.turn).reply.textContent += f.text;
  } else if (f.kind === "part") {
    try {
      const p = framePart(m);
      showPart(turnEl(f.turn), p, p.phase, f.text || "");
    } catch { /* a part the client refuses: its problem is counted, nothing is shown */ }
  } else if (f.kind === "done") {
    const t = turnEl(f.turn);
    t.reply.classList.remove("streaming");
    if (m.finish_reason === "cancelled") t.reply.classList.add("stopped");
    if (state.running === f.turn) state.running = null;
    state.lastDone = f.turn;
    controls();
    t.engine = m.engine || t.engine;
    if (typeof m.cached_tokens === "number") t.cached = m.cached_tokens;
    if (typeof m.prompt_tokens === "number") t.prompt = m.prompt_tokens;
    t.cache = m.cache || t.cache;  // "hit" | "miss" | "unknown" (engine did not say)
    const ttft = m.ttft_ms !== undefined ? `TTFT ${Math.round(m.ttft_ms)} ms` : "";
    describe(t, [ttft, m.finish_reason ? `finish: ${m.finish_reason}` : ""].filter(Boolean).join(" · "));
  } else if (f.kind === "error") {
    const t = turnEl(f.turn);
    if (state.running === f.turn) state.running = null;
    controls();
    t.reply.classList.remove("streaming");
    t.reply.classList.add("error");
    describe(t, `<span class="gap">error: ${escapeHtml(f.text)}</span>`);
  } else if (f.kind === "gap") {
    const p = document.createElement("div");
    p.className = "gap";
    p.textContent = `⚠ ${f.text}`;
    $("log").append(p);
  } else if (f.kind === "reset") {
    // the session restarted (its keys expired) or was deleted: turn numbers start
    // again at 1, so the old transcript goes and the page says why
    state.turns.clear();
    state.running = state.lastDone = null;
    controls();
    $("log").innerHTML = "";
    const p = document.createElement("div");
    p.className = "gap";
    p.textContent = `⚠ ${f.text}`;
    $("log").append(p);
  }
  $("log").scrollTop = $("log").scrollHeight;
  counters();
}

function escapeHtml(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}

function onGap(g) {
  if (g.reason === "gap") return;  // the gap frame itself is shown by onFrame
  state.problems += 1;
  const p = document.createElement("div");
  p.className = "gap";
  p.textContent = `⚠ ${g.reason}: ${g.detail}${g.from !== null ? ` (offsets ${g.from}..${g.to})` : ""}`;
  $("log").append(p);
  counters();
}

function onState(s, info) {
  if (info.relay) $("relay").textContent = info.relay;
  if (s === "error") setState(inWords(info.reason), "closed");
  else setState(s === "reconnecting" ? `reconnecting (${info.reason})` : s);
  counters();
}

// `from` and `gen`: the last offset this page shows and its session generation (the
// client sends both on every reconnect; a session that restarted meanwhile answers with
// a reset frame, and the page starts its transcript again).
function connect(from = 0, gen = null) {
  if (state.watcher) {
    for (const k of Object.keys(state.carried)) state.carried[k] += state.watcher.stats[k] || 0;
    state.watcher.close();
  }
  state.watcher = null;
  if (!state.sid) return;
  state.watcher = watch(location.origin, state.sid, state.token, {
    transport: state.transport, from, gen, onFrame, onGap, onState,
    // a refused or expired token: a write-token page mints a fresh one; a watch link
    // cannot, and says so
    refreshToken: async () => {
      const c = claims(state.token || "");
      if (!c || c.scope !== "write") return null;  // the watch ends: onState says why in words
      const fresh = await mint("write");
      if (fresh) state.token = fresh;
      return fresh;
    },
  });
}

async function newSession() {
  const r = await fetch("/v1/sessions", { method: "POST" });
  const body = await r.json();
  if (!r.ok) { $("notice").textContent = `could not create a session: ${body.reason || r.status}`; return; }
  keepToken(body.session, body.token);  // the write token stays in this tab, not the address
  location.hash = `session=${body.session}`;
}

// The conversation so far, from the worker's store (a reload shows it at once), and the
// offset the watch goes on from: no gap and no duplicate with what the page shows.
async function restore() {
  try {
    const page = await loadMessages(location.origin, state.sid, state.token, { limit: 200 });
    for (const msg of page.messages) {
      if (msg.role === "tool") continue;  // a tool's result an agent sent back: not a reply
      const t = turnEl(msg.turn);
      if (msg.role === "user") { t.user.textContent = msg.text; t.user.hidden = false; continue; }
      t.reply.textContent = msg.text;
      for (const d of msg.parts || []) {  // a stored reply's parts, in order
        if (d.type !== "text") showPart(t, { part: d.type, id: d.id, name: d.name || "", summary: !!d.summary, error: !!d.error }, d.done === false ? "delta" : "end", d.text || "");
      }
      t.reply.classList.remove("streaming");
      if (msg.finish_reason === "cancelled") t.reply.classList.add("stopped");
      describe(t, msg.finish_reason ? `finish: ${msg.finish_reason}` : "");
      state.lastDone = msg.turn;
    }
    controls();
    return { from: page.resume_from, gen: page.gen };
  } catch (e) {
    return { from: 0, gen: null };  // the whole backlog then: slower, the same transcript
  }
}

async function stopTurn() {
  try {
    await cancel(location.origin, state.sid, state.token);
  } catch (e) {
    $("notice").textContent = `stop refused: ${e.status || ""} ${e.body ? e.body.reason : e.message}`;
  }
}

async function postTurn(body) {
  const key = crypto.randomUUID ? crypto.randomUUID() : String(Math.random()).slice(2);
  for (let attempt = 0; attempt < 3; attempt++) {
    try {
      const r = await fetch(`/v1/sessions/${state.sid}/turns`, {
        method: "POST",
        headers: { "Content-Type": "application/json", "Authorization": `Bearer ${state.token}`, "Idempotency-Key": key },
        body: JSON.stringify(body),
      });
      const out = await r.json().catch(() => ({}));
      if (r.status === 202) return true;
      const wait = r.headers.get("Retry-After");
      $("notice").textContent = `${r.status}: ${out.reason || out.error || "refused"}${wait ? ` (retry after ${wait}s)` : ""}`;
      return false;
    } catch (e) {
      $("notice").textContent = `network error, retrying with the same Idempotency-Key…`;
      await new Promise((res) => setTimeout(res, 500));
    }
  }
  return false;
}

// Two tools the "Tools" box offers the model with a turn (the turns API forwards them to
// the engine): its reply may then be tool calls, which every screen shows. The page runs
// no tool; an agent sends the results back (the Responses API, the AI SDK chat POST).
const DEMO_TOOLS = ["weather", "clock"].map((name) => ({
  type: "function",
  function: { name, parameters: { type: "object", properties: { query: { type: "string" } } } },
}));

function withTools(body) {
  return $("tools").checked ? { ...body, tools: DEMO_TOOLS } : body;
}

async function send(ev) {
  ev.preventDefault();
  const text = $("message").value.trim();
  if (!state.sid) { $("notice").textContent = "press New session first"; return; }
  if (!text || !state.canWrite) return;
  $("notice").textContent = "";
  if (await postTurn(withTools({ message: text }))) $("message").value = "";
}

async function regenerate() {
  $("notice").textContent = "";
  await postTurn(withTools({ regenerate: true }));
}

// An offline job: POST /v1/jobs (RabbitMQ), then poll its status; when done, the whole
// report also arrives on every screen of the session as one message.
async function submitJob() {
  const text = $("message").value.trim() || "Write a detailed case report of the last ward round.";
  if (!state.sid) return;
  const r = await fetch("/v1/jobs", {
    method: "POST",
    headers: { "Content-Type": "application/json", "Authorization": `Bearer ${state.token}` },
    body: JSON.stringify({ prompt: text, session: state.sid, max_tokens: 800 }),
  });
  const body = await r.json().catch(() => ({}));
  if (r.status !== 202) {
    $("notice").textContent = `job refused: ${r.status} ${body.reason || body.error || ""}`;
    return;
  }
  $("message").value = "";
  const row = document.createElement("div");
  row.className = "job";
  $("jobs").prepend(row);
  for (;;) {
    const g = await fetch(`/v1/jobs/${body.job}`, { headers: { "Authorization": `Bearer ${state.token}` } });
    const j = await g.json().catch(() => ({}));
    const progress = j.progress_tokens !== undefined ? `, ${j.progress_tokens} tokens so far` : "";
    row.textContent = `job ${body.job.slice(0, 8)}: ${j.status || g.status} (attempt ${j.attempts ?? "?"}${progress})`;
    if (j.status === "done") {
      row.textContent = `job ${body.job.slice(0, 8)}: done, ${j.tokens} tokens, ${j.chars} chars, sha256 ${String(j.sha256).slice(0, 12)}… on ${j.engine}; delivered on this session as one message`;
      return;
    }
    if (j.status === "failed" || !g.ok) { row.textContent += ` ${j.error || j.reason || ""}`; return; }
    await new Promise((res) => setTimeout(res, 500));
  }
}

function bar(inFlight, cap) {
  const pct = cap > 0 ? Math.min(100, (100 * inFlight) / cap) : 0;
  return `<div class="bar ${inFlight >= cap ? "full" : ""}"><div style="width:${pct}%"></div></div>`;
}

async function refreshPanel() {
  try {
    const r = await fetch("/api/stack");
    if (!r.ok) {  // behind a plain ingress (docker-compose): no view of the processes
      $("engines").tBodies[0].innerHTML =
        `<tr><td colspan="3">live panel: served by <code>python -m devstack demo</code> only</td></tr>`;
      return;
    }
    const s = await r.json();
    $("engines").tBodies[0].innerHTML = (s.engines || []).map((e) =>
      `<tr><td>${escapeHtml(e.id)}${e.healthy === false ? " (down)" : ""}</td><td>${e.in_flight} / ${e.cap}</td><td>${bar(e.in_flight, e.cap)}</td></tr>`).join("");
    $("engine-kind").textContent = s.mock_engines
      ? "Mock engines: the replies are made-up text from a simulated engine (python -m devstack demo --engine URL runs real ones)."
      : "";
    const seen = new Set();  // newest first: one row per ring point, its latest turn
    const latest = (s.placements || []).filter((p) => !seen.has(p.point) && seen.add(p.point));
    $("placements").tBodies[0].innerHTML = latest.slice(0, 12).map((p) =>
      `<tr><td><code>${escapeHtml(String(p.point))}</code></td><td>${escapeHtml(p.preferred)}</td><td>${escapeHtml(p.engine)}${p.spilled ? " (spill)" : ""}</td></tr>`).join("");
    $("procs").tBodies[0].innerHTML = (s.processes || []).map((p) =>
      `<tr><td>${escapeHtml(p.name)}</td><td>${p.pid}</td><td>${p.alive ? "running" : "stopped"}</td><td>${
        p.alive ? `<button class="kill" data-action="kill" data-name="${escapeHtml(p.name)}">kill -9</button>`
                : `<button data-action="restart" data-name="${escapeHtml(p.name)}">start</button>`}</td></tr>`).join("");
  } catch (e) { /* the panel is best effort */ }
}

// Process control needs the per-run token that `python -m devstack demo` prints to its terminal:
// opened as #control=..., it is kept for this tab and taken out of the address (the
// share link must not carry it); otherwise the first click asks for it.
const CONTROL = "tokenrelay-control";

// A tab that holds the control token says so (its buttons act), and refusals show under
// the buttons, not below the fold.
function controlBadge() { $("control-badge").hidden = !sessionStorage.getItem(CONTROL); }

function takeControlToken() {
  const p = new URLSearchParams(location.hash.slice(1));
  const token = p.get("control");
  controlBadge();
  if (!token) return;
  sessionStorage.setItem(CONTROL, token);
  controlBadge();
  p.delete("control");
  history.replaceState(null, "", location.pathname + location.search + (p.toString() ? `#${p}` : ""));
}

document.addEventListener("click", async (ev) => {
  const b = ev.target.closest("button[data-action]");
  if (!b) return;
  let token = sessionStorage.getItem(CONTROL);
  if (!token) {
    token = prompt("Control token (printed in the terminal running python -m devstack demo):");
    if (!token) return;
    sessionStorage.setItem(CONTROL, token.trim());
    controlBadge();
  }
  const r = await fetch(`/api/${b.dataset.action}/${b.dataset.name}`, {
    method: "POST", headers: { "X-Control-Token": sessionStorage.getItem(CONTROL) },
  });
  const body = await r.json().catch(() => ({}));
  $("control-notice").textContent = r.ok ? "" : `${b.dataset.action} ${b.dataset.name} refused: ${body.reason || r.status}`;
  if (r.status === 403) {
    sessionStorage.removeItem(CONTROL);
    controlBadge();
  }
  refreshPanel();
});

async function load() {
  takeControlToken();
  const p = params();
  state.sid = p.sid;
  state.token = p.token || (p.sid && sessionStorage.getItem(TOKEN + p.sid)) || null;
  if (p.sid && p.token) {  // a link's token: into this tab, out of the address bar
    keepToken(p.sid, p.token);
    const keep = new URLSearchParams(location.hash.slice(1));
    keep.delete("token");
    history.replaceState(null, "", `${location.pathname}${location.search}#${keep}`);
  }
  state.transport = p.transport === "ws" ? "ws" : $("transport").value;
  $("transport").value = state.transport;
  if (state.watcher) { state.watcher.close(); state.watcher = null; }  // another session
  state.problems = 0; state.turns.clear(); $("log").innerHTML = "";
  state.carried = { frames: 0, duplicates: 0, gaps: 0, reconnects: 0 };
  state.running = state.lastDone = null;
  $("sid").textContent = state.sid || "—";
  $("screens").textContent = "—";
  manageTokens();
  if (!state.sid) { setState("idle"); return; }
  const { from, gen } = await restore();
  connect(from, gen);
}

$("new-session").addEventListener("click", newSession);
$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", stopTurn);
$("regenerate").addEventListener("click", regenerate);
$("job").addEventListener("click", submitJob);
$("transport").addEventListener("change", () => {
  state.transport = $("transport").value;
  const w = state.watcher;
  connect(w && w.last !== null ? w.last : 0, w ? w.gen : null);  // resume there
});
window.addEventListener("hashchange", load);
load();
refreshPanel();
setInterval(refreshPanel, 1000);
