-- Open a fenced generation of a session: epoch + 1 and turn + 1, atomically; the offset
-- it continues from (recovered from the backlog if a failover lost the hash); the
-- session's generation id (kept, or recovered, or the fresh one given).
-- A turn still open (its producer died or lost its lock, and the next turn came before
-- a relay reaped it) ends here first, so that every turn ends with exactly one terminal
-- frame: one `error` frame of that turn (`meta.code` `superseded`, `by_turn` the new
-- turn) at the next offset under the new epoch, which fences its producer.
-- KEYS: meta hash, backlog stream, live channel (without it, as callers of the two-key
-- form get: nothing is ended).
-- ARGV: ttl_s, a fresh gen id, then with the live channel: session, ts (ms), maxlen,
-- max bytes of the backlog (0: no byte bound). Loaded after frame.lua, backlog.lua.
-- Returns {epoch, turn, offset, gen}, and the superseding frame when one was written (the
-- offset is then its offset).
local gen = redis.call('HGET', KEYS[1], 'gen')
local prev = tonumber(redis.call('HGET', KEYS[1], 'open') or '0')
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local turn = redis.call('HINCRBY', KEYS[1], 'turn', 1)
local off = tonumber(redis.call('HGET', KEYS[1], 'offset') or '0')
if off == 0 then
  local top = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
  if top[1] then
    off = tonumber(string.match(top[1][1], '^(%d+)'))
    redis.call('HSET', KEYS[1], 'offset', off)
    if not gen then  -- a failover lost the hash, not the backlog: same generation
      local ok, f = pcall(cjson.decode, top[1][2][2])
      if ok and type(f.meta) == 'table' and type(f.meta.gen) == 'string' then gen = f.meta.gen end
    end
  end
end
if not gen then gen = ARGV[2] end
if KEYS[3] then
  off, epoch = skip_lost(KEYS[1], KEYS[2], KEYS[3], ARGV[3], ARGV[4], ARGV[5], ARGV[6], off,
    epoch, gen)
end
local ended = nil
if prev > 0 and KEYS[3] then
  off = off + 1
  local meta = {code = 'superseded', by_turn = turn, gen = gen}
  local f = frame(ARGV[3], prev, off, 'error', 'interrupted: the next turn started', epoch,
    ARGV[4], meta)
  local total = backlog_total(KEYS[1], KEYS[2])
  total = backlog_add(KEYS[2], ARGV[5], string.format('%d-1', off), f, total)
  backlog_trim(KEYS[1], KEYS[2], total, tonumber(ARGV[6] or '0'))
  redis.call('SPUBLISH', KEYS[3], f)
  redis.call('HSET', KEYS[1], 'offset', off)
  ended = f
end
redis.call('HSET', KEYS[1], 'open', turn, 'gen', gen, 'ttl', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
if ended then return {epoch, turn, off, gen, ended} end
return {epoch, turn, off, gen}
