// What the resumable-stream driver's two processes share (bench/peers/resumable.py starts
// them): the library and its node-redis client from the npm cache (ESM ignores NODE_PATH,
// so they are required from RS_MODULES), the context on a single node or the 3+3 cluster,
// the token format and a reader's tally.
//
// A token's text is "<seq>:<send time, CLOCK_MONOTONIC ns, 19 digits>;". A reader parses
// every token out of each chunk (a resumed reader's first chunk is the producer's buffered
// chunks joined), so a tally counts deliveries, reordered tokens (one that fills a gap a
// later one left), duplicates (a seq seen before), gaps (never filled: lost) and the
// latency of each token from its send time to its arrival.
import { createRequire } from "node:module";
import fs from "node:fs";

const require = createRequire(`${process.env.RS_MODULES}/`);
const { createResumableStreamContext } = require("resumable-stream");
const { createClient, createCluster } = require("redis");

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
export const now = () => process.hrtime.bigint();
export const readSpec = () => JSON.parse(fs.readFileSync(process.argv[2], "utf8"));

export function token(seq) {
  return `${seq}:${now().toString().padStart(19, "0")};`;
}

// Two clients per process (a publisher and a subscriber), as the library's own defaults
// make them; in cluster mode node-redis's createCluster, which has every command the
// library calls (connect, subscribe/unsubscribe, publish, set with EX, get, incr).
export async function context(spec) {
  const make = () =>
    spec.mode === "cluster"
      ? createCluster({ rootNodes: spec.nodes.map((n) => ({ url: `redis://${n}` })) })
      : createClient({ url: `redis://${spec.nodes[0]}` });
  const publisher = make();
  const subscriber = make();
  for (const c of [publisher, subscriber]) c.on("error", (e) => console.error("redis:", e.message));
  await Promise.all([publisher.connect(), subscriber.connect()]);
  const ctx = createResumableStreamContext({ waitUntil: null, publisher, subscriber });
  return { ctx, close: () => Promise.allSettled([publisher.disconnect(), subscriber.disconnect()]) };
}

const TOKEN = /(\d+):(\d{19});/g;

// The latency window: tokens sent in the first warm_s after the first token this process
// saw are left out (set once, at that first token).
export const warm = { s: 0, ns: null };
export let lastAt = 0n; // the last arrival in this process

export class Tally {
  constructor(last = 0) {
    this.last = last; // highest seq seen
    this.received = 0;
    this.duplicated = 0;
    this.missing = new Set(); // seqs skipped so far: lost unless they arrive late
    this.reordered = 0; // tokens that arrived after a later one
    this.ended = false; // the library closed the stream (its DONE)
    this.error = null; // the stream errored: why
    this.chars = 0; // characters received: the skipCharacters of a resume
  }

  take(chunk, lat) {
    const at = now();
    this.chars += chunk.length;
    lastAt = at;
    for (const m of chunk.matchAll(TOKEN)) {
      const seq = Number(m[1]);
      const sent = BigInt(m[2]);
      if (warm.ns === null) warm.ns = sent + BigInt(Math.round(warm.s * 1e9));
      if (seq <= this.last) {
        // an earlier token late (a gap it had left) or a second copy
        if (this.missing.delete(seq)) {
          this.reordered += 1;
          this.received += 1;
          if (sent >= warm.ns) lat.push(Number((at - sent) / 1000n));
        } else this.duplicated += 1;
        continue;
      }
      for (let s = this.last + 1; s < seq; s++) this.missing.add(s);
      this.last = seq;
      this.received += 1;
      if (sent >= warm.ns) lat.push(Number((at - sent) / 1000n));
    }
  }

  json() {
    const { last, received, duplicated, reordered, ended } = this;
    const { error } = this;
    return { last, received, duplicated, reordered, gaps: this.missing.size, ended, error };
  }
}

// Read a stream to its end (or until stop() says so); every chunk into the tally.
export async function drain(stream, tally, lat, stopped) {
  const reader = stream.getReader();
  for (;;) {
    if (stopped()) {
      await reader.cancel().catch(() => {});
      return "dropped";
    }
    let got;
    try {
      got = await reader.read();
    } catch (e) {
      // the library errors a resumed stream whose first answer took over 1 s
      // ("Timeout waiting for ack"), even when that answer then arrives
      tally.error = String(e && e.message ? e.message : e);
      return "error";
    }
    const { done, value } = got;
    if (done) {
      tally.ended = true;
      return "done";
    }
    if (stopped()) {
      // dropped while this read was pending: the chunk belongs to the resume (it is
      // within the characters the drop recorded), not to this reader
      await reader.cancel().catch(() => {});
      return "dropped";
    }
    tally.take(value, lat);
  }
}

export function cpuS(since) {
  const u = process.cpuUsage(since);
  return (u.user + u.system) / 1e6;
}
