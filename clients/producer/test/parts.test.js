// A reply's parts from the TypeScript producer (docs/PROTOCOL.md, "Parts"): the pure
// rules (the digest's vector shared with the Python producer, the refusals), then against
// a real Redis Cluster (TR_REDIS_URL; skipped without it) streamText's reasoning, tool
// calls and tool results through pipe, and the openai SDK's chat-completion chunks.
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { test } from 'node:test';
import { jsonSchema, simulateReadableStream, streamText, tool } from 'ai';
import { MockLanguageModelV3 } from 'ai/test';
import { PartError, Producer, partsDigest, pipe } from '../src/index.js';
import { Parts } from '../src/parts.js';
import { Coalescer, policy } from '../src/coalesce.js';

const URL = process.env.TR_REDIS_URL;
const skip = URL ? false : 'TR_REDIS_URL is not set (the tests of the repository set it)';
const sid = () => `tp-${randomBytes(6).toString('hex')}`;

async function frames(p, id) {
  const entries = await p.redis.xrange(`tr:{${id}}:log`, '-', '+');
  return entries.map(([, fields]) => JSON.parse(fields[fields.indexOf('f') + 1]));
}

/** The parts a screen rebuilds from the frames (the client's rules, for the check). */
function rebuild(fs) {
  const parts = new Parts();
  for (const f of fs) if (f.kind === 'part') parts.apply({ ...f.meta, phase: f.meta.phase ?? null }, f.text);
  return parts.records;
}

test('the parts digest is the Python producer\'s (the shared vector)', () => {
  const records = [
    { part: 'reasoning', id: 'r1', name: '', text: 'hé', done: true, summary: true },
    { part: 'tool-call', id: 'c1', name: 'f', text: '{"a":1}', done: true, summary: false },
  ];
  assert.equal(partsDigest(records), 'bd42b564c61eee077aa47bb3bf4f131ca95cf2a85f60c8fb01f90d3a5c92efb1');
});

test('one part\'s deltas coalesce apart from the text', () => {
  const c = new Coalescer(policy({ maxTokens: 4, firstImmediate: false }));
  assert.equal(c.push('a', 0), null);
  const part = { part: 'tool-call', id: 'c1', phase: 'delta' };
  assert.deepEqual(c.switchTo(part, 1), { text: 'a', count: 1 });
  c.push('{"x"', 1);
  c.push(':1}', 2);
  assert.deepEqual(c.switchTo(null, 3), { text: '{"x":1}', count: 2, part });
});

test('bad parts are refused before anything is written', { skip }, async () => {
  const p = await Producer.connect(URL);
  try {
    const s = p.session(sid());
    const turn = await s.startTurn('go');
    assert.throws(() => turn.toolCallDelta('ghost', '{}'), PartError);
    assert.throws(() => turn.toolCall('c1', 'f', '{"a": '), /not valid JSON/);
    assert.throws(() => turn.part('video', 'v', {}), /unknown part type/);
    assert.throws(() => turn.toolResult('c9', 1), /has not finished/);
    turn.toolCallStart('c2', 'f');
    turn.toolCallDelta('c2', '{"a":');
    await assert.rejects(() => turn.done(), /not valid JSON/);
    assert.equal(turn.closed, false);
    await turn.error('broken call');
    const fs = await frames(p, s.id);
    assert.deepEqual(fs.map((f) => f.kind), ['meta', 'part', 'part', 'error']);
  } finally {
    await p.close();
  }
});

test('streamText with reasoning and a tool: every part through pipe, done covers them', { skip }, async () => {
  const model = new MockLanguageModelV3({
    doStream: async () => ({
      stream: simulateReadableStream({
        chunkDelayInMs: 5,
        chunks: [
          { type: 'stream-start', warnings: [] },
          { type: 'reasoning-start', id: 'r0' },
          { type: 'reasoning-delta', id: 'r0', delta: 'The user wants ' },
          { type: 'reasoning-delta', id: 'r0', delta: 'the weather.' },
          { type: 'reasoning-end', id: 'r0' },
          { type: 'text-start', id: 't0' },
          { type: 'text-delta', id: 't0', delta: 'Checking.' },
          { type: 'text-end', id: 't0' },
          { type: 'tool-input-start', id: 'call_1', toolName: 'weather' },
          { type: 'tool-input-delta', id: 'call_1', delta: '{"city":' },
          { type: 'tool-input-delta', id: 'call_1', delta: '"Oslo"}' },
          { type: 'tool-input-end', id: 'call_1' },
          { type: 'tool-call', toolCallId: 'call_1', toolName: 'weather', input: '{"city":"Oslo"}' },
          {
            type: 'finish', finishReason: { unified: 'tool-calls', raw: 'tool_calls' },
            usage: { inputTokens: { total: 9, noCache: 9, cacheRead: 0, cacheWrite: 0 }, outputTokens: { total: 5, text: 5, reasoning: 2 } },
          },
        ],
      }),
    }),
  });
  const weather = tool({
    inputSchema: jsonSchema({ type: 'object', properties: { city: { type: 'string' } } }),
    execute: async ({ city }) => ({ city, temp: 4 }),
  });
  const p = await Producer.connect(URL);
  try {
    const s = p.session(sid());
    const turn = await s.startTurn('weather?');
    await pipe(turn, streamText({ model, prompt: 'weather?', tools: { weather } }));
    const fs = await frames(p, s.id);
    const got = rebuild(fs).map((x) => [x.part, x.id, x.name, x.text, x.done]);
    assert.deepEqual(got, [
      ['reasoning', 'r0', '', 'The user wants the weather.', true],
      ['tool-call', 'call_1', 'weather', '{"city":"Oslo"}', true],
      ['tool-result', 'call_1', 'weather', '{"city":"Oslo","temp":4}', true],
    ]);
    const done = fs.at(-1).meta;
    assert.equal(done.parts, 3);
    assert.equal(done.parts_sha256, partsDigest(rebuild(fs)));
    assert.equal(fs.filter((f) => f.kind === 'token').map((f) => f.text).join(''), 'Checking.');
  } finally {
    await p.close();
  }
});

test('the openai SDK\'s chat chunks: reasoning_content and tool_calls by index', { skip }, async () => {
  const chunk = (delta, finish = null) => ({ id: 'c', object: 'chat.completion.chunk', choices: [{ index: 0, delta, finish_reason: finish }] });
  async function* chunks() {
    yield chunk({ role: 'assistant', reasoning_content: 'Two calls.' });
    yield chunk({ tool_calls: [{ index: 0, id: 'call_a', type: 'function', function: { name: 'f', arguments: '{"x"' } }] });
    yield chunk({ tool_calls: [{ index: 1, id: 'call_b', type: 'function', function: { name: 'g', arguments: '' } }] });
    yield chunk({ tool_calls: [{ index: 0, function: { arguments: ':1}' } }] });
    yield chunk({}, 'tool_calls');
  }
  const p = await Producer.connect(URL);
  try {
    const s = p.session(sid());
    await pipe(await s.startTurn('go'), chunks());
    const fs = await frames(p, s.id);
    assert.deepEqual(rebuild(fs).map((x) => [x.part, x.id, x.text]), [
      ['reasoning', 'reasoning-1', 'Two calls.'], ['tool-call', 'call_a', '{"x":1}'], ['tool-call', 'call_b', '{}'],
    ]);
    assert.equal(fs.at(-1).meta.finish_reason, 'tool_calls');
  } finally {
    await p.close();
  }
});
