// One turn through the Vercel AI SDK's stock transport, against `make demo`:
//   cd clients/aisdk && npm ci && node example.mjs
// (TOKENRELAY_BASE=http://HOST:PORT points it at another front door.)
import { DefaultChatTransport, readUIMessageStream } from "ai";

const base = process.env.TOKENRELAY_BASE ?? "http://127.0.0.1:8080";
const { session, token } = await (await fetch(`${base}/v1/sessions`, { method: "POST" })).json();
const transport = new DefaultChatTransport({
  api: `${base}/v1/chat`, headers: { Authorization: `Bearer ${token}` },
});
const stream = await transport.sendMessages({
  chatId: session, trigger: "submit-message", messageId: undefined, abortSignal: undefined,
  messages: [{ id: "m1", role: "user", parts: [{ type: "text", text: "hello" }] }],
});
let reply;
for await (const message of readUIMessageStream({ stream })) reply = message;
console.log(reply.parts.filter((p) => p.type === "text").map((p) => p.text).join(""));
