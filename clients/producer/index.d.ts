// Types of @tokenrelay/producer (hand-written; `npm run typecheck` checks them with tsc
// together with a typed use of the API, test/types.ts).
import type { Cluster } from 'ioredis';

/**
 * What the producer calls on a Redis client you pass in: ioredis's `Cluster` (or `Redis`),
 * of ioredis 5 or 6. Structural, so a client from your app's own ioredis install (another
 * major, another copy) type-checks; the scripts are added with `defineCommand`.
 */
export interface RedisClient {
  defineCommand(name: string, definition: { lua: string; numberOfKeys?: number }): void;
  set(key: string, value: string, px: 'PX', ms: number, nx: 'NX'): Promise<'OK' | null>;
  get(key: string): Promise<string | null>;
  quit(): Promise<'OK'>;
  disconnect(): void;
}

/** Coalescing: flush at `maxTokens` pending deltas or after `maxDelayMs`, whichever first. */
export interface CoalescePolicy {
  maxTokens: number;
  maxDelayMs: number;
  /** The first delta of a turn goes at once (never adds to the time to first token). */
  firstImmediate: boolean;
}
/** The worker's defaults: 8 deltas or 50 ms, the first at once. */
export const DEFAULT_POLICY: Readonly<CoalescePolicy>;

export interface PresencePolicy {
  /** How long a turn may generate with nobody watching (default 10 000). */
  graceMs: number;
  /** How often the lock is refreshed, the stop record read, viewers counted (default 1000). */
  intervalMs: number;
}

export interface ProducerOptions {
  /** The HS256 secret relays verify tokens with (>= 32 bytes), for Session.token(). */
  secret?: string | Uint8Array;
  /** The key id in the token header (default "k1"). */
  kid?: string;
  /** Names this process in lock owners and in the meta frame's `worker`. */
  producerId?: string;
  /** A session's keys expire this long after its last write (default 86 400). */
  ttlS?: number;
  /** Frames a backlog keeps (default 10 000). */
  maxlen?: number;
  /** Bytes of frames a backlog keeps (default 4 MiB; 0: no byte bound). */
  maxBytes?: number;
  /** How long a call retries while Redis is unreachable (default 10 000). */
  retryMs?: number;
  /** Frames a generation keeps to write again after a failover (default 4096). */
  keepFrames?: number;
  /** The turn lock's TTL (default LOCK_TTL_MS, 5 000; RangeError above MAX_LOCK_TTL_MS,
   * 7 000, so that a dead producer's turn ends within PRODUCER_LOST_MS); refreshed every
   * presence.intervalMs. */
  lockTtlMs?: number;
  coalesce?: Partial<CoalescePolicy>;
  presence?: Partial<PresencePolicy>;
  /** Producer.connect only: how long to wait for the cluster at start (default 5000). */
  connectTimeoutMs?: number;
}

export interface StartOptions {
  /** The meta frame's message_id (default `<sid>-<turn>-user`). */
  messageId?: string;
  /** Fields of the turn's meta frame (model, engine, ...). */
  meta?: Record<string, unknown>;
  /** Refresh the lock and watch for stops and viewers while the turn runs (default true). */
  watch?: boolean;
}

/** Token usage; snake_case, camelCase or the AI SDK's LanguageModelUsage. */
export type Usage = Record<string, unknown>;

export type StopReasonValue = 'cancelled' | 'no viewers' | 'lock lost';
export const StopReason: Readonly<{ CANCELLED: 'cancelled'; NO_VIEWERS: 'no viewers'; LOCK_LOST: 'lock lost' }>;
export const CANCELLED: 'cancelled';
export const MAX_FRAME_BYTES: number;
export const MAX_DELTA_BYTES: number;
export const BACKLOG_MAXLEN: number;
export const BACKLOG_MAX_BYTES: number;
export const LOCK_TTL_MS: number;
export const MAX_LOCK_TTL_MS: number;
export const PRODUCER_LOST_MS: number;
export const SESSION_TTL_S: number;
/** The directory the Lua scripts are read from. */
export const LUA_DIR: string;
/** The source a script file runs as (`publish`: backlog.lua then publish.lua). */
export function scriptSource(name: string): string;
export function usageMeta(u: Usage | null | undefined): Record<string, unknown>;
export function replyIntegrity(text: string, tokens: number): { tokens: number; chars: number; sha256: string };

