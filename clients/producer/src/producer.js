// The producer: sessions, their tokens, and turns written with the worker's rules
// (the Python API's relay/producer/session.py; docs/PROTOCOL.md, "Producers"):
//   1. claim the session's turn lock (SET NX PX; a second producer gets TurnBusy);
//   2. open a fenced generation (open.lua: epoch + 1, turn + 1), publish the turn's
//      meta frame, name the turn in the lock (lock_name.lua);
//   3. write deltas (coalesced; a watch refreshes the lock every second, reads the stop
//      record and counts the relays with viewers);
//   4. end with exactly one done or error frame; the lock is given back.
import { createHash, randomBytes } from 'node:crypto';
import IORedis from 'ioredis';
import { InvalidSession, LockLost, RedisUnreachable, TurnBusy } from './errors.js';
import { key, sessionProblem } from './frame.js';
import { Generation, withRetry } from './generation.js';
import { defineScripts } from './scripts.js';
import { checkSecret, issueToken } from './token.js';
import { policy } from './coalesce.js';
import { Turn } from './turn.js';

export const BACKLOG_MAXLEN = 10_000;
export const BACKLOG_MAX_BYTES = 4 << 20;
export const SESSION_TTL_S = 86_400;
// A producer's death ends its open turn with an error frame on the screens within
// PRODUCER_LOST_MS, for every producer (docs/PROTOCOL.md, "Producers"): the relays' reaper
// ends a silent turn once its lock expired, so the lock's TTL is at most MAX_LOCK_TTL_MS.
export const PRODUCER_LOST_MS = 10_000;
export const LOCK_TTL_MS = 5_000;
export const MAX_LOCK_TTL_MS = 7_000;
export const META_MESSAGE_BYTES = 2048;

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** The ioredis Cluster options the producer uses (no offline queue past the window). */
function clusterOf(url) {
  const nodes = (Array.isArray(url) ? url : String(url).split(',')).map((u) => {
    const parsed = new URL(u.includes('://') ? u : `redis://${u}`);
    return { host: parsed.hostname, port: Number(parsed.port || 6379) };
  });
  return new IORedis.Cluster(nodes, {
    lazyConnect: true,
    enableReadyCheck: true,
    clusterRetryStrategy: (times) => Math.min(100 * times, 1000),
    redisOptions: { maxRetriesPerRequest: 2, connectTimeout: 2000 },
  });
}

export class Producer {
  /**
   * @param {any} redis an ioredis Cluster (or Redis) client
   * @param {import('../index.js').ProducerOptions} [opts]
   */
  constructor(redis, opts = {}) {
    this.redis = redis;
    defineScripts(redis);
    this.secret = opts.secret == null ? null : checkSecret(opts.secret);
    this.kid = opts.kid ?? 'k1';
    this.producerId = opts.producerId ?? `producer-${randomBytes(4).toString('hex')}`;
    this.ttlS = opts.ttlS ?? SESSION_TTL_S;
    this.maxlen = opts.maxlen ?? BACKLOG_MAXLEN;
    this.maxBytes = opts.maxBytes ?? BACKLOG_MAX_BYTES;
    this.retryMs = opts.retryMs ?? 10_000;
    this.keepFrames = opts.keepFrames ?? 4096;
    this.lockTtlMs = Math.max(1, Math.round(opts.lockTtlMs ?? LOCK_TTL_MS));
    if (!(this.lockTtlMs <= MAX_LOCK_TTL_MS)) {
      throw new RangeError(`lockTtlMs must be at most ${MAX_LOCK_TTL_MS}: a turn of a dead ` +
        `producer must end within ${PRODUCER_LOST_MS} ms`);
    }
    this.coalesce = policy(opts.coalesce);
    this.presence = { graceMs: 10_000, intervalMs: 1000, ...(opts.presence ?? {}) };
    this.ownsRedis = false;
  }

  /**
   * A producer on its own Cluster client (`redis://host:port`, or several, comma
   * separated or an array of seed nodes); RedisUnreachable if none answers.
   * @param {string | string[]} url @param {import('../index.js').ProducerOptions} [opts]
   */
  static async connect(url, opts = {}) {
    const cluster = clusterOf(url);
    cluster.on('error', () => {}); // reported through the calls that fail
    const waitMs = opts.connectTimeoutMs ?? 5000;
    let timer;
    let why = `no node answered in ${waitMs} ms`;
    try {
      // one connect; when it fails ioredis goes on trying the seed nodes by itself
      // (clusterRetryStrategy): wait for its ready until connectTimeoutMs
      const ready = new Promise((resolve) => cluster.once('ready', resolve));
      cluster.connect().catch((err) => { why = err.message; });
      await Promise.race([ready, new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error(why)), waitMs);
      })]);
    } catch (err) {
      cluster.disconnect();
      throw new RedisUnreachable(`redis unreachable at start: ${/** @type {Error} */ (err).message}`);
    } finally {
      clearTimeout(timer);
    }
    const p = new Producer(cluster, opts);
    p.ownsRedis = true;
    return p;
  }

  /** Run one Redis call with the retry window (transport failures: RedisUnreachable). */
  call(fn) {
    return withRetry(fn, this.retryMs);
  }

  async close() {
    if (this.ownsRedis) await this.redis.quit().catch(() => this.redis.disconnect());
  }

  /** The session `sid` (a new random id when omitted); InvalidSession when it is not one. */
  session(sid) {
    const id = sid ?? randomBytes(12).toString('base64url');
    const why = sessionProblem(id);
    if (why) throw new InvalidSession(why);
    return new Session(this, id);
  }
}

