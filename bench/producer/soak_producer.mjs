// The producer of bench/producer/soak.py: the Node package (clients/producer) writing
// turn after turn into every session for `duration_s`, `rate` deltas per second per
// session, replies of `reply_min`..`reply_max` deltas (some of them non-ASCII).
// Prints one line of JSON: turns, deltas, its own CPU, the errors it met.
// Run: node bench/producer/soak_producer.mjs SPEC.json
import { readFileSync } from 'node:fs';
import { Producer } from '../../clients/producer/src/index.js';

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
let seed = spec.seed >>> 0 || 1;
const rand = () => ((seed = (seed * 1103515245 + 12345) >>> 0) / 2 ** 32);
const WORDS = ['relay ', 'token ', 'stream ', 'wörld ', '🙂 ', '中文 ', '"q" ', 'a\\b ', 'line\n'];

const p = await Producer.connect(spec.url, { producerId: 'soak-node' });
const stats = { turns: 0, deltas: 0, errors: [] };
const until = performance.now() + spec.duration_s * 1000;
const c0 = process.cpuUsage();

async function session(sid) {
  const s = p.session(sid);
  while (performance.now() < until) {
    const n = spec.reply_min + Math.floor(rand() * (spec.reply_max - spec.reply_min + 1));
    try {
      const turn = await s.startTurn(`soak turn ${stats.turns}`);
      const t0 = performance.now();
      for (let k = 0; k < n; k++) {
        turn.write(WORDS[Math.floor(rand() * WORDS.length)]);
        const delay = t0 + ((k + 1) * 1000) / spec.rate - performance.now();
        if (delay > 0) await sleep(delay);
      }
      await turn.done();
      stats.turns += 1;
      stats.deltas += n;
    } catch (err) {
      stats.errors.push(`${sid}: ${err.code ?? err.name}: ${err.message}`);
      await sleep(100);
    }
  }
}

try {
  await Promise.all(spec.sessions.map(session));
} finally {
  await p.close();
}
const c = process.cpuUsage(c0);
console.log(JSON.stringify({ ...stats, errors: stats.errors.slice(0, 10), error_count: stats.errors.length, cpu_s: (c.user + c.system) / 1e6 }));
