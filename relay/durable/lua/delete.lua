-- Delete a Durable Stream. KEYS[1] meta  KEYS[2] log  KEYS[3] producers  KEYS[4] forks
-- (the set of the paths of its forks)  ARGV[1] live channel
-- Returns {404} when there is none (or a fork's create is still copying into it), {410}
-- when it is already soft-deleted, {204, ""} when forks still hold it, else {204, source
-- path}: removed (the caller releases the source's reference, if a fork). Forks hold
-- copies, never this stream's data: a soft delete removes its messages and producers
-- too and keeps only the configuration (a tombstone: 410, its path blocked) until its
-- last fork goes.
local s = redis.call("HMGET", KEYS[1], "mt", "del", "fork", "building")
if not s[1] or s[4] then return {404} end
if s[2] == "1" then return {410} end
redis.call("SPUBLISH", ARGV[1], "deleted")
if redis.call("SCARD", KEYS[4]) > 0 then
  redis.call("DEL", KEYS[2], KEYS[3])
  redis.call("HSET", KEYS[1], "del", "1", "n", 0)
  return {204, ""}
end
redis.call("DEL", KEYS[1], KEYS[2], KEYS[3], KEYS[4])
local src = string.match(s[3] or "", "^([^\n]*)\n") or ""
return {204, src}
