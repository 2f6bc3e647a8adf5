// Where the examples find the stack: `make demo`'s front door (TOKENRELAY_BASE,
// default http://127.0.0.1:8080), its Redis Cluster (TOKENRELAY_REDIS_URL, else the one
// the demo reports at /api/stack) and the token secret its relays verify
// (TOKENRELAY_SECRET: export it before `make demo`, which then uses it). Simplest: the
// line `make demo` prints, `set -a; . /tmp/.../backend.env; set +a`, sets all three.
export const BASE = (process.env.TOKENRELAY_BASE ?? 'http://127.0.0.1:8080').replace(/\/$/, '');
export const SECRET = process.env.TOKENRELAY_SECRET;

export async function redisUrl() {
  if (process.env.TOKENRELAY_REDIS_URL) return process.env.TOKENRELAY_REDIS_URL;
  const stack = await (await fetch(`${BASE}/api/stack`)).json();
  if (!stack.redis) throw new Error(`${BASE}/api/stack names no Redis: set TOKENRELAY_REDIS_URL`);
  return stack.redis;
}
