-- The publish script as it was before its per-frame writes were cut (relay/broker/
-- rediscluster/lua/publish.lua at that time), kept verbatim as the baseline that
-- bench.pubsub.publish_cost measures beside the current script and the XADD + SPUBLISH floor.
-- Loaded after the product's backlog.lua. Not used by any producer.
-- Append frames and SPUBLISH each, fenced: a stale epoch or generation gets FENCED
-- <epoch> and writes nothing; an offset that is not the expected one gets OFFSET <off>.
-- KEYS: meta hash, backlog stream, live channel.
-- ARGV: epoch, expected offset, maxlen, ttl_s, terminal (1: the last frame ends the turn),
-- turn, gen, max bytes of the backlog (0: no byte bound), then the encoded frames.
-- Loaded after backlog.lua. Returns the last offset written.
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'offset', 'gen')
local epoch = tonumber(cur[1] or '0')
local off = tonumber(cur[2] or '0')
if epoch > tonumber(ARGV[1]) then return redis.error_reply('FENCED ' .. epoch) end
if cur[3] and cur[3] ~= ARGV[7] then return redis.error_reply('FENCED ' .. epoch) end
if off ~= tonumber(ARGV[2]) then return redis.error_reply('OFFSET ' .. off) end
if epoch < tonumber(ARGV[1]) then
  -- a failover lost our open_generation (asynchronous replication): restore it
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'open', ARGV[6], 'gen', ARGV[7])
  local turn = tonumber(redis.call('HGET', KEYS[1], 'turn') or '0')
  if turn < tonumber(ARGV[6]) then redis.call('HSET', KEYS[1], 'turn', ARGV[6]) end
end
local total = backlog_total(KEYS[1], KEYS[2])
for i = 9, #ARGV do
  off = off + 1
  total = backlog_add(KEYS[2], ARGV[3], string.format('%d-1', off), ARGV[i], total)
  redis.call('SPUBLISH', KEYS[3], ARGV[i])
end
backlog_trim(KEYS[1], KEYS[2], total, tonumber(ARGV[8]))
redis.call('HSET', KEYS[1], 'offset', off)
redis.call('HSETNX', KEYS[1], 'ttl', ARGV[4])
if ARGV[5] == '1' then redis.call('HDEL', KEYS[1], 'open') end
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return off
