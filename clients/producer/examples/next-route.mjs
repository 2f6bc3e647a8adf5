// A Next.js route handler (app/api/chat/route.js) that keeps its own streamText call
// and hands the reply to tokenrelay: the response is where to watch (a relay's SSE URL
// and a watch token), at once; the reply streams into the session in the background,
// and every screen (a reload, a second tab, another device) reads it from any relay.
// In Next.js wrap the background work in `after()` from 'next/server' so the platform
// keeps the function alive until the turn ends.
import { streamText } from 'ai';
import { Producer, ProducerError, pipe } from '@tokenrelay/producer';
import { BASE, SECRET, redisUrl } from './config.mjs';
import { mockModel } from './mock-model.mjs'; // your provider's model here: openai('gpt-4o-mini')

let producer; // one per process: connected on the first request
const getProducer = async () => (producer ??= await Producer.connect(await redisUrl(), { secret: SECRET }));

export async function POST(req) {
  const { message = '', session: sid } = await req.json();
  try {
    const p = await getProducer();
    const session = p.session(sid); // InvalidSession: a 400 below
    const turn = await session.startTurn(message); // TurnBusy while another turn generates
    const result = streamText({ model: mockModel(), prompt: message, abortSignal: turn.signal });
    pipe(turn, result).catch((err) => console.error(`turn ${turn.turn} of ${session.id}: ${err.message}`));
    return Response.json({
      session: session.id,
      turn: turn.turn,
      offset: turn.firstOffset, // watch from here: ?last_event_id=offset - 1
      token: session.token({ ttlS: 600 }),
      events: `${BASE}/v1/sessions/${session.id}/events`,
    });
  } catch (err) {
    if (!(err instanceof ProducerError)) throw err;
    const status = err.code === 'invalid_session' ? 400 : err.code === 'turn_busy' ? 409 : 503;
    return Response.json({ error: err.code, message: err.message }, { status });
  }
}
