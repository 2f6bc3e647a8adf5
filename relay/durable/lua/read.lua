-- A read of a Durable Stream: its metadata and up to ARGV[2] messages from ARGV[1]
-- (a message index; "" for the tail), in one step, so the closure seen goes with them.
-- A sliding TTL is reset (ARGV[3] = "1": not for HEAD). ARGV[4], when > 0, bounds the
-- messages' bytes (one message at least): the log is read in growing pages, so a read
-- of large messages copies about the budget, not ARGV[2] messages, into the script.
-- KEYS[1] meta  KEYS[2] log  KEYS[3] producers
-- Returns {} when there is no stream (or a fork's create is still copying into it), {"gone"} when it is soft-deleted (forks hold it), else {mt, ct, ttl, ea, closed, n, gen, low, from, msgs...}
local meta, log = KEYS[1], KEYS[2]
local s = redis.call("HMGET", meta, "mt", "ct", "ttl", "ea", "closed", "n", "gen", "low", "del",
  "building")
if not s[1] or s[10] then return {} end -- none, or a fork's create still copying
if s[9] == "1" then return {"gone"} end
local n, low = tonumber(s[6]), tonumber(s[8] or "0")
if ARGV[3] == "1" and s[3] and s[3] ~= "" then
  for _, k in ipairs(KEYS) do redis.call("PEXPIRE", k, s[3] .. "000") end -- whole ms
end
local from = n
if ARGV[1] ~= "" then from = tonumber(ARGV[1]) end
local out = {s[1], s[2], s[3] or "", s[4] or "", s[5], n, s[7], low, from}
local count = tonumber(ARGV[2])
local budget = tonumber(ARGV[4] or "0")
if from >= low and from < n and count > 0 then
  local i, last = from - low, math.min(n, from + count) - low - 1
  local size, page = 0, 8
  while i <= last do
    local msgs = redis.call("LRANGE", log, i, math.min(i + page - 1, last))
    if #msgs == 0 then break end
    for _, m in ipairs(msgs) do
      if budget > 0 and #out > 9 and size + #m > budget then return out end
      out[#out + 1] = m
      size = size + #m
    end
    i = i + #msgs
    page = math.min(page * 2, 512)
  end
end
return out