export class Producer<R extends RedisClient = RedisClient> {
  constructor(redis: R, opts?: ProducerOptions);
  /** A producer on its own ioredis Cluster client; RedisUnreachable if no node answers. */
  static connect(url: string | string[], opts?: ProducerOptions): Promise<Producer<Cluster>>;
  /** The client given to the constructor (connect: the package's own ioredis Cluster). */
  readonly redis: R;
  readonly producerId: string;
  /** The session `sid` (a new random id when omitted); throws InvalidSession. */
  session(sid?: string): Session;
  close(): Promise<void>;
}

export class Session {
  readonly producer: Producer;
  readonly id: string;
  /** A token to watch the session with (scope "watch"), at most its lifetime. */
  token(opts?: { scope?: 'watch' | 'write'; ttlS?: number; now?: number }): string;
  /** Take the turn lock; TurnBusy if another producer's turn holds it. */
  claim(opts?: { owner?: string; retries?: number; retryMs?: number }): Promise<Claim>;
  /** Claim the lock and open a turn (its meta frame is out when this resolves). */
  startTurn(message?: string, opts?: StartOptions): Promise<Turn>;
}

export class Claim {
  readonly owner: string;
  open(message?: string, opts?: StartOptions): Promise<Turn>;
  release(): Promise<void>;
}

export class Turn {
  readonly sid: string;
  readonly turn: number;
  readonly epoch: number;
  /** The offset of the turn's meta frame. */
  readonly firstOffset: number;
  readonly nextOffset: number;
  /** The reply so far. */
  readonly text: string;
  readonly closed: boolean;
  /** Why the turn should stop, once it should. */
  readonly stopReason: StopReasonValue | null;
  /** Aborted when the turn should stop: give it to the generation (streamText's abortSignal). */
  readonly signal: AbortSignal;
  /** Append one delta (never waits). Throws TurnClosed, FrameTooLarge, LockLost, StaleEpoch, RedisUnreachable. */
  write(text: string, meta?: Record<string, unknown>): void;
  /** The reply's parts so far (docs/PROTOCOL.md, "Parts"), in the order they started. */
  readonly parts: { records: PartRecord[] };
  /** Append to the reasoning part being written (a new one when none is); its id. */
  reasoning(text: string, opts?: { summary?: boolean; id?: string | null }): string;
  endReasoning(): void;
  /** `id` was ended by hand (partEnd): reasoning() starts a new part next time. */
  forgetReasoning(id: string): void;
  toolCallStart(id: string, name: string): void;
  toolCallDelta(id: string, args: string): void;
  toolCallEnd(id: string): void;
  /** The complete call (arguments checked as JSON before anything is written). */
  toolCall(id: string, name: string, args: string | Record<string, unknown>): void;
  toolResult(id: string, output: unknown, opts?: { error?: boolean }): void;
  source(url: string, opts?: { title?: string; id?: string }): string;
  usage(u: Usage, opts?: { id?: string }): string;
  /** An application's own part `data-<name>`. */
  data(name: string, value: unknown, opts?: { id?: string }): string;
  partStart(part: 'reasoning' | 'tool-call', id: string, opts?: { name?: string; summary?: boolean }): void;
  partDelta(part: 'reasoning' | 'tool-call', id: string, text: string): void;
  partEnd(part: 'reasoning' | 'tool-call', id: string): void;
  part(part: string, id: string, value: unknown, opts?: { name?: string; error?: boolean }): void;
  /** Wait until every delta written is in Redis. */
  flush(): Promise<void>;
  /** End with done (tokens, chars, sha256, usage, finish_reason); resolves to its offset. */
  done(opts?: { finishReason?: string | null; usage?: Usage | null; meta?: Record<string, unknown> }): Promise<number>;
  /** End with error (text = reason, meta.code); resolves to its offset. */
  error(reason: string, opts?: { code?: string | null; meta?: Record<string, unknown> }): Promise<number>;
  /** Stop the helpers and give the lock back, with no terminal frame. */
  close(): Promise<void>;
  onStop(cb: (reason: StopReasonValue) => void): void;
  stopped(): Promise<StopReasonValue>;
  /** Record that the turn should stop. */
  stop(reason: StopReasonValue): void;
}

