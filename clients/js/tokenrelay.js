// tokenrelay browser client: watch one session's frames from any relay, with resume.
// One dependency-free ES module (browsers, Node >= 20, Deno, Bun). See README.md.
//
//   import { watch } from "./tokenrelay.js";
//   const w = watch("https://chat.example", session, token, {
//     transport: "sse",               // or "ws"
//     from: 0,                        // last offset you already have; null/undefined = live
//     gen: "9f1c2a7d0b3e",            // the generation of that offset (meta.gen), if known
//     compact: true,                  // a late joiner: each finished turn as <= 3 frames
//     onFrame(frame) { ... },         // every frame once, in order (duplicates dropped)
//     onGap(gap) { ... },             // {reason, from, to, turn, detail}: text is missing or wrong
//     onState(state, info) { ... },   // connecting | live | reconnecting | closed | error
//     refreshToken: async () => "<new token>",  // on 401/403 (and WS refusals)
//   });
//   w.close();
//
// Pure parts (exported, tested with `node --test`): SseParser, Continuity, Transcript,
// backoffMs, sha256Hex, codePoints. The I/O shell is Watcher (fetch-streamed SSE or
// WebSocket) and the chat controls: cancel, loadMessages, deleteSession (any worker).
"use strict";

export const VERSION = "0.1.0";
export const KINDS = Object.freeze(["token", "part", "done", "error", "presence", "gap", "meta", "reset"]);

// ---------------------------------------------------------------- SHA-256 (sync, pure)

const K = new Uint32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
]);

/** Lowercase hex SHA-256 of the UTF-8 bytes of `text` (synchronous: no secure context needed). */
export function sha256Hex(text) {
  const data = new TextEncoder().encode(text);
  const bitLen = data.length * 8;
  const padded = new Uint8Array(((data.length + 9 + 63) >> 6) << 6);
  padded.set(data);
  padded[data.length] = 0x80;
  const view = new DataView(padded.buffer);
  view.setUint32(padded.length - 8, Math.floor(bitLen / 0x100000000));
  view.setUint32(padded.length - 4, bitLen >>> 0);
  const h = new Uint32Array([
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
  ]);
  const w = new Uint32Array(64);
  const rotr = (x, n) => (x >>> n) | (x << (32 - n));
  for (let off = 0; off < padded.length; off += 64) {
    for (let i = 0; i < 16; i++) w[i] = view.getUint32(off + 4 * i);
    for (let i = 16; i < 64; i++) {
      const s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >>> 3);
      const s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >>> 10);
      w[i] = (w[i - 16] + s0 + w[i - 7] + s1) >>> 0;
    }
    let [a, b, c, d, e, f, g, hh] = h;
    for (let i = 0; i < 64; i++) {
      const t1 = (hh + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i]) >>> 0;
      const t2 = ((rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c))) >>> 0;
      hh = g; g = f; f = e; e = (d + t1) >>> 0; d = c; c = b; b = a; a = (t1 + t2) >>> 0;
    }
    const add = [a, b, c, d, e, f, g, hh];
    for (let i = 0; i < 8; i++) h[i] = (h[i] + add[i]) >>> 0;
  }
  return Array.from(h, (x) => x.toString(16).padStart(8, "0")).join("");
}

/** Number of Unicode code points (what the done frame's `meta.chars` counts). */
export function codePoints(text) {
  let n = 0;
  for (const _ of text) n++;  // string iteration is by code point
  return n;
}

// ---------------------------------------------------------------- backoff (pure)

/** Delay before reconnect number `attempt` (0-based): exponential, capped, equal jitter
 * (half fixed, half random) so a relay's screens do not all come back at once. */
export function backoffMs(attempt, { baseMs = 250, maxMs = 10_000, random = Math.random } = {}) {
  const ceiling = Math.min(maxMs, baseMs * 2 ** Math.min(attempt, 30));
  return Math.round(ceiling / 2 + random() * (ceiling / 2));
}

// ---------------------------------------------------------------- SSE parser (pure)

/** Incremental text/event-stream parser (the WHATWG rules the relay's stream needs).
 * push(chunk) returns the events completed by it: {type: "event", event, data, id} |
 * {type: "retry", ms} | {type: "comment", text}. */