export class Session {
  /** @param {Producer} producer @param {string} id */
  constructor(producer, id) {
    this.producer = producer;
    this.id = id;
  }

  /** A token to watch (or, scope 'write', to write to) this session, at most its lifetime. */
  token({ scope = 'watch', ttlS = 3600, now } = {}) {
    const p = this.producer;
    if (!p.secret) throw new Error('the producer has no token secret (Producer.connect(url, {secret}))');
    return issueToken(p.secret, this.id, { scope, ttlS: Math.min(ttlS, p.ttlS), now, kid: p.kid });
  }

  /** Take the turn lock (retries more times, retryMs apart); TurnBusy else. */
  async claim({ owner, retries = 3, retryMs = 50 } = {}) {
    const p = this.producer;
    const who = owner ?? `${p.producerId}:${randomBytes(8).toString('hex')}`;
    for (let attempt = 0; ; attempt++) {
      const holder = await acquire(p, this.id, who);
      if (holder === null) return new Claim(this, who);
      if (attempt >= retries) throw new TurnBusy(holder);
      await sleep(retryMs);
    }
  }

  /**
   * Claim the lock and open a turn (its meta frame is out when this resolves).
   * @param {string} [message] @param {import('../index.js').StartOptions} [opts]
   */
  async startTurn(message = '', opts = {}) {
    const claim = await this.claim();
    return claim.open(message, opts);
  }
}

export class Claim {
  /** @param {Session} session @param {string} owner */
  constructor(session, owner) {
    this.session = session;
    this.owner = owner;
  }

  async release() {
    const p = this.session.producer;
    await p.call(() => p.redis.trLockRelease(key(this.session.id, 'lock'), this.owner + ' ')).catch(() => {});
  }

  /** Open the generation, publish the meta frame, name the turn in the lock. */
  async open(message = '', { messageId, meta, watch = true } = {}) {
    const p = this.session.producer;
    const sid = this.session.id;
    const t0 = performance.now();
    let gen = null;
    let metaOut = false;
    try {
      gen = await Generation.open(p, sid);
      const body = { role: 'user', ...messageMeta(message), worker: p.producerId, ...(meta ?? {}) };
      body.message_id = messageId ?? `${sid}-${gen.turn}-user`;
      const [first] = await gen.publish([{ kind: 'meta', meta: body }]);
      metaOut = true;
      const value = lockValue(this.owner, gen.turn, first);
      const named = await p.call(() => p.redis.trLockName(key(sid, 'lock'), this.owner + ' ', p.lockTtlMs, value));
      if (!Number(named)) throw new LockLost('the turn lock expired while the turn was started');
      const turn = new Turn(p, sid, this.owner, gen, first, t0);
      if (watch) turn.watch();
      return turn;
    } catch (err) {
      if (gen && metaOut) await gen.publish([{ kind: 'error', text: 'turn failed to start' }]).catch(() => {});
      await this.release();
      throw err;
    }
  }
}

/** @param {string} owner @param {number} turn @param {number} offset */
export const lockValue = (owner, turn, offset) => `${owner} ${JSON.stringify({ turn, offset })}`;

/** @param {string} text */
export function parseLock(text) {
  const at = text.indexOf(' ');
  const owner = at < 0 ? text : text.slice(0, at);
  try {
    const d = JSON.parse(text.slice(at + 1));
    return { owner, turn: Number(d.turn ?? 0), offset: Number(d.offset ?? 0) };
  } catch {
    return { owner, turn: 0, offset: 0 };
  }
}

/** SET NX PX the lock; null when taken, else who holds it. */
async function acquire(p, sid, owner) {
  const lk = key(sid, 'lock');
  const value = lockValue(owner, 0, 0);
  if (await p.call(() => p.redis.set(lk, value, 'PX', p.lockTtlMs, 'NX'))) return null;
  const cur = await p.call(() => p.redis.get(lk));
  if (cur !== null && cur.startsWith(owner + ' ')) return null; // our SET landed, its reply was lost
  if (cur === null) {
    const ok = await p.call(() => p.redis.set(lk, value, 'PX', p.lockTtlMs, 'NX'));
    return ok ? null : { owner: '?', turn: 0, offset: 0 };
  }
  return parseLock(cur);
}

/** The user's message as a meta frame carries it (whole up to 2 KiB of UTF-8). */
export function messageMeta(text, max = META_MESSAGE_BYTES) {
  const raw = Buffer.from(text, 'utf8');
  if (raw.length <= max) return { message: text };
  let cut = max;
  while (cut > 0 && (raw[cut] & 0xc0) === 0x80) cut--; // whole code points
  return {
    message: raw.subarray(0, cut).toString('utf8'),
    message_truncated: true,
    message_chars: [...text].length,
    message_sha256: createHash('sha256').update(raw).digest('hex'),
  };
}
