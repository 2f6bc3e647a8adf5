-- Name the turn in a producer's turn lock (after its generation opened): the lock is
-- set to ARGV[3] when it is this owner's or nobody's (it expired during a slow start;
-- the generation just opened fences every older producer anyway).
-- KEYS: turn lock. ARGV: owner prefix ("<owner> "), TTL (ms), the lock's new value
-- ("<owner> {\"turn\":N,\"offset\":M}"). Returns 1 (set) or 0 (another owner holds it).
local v = redis.call('GET', KEYS[1])
if (not v) or string.sub(v, 1, #ARGV[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[2])
  return 1
end
return 0
