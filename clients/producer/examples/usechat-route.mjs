// useChat with your own backend: Next.js route handlers for the AI SDK's stock
// DefaultChatTransport (what `useChat()` uses). The POST keeps its own streamText call,
// writes the reply into tokenrelay, and answers with the relay's UI message stream of
// that turn, forwarded as is: the transport reads it like any AI SDK route, while every
// other screen (a second tab, a reload, another device) reads the same turn from any
// relay. The GET is the transport's resume URL (`useChat({ resume: true })`): the running
// turn from its start, or 204 when none runs.
//
//   app/api/chat/route.js             export { POST } from '.../usechat-route.mjs'
//   app/api/chat/[id]/stream/route.js export { GET } from '.../usechat-route.mjs'
//
// Check your own user's right to the chat id in both before anything else.
import { streamText } from 'ai';
import { Producer, ProducerError, pipe } from '@tokenrelay/producer';
import { BASE, SECRET, redisUrl } from './config.mjs';
import { mockModel } from './mock-model.mjs'; // your provider's model here: openai('gpt-4o-mini')

let producer; // one per process: connected on the first request
const getProducer = async () => (producer ??= await Producer.connect(await redisUrl(), { secret: SECRET }));

/** The relay's UI message stream of the session's running turn (its headers with it). */
async function relayStream(path, token) {
  const upstream = await fetch(`${BASE}${path}`, { headers: { Authorization: `Bearer ${token}` } });
  if (upstream.status === 204) return new Response(null, { status: 204 });
  const headers = new Headers(upstream.headers);
  headers.delete('content-length');
  return new Response(upstream.body, { status: upstream.status, headers });
}

const lastUserText = (messages) => {
  const last = [...(messages ?? [])].reverse().find((m) => m.role === 'user');
  return (last?.parts ?? []).filter((p) => p.type === 'text').map((p) => p.text).join('');
};

export async function POST(req) {
  const { id, messages } = await req.json(); // the transport's body: the chat id, the messages
  try {
    const session = (await getProducer()).session(id); // the chat id is the session id
    const prompt = lastUserText(messages);
    const turn = await session.startTurn(prompt); // TurnBusy while another turn generates
    // subscribe first (the turn is open, nothing written yet), then generate
    const res = await relayStream(`/v1/sessions/${session.id}/ui-stream`, session.token({ ttlS: 600 }));
    const result = streamText({ model: mockModel(), prompt, abortSignal: turn.signal });
    pipe(turn, result).catch((err) => console.error(`turn ${turn.turn} of ${session.id}: ${err.message}`));
    return res;
  } catch (err) {
    if (!(err instanceof ProducerError)) throw err;
    const status = err.code === 'invalid_session' ? 400 : err.code === 'turn_busy' ? 409 : 503;
    return Response.json({ error: err.code, message: err.message }, { status });
  }
}

export async function GET(_req, { params }) {
  const { id } = await params; // Next.js 15 passes params as a promise
  try {
    const session = (await getProducer()).session(id);
    return await relayStream(`/v1/chat/${session.id}/stream`, session.token({ ttlS: 600 }));
  } catch (err) {
    if (!(err instanceof ProducerError)) throw err;
    return Response.json({ error: err.code, message: err.message }, { status: 400 });
  }
}
