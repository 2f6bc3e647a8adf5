// The package against a real Redis Cluster (TR_REDIS_URL; skipped without it) with the
// real `ai` package and its mock model: the adapters, the stop and nobody-watching
// signals, the errors. The frame rules are tests/conformance's, run on this package too.
import assert from 'node:assert/strict';
import { randomBytes } from 'node:crypto';
import { test } from 'node:test';
import { streamText } from 'ai';
import IORedis6 from 'ioredis6';
import {
  InvalidSession, Producer, RedisUnreachable, StopReason, TurnClosed, pipe, pipeText, pipeUIMessageStream,
} from '../src/index.js';
import { mockModel } from '../examples/mock-model.mjs';

const URL = process.env.TR_REDIS_URL;
const skip = URL ? false : 'TR_REDIS_URL is not set (the tests of the repository set it)';
const sid = () => `ts-${randomBytes(6).toString('hex')}`;

async function frames(p, id) {
  const entries = await p.redis.xrange(`tr:{${id}}:log`, '-', '+');
  return entries.map(([, fields]) => JSON.parse(fields[fields.indexOf('f') + 1]));
}

const reply = (fs) => fs.filter((f) => f.kind === 'token').map((f) => f.text).join('');

test('streamText into a turn: its text, finish reason and usage', { skip }, async () => {
  const p = await Producer.connect(URL);
  try {
    const s = p.session(sid());
    const turn = await s.startTurn('hi', { meta: { model: 'mock' } });
    const result = streamText({ model: mockModel('one two three four', { finishReason: 'length' }), prompt: 'hi', abortSignal: turn.signal });
    const at = await pipe(turn, result);
    const fs = await frames(p, s.id);
    assert.equal(fs.at(-1).offset, at);
    assert.equal(reply(fs), 'one two three four');
    const done = fs.at(-1).meta;
    assert.equal(done.finish_reason, 'length');
    assert.deepEqual(done.usage, { prompt_tokens: 9, completion_tokens: 4, total_tokens: 13, cached_tokens: 0 });
    assert.equal(done.chars, 18);
    assert.equal(fs[0].meta.model, 'mock');
  } finally {
    await p.close();
  }
});

test('the UI message stream into a turn, usage from its message metadata', { skip }, async () => {
  const p = await Producer.connect(URL);
  try {
    const s = p.session(sid());
    const turn = await s.startTurn('hi');
    const result = streamText({ model: mockModel('alpha beta'), prompt: 'hi' });
    const ui = result.toUIMessageStream({
      messageMetadata: ({ part }) => (part.type === 'finish' ? { usage: part.totalUsage } : undefined),
    });
    await pipeUIMessageStream(turn, ui);
    const fs = await frames(p, s.id);
    assert.equal(reply(fs), 'alpha beta');
    assert.equal(fs.at(-1).kind, 'done');
    assert.equal(fs.at(-1).meta.finish_reason, 'stop');
    assert.equal(fs.at(-1).meta.usage.completion_tokens, 2);
  } finally {
    await p.close();
  }
});

test('a stop asked of the turn aborts its signal; the turn ends done "cancelled"', { skip }, async () => {
  const p = await Producer.connect(URL, { presence: { intervalMs: 100 } });
  try {
    const s = p.session(sid());
    const turn = await s.startTurn('hi');
    const seen = [];
    turn.onStop((r) => seen.push(r));
    async function* slow() {
      for (let i = 0; i < 1000; i++) {
        yield `w${i} `;
        await new Promise((r) => setTimeout(r, 20));
      }
    }
    const piped = pipeText(turn, slow());
    await new Promise((r) => setTimeout(r, 150));
    await p.redis.hset(`tr:{${s.id}}:cancel`, String(turn.turn), 'asked');
    const at = await piped;
    assert.deepEqual(seen, [StopReason.CANCELLED]);
    assert.equal(turn.signal.aborted, true);
    const fs = await frames(p, s.id);
    assert.equal(fs.at(-1).offset, at);
    assert.equal(fs.at(-1).meta.finish_reason, 'cancelled');
    assert.ok(fs.length < 100);
    assert.equal(await p.redis.hget(`tr:{${s.id}}:cancel`, String(turn.turn)), String(at));
  } finally {
    await p.close();
  }
});

