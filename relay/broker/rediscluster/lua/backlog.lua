-- A session's backlog, bounded in frames and in bytes (docs/PROTOCOL.md, "Publishing").
-- Each entry is `<offset>-1` with two fields: `f` the encoded frame and `b` where it
-- starts in the session's byte count (the bytes of every frame written before it);
-- the meta hash's `bytes` is where the next one starts. The backlog holds the bytes
-- from its first entry's `b` to `bytes`; past the budget, the oldest entries go
-- (XTRIM MINID), whole, the newest always stays. A reader that asks for a trimmed
-- offset gets the backlog's first offset back (and its client a `gap` frame), as for
-- a trim by MAXLEN. Scripts that append (publish.lua, reap.lua, seal.lua) are loaded
-- with this file in front: backlog_total once (publish.lua reads `bytes` with its other
-- fields instead), backlog_add per frame, backlog_trim once (publish.lua: backlog_cut,
-- and `bytes` in its one HSET).

-- Where the next entry starts: the hash's count, or, when a failover or an expiry lost
-- the hash and not the backlog, the end of the backlog's last entry.
local function backlog_total(meta, log)
  local total = redis.call('HGET', meta, 'bytes')
  if total then return tonumber(total) end
  local top = redis.call('XREVRANGE', log, '+', '-', 'COUNT', 1)
  if top[1] then
    local fields = top[1][2]
    return tonumber(fields[4] or '0') + #fields[2]
  end
  return 0
end

-- Append one frame (trimmed to about maxlen frames, as before); returns the new total.
local function backlog_add(log, maxlen, id, frame, total)
  redis.call('XADD', log, 'MAXLEN', '~', maxlen, id, 'f', frame, 'b', total)
  return total + #frame
end

-- Drop the oldest entries until the rest fit in maxbytes (0: no byte bound); the caller
-- stores the total in the hash's `bytes`. Reads the entries it drops, one page at a
-- time (1, 2, 4, ... 64).
local function backlog_cut(log, total, maxbytes)
  if maxbytes <= 0 or total <= maxbytes then return end
  local floor = total - maxbytes  -- an entry that starts before it does not fit
  local from, count, last = '-', 1, nil
  while true do
    local page = redis.call('XRANGE', log, from, '+', 'COUNT', count)
    if #page == 0 then break end
    for _, e in ipairs(page) do
      local start = tonumber(e[2][4] or '')
      if start == nil or start >= floor then  -- no `b` (written before the budget): keep
        if last then redis.call('XTRIM', log, 'MINID', e[1]) end
        return
      end
      last = e[1]
    end
    from = '(' .. last
    if count < 64 then count = count * 2 end
  end
  if last then redis.call('XTRIM', log, 'MINID', last) end  -- the newest stays
end

-- Store the total, then backlog_cut.
local function backlog_trim(meta, log, total, maxbytes)
  redis.call('HSET', meta, 'bytes', total)
  backlog_cut(log, total, maxbytes)
end
