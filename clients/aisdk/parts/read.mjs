// The AI SDK's own reader on a UI message stream from a file: the SSE body is parsed with
// the SDK's parseJsonEventStream and its uiMessageChunkSchema (every chunk checked as the
// SDK's transport checks it), then readUIMessageStream builds the message. Prints the
// final UI message as JSON, or exits 1 with the first chunk the SDK refused.
// Usage: node parts/read.mjs <file with the SSE body>
import { readFileSync } from "node:fs";
import { parseJsonEventStream, readUIMessageStream, uiMessageChunkSchema } from "ai";

const body = readFileSync(process.argv[2]);
const bytes = new ReadableStream({
  start(c) { c.enqueue(new Uint8Array(body)); c.close(); },
});
const chunks = parseJsonEventStream({ stream: bytes, schema: uiMessageChunkSchema }).pipeThrough(
  new TransformStream({
    transform(result, c) {
      if (!result.success) {
        console.error(`refused chunk: ${result.error}`);
        process.exit(1);
      }
      c.enqueue(result.value);
    },
  }),
);
let last;
for await (const message of readUIMessageStream({ stream: chunks })) last = message;
console.log(JSON.stringify(last));
