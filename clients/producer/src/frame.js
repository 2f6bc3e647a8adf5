// The wire frame (docs/PROTOCOL.md, "Frame"): JSON with its fields in this order, as
// the Python encoder writes it. Encoded once here; the same bytes go to the backlog,
// the live channel and every socket.

export const VERSION = 1;
export const MAX_FRAME_BYTES = 256 * 1024;
/** The largest delta one token frame carries: the frame's other fields fit in the rest. */
export const MAX_DELTA_BYTES = MAX_FRAME_BYTES - 4096;
export const SESSION_ID = /^[A-Za-z0-9_-]{1,64}$/;

/**
 * @param {{session: string, turn: number, offset: number, kind: string, text?: string,
 *   epoch: number, ts: number, meta?: Record<string, unknown> | null}} f
 */
export function encode(f) {
  return JSON.stringify({
    v: VERSION, session: f.session, turn: f.turn, offset: f.offset, kind: f.kind,
    text: f.text ?? '', epoch: f.epoch, ts: f.ts, meta: f.meta ?? null,
  });
}

/** Why `sid` is not a session id, or null. @param {unknown} sid */
export function sessionProblem(sid) {
  if (typeof sid !== 'string') return 'session id must be a string';
  if (!sid) return 'session id is empty';
  if (sid.length > 64) return 'session id longer than 64 characters';
  if (!SESSION_ID.test(sid)) return 'session id may contain only A-Z a-z 0-9 _ -';
  return null;
}

/** @param {string} sid @param {string} kind */
export const key = (sid, kind) => `tr:{${sid}}:${kind}`;

/** `text` cut into pieces of at most `max` UTF-8 bytes, whole code points. */
export function chunks(text, max = MAX_DELTA_BYTES) {
  const out = [];
  let cur = '';
  let size = 0;
  for (const ch of text) {
    const n = Buffer.byteLength(ch);
    if (size + n > max) {
      out.push(cur);
      cur = '';
      size = 0;
    }
    cur += ch;
    size += n;
  }
  if (cur) out.push(cur);
  return out;
}
