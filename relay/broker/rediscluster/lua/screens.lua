-- A relay's count of the screens it serves a session to, and the session's total over
-- every relay, sent as one presence frame on its live channel (offset 0, in no backlog).
-- KEYS: screens hash, presence sorted set, live channel, tombstone.
-- ARGV: relay id, its count (0: its field removed), session, the presence entry's ttl ms;
-- ARGV[5..]: pairs of a relay known dead and a time (server ms): its entry goes if it
-- expires by then (it was written before the relay went silent), and so its field.
-- A field counts while its relay's presence entry has not expired (server time); this
-- relay's own counts, and gets an entry if it has none yet (NX: one it has is left as it
-- is), so that its screens count before its first presence refresh lands. Fields of
-- relays without a live entry are removed. The hash lives as long as the presence set.
-- Nothing is written for a deleted session. Returns the total, or -1: deleted.
if redis.call('EXISTS', KEYS[4]) == 1 then return -1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[4])
local mine = tonumber(ARGV[2])
if mine > 0 then
  redis.call('HSET', KEYS[1], ARGV[1], mine)
  redis.call('ZADD', KEYS[2], 'NX', now + ttl, ARGV[1])
  if redis.call('PTTL', KEYS[2]) < ttl then redis.call('PEXPIRE', KEYS[2], ttl) end
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
for i = 5, #ARGV - 1, 2 do
  local at = redis.call('ZSCORE', KEYS[2], ARGV[i])
  if at and tonumber(at) <= tonumber(ARGV[i + 1]) then redis.call('ZREM', KEYS[2], ARGV[i]) end
end
local total = mine
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    if tonumber(redis.call('ZSCORE', KEYS[2], all[i]) or '0') > now then
      total = total + tonumber(all[i + 1])
    else
      redis.call('HDEL', KEYS[1], all[i])
    end
  end
end
local left = redis.call('PTTL', KEYS[2])
if left > 0 then redis.call('PEXPIRE', KEYS[1], left) end
local f = frame(ARGV[3], 0, 0, 'presence', '', 0, string.format('%d', now), {screens = total})
redis.call('SPUBLISH', KEYS[3], f)
return total
