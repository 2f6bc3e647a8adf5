-- Open a fenced generation of a session: epoch + 1 and turn + 1, atomically; the offset
-- it continues from (recovered from the backlog if a failover lost the hash); the
-- session's generation id (kept, or recovered, or the fresh one given).
-- KEYS: meta hash, backlog stream. ARGV: ttl_s, a fresh gen id.
-- Returns {epoch, turn, offset, gen}.
local gen = redis.call('HGET', KEYS[1], 'gen')
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
redis.call('HSET', KEYS[1], 'open', turn, 'gen', gen, 'ttl', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return {epoch, turn, off, gen}
