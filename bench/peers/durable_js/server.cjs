// The Durable Streams reference server (@durable-streams/server) as one process, for
// bench/peers/durable.py: `node server.cjs PORT [DATA_DIR]`. With DATA_DIR it runs in its
// file-backed mode (log files + LMDB, fdatasync on each append), without it in memory.
// Prints "ready PORT" once listening; stopped by its pid (SIGTERM stops the server).
"use strict";
const { DurableStreamTestServer } = require("@durable-streams/server");

const port = Number(process.argv[2]);
const dataDir = process.argv[3];
if (!Number.isInteger(port) || port <= 0) {
  console.error("usage: node server.cjs PORT [DATA_DIR]");
  process.exit(2);
}
const server = new DurableStreamTestServer({
  port,
  host: "127.0.0.1",
  ...(dataDir ? { dataDir } : {}),
});
server.start().then(
  () => console.log(`ready ${port}`),
  (err) => {
    console.error(`cannot start: ${err && err.message}`);
    process.exit(1);
  },
);
const stop = () => server.stop().finally(() => process.exit(0));
process.on("SIGTERM", stop);
process.on("SIGINT", stop);
