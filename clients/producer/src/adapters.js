// Whole streams into one turn, in one call (the Python API's relay/producer/adapters.py):
// any AsyncIterable<string>, the AI SDK's streamText result (its fullStream, then its
// finishReason and totalUsage), its UI message stream (toUIMessageStream() chunks) and
// the openai SDK's chat-completion chunks, with every part they carry (docs/PROTOCOL.md,
// "Parts"): reasoning, tool calls with their input deltas, tool results, sources, data-*.
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

/** A tool call's input, streamed or whole, into the turn once. */
function callInput(turn, id, name, input) {
  const p = turn.parts.get('tool-call', id);
  const text = typeof input === 'string' ? input : JSON.stringify(input ?? {});
  if (!p) { turn.toolCall(id, name, text); return; }
  if (p.done) return;
  if (!p.text) turn.toolCallDelta(id, text || '{}');
  turn.toolCallEnd(id);
}

/** One AI SDK part (a UI message chunk, or a streamText fullStream part) besides text. */
function sdkPart(turn, c) {
  const t = c.type;
  if (t === 'reasoning-start') turn.partStart('reasoning', String(c.id));
  else if (t === 'reasoning-delta') {
    const text = c.delta ?? c.text;
    if (!turn.parts.get('reasoning', String(c.id))) turn.partStart('reasoning', String(c.id));
    if (typeof text === 'string') turn.partDelta('reasoning', String(c.id), text);
  } else if (t === 'reasoning-end') {
    const p = turn.parts.get('reasoning', String(c.id));
    if (p && !p.done) turn.partEnd('reasoning', String(c.id));
  } else if (t === 'tool-input-start') turn.toolCallStart(String(c.toolCallId ?? c.id), String(c.toolName));
  else if (t === 'tool-input-delta') turn.toolCallDelta(String(c.toolCallId ?? c.id), String(c.inputTextDelta ?? c.delta ?? ''));
  else if (t === 'tool-input-available' || t === 'tool-call') callInput(turn, String(c.toolCallId), String(c.toolName), c.input);
  else if (t === 'tool-output-available' || t === 'tool-result') turn.toolResult(String(c.toolCallId), c.output ?? null);
  else if (t === 'tool-output-error' || t === 'tool-error') turn.toolResult(String(c.toolCallId), String(c.errorText ?? c.error ?? 'the tool failed'), { error: true });
  else if ((t === 'source-url' || (t === 'source' && c.sourceType === 'url')) && typeof c.url === 'string') {
    turn.source(c.url, { title: typeof c.title === 'string' ? c.title : undefined, id: c.sourceId ?? c.id });
  } else if (typeof t === 'string' && t.startsWith('data-') && !c.transient) turn.data(t.slice(5), c.data ?? null, { id: c.id });
}

async function consumeUi(turn, it, end) {
  for (;;) {
    const { done, value } = await it.next();
    if (done) return;
    const c = value ?? {};
    if (c.type === 'text-delta' && typeof (c.delta ?? c.text) === 'string') turn.write(c.delta ?? c.text);
    else if (c.type === 'finish') {
      if (typeof c.finishReason === 'string') end.finishReason = c.finishReason;
      const md = c.messageMetadata;
      if (md && typeof md === 'object' && md.usage) end.usage = md.usage;
    } else if (c.type === 'message-metadata' && c.messageMetadata?.usage) end.usage = c.messageMetadata.usage;
    else if (c.type === 'error') end.failed = String(c.errorText ?? c.error ?? 'the stream failed');
    else if (c.type === 'abort') end.finishReason = CANCELLED;
    else sdkPart(turn, c);
  }
}

/** The openai SDK's chat-completion chunks: content, reasoning_content, tool_calls. */
async function consumeChat(turn, it, end) {
  const ids = new Map();
  for (;;) {
    const { done, value } = await it.next();
    if (done) break;
    if (value?.usage) end.usage = value.usage;
    for (const ch of value?.choices ?? []) {
      if ((ch.index ?? 0) !== 0) continue;
      const d = ch.delta ?? {};
      const thought = d.reasoning_content ?? d.reasoning;
      if (typeof thought === 'string' && thought) turn.reasoning(thought);
      if (typeof d.content === 'string' && d.content) turn.write(d.content);
      for (const tc of d.tool_calls ?? []) {
        const n = tc.index ?? 0;
        if (!ids.has(n) && tc.function?.name) {
          ids.set(n, tc.id || `call_${n}`);
          turn.toolCallStart(ids.get(n), tc.function.name);
        }
        if (ids.has(n) && tc.function?.arguments) turn.toolCallDelta(ids.get(n), tc.function.arguments);
      }
      if (typeof ch.finish_reason === 'string') end.finishReason = ch.finish_reason;
    }
  }
  for (const id of ids.values()) {
    const p = turn.parts.get('tool-call', id);
    if (p && !p.done) { if (!p.text) turn.toolCallDelta(id, '{}'); turn.toolCallEnd(id); }
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
    const why = err?.name === 'PartError' ? `the stream's parts: ${err.message}` : `the stream failed: ${err?.name ?? 'Error'}`;
    await turn.error(why, { code: 'producer_error' }).catch(() => {});
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
  try {
    return await turn.done({ finishReason: end.finishReason ?? 'stop', usage: end.usage });
  } catch (err) { // an open call's arguments are not JSON: said, not stored
    if (err?.name !== 'PartError' || turn.closed) throw err;
    await turn.error(`the stream's parts: ${err.message}`, { code: 'producer_error' });
    throw err;
  }
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

/** The openai SDK's `chat.completions.create({stream: true})` chunks. */
export function pipeChatCompletion(turn, stream) {
  return run(turn, iteratorOf(stream), consumeChat, { finishReason: 'stop' });
}

/** The AI SDK's `streamText(...)` result: its fullStream (text, reasoning, tool calls
 * and results, sources; its textStream where it has none), then its finishReason and
 * totalUsage (usage on older versions) into done. */
export function pipeStreamText(turn, result) {
  const end = { finishReason: 'stop' };
  const full = result.fullStream;
  const source = full ? iteratorOf(full) : iteratorOf(result.textStream);
  return run(turn, source, full ? consumeUi : consumeText, end, async () => {
    const [reason, usage] = await Promise.all([
      Promise.resolve(result.finishReason).catch(() => undefined),
      Promise.resolve(result.totalUsage ?? result.usage).catch(() => undefined),
    ]);
    if (typeof reason === 'string') end.finishReason = reason;
    if (usage) end.usage = usage;
  });
}

/** Whichever `source` is: a streamText result, a stream of strings, of UI message chunks
 * or of chat-completion chunks. */
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
  if (head.value && Array.isArray(head.value.choices)) return run(turn, again, consumeChat, { finishReason: 'stop' });
  if (head.value && typeof head.value.type === 'string') return run(turn, again, consumeUi, { finishReason: 'stop' });
  await turn.error('unknown stream item', { code: 'producer_error' });
  throw new TypeError(`cannot stream items of type ${typeof head.value}`);
}
