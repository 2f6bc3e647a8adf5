// Whole streams into one turn, in one call (the Python API's relay/producer/adapters.py):
// any AsyncIterable<string>, the AI SDK's streamText result (its fullStream, then its
// finishReason and totalUsage), its UI message stream (toUIMessageStream() chunks), the
// openai SDK's chat-completion chunks and its Responses stream events, and LangChain's
// message chunks (AIMessageChunk, alone or as LangGraph's [chunk, metadata] pairs), with
// every part they carry (docs/PROTOCOL.md, "Parts"): reasoning, tool calls with their
// input deltas, tool results, sources, data-*. The chat, Responses and LangChain
// adapters are the Python ones rule for rule (the conformance suite pipes the same
// streams through both).
// Each writes the deltas, ends the turn with done (usage and finish reason carried in)
// and resolves to the terminal frame's offset. When the turn is told to stop the source
// is closed (its iterator's return(): the upstream request ends) and the turn ends:
// done "cancelled" for a client's stop, error "no viewers" when nobody watches,
// nothing when the lock was lost. A source that throws ends the turn with error and
// the error is thrown on.
import { ProducerError } from './errors.js';
import { PartError } from './parts.js';
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

const count = (v) => (Number.isInteger(v) && v >= 0 ? v : undefined);

/** An OpenAI chat-completions usage as the done frame's usage. */
function chatUsage(u) {
  if (u == null) return null;
  return {
    prompt_tokens: count(u.prompt_tokens), completion_tokens: count(u.completion_tokens),
    total_tokens: count(u.total_tokens), cached_tokens: count(u.prompt_tokens_details?.cached_tokens),
  };
}

/** An OpenAI Responses usage as the done frame's usage. */
function responsesUsage(u) {
  if (u == null) return null;
  return {
    prompt_tokens: count(u.input_tokens), completion_tokens: count(u.output_tokens),
    total_tokens: count(u.total_tokens), cached_tokens: count(u.input_tokens_details?.cached_tokens),
  };
}

/** Tool calls streamed by index (chat completions' delta.tool_calls, LangChain's
 * tool_call_chunks): the first chunk of an index that names the tool starts the call
 * (its id, else call_<index>); argument pieces before the name are held. */
class Calls {
  constructor(turn) {
    this.turn = turn;
    this.ids = new Map();
    this.names = new Map();
    this.held = new Map();
    this.sent = new Map(); // call id -> any argument sent
  }

  chunk(index, cid, name, args) {
    if (!this.ids.has(index) && typeof cid === 'string' && cid) this.ids.set(index, cid);
    if (!this.names.has(index) && typeof name === 'string' && name) {
      this.names.set(index, name);
      if (!this.ids.has(index)) this.ids.set(index, `call_${index}`);
      const call = this.ids.get(index);
      this.turn.toolCallStart(call, name);
      this.sent.set(call, false);
      for (const piece of this.held.get(index) ?? []) this.args(call, piece);
      this.held.delete(index);
    }
    if (typeof args === 'string' && args) {
      if (this.names.has(index)) this.args(this.ids.get(index), args);
      else this.held.set(index, [...(this.held.get(index) ?? []), args]);
    }
  }

  args(call, text) {
    this.turn.toolCallDelta(call, text);
    this.sent.set(call, true);
  }

  /** End the calls still open (a call whose arguments never came: {}). */
  end() {
    for (const [call, sent] of this.sent) {
      const p = this.turn.parts.get('tool-call', call);
      if (p && !p.done) {
        if (!sent) this.turn.toolCallDelta(call, '{}');
        this.turn.toolCallEnd(call);
      }
    }
  }
}

/** The openai SDK's chat-completion chunks: content, reasoning_content, tool_calls. */
async function consumeChat(turn, it, end) {
  const calls = new Calls(turn);
  for (;;) {
    const { done, value } = await it.next();
    if (done) break;
    if (value?.usage) end.usage = chatUsage(value.usage);
    for (const ch of value?.choices ?? []) {
      if ((ch.index ?? 0) !== 0) continue; // n > 1: the first choice is the turn's reply
      const d = ch.delta ?? {};
      const thought = d.reasoning_content || d.reasoning;
      if (typeof thought === 'string' && thought) turn.reasoning(thought);
      if (typeof d.content === 'string' && d.content) turn.write(d.content);
      for (const tc of d.tool_calls ?? []) calls.chunk(tc.index || 0, tc.id, tc.function?.name, tc.function?.arguments);
      if (typeof ch.finish_reason === 'string') end.finishReason = ch.finish_reason;
    }
  }
  turn.endReasoning();
  calls.end();
}

