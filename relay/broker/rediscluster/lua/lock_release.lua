-- Give a key back when it is still its owner's (a turn lock; an idempotency claim).
-- KEYS: the key. ARGV: owner prefix (the value starts with it). Returns 1 or 0.
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, #ARGV[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
