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
