// A reply's parts in the browser client (pure, no network): the same digest as the
// Python producer (the vector of tests/unit/test_parts.py), the continuity check of the
// done frame's parts, the refusals, and the transcript rebuilding every part in order.
import { test } from "node:test";
import assert from "node:assert/strict";
import { Continuity, PartError, Parts, Transcript, framePart, partsDigest, sha256Hex } from "../tokenrelay.js";

const VECTOR = "bd42b564c61eee077aa47bb3bf4f131ca95cf2a85f60c8fb01f90d3a5c92efb1";
const frame = (offset, kind, text = "", meta = null) => ({ v: 1, session: "s", turn: 1, offset, kind, text, epoch: 1, ts: 0, meta: { ...(meta || {}), gen: "g" } });
const part = (offset, meta, text = "") => frame(offset, "part", text, meta);

function reply() {
  const frames = [
    frame(1, "meta", "", { message: "hi" }),
    part(2, { part: "reasoning", id: "r1", phase: "start" }),
    part(3, { part: "reasoning", id: "r1", phase: "delta" }, "Let me think"),
    part(4, { part: "reasoning", id: "r1", phase: "end" }),
    frame(5, "token", "Checking"),
    part(6, { part: "tool-call", id: "call_1", phase: "start", name: "weather" }),
    part(7, { part: "tool-call", id: "call_1", phase: "delta" }, '{"city":'),
    part(8, { part: "tool-call", id: "call_1", phase: "delta" }, '"Oslo"}'),
    part(9, { part: "tool-call", id: "call_1", phase: "end" }),
    part(10, { part: "tool-result", id: "call_1", name: "weather" }, '{"temp":4}'),
    frame(11, "token", " done"),
  ];
  const parts = new Parts();
  for (const f of frames) if (f.kind === "part") parts.apply(framePart(f.meta), f.text, f.offset);
  const text = "Checking done";
  frames.push(frame(12, "done", "", { chars: 13, sha256: sha256Hex(text), parts: parts.records.length, parts_sha256: partsDigest(parts.records), finish_reason: "stop" }));
  return { frames, parts };
}

test("the parts digest is the Python producer's", () => {
  const records = [
    { part: "reasoning", id: "r1", name: "", text: "hé", done: true, summary: true },
    { part: "tool-call", id: "c1", name: "f", text: '{"a":1}', done: true, summary: false },
  ];
  assert.equal(partsDigest(records), VECTOR);
});

test("a whole reply: no problem, every part rebuilt in order, stored as the worker stores it", () => {
  const { frames } = reply();
  const c = new Continuity(0);
  const t = new Transcript("s");
  for (const f of frames) {
    const { deliver, problems } = c.accept(f);
    assert.deepEqual(problems, []);
    if (deliver) t.apply(f);
  }
  const r = t.entries[1];
  assert.deepEqual(r.parts.records.map((p) => [p.part, p.id, p.text, p.done]), [
    ["reasoning", "r1", "Let me think", true], ["tool-call", "call_1", '{"city":"Oslo"}', true],
    ["tool-result", "call_1", '{"temp":4}', true],
  ]);
  assert.deepEqual(t.history()[1].parts.map((p) => p.type), ["reasoning", "text", "tool-call", "tool-result", "text"]);
  const loaded = new Transcript("s");
  loaded.load({ messages: [{ turn: 1, role: "assistant", text: r.text, parts: t.history()[1].parts }] });
  assert.deepEqual(loaded.entries[0].parts.records.map((p) => p.text), r.parts.records.map((p) => p.text));
});

test("a tampered argument fails the done frame's parts digest", () => {
  const { frames } = reply();
  frames[7] = part(8, { part: "tool-call", id: "call_1", phase: "delta" }, '"Rome"}');
  const c = new Continuity(0);
  const problems = frames.flatMap((f) => c.accept(f).problems);
  assert.deepEqual(problems.map((p) => [p.reason, p.detail]), [["integrity", "parts_sha256 differs"]]);
});

test("bad part frames are refused, not delivered, and change no transcript", () => {
  const { frames } = reply();
  const done = frames.pop();
  const bad = [
    part(12, { part: "tool-call", id: "ghost", phase: "delta" }, "{}"),  // never started
    part(13, { part: "video", id: "v" }, "{}"),  // an unknown type
    part(14, { part: "tool-call", id: "c2", phase: "start", name: "f" }),
    part(15, { part: "tool-call", id: "c2", phase: "delta" }, '{"a": '),
    part(16, { part: "tool-call", id: "c2", phase: "end" }),  // not JSON when complete
  ];
  const after = part(18, { part: "source", id: "late" }, '{"url":"https://x"}');
  const c = new Continuity(0);
  const t = new Transcript("s");
  const reasons = [];
  for (const f of [...frames, ...bad, { ...done, offset: 17, meta: { ...done.meta, parts: 4, parts_sha256: undefined } }, after]) {
    const { deliver, problems } = c.accept(f);
    reasons.push(...problems.map((p) => `${p.from}:${p.reason}`));
    if (deliver) t.apply(f);
  }
  assert.deepEqual(reasons, ["12:part", "13:part", "16:part", "18:part"]);
  const r = t.entries[1];
  assert.equal(r.finish, "stop");
  assert.deepEqual(r.parts.records.map((p) => [p.id, p.done]), [["r1", true], ["call_1", true], ["call_1", true], ["c2", false]]);
  t.apply(after);
  assert.ok(t.refused.at(-1).includes("after the reply ended"));
  assert.throws(() => framePart({ part: "tool-call", id: "c 1", phase: "start", name: "f" }), PartError);
});
