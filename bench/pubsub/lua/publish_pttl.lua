-- The product's publish script as it was before the per-call PTTL went (relay/broker/
-- rediscluster/lua/publish.lua at that time), kept verbatim below as the baseline that
-- bench.pubsub.publish_cost's script_pttl variant measures beside today's script. Its
-- frames start at ARGV[9] (the benchmark drops today's ARGV[9], the producer's clock).
-- Loaded after the product's backlog.lua. Not used by any producer.
-- Append frames and SPUBLISH each, fenced: a stale epoch or generation gets FENCED
-- <epoch> and writes nothing; an offset that is not the expected one gets OFFSET <off>.
-- KEYS: meta hash, backlog stream, live channel.
-- ARGV: epoch, expected offset, maxlen, ttl_s, terminal (1: the last frame ends the turn),
-- turn, gen, max bytes of the backlog (0: no byte bound), then the encoded frames.
-- Loaded after backlog.lua. Returns the last offset written.
-- Per call, besides an XADD and an SPUBLISH per frame: one HMGET, one HSET, one PTTL
-- (a read; none after a terminal frame), and the two EXPIREs only after a terminal frame
-- (the turn's end: the keys live a full TTL from it) or when the TTL has run down by more
-- than the slack (min(60 s, ttl_s / 16)) since it was last set: once a minute per
-- streaming session, not once a second (at a few tokens a second per session that was
-- every other frame: bench.peers.pathcost's commandstats). Every script sets the two
-- keys' TTLs together, so the backlog's stands for both, except where a key is new: the
-- stream's first XADD (PTTL -1) and a hash this script restores (refreshed at once).
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'offset', 'gen', 'bytes', 'ttl')
local epoch = tonumber(cur[1] or '0')
local off = tonumber(cur[2] or '0')
if epoch > tonumber(ARGV[1]) then return redis.error_reply('FENCED ' .. epoch) end
if cur[3] and cur[3] ~= ARGV[7] then return redis.error_reply('FENCED ' .. epoch) end
if off ~= tonumber(ARGV[2]) then return redis.error_reply('OFFSET ' .. off) end
local refresh = false
if epoch < tonumber(ARGV[1]) then
  -- a failover lost our open_generation (asynchronous replication): restore it
  refresh = true
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'open', ARGV[6], 'gen', ARGV[7])
  local turn = tonumber(redis.call('HGET', KEYS[1], 'turn') or '0')
  if turn < tonumber(ARGV[6]) then redis.call('HSET', KEYS[1], 'turn', ARGV[6]) end
end
local total = tonumber(cur[4] or '')
if total == nil then total = backlog_total(KEYS[1], KEYS[2]) end
for i = 9, #ARGV do
  off = off + 1
  total = backlog_add(KEYS[2], ARGV[3], string.format('%d-1', off), ARGV[i], total)
  redis.call('SPUBLISH', KEYS[3], ARGV[i])
end
backlog_cut(KEYS[2], total, tonumber(ARGV[8]))
if cur[5] then
  redis.call('HSET', KEYS[1], 'offset', off, 'bytes', total)
else  -- a failover lost the OPEN: the session's lifetime, for relays to extend it by
  redis.call('HSET', KEYS[1], 'offset', off, 'bytes', total, 'ttl', ARGV[4])
end
if ARGV[5] == '1' then redis.call('HDEL', KEYS[1], 'open') end
local ttl_ms = tonumber(ARGV[4]) * 1000
local due = ttl_ms - math.min(60000, math.floor(ttl_ms / 16))
-- PTTL is -1 for a key without a TTL (the stream's first XADD)
if refresh or ARGV[5] == '1' or redis.call('PTTL', KEYS[2]) < due then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return off