export class SseParser {
  constructor() {
    this.buf = "";
    this.reset();
  }

  reset() {
    this.data = [];
    this.event = "";
    this.id = null;
  }

  push(chunk) {
    this.buf += chunk;
    const out = [];
    let nl;
    while ((nl = this.buf.search(/\r\n|\r|\n/)) >= 0) {
      const line = this.buf.slice(0, nl);
      const width = this.buf.startsWith("\r\n", nl) ? 2 : 1;
      if (this.buf[nl] === "\r" && nl + 1 === this.buf.length) break;  // a CR may be half of CRLF
      this.buf = this.buf.slice(nl + width);
      this.line(line, out);
    }
    return out;
  }

  line(line, out) {
    if (line === "") {
      if (this.data.length) out.push({ type: "event", event: this.event || "message", data: this.data.join("\n"), id: this.id });
      this.reset();
      return;
    }
    if (line.startsWith(":")) { out.push({ type: "comment", text: line.slice(1).trimStart() }); return; }
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    let value = colon < 0 ? "" : line.slice(colon + 1);
    if (value.startsWith(" ")) value = value.slice(1);
    if (field === "data") this.data.push(value);
    else if (field === "event") this.event = value;
    else if (field === "id" && !value.includes("\0")) this.id = value;
    else if (field === "retry" && /^\d+$/.test(value)) out.push({ type: "retry", ms: Number(value) });
  }
}

// ---------------------------------------------------------------- continuity (pure)

/** The first offset a frame covers: its own, or for a merged frame (text, or one part's
 * deltas) `meta.from`. */
export function firstOffset(frame) {
  const m = frame.meta;
  if ((frame.kind === "token" || frame.kind === "part") && m && typeof m.merged === "number" && typeof m.from === "number") return m.from;
  return frame.offset;
}

// ---------------------------------------------------------------- parts (pure)
// A reply's parts besides its text (docs/PROTOCOL.md, "Parts"; the same rules as
// relay/protocol/parts.py): reasoning and tool calls stream (start, delta..., end), tool
// results, sources, usage and data-<name> parts are one frame whose text is JSON.

const STREAMED = new Set(["reasoning", "tool-call"]);
const WHOLE = new Set(["tool-result", "source", "usage"]);
const PART_ID = /^[!-~]{1,128}$/;
const DATA_PART = /^data-[A-Za-z0-9_-]{1,64}$/;

/** A part frame that would corrupt the transcript (the message says why). */
export class PartError extends Error {}

const isJson = (text) => { try { JSON.parse(text); return true; } catch { return false; } };

/** A part frame's meta read and checked: {part, id, phase, name, summary, error}. */
export function framePart(meta) {
  if (!meta || typeof meta !== "object") throw new PartError("a part frame carries its part in meta");
  const { part, id, phase } = meta;
  if (typeof part !== "string" || !(STREAMED.has(part) || WHOLE.has(part) || DATA_PART.test(part))) {
    throw new PartError(`unknown part type ${JSON.stringify(part)}`);
  }
  if (typeof id !== "string" || !PART_ID.test(id)) throw new PartError(`a part's id must be 1..128 printable ASCII characters, no space`);
  if (STREAMED.has(part) && !["start", "delta", "end"].includes(phase)) throw new PartError(`a ${part} part streams: phase start, delta or end`);
  if (!STREAMED.has(part) && phase !== undefined && phase !== null) throw new PartError(`a ${part} part is whole: it has no phase`);
  let name = meta.name ?? "";
  if ((part === "tool-call" && phase === "start") || part === "tool-result" || name) {
    if (typeof name !== "string" || !PART_ID.test(name)) throw new PartError("a tool's name must be 1..128 printable ASCII characters");
  }
  return { part, id, phase: STREAMED.has(part) ? phase : null, name, summary: meta.summary === true, error: meta.error === true };
}

/** One turn's parts in the order they started; `apply` refuses (PartError, nothing
 * changed) what Python's relay.protocol.parts.Parts refuses. `records`: [{part, id,
 * name, text, done, summary, error}]; `stored()`: text runs and parts in order. */
export class Parts {
  constructor() { this.records = []; this.closed = false; this.byKey = new Map(); this.order = []; }

  get(part, id) { return this.byKey.get(`${part}\n${id}`) || null; }

