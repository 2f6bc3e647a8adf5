// The producer's errors: one class per cause, each with a one-line message and a
// stable `code` (the same codes as the Python API's and the conformance protocol's).
//
//   ProducerError
//    +-- InvalidSession     the session id is not [A-Za-z0-9_-]{1,64}
//    +-- FrameTooLarge      a delta or a frame over MAX_FRAME_BYTES: nothing of it written
//    +-- TurnClosed         a turn that ended (done, error, closed) was written again
//    +-- RedisUnreachable   Redis did not answer within the retry window (a retry of the
//                           same turn is safe: nothing is written twice)
//    +-- StaleEpoch         a newer producer opened the session (or a relay's reaper
//                           ended this turn): nothing was written
//    +-- TurnBusy           another producer holds the session's turn lock
//    +-- LockLost           the turn lock expired and is no longer this producer's

/** Base of every error the producer throws on purpose. */
export class ProducerError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message.replace(/\s*\n\s*/g, ' '));
    this.name = new.target.name;
  }
}

export class InvalidSession extends ProducerError {
  /** @param {string} why */
  constructor(why) {
    super(`invalid session id: ${why}`);
    this.code = 'invalid_session';
  }
}

export class FrameTooLarge extends ProducerError {
  /** @param {string} session @param {number} size @param {number} limit */
  constructor(session, size, limit) {
    super(`session ${session}: a frame of ${size} bytes is over ${limit} bytes`);
    this.code = 'frame_too_large';
    this.session = session;
    this.size = size;
    this.limit = limit;
  }
}

export class TurnClosed extends ProducerError {
  /** @param {string} session @param {number} turn @param {string} how */
  constructor(session, turn, how) {
    super(`session ${session}: turn ${turn} is closed (${how}); start a new turn`);
    this.code = 'turn_closed';
    this.session = session;
    this.turn = turn;
  }
}

export class RedisUnreachable extends ProducerError {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.code = 'redis_unreachable';
  }
}

export class StaleEpoch extends ProducerError {
  /** @param {string} session @param {number} epoch @param {number} current */
  constructor(session, epoch, current) {
    super(`session ${session}: generation epoch ${epoch} fenced by epoch ${current}`);
    this.code = 'stale_epoch';
    this.session = session;
    this.epoch = epoch;
    this.current = current;
  }
}

export class TurnBusy extends ProducerError {
  /** @param {{owner: string, turn: number, offset: number}} holder */
  constructor(holder) {
    super(`turn ${holder.turn} is generating`);
    this.code = 'turn_busy';
    this.holder = holder;
  }
}

export class LockLost extends ProducerError {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.code = 'lock_lost';
  }
}

/** An error Redis answered (a script's error reply), not a transport failure. */
export function isReplyError(err) {
  return err instanceof Error && err.name === 'ReplyError';
}
