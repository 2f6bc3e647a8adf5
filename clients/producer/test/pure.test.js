// The package's pure parts under Node's test runner (no Redis).
import assert from 'node:assert/strict';
import { createHmac } from 'node:crypto';
import { test } from 'node:test';
import { Coalescer, DEFAULT_POLICY, policy } from '../src/coalesce.js';
import { chunks, encode, sessionProblem } from '../src/frame.js';
import { issueToken } from '../src/token.js';
import { replyIntegrity, usageMeta } from '../src/turn.js';
import { messageMeta } from '../src/producer.js';
import { SCRIPTS, source, sha1 } from '../src/scripts.js';
import * as errors from '../src/errors.js';

test('the coalescer has the worker defaults: the first delta at once, then 8 or 50 ms', () => {
  assert.deepEqual({ ...DEFAULT_POLICY }, { maxTokens: 8, maxDelayMs: 50, firstImmediate: true });
  const c = new Coalescer(policy());
  assert.deepEqual(c.push('a', 0), { text: 'a', count: 1 });
  for (let i = 0; i < 7; i++) assert.equal(c.push(String(i), 1), null);
  assert.deepEqual(c.push('x', 2), { text: '0123456x', count: 8 });
  assert.equal(c.push('y', 10), null);
  assert.equal(c.deadline(), 60);
  assert.equal(c.poll(59), null);
  assert.deepEqual(c.poll(60), { text: 'y', count: 1 });
  const one = new Coalescer(policy({ maxTokens: 1 }));
  assert.deepEqual([one.push('a', 0), one.push('b', 0)].map((b) => b?.text), ['a', 'b']);
  assert.throws(() => policy({ maxTokens: 0 }), RangeError);
});

test('a frame encodes with its fields in the protocol order', () => {
  const f = encode({ session: 's', turn: 1, offset: 2, kind: 'token', text: 'ü"\n', epoch: 3, ts: 4, meta: { gen: 'g' } });
  assert.equal(f, '{"v":1,"session":"s","turn":1,"offset":2,"kind":"token","text":"ü\\"\\n","epoch":3,"ts":4,"meta":{"gen":"g"}}');
  assert.deepEqual(chunks('aé🙂', 4), ['aé', '🙂']);
});

test('session ids, integrity, usage and the message meta as the Python API writes them', () => {
  assert.equal(sessionProblem('ok_id-1'), null);
  assert.match(sessionProblem('not a session!'), /only A-Z/);
  assert.match(sessionProblem('x'.repeat(65)), /longer than 64/);
  assert.deepEqual(replyIntegrity('wö🙂', 2), {
    tokens: 2, chars: 3, sha256: 'f1c1c708016632a89a2e14f2e16690d9fe65970e67910973fdeceb52b7a4ed68',
  });
  assert.deepEqual(usageMeta({ inputTokens: 7, outputTokens: 5, totalTokens: 12, inputTokenDetails: { cacheReadTokens: 3 } }), {
    usage: { prompt_tokens: 7, completion_tokens: 5, total_tokens: 12, cached_tokens: 3 }, prompt_tokens: 7, cached_tokens: 3,
  });
  assert.deepEqual(usageMeta({ completion_tokens: 1 }), { usage: { completion_tokens: 1 } });
  assert.deepEqual(messageMeta('hi'), { message: 'hi' });
  const long = messageMeta('é'.repeat(2000));
  assert.equal(long.message_truncated, true);
  assert.equal(Buffer.byteLength(long.message), 2048);
  assert.equal(long.message_chars, 2000);
});

test('a token is an HS256 JWT with the claims relays check', () => {
  const secret = Buffer.from('0123456789abcdefghijklmnopqrstuvwxyz');
  const t = issueToken(secret, 'sid-1', { ttlS: 60, now: 1000 });
  const [h, c, s] = t.split('.');
  assert.deepEqual(JSON.parse(Buffer.from(h, 'base64url')), { alg: 'HS256', kid: 'k1', typ: 'JWT' });
  const claims = JSON.parse(Buffer.from(c, 'base64url'));
  assert.deepEqual([claims.sub, claims.scope, claims.iat, claims.exp], ['sid-1', 'watch', 1000, 1060]);
  assert.equal(s, createHmac('sha256', secret).update(`${h}.${c}`).digest('base64url'));
});

test('every error has a code and a one-line message', () => {
  const all = [
    new errors.InvalidSession('session id is empty'), new errors.FrameTooLarge('s', 10, 5),
    new errors.TurnClosed('s', 1, 'done'), new errors.RedisUnreachable('redis unreachable:\n down'),
    new errors.StaleEpoch('s', 1, 2), new errors.TurnBusy({ owner: 'o', turn: 3, offset: 0 }), new errors.LockLost('gone'),
  ];
  const codes = all.map((e) => e.code);
  assert.deepEqual(codes, ['invalid_session', 'frame_too_large', 'turn_closed', 'redis_unreachable', 'stale_epoch', 'turn_busy', 'lock_lost']);
  for (const e of all) {
    assert.ok(e instanceof errors.ProducerError);
    assert.ok(!e.message.includes('\n'), e.message);
  }
});

test('the scripts are the relay files, joined as the Python side joins them', () => {
  const publish = source(...SCRIPTS.trPublish.slice(0, 2));
  assert.ok(publish.startsWith('-- A session\'s backlog'));
  assert.match(publish, /\nlocal cur = redis.call\('HMGET'/);
  if (process.env.TR_PUBLISH_SHA) assert.equal(sha1(publish), process.env.TR_PUBLISH_SHA);
});

test('the turn lock keeps the bound every producer states: 5 s, at most 7 s', async () => {
  const { Producer, LOCK_TTL_MS, MAX_LOCK_TTL_MS, PRODUCER_LOST_MS } = await import('../src/index.js');
  assert.deepEqual([LOCK_TTL_MS, MAX_LOCK_TTL_MS, PRODUCER_LOST_MS], [5000, 7000, 10_000]);
  const redis = { defineCommand() {} }; // no Redis: the constructor only declares scripts
  assert.equal(new Producer(redis).lockTtlMs, LOCK_TTL_MS);
  assert.equal(new Producer(redis, { lockTtlMs: 7000 }).lockTtlMs, 7000);
  assert.throws(() => new Producer(redis, { lockTtlMs: 15_000 }), RangeError);
  assert.throws(() => new Producer(redis, { lockTtlMs: Number.NaN }), RangeError);
});
