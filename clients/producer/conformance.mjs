// The TypeScript producer behind the conformance command protocol (docs/PROTOCOL.md,
// "Producer conformance"; tests/conformance/py_producer.py says the commands): one JSON
// object per line on stdin, one answer per line on stdout.
// Settings from the environment: TR_REDIS_URL, TR_LOCK_TTL_S, TR_MAXLEN, TR_COALESCE.
import { createInterface } from 'node:readline';
import { Producer, ProducerError, pipe } from './src/index.js';

const env = process.env;
const producer = await Producer.connect(env.TR_REDIS_URL ?? 'redis://127.0.0.1:7000', {
  producerId: 'conformance-node',
  lockTtlMs: env.TR_LOCK_TTL_S ? Number(env.TR_LOCK_TTL_S) * 1000 : undefined,
  maxlen: Number(env.TR_MAXLEN ?? '10000'),
  coalesce: { maxTokens: Number(env.TR_COALESCE ?? '8') },
});
const state = { turn: null };

async function handle(cmd) {
  const { op } = cmd;
  if (op === 'start') {
    const t = await producer.session(cmd.session).startTurn(String(cmd.message ?? ''), { meta: cmd.meta, watch: Boolean(cmd.watch) });
    state.turn = t;
    return { ok: true, turn: t.turn, offset: t.firstOffset, epoch: t.epoch };
  }
  const turn = state.turn;
  if (!turn) return { ok: false, error: 'no_turn', message: 'start a turn first' };
  if (op === 'write') {
    turn.write(String(cmd.text));
    return { ok: true };
  }
  if (op === 'part') { // one part frame: phase start, delta, end, or a whole part (no phase)
    const { part, id, phase } = cmd;
    if (phase === 'start') turn.partStart(part, id, { name: cmd.name ?? '', summary: !!cmd.summary });
    else if (phase === 'delta') turn.partDelta(part, id, String(cmd.text));
    else if (phase === 'end') turn.partEnd(part, id);
    else turn.part(part, id, cmd.value, { name: cmd.name ?? '', error: !!cmd.error });
    return { ok: true };
  }
  if (op === 'pipe') { // a stream's items into the turn; pipe tells their kind and ends it
    async function* source() { yield* cmd.items; }
    return { ok: true, offset: await pipe(turn, source()) };
  }
  if (op === 'done') {
    return { ok: true, offset: await turn.done({ finishReason: cmd.finish_reason ?? 'stop', usage: cmd.usage ?? null }) };
  }
  if (op === 'error') return { ok: true, offset: await turn.error(String(cmd.reason)) };
  if (op === 'replay_last') {
    const g = turn.generation; // the last frame's bytes sent again, as a retry after a lost reply
    const last = g.offset;
    return { ok: true, offset: await g.write(last - 1, [g.written.get(last)], false) };
  }
  return { ok: false, error: 'unknown_op', message: `unknown op ${op}` };
}

process.stdout.write(JSON.stringify({ ok: true, ready: 'node' }) + '\n');
const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
for await (const line of lines) {
  if (!line.trim()) continue;
  const cmd = JSON.parse(line);
  if (cmd.op === 'quit') break;
  let out;
  try {
    out = await handle(cmd);
  } catch (err) {
    out = err instanceof ProducerError
      ? { ok: false, error: err.code, message: err.message }
      : { ok: false, error: 'internal', message: String(err?.message ?? err).split('\n')[0] };
  }
  process.stdout.write(JSON.stringify(out) + '\n');
}
await producer.close();
process.exit(0);
