-- A stopped turn ended: its stop record's field becomes the turn's terminal offset, so
-- that a later stop of it answers the same. KEYS: stop record (hash). ARGV: turn,
-- terminal offset, TTL (s).
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1
