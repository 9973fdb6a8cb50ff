-- Writes the seed corpus of decode_fuzz: real encodings of every kind of
-- value, each a file in fuzz/corpus/.  Run from the top of the tree with a
-- built core:  LUA_CPATH='build/?.so' lua5.4 fuzz/make_corpus.lua
local core = require "multiprocessing.core"

local function u32(n) return string.pack("<I4", n) end

-- a fuzz.Blob (the type decode_fuzz registers) that takes one descriptor;
-- Lua cannot make one, so its frame is written by hand (T_USERDATA = 13)
local blob = core.encode(false, 1):sub(1, 2) .. "\1"
  .. "\13" .. "\9fuzz.Blob" .. u32(5) .. u32(1) .. "\1\3abc"

local cycle = { name = "cycle" }
cycle.self = cycle
local shared = { 1, 2 }
local deep = {}
for _ = 1, 50 do deep = { deep } end

-- nested tables that each claim every byte left as an item: the shape
-- the decoder's one budget for the whole message stops (T_TABLE = 6)
local function amplifier(size, levels)
  local parts, pos = { "\xCD\1\1" }, 3
  for _ = 1, levels do
    local narr = size - pos - 4
    parts[#parts + 1] = "\6" .. string.char((narr & 0x7F) | 0x80,
      ((narr >> 7) & 0x7F) | 0x80, narr >> 14) .. u32(0)
    pos = pos + 8
  end
  parts[#parts + 1] = ("\0"):rep(size - pos)
  return table.concat(parts)
end

-- arrays the decoder reads on its fast path (decode_items): integers of
-- every width, floats, strings, holes and everything else mixed in
local ints, floats, strs, mixed = {}, {}, {}, { 1, nil, 2.5, "s", true, { 1 }, nil }
for i = 1, 200 do
  ints[i] = (i % 2 == 0 and -1 or 1) * (1 << (i % 63))
  floats[i] = i / 7
  strs[i] = ("s"):rep(i % 20)
end
floats[#floats + 1], floats[#floats + 2], floats[#floats + 3] = 0/0, -0.0, math.huge

local seeds = {
  ints = core.encode(false, ints),
  floats = core.encode(false, floats),
  strarray = core.encode(false, strs),
  mixedarray = core.encode(false, mixed, { 7, 8, 9, 3, reset = true, [5] = "chunk item" }),
  scalars = core.encode(false, nil, true, false, 0, -1, math.maxinteger,
                        math.mininteger, 1.5, -0.0, 0/0, math.huge),
  strings = core.encode(false, "", "hello", "\0\1\2\255"),
  array = core.encode(false, { 1, 2, 3, nil, 5 }),
  record = core.encode(false, { a = 1, b = { c = "d" }, ["a b"] = true }),
  keys = core.encode(false, { [1.5] = 1, [true] = 2, [{}] = 3, [-7] = 4 }),
  cycle = core.encode(false, cycle, { shared, shared }, shared),
  modfuncs = core.encode(false, string.format, print, { f = table.concat }),
  metatable = core.encode(false, setmetatable({ x = 1 }, string)),
  globals = core.encode(false, _G, { env = _G }),
  deep = core.encode(false, deep),
  bytecode = core.encode(true, function(x) return x + shared[1] end),
  blob = blob,
  amplify = amplifier(16 * 1024, 1000),
}

for name, bytes in pairs(seeds) do
  local f = assert(io.open("fuzz/corpus/" .. name, "wb"))
  f:write(bytes)
  f:close()
end
