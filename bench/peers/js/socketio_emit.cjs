// The peer's publisher: a second Socket.IO server instance (no clients, not listening)
// on the same cluster and sharded adapter, broadcasting with io.to(room).emit(), which
// the adapter turns into one SPUBLISH on the room's channel. Started by
// bench/peers/socketio.py with NODE_PATH pointing at its npm cache.
//
//   node socketio_emit.cjs <spec.json>
//   spec: {"seed": "host:port", "rooms": [...], "rate": <msgs/s per room>, "seconds": <s>,
//          "adapter": "sharded" | "streams", "ticks": [[room index, ...], ...] (optional)}
//
// With "streams" the broadcast is the streams adapter's XADD to its one stream (what the
// server of that mode reads); with "ticks" (the LLM-rate phases' schedule,
// bench/peers/llmshape.py) tick t sends one message per entry of ticks[t] (a reply's
// first token written -(index + 1)) instead of the even pacing below.
//
// Pacing: a 10 ms tick; at tick t the rooms i with i % groups == t % groups get one
// message, groups = round(1 / (rate * 0.01)), the schedule of the tokenrelay side's
// paced publisher. Each message is a frame-shaped object whose `text` is the send time
// as CLOCK_MONOTONIC nanoseconds (19 digits) and ";", read by the bench's clients
// against their own CLOCK_MONOTONIC. Prints one JSON line: sent, acked, seconds, cpu_s,
// publish_cpu_s (the pacing's CPU alone).
"use strict";

const fs = require("node:fs");
const { Server } = require("socket.io");
const { createShardedAdapter } = require("@socket.io/redis-adapter");
const { createCluster } = require("redis");

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function main() {
  const spec = JSON.parse(fs.readFileSync(process.argv[2], "utf8"));
  const pub = createCluster({ rootNodes: [{ url: `redis://${spec.seed}` }] });
  const sub = pub.duplicate();
  for (const c of [pub, sub]) c.on("error", (e) => console.error("redis:", e.message));
  await Promise.all([pub.connect(), sub.connect()]);

  // Count the SPUBLISH replies, so the run ends when Redis has taken every message.
  let pending = 0;
  let acked = 0;
  let failed = 0;
  const sPublish = pub.sPublish.bind(pub);
  pub.sPublish = (...args) => {
    pending += 1;
    return sPublish(...args).then(
      (n) => { pending -= 1; acked += 1; return n; },
      (e) => { pending -= 1; failed += 1; throw e; },
    );
  };
  let adapter;
  if (spec.adapter === "streams") {
    const xAdd = pub.xAdd.bind(pub); // the streams adapter publishes with XADD
    pub.xAdd = (...args) => {
      pending += 1;
      return xAdd(...args).then(
        (n) => { pending -= 1; acked += 1; return n; },
        (e) => { pending -= 1; failed += 1; throw e; },
      );
    };
    const { createAdapter } = require("@socket.io/redis-streams-adapter");
    adapter = createAdapter(pub, { useShardedPubSub: true });
  } else {
    adapter = createShardedAdapter(pub, sub, { subscriptionMode: "dynamic" });
  }
  const io = new Server({ adapter });

  const rooms = spec.rooms;
  const tick = 10;
  const perTick = spec.rate * (tick / 1000);
  const groups = perTick < 1 ? Math.max(1, Math.round(1 / perTick)) : 1;
  const plan = spec.ticks || null;
  const nTicks = plan ? plan.length : Math.floor((spec.seconds * 1000) / tick);
  const offsets = new Array(rooms.length).fill(0);
  let sent = 0;
  const send = (i) => {
    offsets[i] += 1;
    io.to(rooms[i]).emit("m", {
      v: 1, session: rooms[i], turn: 1, offset: offsets[i], kind: "token",
      text: `${process.hrtime.bigint().toString().padStart(19, "0")};`, epoch: 1, ts: Date.now(),
    });
    sent += 1;
  };
  const cpu0 = process.cpuUsage(); // the pacing's own CPU, without start-up
  const t0 = performance.now();
  for (let t = 0; t < nTicks; t++) {
    if (plan) {
      for (const e of plan[t]) send(e >= 0 ? e : -e - 1);
    } else {
      for (let i = t % groups; i < rooms.length; i += groups) send(i);
    }
    const delay = t0 + (t + 1) * tick - performance.now();
    if (delay > 0) await sleep(delay);
    else await new Promise((r) => setImmediate(r));
  }
  const seconds = (performance.now() - t0) / 1000;
  const deadline = performance.now() + 10000;
  while ((pending > 0 || acked + failed < sent) && performance.now() < deadline) await sleep(5);
  const cpu = process.cpuUsage();
  const own = process.cpuUsage(cpu0);
  console.log(JSON.stringify({
    sent, acked, failed, seconds, cpu_s: (cpu.user + cpu.system) / 1e6,
    publish_cpu_s: (own.user + own.system) / 1e6,
  }));
  await Promise.allSettled([pub.disconnect(), sub.disconnect()]);
  process.exit(0);
}

main().catch((e) => {
  console.error(e && e.stack ? e.stack : String(e));
  process.exit(1);
});
