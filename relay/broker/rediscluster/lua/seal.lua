-- A relay delivered offsets up to ``seen`` but the backlog now ends before them (a
-- failover lost them): one ``gap`` frame at ``seen`` over the lost range, so that no
-- offset a client holds is reused. KEYS: meta hash, backlog stream, live channel.
-- ARGV: seen, maxlen, ttl_s (when the session has none), session, ts (ms), sealer, gen
-- (the generation ``seen`` was delivered in; '' when unknown), max bytes of the backlog
-- (0 or absent: no byte bound). Loaded after frame.lua, backlog.lua. Returns how many
-- offsets were sealed (0: none missing, or another generation, or none).
local cur = redis.call('HMGET', KEYS[1], 'offset', 'gen')
local off = tonumber(cur[1] or '0')
local seen = tonumber(ARGV[1])
if off >= seen then return 0 end
-- another generation (the keys expired and restarted), or none: nothing to seal
if ARGV[7] ~= '' and cur[2] ~= ARGV[7] then return 0 end
local meta = {from = off + 1, to = seen, code = 'lost_in_failover', sealed_by = ARGV[6]}
if cur[2] then meta.gen = cur[2] end
local f = frame(ARGV[4], 0, seen, 'gap', 'frames lost in a Redis failover', 0, ARGV[5], meta)
local total = backlog_total(KEYS[1], KEYS[2])
total = backlog_add(KEYS[2], ARGV[2], string.format('%d-1', seen), f, total)
backlog_trim(KEYS[1], KEYS[2], total, tonumber(ARGV[8] or '0'))
redis.call('SPUBLISH', KEYS[3], f)
redis.call('HSET', KEYS[1], 'offset', seen)
local ttl = redis.call('TTL', KEYS[1])  -- keep the session's own lifetime
if ttl < 1 then ttl = tonumber(ARGV[3]) end
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return seen - off
