// The readers that resumable-stream serves through Redis: further viewers of a stream and
// viewers that reconnect, as a second Next.js instance's resume route runs them
// (ctx.resumeExistingStream(id, skipCharacters): SUBSCRIBE to a channel of its own,
// PUBLISH a request; the producer answers with its buffered chunks and then one PUBLISH
// per chunk to that channel). A separate process from the producer.
//
//   RS_MODULES=<node_modules> node resumable_viewers.mjs <spec.json>
//   spec: {mode, nodes, streams, per_stream: <viewers per stream now>, warm_s,
//          storm_file: <path> | null, probe_after_death: <bool>}
//
// Attaches per_stream viewers per stream, prints "attached <n>"; on SIGUSR1 (the resume
// storm) reads storm_file ([last seq, chars] per stream) and resumes one viewer per stream
// from there, all at once; on SIGUSR2 (the producer was killed) stops waiting, and resumes
// a fresh viewer of a few streams to show what a reader gets then. Ends when every viewer
// has its DONE (or on SIGUSR2) and prints one JSON line.
import fs from "node:fs";
import * as rs from "./resumable_common.mjs";
import { Tally, context, cpuS, drain, readSpec, warm } from "./resumable_common.mjs";

const spec = readSpec();
const { ctx, close } = await context(spec);
warm.s = spec.warm_s;
const lat = [];
const viewers = []; // [stream index, tally, read promise]
let dead = false;
let deadResolve;
const deadP = new Promise((r) => { deadResolve = r; });
const cpu0 = process.cpuUsage();
let attachErrors = 0;

async function attach(i, last, skip) {
  const tally = new Tally(last);
  let stream;
  try {
    stream = await ctx.resumeExistingStream(spec.streams[i], skip);
  } catch (e) {
    attachErrors += 1;
    return;
  }
  if (!stream) {
    attachErrors += 1;
    return;
  }
  viewers.push([i, tally, drain(stream, tally, lat, () => dead)]);
}

await Promise.all(spec.streams.flatMap((_, i) =>
  Array.from({ length: spec.per_stream }, () => attach(i, 0, 0))));
console.log(`attached ${viewers.length}`);

let stormT = null;
let stormDone;
const stormP = spec.storm_file ? new Promise((r) => { stormDone = r; }) : Promise.resolve();
process.on("SIGUSR1", async () => {
  const from = JSON.parse(fs.readFileSync(spec.storm_file, "utf8"));
  const t = performance.now();
  await Promise.all(from.map(([last, chars], i) => attach(i, last, chars)));
  stormT = (performance.now() - t) / 1000;
  console.log(`resumed ${viewers.length}`);
  stormDone();
});
process.on("SIGUSR2", () => { dead = true; deadResolve(); });

await Promise.race([stormP, deadP]);
for (;;) {
  const n = viewers.length;
  await Promise.race([Promise.all(viewers.map((v) => v[2])), deadP]);
  if (dead || viewers.length === n) break;
}
const cpu = cpuS(cpu0);
let afterDeath = null;
if (dead && spec.probe_after_death) {
  const tries = spec.streams.slice(0, 5).map(async (id) => {
    try {
      // the library's own ack timeout (1 s) can miss: its check is "> 1000 ms" after a
      // 1000 ms timer, so a resume nobody answers may never settle; 3 s bounds it here
      const s = await Promise.race([ctx.resumeExistingStream(id),
        new Promise((r) => setTimeout(() => r("timeout"), 3000))]);
      if (s === "timeout") return "no answer within 3 s";
      if (s === null) return "null (Stream is already done)";
      if (s === undefined) return "undefined (no such stream)";
      return "a stream";
    } catch (e) {
      return `error: ${e.message}`;
    }
  });
  afterDeath = await Promise.all(tries);
}
const byStream = {};
for (const [i, tally] of viewers) (byStream[i] ??= []).push(tally.json());
console.log(JSON.stringify({
  viewers: viewers.length, attach_errors: attachErrors, cpu_s: cpu, lat_us: lat,
  last_at_ns: rs.lastAt.toString(),
  by_stream: byStream, storm_resume_s: stormT, after_death: afterDeath,
}));
await close();
process.exit(0);
