-- Delete a Durable Stream: its keys, and a wake-up for its live readers (who then find
-- no stream). KEYS[1] meta  KEYS[2] log  KEYS[3] producers  ARGV[1] live channel
-- Returns 1 when the stream existed, else 0.
local existed = redis.call("DEL", KEYS[1])
redis.call("DEL", KEYS[2], KEYS[3])
if existed == 1 then redis.call("SPUBLISH", ARGV[1], "deleted") end
return existed
