-- bench/lua_codec.lua REPS
-- The codec (src/codec.c) alone: core.encode then core.decode of
--   ints     an array of 10^6 integers 1..10^6
--   floats   an array of 10^6 floats (i + 0.5)
--   strings  an array of 10^5 short strings ("item" .. i)
--   nested   10^4 records {id = i, name = "name" .. i, score = i * 0.5,
--            tags = {"a", "b"}} in an array
-- each the same data as bench/py_codec.py pickles.  JSON lines, one sample
-- per repetition, in ns per element (per record for nested):
--   lua_codec/<kind>     encode + decode (fields enc, dec: each alone)
--   floor_memcpy/<kind>  one memcpy of the encoding's bytes
-- and "bytes": the encoding's size.
local B = dofile("bench/lib.lua")
local reps = tonumber(arg[1]) or 5
local WARM = 2   -- untimed rounds first, as py_codec.py runs them
local ok, core = pcall(require, "multiprocessing.core")
local bc = require "benchclock"

local function data(kind)
  local t = {}
  if kind == "ints" then for i = 1, 1000000 do t[i] = i end
  elseif kind == "floats" then for i = 1, 1000000 do t[i] = i + 0.5 end
  elseif kind == "strings" then for i = 1, 100000 do t[i] = "item" .. i end
  else
    for i = 1, 10000 do
      t[i] = { id = i, name = "name" .. i, score = i * 0.5, tags = { "a", "b" } }
    end
  end
  return t
end

for _, kind in ipairs { "ints", "floats", "strings", "nested" } do
  if not ok then
    B.skip("lua_codec", core, { method = kind })
  else
    local v = data(kind)
    local n = #v
    local s, enc, dec, copy = nil, {}, {}, {}
    local total = {}
    -- the first WARM rounds are not kept: the heap grows, and the
    -- allocator's thresholds settle, over two rounds of this loop
    for r = 1 - WARM, reps do
      collectgarbage()
      local t0 = B.now()
      s = core.encode(false, v)
      local t1 = B.now()
      local back = core.decode(s)
      local t2 = B.now()
      assert(#back == n)
      if r >= 1 then
        enc[r], dec[r], total[r] = (t1 - t0) / n * 1e9, (t2 - t1) / n * 1e9, (t2 - t0) / n * 1e9
        copy[r] = bc.memcpy(s) / n * 1e9
      end
    end
    B.emit { bench = "lua_codec", method = kind, samples = total, enc = enc, dec = dec, bytes = #s }
    B.emit { bench = "floor_memcpy", method = kind, samples = copy, bytes = #s }
  end
end
