// Follow a Durable Streams JSON stream live with the official TypeScript client
// (@durable-streams/client), moving to the next URL from the last offset it was given
// when the current server fails: `node follow.mjs SPEC_JSON`, where the spec is
// {"urls": [A, B, ...], "offset": "-1", "live": "sse" | "long-poll"}. It stops after an
// item with "last": true. Prints "on URL" when it (re)connects, "got N OFFSET" after
// each batch, and at the end one JSON line {"items": [...], "switches": n, "errors": [...]}.
import { stream } from "@durable-streams/client";

const spec = JSON.parse(process.argv[2] ?? "{}");
if (!Array.isArray(spec.urls) || spec.urls.length === 0) {
  console.error('usage: node follow.mjs \'{"urls": [...], "offset": "-1"}\'');
  process.exit(2);
}
const items = [];
const errors = [];
let offset = spec.offset ?? "-1";
let done = false;
let switches = -1;

async function follow(url) {
  switches += 1;
  console.log(`on ${url} from ${offset}`);
  const abort = new AbortController();
  const res = await stream({
    url,
    offset,
    live: spec.live ?? "sse",
    signal: abort.signal,
    backoffOptions: { initialDelay: 100, maxDelay: 500, multiplier: 2, maxRetries: 2 },
    onError: (err) => {
      errors.push(String(err && err.message ? err.message : err).slice(0, 200));
      return undefined; // propagate: this server is gone, the next one takes over
    },
  });
  await new Promise((resolve, reject) => {
    res.subscribeJson(async (batch) => {
      items.push(...batch.items);
      offset = batch.offset;
      console.log(`got ${items.length} ${offset}`);
      if (batch.items.some((m) => m && m.last === true)) {
        done = true;
        abort.abort();
        resolve();
      }
    });
    res.closed.then(resolve, reject);
  });
}

for (let i = 0; !done; i = Math.min(i + 1, spec.urls.length - 1)) {
  try {
    await follow(spec.urls[i]);
  } catch (err) {
    if (done) break;
    errors.push(String(err && err.message ? err.message : err).slice(0, 200));
    if (i === spec.urls.length - 1 && errors.length > 50) break;
    await new Promise((r) => setTimeout(r, 100));
  }
}
console.log(JSON.stringify({ items, switches, errors }));
process.exit(0);