  text(delta) {
    const last = this.order[this.order.length - 1];
    if (last && last.text !== undefined && last.part === undefined) last.text += delta;
    else if (delta) this.order.push({ text: delta });
  }

  apply(ref, text, offset = 0) {
    if (this.closed) throw new PartError(`${ref.part} ${ref.id} after the turn ended`);
    const p = this.get(ref.part, ref.id);
    if (!STREAMED.has(ref.part)) {
      if (p) throw new PartError(`${ref.part} ${ref.id} was already written`);
      if (ref.part === "tool-result") {
        const call = this.get("tool-call", ref.id);
        if (!call || !call.done) throw new PartError(`tool-result for call ${ref.id}, which the turn has not finished`);
      }
      if (!isJson(text)) throw new PartError(`${ref.part} ${ref.id}: its value is not valid JSON`);
      return this.add({ part: ref.part, id: ref.id, name: ref.name, text, done: true, summary: false, error: ref.error, offset });
    }
    if (ref.phase === "start") {
      if (p) throw new PartError(`${ref.part} ${ref.id} was already started`);
      if (text) throw new PartError(`a ${ref.part} start carries no text; deltas do`);
      return this.add({ part: ref.part, id: ref.id, name: ref.name, text: "", done: false, summary: ref.summary, error: false, offset });
    }
    if (!p) throw new PartError(`${ref.phase} for ${ref.part} ${ref.id}, which was never started`);
    if (p.done) throw new PartError(`${ref.phase} for ${ref.part} ${ref.id}, which already ended`);
    if (ref.phase === "delta") { p.text += text; return p; }
    if (text) throw new PartError(`a ${ref.part} end carries no text; deltas do`);
    if (ref.part === "tool-call" && !isJson(p.text)) throw new PartError(`tool-call ${ref.id} (${p.name}): its arguments are not valid JSON`);
    p.done = true;
    return p;
  }

  close() { this.closed = true; }

  add(p) {
    if (this.records.length >= 4096) throw new PartError("more than 4096 parts in one turn");
    this.records.push(p);
    this.byKey.set(`${p.part}\n${p.id}`, p);
    this.order.push(p);
    return p;
  }

  stored() {
    if (!this.records.length) return [];
    return this.order.map((x) => {
      if (x.part === undefined) return { type: "text", text: x.text };
      const d = { type: x.part, id: x.id, text: x.text };
      if (x.name) d.name = x.name;
      if (x.summary) d.summary = true;
      if (x.error) d.error = true;
      if (!x.done) d.done = false;
      return d;
    });
  }

  static fromStored(stored) {
    const ps = new Parts();
    for (const d of Array.isArray(stored) ? stored : []) {
      if (!d || typeof d !== "object" || typeof (d.text ?? "") !== "string") continue;
      if (d.type === "text") { ps.text(d.text); continue; }
      if (typeof d.type !== "string" || !(STREAMED.has(d.type) || WHOLE.has(d.type) || DATA_PART.test(d.type))) continue;
      if (typeof d.id !== "string" || ps.get(d.type, d.id)) continue;
      ps.add({ part: d.type, id: d.id, name: d.name || "", text: d.text ?? "", done: d.done !== false, summary: d.summary === true, error: d.error === true, offset: 0 });
    }
    ps.closed = true;
    return ps;
  }
}

/** Hex SHA-256 over the parts in the order they started (docs/PROTOCOL.md, "Parts"). */
export function partsDigest(records) {
  const enc = new TextEncoder();
  let all = "";
  for (const p of records) {
    const name = p.summary ? "summary" : p.name || "";
    all += `${p.part}\x1f${p.id}\x1f${name}\x1f${enc.encode(p.text).length}\x1f${p.text}`;
  }
  return sha256Hex(all);
}

/** Checks one session's frames: in order, none twice, none missing, merged frames
 * well-formed, and each turn's text against its done frame's `chars` / `sha256`.
 *
 * accept(frame) -> {deliver: bool, problems: [{reason, from, to, turn, detail}]}.
 * Reasons: "gap" (the relay said frames are gone), "missing" (offsets skipped),
 * "overlap" (a merged frame covers offsets already delivered), "merge" (meta.merged
 * does not match meta.from..offset), "integrity" (the turn's text does not match its
 * done frame). A duplicate is not delivered and not a problem (`duplicates` counts it).
 * A `reset` frame (offset 0: the session restarted) is delivered and starts the offsets
 * and the turns again (docs/PROTOCOL.md, session generations). `gen` is the generation
 * of the frames delivered (their `meta.gen`, a reset's new one): sent with the resume
 * offset, so that a relay can tell an offset of an older generation. */