/** What the AI SDK's streamText(...) returns, as far as the producer reads it. */
export interface StreamTextLike {
  textStream: AsyncIterable<string>;
  finishReason: PromiseLike<string>;
  totalUsage?: PromiseLike<unknown>;
  usage?: PromiseLike<unknown>;
}
/** A chunk of the AI SDK's UI message stream (toUIMessageStream()). */
export interface UIChunkLike {
  type: string;
  delta?: string;
  finishReason?: string;
  errorText?: string;
  messageMetadata?: unknown;
}
type Source<T> = AsyncIterable<T> | ReadableStream<T>;

export function pipeText(turn: Turn, source: Source<string>): Promise<number>;
export function pipeStreamText(turn: Turn, result: StreamTextLike): Promise<number>;
export function pipeUIMessageStream(turn: Turn, stream: Source<UIChunkLike>): Promise<number>;
export function pipe(
  turn: Turn,
  source: StreamTextLike | Source<string> | Source<UIChunkLike> | Source<ChatChunkLike> | Source<ResponsesEventLike>
    | Source<LangChainChunkLike | [LangChainChunkLike, unknown]>,
): Promise<number>;
/** The openai SDK's chat-completion chunks (content, reasoning_content, tool_calls). */
export function pipeChatCompletion(turn: Turn, stream: Source<ChatChunkLike>): Promise<number>;
export interface ChatChunkLike { choices: { index?: number; delta?: Record<string, unknown>; finish_reason?: string | null }[]; usage?: Usage | null }
/** The openai SDK's Responses stream events (responses.create({stream: true})). */
export function pipeResponses(turn: Turn, stream: Source<ResponsesEventLike>): Promise<number>;
/** One Responses stream event, as far as the producer reads it. */
export interface ResponsesEventLike {
  type: string;
  item_id?: string;
  delta?: string;
  arguments?: string;
  summary_index?: number;
  item?: { type: string; id?: string; call_id?: string; name?: string; arguments?: string };
  annotation?: { type: string; url?: string; title?: string };
  response?: { usage?: Usage | null; incomplete_details?: { reason?: string } | null; error?: { message?: string } | null };
  message?: string;
}
/** LangChain's message chunks (`model.stream()`), or LangGraph's streamMode "messages" pairs. */
export function pipeLangChain(turn: Turn, stream: Source<LangChainChunkLike | [LangChainChunkLike, unknown]>): Promise<number>;
/** An AIMessageChunk (@langchain/core), as far as the producer reads it. */
export interface LangChainChunkLike {
  content: string | (string | { type: string; text?: string; reasoning?: string; thinking?: string })[];
  additional_kwargs?: Record<string, unknown>;
  tool_call_chunks?: { name?: string; args?: string; id?: string; index?: number }[];
  usage_metadata?: { input_tokens?: number; output_tokens?: number; total_tokens?: number };
  response_metadata?: Record<string, unknown>;
}
/** One part of a reply as the producer wrote it. */
export interface PartRecord { part: string; id: string; name: string; text: string; done: boolean; summary: boolean; error: boolean }
/** Hex SHA-256 of a reply's parts (the done frame's parts_sha256). */
export function partsDigest(records: PartRecord[]): string;

export class ProducerError extends Error {
  readonly code: string;
}
export class InvalidSession extends ProducerError { readonly code: 'invalid_session'; }
export class FrameTooLarge extends ProducerError {
  readonly code: 'frame_too_large'; readonly session: string; readonly size: number; readonly limit: number;
}
/** A part that would corrupt the transcript (nothing of it was written). */
export class PartError extends ProducerError { readonly code: 'invalid_part'; }
export class TurnClosed extends ProducerError { readonly code: 'turn_closed'; readonly session: string; readonly turn: number; }
export class RedisUnreachable extends ProducerError { readonly code: 'redis_unreachable'; }
export class StaleEpoch extends ProducerError {
  readonly code: 'stale_epoch'; readonly session: string; readonly epoch: number; readonly current: number;
}
export class TurnBusy extends ProducerError {
  readonly code: 'turn_busy'; readonly holder: { owner: string; turn: number; offset: number };
}
export class LockLost extends ProducerError { readonly code: 'lock_lost'; }
