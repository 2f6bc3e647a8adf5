// One turn being written: deltas and parts through the coalescing pump, its watch (lock refresh,
// stop record, viewers), its one terminal frame (the Python API's relay/producer/turn.py).
import { createHash } from 'node:crypto';
import { FrameTooLarge, LockLost, TurnClosed } from './errors.js';
import { MAX_DELTA_BYTES, chunks, key } from './frame.js';
import { TokenPump } from './coalesce.js';
import { PartError, Parts, checkType, isStreamed, partMeta, partsIntegrity } from './parts.js';
import { withRetry } from './generation.js';

/** Why the caller should stop generating (turn.stopReason, turn.signal.reason). */
export const StopReason = Object.freeze({
  CANCELLED: 'cancelled', // a client stopped the turn: it ends with done, finish_reason "cancelled"
  NO_VIEWERS: 'no viewers', // nobody watched for the grace period
  LOCK_LOST: 'lock lost', // the turn is no longer ours: write nothing more
});
export const CANCELLED = 'cancelled';

const int = (v) => (Number.isInteger(v) ? v : undefined);

/**
 * Usage as the done frame carries it: `usage` {prompt_tokens, completion_tokens,
 * total_tokens, cached_tokens} (what is known), `prompt_tokens` and `cached_tokens`
 * beside it as the worker writes them. Takes snake_case, camelCase or the AI SDK's
 * {inputTokens, outputTokens, totalTokens, cachedInputTokens}.
 */
export function usageMeta(u) {
  if (u == null) return {};
  const usage = {};
  const put = (k, ...names) => {
    for (const n of names) {
      const v = int(u[n]);
      if (v !== undefined) { usage[k] = v; return; }
    }
  };
  put('prompt_tokens', 'prompt_tokens', 'promptTokens', 'inputTokens');
  put('completion_tokens', 'completion_tokens', 'completionTokens', 'outputTokens');
  put('total_tokens', 'total_tokens', 'totalTokens');
  put('cached_tokens', 'cached_tokens', 'cachedTokens', 'cachedInputTokens');
  if (usage.cached_tokens === undefined) {
    const v = int(u.inputTokenDetails?.cacheReadTokens);
    if (v !== undefined) usage.cached_tokens = v;
  }
  const out = { usage };
  if (usage.prompt_tokens !== undefined) out.prompt_tokens = usage.prompt_tokens;
  if (usage.cached_tokens !== undefined) out.cached_tokens = usage.cached_tokens;
  return out;
}

/** tokens, chars (code points) and sha256 (hex of the UTF-8) of the reply. */
export function replyIntegrity(text, tokens) {
  return { tokens, chars: [...text].length, sha256: createHash('sha256').update(text, 'utf8').digest('hex') };
}

export class Turn {
  /**
   * @param {import('./producer.js').Producer} producer @param {string} sid
   * @param {string} owner @param {import('./generation.js').Generation} generation
   * @param {number} firstOffset @param {number} t0
   */
  constructor(producer, sid, owner, generation, firstOffset, t0) {
    this.producer = producer;
    this.sid = sid;
    this.owner = owner;
    this.generation = generation;
    this.firstOffset = firstOffset; // the turn's meta frame
    this.t0 = t0;
    /** @type {string[]} */
    this.deltas = [];
    /** @type {string | null} */
    this.stopReason = null;
    this.lockLost = false;
    /** @type {string | null} how it ended */
    this.how = null;
    /** @type {Record<string, unknown> | null} */
    this.pendingMeta = null;
    this.controller = new AbortController();
    /** Aborted when the turn should stop: pass it to the generation (streamText's abortSignal). */
    this.signal = this.controller.signal;
    /** @type {NodeJS.Timeout | null} */
    this.watchTimer = null;
    this.pump = new TokenPump((b) => this.publishBatch(b), producer.coalesce);
    /** The reply's parts (reasoning, tool calls, results, sources, usage, data). */
    this.parts = new Parts();
    /** @type {string | null} the reasoning part `reasoning()` appends to */
    this.reasoningId = null;
    this.ids = 0;
  }

  get turn() { return this.generation.turn; }
  get epoch() { return this.generation.epoch; }
  get nextOffset() { return this.generation.nextOffset; }
  get text() { return this.deltas.join(''); }
  get closed() { return this.how !== null; }

