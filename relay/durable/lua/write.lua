-- One write of a Durable Stream, atomic on its slot: create (PUT), append, close.
-- KEYS[1] meta (hash)  KEYS[2] log (list of messages)  KEYS[3] producers (hash)
-- ARGV: 1 op (put|post), 2 media type, 3 content type as given, 4 ttl s or "",
--   5 expires-at text or "", 6 expires-at ms or "", 7 close "1"/"0", 8 Stream-Seq or "",
--   9 producer id or "", 10 epoch, 11 seq, 12 new incarnation id, 13 live channel,
--   14 stream path, 15 has body "1"/"0", 16 fork identity ("source\noffset\nsub" or ""),
--   17 the most bytes the stream may hold ("0": no bound; relay.broker.streams.charge),
--   18.. messages
-- Returns {code, next, closed, a, b}: code is the HTTP status; a, b its extra figures
-- (producer epoch / seq, expected / received seq; 413: the bytes held, the bound).
local meta, log, prods = KEYS[1], KEYS[2], KEYS[3]
local op, mt, ct, ttl, ea, eams = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local close, sseq, pid, epoch, pseq = ARGV[7] == "1", ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local gen, channel, path, hasbody = ARGV[12], ARGV[13], ARGV[14], ARGV[15] == "1"
local fork = ARGV[16]
local FIRST = 18  -- the first message's ARGV
local nmsg = #ARGV - FIRST + 1
-- the byte bound: what a message is charged (its bytes + the store's overhead per message)
local cap, size = tonumber(ARGV[17]), 0
for i = FIRST, #ARGV do size = size + #ARGV[i] + 16 end

local function expire()
  local t = redis.call("HGET", meta, "ttl")
  local at = redis.call("HGET", meta, "eams")
  for _, k in ipairs({meta, log, prods}) do
    if t and t ~= "" then
      redis.call("PEXPIRE", k, tonumber(t) * 1000)
    elseif at and at ~= "" then
      redis.call("PEXPIREAT", k, at)
    end
  end
end

local function append(n)
  if nmsg > 0 then
    redis.call("RPUSH", log, unpack(ARGV, FIRST))
    n = n + nmsg
    redis.call("HSET", meta, "n", n)
    redis.call("HINCRBY", meta, "bytes", size)
  end
  return n
end

local exists = redis.call("EXISTS", meta) == 1
if op == "put" then
  if exists then
    local s = redis.call("HMGET", meta, "mt", "ttl", "ea", "closed", "n", "del", "fork")
    local same = s[1] == mt and (s[2] or "") == ttl and (s[3] or "") == ea
      and ((s[4] == "1") == close) and s[6] ~= "1" and (s[7] or "") == fork
    return {same and 200 or 409, tonumber(s[5]), s[4] == "1" and 1 or 0, 0, 0}
  end
  if cap > 0 and size > cap then return {413, 0, 0, 0, cap} end
  redis.call("HSET", meta, "mt", mt, "ct", ct, "ttl", ttl, "ea", ea, "eams", eams,
    "closed", close and "1" or "0", "n", 0, "gen", gen, "path", path, "sseq", "",
    "fork", fork)
  local n = append(0)
  expire()
  if nmsg > 0 or close then redis.call("SPUBLISH", channel, n) end
  return {201, n, close and 1 or 0, 0, 0}
end

if not exists then return {404, 0, 0, 0, 0} end
local s = redis.call("HMGET", meta, "mt", "closed", "n", "sseq", "closer", "del")
if s[6] == "1" then return {410, 0, 0, 0, 0} end
local n, closed = tonumber(s[3]), s[2] == "1"
local tuple = pid ~= "" and (pid .. "\n" .. epoch .. "\n" .. pseq) or ""
if closed then
  if tuple ~= "" and s[5] == tuple then return {204, n, 1, tonumber(epoch), tonumber(pseq)} end
  if close and not hasbody then return {204, n, 1, 0, 0} end
  return {409, n, 1, 0, 0}
end
if hasbody and s[1] ~= mt then return {409, n, 0, 0, 0} end

local accepted = false
if pid ~= "" then
  local e, q = tonumber(epoch), tonumber(pseq)
  local st = redis.call("HGET", prods, pid)
  if st then
    local se, sq = string.match(st, "^(%d+):(-?%d+)$")
    se, sq = tonumber(se), tonumber(sq)
    if e < se then return {403, n, 0, se, 0} end
    if e > se then
      if q ~= 0 then return {400, n, 0, 0, 0} end
    elseif q <= sq then
      return {204, n, 0, e, sq}
    elseif q ~= sq + 1 then
      return {409, n, 0, sq + 1, q}
    end
  elseif q ~= 0 then
    return {409, n, 0, 0, q}
  end
  accepted = true
end
local held = tonumber(redis.call("HGET", meta, "bytes") or "0")
if cap > 0 and nmsg > 0 and held + size > cap then return {413, n, 0, held, cap} end
if sseq ~= "" then
  if s[4] ~= "" and sseq <= s[4] then return {409, n, 0, 0, 0} end
  redis.call("HSET", meta, "sseq", sseq)
end
if accepted then redis.call("HSET", prods, pid, epoch .. ":" .. pseq) end
n = append(n)
if close then
  redis.call("HSET", meta, "closed", "1")
  if tuple ~= "" then redis.call("HSET", meta, "closer", tuple) end
end
expire()
redis.call("SPUBLISH", channel, n)
if accepted then return {200, n, close and 1 or 0, tonumber(epoch), tonumber(pseq)} end
return {204, n, close and 1 or 0, 0, 0}