export class Continuity {
  constructor(from = null, gen = null) {
    this.last = from === undefined ? null : from;  // last offset delivered; null: none yet
    this.gen = gen || null;  // generation of the frames delivered; null: not known yet
    this.turns = new Map();  // turn -> {text, whole, parts}: seen since the turn's meta frame
    this.ended = new Set();  // turns whose terminal frame came (a part after it is refused)
    this.duplicates = 0;
    this.problems = 0;
  }

  accept(frame) {
    const out = this.check(frame);
    const gen = frame.meta && frame.meta.gen;
    if (out.deliver && typeof gen === "string" && gen) this.gen = gen;
    return out;
  }

  check(frame) {
    const problems = [];
    const first = firstOffset(frame);
    if (frame.kind === "gap") {
      const m = frame.meta || {};
      problems.push({ reason: "gap", from: m.from ?? null, to: m.to ?? frame.offset, turn: null, detail: frame.text || "" });
      for (const t of this.turns.values()) t.whole = false;
      if (this.last === null || frame.offset > this.last) this.last = frame.offset;
      return this.done(true, problems);
    }
    if (frame.kind === "presence") return this.done(true, problems);  // outside the offsets
    if (frame.kind === "reset") {  // a new generation: offsets start again at 1, turns at 1
      this.turns.clear();
      this.ended.clear();
      this.last = frame.offset;
      return this.done(true, problems);
    }
    if (this.last !== null && frame.offset <= this.last) {
      this.duplicates += 1;
      return { deliver: false, problems };
    }
    if ((frame.kind === "token" || frame.kind === "part") && frame.meta && typeof frame.meta.merged === "number") {
      if (frame.meta.merged !== frame.offset - first + 1) {
        problems.push({ reason: "merge", from: first, to: frame.offset, turn: frame.turn,
          detail: `meta.merged ${frame.meta.merged} but meta.from..offset covers ${frame.offset - first + 1}` });
      }
    }
    if (this.last !== null && first > this.last + 1) {
      problems.push({ reason: "missing", from: this.last + 1, to: first - 1, turn: frame.turn, detail: "offsets skipped" });
      for (const t of this.turns.values()) t.whole = false;
    } else if (this.last !== null && first <= this.last) {
      problems.push({ reason: "overlap", from: first, to: this.last, turn: frame.turn, detail: "merged frame covers offsets already delivered" });
      const t = this.turns.get(frame.turn);
      if (t) t.whole = false;
    }
    this.last = frame.offset;
    if (frame.kind === "part") {  // one that would corrupt its turn's parts is not delivered
      const refused = this.refusePart(frame);
      if (refused) { problems.push(refused); return this.done(false, problems); }
    }
    this.track(frame, problems);
    return this.done(true, problems);
  }

  refusePart(frame) {
    try {
      const ref = framePart(frame.meta);
      if (this.ended.has(frame.turn)) throw new PartError(`${ref.part} ${ref.id} after turn ${frame.turn} ended`);
      const t = this.turns.get(frame.turn);
      if (t && t.whole) t.parts.apply(ref, frame.text || "", frame.offset);
    } catch (e) {
      if (!(e instanceof PartError)) throw e;
      return { reason: "part", from: frame.offset, to: frame.offset, turn: frame.turn, detail: e.message };
    }
    return null;
  }

  track(frame, problems) {
    if (frame.kind === "meta") {
      this.turns.set(frame.turn, { text: "", whole: true, parts: new Parts() });
      this.ended.delete(frame.turn);
      while (this.turns.size > 8) this.turns.delete(this.turns.keys().next().value);
      return;
    }
    if (frame.kind === "done" || frame.kind === "error") {
      this.ended.add(frame.turn);
      while (this.ended.size > 8) this.ended.delete(this.ended.values().next().value);
    }
    const t = this.turns.get(frame.turn);
    if (!t) return;  // joined mid-turn: the turn's text cannot be checked
    if (frame.kind === "token") { t.text += frame.text || ""; return; }
    if (frame.kind !== "done" && frame.kind !== "error") return;
    this.turns.delete(frame.turn);
    if (frame.kind !== "done" || !t.whole) return;
    const problem = checkDone(frame, t.text, t.parts);
    if (problem) problems.push(problem);
  }

