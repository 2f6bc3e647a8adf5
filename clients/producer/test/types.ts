// A typed use of the API, checked by `tsc --noEmit` (npm run typecheck): the
// declarations in index.d.ts must describe what the README shows.
import { streamText } from 'ai';
import { InvalidSession, Producer, ProducerError, StopReason, pipe, type Turn } from '@tokenrelay/producer';
import { MockLanguageModelV3 } from 'ai/test';

export async function route(url: string, secret: string): Promise<{ session: string; token: string }> {
  const producer = await Producer.connect(url, { secret, coalesce: { maxTokens: 8 } });
  const session = producer.session();
  const turn: Turn = await session.startTurn('Hello?', { meta: { model: 'mock' } });
  const result = streamText({ model: new MockLanguageModelV3(), prompt: 'Hello?', abortSignal: turn.signal });
  const offset: Promise<number> = pipe(turn, result);
  turn.onStop((why) => {
    if (why === StopReason.CANCELLED) console.log('stopped');
  });
  void offset;
  return { session: session.id, token: session.token({ ttlS: 600 }) };
}

export function code(err: unknown): string {
  if (err instanceof InvalidSession) return err.code;
  return err instanceof ProducerError ? err.code : 'internal';
}

// An app's own client, of ioredis 5 or 6 (the producer calls only what both have).
import { Cluster as Cluster6, Redis as Redis6 } from 'ioredis6';
export function ownClients(secret: string): string[] {
  const cluster = new Producer(new Cluster6([{ host: '127.0.0.1', port: 7000 }]), { secret });
  const single = new Producer(new Redis6(), { secret });
  return [cluster.session().id, single.producerId];
}
// @ts-expect-error: not a Redis client
export const notAClient = new Producer({ get: 1 });

// The openai SDK's Responses events and LangChain's message chunks, piped.
import { pipeLangChain, pipeResponses, type LangChainChunkLike, type ResponsesEventLike } from '@tokenrelay/producer';
import { AIMessageChunk } from '@langchain/core/messages';
export async function more(turn: Turn, again: Turn): Promise<number[]> {
  async function* events(): AsyncGenerator<ResponsesEventLike> {
    yield { type: 'response.output_text.delta', item_id: 'm', delta: 'Hi' };
  }
  async function* chunks(): AsyncGenerator<LangChainChunkLike> {
    yield new AIMessageChunk({ content: 'Hi', tool_call_chunks: [{ name: 'f', args: '{}', id: 't1', index: 0 }] });
  }
  return [await pipeResponses(turn, events()), await pipeLangChain(again, chunks())];
}
