// The relay's Lua scripts, loaded from their one copy: the repository's
// relay/broker/rediscluster/lua/ when this package runs from the repository, else the
// copy `npm pack` puts beside it (scripts/copy-lua.mjs; a test of the repository fails
// when that copy differs). A script that `uses` others has their sources in front of
// its own, joined exactly as the Python side joins them, so both languages run (and
// cache) the very same script under the same SHA-1.
import { createHash } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const REPO_LUA = join(HERE, '..', '..', '..', 'relay', 'broker', 'rediscluster', 'lua');
const PACKED_LUA = join(HERE, '..', 'lua');

/** The directory the scripts are read from. */
export const LUA_DIR = existsSync(join(REPO_LUA, 'publish.lua')) ? REPO_LUA : PACKED_LUA;

/** @param {string} name */
export function lua(name) {
  return readFileSync(join(LUA_DIR, `${name}.lua`), 'utf8');
}

/** The scripts the producer runs: name -> [file, files in front, number of keys]. */
export const SCRIPTS = {
  trOpen: ['open', ['frame', 'backlog', 'failover'], 3],
  trPublish: ['publish', ['backlog'], 3],
  trLockName: ['lock_name', [], 1],
  trLockRefresh: ['lock_refresh', [], 2],
  trLockRelease: ['lock_release', [], 1],
  trStopped: ['stopped', [], 1],
  trPresenceCount: ['presence_count', [], 1],
};

/** @param {string} name @param {string[]} uses */
export function source(name, uses = []) {
  return uses.map((u) => lua(u) + '\n').join('') + lua(name);
}

/** The source a script file runs as (`publish`: backlog.lua, then publish.lua). @param {string} name */
export function scriptSource(name) {
  const entry = Object.values(SCRIPTS).find(([n]) => n === name);
  if (!entry) throw new RangeError(`no producer script ${name}`);
  return source(entry[0], entry[1]);
}

/** @param {string} src */
export function sha1(src) {
  return createHash('sha1').update(src).digest('hex');
}

/**
 * Define the scripts on an ioredis client (Cluster or Redis) with `defineCommand`:
 * ioredis sends EVALSHA, and EVAL the first time on each connection and after a
 * NOSCRIPT (a restarted node, a promoted replica).
 * @param {any} redis
 */
export function defineScripts(redis) {
  for (const [cmd, [name, uses, numberOfKeys]] of Object.entries(SCRIPTS)) {
    if (typeof redis[cmd] !== 'function') {
      redis.defineCommand(cmd, { numberOfKeys, lua: source(name, uses) });
    }
  }
}