  done(deliver, problems) {
    this.problems += problems.length;
    return { deliver, problems };
  }
}

/** The done frame's integrity fields against the text received; null when they agree
 * or are absent. */
export function checkDone(frame, text, parts = null) {
  const m = frame.meta || {};
  const wrong = [];
  const records = parts ? parts.records : [];
  const count = typeof m.parts === "number" ? m.parts : 0;
  if (count !== records.length) wrong.push(`parts ${records.length} != ${count}`);
  if (typeof m.parts_sha256 === "string" && partsDigest(records) !== m.parts_sha256.toLowerCase()) wrong.push("parts_sha256 differs");
  if (typeof m.chars === "number" && codePoints(text) !== m.chars) wrong.push(`chars ${codePoints(text)} != ${m.chars}`);
  if (typeof m.sha256 === "string" && sha256Hex(text) !== m.sha256.toLowerCase()) wrong.push("sha256 differs");
  if (!wrong.length) return null;
  return { reason: "integrity", from: null, to: frame.offset, turn: frame.turn, detail: wrong.join("; ") };
}

/** A screen's conversation, built from the stored page and the frames (the same rules
 * as the Python client's relay/client/transcript.py). `load(page)` starts from the
 * worker's GET /v1/sessions/{sid}/messages; `apply(frame)` for every frame delivered
 * from the page's `resume_from`: a `meta` frame opens its turn (with `meta.replaces` = N
 * it first drops turns N and later: a regenerate or an edit replaced them), tokens
 * append, `done` ends it (`finish` = its finish_reason, "cancelled" for a stopped
 * reply), `error` ends it with `finish` "error", `reset` clears everything.
 * A `part` frame adds to or extends one of the reply's parts (`entry.parts`, a Parts:
 * `.records` in the order they started, `.stored()` text and parts in order); one that
 * does not fit changes nothing and its reason goes to `refused`.
 * `entries`: [{turn, role, text, id, finish, error, parts}]; `history()`: what the worker
 * stores (failed turns left out; `parts` for a reply with parts). */
export class Transcript {
  constructor(session) {
    this.session = session;
    this.entries = [];
    this.refused = [];  // why each refused part frame was refused
  }

  load(page) {
    this.entries = (page.messages || []).map((m) => ({
      turn: Number.isInteger(m.turn) ? m.turn : 0, role: m.role, text: m.text ?? "",
      id: m.id ?? null, finish: m.finish_reason ?? null, error: null, parts: Parts.fromStored(m.parts),
    }));
  }

  apply(frame) {
    const meta = frame.meta || {};
    if (frame.kind === "reset") { this.entries = []; return; }
    if (frame.kind === "meta" && frame.turn > 0) {
      if (Number.isInteger(meta.replaces)) this.entries = this.entries.filter((e) => e.turn < meta.replaces);
      if (!this.reply(frame.turn)) {
        this.entries.push({ turn: frame.turn, role: "user", text: String(meta.message ?? ""), id: meta.message_id ?? null, finish: null, error: null, parts: new Parts() });
        this.open(frame.turn);
      }
      return;
    }
    if (frame.kind === "token") {
      const r = this.reply(frame.turn) || this.open(frame.turn);
      r.text += frame.text || "";
      r.parts.text(frame.text || "");
      return;
    }
    if (frame.kind === "part") {
      const r = this.reply(frame.turn) || this.open(frame.turn);
      try {
        const ref = framePart(frame.meta);
        if (r.finish !== null) throw new PartError(`${ref.part} ${ref.id} after the reply ended`);
        r.parts.apply(ref, frame.text || "", frame.offset);
      } catch (e) {
        if (!(e instanceof PartError)) throw e;
        this.refused.push(e.message);
      }
      return;
    }
    if (frame.kind === "done") {
      const r = this.reply(frame.turn) || this.open(frame.turn);
      r.finish = meta.finish_reason || "stop";
      r.parts.close();
      return;
    }
    if (frame.kind === "error" && frame.turn > 0) {
      const r = this.reply(frame.turn) || this.open(frame.turn);
      r.finish = "error";
      r.error = frame.text || "the turn failed";
      r.parts.close();
    }
  }

