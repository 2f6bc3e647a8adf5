-- End a session's open turn whose producer is gone (its turn lock expired), once.
-- KEYS: meta hash, backlog stream, live channel, turn lock.
-- ARGV: maxlen, ttl_s (when the session has none), session, ts (ms), reason, reaper, max
-- bytes of the backlog (0 or absent: no byte bound). Loaded after frame.lua, backlog.lua,
-- failover.lua (a session whose last writes were made in another replication history
-- gets its skip and `gap` frame first).
-- Returns {'locked'|'idle'|'reaped', offset, turn}.
if redis.call('EXISTS', KEYS[4]) == 1 then return {'locked', 0, 0} end
local turn = tonumber(redis.call('HGET', KEYS[1], 'open') or '0')
if turn == 0 then return {'idle', 0, 0} end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local off = tonumber(redis.call('HGET', KEYS[1], 'offset') or '0')
local gen = redis.call('HGET', KEYS[1], 'gen')
off, epoch = skip_lost(KEYS[1], KEYS[2], KEYS[3], ARGV[3], ARGV[4], ARGV[1], ARGV[7], off, epoch,
  gen)
off = off + 1
local meta = {code = 'worker_lost', reaped_by = ARGV[6]}
if gen then meta.gen = gen end
local f = frame(ARGV[3], turn, off, 'error', ARGV[5], epoch, ARGV[4], meta)
local total = backlog_total(KEYS[1], KEYS[2])
total = backlog_add(KEYS[2], ARGV[1], string.format('%d-1', off), f, total)
backlog_trim(KEYS[1], KEYS[2], total, tonumber(ARGV[7] or '0'))
redis.call('SPUBLISH', KEYS[3], f)
redis.call('HSET', KEYS[1], 'offset', off)
redis.call('HDEL', KEYS[1], 'open')
local ttl = redis.call('TTL', KEYS[1])  -- keep the session's own lifetime
if ttl < 1 then ttl = tonumber(ARGV[2]) end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return {'reaped', off, turn}
