// resumable-stream's producer, as a Next.js route handler runs it: per stream one
// ctx.resumableStream(id, makeStream) (INCR of the sentinel, SUBSCRIBE to the stream's
// request channel, SET of the sentinel), the returned stream read by the route's own
// response (the first reader, in this process). Tokens are enqueued into each makeStream
// source by one paced ticker; the library forwards each chunk with one PUBLISH per
// listener that resumed (the viewers' process, resumable_viewers.mjs).
//
//   RS_MODULES=<node_modules> node resumable_producer.mjs <spec.json>
//   spec: {mode: "node"|"cluster", nodes: ["host:port"...], streams: [...], rate: <tokens/s
//          over all streams>, seconds, warm_s, storm_file: <path> | null}
//
// Prints "ready <n>" once every stream exists, starts pacing on SIGUSR1; on SIGUSR2 (the
// resume storm) every first reader drops at once and the characters each had received go
// to storm_file ("dropped" is printed). At the end: a resume of a finished stream (the
// library's answer: null, "Stream is already done"), then one JSON line.
import fs from "node:fs";
import * as rs from "./resumable_common.mjs";
import { Tally, context, cpuS, drain, readSpec, sleep, token, warm } from "./resumable_common.mjs";

const spec = readSpec();
const { ctx, close } = await context(spec);
const n = spec.streams.length;
const controllers = new Array(n);
let go;
const started = new Promise((r) => { go = r; });
process.on("SIGUSR1", () => go());
let dropped = false;
process.on("SIGUSR2", () => { dropped = true; });

const firsts = [];
for (let i = 0; i < n; i++) {
  const make = () => new ReadableStream({ start(c) { controllers[i] = c; } });
  firsts.push(await ctx.resumableStream(spec.streams[i], make));
}
console.log(`ready ${n}`);
await started;

const cpu0 = process.cpuUsage();
warm.s = spec.warm_s;
const lat = [];
const tallies = firsts.map(() => new Tally());
const reads = firsts.map((s, i) => drain(s, tallies[i], lat, () => dropped));

const tick = 10;
const perTick = spec.rate * (tick / 1000);
const groups = perTick < n ? Math.max(1, Math.round(n / perTick)) : 1;
const each = Math.max(1, Math.round(perTick / n)); // tokens per stream per tick above n/tick
const nTicks = Math.floor((spec.seconds * 1000) / tick);
const seqs = new Array(n).fill(0);
const t0 = performance.now();
let stormed = false;
for (let t = 0; t < nTicks; t++) {
  for (let i = t % groups; i < n; i += groups) {
    for (let k = 0; k < each; k++) controllers[i].enqueue(token(++seqs[i]));
  }
  if (dropped && !stormed) {
    stormed = true;
    await sleep(0); // let the readers see the drop
    fs.writeFileSync(spec.storm_file, JSON.stringify(tallies.map((x) => [x.last, x.chars])));
    console.log("dropped");
  }
  const delay = t0 + (t + 1) * tick - performance.now();
  if (delay > 0) await sleep(delay);
  else await new Promise((r) => setImmediate(r));
}
const seconds = (performance.now() - t0) / 1000;
const endNs = rs.now();
for (const c of controllers) c.close();
const ends = await Promise.all(reads);
// the library's own end: the DONE sentinel is set and every listener is sent DONE
await sleep(200);
const cpu = cpuS(cpu0);
const again = await ctx.resumableStream(spec.streams[0], () => { throw new Error("made twice"); });
console.log(JSON.stringify({
  published: seqs, seconds, cpu_s: cpu, end_ns: endNs.toString(), last_at_ns: rs.lastAt.toString(),
  first: tallies.map((x) => x.json()), ends: ends.filter((e) => e === "done").length,
  lat_us: lat, after_end: again === null ? "null (Stream is already done)" : "a stream",
}));
await close();
process.exit(0);