  history() {
    const failed = new Set(this.entries.filter((e) => e.finish === "error").map((e) => e.turn));
    return this.entries.filter((e) => !failed.has(e.turn)).map((e) => {
      const m = { role: e.role, content: e.text, turn: e.turn };
      const parts = e.parts ? e.parts.stored() : [];
      if (parts.length) m.parts = parts;
      return m;
    });
  }

  reply(turn) {
    for (let i = this.entries.length - 1; i >= 0; i--) {
      const e = this.entries[i];
      if (e.turn === turn && e.role === "assistant") return e;
    }
    return null;
  }

  open(turn) {
    const e = { turn, role: "assistant", text: "", id: `${this.session}-${turn}`, finish: null, error: null, parts: new Parts() };
    this.entries.push(e);
    return e;
  }
}

// ---------------------------------------------------------------- the I/O shell

/** A worker's refusal of a chat control: `status`, `code` (its `error`), `body`. */
export class ControlRefused extends Error {
  constructor(status, body) {
    super(`${status} ${body.error || ""}: ${body.reason || ""}`);
    this.status = status;
    this.code = body.error || "";
    this.body = body;
  }
}

async function control(method, url, token, fetchImpl = globalThis.fetch) {
  const res = await fetchImpl(url, { method, headers: { Authorization: `Bearer ${token}` } });
  const text = res.status === 204 ? "" : await res.text();
  let body = {};
  try { body = text ? JSON.parse(text) : {}; } catch { body = { error: "bad_response", reason: text.slice(0, 200) }; }
  if (res.status >= 400) throw new ControlRefused(res.status, body);
  return body;
}

const sessionUrl = (workerUrl, session) => `${String(workerUrl).replace(/\/$/, "")}/v1/sessions/${encodeURIComponent(session)}`;

/** Stop `turn` of `session` (omit it: whichever turn runs or waits) on any worker:
 * {session, turn, status: "stopping" | "stopped", offset?}. The turn's `done` frame
 * (finish_reason "cancelled") reaches every screen. */
export function cancel(workerUrl, session, token, turn = null, { fetch: f } = {}) {
  const base = sessionUrl(workerUrl, session);
  return control("POST", turn == null ? `${base}/cancel` : `${base}/turns/${turn}/cancel`, token, f);
}

/** A page of the stored conversation: {messages, resume_from, gen, running, next_before};
 * watch from `resume_from` (with `gen`) for no gap and no duplicate. */
export function loadMessages(workerUrl, session, token, { limit, before, ui = false, fetch: f } = {}) {
  const q = new URLSearchParams();
  if (limit != null) q.set("limit", String(limit));
  if (before != null) q.set("before", String(before));
  if (ui) q.set("format", "ui");
  return control("GET", `${sessionUrl(workerUrl, session)}/messages?${q}`, token, f);
}

/** Delete the session: its turn stopped, its keys removed, its streams closed. */
export function deleteSession(workerUrl, session, token, { fetch: f } = {}) {
  return control("DELETE", sessionUrl(workerUrl, session), token, f);
}

const FATAL_STATUS = new Set([400, 404, 410]);  // bad id or offset, a deleted session: retrying cannot help
const AUTH_STATUS = new Set([401, 403]);
/** The subprotocols a WebSocket offers to carry `token` (a browser cannot set headers on
 * one): "tokenrelay", the one the relay answers with, and "tokenrelay.bearer.<token>". */
export function wsProtocols(token) {
  return ["tokenrelay", `tokenrelay.bearer.${token}`];
}

const FATAL_WS_CLOSE = new Set([1003, 1009, 4400, 4410]);  // the client broke the protocol; the session was deleted

class Fatal extends Error {}

/** Watch `session` on the relay(s) behind `baseUrl` (an ingress, or an array of relay
 * URLs: each (re)connect picks one at random). Returns a Watcher: `.close()`,
 * `.last` (resume point), `.relay`, `.stats`, `.closed` (a promise settled at the end). */
