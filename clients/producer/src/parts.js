// A reply's parts besides its text (docs/PROTOCOL.md, "Parts"; the Python API's
// relay/protocol/parts.py and relay/producer/parts.py): reasoning and tool calls stream
// (start, delta..., end), tool results, sources, usage and data-<name> parts are one
// frame whose text is JSON. `Parts` refuses what would corrupt a transcript (PartError,
// nothing written); `partsIntegrity` is the done frame's `parts` and `parts_sha256`.
import { createHash } from 'node:crypto';
import { ProducerError } from './errors.js';

const STREAMED = new Set(['reasoning', 'tool-call']);
const WHOLE = new Set(['tool-result', 'source', 'usage']);
const PART_ID = /^[!-~]{1,128}$/;
const DATA_PART = /^data-[A-Za-z0-9_-]{1,64}$/;

/** A part that would corrupt the transcript: an unknown type, a delta for a part never
 * started, arguments that are not JSON when the call ends, a part after the turn ended. */
export class PartError extends ProducerError {
  constructor(message) {
    super(message);
    this.name = 'PartError';
    this.code = 'invalid_part';
  }
}

export function checkType(part) {
  if (typeof part === 'string' && (STREAMED.has(part) || WHOLE.has(part) || DATA_PART.test(part))) return part;
  throw new PartError(`unknown part type ${JSON.stringify(part)}: reasoning, tool-call, tool-result, source, usage or data-<name>`);
}

export const isStreamed = (part) => STREAMED.has(part);

function checkId(what, v) {
  if (typeof v !== 'string' || !PART_ID.test(v)) throw new PartError(`${what} must be 1..128 printable ASCII characters, no space: ${JSON.stringify(v)}`);
  return v;
}

const isJson = (text) => { try { JSON.parse(text); return true; } catch { return false; } };

/** The part fields of a frame's meta. */
export function partMeta(ref) {
  const m = { part: ref.part, id: ref.id };
  if (ref.phase) m.phase = ref.phase;
  if (ref.name) m.name = ref.name;
  if (ref.summary) m.summary = true;
  if (ref.error) m.error = true;
  return m;
}

/** One turn's parts in the order they started (see the module comment). */
export class Parts {
  constructor() {
    /** @type {{part: string, id: string, name: string, text: string, done: boolean, summary: boolean, error: boolean}[]} */
    this.records = [];
    this.closed = false;
    this.byKey = new Map();
  }

  get(part, id) { return this.byKey.get(`${part}\n${id}`) ?? null; }

  open() { return this.records.filter((p) => !p.done); }

  /** Apply one part frame (`ref`: {part, id, phase, name, summary, error}); nothing
   * changes when it is refused. */
  apply(ref, text) {
    if (this.closed) throw new PartError(`${ref.part} ${JSON.stringify(ref.id)} after the turn ended`);
    checkType(ref.part);
    checkId("a part's id", ref.id);
    const p = this.get(ref.part, ref.id);
    if (!STREAMED.has(ref.part)) {
      if (p) throw new PartError(`${ref.part} ${JSON.stringify(ref.id)} was already written`);
      if (ref.part === 'tool-result') {
        const call = this.get('tool-call', ref.id);
        if (!call || !call.done) throw new PartError(`tool-result for call ${JSON.stringify(ref.id)}, which the turn has not finished`);
      }
      if (!isJson(text)) throw new PartError(`${ref.part} ${JSON.stringify(ref.id)}: its value is not valid JSON`);
      return this.add({ part: ref.part, id: ref.id, name: ref.name || '', text, done: true, summary: false, error: !!ref.error });
    }
    if (ref.phase === 'start') {
      if (p) throw new PartError(`${ref.part} ${JSON.stringify(ref.id)} was already started`);
      if (ref.part === 'tool-call') checkId("a tool's name", ref.name);
      return this.add({ part: ref.part, id: ref.id, name: ref.name || '', text: '', done: false, summary: !!ref.summary, error: false });
    }
    if (!p) throw new PartError(`${ref.phase} for ${ref.part} ${JSON.stringify(ref.id)}, which was never started`);
    if (p.done) throw new PartError(`${ref.phase} for ${ref.part} ${JSON.stringify(ref.id)}, which already ended`);
    if (ref.phase === 'delta') { p.text += text; return p; }
    if (ref.part === 'tool-call' && !isJson(p.text)) {
      throw new PartError(`tool-call ${JSON.stringify(ref.id)} (${p.name}): its arguments are not valid JSON`);
    }
    p.done = true;
    return p;
  }

  add(p) {
    if (this.records.length >= 4096) throw new PartError('more than 4096 parts in one turn');
    this.records.push(p);
    this.byKey.set(`${p.part}\n${p.id}`, p);
    return p;
  }
}

/** Hex SHA-256 over the parts in the order they started (docs/PROTOCOL.md, "Parts"). */
export function partsDigest(records) {
  const h = createHash('sha256');
  for (const p of records) {
    const name = p.summary ? 'summary' : p.name;
    h.update(`${p.part}\x1f${p.id}\x1f${name}\x1f${Buffer.byteLength(p.text, 'utf8')}\x1f`, 'utf8');
    h.update(p.text, 'utf8');
  }
  return h.digest('hex');
}

/** The done frame's `parts` and `parts_sha256`; nothing for a turn without parts. */
export function partsIntegrity(records) {
  return records.length ? { parts: records.length, parts_sha256: partsDigest(records) } : {};
}
