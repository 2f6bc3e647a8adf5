// WebSocket mode on Node (TOKENRELAY_BASE: a live front door, tests/e2e/test_js_client.py).
// The client uses options.WebSocket, else the runtime's global one: Node >= 22 has it;
// Node 20 has none unless started with --experimental-websocket, so there an app passes
// one in (the `ws` package's, or undici's). Both paths are checked here: without any,
// one clear error; with the runtime's, a whole turn.
import { test } from "node:test";
import assert from "node:assert/strict";
import { watch } from "../tokenrelay.js";

const BASE = process.env.TOKENRELAY_BASE;
const skip = BASE ? false : "TOKENRELAY_BASE is not set (run through tests/e2e/test_js_client.py)";
const NativeWS = globalThis.WebSocket;

async function session() {
  const r = await fetch(`${BASE}/v1/sessions`, { method: "POST" });
  assert.equal(r.status, 201);
  return r.json();
}

test("no WebSocket in the runtime and none passed: state error, saying to pass one", { skip, timeout: 30_000 }, async () => {
  const s = await session();
  delete globalThis.WebSocket;
  try {
    const w = watch(BASE, s.session, s.token, { transport: "ws", from: 0 });
    const outcome = await w.closed;
    assert.equal(outcome.state, "error");
    assert.match(outcome.reason, /pass options\.WebSocket/);
  } finally {
    if (NativeWS) globalThis.WebSocket = NativeWS;
  }
});

test("a WebSocket passed in (options.WebSocket): the turn streams to its done frame", { skip, timeout: 60_000 }, async () => {
  assert.equal(typeof NativeWS, "function", "run with a WebSocket (Node >= 22, or --experimental-websocket on Node 20)");
  const s = await session();
  delete globalThis.WebSocket;  // only the one passed in
  let text = "";
  let finish;
  const ended = new Promise((k) => { finish = k; });
  try {
    const w = watch(BASE, s.session, s.token, {
      transport: "ws", from: 0, WebSocket: NativeWS,
      onFrame(f) {
        if (f.kind === "token") text += f.text;
        if (f.kind === "done" || f.kind === "error") finish(f);
      },
    });
    const r = await fetch(`${BASE}/v1/sessions/${s.session}/turns`, {
      method: "POST",
      headers: { "Content-Type": "application/json", Authorization: `Bearer ${s.token}` },
      body: JSON.stringify({ message: "hello over a websocket" }),
    });
    assert.equal(r.status, 202, await r.text());
    const last = await ended;
    w.close();
    assert.equal(last.kind, "done");
    assert.equal([...text].length, last.meta.chars);
  } finally {
    globalThis.WebSocket = NativeWS;
  }
});