test('nobody watching for the grace period ends the turn with error "no viewers"', { skip }, async () => {
  const p = await Producer.connect(URL, { presence: { intervalMs: 50, graceMs: 200 } });
  try {
    const s = p.session(sid());
    const turn = await s.startTurn('hi');
    const result = streamText({ model: mockModel('x '.repeat(200), { delayMs: 20 }), prompt: 'hi', abortSignal: turn.signal });
    await pipe(turn, result);
    assert.equal(turn.stopReason, StopReason.NO_VIEWERS);
    const fs = await frames(p, s.id);
    assert.equal(fs.at(-1).kind, 'error');
    assert.equal(fs.at(-1).meta.code, 'no_viewers');
  } finally {
    await p.close();
  }
});

test('pipe tells a UI chunk stream by its first chunk; an error chunk or a failing source ends the turn with error', { skip }, async () => {
  const p = await Producer.connect(URL);
  try {
    async function* ui() {
      yield { type: 'start' };
      yield { type: 'text-delta', id: 't', delta: 'par' };
      yield { type: 'text-delta', id: 't', delta: 'tial' };
      yield { type: 'error', errorText: 'the model failed' };
    }
    const a = p.session(sid());
    await pipe(await a.startTurn('hi'), ui());
    let fs = await frames(p, a.id);
    assert.equal(reply(fs), 'partial');
    assert.deepEqual([fs.at(-1).kind, fs.at(-1).text, fs.at(-1).meta.code], ['error', 'the model failed', 'producer_error']);

    async function* broken() {
      yield 'one ';
      throw new RangeError('upstream went away');
    }
    const b = p.session(sid());
    await assert.rejects(pipeText(await b.startTurn('hi'), broken()), RangeError);
    fs = await frames(p, b.id);
    assert.equal(reply(fs), 'one ');
    assert.equal(fs.at(-1).text, 'the stream failed: RangeError');
    await b.startTurn('again', { watch: false }).then((t) => t.done()); // the lock was given back
  } finally {
    await p.close();
  }
});

test('bad input and a dead Redis: one error type per cause', { skip }, async () => {
  await assert.rejects(Producer.connect('redis://127.0.0.1:1', { connectTimeoutMs: 500 }), RedisUnreachable);
  const p = await Producer.connect(URL);
  try {
    assert.throws(() => p.session('not a session!'), InvalidSession);
    const turn = await p.session(sid()).startTurn('hi', { watch: false });
    turn.write('a');
    await turn.done();
    assert.throws(() => turn.write('late'), TurnClosed);
    await assert.rejects(turn.done(), TurnClosed);
  } finally {
    await p.close();
  }
  // Redis gone mid-turn: the publish is retried for retryMs, then RedisUnreachable
  const q = await Producer.connect(URL, { retryMs: 300 });
  const turn = await q.session(sid()).startTurn('hi', { watch: false });
  q.redis.disconnect();
  turn.write('a');
  const t0 = Date.now();
  await assert.rejects(turn.done(), RedisUnreachable);
  assert.ok(Date.now() - t0 >= 250);
});

test("an app's own client of ioredis 6 (the package's dependency is 5): a whole turn", { skip }, async () => {
  const { hostname, port } = new globalThis.URL(URL.split(',')[0]);
  const cluster = new IORedis6.Cluster([{ host: hostname, port: Number(port) }]);
  const p = new Producer(cluster, { secret: randomBytes(32).toString('hex') });
  try {
    const s = p.session(sid());
    const turn = await s.startTurn('hi', { watch: false });
    const result = streamText({ model: mockModel('six majors later'), prompt: 'hi' });
    const at = await pipe(turn, result);
    const fs = await frames(p, s.id);
    assert.equal(fs.at(-1).offset, at);
    assert.equal(reply(fs), 'six majors later');
    assert.equal(fs.at(-1).kind, 'done');
    assert.ok(s.token().split('.').length === 3);
  } finally {
    await cluster.quit();
  }
});