  /**
   * Append one delta (never waits: the pump publishes it, coalesced). `meta` goes into
   * the token frame that carries it. Throws TurnClosed, FrameTooLarge, LockLost, or what
   * stopped the pump (StaleEpoch, RedisUnreachable).
   * @param {string} text @param {Record<string, unknown>} [meta]
   */
  write(text, meta) {
    this.checkOpen();
    if (this.pump.failed) throw this.pump.failed;
    if (typeof text !== 'string') throw new TypeError('a delta is a string');
    if (!text) return;
    const size = Buffer.byteLength(text);
    if (size > MAX_DELTA_BYTES) throw new FrameTooLarge(this.sid, size, MAX_DELTA_BYTES);
    this.endReasoning(); // the text follows the reasoning `reasoning()` was writing
    if (meta) this.pendingMeta = { ...(this.pendingMeta ?? {}), ...meta };
    this.deltas.push(text);
    this.pump.push(text);
  }

  // ---- parts (docs/PROTOCOL.md, "Parts"): each checked first (PartError, nothing written)

  /** Start a streamed part (`reasoning`, `tool-call` with the tool's `name`). */
  partStart(part, id, { name = '', summary = false } = {}) {
    if (!isStreamed(checkType(part))) throw new PartError(`a ${part} part is whole: write it with part()`);
    this.applyPart({ part, id, phase: 'start', name, summary }, '');
  }

  /** Append `text` to a started part (coalesced like text). */
  partDelta(part, id, text) {
    if (typeof text !== 'string') throw new TypeError('a delta is a string');
    if (!text) return;
    const size = Buffer.byteLength(text);
    if (size > MAX_DELTA_BYTES) throw new FrameTooLarge(this.sid, size, MAX_DELTA_BYTES);
    this.applyPart({ part, id, phase: 'delta' }, text);
  }

  /** End a streamed part (a tool call's arguments must be JSON by now). */
  partEnd(part, id) { this.applyPart({ part, id, phase: 'end' }, ''); }

  /** A whole part (`tool-result`, `source`, `usage`, `data-<name>`): `value` as JSON. */
  part(part, id, value, { name = '', error = false } = {}) {
    if (isStreamed(checkType(part))) throw new PartError(`a ${part} part streams: partStart, partDelta, partEnd`);
    const text = JSON.stringify(value);
    if (text === undefined) throw new PartError("the part's value is not JSON");
    const size = Buffer.byteLength(text);
    if (size > MAX_DELTA_BYTES) throw new FrameTooLarge(this.sid, size, MAX_DELTA_BYTES);
    this.applyPart({ part, id, phase: null, name, error }, text);
  }

  /** Append to the reasoning part being written (started when none is, or when `id`
   * names another); the next text delta and done end it. Returns its id. */
  reasoning(text, { summary = false, id = null } = {}) {
    if (this.reasoningId === null || (id !== null && id !== this.reasoningId)) {
      this.endReasoning();
      const rid = id ?? `reasoning-${++this.ids}`;
      this.partStart('reasoning', rid, { summary });
      this.reasoningId = rid;
    }
    this.partDelta('reasoning', /** @type {string} */ (this.reasoningId), text);
    return /** @type {string} */ (this.reasoningId);
  }

  endReasoning() {
    const id = this.reasoningId;
    if (id === null) return;
    this.reasoningId = null;
    const p = this.parts.get('reasoning', id);
    if (p && !p.done) this.partEnd('reasoning', id);
  }

  /** `id` was ended by hand (partEnd): reasoning() starts a new part next time. */
  forgetReasoning(id) {
    if (this.reasoningId === id) this.reasoningId = null;
  }

  toolCallStart(id, name) { this.partStart('tool-call', id, { name }); }
  toolCallDelta(id, args) { this.partDelta('tool-call', id, args); }
  toolCallEnd(id) { this.partEnd('tool-call', id); }

