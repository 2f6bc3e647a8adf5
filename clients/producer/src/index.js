// @tokenrelay/producer: stream from your own backend into tokenrelay. See README.md.
export {
  Producer, Session, Claim, BACKLOG_MAXLEN, BACKLOG_MAX_BYTES, SESSION_TTL_S, LOCK_TTL_MS,
  MAX_LOCK_TTL_MS, PRODUCER_LOST_MS,
} from './producer.js';
export { Turn, StopReason, CANCELLED, usageMeta, replyIntegrity } from './turn.js';
export { DEFAULT_POLICY } from './coalesce.js';
export { PartError, partsDigest } from './parts.js';
export { MAX_FRAME_BYTES, MAX_DELTA_BYTES } from './frame.js';
export {
  pipe, pipeText, pipeStreamText, pipeUIMessageStream, pipeChatCompletion, pipeResponses, pipeLangChain,
} from './adapters.js';
export { LUA_DIR, scriptSource } from './scripts.js';
export {
  ProducerError, InvalidSession, FrameTooLarge, TurnClosed, RedisUnreachable, StaleEpoch, TurnBusy, LockLost,
} from './errors.js';
