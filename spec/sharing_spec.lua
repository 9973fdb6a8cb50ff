-- Shared memory: sharing strategies, Array and Value, and their crossing of
-- process boundaries (arguments, results, queues, pipes) under each start
-- method and each strategy.  Nothing may be left in /dev/shm or open.
local mp = require "multiprocessing"
local H = require "helpers"

describe("sharing strategies", function()
  after_each(function() mp.set_sharing_strategy("file_descriptor") end)

  it("are the two of torch on Linux, file_descriptor by default", function()
    assert.are.same({ file_descriptor = true, file_system = true },
                    mp.get_all_sharing_strategies())
    assert.are.equal("file_descriptor", mp.get_sharing_strategy())
    mp.set_sharing_strategy("file_system")
    assert.are.equal("file_system", mp.get_sharing_strategy())
  end)

  it("are the parent's in workers of every start method", function()
    for _, strategy in ipairs(H.STRATEGIES) do
      mp.set_sharing_strategy(strategy)
      for _, method in ipairs(H.methods) do
        local r = mp.start_processes(function() return mp.get_sharing_strategy() end,
                                     {}, 1, true, false, method)
        assert.are.equal(strategy, r[1], method)
      end
    end
  end)

  it("reject an unknown name clearly", function()
    assert.has_error(function() mp.set_sharing_strategy("cuda_ipc") end)
    local ok, err = pcall(mp.set_sharing_strategy, "cuda_ipc")
    assert.is_false(ok)
    assert.matches("unknown sharing strategy 'cuda_ipc'", err)
    assert.are.equal("file_descriptor", mp.get_sharing_strategy())
  end)
end)

