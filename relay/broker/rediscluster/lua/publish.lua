-- Append frames and SPUBLISH each, fenced: a stale epoch or generation gets FENCED
-- <epoch> and writes nothing; an offset that is not the expected one gets OFFSET <off>.
-- KEYS: meta hash, backlog stream, live channel.
-- ARGV: epoch, expected offset, maxlen, ttl_s, terminal (1: the last frame ends the turn),
-- turn, gen, max bytes of the backlog (0: no byte bound), the producer's clock (ms), then
-- the encoded frames.
-- Loaded after backlog.lua. Returns the last offset written.
-- Per call, besides an XADD and an SPUBLISH per frame: one HMGET and one HSET; the two
-- EXPIREs only after a terminal frame (the turn's end: the keys live a full TTL from it)
-- or when the TTL has run down by more than the slack (min(60 s, ttl_s / 16)) since
-- this script last set it: once a minute per streaming session, not once a second (at a
-- few tokens a second per session that was every other frame: bench.peers.pathcost's
-- commandstats). When it last set it is the hash's `exp`, on the producer's clock, read
-- with the other fields (no PTTL per call: a command the master ran for every call).
-- A clock behind `exp` (another producer's, or one stepped back) sets the TTLs again at
-- once, so a skew between producers shortens no key's life by more than the skew, and
-- the TTL left is never below ttl_s minus the slack minus that skew. Every script sets
-- the two keys' TTLs together, so `exp` stands for both, except where a key is new: the
-- stream's first XADD (a hash with no `exp`: a new session, or a hash this script
-- restores, refreshed at once).
local cur = redis.call('HMGET', KEYS[1], 'epoch', 'offset', 'gen', 'bytes', 'ttl', 'exp')
local now = tonumber(ARGV[9])
if now == nil then return redis.error_reply('ERR publish: ARGV[9] must be the clock in ms') end
local epoch = tonumber(cur[1] or '0')
local off = tonumber(cur[2] or '0')
if epoch > tonumber(ARGV[1]) then return redis.error_reply('FENCED ' .. epoch) end
if cur[3] and cur[3] ~= ARGV[7] then return redis.error_reply('FENCED ' .. epoch) end
if off ~= tonumber(ARGV[2]) then return redis.error_reply('OFFSET ' .. off) end
local refresh = false
if epoch < tonumber(ARGV[1]) then
  -- a failover lost our open_generation (asynchronous replication): restore it
  refresh = true
  redis.call('HSET', KEYS[1], 'epoch', ARGV[1], 'open', ARGV[6], 'gen', ARGV[7])
  local turn = tonumber(redis.call('HGET', KEYS[1], 'turn') or '0')
  if turn < tonumber(ARGV[6]) then redis.call('HSET', KEYS[1], 'turn', ARGV[6]) end
end
local total = tonumber(cur[4] or '')
if total == nil then total = backlog_total(KEYS[1], KEYS[2]) end
for i = 10, #ARGV do
  off = off + 1
  total = backlog_add(KEYS[2], ARGV[3], string.format('%d-1', off), ARGV[i], total)
  redis.call('SPUBLISH', KEYS[3], ARGV[i])
end
backlog_cut(KEYS[2], total, tonumber(ARGV[8]))
local ttl_ms = tonumber(ARGV[4]) * 1000
local exp = tonumber(cur[6] or '')
local expire = refresh or ARGV[5] == '1' or exp == nil or now < exp
  or now - exp > math.min(60000, math.floor(ttl_ms / 16))
if not cur[5] then  -- a failover lost the OPEN: the session's lifetime, for relays to extend it by
  if expire then
    redis.call('HSET', KEYS[1], 'offset', off, 'bytes', total, 'ttl', ARGV[4], 'exp', ARGV[9])
  else
    redis.call('HSET', KEYS[1], 'offset', off, 'bytes', total, 'ttl', ARGV[4])
  end
elseif expire then
  redis.call('HSET', KEYS[1], 'offset', off, 'bytes', total, 'exp', ARGV[9])
else
  redis.call('HSET', KEYS[1], 'offset', off, 'bytes', total)
end
if ARGV[5] == '1' then redis.call('HDEL', KEYS[1], 'open') end
if expire then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return off