export function watch(baseUrl, session, token, options = {}) {
  return new Watcher(baseUrl, session, token, options);
}

export class Watcher {
  constructor(baseUrl, session, token, options = {}) {
    if (!/^[A-Za-z0-9_-]{1,64}$/.test(session || "")) throw new TypeError("session id must match [A-Za-z0-9_-]{1,64}");
    const bases = (Array.isArray(baseUrl) ? baseUrl : [baseUrl])
      .map((b) => String(b || (typeof location !== "undefined" ? location.origin : "")).replace(/\/+$/, ""));
    if (!bases.length) throw new TypeError("no relay URL");
    this.bases = bases;
    this.base = bases[0];  // the relay of the current connection
    this.session = session;
    this.token = token;
    this.opts = options;
    this.transport = options.transport === "ws" ? "ws" : "sse";
    this.check = new Continuity(options.from ?? null, options.gen ?? null);
    this.stats = { frames: 0, duplicates: 0, gaps: 0, problems: 0, reconnects: 0 };
    this.relay = null;
    this.state = "idle";
    this.attempt = 0;
    this.retryBaseMs = options.backoff?.baseMs ?? 250;
    this.stopped = false;
    this.timer = null;
    this.abort = null;
    this.ws = null;
    this.conn = 0;  // bumped by every connect and teardown: late events of old ones are ignored
    this.closed = new Promise((resolve) => { this.resolveClosed = resolve; });
    this.connect();
  }

  get last() { return this.check.last; }

  get gen() { return this.check.gen; }  // the generation of `last`, sent with it

  close() {
    if (this.stopped) return;
    this.teardown();
    this.finish("closed", { reason: "closed by the page" });
  }

  // -- states ------------------------------------------------------------------------

  setState(state, info = {}) {
    this.state = state;
    this.opts.onState?.(state, { relay: this.relay, ...info });
  }

  finish(state, info) {
    this.stopped = true;
    this.setState(state, info);
    this.resolveClosed({ state, ...info });
  }

  teardown() {
    this.conn += 1;
    clearTimeout(this.timer);
    this.timer = null;
    if (this.abort) { this.abort.abort(); this.abort = null; }
    if (this.ws) { const ws = this.ws; this.ws = null; ws.onclose = ws.onmessage = ws.onerror = null; try { ws.close(1000); } catch { /* already closed */ } }
  }

  retry(why, hintMs = null) {
    if (this.stopped) return;
    this.teardown();
    const delay = hintMs ?? backoffMs(this.attempt, { baseMs: this.retryBaseMs, maxMs: this.opts.backoff?.maxMs ?? 10_000 });
    this.attempt += 1;
    this.stats.reconnects += 1;
    this.setState("reconnecting", { reason: why, delayMs: delay, attempt: this.attempt });
    this.timer = setTimeout(() => this.connect(), delay);
  }

  async authFailed(why) {
    if (!this.opts.refreshToken) throw new Fatal(why);
    const fresh = await this.opts.refreshToken(why);
    if (!fresh) throw new Fatal(`${why} (refreshToken gave no token)`);
    this.token = fresh;
  }

  // -- frames ------------------------------------------------------------------------

  hello(msg) {
    this.relay = msg.relay ?? null;
    this.attempt = 0;
    this.setState("live", { from: msg.from ?? null });
  }

  frame(raw) {
    let frame;
    try { frame = typeof raw === "string" ? JSON.parse(raw) : raw; } catch { return; }
    if (!frame || typeof frame.kind !== "string" || typeof frame.offset !== "number") return;
    const { deliver, problems } = this.check.accept(frame);
    this.stats.duplicates = this.check.duplicates;
    if (frame.kind === "gap") this.stats.gaps += 1;
    this.stats.problems = this.check.problems;
    if (deliver) { this.stats.frames += 1; this.opts.onFrame?.(frame); }
    for (const p of problems) this.opts.onGap?.({ ...p, frame });
  }

  // -- transports --------------------------------------------------------------------

  url(path, query) {
    const q = new URLSearchParams(query);
    const url = `${this.base}/v1/sessions/${encodeURIComponent(this.session)}/${path}?${q}`;
    return url;
  }

