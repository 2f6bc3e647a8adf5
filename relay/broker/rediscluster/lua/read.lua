-- One consistent backlog read: the first offset held, the last written, the session's
-- generation, then up to ARGV[2] frames from entry id ARGV[1] (at most ARGV[3] bytes
-- past the first; 0: no byte bound). KEYS: backlog stream, meta hash, the session's
-- tombstone. A deleted session (its tombstone exists) answers the error GONE instead.
if redis.call('EXISTS', KEYS[3]) == 1 then return redis.error_reply('GONE') end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)
local last = tonumber(redis.call('HGET', KEYS[2], 'offset') or '0')
local firstoff = last + 1
if first[1] then firstoff = tonumber(string.match(first[1][1], '^(%d+)')) end
local out = {firstoff, last, redis.call('HGET', KEYS[2], 'gen') or ''}
if tonumber(ARGV[2]) > 0 then
  local entries = redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])
  local budget = tonumber(ARGV[3] or '0')
  local size = 0
  for _, e in ipairs(entries) do
    if budget > 0 and size > 0 and size + #e[2][2] > budget then break end
    size = size + #e[2][2]
    out[#out + 1] = e[2][2]
  end
end
return out