  /** The complete call: arguments as JSON text or an object, checked before anything
   * is written. */
  toolCall(id, name, args) {
    const text = typeof args === 'string' ? args : JSON.stringify(args ?? {});
    if (this.parts.get('tool-call', id)) throw new PartError(`tool-call ${JSON.stringify(id)} was already started`);
    const probe = new Parts();
    probe.apply({ part: 'tool-call', id, phase: 'start', name }, '');
    probe.apply({ part: 'tool-call', id, phase: 'delta' }, text);
    probe.apply({ part: 'tool-call', id, phase: 'end' }, '');
    this.toolCallStart(id, name);
    this.toolCallDelta(id, text);
    this.toolCallEnd(id);
  }

  /** The result of the turn's finished call `id` (`error`: the tool failed). */
  toolResult(id, output, { error = false } = {}) {
    const call = this.parts.get('tool-call', id);
    this.part('tool-result', id, output, { name: call ? call.name : '', error });
  }

  source(url, { title, id } = {}) {
    const sid = id ?? `source-${++this.ids}`;
    this.part('source', sid, title === undefined ? { url } : { url, title });
    return sid;
  }

  usage(u, { id } = {}) {
    const uid = id ?? `usage-${++this.ids}`;
    this.part('usage', uid, usageMeta(u).usage ?? {});
    return uid;
  }

  /** An application's own part `data-<name>`. */
  data(name, value, { id } = {}) {
    const did = id ?? `data-${++this.ids}`;
    this.part(`data-${name}`, did, value);
    return did;
  }

  /** End the streamed parts still open (checked first: arguments that are not JSON
   * throw PartError and nothing is ended). */
  endOpenParts() {
    const open = this.parts.open();
    for (const p of open) {
      if (p.part !== 'tool-call') continue;
      const probe = new Parts();
      probe.apply({ part: p.part, id: p.id, phase: 'start', name: p.name }, '');
      probe.apply({ part: p.part, id: p.id, phase: 'delta' }, p.text);
      probe.apply({ part: p.part, id: p.id, phase: 'end' }, '');
    }
    for (const p of open) this.partEnd(p.part, p.id);
    this.reasoningId = null;
  }

  applyPart(ref, text) {
    this.checkOpen();
    if (this.pump.failed) throw this.pump.failed;
    this.parts.apply(ref, text);
    const meta = partMeta(ref);
    if (ref.phase === 'delta') this.pump.push(text, meta);
    else this.pump.put(meta, text);
  }

  /** Wait until every delta written is in Redis; throws what stopped the pump. */
  flush() {
    return this.pump.flush();
  }

  /**
   * End with done: `meta`, `usage`, then tokens, chars, sha256 and finishReason.
   * Resolves to its offset; the lock is given back.
   * @param {{finishReason?: string | null, usage?: object | null, meta?: Record<string, unknown>}} [opts]
   */
  async done({ finishReason = 'stop', usage = null, meta } = {}) {
    this.checkOpen();
    if (finishReason !== CANCELLED) this.endOpenParts(); // a stopped turn's stay partial
    try {
      await this.flush();
      const body = {
        duration_ms: Math.round((performance.now() - this.t0) * 10) / 10,
        ...usageMeta(usage),
        ...(meta ?? {}),
        ...replyIntegrity(this.text, this.deltas.length),
        ...partsIntegrity(this.parts.records),
        finish_reason: finishReason,
      };
      const at = await this.terminal({ kind: 'done', meta: body }, 'done');
      if (finishReason === CANCELLED) {
        const p = this.producer;
        await p.call(() => p.redis.trStopped(key(this.sid, 'cancel'), this.turn, at, p.ttlS)).catch(() => {});
      }
      return at;
    } finally {
      await this.close();
    }
  }

  /**
   * End with error (text = reason; meta.code, tokens written before it). Resolves to
   * its offset; the lock is given back.
   * @param {string} reason @param {{code?: string | null, meta?: Record<string, unknown>}} [opts]
   */
  async error(reason, { code = 'producer_error', meta } = {}) {
    this.checkOpen();
    try {
      await this.flush().catch(() => {}); // what was written goes first
      let body = null;
      if (code !== null) body = { code, tokens: this.deltas.length, ...(meta ?? {}) };
      else if (meta) body = { ...meta };
      return await this.terminal({ kind: 'error', text: String(reason), meta: body }, 'error');
    } finally {
      await this.close();
    }
  }

  async terminal(draft, how) {
    if (this.lockLost) throw new LockLost(`session ${this.sid}: turn ${this.turn} lost its turn lock`);
    this.how = how;
    this.parts.closed = true;
    return (await this.generation.publish([draft]))[0];
  }

