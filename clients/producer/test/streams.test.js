// The openai SDK's Responses events and LangChain's message chunks through pipe (the
// Python producer's adapters, rule for rule; tests/conformance pipes the same streams
// through both producers), against a real Redis Cluster (TR_REDIS_URL; skipped
// without it). The LangChain chunks are @langchain/core's own AIMessageChunk; the
// Responses events have the shape of the openai SDK's ResponseStreamEvent (the Python
// contract test validates the same sequence with the SDK's own types).
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { test } from 'node:test';
import { AIMessageChunk } from '@langchain/core/messages';
import { PartError, Producer, partsDigest, pipe, pipeLangChain, pipeResponses, pipeUIMessageStream } from '../src/index.js';
import { Parts } from '../src/parts.js';

const URL = process.env.TR_REDIS_URL;
const skip = URL ? false : 'TR_REDIS_URL is not set (the tests of the repository set it)';
const sid = () => `ts-${randomBytes(6).toString('hex')}`;

async function frames(p, id) {
  const entries = await p.redis.xrange(`tr:{${id}}:log`, '-', '+');
  return entries.map(([, fields]) => JSON.parse(fields[fields.indexOf('f') + 1]));
}

function rebuild(fs) {
  const parts = new Parts();
  for (const f of fs) if (f.kind === 'part') parts.apply({ ...f.meta, phase: f.meta.phase ?? null }, f.text);
  return parts.records;
}

const text = (fs) => fs.filter((f) => f.kind === 'token').map((f) => f.text).join('');

async function* each(items) {
  for (const x of items) yield x;
}

/** A turn piped from `items` with `how`; its frames (and what the pipe threw). */
async function piped(how, items) {
  const p = await Producer.connect(URL);
  try {
    const s = p.session(sid());
    let thrown = null;
    await how(await s.startTurn('go'), each(items)).catch((err) => { thrown = err; });
    return { fs: await frames(p, s.id), thrown };
  } finally {
    await p.close();
  }
}

const fc = { type: 'function_call', id: 'fc_1', call_id: 'call_1', name: 'search', arguments: '', status: 'in_progress' };
const RESPONSES = [
  { type: 'response.created', sequence_number: 0, response: { id: 'resp_1', status: 'in_progress' } },
  { type: 'response.output_item.added', output_index: 0, item: { type: 'reasoning', id: 'rs_1', summary: [] } },
  { type: 'response.reasoning_summary_text.delta', item_id: 'rs_1', output_index: 0, summary_index: 0, delta: 'Searching ' },
  { type: 'response.reasoning_summary_text.delta', item_id: 'rs_1', output_index: 0, summary_index: 0, delta: 'first.' },
  { type: 'response.reasoning_summary_text.done', item_id: 'rs_1', output_index: 0, summary_index: 0, text: 'Searching first.' },
  { type: 'response.output_item.added', output_index: 1, item: fc },
  { type: 'response.function_call_arguments.delta', item_id: 'fc_1', output_index: 1, delta: '{"q":' },
  { type: 'response.function_call_arguments.delta', item_id: 'fc_1', output_index: 1, delta: '"tides"}' },
  { type: 'response.function_call_arguments.done', item_id: 'fc_1', output_index: 1, arguments: '{"q":"tides"}' },
  { type: 'response.output_item.done', output_index: 1, item: { ...fc, arguments: '{"q":"tides"}', status: 'completed' } },
  { type: 'response.output_text.delta', item_id: 'msg_1', output_index: 2, content_index: 0, delta: 'Tides are', logprobs: [] },
  {
    type: 'response.output_text.annotation.added', item_id: 'msg_1', output_index: 2, content_index: 0, annotation_index: 0,
    annotation: { type: 'url_citation', url: 'https://example.org/t', title: 'Tides', start_index: 0, end_index: 5 },
  },
  {
    type: 'response.completed',
    response: { id: 'resp_1', status: 'completed', usage: { input_tokens: 9, output_tokens: 6, total_tokens: 15, input_tokens_details: { cached_tokens: 4 } } },
  },
];

test('a Responses stream: reasoning summary, a function call, text and a citation', { skip }, async () => {
  for (const how of [pipeResponses, pipe]) {
    const { fs, thrown } = await piped(how, RESPONSES);
    assert.equal(thrown, null);
    assert.deepEqual(rebuild(fs).map((x) => [x.part, x.id, x.name, x.summary, x.text, x.done]), [
      ['reasoning', 'rs_1-summary-0', '', true, 'Searching first.', true],
      ['tool-call', 'call_1', 'search', false, '{"q":"tides"}', true],
      ['source', 'source-1', '', false, '{"url":"https://example.org/t","title":"Tides"}', true],
    ]);
    assert.equal(text(fs), 'Tides are');
    const done = fs.at(-1);
    assert.equal(done.kind, 'done');
    assert.equal(done.meta.finish_reason, 'tool_calls'); // as chat completions says it
    assert.deepEqual(done.meta.usage, { prompt_tokens: 9, completion_tokens: 6, total_tokens: 15, cached_tokens: 4 });
    assert.equal(done.meta.parts_sha256, partsDigest(rebuild(fs)));
  }
});

