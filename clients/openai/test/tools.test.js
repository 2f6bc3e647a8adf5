// The official `openai` Node SDK reassembling tool calls from tokenrelay's two OpenAI
// fronts (chat completions and the Responses API), on a running stack whose mock engines
// answer `tools` with tool calls. TOKENRELAY_BASE and TOKENRELAY_GATEWAY_KEY as in
// responses.test.js; without them every test skips with the reason.
import { test } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";

const BASE = process.env.TOKENRELAY_BASE;
const KEY = process.env.TOKENRELAY_GATEWAY_KEY;
const skip = BASE && KEY ? false
  : "TOKENRELAY_BASE and TOKENRELAY_GATEWAY_KEY are not set (run it through tests/e2e/test_responses_node.py or against make demo)";
const MODEL = process.env.TOKENRELAY_MODEL || "mock";
const client = () => new OpenAI({ baseURL: `${BASE}/v1`, apiKey: KEY, maxRetries: 0 });
const NAMES = ["weather", "clock"];
const schema = { type: "object", properties: { city: { type: "string" } } };

test("chat completions: the SDK's stream helper rebuilds every tool call", { skip }, async () => {
  const stream = client().chat.completions.stream({
    model: MODEL, max_tokens: 64, tool_choice: "auto",
    messages: [{ role: "user", content: "Weather and time in Oslo?" }],
    tools: NAMES.map((name) => ({ type: "function", function: { name, parameters: schema } })),
  });
  const deltas = [];
  stream.on("tool_calls.function.arguments.delta", (e) => deltas.push(e.arguments_delta));
  const done = await stream.finalChatCompletion();
  const choice = done.choices[0];
  assert.equal(choice.finish_reason, "tool_calls");
  const calls = choice.message.tool_calls;
  assert.ok(calls.length >= 1, JSON.stringify(choice.message));
  for (const call of calls) {
    assert.ok(NAMES.includes(call.function.name), call.function.name);
    assert.equal(typeof JSON.parse(call.function.arguments), "object");
    assert.ok(call.id);
  }
  assert.equal(deltas.join(""), calls.map((c) => c.function.arguments).join(""));
});

test("Responses: function_call items rebuilt, and a tool's result continues", { skip }, async () => {
  const openai = client();
  const stream = openai.responses.stream({
    model: MODEL, input: "Weather in Oslo?", max_output_tokens: 64,
    tools: NAMES.map((name) => ({ type: "function", name, parameters: schema })),
  });
  const first = await stream.finalResponse();
  const calls = first.output.filter((item) => item.type === "function_call");
  assert.ok(calls.length >= 1, JSON.stringify(first.output));
  for (const call of calls) {
    assert.ok(NAMES.includes(call.name), call.name);
    assert.equal(typeof JSON.parse(call.arguments), "object");
  }
  const next = await openai.responses.create({
    model: MODEL, previous_response_id: first.id, max_output_tokens: 32,
    input: calls.map((c, i) => ({ type: "function_call_output", call_id: c.call_id, output: `{"n": ${i}}` })),
  });
  assert.ok(["completed", "incomplete"].includes(next.status), next.status);  // at max_output_tokens
  assert.ok(next.output_text.length > 0);
});
