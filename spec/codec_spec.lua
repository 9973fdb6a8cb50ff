-- The value codec: core.encode(opts, ...) -> bytes, core.decode(bytes, functions).
local core = require "multiprocessing.core"

local encode, decode = core.encode, core.decode

local function rt(...) return decode(encode(false, ...)) end
local function frt(...) return decode(encode(true, ...), true) end

-- Builders of raw messages; the tags mirror the enum in src/codec.c.
local T = { NIL = 0, FALSE = 1, TRUE = 2, INT = 3, FLOAT = 4, STRING = 5,
            TABLE = 6, TABLEMT = 7, REF = 8, GLOBALS = 9, MODULE = 10,
            MODFIELD = 11, FUNCTION = 12, USERDATA = 13, UPJOIN = 14,
            KEYREF = 16 }
local HEADER = "\xCD\1"

local function varint(n)  -- n >= 0, or a float up to 2^64 for huge counts
  local out = {}
  while n >= 0x80 do
    out[#out + 1] = string.char(math.tointeger(n % 0x80) | 0x80)
    n = n // 0x80
  end
  out[#out + 1] = string.char(math.tointeger(n))
  return table.concat(out)
end

local function msg(...)  -- a message of the given encoded values
  return HEADER .. varint(select("#", ...)) .. table.concat({ ... })
end

local function tag(t) return string.char(t) end
local function str(s) return tag(T.STRING) .. varint(#s) .. s end
local function tbl(narr, nhash) return tag(T.TABLE) .. varint(narr) .. string.pack("<I4", nhash) end

local function bits(x) return string.pack("<d", x) end

local function decode_error(s, functions)
  local ok, err = pcall(decode, s, functions)
  assert.is_false(ok, "decoded bad input")
  assert.is_string(err)
  return err
end

local function encode_error(...)
  local ok, err = pcall(encode, ...)
  assert.is_false(ok, "encoded an unsendable value")
  return err
end

local TO = 'to a spawned process: pass it differently or use start_method "fork"'
local function send_error(names, ...)
  return encode_error({ functions = true, names = names, to = TO }, ...)
end

describe("codec", function()
  describe("round trips", function()
    it("keeps nil, booleans and the number of values, trailing nils included", function()
      assert.are.equal(4, select("#", rt(nil, true, false, nil)))
      local a, b, c, d = rt(nil, true, false, nil)
      assert.is_nil(a); assert.is_true(b); assert.is_false(c); assert.is_nil(d)
      assert.are.equal(0, select("#", rt()))
    end)

    it("keeps integers and floats apart", function()
      local values = { 0, 1, -1, 63, 64, -64, -65, 127, 128, 300, 2^53, 1.0, -0.5,
                       math.maxinteger, math.mininteger, math.maxinteger - 1,
                       (1 << 53) + 1, 3.14159, 1e308, 5e-324, math.huge, -math.huge }
      local back = { rt(table.unpack(values)) }
      for i, v in ipairs(values) do
        assert.are.equal(math.type(v), math.type(back[i]), "value " .. i)
        assert.are.equal(bits(v), bits(back[i]), "value " .. i)
        if math.type(v) == "integer" then assert.are.equal(v, back[i]) end
      end
    end)

    it("keeps NaN, its payload and sign, and -0.0 bit for bit", function()
      local nan_payload = string.unpack("<d", "\1\2\3\0\0\0\xf8\x7f")
      local neg_nan = string.unpack("<d", "\0\0\0\0\0\0\xf8\xff")
      for _, x in ipairs({ 0/0, -(0/0), nan_payload, neg_nan, -0.0, 0.0 }) do
        local y = rt(x)
        assert.are.equal("float", math.type(y))
        assert.are.equal(bits(x), bits(y))
      end
      assert.are.equal("-0.0", tostring(rt(-0.0)))
    end)

    it("keeps binary strings", function()
      local all = {}
      for i = 0, 255 do all[#all + 1] = string.char(i) end
      all = table.concat(all)
      for _, s in ipairs({ "", "a", "\0", all, all:rep(100), ("x"):rep(127), ("y"):rep(128) }) do
        assert.are.equal(s, rt(s))
      end
    end)

    it("moves a 64 MiB string quickly", function()
      local big = ("0123456789abcdef"):rep(4 << 20)
      local t0 = os.clock()
      local s = encode(false, big)
      local back = decode(s)
      local elapsed = os.clock() - t0
      assert.are.equal(#big + 2 + 1 + 1 + 4, #s)  -- header, count, tag, varint
      assert.is_true(back == big)
      assert.is_true(elapsed < 3, ("took %.2f s"):format(elapsed))
    end)

    it("keeps nested tables, holes, and keys of every type", function()
      local key = {}
      local t = { 1, "two", nil, 4.0, [10] = "ten", x = { y = { z = true } },
                  [1.5] = "float", [true] = false, [key] = "table key",
                  [-3] = "negative", [math.maxinteger] = "max" }
      local b = rt(t)
      assert.are.equal(1, b[1]); assert.are.equal("two", b[2]); assert.is_nil(b[3])
      assert.are.equal("float", math.type(b[4]))
      assert.are.equal("ten", b[10]); assert.is_true(b.x.y.z)
      assert.are.equal("float", b[1.5]); assert.is_false(b[true])
      assert.are.equal("negative", b[-3]); assert.are.equal("max", b[math.maxinteger])
      local n = 0
      for k, v in pairs(b) do
        n = n + 1
        if type(k) == "table" then assert.are.equal("table key", v); assert.are_not.equal(key, k) end
      end
      assert.are.equal(10, n)
    end)

    it("keeps cycles and shared references, across the values of one message", function()
      local t = { name = "t" }
      t.self = t
      local shared = { 1 }
      t.a, t.b = shared, shared
      local child = { parent = t }
      t.child = child
      local b, s2, c2 = rt(t, shared, child)
      assert.are.equal(b, b.self)
      assert.are.equal(b.a, b.b)
      assert.are.equal(b.a, s2)
      assert.are.equal(b.child, c2)
      assert.are.equal(b, c2.parent)
      assert.are_not.equal(t, b)
      -- separate messages do not share
      assert.are_not.equal(rt(shared), rt(shared))
    end)

    it("keeps shared references in keys", function()
      local k = {}
      local b = rt({ [k] = k })
      local key, value = next(b)
      assert.are.equal(key, value)
    end)

    it("sends the globals table as the receiver's globals", function()
      local g, t = rt(_G, { env = _G })
      assert.are.equal(_G, g)
      assert.are.equal(_G, t.env)
    end)

    it("accepts 1000 levels and refuses more, both ways, without a C stack overflow", function()
      local ok_depth = {}
      for _ = 2, 1000 do ok_depth = { ok_depth } end
      assert.is_table(rt(ok_depth))

      local deep = {}
      for _ = 1, 1e6 do deep = { deep } end
      local err = encode_error(false, deep)
      assert.matches("nesting too deep", err, 1, true)

      local crafted = msg(tbl(1, 0):rep(1e6))
      assert.matches("nesting too deep", decode_error(crafted), 1, true)
    end)
  end)

  describe("arrays (the fast paths of the encoder and decoder)", function()
    local int, float = function(i)
      local u = i >= 0 and 2 * i or -2 * i - 1
      return tag(T.INT) .. varint(u)
    end, function(x) return tag(T.FLOAT) .. bits(x) end

    local function same_bits(a, b, what)
      assert.are.equal(#a, #b, what)
      for i = 1, #a do
        assert.are.equal(math.type(a[i]) or type(a[i]), math.type(b[i]) or type(b[i]), what .. " " .. i)
        if type(a[i]) == "number" then
          assert.are.equal(bits(a[i]), bits(b[i]), what .. " " .. i)
        else
          assert.are.equal(a[i], b[i], what .. " " .. i)
        end
      end
    end

    it("keeps arrays of integers: every width, the extremes, int/float apart", function()
      local t = {}
      for i = -300, 300 do t[#t + 1] = i end
      for sh = 7, 62, 5 do t[#t + 1] = 1 << sh; t[#t + 1] = -(1 << sh); t[#t + 1] = (1 << sh) - 1 end
      t[#t + 1] = math.maxinteger; t[#t + 1] = math.mininteger
      t[#t + 1] = 1.0; t[#t + 1] = 2^53; t[#t + 1] = -0.0
      same_bits(t, rt(t), "ints")
      assert.are.equal("float", math.type(rt({ 1, 2.0, 3 })[2]))
      assert.are.equal("integer", math.type(rt({ 1.5, 2, 3.5 })[2]))
    end)

    it("keeps arrays of floats bit for bit: NaN payloads and signs, -0.0, infinities, subnormals", function()
      local t = { 0/0, -(0/0), string.unpack("<d", "\1\2\3\0\0\0\xf8\x7f"), -0.0, 0.0, math.huge, -math.huge,
                  5e-324, -5e-324, 1e308, 0.1, 1 / 3 }
      for i = 1, 1000 do t[#t + 1] = i / 7 end
      same_bits(t, rt(t), "floats")
      local back = rt(t)
      assert.are.equal("-0.0", tostring(back[4]))
      assert.is_true(back[1] ~= back[1])
    end)

    it("keeps arrays of short and long strings, binary and empty ones", function()
      local t = { "", "a", "\0", ("x"):rep(127), ("y"):rep(128), ("z"):rep(70000), "\255\254" }
      for i = 1, 1000 do t[#t + 1] = "item" .. i end
      same_bits(t, rt(t), "strings")
    end)

    it("keeps mixed arrays, nested tables and holes anywhere", function()
      local inner = { 1, "two" }
      local t = { 1, 2.5, "s", true, false, inner, inner, nil, 9, { x = 1 }, nil, nil, 13 }
      local b = rt(t)
      assert.are.equal(1, b[1]); assert.are.equal(2.5, b[2]); assert.are.equal("s", b[3])
      assert.is_true(b[4]); assert.is_false(b[5])
      assert.are.equal(b[6], b[7]); assert.are.equal("two", b[6][2])
      assert.is_nil(b[8]); assert.are.equal(9, b[9]); assert.are.equal(1, b[10].x)
      assert.is_nil(b[11]); assert.is_nil(b[12]); assert.are.equal(13, b[13])
      local n = 0
      for _ in pairs(b) do n = n + 1 end
      assert.are.equal(10, n)
    end)

    it("writes the same bytes as ever: array items, then the other entries", function()
      assert.are.equal(msg(tbl(3, 0) .. int(1) .. int(-2) .. int(300)), encode(false, { 1, -2, 300 }))
      assert.are.equal(msg(tbl(2, 0) .. float(0.5) .. str("ab")), encode(false, { 0.5, "ab" }))
      assert.are.equal(msg(tbl(3, 0) .. int(1) .. tag(T.NIL) .. int(3)), encode(false, { 1, nil, 3 }))
      assert.are.equal(msg(tbl(1, 1) .. int(7) .. str("k") .. tag(T.TRUE)), encode(false, { 7, k = true }))
    end)

    it("sends a short string key once a message, then its number", function()
      -- the second record's "k" is the first key numbered: T_KEYREF 1
      assert.are.equal(msg(tbl(2, 0) .. tbl(0, 1) .. str("k") .. int(1) .. tbl(0, 1) .. tag(T.KEYREF) .. varint(1) .. int(2)),
                       encode(false, { { k = 1 }, { k = 2 } }))
      -- across the values of a message too; a value that is the same string stays a string
      assert.are.equal(msg(tbl(0, 1) .. str("k") .. str("k"), tbl(0, 1) .. tag(T.KEYREF) .. varint(1) .. str("k")),
                       encode(false, { k = "k" }, { k = "k" }))
      -- a key longer than 40 bytes is sent whole each time, and takes no number
      local long = ("x"):rep(41)
      assert.are.equal(msg(tbl(2, 0) .. tbl(0, 1) .. str(long) .. int(1) .. tbl(0, 1) .. str(long) .. int(2)),
                       encode(false, { { [long] = 1 }, { [long] = 2 } }))
    end)

    it("keeps records of many shared and unshared keys", function()
      local records, long = {}, ("y"):rep(60)
      for i = 1, 3000 do
        records[i] = { id = i, name = "name" .. i, ["k" .. i % 7] = i % 7, [long] = i,
                       [i] = "own", tags = { "a", "b", a = true }, [("z"):rep(40)] = -i }
      end
      local back = rt(records)
      assert.are.same(records, back)
      -- the names of the fields cross about once: the list is much smaller
      -- than its records sent one by one
      local apart = 0
      for i = 1, #records do apart = apart + #encode(false, records[i]) end
      assert.is_true(#encode(false, records) < 0.75 * apart)
    end)

    it("decodes the costliest honest messages within the budget", function()
      -- every two-byte key new: a node, a string and a key number each
      local keys = {}
      for i = 0, 65535 do keys[string.char(i // 256, i % 256)] = i end
      local back = rt(keys)
      assert.are.equal(12345, back[string.char(12345 // 256, 12345 % 256)])
      local n = 0
      for _ in pairs(back) do n = n + 1 end
      assert.are.equal(65536, n)
      -- every one-byte key new, and empty tables in an array
      local bytes, empties = {}, {}
      for i = 0, 255 do bytes[string.char(i)] = true end
      for i = 1, 100000 do empties[i] = {} end
      assert.are.same(bytes, rt(bytes))
      assert.are.equal(100000, #rt(empties))
    end)

    it("numbers only the short string keys, in the order they come", function()
      local long = ("q"):rep(41)
      -- keys: a long one (no number), "x" (1), 7 (none; its value "z" is no
      -- key), "y" (2); then the numbers 2 and 1
      local s = msg(tbl(0, 4) .. str(long) .. int(1) .. str("x") .. int(2) .. int(7) .. str("z") .. str("y") .. int(5),
                    tbl(0, 2) .. tag(T.KEYREF) .. varint(2) .. int(3) .. tag(T.KEYREF) .. varint(1) .. int(4))
      local a, b = decode(s)
      assert.are.same({ [long] = 1, x = 2, [7] = "z", y = 5 }, a)
      assert.are.same({ y = 3, x = 4 }, b)
    end)

    it("keeps every entry whatever part of the table holds the items", function()
      -- items in the hash part: built backwards, after string keys, or
      -- with the integer 1 arriving after the hash part filled up
      local back = {}
      for i = 50, 1, -1 do back[i] = i * 10 end
      local late = { a = 1, b = 2, c = 3 }
      late[1] = "one"
      local mixed = { x = "x", y = "y" }
      for i = 1, 40 do mixed[i] = i end
      mixed["3"] = "string three"; mixed[3.5] = "float"; mixed[-1] = "neg"; mixed[100] = "far"
      local holes = {}
      for i = 1, 64 do holes[i] = i end
      for i = 2, 64, 3 do holes[i] = nil end
      holes.k = "v"
      local shrunk = {}
      for i = 1, 1000 do shrunk[i] = i end
      for i = 1, 990 do shrunk[i] = nil end
      shrunk.z = true
      for _, t in ipairs { back, late, mixed, holes, shrunk } do
        local b = rt(t)
        local n = 0
        for k, v in pairs(t) do
          n = n + 1
          assert.are.equal(v, b[k], "key " .. tostring(k))
        end
        for _ in pairs(b) do n = n - 1 end
        assert.are.equal(0, n, "the same number of entries")
      end
    end)

    it("keeps big arrays whole", function()
      local ints, floats, strs = {}, {}, {}
      for i = 1, 100000 do ints[i] = i * 3 - 150000; floats[i] = i * 0.25; strs[i] = "s" .. i end
      local a, b, c = rt(ints, floats, strs)
      assert.are.equal(100000, #a); assert.are.equal(100000, #b); assert.are.equal(100000, #c)
      for i = 1, 100000, 997 do
        assert.are.equal(ints[i], a[i]); assert.are.equal(floats[i], b[i]); assert.are.equal(strs[i], c[i])
      end
      assert.are.equal("float", math.type(b[4]))
    end)

    it("refuses metatables in arrays on a data channel, keeps them with functions, as before", function()
      local obj = setmetatable({ 1 }, { __index = { x = 1 } })
      assert.are.equal("cannot send getmetatable(value1[2]) (a metatable that is not a module) to another process",
                       encode_error(false, { 1, obj }))
      local b = frt({ 1, obj })
      assert.are.equal(1, b[2].x)
    end)

    it("checks array items it reads fast as strictly as any: lengths, varints, the budget, truncation", function()
      -- a string item claiming more bytes than are left
      assert.matches("truncated", decode_error(msg(tbl(1, 0) .. tag(T.STRING) .. varint(2^40) .. ("a"):rep(20))),
                     1, true)
      assert.matches("truncated", decode_error(msg(tbl(2, 0) .. tag(T.STRING) .. varint(30) .. ("a"):rep(20))),
                     1, true)
      -- an integer item over 64 bits, with bytes to spare behind it
      assert.matches("bad varint", decode_error(msg(tbl(2, 0) .. tag(T.INT) .. ("\xff"):rep(9) .. "\2"
                                                    .. ("\0"):rep(12))), 1, true)
      -- a float item cut short, an array cut short
      assert.matches("truncated", decode_error(msg(tbl(1, 0) .. tag(T.FLOAT) .. "\0\0\0")), 1, true)
      assert.matches("truncated", decode_error(msg(tbl(20, 0) .. int(1):rep(15))), 1, true)
      -- huge counts are refused before anything is allocated
      assert.matches("truncated", decode_error(msg(tag(T.TABLE) .. varint(2^62) .. "\0\0\0\0" .. int(1):rep(20))),
                     1, true)
      -- where: header 2, count 1, table 6, first item 2 bytes: the second is byte 11
      assert.are.equal("bad message at byte 11: bad tag 99", decode_error(msg(tbl(2, 0) .. int(5) .. "\99"
                                                                            .. ("\0"):rep(12))))
    end)
  end)

  describe("chunks: core._chunk(head, list, first, n), the Pool's messages", function()
    local chunk = core._chunk

    it("crosses as the table table.move would build, byte for byte", function()
      local list = { 10, 20, "x", { 1, 2 }, 5.5, nil, 7 }
      -- one key in the hash part: the order of two would depend on the
      -- string hashes' seed and on whether the table was rehashed
      local one = { 7, 8, 9, 3, fns = { a = 1 } }
      local built = { 7, 8, 9, 3, fns = one.fns }
      table.move(list, 2, 5, 5, built)
      assert.are.equal(encode(false, built), encode(false, chunk(one, list, 2, 4)))
      local head = { 7, 8, 9, 3, reset = true, fns = one.fns }
      -- a trailing hole goes as nil: the same table arrives
      local b = rt(chunk(head, list, 2, 5))
      assert.are.equal(20, b[5]); assert.are.equal("x", b[6]); assert.are.equal(2, b[7][2])
      assert.are.equal(5.5, b[8]); assert.is_nil(b[9]); assert.is_true(b.reset); assert.are.equal(1, b.fns.a)
    end)

    it("reads the list as table.move does: through __index, holes as nil", function()
      local proxy = setmetatable({}, { __index = function(_, i) return i * 2 end })
      local b = rt(chunk({}, proxy, 3, 4))
      assert.are.same({ 6, 8, 10, 12 }, b)
      local holes = rt(chunk({ "h" }, { 1, nil, 3 }, 1, 5))
      assert.are.equal("h", holes[1]); assert.are.equal(1, holes[2]); assert.is_nil(holes[3])
      assert.are.equal(3, holes[4]); assert.is_nil(holes[5]); assert.is_nil(holes[6])
    end)

    it("is one object: sent twice it arrives as one table; its items keep their references", function()
      local shared = { "s" }
      local c = chunk({ 1 }, { shared, shared }, 1, 2)
      local a, b = rt(c, c)
      assert.are.equal(a, b)
      assert.are.equal(a[2], a[3])
    end)

    it("names what cannot cross by its place in the table", function()
      assert.are.equal("cannot send value1[3] (function) to another process",
                       encode_error(false, chunk({ 1 }, { 2, function() end }, 1, 2)))
    end)

    -- with args (a starmap's), each item crosses flat: its count c and
    -- its c values, or -1 and the item as it is; a worker unpacks each
    -- list out of the one message table
    local function lists(t, from)
      local out, p = {}, from
      while p <= #t or t[p] ~= nil do
        local c = t[p]
        if c < 0 then
          out[#out + 1] = { bad = t[p + 1] }
          p = p + 2
        else
          out[#out + 1] = table.pack(table.unpack(t, p + 1, p + c))
          p = p + 1 + c
        end
      end
      return out
    end

    it("with args, an item crosses flat as the argument list unpack reads from it", function()
      local shared = { "s" }
      local proxy = setmetatable({}, { __index = function(_, k) return k == 1 and "p" or nil end,
                                      __len = function() return 2 end })
      local list = { { 1, 2 }, { 1, nil, 3, n = 3, x = print }, {}, { n = 2 }, proxy,
                     { shared, shared }, { n = 1.0 }, "not a table", { 4, nil, nil } }
      local b = rt(chunk({ 0, flag = true }, list, 1, #list, true))
      assert.are.equal(0, b[1])
      assert.is_true(b.flag)
      local got = lists(b, 2)
      assert.are.equal(#list, #got)
      assert.are.same({ 1, 2, n = 2 }, got[1])
      assert.are.same({ 1, nil, 3, n = 3 }, got[2])       -- a nil inside: n
      assert.are.same({ n = 0 }, got[3])
      assert.are.same({ n = 2 }, got[4])
      assert.are.same({ "p", nil, n = 2 }, got[5])        -- read through the metatable
      assert.are.equal(got[6][1], got[6][2])              -- values keep their references
      assert.are.same({ "s" }, got[6][1])
      assert.are.same({ n = 1 }, got[7])
      assert.are.same({ bad = "not a table" }, got[8])    -- for unpack to refuse
      assert.are.same({ 4, n = 1 }, got[9])               -- #: its border
      -- an n that is no count: the item crosses as it is, for unpack to refuse
      assert.are.same({ { bad = { n = "x" } } }, lists(rt(chunk({}, { { n = "x" } }, 1, 1, true)), 1))
      -- nor one that no unpack could give (Lua's stack limit): as it is
      assert.are.same({ { bad = { n = 1 << 40 } } },
                      lists(rt(chunk({}, { { n = 1 << 40 } }, 1, 1, true)), 1))
      -- an argument list has no number: the same table twice is read twice
      local twice = lists(rt(chunk({}, { { 7 }, { 7 } }, 1, 2, true)), 1)
      assert.are.same({ { 7, n = 1 }, { 7, n = 1 } }, twice)
      assert.are.equal("cannot send value1[1][2] (function) to another process",
                       encode_error(false, chunk({}, { { 1, function() end } }, 1, 1, true)))
      -- the count is written after the lists: the same table as built by hand
      assert.are.equal(encode(false, { 9, 2, "a", "b", 0, 1, 5, n = 3 }):len(),
                       encode(false, chunk({ 9, n = 3 }, { { "a", "b" }, {}, { 5 } }, 1, 3, true)):len() - 4)
      assert.are.same({ 9, 2, "a", "b", 0, 1, 5, n = 3 },
                      rt(chunk({ 9, n = 3 }, { { "a", "b" }, {}, { 5 } }, 1, 3, true)))
    end)

    it("with args, thousands of lists and a count past one varint byte", function()
      local list = {}
      for i = 1, 5000 do list[i] = { i, tostring(i), i % 2 == 0 } end
      local b = rt(chunk({}, list, 1, #list, true))
      local got = lists(b, 1)
      assert.are.equal(5000, #got)
      for i = 1, 5000, 499 do assert.are.same({ i, tostring(i), i % 2 == 0, n = 3 }, got[i]) end
    end)

    it("checks its arguments", function()
      assert.has_error(function() chunk(setmetatable({}, {}), {}, 1, 1) end)
      assert.has_error(function() chunk({}, {}, 0, 1) end)
      assert.has_error(function() chunk({}, {}, 1, -1) end)
      assert.has_error(function() chunk({}, {}, 2, math.maxinteger) end)
      assert.has_error(function() chunk({}, "list", 1, 1) end)
    end)

    it("core._table(narray, n): an empty table with its n", function()
      local t = core._table(1000, 1000)
      assert.are.equal(1000, t.n); assert.is_nil(next(t, "n") or t[1])
      assert.has_error(function() core._table(-1, 0) end)
    end)
  end)

  describe("untrusted input", function()
    local samples = {
      encode(false, nil, true, 1, -1.5, "str", { 1, 2, x = { y = "z" } }),
      encode(false, { a = { b = { c = string.format } } }, math.mininteger, ("x"):rep(300)),
      (function() local t = {}; t[1] = t; t.k = { t }; return encode(false, t, t) end)(),
    }

    it("says 'truncated' for every prefix of real messages", function()
      for _, s in ipairs(samples) do
        for i = 0, #s - 1 do
          local err = decode_error(s:sub(1, i))
          if i < 2 then
            assert.matches("not from this codec", err, 1, true)
          else
            assert.matches("truncated", err, 1, true)
          end
        end
      end
    end)

    it("refuses trailing garbage", function()
      for _, s in ipairs(samples) do
        assert.matches("trailing garbage", decode_error(s .. "\0"), 1, true)
      end
    end)

    it("refuses foreign bytes and other versions early", function()
      assert.matches("not from this codec", decode_error(""), 1, true)
      assert.matches("not from this codec", decode_error("\27Lua"), 1, true)
      assert.matches("not from this codec", decode_error("return 1"), 1, true)
      assert.matches("version 2", decode_error("\xCD\2\1\0"), 1, true)
    end)

    it("checks huge lengths and counts against the bytes left", function()
      local huge = varint(2^63)
      assert.matches("truncated", decode_error(HEADER .. "\1" .. tag(T.STRING) .. huge .. "abc"), 1, true)
      assert.matches("truncated", decode_error(HEADER .. huge), 1, true)
      assert.matches("truncated", decode_error(msg(tag(T.TABLE) .. huge .. "\0\0\0\0")), 1, true)
      assert.matches("truncated", decode_error(msg(tag(T.TABLE) .. "\0" .. "\xff\xff\xff\xff")), 1, true)
      assert.matches("truncated", decode_error(msg(tag(T.STRING) .. ("\xff"):rep(9) .. "\1")), 1, true)
      assert.matches("bad varint", decode_error(msg(tag(T.INT) .. ("\xff"):rep(9) .. "\2")), 1, true)
      assert.matches("bad varint", decode_error(msg(tag(T.INT) .. ("\xff"):rep(11))), 1, true)
    end)

    it("refuses bad tags, NaN and nil keys, bad references", function()
      assert.matches("bad tag 99", decode_error(msg("\99")), 1, true)
      assert.matches("bad tag 14", decode_error(msg(tag(T.UPJOIN) .. "\1\1")), 1, true)
      local nan = tag(T.FLOAT) .. bits(0/0)
      assert.matches("NaN key", decode_error(msg(tbl(0, 1) .. nan .. tag(T.TRUE))), 1, true)
      assert.matches("nil key", decode_error(msg(tbl(0, 1) .. tag(T.NIL) .. tag(T.TRUE))), 1, true)
      assert.matches("bad reference", decode_error(msg(tag(T.REF) .. "\1")), 1, true)
      assert.matches("bad reference", decode_error(msg(tbl(1, 0) .. tag(T.REF) .. "\2")), 1, true)
      assert.matches("bad reference", decode_error(msg(tag(T.REF) .. "\0")), 1, true)
      -- a key's number: only in a key's place, only of a key already numbered
      assert.matches("bad tag 16", decode_error(msg(tag(T.KEYREF) .. "\1")), 1, true)
      assert.matches("bad tag 16", decode_error(msg(tbl(0, 1) .. str("k") .. tag(T.KEYREF) .. "\1")), 1, true)
      assert.matches("bad key reference (0 keys so far)", decode_error(msg(tbl(0, 1) .. tag(T.KEYREF) .. "\1" .. tag(T.TRUE))), 1, true)
      assert.matches("bad key reference (1 keys so far)",
                     decode_error(msg(tbl(0, 2) .. str("k") .. tag(T.TRUE) .. tag(T.KEYREF) .. "\2" .. tag(T.TRUE))), 1, true)
      assert.matches("bad key reference", decode_error(msg(tbl(0, 1) .. tag(T.KEYREF) .. "\0" .. tag(T.TRUE))), 1, true)
      assert.matches("truncated", decode_error(msg(tbl(0, 1) .. tag(T.KEYREF))), 1, true)
      -- a string value is not numbered: no key to refer to
      assert.matches("bad key reference",
                     decode_error(msg(tbl(1, 1) .. str("v") .. tag(T.KEYREF) .. "\1" .. tag(T.TRUE))), 1, true)
      assert.matches("unknown userdata type 'nope'",
                     decode_error(msg(tag(T.USERDATA) .. varint(4) .. "nope" .. ("\0"):rep(8))), 1, true)
    end)

    it("says where the problem is", function()
      -- header 2, count 1, table tag 1, narray 1, nhash 4: the item is byte 9
      assert.are.equal("bad message at byte 9: bad tag 99", decode_error(msg(tbl(1, 0) .. "\99")))
    end)

    it("refuses function bytecode on a data channel", function()
      local s = encode(true, function() return 1 end)
      assert.matches("function bytecode is not accepted on this channel", decode_error(s), 1, true)
      assert.are.equal(1, decode(s, true)())
    end)

    it("refuses a metatable that is not a module reference on a data channel", function()
      local s = encode(true, setmetatable({}, { __index = { x = 1 } }))
      assert.matches("metatable is not a module reference", decode_error(s), 1, true)
      assert.are.equal(1, decode(s, true).x)
    end)

    it("refuses module fields that are not functions", function()
      local s = msg(tag(T.MODFIELD) .. varint(6) .. "string" .. varint(3) .. "nop")
      assert.matches("module has no function 'nop'", decode_error(s), 1, true)
      local s2 = msg(tag(T.MODFIELD) .. varint(4) .. "math" .. varint(2) .. "pi")
      assert.matches("module has no function 'pi'", decode_error(s2), 1, true)
      assert.matches("module 'codec_spec_nowhere' not found",
                     decode_error(msg(tag(T.MODULE) .. str("codec_spec_nowhere"):sub(2))), 1, true)
    end)

    it("survives random garbage and mutated messages", function()
      math.randomseed(20240607)
      local function random_bytes(n)
        local t = {}
        for i = 1, n do t[i] = string.char(math.random(0, 255)) end
        return table.concat(t)
      end
      for i = 1, 3000 do
        local s = random_bytes(math.random(0, 64))
        if i % 2 == 0 then s = HEADER .. s end
        local ok, err = pcall(decode, s)
        if not ok then assert.is_string(err) end
      end
      for _ = 1, 3000 do
        local s = samples[math.random(#samples)]
        local i = math.random(3, #s)
        s = s:sub(1, i - 1) .. string.char(math.random(0, 255)) .. s:sub(i + 1)
        local ok, err = pcall(decode, s)
        if not ok then assert.is_string(err) end
      end
      collectgarbage()
    end)
  end)

  describe("functions", function()
    local modname = "codec_spec_mod"
    local mod

    setup(function()
      package.preload[modname] = function()
        local M = { calls = 0 }
        function M.work(x) M.calls = M.calls + 1; return x * 2 end
        M.__index = M
        function M.new(v) return setmetatable({ v = v }, M) end
        function M:get() return self.v end
        return M
      end
      mod = require(modname)
    end)

    teardown(function()
      package.loaded[modname] = nil
      package.preload[modname] = nil
    end)

    it("sends module fields by reference on a data channel", function()
      local s = encode(false, string.format, mod.work, print)
      assert.is_nil(s:find("\27Lua", 1, true))
      assert.truthy(s:find(modname, 1, true))
      local f, w, p = decode(s)
      assert.are.equal(string.format, f)
      assert.are.equal(mod.work, w)
      assert.are.equal(print, p)
    end)

    it("requires the module on the receiving side", function()
      local s = encode(false, mod.work)
      package.loaded[modname] = nil
      local w = decode(s)
      assert.are.equal(package.loaded[modname].work, w)
      assert.are_not.equal(mod.work, w)
      assert.are.equal(6, w(3))
      package.loaded[modname] = mod
    end)

    it("refuses other functions on a data channel", function()
      local function f() end
      assert.are.equal("cannot send value1 (function) to another process", encode_error(false, f))
      assert.are.equal("cannot send value2.cb (function) to a queue",
                       encode_error({ names = nil, to = "to a queue" }, 1, { cb = f }))
    end)

    it("sends an object of a module class on a data channel", function()
      local p = mod.new(42)
      local b = rt({ p, p })
      assert.are.equal(mod, getmetatable(b[1]))
      assert.are.equal(b[1], b[2])
      assert.are.equal(42, b[1]:get())
    end)

    it("refuses other metatables on a data channel", function()
      local err = encode_error({ names = { "args" }, to = "to a queue" }, { p = setmetatable({}, {}) })
      assert.are.equal("cannot send getmetatable(args.p) (a metatable that is not a module) to a queue", err)
    end)

    it("sends closures with their upvalues", function()
      local n, label = 10, "count"
      local function counter(k) n = n + k; return label, n end
      local c = frt(counter)
      assert.are_not.equal(counter, c)
      assert.are.same({ "count", 15 }, { c(5) })
      assert.are.same({ "count", 16 }, { c(1) })
      assert.are.equal(10, n)  -- the copy has its own upvalues
    end)

    it("sets every upvalue, not only the first one load sets to the globals", function()
      -- a chunk of its own, so that _ENV is the globals (busted gives each
      -- spec file an environment of its own)
      local f = load("local first = ... return function() return first, string.rep('x', 2), _ENV end")("first")
      assert.are.equal("_ENV", debug.getupvalue(f, 2))
      local g = frt(f)
      assert.are_not.equal(f, g)
      assert.are.same({ "first", "xx", _G }, { g() })
    end)

    it("keeps upvalues shared between functions", function()
      local n = 0
      local function inc() n = n + 1 end
      local function get() return n end
      local t = frt({ inc = inc, get = get })
      t.inc(); t.inc()
      assert.are.equal(2, t.get())
      assert.are.equal(0, n)
      assert.are.equal(debug.upvalueid(t.inc, 1), debug.upvalueid(t.get, 1))
    end)

    it("keeps upvalues shared when the functions are separate values", function()
      local n = 0
      local function inc() n = n + 1 end
      local function get() return n end
      local i2, g2 = frt(inc, get)
      i2()
      assert.are.equal(1, g2())
    end)

    it("sends recursive and mutually recursive local functions", function()
      local function fact(n) if n <= 1 then return 1 end return n * fact(n - 1) end
      local is_even, is_odd
      function is_even(n) if n == 0 then return true end return is_odd(n - 1) end
      function is_odd(n) if n == 0 then return false end return is_even(n - 1) end
      local f, e = frt(fact, is_even)
      assert.are.equal(3628800, f(10))
      assert.is_true(e(10))
      assert.is_false(e(7))
      assert.are.equal(f, select(2, debug.getupvalue(f, 1)))
    end)

    it("decodes a function reached twice as one function", function()
      local function f() return 1 end
      local t, g = frt({ f, f, { f } }, f)
      assert.are.equal(t[1], t[2])
      assert.are.equal(t[1], t[3][1])
      assert.are.equal(t[1], g)
    end)

    it("sends module tables and module functions by reference", function()
      local m, fmt = mod, string.format
      local function worker(x) return m.work(x), fmt("%d", x), m end
      local s = encode(true, worker, { lib = mod, str = string, env = package.loaded._G })
      local w, t = decode(s, true)
      local doubled, formatted, mm = w(21)
      assert.are.equal(42, doubled)
      assert.are.equal("21", formatted)
      assert.are.equal(mod, mm)
      assert.are.equal(mod, t.lib)
      assert.are.equal(string, t.str)
      assert.are.equal(_G, t.env)
      local mw = frt(mod.work)
      assert.are.equal(mod.work, mw)
    end)

    -- the first few functions of a message are looked up by a walk of the
    -- modules, the rest in an index of them: both must find the same
    it("finds module functions alike in a message with few and with many", function()
      local function own(x) return x + 1 end
      local fields = { string.format, mod.work, table.concat, own, math.max,
                       print, string.rep, os.time, mod.new, io.write, own }
      for n = 1, #fields do
        local some = table.move(fields, 1, n, 1, {})
        local s = encode(true, some)
        local got = decode(s, true)
        for i = 1, n do
          if fields[i] == own then
            assert.are_not.equal(own, got[i])
            assert.are.equal(8, got[i](7))
          else
            assert.are.equal(fields[i], got[i])
          end
        end
        if n == #fields then assert.are.equal(got[4], got[11]) end
        -- module functions cross as names, not bytecode
        assert.are.equal(n >= 4, s:find("\27Lua", 1, true) ~= nil)
      end
    end)

    it("sends a Lua function that is a global as bytecode", function()
      local global = function() return "global" end
      rawset(_G, "codec_spec_global", global)
      local g = frt(global)
      assert.are_not.equal(global, g)
      assert.are.equal("global", g())
      assert.are.equal("cannot send value1 (function) to another process", encode_error(false, global))
      rawset(_G, "codec_spec_global", nil)
    end)

    it("keeps debug information: tracebacks name this file and line", function()
      local function boom() error("boom") end
      local line = debug.getinfo(boom, "S").linedefined
      local b = frt(boom)
      assert.are.equal(debug.getinfo(boom, "S").source, debug.getinfo(b, "S").source)
      local _, err = pcall(b)
      assert.matches("codec_spec.lua:" .. line .. ": boom", err, 1, true)
    end)

    it("names what cannot cross, and how it was reached", function()
      local sock = io.stdout
      local function worker() return sock end
      assert.are.equal("cannot send upvalue 'sock' of function 'worker' (userdata) " .. TO,
                       send_error({ "worker" }, worker))
      assert.are.equal("cannot send args[2].conn (userdata) " .. TO,
                       send_error({ "worker", "args" }, function() end, { 1, { conn = sock } }))
      assert.are.equal('cannot send args["a b"][true][1.5][table] (userdata) ' .. TO,
                       send_error({ "args" }, { ["a b"] = { [true] = { [1.5] = { [{}] = sock } } } }))
      assert.are.equal('cannot send args["end"] (userdata) ' .. TO, send_error({ "args" }, { ["end"] = sock }))
      local f = function() return sock end
      local function helper() return f end
      local function w() return helper() end
      assert.are.equal("cannot send upvalue 'sock' of upvalue 'f' of upvalue 'helper' of function 'worker' (userdata) " .. TO,
                       send_error({ "worker" }, w))
      local cfg = { conn = sock }
      local function w2() return cfg end
      assert.are.equal("cannot send upvalue 'cfg.conn' of function 'worker' (userdata) " .. TO,
                       send_error({ "worker" }, w2))
      assert.are.equal("cannot send upvalue 'sock' of function 'args.cb' (userdata) " .. TO,
                       send_error({ "args" }, { cb = worker }))
      assert.are.equal("cannot send a key of args (userdata) " .. TO, send_error({ "args" }, { [sock] = 1 }))
      assert.are.equal("cannot send x in a key of args (userdata) " .. TO,
                       send_error({ "args" }, { [{ x = sock }] = 1 }))
      assert.are.equal("cannot send getmetatable(args).__index (userdata) " .. TO,
                       send_error({ "args" }, setmetatable({}, { __index = sock })))
    end)

    it("refuses coroutines, C functions that are no module field, and light values", function()
      assert.are.equal("cannot send args.co (thread) " .. TO,
                       send_error({ "args" }, { co = coroutine.create(print) }))
      assert.are.equal("cannot send worker (function) " .. TO, send_error({ "worker" }, coroutine.wrap(print)))
      assert.are.equal("cannot send value2 (userdata) to another process", encode_error(true, 1, io.stderr))
    end)

    it("refuses deep chains of closures", function()
      local f = function() end
      for _ = 1, 2000 do local g = f; f = function() return g end end
      assert.matches("cannot send value1: nesting too deep", encode_error(true, f), 1, true)
    end)
  end)

  describe("userdata types", function()
    -- spec/host/codectest.c: a type registered with the codec, built with
    -- its own copy of src/codec.c (the core keeps its symbols hidden)
    local dir = os.tmpname()
    os.remove(dir)
    local so = dir .. "/codectest.so"
    local built = os.execute(("mkdir -p %s && cc -std=c99 -D_GNU_SOURCE -shared -fPIC -Isrc -o %s "
                              .. "spec/host/codectest.c src/codec.c $(pkg-config --cflags lua5.4)")
                             :format(dir, so))
    local T_ = built and assert(package.loadlib(so, "luaopen_codectest"))()
    os.execute("rm -rf " .. dir)
    local function it_(name, body)
      if T_ then it(name, body)
      else pending(name .. ": cannot compile spec/host/codectest.c (cc, pkg-config lua5.4)") end
    end

    it_("sends a registered type through its codec, once per object", function()
      local b = T_.blob("payload\0bytes")
      local s = encode(false, { b, b })
      local t = decode(s)
      assert.are.equal(t[1], t[2])
      assert.are_not.equal(b, t[1])
      assert.are.equal("payload\0bytes", (T_.blobinfo(t[1])))
    end)

    it_("passes descriptors beside the bytes, in order, each owned once", function()
      local path = os.tmpname()
      local b1, b2 = T_.blob("one", path), T_.blob("two", "/dev/null")
      local s, fd1, fd2 = encode(false, b1, 5, b2)
      assert.are.equal(select(2, T_.blobinfo(b1)), fd1)
      assert.are.equal(select(2, T_.blobinfo(b2)), fd2)
      local d1, five, d2 = decode(s, false, { fd1, fd2 })
      assert.are.equal(5, five)
      local data1, nfd1, target1 = T_.blobinfo(d1)
      local data2, nfd2, target2 = T_.blobinfo(d2)
      assert.are.equal("one", data1); assert.are.equal("two", data2)
      assert.are_not.equal(fd1, nfd1)
      assert.are.equal(select(3, T_.blobinfo(b1)), target1)
      assert.are.equal("/dev/null", target2)
      assert.are_not.equal(nfd1, nfd2)
      assert.matches("needs 1 descriptors, 0 came", decode_error(s), 1, true)
      assert.matches("needs 1 descriptors, 0 came", select(2, pcall(decode, s, false, { fd1 })), 1, true)
      os.remove(path)
    end)

    it_("refuses a userdata that only copies a registered __name", function()
      assert.are.equal("cannot send value1 (userdata) to another process", encode_error(false, T_.fakeblob()))
    end)
  end)
end)

-- Issue 8, defect 10: what decoding may cost is bounded by one budget for
-- the whole message.  Nested tables that each claim as many items as bytes
-- are left pass every per-level check; before the budget, a 109 KB message
-- of them cost 1.6 GB.
describe("codec memory budget", function()
  -- 'levels' nested tables, each claiming every byte left as an item (3-byte
  -- varints, so the sizes are known up front), padded with nils to 'size'
  local function amplifier(size, levels)
    local parts, pos = { HEADER, varint(1) }, 3
    for _ = 1, levels do
      local narr = size - pos - 4
      parts[#parts + 1] = tag(T.TABLE)
        .. string.char((narr & 0x7F) | 0x80, ((narr >> 7) & 0x7F) | 0x80, narr >> 14)
        .. string.pack("<I4", 0)
      pos = pos + 8
    end
    parts[#parts + 1] = ("\0"):rep(size - pos)
    local s = table.concat(parts)
    assert(#s == size)
    return s
  end

  -- KiB the Lua state allocated while 'f' ran (nothing is collected meanwhile)
  local function allocated(f)
    collectgarbage()
    collectgarbage()
    collectgarbage("stop")
    local before = collectgarbage("count")
    local ok, err = pcall(f)
    local kib = collectgarbage("count") - before
    collectgarbage("restart")
    collectgarbage()
    return kib, ok, err
  end

  it("a 109 KB message of nested claims costs at most a few MB, and fails", function()
    local s = amplifier(109 * 1024, 1000)
    local kib, ok, err = allocated(function() return decode(s) end)
    assert.is_false(ok)
    assert.matches("^bad message at byte %d+: ", err)
    assert.matches("more memory than a message of 111616 bytes may", err, 1, true)
    assert.is_true(kib < 4 * 1024, ("%.0f KiB"):format(kib))
  end)

  it("the budget is the message's, not each level's", function()
    -- two levels are enough to overdraw it where each alone would pass
    local s = amplifier(64 * 1024, 2)
    local ok, err = pcall(decode, s)
    assert.is_false(ok)
    assert.matches("more memory than a message", err, 1, true)
  end)

  it("honest messages stay well within it", function()
    local empties, nils, strings, record = {}, {}, {}, {}
    for i = 1, 20000 do
      empties[i] = {}
      strings[i] = tostring(i)
      record["k" .. i] = i % 2 == 0
    end
    for i = 1, 50000 do nils[i] = false end
    local values = { empties, nils, strings, record, { { {} }, { {}, {} } } }
    for _, v in ipairs(values) do
      assert.are.same(v, decode(encode(false, v)))
    end
    -- many values at the top, each a table
    assert.are.equal(5000, select("#", decode(encode(false, table.unpack(empties, 1, 5000)))))
  end)

  it("a message's own size is what it may cost: a big array of nils", function()
    local n = 200000
    local s = msg(tbl(n, 0) .. ("\0"):rep(n))
    local kib, ok = allocated(function() return decode(s) end)
    assert.is_true(ok)
    assert.is_true(kib < 24 * (n + 100) / 1024, ("%.0f KiB"):format(kib))
  end)
end)
