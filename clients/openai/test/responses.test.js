// The official `openai` Node SDK against tokenrelay's Responses API on a running stack.
// TOKENRELAY_BASE: a front door (make demo, or tests/e2e/test_responses_node.py's stack);
// TOKENRELAY_GATEWAY_KEY: the workers' and relays' gateway key. Without them every test
// skips with the reason.
//
// The front door sends POST /v1/responses to a worker and a response's stream
// (GET /v1/responses/{id}?stream=true) to a relay, at random: a resume lands anywhere.
import { test } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";

const BASE = process.env.TOKENRELAY_BASE;
const KEY = process.env.TOKENRELAY_GATEWAY_KEY;
const skip = BASE && KEY ? false
  : "TOKENRELAY_BASE and TOKENRELAY_GATEWAY_KEY are not set (run it through tests/e2e/test_responses_node.py or against make demo)";
const MODEL = process.env.TOKENRELAY_MODEL || "mock";

function client() {
  return new OpenAI({ baseURL: `${BASE}/v1`, apiKey: KEY, maxRetries: 0 });
}

const text = (events) => events
  .filter((e) => e.type === "response.output_text.delta").map((e) => e.delta).join("");

test("a streamed create is every event in order, usage at the end", { skip }, async () => {
  const openai = client();
  const stream = await openai.responses.create({
    model: MODEL, input: "Name three rivers.", stream: true, max_output_tokens: 24,
  });
  const events = [];
  for await (const e of stream) events.push(e);
  assert.deepEqual(events.map((e) => e.sequence_number), events.map((_, i) => i));
  assert.equal(events[0].type, "response.created");
  const last = events.at(-1);
  assert.ok(["response.completed", "response.incomplete"].includes(last.type), last.type);
  assert.equal(last.response.output[0].content[0].text, text(events));
  assert.ok(last.response.usage.output_tokens > 0);
  const whole = await openai.responses.retrieve(last.response.id);
  assert.equal(whole.output_text, text(events));
});

test("a background stream cut after a few events resumes with starting_after", { skip }, async () => {
  const openai = client();
  const stream = await openai.responses.create({
    model: MODEL, input: "Tell me a long story.", stream: true, background: true,
    max_output_tokens: 48,
  });
  const before = [];
  for await (const e of stream) {
    before.push(e);
    if (before.length === 6) break;  // the client drops; a background response runs on
  }
  const id = before[0].response.id;
  const n = before.at(-1).sequence_number;
  const after = [];
  for await (const e of await openai.responses.retrieve(id, { stream: true, starting_after: n })) {
    after.push(e);
  }
  const all = [...before, ...after];
  assert.deepEqual(all.map((e) => e.sequence_number), all.map((_, i) => i));
  const whole = [];
  for await (const e of await openai.responses.retrieve(id, { stream: true })) whole.push(e);
  assert.deepEqual(all, whole);
  const done = await openai.responses.retrieve(id);
  assert.equal(done.output_text, text(all));
  assert.ok(done.output_text.length > 0);
});
