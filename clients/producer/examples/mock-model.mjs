// A scripted language model for the examples and tests (the AI SDK's own mock from
// `ai/test`): no API key, no network. In your backend use a provider's model instead,
// e.g. `openai('gpt-4o-mini')` from @ai-sdk/openai.
import { simulateReadableStream } from 'ai';
import { MockLanguageModelV3 } from 'ai/test';

/** A model that streams `reply` word by word, `delayMs` apart, with usage and finish reason. */
export function mockModel(reply = 'Streams from your own backend reach every screen.', { delayMs = 20, finishReason = 'stop' } = {}) {
  const words = reply.match(/\S+\s*/g) ?? [];
  return new MockLanguageModelV3({
    doStream: async () => ({
      stream: simulateReadableStream({
        chunkDelayInMs: delayMs,
        chunks: [
          { type: 'stream-start', warnings: [] },
          { type: 'text-start', id: 't0' },
          ...words.map((delta) => ({ type: 'text-delta', id: 't0', delta })),
          { type: 'text-end', id: 't0' },
          {
            type: 'finish',
            finishReason: { unified: finishReason, raw: finishReason },
            usage: {
              inputTokens: { total: 9, noCache: 9, cacheRead: 0, cacheWrite: 0 },
              outputTokens: { total: words.length, text: words.length, reasoning: 0 },
            },
          },
        ],
      }),
    }),
  });
}
