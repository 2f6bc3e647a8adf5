// The client's pure parts under Node's built-in test runner (no network).
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHash } from "node:crypto";
import { Continuity, SseParser, Transcript, backoffMs, checkDone, codePoints, firstOffset, sha256Hex } from "../tokenrelay.js";

const frame = (offset, kind, extra = {}) => ({ v: 1, session: "s", turn: 1, offset, kind, text: "", epoch: 1, ts: 0, meta: null, ...extra });
const node256 = (s) => createHash("sha256").update(Buffer.from(s, "utf8")).digest("hex");

test("sha256Hex matches node:crypto on ASCII, multi-byte, astral and block-boundary inputs", () => {
  const inputs = ["", "abc", "héllo wörld", "日本語のテキスト", "emoji 🙂🚀 and 𝄞", "x".repeat(55), "x".repeat(56), "y".repeat(64), "z".repeat(1000)];
  for (const s of inputs) assert.equal(sha256Hex(s), node256(s), JSON.stringify(s.slice(0, 20)));
  assert.equal(sha256Hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
});

test("codePoints counts code points, not UTF-16 units", () => {
  assert.equal(codePoints(""), 0);
  assert.equal(codePoints("abc"), 3);
  assert.equal(codePoints("🙂🚀"), 2);
  assert.equal("🙂🚀".length, 4);
});

test("backoffMs grows, is capped, and is jittered within [ceiling/2, ceiling]", () => {
  assert.equal(backoffMs(0, { baseMs: 100, random: () => 0 }), 50);
  assert.equal(backoffMs(0, { baseMs: 100, random: () => 1 }), 100);
  assert.equal(backoffMs(3, { baseMs: 100, random: () => 1 }), 800);
  assert.equal(backoffMs(50, { baseMs: 100, maxMs: 5000, random: () => 1 }), 5000);
  const seen = new Set(Array.from({ length: 50 }, () => backoffMs(2, { baseMs: 100 })));
  for (const d of seen) assert.ok(d >= 200 && d <= 400, String(d));
  assert.ok(seen.size > 5, "jittered");
});

test("SseParser: events split across chunks, CRLF, comments, retry, multi-line data", () => {
  const p = new SseParser();
  const got = [];
  const text = "retry: 1000\r\nevent: hello\r\ndata: {\"type\":\"hello\"}\r\n\r\nid: 7\nevent: token\ndata: {\"a\":\ndata: 1}\n\n: heartbeat\n\n: close relay_shutdown the relay is restarting; reconnect\n\n";
  for (let i = 0; i < text.length; i += 3) got.push(...p.push(text.slice(i, i + 3)));
  assert.deepEqual(got, [
    { type: "retry", ms: 1000 },
    { type: "event", event: "hello", data: "{\"type\":\"hello\"}", id: null },
    { type: "event", event: "token", data: "{\"a\":\n1}", id: "7" },
    { type: "comment", text: "heartbeat" },
    { type: "comment", text: "close relay_shutdown the relay is restarting; reconnect" },
  ]);
});

test("Continuity: in order delivers, duplicates are dropped, holes are reported", () => {
  const c = new Continuity(0);
  assert.deepEqual(c.accept(frame(1, "meta")), { deliver: true, problems: [] });
  assert.equal(c.accept(frame(2, "token", { text: "a" })).deliver, true);
  assert.equal(c.accept(frame(2, "token", { text: "a" })).deliver, false);
  assert.equal(c.duplicates, 1);
  const r = c.accept(frame(5, "token", { text: "b" }));
  assert.equal(r.deliver, true);
  assert.deepEqual(r.problems.map((p) => [p.reason, p.from, p.to]), [["missing", 3, 4]]);
  assert.equal(c.last, 5);
});

test("Continuity: a reset frame is delivered and the new generation starts again at 1", () => {
  const c = new Continuity(0);
  for (const f of [frame(1, "meta"), frame(2, "token", { text: "old" }), frame(3, "done")]) c.accept(f);
  const reset = frame(0, "reset", { turn: 0, epoch: 0, meta: { gen: "g2", previous_gen: "g1", code: "session_reset" } });
  assert.deepEqual(c.accept(reset), { deliver: true, problems: [] });
  assert.equal(c.last, 0);
  assert.equal(c.accept(frame(1, "meta")).deliver, true);  // not a duplicate of the old offset 1
  assert.equal(c.accept(frame(2, "token", { text: "new" })).deliver, true);
  assert.equal(c.duplicates, 0);
});

test("Continuity: live start (from null) accepts any first offset", () => {
  const c = new Continuity(null);
  assert.deepEqual(c.accept(frame(40, "token", { text: "x" })).problems, []);
  assert.equal(c.last, 40);
});

test("Continuity: merged frames cover meta.from..offset; a wrong count or an overlap is reported", () => {
  const c = new Continuity(0);
  c.accept(frame(1, "meta"));
  const merged = frame(4, "token", { text: "abc", meta: { merged: 3, from: 2 } });
  assert.equal(firstOffset(merged), 2);
  assert.deepEqual(c.accept(merged).problems, []);
  const bad = c.accept(frame(6, "token", { text: "de", meta: { merged: 5, from: 5 } }));
  assert.deepEqual(bad.problems.map((p) => p.reason), ["merge"]);
  const overlap = c.accept(frame(8, "token", { text: "f", meta: { merged: 3, from: 6 } }));
  assert.deepEqual(overlap.problems.map((p) => p.reason), ["overlap"]);
});

test("Continuity: a gap frame is delivered, reported with its range, and moves the resume point", () => {
  const c = new Continuity(0);
  const gap = frame(9, "gap", { turn: 0, text: "frames 1..9 are no longer in the backlog", meta: { from: 1, to: 9 } });
  const r = c.accept(gap);
  assert.equal(r.deliver, true);
  assert.deepEqual(r.problems.map((p) => [p.reason, p.from, p.to]), [["gap", 1, 9]]);
  assert.equal(c.last, 9);
});

function turn(text, doneMeta) {
  const c = new Continuity(0);
  const problems = [];
  const frames = [frame(1, "meta")];
  const pieces = [...text];
  pieces.forEach((p, i) => frames.push(frame(2 + i, "token", { text: p })));
  frames.push(frame(2 + pieces.length, "done", { meta: doneMeta }));
  for (const f of frames) problems.push(...c.accept(f).problems);
  return problems;
}

test("done frame integrity: correct chars and sha256 pass, wrong ones are reported", () => {
  const text = "Hello, 世界 🙂!";
  assert.deepEqual(turn(text, { tokens: 3, chars: codePoints(text), sha256: node256(text) }), []);
  assert.deepEqual(turn(text, { tokens: 3 }), [], "absent fields: no check");
  const wrongChars = turn(text, { chars: codePoints(text) + 1, sha256: node256(text) });
  assert.deepEqual(wrongChars.map((p) => p.reason), ["integrity"]);
  assert.match(wrongChars[0].detail, /chars/);
  const wrongHash = turn(text, { chars: codePoints(text), sha256: node256(text + "x") });
  assert.deepEqual(wrongHash.map((p) => p.reason), ["integrity"]);
  assert.match(wrongHash[0].detail, /sha256/);
  assert.equal(checkDone(frame(9, "done", { meta: { sha256: node256("ab").toUpperCase() } }), "ab"), null);
});

test("done frame integrity is not checked for a turn joined mid-way or broken by a hole", () => {
  const c = new Continuity(null);
  assert.deepEqual(c.accept(frame(5, "token", { text: "tail" })).problems, []);
  assert.deepEqual(c.accept(frame(6, "done", { meta: { chars: 999, sha256: "00" } })).problems, []);
  const d = new Continuity(0);
  d.accept(frame(1, "meta"));
  d.accept(frame(2, "token", { text: "a" }));
  assert.deepEqual(d.accept(frame(4, "token", { text: "c" })).problems.map((p) => p.reason), ["missing"]);
  assert.deepEqual(d.accept(frame(5, "done", { meta: { chars: 3, sha256: node256("abc") } })).problems, []);
});

test("a runtime without WebSocket ends the watch in state error instead of retrying", async () => {
  const { watch } = await import("../tokenrelay.js");
  const states = [];
  // Not a constructor (as where a runtime has none; Node 22 has a global one).
  const w = watch("http://127.0.0.1:9", "s1", "t", { transport: "ws", WebSocket: {}, onState: (s) => states.push(s) });
  const outcome = await w.closed;
  assert.equal(outcome.state, "error");
  assert.match(outcome.reason, /no WebSocket/);
  assert.deepEqual(states, ["connecting", "error"]);
});

test("Continuity keeps the generation of what it delivered: any frame's meta.gen, a reset's new one", () => {
  const c = new Continuity(0, "g0");
  assert.equal(c.gen, "g0");
  c.accept(frame(1, "meta", { meta: { gen: "g1" } }));
  assert.equal(c.gen, "g1");
  c.accept(frame(1, "meta", { meta: { gen: "gX" } }));  // a duplicate: not delivered, not taken
  assert.equal(c.gen, "g1");
  c.accept(frame(2, "token", { text: "a" }));  // no meta: the generation stays
  assert.equal(c.gen, "g1");
  c.accept(frame(0, "reset", { turn: 0, epoch: 0, meta: { gen: "g2", previous_gen: "g1", code: "session_reset" } }));
  assert.deepEqual([c.last, c.gen], [0, "g2"]);
});

test("every reconnect sends the generation it knows with its offset (SSE query gen, WebSocket gen)", async () => {
  const { watch } = await import("../tokenrelay.js");
  const sse = (frames) => new Response("event: hello\ndata: {\"type\":\"hello\",\"relay\":\"r\"}\n\n" +
    frames.map((f) => `id: ${f.offset}\nevent: ${f.kind}\ndata: ${JSON.stringify(f)}\n\n`).join(""), { status: 200 });
  const asked = [];
  let calls = 0;
  const w = watch("http://relay.test", "s1", "t", {
    from: 0,
    backoff: { baseMs: 1, maxMs: 2 },
    fetch: async (url, init) => {
      asked.push([new URL(url).searchParams.get("gen"), init.headers["Last-Event-ID"]]);
      calls += 1;
      if (calls === 1) return sse([frame(1, "meta", { meta: { gen: "g1" } }), frame(2, "token", { text: "a", meta: { gen: "g1" } })]);
      if (calls === 2) return sse([frame(0, "reset", { turn: 0, epoch: 0, meta: { gen: "g2", previous_gen: "g1", code: "session_reset" } })]);
      w.close();
      return sse([]);
    },
  });
  await w.closed;
  assert.deepEqual(asked, [[null, "0"], ["g1", "2"], ["g2", "0"]]);
  // and over a WebSocket: the URL of the first connect carries from and gen given as options
  const urls = [];
  class FakeWs { constructor(url) { urls.push(url); setTimeout(() => w2.close(), 0); } close() {} }
  const w2 = watch("http://relay.test", "s1", "t", { transport: "ws", from: 7, gen: "g9", WebSocket: FakeWs });
  await w2.closed;
  const q = new URL(urls[0]).searchParams;
  assert.deepEqual([q.get("from"), q.get("gen")], ["7", "g9"]);
});

test("a WebSocket carries its token as a subprotocol, never in its URL", async () => {
  const { watch, wsProtocols } = await import("../tokenrelay.js");
  const opened = [];
  class FakeWs { constructor(url, protocols) { opened.push([url, protocols]); setTimeout(() => w.close(), 0); } close() {} }
  const w = watch("http://relay.test", "s1", "secret.jwt.sig", { transport: "ws", WebSocket: FakeWs });
  await w.closed;
  const [url, protocols] = opened[0];
  assert.ok(!url.includes("secret"), url);
  assert.equal(new URL(url).searchParams.get("token"), null);
  assert.deepEqual(protocols, ["tokenrelay", "tokenrelay.bearer.secret.jwt.sig"]);
  assert.deepEqual(protocols, wsProtocols("secret.jwt.sig"));
});

test("Transcript: replaces drops the replaced turns, a cancelled done marks the reply, errors leave the history", () => {
  const f = (offset, turn, kind, text = "", meta = null) => ({ v: 1, session: "s", turn, offset, kind, text, epoch: 1, ts: 0, meta });
  const t = new Transcript("s");
  t.load({ messages: [
    { id: "u1", turn: 1, role: "user", text: "hi", finish_reason: null },
    { id: "s-1", turn: 1, role: "assistant", text: "hello", finish_reason: "stop" },
  ] });
  for (const fr of [
    f(4, 2, "meta", "", { message: "more", message_id: "u2" }), f(5, 2, "token", "ab"), f(6, 2, "token", "c"),
    f(7, 2, "done", "", { finish_reason: "cancelled" }),
    f(8, 3, "meta", "", { message: "x" }), f(9, 3, "error", "engine down"),
    f(10, 4, "meta", "", { message: "hi again", replaces: 1 }), f(11, 4, "token", "yo"), f(12, 4, "done", "", { finish_reason: "stop" }),
  ]) t.apply(fr);
  assert.deepEqual(t.history(), [{ role: "user", content: "hi again", turn: 4 }, { role: "assistant", content: "yo", turn: 4 }]);
  const t2 = new Transcript("s");
  for (const fr of [f(4, 2, "meta", "", { message: "more" }), f(5, 2, "token", "ab"), f(7, 2, "done", "", { finish_reason: "cancelled" })]) t2.apply(fr);
  assert.equal(t2.entries[1].finish, "cancelled");
  assert.equal(t2.entries[1].text, "ab");
  assert.equal(t2.entries[1].id, "s-2");
  t2.apply({ ...f(0, 0, "reset"), meta: { code: "session_reset" } });
  assert.deepEqual(t2.entries, []);
});
