-- Writes a failover lost (docs/PROTOCOL.md, "Publishing": writes lost in a failover).
-- A frame is SPUBLISHed in the script that appends it, before any replica has it: a
-- failover can promote a replica without a session's last frames, which screens already
-- hold. The writer that is still alive writes them again at their offsets; one that is
-- gone cannot, and the session's next writer would put other frames at those offsets.
-- So every script that takes a session over from a writer (open.lua, reap.lua) stamps
-- the hash's `rid` with the replication history of the node it runs on (INFO's
-- `master_replid`: a promoted replica starts a new one, a node that syncs from another
-- takes that one's). A stamp of another history means the session's last writes were
-- made on another node, and any number of them may be gone: the taker skips LOST_SKIP
-- offsets with one `gap` frame over them (`code` `lost_in_failover`), so a screen that
-- holds lost frames gets a gap, never other frames at offsets it holds. The bound: no
-- writer publishes LOST_SKIP frames to one session in the time a promotable replica can
-- lag its master. Epochs skip as far, so that no writer of the lost history shares its
-- epoch with a later one. Loaded after frame.lua and backlog.lua.

local LOST_SKIP = 1048576

-- The replication history of this node's dataset.
local function history()
  return string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)') or ''
end

-- Stamp the session with this node's history; when its stamp is another one, write the
-- gap frame over the offsets the lost writes may have used, after `off`. Returns the
-- offset after the skip (the gap frame's) and the epoch to use (`epoch`, or past the
-- skip).
local function skip_lost(meta, log, live, session, ts, maxlen, max_bytes, off, epoch, gen)
  local here = history()
  local stamp = redis.call('HGET', meta, 'rid')
  redis.call('HSET', meta, 'rid', here)
  if not stamp or stamp == here then return off, epoch end
  local to = off + LOST_SKIP
  local m = {from = off + 1, to = to, code = 'lost_in_failover', history = stamp}
  if gen then m.gen = gen end
  local f = frame(session, 0, to, 'gap', 'frames lost in a Redis failover', 0, ts, m)
  local total = backlog_total(meta, log)
  total = backlog_add(log, maxlen, string.format('%d-1', to), f, total)
  backlog_trim(meta, log, total, tonumber(max_bytes or '0'))
  redis.call('SPUBLISH', live, f)
  epoch = redis.call('HINCRBY', meta, 'epoch', LOST_SKIP)
  redis.call('HSET', meta, 'offset', to)
  return to, epoch
end