  connect() {
    if (this.stopped) return;
    const conn = ++this.conn;
    this.base = this.bases[Math.floor(Math.random() * this.bases.length)];  // any relay will do
    this.setState("connecting", { attempt: this.attempt });
    const run = this.transport === "ws" ? this.connectWs(conn) : this.connectSse(conn);
    run.catch((err) => {
      if (this.stopped || conn !== this.conn) return;
      if (err instanceof Fatal) { this.teardown(); this.finish("error", { reason: err.message }); return; }
      this.retry(err?.message || String(err));
    });
  }

  async connectSse(conn) {
    const abort = new AbortController();
    this.abort = abort;
    const headers = { Accept: "text/event-stream" };
    if (this.token) headers.Authorization = `Bearer ${this.token}`;
    if (this.check.last !== null) headers["Last-Event-ID"] = String(this.check.last);
    const doFetch = this.opts.fetch || globalThis.fetch;
    if (typeof doFetch !== "function") throw new Fatal("no fetch in this runtime: pass options.fetch");
    const query = this.check.gen ? { gen: this.check.gen } : {};
    if (this.opts.compact) query.compact = "1";
    const resp = await doFetch(this.url("events", query), { headers, signal: abort.signal });
    if (conn !== this.conn) return;
    if (!resp.ok) {
      const body = await resp.json().catch(() => ({}));
      const why = `${resp.status} ${body.error || ""} ${body.reason || ""}`.trim();
      if (FATAL_STATUS.has(resp.status)) throw new Fatal(why);
      if (AUTH_STATUS.has(resp.status)) {
        await this.authFailed(why);
        if (conn === this.conn) this.retry(why);  // backoff as usual: a failing hook must not spin
        return;
      }
      const after = Number(resp.headers.get("Retry-After"));
      this.retry(why, Number.isFinite(after) && after > 0 ? after * 1000 : null);
      return;
    }
    const parser = new SseParser();
    const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
    let goodbye = "stream ended";
    for (;;) {
      const { value, done } = await reader.read();
      if (done || conn !== this.conn) break;
      for (const ev of parser.push(value)) {
        if (ev.type === "retry") this.retryBaseMs = Math.max(50, ev.ms);
        else if (ev.type === "comment" && ev.text.startsWith("close ")) goodbye = ev.text.slice(6);
        else if (ev.type === "event" && ev.event === "hello") this.hello(JSON.parse(ev.data));
        else if (ev.type === "event") this.frame(ev.data);
        if (conn !== this.conn) return;  // closed from a callback
      }
    }
    if (conn === this.conn) this.retry(goodbye);
  }

  async connectWs(conn) {
    const WS = this.opts.WebSocket || globalThis.WebSocket;
    if (typeof WS !== "function") throw new Fatal("no WebSocket in this runtime: pass options.WebSocket");
    const query = {};
    if (this.check.last !== null) query.from = String(this.check.last);
    if (this.check.gen) query.gen = this.check.gen;
    if (this.opts.compact) query.compact = "1";
    const url = this.url("ws", query).replace(/^http/, "ws");
    // The token goes as a subprotocol, never in the URL (a URL ends up in logs and in the
    // browser's console lines); the relay answers with "tokenrelay", never the token.
    const ws = this.token ? new WS(url, wsProtocols(this.token)) : new WS(url);
    this.ws = ws;
    let greeted = false;
    ws.onmessage = (ev) => {
      if (conn !== this.conn) return;
      const msg = JSON.parse(ev.data);
      if (msg.type === "hello") { greeted = true; this.hello(msg); } else this.frame(msg);
    };
    ws.onclose = (ev) => {
      if (conn !== this.conn) return;
      this.ws = null;
      const why = `ws close ${ev.code}${ev.reason ? " " + ev.reason : ""}`;
      if (FATAL_WS_CLOSE.has(ev.code)) { this.finish("error", { reason: why, code: ev.code }); return; }
      if (!greeted && this.opts.refreshToken) {
        // A refused handshake: the browser hides the status, so a refusal for the
        // token looks like any other; ask for a fresh token before the next try.
        this.authFailed(why).then(() => { if (conn === this.conn) this.retry(why); }, (err) => {
          if (!this.stopped && conn === this.conn) this.finish("error", { reason: err.message });
        });
        return;
      }
      this.retry(why);
    };
  }
}
