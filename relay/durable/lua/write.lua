-- One write of a Durable Stream, atomic on its slot: create (PUT), append, close, and the
-- steps of a large fork's create (build: its copied messages in bounded calls).
-- KEYS[1] meta (hash)  KEYS[2] log (list of messages)  KEYS[3] producers (hash)
-- ARGV: 1 op (put|post|build), 2 media type, 3 content type as given, 4 ttl s or "",
--   5 expires-at text or "", 6 expires-at ms or "", 7 close "1"/"0", 8 Stream-Seq or "",
--   9 producer id or "", 10 epoch, 11 seq, 12 new incarnation id, 13 live channel,
--   14 stream path, 15 has body "1"/"0", 16 fork identity ("source\noffset\nsub" or ""),
--   17 build id ("" but for a built create: its build steps' and its commit's),
--   18 the most bytes the stream may hold ("0": no bound; relay.broker.streams.charge),
--   19 the messages, each "<length>:<bytes>" one after the other (one argument: the relay
--   packs a write of 10,000 messages as one string, not 10,000 arguments)
-- Returns {code, next, closed, a, b}: code is the HTTP status (202: a build step taken,
-- 412: a commit whose build is not there); a, b its extra figures (producer epoch / seq,
-- expected / received seq; 413: the bytes held, the bound).
-- Nothing is written before every check has passed, and no command after the first write
-- can fail on the request's values (the TTL is passed to PEXPIRE as whole milliseconds,
-- "<seconds>000", never as a float): a refused or failed write leaves nothing behind.
local meta, log, prods = KEYS[1], KEYS[2], KEYS[3]
local op, mt, ct, ttl, ea, eams = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local close, sseq, pid, epoch, pseq = ARGV[7] == "1", ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local gen, channel, path, hasbody = ARGV[12], ARGV[13], ARGV[14], ARGV[15] == "1"
local fork, build, cap, packed = ARGV[16], ARGV[17], tonumber(ARGV[18]), ARGV[19]
local BUILD_MS = 10000 -- a build's keys live this long past its last step

-- the byte bound: what the messages are charged (their bytes + the store's overhead of 16
-- per message), read from the packed lengths before anything is written
local nmsg, size = 0, 0
do
  local pos = 1
  while pos <= #packed do
    local colon = string.find(packed, ":", pos, true)
    local len = tonumber(string.sub(packed, pos, colon - 1))
    nmsg, size = nmsg + 1, size + len + 16
    pos = colon + len + 1
  end
end
local function over(held) return cap > 0 and nmsg > 0 and held + size > cap end

local function expire(persist)
  local t = redis.call("HGET", meta, "ttl")
  local at = redis.call("HGET", meta, "eams")
  for _, k in ipairs({meta, log, prods}) do
    if t and t ~= "" then
      redis.call("PEXPIRE", k, t .. "000")
    elseif at and at ~= "" then
      redis.call("PEXPIREAT", k, at)
    elseif persist then
      redis.call("PERSIST", k)
    end
  end
end

local function append(n)
  -- in steps of 1,000: unpack() of more than about 8,000 values overflows Lua's C stack
  local pos, batch, added = 1, {}, 0
  while pos <= #packed do
    local colon = string.find(packed, ":", pos, true)
    local len = tonumber(string.sub(packed, pos, colon - 1))
    batch[#batch + 1] = string.sub(packed, colon + 1, colon + len)
    pos = colon + len + 1
    if #batch == 1000 or pos > #packed then
      redis.call("RPUSH", log, unpack(batch))
      added = added + #batch
      batch = {}
    end
  end
  if added > 0 then
    n = n + added
    redis.call("HSET", meta, "n", n)
    redis.call("HINCRBY", meta, "bytes", size)
  end
  return n
end

local exists = redis.call("EXISTS", meta) == 1
local building = exists and redis.call("HGET", meta, "building") or false

if op == "build" then
  if exists and building ~= build then return {409, 0, 0, 0, 0} end
  local n, held = 0, 0
  if exists then
    local b = redis.call("HMGET", meta, "n", "bytes")
    n, held = tonumber(b[1]), tonumber(b[2] or "0")
  end
  if over(held) then return {413, n, 0, held, cap} end
  if not exists then
    redis.call("HSET", meta, "building", build, "mt", mt, "n", 0, "path", path)
  end
  n = append(n)
  for _, k in ipairs({meta, log, prods}) do redis.call("PEXPIRE", k, BUILD_MS) end
  return {202, n, 0, 0, 0}
end

if op == "put" then
  if build ~= "" and building ~= build then return {412, 0, 0, 0, 0} end
  if exists and build == "" then
    local s = redis.call("HMGET", meta, "mt", "ttl", "ea", "closed", "n", "del", "fork")
    local same = s[1] == mt and (s[2] or "") == ttl and (s[3] or "") == ea
      and ((s[4] == "1") == close) and s[6] ~= "1" and (s[7] or "") == fork and not building
    return {same and 200 or 409, tonumber(s[5]) or 0, s[4] == "1" and 1 or 0, 0, 0}
  end
  local n, held = 0, 0
  if building then
    local b = redis.call("HMGET", meta, "n", "bytes")
    n, held = tonumber(b[1]), tonumber(b[2] or "0")
  end
  if over(held) then return {413, 0, 0, held, cap} end
  redis.call("HSET", meta, "mt", mt, "ct", ct, "ttl", ttl, "ea", ea, "eams", eams,
    "closed", close and "1" or "0", "n", n, "gen", gen, "path", path, "sseq", "",
    "fork", fork)
  if building then redis.call("HDEL", meta, "building") end
  n = append(n)
  expire(building)
  if n > 0 or close then redis.call("SPUBLISH", channel, n) end
  return {201, n, close and 1 or 0, 0, 0}
end

if not exists or building then return {404, 0, 0, 0, 0} end
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
if over(held) then return {413, n, 0, held, cap} end
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
expire(false)
redis.call("SPUBLISH", channel, n)
if accepted then return {200, n, close and 1 or 0, tonumber(epoch), tonumber(pseq)} end
return {204, n, close and 1 or 0, 0, 0}
