// Token coalescing, as the worker does it (the Python API's relay/producer/coalesce.py):
// pending deltas go out as one token frame when `maxTokens` are pending or the oldest
// has waited `maxDelayMs`, whichever first; the first delta of a turn goes at once, so
// coalescing never adds to the time to first token. `{maxTokens: 1}`: one frame per delta.
// A reply's parts go through the same pump, in the order they are written: one part's
// deltas coalesce like text (`part` names what is pending), and a change of what is
// pending, or a part's start, end or whole frame (`put`), first flushes what is pending.

/** @typedef {{maxTokens: number, maxDelayMs: number, firstImmediate: boolean}} CoalescePolicy */

/** The worker's defaults: 8 deltas or 50 ms. @type {Readonly<CoalescePolicy>} */
export const DEFAULT_POLICY = Object.freeze({ maxTokens: 8, maxDelayMs: 50, firstImmediate: true });

/** @param {Partial<CoalescePolicy>} [p] @returns {CoalescePolicy} */
export function policy(p = {}) {
  const out = { ...DEFAULT_POLICY, ...p };
  if (!(Number.isInteger(out.maxTokens) && out.maxTokens >= 1)) {
    throw new RangeError('maxTokens must be an integer >= 1');
  }
  if (!(out.maxDelayMs >= 0)) throw new RangeError('maxDelayMs must be >= 0');
  return out;
}

/** The pure core: the caller passes the time (ms). */
export class Coalescer {
  /** @param {CoalescePolicy} p */
  constructor(p = DEFAULT_POLICY) {
    this.policy = p;
    /** @type {string[]} */
    this.texts = [];
    this.oldest = 0;
    this.seen = 0;
    /** @type {Record<string, unknown> | null} what is pending: null text, else a part's delta */
    this.part = null;
  }

  /** The next deltas are `part`'s (null: text): what is pending of anything else. */
  switchTo(part, now) {
    if (part === this.part || (part && this.part && part.part === this.part.part && part.id === this.part.id)) return null;
    const b = this.texts.length ? this.take() : null;
    this.part = part;
    return b;
  }

  /** Add one delta; the batch `{text, count}` to publish if the count rule fired. */
  push(text, now) {
    if (this.texts.length === 0) this.oldest = now;
    this.texts.push(text);
    this.seen += 1;
    const p = this.policy;
    if (this.texts.length >= p.maxTokens || (p.firstImmediate && this.seen === 1) || p.maxDelayMs === 0) {
      return this.take();
    }
    return null;
  }

  /** When the oldest pending delta must go (ms), or null. */
  deadline() {
    return this.texts.length ? this.oldest + this.policy.maxDelayMs : null;
  }

  poll(now) {
    const d = this.deadline();
    return d === null || now < d ? null : this.take();
  }

  flush() {
    return this.texts.length ? this.take() : null;
  }

  take() {
    /** @type {{text: string, count: number, part?: Record<string, unknown>}} */
    const batch = { text: this.texts.join(''), count: this.texts.length };
    if (this.part) batch.part = this.part;
    this.texts = [];
    return batch;
  }
}

/**
 * Drives a Coalescer: `push` never waits; batches are published one after another
 * through `publish(batch)`; the first failure stops the pump and is kept (`failed`).
 */
export class TokenPump {
  /** @param {(b: {text: string, count: number}) => Promise<unknown>} publish @param {CoalescePolicy} p */
  constructor(publish, p = DEFAULT_POLICY) {
    this.publish = publish;
    this.core = new Coalescer(p);
    /** @type {{text: string, count: number}[]} */
    this.ready = [];
    /** @type {Promise<void> | null} */
    this.draining = null;
    /** @type {NodeJS.Timeout | null} */
    this.timer = null;
    /** @type {Error | null} */
    this.failed = null;
    this.batches = 0;
  }

  /** One delta of the text, or of `part` (a part frame's meta). */
  push(text, part = null) {
    const before = this.core.switchTo(part, performance.now());
    if (before) this.enqueue(before);
    const b = this.core.push(text, performance.now());
    if (b) this.enqueue(b);
    else this.arm();
  }

  /** One frame of a part as it is (a start, an end, a whole part), after what is pending. */
  put(part, text = '') {
    const before = this.core.flush();
    if (before) this.enqueue(before);
    this.enqueue({ text, count: 0, part });
  }

  arm() {
    const d = this.core.deadline();
    if (d === null || this.timer) return;
    this.timer = setTimeout(() => {
      this.timer = null;
      const b = this.core.poll(performance.now());
      if (b) this.enqueue(b);
      this.arm();
    }, Math.max(0, d - performance.now()));
  }

  enqueue(b) {
    this.ready.push(b);
    if (!this.draining) this.draining = this.drain();
  }

  async drain() {
    try {
      while (this.ready.length && !this.failed) {
        const b = /** @type {{text: string, count: number}} */ (this.ready.shift());
        try {
          await this.publish(b);
          this.batches += 1;
        } catch (err) {
          this.failed = /** @type {Error} */ (err);
        }
      }
    } finally {
      this.draining = null;
    }
  }

  /** Publish what is pending and wait until every batch is out (or one failed). */
  async flush() {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    const tail = this.core.flush();
    if (tail) this.enqueue(tail);
    while (this.draining) await this.draining;
    if (this.failed) throw this.failed;
  }

  stop() {
    if (this.timer) clearTimeout(this.timer);
    this.timer = null;
    this.ready = [];
  }
}