describe("Array and Value", function()
  H.leak_check(before_each, after_each)

  it("index from 1 with bounds checks and typed conversion", function()
    local a <close> = mp.Array("int32", 3)
    assert.are.equal(3, #a)
    a[1], a[3] = 7, -2
    assert.are.same({ 7, 0, -2 }, a:totable())
    assert.has_error(function() return a[4] end, nil)
    assert.matches("index 4 out of range %(1%.%.3%)", select(2, pcall(function() return a[4] end)))
    assert.matches("index 0 out of range", select(2, pcall(function() a[0] = 1 end)))
    assert.matches("out of range for uint8", select(2, pcall(function()
      local b <close> = mp.Array("uint8", 1); b[1] = 256 end)))
    assert.matches("no integer representation", select(2, pcall(function() a[1] = 1.5 end)))
    assert.matches("unknown ctype 'int7'", select(2, pcall(mp.Array, "int7", 1)))
  end)

  it("support every ctype", function()
    for _, ct in ipairs { "int8", "int16", "int32", "int64", "uint8", "uint16",
                          "uint32", "uint64", "float", "double" } do
      local a <close> = mp.Array(ct, { 1, 2, 3 })
      assert.are.same({ 1, 2, 3 }, a:totable(), ct)
      assert.are.equal(ct, a:ctype())
    end
    local c <close> = mp.Array("char", "hey")
    assert.are.equal("h", c[1])
    c[1] = "H"
    assert.are.equal("Hey", c:tostring())
    assert.are.equal("ey", c:tostring(2, 3))
    local d <close> = mp.Array("double", { 0.5 })
    assert.are.equal(0.5, d[1])
  end)

  it("fill, copy and tostring in bulk", function()
    local a <close> = mp.Array("uint8", 8)
    a:fill(9)
    assert.are.same({ 9, 9, 9, 9, 9, 9, 9, 9 }, a:totable())
    a:copy("abc")                       -- raw bytes at 1
    a:copy({ 1, 2 }, 4)                 -- a table at 4
    assert.are.equal("abc\1\2\9\9\9", a:tostring())
    local b <close> = mp.Array("uint8", 4, { shared = false })
    b:copy(a, 1, 2, 5)                  -- a[2..5] into b at 1
    assert.are.equal("bc\1\2", b:tostring())
    assert.has_error(function() a:copy(string.rep("x", 9)) end)
    local w <close> = mp.Array("int32", 2)
    w:copy(string.pack("<i4i4", 5, -6))
    assert.are.same({ 5, -6 }, w:totable())
  end)

  it("are shared by default; private ones move with share_memory", function()
    for _, s in ipairs(H.STRATEGIES) do
      mp.set_sharing_strategy(s)
      local a <close> = mp.Array("int64", 2)
      assert.is_true(a:is_shared())
      local p <close> = mp.Array("int64", { 1, 2 }, { shared = false })
      assert.is_false(p:is_shared())
      assert.are.equal(p, p:share_memory())
      assert.is_true(p:is_shared())
      assert.are.same({ 1, 2 }, p:totable())
      assert.matches(s, tostring(p))
    end
    mp.set_sharing_strategy("file_descriptor")
  end)

  it("Value has .value", function()
    local v <close> = mp.Value("double", 1.5)
    assert.are.equal(1.5, v.value)
    v.value = 2.5
    assert.are.equal(2.5, v.value)
    assert.has_error(function() v.other = 1 end)
  end)

  it("are closed by close, and then refuse use", function()
    local a = mp.Array("int8", 1)
    a:close()
    assert.matches("closed Array", select(2, pcall(function() return a[1] end)))
  end)
end)

for _, method in ipairs(H.methods) do
  for _, strategy in ipairs(H.STRATEGIES) do
    describe(("shared memory, %s, %s:"):format(method, strategy), function()
      H.leak_check(before_each, after_each, strategy)

      it("is the same memory for an argument", function()
        local a <close> = mp.Array("int32", 4)
        local v <close> = mp.Value("int64", 0)
        mp.start_processes(function(i, arr, val)
          arr[i + 1] = 10 + i
          val.value = 99
        end, { a, v }, 2, true, false, method)
        assert.are.same({ 10, 11, 0, 0 }, a:totable())
        assert.are.equal(99, v.value)
      end)

      it("is the same memory through a queue and a pipe, both ways", function()
        local q <close> = mp.Queue()
        local c1, c2 = mp.Pipe()
        local ctx = mp.start_processes(function(_, qq, conn)
          local x = qq:get()          -- from the parent
          x[1] = 42
          local y = mp.Array("int32", 1)
          y[1] = 5
          conn:send(y)                -- to the parent
          assert(conn:recv() == "written")
          assert(y[1] == 6, "parent's write seen")
          x:close(); y:close()
        end, { q, c2 }, 1, false, false, method)
        local a <close> = mp.Array("int32", 1)
        q:put(a)
        local y <close> = c1:recv()
        assert.are.equal(5, y[1])
        y[1] = 6
        c1:send("written")
        assert.is_true(ctx:join(10))
        assert.are.equal(42, a[1])
        c1:close(); c2:close()
      end)

      it("stays there for the workers when the parent closes it at once", function()
        local a = mp.Array("int32", 3)
        local back <close> = mp.Queue()
        local ctx = mp.start_processes(function(i, arr, bq)
          os.execute("sleep 0.2")       -- the parent has closed its array
          arr[i + 1] = i + 1
          bq:put(arr:totable())
        end, { a, back }, 3, false, false, method)
        a:close()
        for _ = 1, 3 do assert.are.equal(3, #back:get(10)) end
        assert.is_true(ctx:join(10))
      end)

      it("leaves nothing when a worker is SIGKILLed", function()
        local a <close> = mp.Array("int32", 1)
        local ok, e = pcall(mp.start_processes, function(i, arr)
          arr[1] = 1
          if i == 0 then
            os.execute("kill -9 " .. io.open("/proc/self/stat"):read("a"):match("^(%d+)"))
          end
        end, { a }, 2, true, false, method)
        assert.is_false(ok)
        assert.matches("SIGKILL", tostring(e))
        assert.are.equal(1, a[1])
      end)

      it("gives back what a SIGKILLed worker held while the parent runs on", function()
        local q <close> = mp.Queue()
        local from_parent <close> = mp.Array("int32", 1)
        q:put(from_parent)
        local ok, e = pcall(mp.start_processes, function(_, qq)
          local got = qq:get()              -- a reference received
          got[1] = 7
          local made = mp.Array("int32", 2)  -- made and kept
          local sent = mp.Array("int32", 1)  -- made and sent: the queue's now
          made[1], sent[1] = 1, 8
          qq:put(sent)
          os.execute("kill -9 " .. io.open("/proc/self/stat"):read("a"):match("^(%d+)"))
        end, { q }, 1, true, false, method)
        assert.is_false(ok)
        assert.matches("SIGKILL", tostring(e))
        assert.are.equal(7, from_parent[1])
        local sent <close> = q:get(10)
        assert.are.equal(8, sent[1])
        -- after_each: nothing else of the worker's is left in /dev/shm
      end)

      it("gives back what a SIGKILLed worker held after it forked workers of its own", function()
        -- its forks found a ledger of their own in its registry; its own
        -- is back in place for what it holds after them
        local q <close> = mp.Queue()
        local from_parent <close> = mp.Array("int32", 1)
        q:put(from_parent)
        local ok, e = pcall(mp.start_processes, function(_, qq)
          local inner = mp.start_processes(function(i)
            local mine = mp.Array("int32", 1)   -- an inner worker's own, given back
            mine[1] = i
            return i
          end, {}, 2, true, false, "fork")
          local got = qq:get()
          got[1] = inner[2] + 6
          local made = mp.Array("int32", 2)
          made[1] = 1
          os.execute("kill -9 " .. io.open("/proc/self/stat"):read("a"):match("^(%d+)"))
        end, { q }, 1, true, false, method)
        assert.is_false(ok)
        assert.matches("SIGKILL", tostring(e))
        assert.are.equal(7, from_parent[1])
        -- after_each: nothing of the worker's is left in /dev/shm
      end)

      it("copies a private array", function()
        local p <close> = mp.Array("int32", { 1 }, { shared = false })
        local q <close> = mp.Queue()
        mp.start_processes(function(_, arr, qq)
          arr[1] = 2
          qq:put(arr)
        end, { p, q }, 1, true, false, method)
        local r <close> = q:get()
        assert.are.equal(1, p[1])
        assert.are.equal(2, r[1])
        assert.is_false(r:is_shared())
      end)

      it("maps an array sent 100 times once in the worker", function()
        -- HDR (64) + n bytes = 13 pages: a size that tells the segment's
        -- lines in /proc/self/maps from the queues' own segments
        local a <close> = mp.Array("uint8", 13 * 4096 - 64)
        local q <close> = mp.Queue()
        local back <close> = mp.Queue()
        local ctx = mp.start_processes(function(_, qq, bq)
          local pid = io.open("/proc/self/stat"):read("a"):match("^(%d+)")
          local list = os.tmpname()
          local function fds()
            collectgarbage()          -- what the start left behind goes
            collectgarbage()
            -- through a file, not io.popen: its pipe races with the listing
            os.execute("ls /proc/" .. pid .. "/fd > " .. list)
            local f = io.open(list)
            local n = #f:read("a"):gsub("[^\n]", "")
            f:close()
            return n
          end
          local function maps()
            local n = 0
            for l in io.lines("/proc/self/maps") do
              local lo, hi = l:match("^(%x+)-(%x+)")
              if tonumber(hi, 16) - tonumber(lo, 16) == 13 * 4096 and
                 (l:find("memfd:multiprocessing", 1, true) or
                  l:find("/dev/shm/lmp_", 1, true)) then
                n = n + 1
              end
            end
            return n
          end
          local got = { qq:get() }    -- all kept open: 100 Arrays at the end
          bq:put(got[1][1])
          local f1, m1 = fds(), maps()
          for k = 2, 100 do
            got[k] = qq:get()
            bq:put(got[k][1])
          end
          got[100][2] = 7             -- seen through every other one
          local same = true
          for k = 1, 100 do same = same and got[k][2] == 7 end
          bq:put({ f1, fds(), m1, maps(), same })
          os.remove(list)
          for k = 1, 100 do got[k]:close() end
        end, { q, back }, 1, false, false, method)
        for k = 1, 100 do
          a[1] = k
          q:put(a)
          assert.are.equal(k, back:get(10))
        end
        local r = back:get(30)
        assert.is_true(ctx:join(10))
        assert.are.equal(r[1], r[2], "fds grew")
        assert.are.equal(1, r[3], "one mapping of the segment")
        assert.are.equal(r[3], r[4], "mappings grew")
        assert.is_true(r[5])
        assert.are.equal(7, a[2])
      end)

      it("sends 1000 arrays without running out of descriptors", function()
        local q <close> = mp.Queue()
        local back <close> = mp.Queue()
        local ctx = mp.start_processes(function(_, qq, bq)
          local sum = 0
          for _ = 1, 1000 do
            local x = qq:get()
            sum = sum + x[1]
            x:close()
          end
          bq:put(sum)
        end, { q, back }, 1, false, false, method)
        local want = 0
        for k = 1, 1000 do
          local a = mp.Array("int32", 1)
          a[1] = k
          want = want + k
          q:put(a)
          a:close()
        end
        assert.are.equal(want, back:get(30))
        assert.is_true(ctx:join(10))
      end)
    end)
  end
end

describe("the Arrays of one process on the same memory", function()
  local core = require "multiprocessing.core"
  H.leak_check(before_each, after_each)

  -- An encoded int32 Array without a lock, of n elements, claiming m
  -- instead (src/array.c's ArrayWire: how, ctype (E_INT32 = 2), isvalue,
  -- locked, 4 pad bytes, n).
  local function resize(s, how, n, m)
    local wire = how .. "\2\0" .. ("\0"):rep(5)
    local i = assert(s:find(wire .. string.pack("<I8", n), 1, true))
    return s:sub(1, i - 1) .. wire .. string.pack("<I8", m) ..
           s:sub(i + #wire + 8)
  end

  for _, strategy in ipairs(H.STRATEGIES) do
    it("share one mapping that outlives any one's close, " .. strategy, function()
      mp.set_sharing_strategy(strategy)
      local a = mp.Array("int32", 4)
      local q <close> = mp.Queue()
      q:put(a)
      q:put(a)
      local b, c = q:get(), q:get()
      a[1] = 5
      assert.are.equal(5, b[1])
      a:close()                       -- b and c still use the memory
      b[2] = 6
      assert.are.equal(6, c[2])
      c:close()
      assert.are.same({ 5, 6, 0, 0 }, b:totable())
      b:close()
      local d <close> = mp.Array("int32", 4)   -- a new mapping, not b's
      assert.are.same({ 0, 0, 0, 0 }, d:totable())
    end)

    it("refuse a mapped segment claimed with another size, " .. strategy, function()
      mp.set_sharing_strategy(strategy)
      local how = strategy == "file_system" and "N" or "F"
      local a <close> = mp.Array("int32", 4, { lock = false })
      local s, fd = core.encode(false, a)
      for _, m in ipairs { 5, 3, 1 << 20 } do
        local ok, e = pcall(core.decode, resize(s, how, 4, m), false, { fd })
        assert.is_false(ok)
        assert.matches("shared memory has size 80, expected " .. 64 + 4 * m, e)
      end
      -- the one real receipt takes the message's file_system reference
      local b <close> = core.decode(s, false, { fd })
      b[4] = 9
      assert.are.equal(9, a[4])
    end)
  end
end)

describe("file_system segments", function()
  it("are unlinked after SIGKILL of the parent", function()
    local before = H.shm()
    local script = os.tmpname()
    local f = assert(io.open(script, "w"))
    f:write("package.path = ", ("%q"):format(package.path),
            "; package.cpath = ", ("%q"):format(package.cpath), "\n", [[
      local mp = require "multiprocessing"
      mp.set_sharing_strategy("file_system")
      local keep = {}
      for i = 1, 5 do keep[i] = mp.Array("uint8", 4096) end
      local q = mp.Queue()
      q:put(keep[1])                -- in flight, never received
      io.stdout:write(#io.popen("ls /dev/shm"):read("a") > 0 and "made\n" or "none\n")
      io.stdout:flush()
      os.execute("kill -9 " .. io.open("/proc/self/stat"):read("a"):match("^(%d+)"))
    ]])
    f:close()
    local out = H.sh("lua5.4 " .. script .. " 2>&1")
    os.remove(script)
    assert.matches("made", out)
    assert.is_truthy(H.eventually(function()
      return #H.shm() == #before
    end, 5))
    assert.are.same(before, H.shm())
  end)

  it("names cannot be guessed and are private", function()
    mp.set_sharing_strategy("file_system")
    local before = H.shm()
    local a <close> = mp.Array("uint8", 1)
    local new = {}
    for _, n in ipairs(H.shm()) do
      local seen = false
      for _, o in ipairs(before) do seen = seen or o == n end
      if not seen then new[#new + 1] = n end
    end
    mp.set_sharing_strategy("file_descriptor")
    assert.are.equal(1, #new)
    assert.matches("^lmp_%x+$", new[1])
    assert.are.equal(32, #new[1] - 4)
    assert.matches("^%-rw%-%-%-%-%-%-%-", H.sh("ls -l /dev/shm/" .. new[1]))
  end)
end)


-- issue 19 item 8: what tostring prints is the object's state as of now
describe("tostring tells the truth, live", function()
  H.leak_check(before_each, after_each)

  it("Value with its value, Array with its type, length and first elements", function()
    local v <close> = mp.Value("double", 2.5)
    assert.are.equal("multiprocessing.Value(double, 2.5, shared, file_descriptor)", tostring(v))
    v.value = -1
    assert.are.equal("multiprocessing.Value(double, -1.0, shared, file_descriptor)", tostring(v))
    local a <close> = mp.Array("int32", 1000)
    a[2] = 42
    assert.are.equal("multiprocessing.Array(int32, 1000, shared, file_descriptor): "
                     .. "{0, 42, 0, 0, 0, 0, 0, 0, ...}", tostring(a))
    local s <close> = mp.Array("int8", { 1, -2, 3 }, { shared = false })
    assert.are.equal("multiprocessing.Array(int8, 3, private): {1, -2, 3}", tostring(s))
    local c <close> = mp.Array("char", 'hi "x"\0')
    assert.are.equal('multiprocessing.Array(char, 7, shared, file_descriptor): "hi \\34x\\34\\0"',
                     tostring(c))
    a:close()
    assert.are.equal("multiprocessing.Array(int32, 1000, closed)", tostring(a))
  end)

  it("a ProcessContext counts its running and finished workers as of now", function()
    local e <close> = mp.Event()
    local ctx = mp.start_processes(function(i, ev)
      if i == 1 then os.exit(3) end
      if i == 2 then return end
      ev:wait(60)
    end, { e }, 3, false, false, "fork")
    -- no join: tostring itself sees the two that ended
    assert.is_truthy(H.eventually(function()
      return tostring(ctx):find("3 processes: 1 running, 2 done, 1 failed", 1, true)
    end, 30), tostring(ctx))
    assert.matches("^ProcessContext %(fork, ", tostring(ctx))
    e:set()
    assert.is_false(pcall(ctx.join, ctx, 60))
    assert.truthy(tostring(ctx):find("0 running, 3 done, 1 failed", 1, true), tostring(ctx))
  end)

  it("a Pool counts its workers, tasks pending and tasks done", function()
    local pool = mp.Pool(2, { start_method = "fork" })
    assert.are.equal("Pool (fork, 2 workers, 0 tasks pending, 0 done, run)", tostring(pool))
    local e <close> = mp.Event()
    local ar = pool:apply_async(function(ev) ev:wait(60) end, { e })
    assert.are.equal("Pool (fork, 2 workers, 1 task pending, 0 done, run)", tostring(pool))
    e:set()
    ar:get(60)
    assert.are.same({ 2, 4, 6, n = 3 }, pool:map(function(x) return 2 * x end, { 1, 2, 3 }))
    assert.are.equal("Pool (fork, 2 workers, 0 tasks pending, 4 done, run)", tostring(pool))
    pool:close()
    pool:join()
    assert.are.equal("Pool (fork, 0 workers, 0 tasks pending, 4 done, joined)", tostring(pool))
  end)

  it("current_process() prints as a process; exceptions print their type first", function()
    local me = mp.current_process()
    assert.are.equal(("MainProcess (pid %d, running)"):format(me.pid), tostring(me))
    local r = mp.start_processes(function()
      return tostring(require("multiprocessing").current_process())
    end, {}, 2, true, false, "fork")
    assert.matches("^Process 0 %(pid %d+, running%)$", r[1])
    assert.matches("^Process 1 %(pid %d+, running%)$", r[2])
    local ok, e = pcall(mp.start_processes, function() os.exit(5) end, {}, 1, true, false, "fork")
    assert.is_false(ok)
    assert.are.equal("ProcessExitedException: " .. e.msg, tostring(e))
    ok, e = pcall(mp.start_processes, function() error("boom") end, {}, 1, true, false, "fork")
    assert.is_false(ok)
    assert.are.equal("ProcessRaisedException: " .. e.msg, tostring(e))
    -- an Interrupted says what it is in its message already
    ok, e = pcall(require("multiprocessing.core")._interrupt, "Queue.get", "nothing was taken")
    assert.is_false(ok)
    assert.are.equal("interrupted: SIGINT during Queue.get; nothing was taken", tostring(e))
  end)
end)