test('a Responses stream that is incomplete, failed, or sends arguments for no item', { skip }, async () => {
  const text1 = { type: 'response.output_text.delta', item_id: 'm', output_index: 0, content_index: 0, delta: 'Half' };
  const cut = await piped(pipeResponses, [text1, { type: 'response.incomplete', response: { incomplete_details: { reason: 'max_output_tokens' } } }]);
  assert.equal(cut.fs.at(-1).meta.finish_reason, 'max_output_tokens');
  const failed = await piped(pipeResponses, [text1, { type: 'response.failed', response: { error: { message: 'overloaded' } } }]);
  assert.deepEqual([failed.fs.at(-1).kind, failed.fs.at(-1).text], ['error', 'overloaded']);
  const ghost = await piped(pipe, [{ type: 'response.function_call_arguments.delta', item_id: 'fc_9', delta: '{}' }]);
  assert.ok(ghost.thrown instanceof PartError);
  const end = ghost.fs.at(-1);
  assert.equal(end.kind, 'error'); // the turn ends, said, never left open
  assert.equal(end.meta.code, 'producer_error');
  assert.match(end.text, /function call arguments for item 'fc_9', never added/);
});

test('LangChain message chunks (@langchain/core): reasoning, blocks, tool_call_chunks, usage', { skip }, async () => {
  const chunks = [
    new AIMessageChunk({ content: '', additional_kwargs: { reasoning_content: 'Think.' } }),
    new AIMessageChunk({ content: [{ type: 'text', text: 'Sure, ' }] }),
    new AIMessageChunk({ content: 'calling.' }),
    new AIMessageChunk({ content: '', tool_call_chunks: [{ args: '{"id":', index: 0 }] }), // before its name: held
    new AIMessageChunk({ content: '', tool_call_chunks: [{ name: 'lookup', args: ' 7}', id: 't1', index: 0 }] }),
    new AIMessageChunk({ content: '', tool_call_chunks: [{ name: 'clock', id: 't2', index: 1 }] }), // no arguments: {}
    new AIMessageChunk({
      content: '', usage_metadata: { input_tokens: 5, output_tokens: 7, total_tokens: 12 },
      response_metadata: { finish_reason: 'tool_calls' },
    }),
  ];
  for (const [how, items] of [[pipeLangChain, chunks], [pipe, chunks.map((c) => [c, { langgraph_node: 'agent' }])]]) {
    const { fs, thrown } = await piped(how, items);
    assert.equal(thrown, null);
    assert.equal(text(fs), 'Sure, calling.');
    assert.deepEqual(rebuild(fs).map((x) => [x.part, x.id, x.name, x.text, x.done]), [
      ['reasoning', 'reasoning-1', '', 'Think.', true],
      ['tool-call', 't1', 'lookup', '{"id": 7}', true],
      ['tool-call', 't2', 'clock', '{}', true],
    ]);
    const done = fs.at(-1).meta;
    assert.equal(done.finish_reason, 'tool_calls');
    assert.deepEqual(done.usage, { prompt_tokens: 5, completion_tokens: 7, total_tokens: 12 });
  }
  const broken = await piped(pipe, [new AIMessageChunk({ content: '', tool_call_chunks: [{ name: 'f', args: '{"a": nope', id: 'c', index: 0 }] })]);
  assert.ok(broken.thrown instanceof PartError);
  assert.deepEqual([broken.fs.at(-1).kind, broken.fs.at(-1).meta.code], ['error', 'producer_error']);
  assert.match(broken.fs.at(-1).text, /not valid JSON/);
});

test('chat chunks: arguments before the call\'s name are held, cached tokens kept', { skip }, async () => {
  const chunk = (delta, finish = null) => ({ id: 'c', choices: [{ index: 0, delta, finish_reason: finish }] });
  const { fs } = await piped(pipe, [
    chunk({ reasoning_content: 'One call.' }),
    chunk({ tool_calls: [{ index: 0, function: { arguments: '{"x"' } }] }),
    chunk({ tool_calls: [{ index: 0, id: 'call_a', type: 'function', function: { name: 'f', arguments: ':1}' } }] }),
    chunk({}, 'tool_calls'),
    { id: 'c', choices: [], usage: { prompt_tokens: 8, completion_tokens: 3, total_tokens: 11, prompt_tokens_details: { cached_tokens: 6 } } },
  ]);
  assert.deepEqual(rebuild(fs).map((x) => [x.part, x.id, x.text]), [['reasoning', 'reasoning-1', 'One call.'], ['tool-call', 'call_a', '{"x":1}']]);
  // the reasoning ends before the calls do, as the Python producer ends them
  const ends = fs.filter((f) => f.kind === 'part' && f.meta.phase === 'end').map((f) => f.meta.part);
  assert.deepEqual(ends, ['reasoning', 'tool-call']);
  assert.equal(fs.at(-1).meta.cached_tokens, 6);
});

test('a part the turn refuses mid-stream ends it with error, as in Python', { skip }, async () => {
  // before, a PartError (a ProducerError) closed the turn with no terminal frame
  const { fs, thrown } = await piped(pipeUIMessageStream, [
    { type: 'text-delta', id: 't', delta: 'Calling.' },
    { type: 'tool-input-available', toolCallId: 'c1', toolName: 'f', input: '{"a": nope' },
  ]);
  assert.ok(thrown instanceof PartError);
  assert.deepEqual(fs.map((f) => f.kind), ['meta', 'token', 'error']);
  assert.equal(fs.at(-1).meta.code, 'producer_error');
  assert.match(fs.at(-1).text, /^the stream's parts: .*not valid JSON/);
});