  /** Stop the turn's helpers and give the lock back (no terminal frame: a relay's
   * reaper ends a turn left open once its lock is gone). */
  async close() {
    if (this.how === null) this.how = 'closed';
    if (this.watchTimer) clearTimeout(this.watchTimer);
    this.watchTimer = null;
    await Promise.race([this.pump.flush().catch(() => {}), new Promise((r) => setTimeout(r, 5000).unref())]);
    this.pump.stop();
    const p = this.producer;
    await p.call(() => p.redis.trLockRelease(key(this.sid, 'lock'), this.owner + ' ')).catch(() => {});
  }

  checkOpen() {
    if (this.how !== null) throw new TurnClosed(this.sid, this.turn, this.how);
    if (this.lockLost) throw new LockLost(`session ${this.sid}: turn ${this.turn} lost its turn lock`);
  }

  async publishBatch(b) {
    if (this.lockLost) return; // the stream is no longer ours
    if (b.part) { // a part's frame, or a run of one part's deltas
      const texts = Buffer.byteLength(b.text) > MAX_DELTA_BYTES ? chunks(b.text) : [b.text];
      await this.generation.publish(texts.map((t) => ({ kind: 'part', text: t, meta: b.part })));
      return;
    }
    let meta = this.pendingMeta;
    this.pendingMeta = null;
    if (b.count > 1) meta = { ...(meta ?? {}), n: b.count };
    let drafts = [{ kind: 'token', text: b.text, meta }];
    if (Buffer.byteLength(b.text) > MAX_DELTA_BYTES) {
      drafts = chunks(b.text).map((c, i) => ({ kind: 'token', text: c, meta: i === 0 ? meta : null }));
    }
    await this.generation.publish(drafts);
  }

  // ---- being told to stop ----------------------------------------------------------

  /** Call `cb(reason)` once when the turn should stop; at once if it has. */
  onStop(cb) {
    if (this.stopReason !== null) cb(this.stopReason);
    else this.signal.addEventListener('abort', () => cb(/** @type {string} */ (this.stopReason)), { once: true });
  }

  /** Resolves with the reason once the turn should stop. @returns {Promise<string>} */
  stopped() {
    return new Promise((resolve) => this.onStop(resolve));
  }

  /** Record that the turn should stop (the watch does; a caller may too). */
  stop(reason) {
    if (reason === StopReason.LOCK_LOST) this.lockLost = true;
    if (this.stopReason !== null) return;
    this.stopReason = reason;
    this.controller.abort(new DOMException(`turn stopped: ${reason}`, 'AbortError'));
  }

  /** Extend the lock and read the stop record (one round trip): 0 lost, 1 held, 2 stop asked. */
  async refresh() {
    const p = this.producer;
    const state = Number(await p.call(() => p.redis.trLockRefresh(
      key(this.sid, 'lock'), key(this.sid, 'cancel'), this.owner + ' ', p.lockTtlMs, this.turn)));
    if (state === 0) this.stop(StopReason.LOCK_LOST);
    else if (state === 2) this.stop(StopReason.CANCELLED);
    return state;
  }

  /** Start the watch: every presence.intervalMs refresh the lock and count the relays
   * with viewers; none for presence.graceMs: StopReason.NO_VIEWERS. Ends with the turn. */
  watch({ localWatchers } = {}) {
    const p = this.producer;
    const { graceMs, intervalMs } = p.presence;
    let lastWatched = performance.now();
    const tick = async () => {
      if (this.closed) return;
      await this.refresh().catch(() => {});
      let watchers = 1; // a failed read counts as watched: never stop for a failed control read
      try {
        watchers = Number(await withRetry(() => p.redis.trPresenceCount(key(this.sid, 'presence')), intervalMs));
      } catch {}
      if (localWatchers) watchers += localWatchers();
      if (this.closed) return;
      const now = performance.now();
      if (watchers > 0) lastWatched = now;
      else if (now - lastWatched >= graceMs) {
        this.stop(StopReason.NO_VIEWERS);
        return;
      }
      this.watchTimer = setTimeout(tick, intervalMs);
    };
    this.watchTimer = setTimeout(tick, intervalMs);
  }
}
