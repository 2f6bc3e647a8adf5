// The Vercel AI SDK (the real `ai` package) against a running tokenrelay stack.
// TOKENRELAY_BASE: a front door (make demo, or tests/e2e/test_aisdk.py's stack). Without it
// every test skips with the reason.
//
// The SDK's own DefaultChatTransport posts the chat body to the worker's /v1/chat and
// reconnects to a relay's /v1/chat/{id}/stream; readUIMessageStream builds the reply.
// The reference is an SSE viewer: this repository's browser client watching the session.
import { test } from "node:test";
import assert from "node:assert/strict";
import { DefaultChatTransport, readUIMessageStream } from "ai";
import { watch } from "../../js/tokenrelay.js";

const BASE = process.env.TOKENRELAY_BASE;
const skip = BASE ? false : "TOKENRELAY_BASE is not set (run it through tests/e2e/test_aisdk.py or against make demo)";

async function newSession() {
  const r = await fetch(`${BASE}/v1/sessions`, { method: "POST" });
  assert.equal(r.status, 201);
  return r.json();
}

/** An SSE viewer on the session (the browser client): turn -> reply text once done. */
function viewer(session, token) {
  const texts = new Map();
  const done = new Map();
  const problems = [];
  const waiters = [];
  const w = watch(BASE, session, token, {
    transport: "sse",
    from: 0,
    onFrame(f) {
      if (f.kind === "token") texts.set(f.turn, (texts.get(f.turn) || "") + f.text);
      if (f.kind === "done" || f.kind === "error") {
        done.set(f.turn, texts.get(f.turn) || "");
        for (const k of waiters.splice(0)) k();
      }
    },
    onGap(g) { problems.push(g); },
  });
  return {
    w, problems,
    async reply(turn) {
      while (!done.has(turn)) await new Promise((k) => waiters.push(k));
      return done.get(turn);
    },
  };
}

function transport(token) {
  return new DefaultChatTransport({ api: `${BASE}/v1/chat`, headers: { Authorization: `Bearer ${token}` } });
}

function userMessage(text) {
  return { id: `u-${Math.random().toString(36).slice(2)}`, role: "user", parts: [{ type: "text", text }] };
}

async function finalMessage(stream) {
  let last;
  for await (const message of readUIMessageStream({ stream })) last = message;
  return last;
}

const textOf = (m) => m.parts.filter((p) => p.type === "text").map((p) => p.text).join("");

test("useChat's transport: the POST streams the reply the SSE viewer sees", { skip, timeout: 60_000 }, async () => {
  const { session, token } = await newSession();
  const view = viewer(session, token);
  try {
    const t = transport(token);
    const stream = await t.sendMessages({
      chatId: session, messages: [userMessage("Tell me about sharded pub/sub")],
      trigger: "submit-message", messageId: undefined, abortSignal: undefined,
    });
    const message = await finalMessage(stream);
    assert.equal(message.role, "assistant");
    assert.equal(message.id, `${session}-1`);
    assert.equal(message.metadata.turn, 1);
    const text = textOf(message);
    assert.ok(text.length > 20, text);
    assert.equal(text, await view.reply(1));
    assert.deepEqual(view.problems, []);
    // Nothing runs now: the resume GET is a 204, which the SDK reads as "nothing to resume".
    assert.equal(await t.reconnectToStream({ chatId: session }), null);
  } finally {
    view.w.close();
  }
});

test("a reconnect mid-turn (any relay) replays the running turn: same text as the SSE viewer", { skip, timeout: 90_000 }, async () => {
  const { session, token } = await newSession();
  const view = viewer(session, token);
  try {
    const t = transport(token);
    const abort = new AbortController();
    const stream = await t.sendMessages({
      chatId: session, messages: [userMessage("And what happens when a relay dies?")],
      trigger: "submit-message", messageId: undefined, abortSignal: abort.signal,
    });
    // Read a few deltas, then drop the connection (a page reload, a network change).
    const reader = stream.getReader();
    let deltas = 0;
    while (deltas < 3) {
      const { value, done } = await reader.read();
      assert.ok(!done, "the stream ended before three deltas");
      if (value.type === "text-delta") deltas += 1;
    }
    abort.abort();
    await reader.cancel().catch(() => {});
    // Two screens resume at once, through whichever relays the front door picks.
    const resumed = await Promise.all([0, 1].map(async () => {
      const again = await t.reconnectToStream({ chatId: session });
      assert.notEqual(again, null, "the turn is still running: the reconnect must not be a 204");
      return textOf(await finalMessage(again));
    }));
    const reference = await view.reply(1);
    assert.ok(reference.length > 20, reference);
    assert.deepEqual(resumed, [reference, reference]);
    assert.deepEqual(view.problems, []);
  } finally {
    view.w.close();
  }
});

test("refusals come back as the SDK's errors, with the reason", { skip, timeout: 30_000 }, async () => {
  const { session } = await newSession();
  const t = transport("forged.token");
  await assert.rejects(
    t.sendMessages({ chatId: session, messages: [userMessage("hi")], trigger: "submit-message" }),
    /token_invalid/,
  );
});
