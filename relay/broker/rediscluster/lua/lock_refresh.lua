-- Extend a running turn's lock and look for a stop of the turn, in one round trip.
-- KEYS: turn lock, stop record (hash: turn -> 'asked' | terminal offset).
-- ARGV: owner prefix ("<owner> "), TTL (ms), turn.
-- Returns 0 (the lock is not ours any more), 1 (refreshed), 2 (refreshed, and a stop of
-- the turn was asked).
local v = redis.call('GET', KEYS[1])
if not (v and string.sub(v, 1, #ARGV[1]) == ARGV[1]) then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if redis.call('HGET', KEYS[2], ARGV[3]) == 'asked' then return 2 end
return 1
