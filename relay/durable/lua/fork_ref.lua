-- Take (ARGV[1] "+") or release (ARGV[1] "-") a fork's reference on its source.
-- KEYS[1] source meta  KEYS[2] log  KEYS[3] producers  KEYS[4] forks  ARGV[2] fork path
-- "+": 1 when taken, 0 when the source is gone or soft-deleted. "-": the source's own
-- source path when this release removed a soft-deleted source (the cascade goes on), else "".
local s = redis.call("HMGET", KEYS[1], "mt", "del", "fork", "building")
if ARGV[1] == "+" then
  if not s[1] or s[2] == "1" or s[4] then return 0 end
  redis.call("SADD", KEYS[4], ARGV[2])
  local ttl = redis.call("PTTL", KEYS[1])
  if ttl > 0 then redis.call("PEXPIRE", KEYS[4], ttl) end
  return 1
end
redis.call("SREM", KEYS[4], ARGV[2])
if s[2] == "1" and redis.call("SCARD", KEYS[4]) == 0 then
  redis.call("DEL", KEYS[1], KEYS[2], KEYS[3], KEYS[4])
  return string.match(s[3] or "", "^([^\n]*)\n") or ""
end
return ""
