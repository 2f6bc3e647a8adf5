// One producer process of bench/producer/cpu.py, in Node: `streams` turns at once
// through the package (clients/producer), each writing `tokens` deltas paced at `rate`
// per second. Its own CPU (process.cpuUsage) over the turns is its answer, one line of
// JSON. Run: node bench/producer/cpu_node.mjs SPEC.json
import { readFileSync } from 'node:fs';
import { Producer } from '../../clients/producer/src/index.js';

const spec = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function paced(turn) {
  const t0 = performance.now();
  for (let k = 0; k < spec.tokens; k++) {
    turn.write(`tok${k} `);
    const delay = t0 + ((k + 1) * 1000) / spec.rate - performance.now();
    if (delay > 0) await sleep(delay);
  }
}

const p = await Producer.connect(spec.url, {
  producerId: 'bench-node',
  coalesce: { maxTokens: spec.max_tokens, maxDelayMs: spec.max_delay_ms },
});
try {
  const sessions = Array.from({ length: spec.streams }, (_, i) => p.session(`${spec.prefix}-${i}`));
  const c0 = process.cpuUsage();
  const t0 = performance.now();
  await Promise.all(sessions.map(async (s) => {
    const turn = await s.startTurn('bench');
    await paced(turn);
    await turn.done();
  }));
  const c = process.cpuUsage(c0);
  console.log(JSON.stringify({ cpu_s: (c.user + c.system) / 1e6, wall_s: (performance.now() - t0) / 1000, batches: 0 }));
} finally {
  await p.close();
}
