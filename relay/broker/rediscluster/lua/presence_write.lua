-- A relay's presence entry for a session, the session kept alive while watched, and its
-- screen count put right when a relay's entry expired.
-- KEYS[1] presence key; then (only KEYS[1]: the entry alone) KEYS[2] the screens hash,
-- KEYS[3] the live channel, KEYS[4] the session's meta hash, KEYS[5..] its other keys to
-- keep alive. ARGV[1] relay id, ARGV[2] ttl ms, ARGV[3] the session (with KEYS[2..]),
-- ARGV[4..]: pairs of a relay known dead (its heartbeat stopped) and a time (server
-- ms): its entry goes now if it expires by then (it was written before the relay went
-- silent; one written since, by a relay back under the same id, stays).
-- Score = server now + ttl; entries already expired are dropped; the key lives as long
-- as its newest entry, and the screens hash with it. A screens field whose relay has no
-- live entry any more (it died) is removed, and the total of the others is sent as a
-- presence frame (only then). The session's keys get at least max(its stored lifetime,
-- the entry's ttl), never less than they have.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('PTTL', KEYS[1]) < ttl then redis.call('PEXPIRE', KEYS[1], ttl) end
if not KEYS[2] then return now end
for i = 4, #ARGV - 1, 2 do
  local at = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if at and tonumber(at) <= tonumber(ARGV[i + 1]) then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
local all = redis.call('HGETALL', KEYS[2])
if #all > 0 then
  local total, stale = 0, false
  for i = 1, #all, 2 do
    if redis.call('ZSCORE', KEYS[1], all[i]) then
      total = total + tonumber(all[i + 1])
    else
      redis.call('HDEL', KEYS[2], all[i])
      stale = true
    end
  end
  redis.call('PEXPIRE', KEYS[2], redis.call('PTTL', KEYS[1]))
  if stale then
    local f = frame(ARGV[3], 0, 0, 'presence', '', 0, string.format('%d', now), {screens = total})
    redis.call('SPUBLISH', KEYS[3], f)
  end
end
local life = tonumber(redis.call('HGET', KEYS[4], 'ttl') or '0') or 0
if life > 0 then
  life = math.max(life * 1000, ttl)
  for i = 4, #KEYS do redis.call('PEXPIRE', KEYS[i], life, 'GT') end
end
return now
