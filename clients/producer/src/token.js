// Tokens relays verify (docs/PROTOCOL.md, "Tokens"): HS256 JWTs with the claims the
// Python API's issue_token writes: sub (the session), scope, iat, exp, jti; header kid.
import { createHmac, randomBytes } from 'node:crypto';

export const MIN_SECRET_BYTES = 32;
export const DEFAULT_KID = 'k1';

const b64url = (buf) => Buffer.from(buf).toString('base64url');

/** The secret as bytes, or a one-line Error saying why it is too weak. @param {string | Uint8Array} secret */
export function checkSecret(secret) {
  const raw = typeof secret === 'string' ? Buffer.from(secret, 'utf8') : Buffer.from(secret);
  if (raw.length < MIN_SECRET_BYTES) {
    throw new RangeError(`the token secret is ${raw.length} bytes; it needs at least ${MIN_SECRET_BYTES}`);
  }
  if (new Set(raw).size < 8) throw new RangeError('the token secret has fewer than 8 distinct bytes');
  return raw;
}

/**
 * @param {Uint8Array} secret @param {string} sid
 * @param {{scope?: 'watch' | 'write', ttlS?: number, now?: number, kid?: string}} [opts]
 */
export function issueToken(secret, sid, { scope = 'watch', ttlS = 3600, now = Date.now() / 1000, kid = DEFAULT_KID } = {}) {
  if (scope !== 'watch' && scope !== 'write') throw new RangeError(`unknown scope ${scope}`);
  if (!(ttlS >= 1)) throw new RangeError('ttlS must be at least 1 second');
  const header = { alg: 'HS256', kid, typ: 'JWT' };
  const iat = Math.floor(now);
  const claims = { sub: sid, scope, iat, exp: Math.floor(now + ttlS), jti: b64url(randomBytes(9)) };
  const body = `${b64url(JSON.stringify(header))}.${b64url(JSON.stringify(claims))}`;
  return `${body}.${b64url(createHmac('sha256', secret).update(body).digest())}`;
}
