// Plain Node: your own loop streams a reply into a tokenrelay session; any number of
// screens watch it from any relay. Against `make demo`:
//   export TOKENRELAY_SECRET=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')
//   make demo                               # in another terminal, same secret
//   cd clients/producer && npm ci && node examples/node.mjs
// Prints where to watch (a relay's SSE URL and its token), then the reply once written.
import { streamText } from 'ai';
import { Producer, pipe } from '@tokenrelay/producer';
import { BASE, SECRET, redisUrl } from './config.mjs';
import { mockModel } from './mock-model.mjs'; // your provider's model here

const producer = await Producer.connect(await redisUrl(), { secret: SECRET });
try {
  const session = producer.session();
  const token = session.token({ ttlS: 600 });
  console.log(JSON.stringify({ session: session.id, token, events: `${BASE}/v1/sessions/${session.id}/events` }));

  const turn = await session.startTurn('What does a relay do?', { meta: { model: 'mock' } });
  const result = streamText({ model: mockModel(), prompt: 'What does a relay do?', abortSignal: turn.signal });
  await pipe(turn, result); // every delta, then done (usage, finish reason, sha256)
  console.log(turn.text);
} finally {
  await producer.close();
}
