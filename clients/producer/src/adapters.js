// Whole streams into one turn, in one call (the Python API's relay/producer/adapters.py):
// any AsyncIterable<string>, the AI SDK's streamText result (its textStream, then its
// finishReason and totalUsage) and its UI message stream (toUIMessageStream() chunks).
// Each writes the deltas, ends the turn with done (usage and finish reason carried in)
// and resolves to the terminal frame's offset. When the turn is told to stop the source
// is closed (its iterator's return(): the upstream request ends) and the turn ends:
// done "cancelled" for a client's stop, error "no viewers" when nobody watches,
// nothing when the lock was lost. A source that throws ends the turn with error and
// the error is thrown on.
import { ProducerError } from './errors.js';
import { CANCELLED, StopReason } from './turn.js';

/** @typedef {{usage?: object | null, finishReason?: string | null, failed?: string | null}} End */

/** @param {any} source */
function iteratorOf(source) {
  if (source && typeof source[Symbol.asyncIterator] === 'function') return source[Symbol.asyncIterator]();
  if (source && typeof source.getReader === 'function') {
    const reader = source.getReader();
    return {
      next: () => reader.read(),
      return: async () => { await reader.cancel(); return { done: true, value: undefined }; },
    };
  }
  throw new TypeError('not an async iterable or a ReadableStream');
}

async function consumeText(turn, it, end) {
  for (;;) {
    const { done, value } = await it.next();
    if (done) return;
    if (typeof value !== 'string') throw new TypeError('a text stream yields strings');
    turn.write(value);
  }
}

async function consumeUi(turn, it, end) {
  for (;;) {
    const { done, value } = await it.next();
    if (done) return;
    const c = value ?? {};
    if (c.type === 'text-delta' && typeof c.delta === 'string') turn.write(c.delta);
    else if (c.type === 'finish') {
      if (typeof c.finishReason === 'string') end.finishReason = c.finishReason;
      const md = c.messageMetadata;
      if (md && typeof md === 'object' && md.usage) end.usage = md.usage;
    } else if (c.type === 'message-metadata' && c.messageMetadata?.usage) end.usage = c.messageMetadata.usage;
    else if (c.type === 'error') end.failed = String(c.errorText ?? 'the stream failed');
    else if (c.type === 'abort') end.finishReason = CANCELLED;
  }
}

/** @param {import('./turn.js').Turn} turn @param {any} it @param {Function} consume @param {End} end @param {() => Promise<void>} [after] */
async function run(turn, it, consume, end, after) {
  const reading = (async () => {
    await consume(turn, it, end);
    if (after) await after();
  })();
  const stop = turn.stopped().then(() => 'stop');
  const first = await Promise.race([reading.then(() => 'read', (err) => ({ err })), stop]);
  if (first === 'stop') {
    reading.catch(() => {});
    await Promise.resolve(it.return?.()).catch(() => {});
  } else if (first !== 'read') {
    const { err } = first;
    if (err instanceof ProducerError || turn.closed) {
      if (!turn.closed) await turn.close();
      throw err;
    }
    await turn.error(`the stream failed: ${err?.name ?? 'Error'}`, { code: 'producer_error' }).catch(() => {});
    throw err;
  }
  const reason = turn.stopReason;
  if (reason === StopReason.LOCK_LOST) {
    await turn.close();
    return 0;
  }
  if (reason === StopReason.NO_VIEWERS) return turn.error('no viewers', { code: 'no_viewers' });
  if (reason === StopReason.CANCELLED) return turn.done({ finishReason: CANCELLED, usage: end.usage });
  if (end.failed != null) return turn.error(end.failed, { code: 'producer_error' });
  return turn.done({ finishReason: end.finishReason ?? 'stop', usage: end.usage });
}

/** Every string of `source` (AsyncIterable<string> or ReadableStream<string>) as a delta, then done. */
export function pipeText(turn, source) {
  return run(turn, iteratorOf(source), consumeText, { finishReason: 'stop' });
}

/** The AI SDK's UI message stream (`result.toUIMessageStream()`): text-delta chunks;
 * finish (its finishReason; `messageMetadata.usage` if the stream carries it) into done;
 * an error chunk ends the turn with error. */
export function pipeUIMessageStream(turn, stream) {
  return run(turn, iteratorOf(stream), consumeUi, { finishReason: 'stop' });
}

/** The AI SDK's `streamText(...)` result: its textStream, then its finishReason and
 * totalUsage (usage on older versions) into done. */
export function pipeStreamText(turn, result) {
  const end = { finishReason: 'stop' };
  return run(turn, iteratorOf(result.textStream), consumeText, end, async () => {
    const [reason, usage] = await Promise.all([
      Promise.resolve(result.finishReason).catch(() => undefined),
      Promise.resolve(result.totalUsage ?? result.usage).catch(() => undefined),
    ]);
    if (typeof reason === 'string') end.finishReason = reason;
    if (usage) end.usage = usage;
  });
}

/** Whichever `source` is: a streamText result, a stream of strings or of UI message chunks. */
export async function pipe(turn, source) {
  if (source && source.textStream && 'finishReason' in source) return pipeStreamText(turn, source);
  const it = iteratorOf(source);
  const head = await it.next();
  if (head.done) return turn.done();
  let sent = false;
  const again = {
    next: () => { if (!sent) { sent = true; return Promise.resolve(head); } return it.next(); },
    return: () => Promise.resolve(it.return?.()),
  };
  if (typeof head.value === 'string') return run(turn, again, consumeText, { finishReason: 'stop' });
  if (head.value && typeof head.value.type === 'string') return run(turn, again, consumeUi, { finishReason: 'stop' });
  await turn.error('unknown stream item', { code: 'producer_error' });
  throw new TypeError(`cannot stream items of type ${typeof head.value}`);
}
