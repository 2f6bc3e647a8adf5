// One fenced generation of a session: the publish script's caller (the Python
// relay/broker/rediscluster/publisher.py's Generation, line for line in its rules).
// A publish runs publish.lua once: it checks the epoch (FENCED: nothing written) and
// the expected offset, XADDs and SPUBLISHes each frame. Retries are safe: a batch
// whose reply was lost answers OFFSET <our end> and is not written again; after a
// failover that lost our last frames (OFFSET below ours) they are written again, same
// bytes at the same offsets, before the new batch.
import { randomBytes } from 'node:crypto';
import { FrameTooLarge, RedisUnreachable, StaleEpoch, isReplyError } from './errors.js';
import { MAX_FRAME_BYTES, encode, key } from './frame.js';

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * Run `call` until Redis answers: transport failures are retried (backoff 50 ms .. 0.5 s)
 * for `retryMs`, then RedisUnreachable; a reply error is thrown as it is.
 * @template T @param {() => Promise<T>} call @param {number} retryMs @returns {Promise<T>}
 */
export async function withRetry(call, retryMs) {
  const deadline = Date.now() + retryMs;
  let backoff = 50;
  for (;;) {
    try {
      const left = deadline - Date.now();
      let timer;
      const late = new Promise((_, reject) => {
        timer = setTimeout(() => reject(new Error(`no answer in ${retryMs} ms`)), Math.max(1, left));
      });
      try {
        return await Promise.race([call(), late]);
      } finally {
        clearTimeout(timer);
      }
    } catch (err) {
      if (isReplyError(err)) throw err;
      if (Date.now() + backoff > deadline) {
        throw new RedisUnreachable(`redis unreachable: ${/** @type {Error} */ (err).message}`);
      }
      await sleep(backoff);
      backoff = Math.min(backoff * 2, 500);
    }
  }
}

export class Generation {
  /**
   * @param {import('./producer.js').Producer} producer
   * @param {string} session @param {number} epoch @param {number} turn
   * @param {number} offset @param {string} gen
   */
  constructor(producer, session, epoch, turn, offset, gen) {
    this.producer = producer;
    this.session = session;
    this.epoch = epoch;
    this.turn = turn;
    this.offset = offset; // the last offset written; the next frame gets offset + 1
    this.gen = gen;
    /** @type {Map<number, string>} the frames written, to write again after a failover */
    this.written = new Map();
    this.rewritten = 0;
    /** @type {Promise<unknown>} publishes of one generation are serialized */
    this.queue = Promise.resolve();
  }

  get nextOffset() {
    return this.offset + 1;
  }

  /** @param {import('./producer.js').Producer} p @param {string} sid */
  static async open(p, sid) {
    const fresh = randomBytes(6).toString('hex');
    // a turn still open (its producer died) is ended by the script first: its error frame
    // (superseded) at the next offset, kept with the frames written (for a failover)
    const reply = await p.call(() => p.redis.trOpen(
      key(sid, 'meta'), key(sid, 'log'), key(sid, 'live'), p.ttlS, fresh, sid, Date.now(),
      p.maxlen, p.maxBytes));
    const [epoch, turn, offset] = reply.slice(0, 3).map(Number);
    const g = new Generation(p, sid, epoch, turn, offset, String(reply[3]));
    if (reply.length > 4) g.written.set(offset, String(reply[4]));
    return g;
  }

  /**
   * Append and SPUBLISH `drafts` ({kind, text?, meta?}) in one round trip; their offsets.
   * @param {{kind: string, text?: string, meta?: Record<string, unknown> | null}[]} drafts
   * @returns {Promise<number[]>}
   */
  publish(drafts) {
    const run = this.queue.then(() => this.publishNow(drafts));
    this.queue = run.catch(() => {});
    return run;
  }

  async publishNow(drafts) {
    if (!drafts.length) return [];
    const base = this.offset;
    const ts = Date.now();
    const payload = drafts.map((d, i) => encode({
      session: this.session, turn: this.turn, offset: base + i + 1, kind: d.kind, text: d.text,
      epoch: this.epoch, ts, meta: d.meta ? { ...d.meta, gen: this.gen } : { gen: this.gen },
    }));
    for (const data of payload) {
      const size = Buffer.byteLength(data);
      if (size > MAX_FRAME_BYTES) throw new FrameTooLarge(this.session, size, MAX_FRAME_BYTES);
    }
    const kind = drafts[drafts.length - 1].kind;
    const last = await this.write(base, payload, kind === 'done' || kind === 'error');
    const keep = this.producer.keepFrames;
    payload.forEach((data, i) => this.written.set(base + i + 1, data));
    for (const o of this.written.keys()) {
      if (this.written.size <= keep) break;
      this.written.delete(o);
    }
    this.offset = last;
    const out = [];
    for (let o = base + 1; o <= last; o++) out.push(o);
    return out;
  }

  /**
   * Run the publish script after offset `base` (what a retry after a lost reply sends
   * again, too); the last offset written.
   * @param {number} base @param {string[]} payload @param {boolean} terminal @returns {Promise<number>}
   */
  async write(base, payload, terminal) {
    const p = this.producer;
    const sid = this.session;
    for (;;) {
      let current;
      try {
        const r = await p.call(() => p.redis.trPublish(
          key(sid, 'meta'), key(sid, 'log'), key(sid, 'live'),
          this.epoch, base, p.maxlen, p.ttlS, terminal ? 1 : 0, this.turn, this.gen, p.maxBytes,
          Date.now(), ...payload,
        ));
        return Number(r);
      } catch (err) {
        const msg = /** @type {Error} */ (err).message;
        if (msg.startsWith('FENCED ')) throw new StaleEpoch(sid, this.epoch, Number(msg.split(' ')[1]));
        if (!msg.startsWith('OFFSET ')) throw err;
        current = Number(msg.split(' ')[1]);
      }
      if (current === base + payload.length) return current; // our batch landed; its reply was lost
      const lost = [];
      for (let o = current + 1; o <= base; o++) lost.push(o);
      if (current < base && lost.every((o) => this.written.has(o))) {
        this.rewritten += lost.length;
        await this.write(current, lost.map((o) => /** @type {string} */ (this.written.get(o))), false);
        continue;
      }
      throw new Error(`session ${sid}: expected offset ${base}, found ${current}`);
    }
  }
}
