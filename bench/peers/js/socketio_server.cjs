// The peer under test: one Socket.IO 4.8 server process with @socket.io/redis-adapter's
// sharded adapter (SSUBSCRIBE per room, "dynamic" subscription mode) on a Redis Cluster.
// Started by bench/peers/socketio.py with NODE_PATH pointing at its npm cache.
//
//   node socketio_server.cjs <port> <host:port of a cluster node>
//
// A client connects with the WebSocket transport and `?room=<session id>`; the
// server puts it in that room and sends it whatever is broadcast there. It prints
// "ready <port>" once it listens; SIGTERM ends it.
"use strict";

const http = require("node:http");
const { Server } = require("socket.io");
const { createShardedAdapter } = require("@socket.io/redis-adapter");
const { createCluster } = require("redis");

async function main() {
  const [port, seed] = process.argv.slice(2);
  if (!port || !seed) {
    console.error("usage: socketio_server.cjs <port> <host:port>");
    process.exit(2);
  }
  const pub = createCluster({ rootNodes: [{ url: `redis://${seed}` }] });
  const sub = pub.duplicate();
  for (const c of [pub, sub]) c.on("error", (e) => console.error("redis:", e.message));
  await Promise.all([pub.connect(), sub.connect()]);

  const httpServer = http.createServer();
  const io = new Server(httpServer, {
    transports: ["websocket"],
    serveClient: false,
    adapter: createShardedAdapter(pub, sub, { subscriptionMode: "dynamic" }),
  });
  io.on("connection", (socket) => {
    const room = socket.handshake.query.room;
    if (typeof room === "string" && room.length > 0) socket.join(room);
    else socket.disconnect(true);
  });
  httpServer.listen(Number(port), "127.0.0.1", () => console.log(`ready ${port}`));
  process.on("SIGTERM", () => process.exit(0));
}

main().catch((e) => {
  console.error(e && e.stack ? e.stack : String(e));
  process.exit(1);
});