const blockText = (block, ...names) => {
  for (const n of names) if (typeof block?.[n] === 'string') return block[n];
  return '';
};

/** LangChain's message chunks (AIMessageChunk), or LangGraph's [chunk, metadata] pairs. */
async function consumeLangChain(turn, it, end) {
  const calls = new Calls(turn);
  for (;;) {
    const { done, value } = await it.next();
    if (done) break;
    const chunk = Array.isArray(value) && value.length ? value[0] : value;
    const thought = chunk?.additional_kwargs?.reasoning_content;
    if (typeof thought === 'string' && thought) turn.reasoning(thought);
    const content = chunk?.content;
    if (typeof content === 'string' && content) turn.write(content);
    else if (Array.isArray(content)) { // content blocks: text and reasoning / thinking
      for (const block of content) {
        if (typeof block === 'string') { if (block) turn.write(block); }
        else if (block?.type === 'reasoning' || block?.type === 'thinking') {
          const t = blockText(block, 'reasoning', 'thinking', 'text');
          if (t) turn.reasoning(t);
        } else if (block?.type === 'text') {
          const t = blockText(block, 'text');
          if (t) turn.write(t);
        }
      }
    }
    for (const tc of chunk?.tool_call_chunks ?? []) calls.chunk(tc.index || 0, tc.id, tc.name, tc.args);
    const um = chunk?.usage_metadata;
    if (um != null) {
      end.usage = { prompt_tokens: count(um.input_tokens), completion_tokens: count(um.output_tokens),
        total_tokens: count(um.total_tokens) };
    }
    const reason = chunk?.response_metadata?.finish_reason;
    if (typeof reason === 'string') end.finishReason = reason;
  }
  calls.end();
}

/** The Responses API's output items: function calls by item id (their part id is the
 * call's call_id), reasoning and its summaries. */
class Items {
  constructor(turn) {
    this.turn = turn;
    this.calls = new Map(); // item id -> call id
    this.sent = new Map();
  }

  added(item) {
    if (item?.type !== 'function_call') return;
    const iid = String(item.id || item.call_id);
    const call = String(item.call_id || iid);
    this.calls.set(iid, call);
    this.sent.set(call, false);
    this.turn.toolCallStart(call, String(item.name || ''));
  }

  args(iid, delta) {
    const call = this.calls.get(String(iid));
    if (call === undefined) throw new PartError(`function call arguments for item '${String(iid)}', never added`); // Python's words
    if (typeof delta === 'string' && delta) {
      this.turn.toolCallDelta(call, delta);
      this.sent.set(call, true);
    }
  }

  callDone(iid, args) {
    const call = this.calls.get(String(iid));
    if (call === undefined) return;
    const p = this.turn.parts.get('tool-call', call);
    if (!p || p.done) return;
    if (!this.sent.get(call)) this.turn.toolCallDelta(call, typeof args === 'string' && args ? args : '{}');
    this.turn.toolCallEnd(call);
  }

  reasoning(id, delta, summary = false) {
    if (typeof delta === 'string' && delta) this.turn.reasoning(delta, { id, summary });
  }

  reasoningDone(id) {
    const p = this.turn.parts.get('reasoning', id);
    if (p && !p.done) {
      this.turn.partEnd('reasoning', id);
      this.turn.forgetReasoning(id);
    }
  }
}

