-- A relay's presence entry for a session, and the session kept alive while watched.
-- KEYS[1] presence key, KEYS[2] the session's meta hash, KEYS[3..] its other keys to keep
-- alive (only KEYS[1]: the entry alone); ARGV[1] relay id, ARGV[2] ttl ms. Score = server
-- now + ttl; entries already expired are dropped; the key lives as long as its newest
-- entry. The session's keys get at least max(its stored lifetime, the entry's ttl),
-- never less than they have.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
local life = 0
if KEYS[2] then life = tonumber(redis.call('HGET', KEYS[2], 'ttl') or '0') or 0 end
if life > 0 then
  life = math.max(life * 1000, ttl)
  for i = 2, #KEYS do redis.call('PEXPIRE', KEYS[i], life, 'GT') end
end
return now
