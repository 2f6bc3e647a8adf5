// The client's I/O shell over SSE against a running stack (Node's fetch). Skips without
// TOKENRELAY_BASE (tests/e2e/test_js_client.py sets it to a live front door).
import { afterEach, test } from "node:test";
import assert from "node:assert/strict";
import { watch } from "../tokenrelay.js";

const BASE = process.env.TOKENRELAY_BASE;
const skip = BASE ? false : "TOKENRELAY_BASE is not set (run through tests/e2e/test_js_client.py)";

async function session() {
  const r = await fetch(`${BASE}/v1/sessions`, { method: "POST" });
  assert.equal(r.status, 201);
  return r.json();
}

async function post(s, message) {
  const r = await fetch(`${BASE}/v1/sessions/${s.session}/turns`, {
    method: "POST",
    headers: { "Content-Type": "application/json", Authorization: `Bearer ${s.token}` },
    body: JSON.stringify({ message }),
  });
  const text = await r.text();
  assert.equal(r.status, 202, text);
  return JSON.parse(text);
}

const open = new Set();  // every watch is closed after each test, even a failed one
afterEach(() => { for (const w of open) w.close(); open.clear(); });

/** Watch until the turn's done frame; resolves with what was seen. */
function collect(s, token, opts = {}) {
  const seen = { frames: [], states: [], gaps: [], refreshed: [] };
  let finish;
  const ended = new Promise((k) => { finish = k; });
  const w = watch(BASE, s.session, token, {
    transport: "sse",
    ...opts,
    onFrame(f) {
      if (f.kind === "presence") return;  // screen counts: outside the session's offsets
      seen.frames.push(f);
      if (f.kind === "done" || f.kind === "error") finish();
    },
    onGap(g) { seen.gaps.push(g); },
    onState(state, info) { seen.states.push([state, info.reason ?? ""]); },
  });
  open.add(w);
  return { w, seen, ended };
}

test("a forged token is refreshed through the hook, then the turn streams in order", { skip, timeout: 60_000 }, async () => {
  const s = await session();
  const { w, seen, ended } = collect(s, "forged.token", {
    from: 0,
    refreshToken: async (why) => { seen.refreshed.push(why); return s.token; },
  });
  const { turn } = await post(s, "hello there");
  await ended;
  w.close();
  const outcome = await w.closed;
  assert.equal(outcome.state, "closed");
  assert.equal(seen.refreshed.length, 1);
  assert.match(seen.refreshed[0], /403 token_invalid/);
  assert.deepEqual(seen.frames.map((f) => f.offset), seen.frames.map((_, i) => i + 1));
  assert.equal(seen.frames.at(-1).kind, "done");
  assert.equal(seen.frames.at(-1).turn, turn);
  assert.deepEqual(seen.gaps, []);
  assert.ok(seen.states.some(([st]) => st === "live"));
  assert.equal(seen.states.at(-1)[0], "closed");
});

test("a refused token without a hook, and a bad offset, end in state error with the reason", { skip, timeout: 30_000 }, async () => {
  const s = await session();
  const forged = collect(s, "forged.token");
  assert.deepEqual(await forged.w.closed, { state: "error", reason: "403 token_invalid " + (await reason(s, "forged.token")) });
  const bad = collect(s, s.token, { from: -5 });
  const outcome = await bad.w.closed;
  assert.equal(outcome.state, "error");
  assert.match(outcome.reason, /^400 invalid_offset/);
});

async function reason(s, token) {
  const r = await fetch(`${BASE}/v1/sessions/${s.session}/events`, { headers: { Authorization: `Bearer ${token}` } });
  return (await r.json()).reason;
}

test("resume from an offset: exactly the frames after it, as first delivered", { skip, timeout: 60_000 }, async () => {
  const s = await session();
  const first = collect(s, s.token, { from: 0 });
  await post(s, "one");
  await first.ended;
  first.w.close();
  assert.equal(first.w.last, first.seen.frames.length);
  const second = collect(s, s.token, { from: 2 });
  await second.ended;
  second.w.close();
  assert.deepEqual(second.seen.frames, first.seen.frames.slice(2));
  assert.equal(second.w.stats.duplicates, 0);
  assert.deepEqual(second.seen.gaps, []);
});