/** The openai SDK's Responses stream events. */
async function consumeResponses(turn, it, end) {
  const items = new Items(turn);
  const summaryId = (e) => `${e.item_id}-summary-${e.summary_index || 0}`;
  for (;;) {
    const { done, value: e } = await it.next();
    if (done) break;
    const kind = e?.type;
    if (kind === 'response.output_text.delta') { if (typeof e.delta === 'string' && e.delta) turn.write(e.delta); }
    else if (kind === 'response.output_item.added') items.added(e.item);
    else if (kind === 'response.function_call_arguments.delta') items.args(e.item_id, e.delta);
    else if (kind === 'response.function_call_arguments.done') items.callDone(e.item_id, e.arguments);
    else if (kind === 'response.output_item.done') {
      if (e.item?.type === 'function_call') items.callDone(e.item.id || e.item.call_id, e.item.arguments);
    } else if (kind === 'response.reasoning_text.delta' || kind === 'response.reasoning.delta') items.reasoning(String(e.item_id), e.delta);
    else if (kind === 'response.reasoning_text.done') items.reasoningDone(String(e.item_id));
    else if (kind === 'response.reasoning_summary_text.delta') items.reasoning(summaryId(e), e.delta, true);
    else if (kind === 'response.reasoning_summary_text.done') items.reasoningDone(summaryId(e));
    else if (kind === 'response.output_text.annotation.added') {
      const note = e.annotation;
      if (note?.type === 'url_citation' && typeof note.url === 'string') {
        turn.source(note.url, { title: typeof note.title === 'string' ? note.title : undefined });
      }
    } else if (kind === 'response.completed' || kind === 'response.incomplete' || kind === 'response.failed') {
      const r = e.response;
      end.usage = responsesUsage(r?.usage);
      if (kind === 'response.incomplete') end.finishReason = String(r?.incomplete_details?.reason || 'incomplete');
      else if (kind === 'response.failed') end.failed = String(r?.error?.message || 'the response failed');
    } else if (kind === 'error') end.failed = String(e.message || 'the response failed');
  }
  if (items.calls.size && end.finishReason === 'stop') end.finishReason = 'tool_calls'; // as chat completions says it
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
    // a PartError is a ProducerError too, but the turn is sound: it ends with error
    if ((err instanceof ProducerError && err.name !== 'PartError') || turn.closed) {
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

/** The openai SDK's `chat.completions.create({stream: true})` chunks: each chunk's first
 * choice's delta.content, reasoning_content (or reasoning) and tool_calls; finish_reason
 * and usage (ask for it with stream_options: {include_usage: true}) into done. */
export function pipeChatCompletion(turn, stream) {
  return run(turn, iteratorOf(stream), consumeChat, { finishReason: 'stop' });
}

/** The openai SDK's `responses.create({stream: true})` events: output_text deltas,
 * function calls (output_item.added, function_call_arguments.delta / .done), reasoning
 * text and summaries, URL citations as sources; response.completed / .incomplete (its
 * reason as finishReason) usage into done; response.failed and error events end the
 * turn with error. Arguments for an item never added are a PartError. */
export function pipeResponses(turn, stream) {
  return run(turn, iteratorOf(stream), consumeResponses, { finishReason: 'stop' });
}

/** LangChain's `stream()` of message chunks (AIMessageChunk: content as text or blocks,
 * tool_call_chunks, additional_kwargs.reasoning_content, usage_metadata,
 * response_metadata.finish_reason), or LangGraph's streamMode "messages" pairs. */
export function pipeLangChain(turn, stream) {
  return run(turn, iteratorOf(stream), consumeLangChain, { finishReason: 'stop' });
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

/** A LangChain message chunk (or a LangGraph [chunk, metadata] pair), as Python tells one. */
function isLangChain(item) {
  const c = Array.isArray(item) && item.length ? item[0] : item;
  return c != null && typeof c === 'object'
    && (c.tool_call_chunks != null || (c.content != null && c.additional_kwargs != null));
}

/** Whichever `source` is, told by its first item: a streamText result, a stream of
 * strings, of chat-completion chunks, of LangChain message chunks, of Responses events
 * (types "response.*") or of UI message chunks. */
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
  const v = head.value;
  const go = (consume) => run(turn, again, consume, { finishReason: 'stop' });
  if (typeof v === 'string') return go(consumeText);
  if (v && Array.isArray(v.choices)) return go(consumeChat);
  if (isLangChain(v)) return go(consumeLangChain);
  if (v && typeof v.type === 'string' && v.type.startsWith('response.')) return go(consumeResponses);
  if (v && typeof v.type === 'string') return go(consumeUi);
  await turn.error('unknown stream item', { code: 'producer_error' });
  throw new TypeError(`cannot stream items of type ${typeof v}`);
}
