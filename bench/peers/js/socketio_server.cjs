// The peer under test: one Socket.IO 4.8 server process on a Redis Cluster, with either
// - "sharded" (the default): @socket.io/redis-adapter's sharded adapter (SSUBSCRIBE per
//   room, "dynamic" subscription mode), no state recovery: at most once;
// - "streams": @socket.io/redis-streams-adapter (every broadcast an XADD to one stream,
//   read by every server with XREAD) and connection state recovery on: a client that
//   comes back within maxDisconnectionDuration with its pid and last offset gets what it
//   missed (XRANGE from that offset), its rooms restored.
// Started by bench/peers/node.py with NODE_PATH pointing at its npm cache.
//
//   node socketio_server.cjs <port> <host:port of a cluster node> [sharded|streams]
//
// A client connects with the WebSocket transport and `?room=<session id>`; the
// server puts it in that room and sends it whatever is broadcast there. It prints
// "ready <port>" once it listens; SIGTERM ends it.
"use strict";

const http = require("node:http");
const { Server } = require("socket.io");
const { createShardedAdapter } = require("@socket.io/redis-adapter");
const { createCluster } = require("redis");

function streamsAdapter(pub) {
  // the Socket.IO setup that keeps what it sends: its docs' options for connection state
  // recovery, the adapter's defaults (one stream, MAXLEN ~10000) but its own heartbeats
  // over sharded Pub/Sub, as the sharded adapter publishes on a cluster
  const { createAdapter } = require("@socket.io/redis-streams-adapter");
  return createAdapter(pub, { useShardedPubSub: true });
}

async function main() {
  const [port, seed, mode = "sharded"] = process.argv.slice(2);
  if (!port || !seed) {
    console.error("usage: socketio_server.cjs <port> <host:port>");
    process.exit(2);
  }
  const pub = createCluster({ rootNodes: [{ url: `redis://${seed}` }] });
  const sub = pub.duplicate();
  for (const c of [pub, sub]) c.on("error", (e) => console.error("redis:", e.message));
  await Promise.all([pub.connect(), sub.connect()]);

  const httpServer = http.createServer();
  const streams = mode === "streams";
  const io = new Server(httpServer, {
    transports: ["websocket"],
    serveClient: false,
    adapter: streams
      ? streamsAdapter(pub)
      : createShardedAdapter(pub, sub, { subscriptionMode: "dynamic" }),
    ...(streams
      ? { connectionStateRecovery: { maxDisconnectionDuration: 2 * 60 * 1000, skipMiddlewares: true } }
      : {}),
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
