-- One frame, as the relay's own scripts write it (docs/PROTOCOL.md, "Frame"): the JSON
-- that a producer's encoder writes, with its fields in the same order. ``meta`` is a Lua
-- table (cjson encodes it); ``ts`` is milliseconds as a string of digits. Scripts that
-- write a frame of their own (reap.lua, seal.lua) are loaded with this file in front.
local function frame(session, turn, offset, kind, text, epoch, ts, meta)
  return string.format(
    '{"v":1,"session":%s,"turn":%d,"offset":%d,"kind":%s,"text":%s,"epoch":%d,' ..
    '"ts":%s,"meta":%s}',
    cjson.encode(session), turn, offset, cjson.encode(kind), cjson.encode(text), epoch,
    ts, cjson.encode(meta))
end
