-- A relay's heartbeat, and the relays whose heartbeat stopped (they died, or stalled).
-- KEYS[1] the relays' heartbeats: sorted set, relay id -> when its heartbeat expires
-- (server ms). ARGV[1] relay id, ARGV[2] ttl ms, ARGV[3] how long a stopped relay stays
-- listed (ms), ARGV[4] how many stopped relays to return at most.
-- Returns {lapsed, id, expired, id, expired, ...}: lapsed is 1 when this relay's own
-- heartbeat had expired (or was gone) before this one: the others may have taken it for
-- dead and dropped its screen counts. Then each relay whose heartbeat has expired, with
-- when it expired (server ms), oldest first.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local old = redis.call('ZSCORE', KEYS[1], ARGV[1])
local lapsed = 0
if (not old) or tonumber(old) <= now then lapsed = 1 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[3]))
local out = {lapsed}
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'WITHSCORES', 'LIMIT', 0, tonumber(ARGV[4]))
for i = 1, #dead do out[#out + 1] = dead[i] end
return out
