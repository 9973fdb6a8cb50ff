-- mp.Pool: a task farm that survives crashed, hung and failing tasks.
local mp = require "multiprocessing"
local H = require "helpers"

local function mypid()
  return tonumber(io.open("/proc/self/stat"):read("a"):match("^%d+"))
end

local function exists(path)
  local f = io.open(path)
  if f then f:close() end
  return f ~= nil
end

-- Waits (in a task) until 'path' exists.
local function wait_file(path)
  for _ = 1, 2000 do
    local f = io.open(path)
    if f then f:close() return true end
    os.execute("sleep 0.01")
  end
  return false
end

local function touch(path) io.open(path, "w"):close() end

describe("mp.Pool basics:", function()
  H.leak_check(before_each, after_each)

  it("cpu_count, set_start_method and get_start_method", function()
    assert.is_true(math.type(mp.cpu_count()) == "integer" and mp.cpu_count() >= 1)
    assert.are.equal("spawn", mp.get_start_method())
    mp.set_start_method("fork")
    assert.are.equal("fork", mp.get_start_method())
    local pool <close> = mp.Pool(1)
    assert.are.equal("fork", pool.start_method)
    mp.set_start_method("spawn")
    assert.has_error(function() mp.set_start_method("threads") end)
    assert.are.equal("spawn", mp.get_start_method())
  end)

  it("processes defaults to cpu_count()", function()
    local pool <close> = mp.Pool(nil, { start_method = "fork" })
    assert.are.equal(mp.cpu_count(), pool.processes)
  end)

  it("TimeoutError is a ProcessException", function()
    assert.is_table(mp.TimeoutError)
    assert.are.equal(mp.ProcessException, mp.TimeoutError.__parent)
  end)

  it("rejects bad input before anything is queued, naming the argument", function()
    local function msg(f, ...)
      local ok, e = pcall(f, ...)
      assert.is_false(ok)
      return tostring(e)
    end
    assert.matches("bad argument #1 to 'Pool' %(processes must be a positive integer, got 0%)",
                   msg(mp.Pool, 0))
    assert.matches("bad argument #1 to 'Pool'", msg(mp.Pool, 1.5))
    assert.matches("unknown option 'procs'", msg(mp.Pool, 1, { procs = 2 }))
    assert.matches("unknown start method 'thread'", msg(mp.Pool, 1, { start_method = "thread" }))
    assert.matches("timeout must be a non%-negative number", msg(mp.Pool, 1, { timeout = -1 }))
    assert.matches("retries must be a non%-negative integer", msg(mp.Pool, 1, { retries = "x" }))
    assert.matches("maxtasksperchild must be a positive integer",
                   msg(mp.Pool, 1, { maxtasksperchild = 0 }))
    local ran = os.tmpname()
    os.remove(ran)
    local pool <close> = mp.Pool(1, { start_method = "fork" })
    local f = function() touch(ran) end
    assert.matches("bad argument #1 to 'Pool.map' %(function expected, got number%)",
                   msg(pool.map, pool, 1, {}))
    assert.matches("bad argument #2 to 'Pool.map' %(table expected, got string%)",
                   msg(pool.map, pool, f, "abc"))
    assert.matches("bad argument #3 to 'Pool.map' %(chunksize must be a positive integer, got 0%)",
                   msg(pool.map, pool, f, { 1 }, 0))
    assert.matches("unknown option 'chunk'", msg(pool.map, pool, f, { 1 }, { chunk = 2 }))
    assert.matches("bad argument #2 to 'Pool.starmap' %(list%[2%] must be a table",
                   msg(pool.starmap, pool, f, { {}, 3 }))
    assert.matches("bad argument #1 to 'Pool.apply_async'", msg(pool.apply_async, pool, nil))
    assert.matches("bad argument #2 to 'Pool.imap'", msg(pool.imap, pool, f, 5))
    assert.matches("bad argument #3 to 'Pool.imap_unordered'",
                   msg(pool.imap_unordered, pool, f, { 1 }, -2))
    -- what cannot cross is refused with its path, before anything runs
    local sock = io.stdout
    assert.matches("cannot send upvalue 'sock'", msg(pool.map, pool, function()
      touch(ran); return sock
    end, { 1, 2 }))
    assert.matches("cannot send list%[2%]", msg(pool.map, pool, f, { 1, io.stderr }))
    assert.matches("cannot send args%[1%]", msg(pool.apply_async, pool, f, { io.stderr }))
    assert.is_false(exists(ran))
    -- use after close or terminate
    pool:close()
    assert.matches("Pool.map: the pool is closed", msg(pool.map, pool, f, { 1 }))
    pool:join()
    local p2 = mp.Pool(1, { start_method = "fork" })
    p2:terminate()
    assert.matches("Pool.apply_async: the pool is terminated", msg(p2.apply_async, p2, f))
    assert.matches("the pool is still running", msg(mp.Pool(1, { start_method = "fork" }).join,
                                                   mp.Pool(1, { start_method = "fork" })))
    assert.is_false(exists(ran))
  end)

  it("__gc terminates the workers", function()
    local pool = mp.Pool(2, { start_method = "fork" })
    local pids = pool:map(function() return mypid() end, { 1, 2, 3, 4 }, 1)
    assert.are.equal(4, pids.n)
    pool = nil -- luacheck: ignore 311
    collectgarbage()
    collectgarbage()
    assert.are.same({}, H.children())
  end)
end)

for _, method in ipairs(H.methods) do
  describe("mp.Pool with start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("map keeps input order, nil and false apart; starmap unpacks", function()
      local pool <close> = mp.Pool(3, { start_method = method })
      local list = {}
      for i = 1, 200 do list[i] = i end
      local base = 1000   -- an upvalue: the closure crosses with it
      local r = pool:map(function(x)
        if x % 3 == 0 then return nil elseif x % 3 == 1 then return false end
        return x + base
      end, list, 7)
      assert.are.equal(200, r.n)
      for i = 1, 200 do
        if i % 3 == 0 then assert.is_nil(r[i])
        elseif i % 3 == 1 then assert.is_false(r[i])
        else assert.are.equal(i + base, r[i]) end
      end
      local s = pool:starmap(function(a, b, c) return (a or 0) + b + (c or 0) end,
                             { { 1, 2 }, { n = 3, nil, 5, 6 }, { 3, 4, 5 } })
      assert.are.same({ 3, 11, 12, n = 3 }, s)
      assert.are.same({ n = 0 }, pool:map(print, {}))
      -- module functions go by reference
      assert.are.same({ "A", "B", n = 2 }, pool:map(string.upper, { "a", "b" }))
    end)

    -- a map's results are decoded straight into its result table, message
    -- by message: slow items post theirs in several messages
    it("map: results posted in pieces land in their places", function()
      local pool <close> = mp.Pool(2, { start_method = method })
      local list = {}
      for i = 1, 24 do list[i] = i end
      local function slow(x)
        local t = os.clock() + 0.012
        while os.clock() < t do end
        if x % 4 == 0 then return nil elseif x % 4 == 1 then return false end
        return x * 10
      end
      for _ = 1, 2 do
        local r = pool:map(slow, list, 12)
        assert.are.equal(24, r.n)
        for i = 1, 24 do
          if i % 4 == 0 then assert.is_nil(r[i])
          elseif i % 4 == 1 then assert.is_false(r[i])
          else assert.are.equal(i * 10, r[i]) end
        end
      end
      local ok, e = pcall(pool.map, pool, function(x)
        if x == 17 then error("seventeen") end
        return slow(x)
      end, list, 12)
      assert.is_false(ok)
      assert.are.equal(17, e.task)
      assert.are.same({ 2, 3, 4, n = 3 }, pool:map(function(x) return x + 1 end, { 1, 2, 3 }))
    end)

    it("imap_unordered: a failed item raises at its turn; with outcomes it is yielded", function()
      local flag = os.tmpname()
      os.remove(flag)
      local pool <close> = mp.Pool(2, { start_method = method })
      local function f(x)
        if x == 3 then error("three") end
        if x >= 5 then wait_file(flag) end
        return x * 10
      end
      local got = {}
      local ok, e = pcall(function()
        for i, r in pool:imap_unordered(f, { 1, 2, 3, 4, 5, 6 }, 2) do got[i] = r end
      end)
      assert.is_false(ok)
      assert.matches("three", tostring(e))
      for i, r in pairs(got) do assert.are.equal(i * 10, r) end
      -- items 5 and 6 finish after the loop has left: their results are
      -- dropped, and the pool counts the abandoned job once
      touch(flag)
      for _ = 1, 3000 do                 -- until the message of 5 and 6 is back
        pool:_drain()
        if pool.nmsg == 0 then break end
        os.execute("sleep 0.01")
      end
      assert.are.equal(0, pool.nmsg)
      assert.are.equal(0, pool.active)
      local outs, count = {}, 0
      for i, o in pool:imap_unordered(f, { 1, 2, 3, 4, 5 }, { outcomes = true, chunksize = 2 }) do
        outs[i], count = o, count + 1
      end
      assert.are.equal(5, count)
      for i = 1, 5 do
        if i == 3 then
          assert.is_false(outs[3].ok)
          assert.matches("three", tostring(outs[3].error))
        else
          assert.are.same({ ok = true, value = i * 10 }, outs[i])
        end
      end
      assert.are.same({ 20, n = 1 }, pool:map(f, { 2 }))
      os.remove(flag)
    end)

    it("starmap calls fn with what table.unpack(args, 1, args.n or #args) gives", function()
      local pool <close> = mp.Pool(2, { start_method = method })
      local function show(...)
        local t = table.pack(...)
        for i = 1, t.n do
          t[i] = type(t[i]) == "table" and ("{%s}"):format(t[i][1]) or tostring(t[i])
        end
        return t.n .. ":" .. table.concat(t, ",", 1, t.n)
      end
      local shared = { 7 }
      local proxy = setmetatable({}, { __index = function(_, k) return k == 1 and "p" or nil end,
                                      __len = function() return 2 end })
      assert.are.same({ "2:1,2", "3:1,nil,3", "0:", "2:nil,nil", "2:p,nil", "2:{7},{7}", n = 6 },
                      pool:starmap(show, { { 1, 2 }, { 1, nil, 3, n = 3 }, {}, { n = 2 }, proxy,
                                           { shared, shared } }))
      local same = pool:starmap(function(a, b) return a == b end, { { shared, shared } })
      assert.is_true(same[1])
      assert.matches("bad argument #3 to 'unpack'",
                     tostring(select(2, pcall(pool.starmap, pool, show, { { n = "x" } }))))
      assert.matches("too many results to unpack",
                     tostring(select(2, pcall(pool.starmap, pool, show, { { n = 1 << 40 } }))))
    end)

    it("imap yields in order as results come; imap_unordered gives positions", function()
      local flag = os.tmpname()
      os.remove(flag)
      local pool <close> = mp.Pool(2, { start_method = method })
      -- item 2 waits for a file that the loop creates once it has item 1:
      -- imap must yield item 1 before item 2 is done
      local seen = {}
      for i, r in pool:imap(function(x)
        if x == 2 then return wait_file(flag) and "two" end
        return "one"
      end, { 1, 2 }) do
        seen[#seen + 1] = i .. "=" .. tostring(r)
        if i == 1 then touch(flag) end
      end
      assert.are.same({ "1=one", "2=two" }, seen)
      os.remove(flag)
      -- item 1 waits for item 2 to have been yielded
      seen = {}
      for i, r in pool:imap_unordered(function(x)
        if x == 10 then return wait_file(flag) and x end
        return x
      end, { 10, 20 }) do
        seen[#seen + 1] = i .. "=" .. r
        if i == 2 then touch(flag) end
      end
      os.remove(flag)
      assert.are.same({ "2=20", "1=10" }, seen)
      -- breaking out of a loop leaves the pool usable
      local next_result, _, _, closer = pool:imap(function(x) return x end, { 1, 2, 3, 4, 5 })
      assert.are.same({ 1, 1 }, { next_result() })
      getmetatable(closer).__close(closer)
      assert.are.same({ 2, n = 1 }, pool:map(function(x) return x * 2 end, { 1 }))
    end)

    it("apply_async: get, wait, ready, successful, callbacks, get(timeout)", function()
      local flag = os.tmpname()
      os.remove(flag)
      local pool <close> = mp.Pool(2, { start_method = method })
      local got, failed = {}, {}
      local a = pool:apply_async(function(x, y) return x * y end, { 6, 7 },
                                 { callback = function(v) got[#got + 1] = v end })
      local b = pool:apply_async(function() error({ code = 42 }) end, nil,
                                 { error_callback = function(e) failed[#failed + 1] = e end })
      local c = pool:apply_async(function(f) wait_file(f); return nil end, { flag })
      assert.are.equal(42, a:get())
      assert.is_true(b:wait())
      assert.is_true(b:ready())
      assert.is_false(b:successful())
      local ok, e = pcall(b.get, b)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      assert.are.equal(42, e.value.code)
      assert.are.equal(2, e.task)
      assert.are.same({ 42 }, got)
      assert.are.equal(e, failed[1])
      -- pending: nil, "timeout"; then a nil result is one nil
      assert.are.same({ nil, "timeout", n = 2 }, table.pack(c:get(0.05)))
      assert.is_false(c:ready())
      assert.has_error(function() c:successful() end)
      touch(flag)
      assert.are.same({ n = 1 }, table.pack(c:get()))
      assert.is_true(c:successful())
      os.remove(flag)
      assert.are.equal(5, pool:apply(function(x) return x + 1 end, { 4 }))
      local m = pool:map_async(function(x) return -x end, { 1, 2, 3 })
      assert.are.same({ -1, -2, -3, n = 3 }, m:get())
      -- a callback that raises: its error comes out of its own
      -- AsyncResult's get(), not of whichever pool call ran it, and the
      -- other results are not lost
      local bad = pool:apply_async(function() return 1 end, {},
                                   { callback = function() error("cb failed") end })
      local ebad = pool:apply_async(function() error("task failed") end, {},
                                    { error_callback = function() error("ecb failed") end })
      local good = pool:apply_async(function() return 2 end)
      assert.are.equal(2, good:get())
      assert.is_true(bad:wait(30) and ebad:wait(30))
      assert.are.equal(2, pool:apply(function() return 2 end))
      local cbok, cberr = pcall(bad.get, bad)
      assert.is_false(cbok)
      assert.matches("cb failed", cberr)
      assert.is_true(bad:successful())   -- the task itself succeeded
      cbok, cberr = pcall(ebad.get, ebad)
      assert.is_false(cbok)
      assert.matches("ecb failed", cberr)
    end)

    it("a worker busy with message after message: holes, failures and shorter messages", function()
      -- one worker, so that each message is decoded over the one before
      local pool <close> = mp.Pool(1, { start_method = method })
      local list = { n = 41 }
      for i = 1, 41 do list[i] = i % 3 ~= 0 and i or nil end
      local r = pool:map(function(x) return x end, list, 4)
      for i = 1, 41 do assert.are.equal(list[i], r[i]) end
      assert.are.equal(41, r.n)
      r = pool:map(function(x) if x and x % 5 == 0 then error("five") end return x end,
                   list, { chunksize = 4, outcomes = true })
      for i = 1, 41 do
        if list[i] and i % 5 == 0 then assert.is_false(r[i].ok)
        else assert.are.same({ ok = true, value = list[i] }, r[i]) end
      end
    end)

    it("failures inside one big message: every other item's result, in map and starmap", function()
      local pool <close> = mp.Pool(2, { start_method = method })
      local function f(x) if x % 7 == 3 then error("bad " .. x) end return x * 2 end
      local list = {}
      for i = 1, 60 do list[i] = i end
      local r = pool:map(f, list, { chunksize = 60, outcomes = true })
      for i = 1, 60 do
        if i % 7 == 3 then
          assert.is_false(r[i].ok)
          assert.are.equal(i, r[i].error.task)
          assert.matches("bad " .. i, r[i].error.msg)
        else
          assert.are.same({ ok = true, value = 2 * i }, r[i])
        end
      end
      -- starmap: flat lists, lists with holes and n, lists with a metatable
      -- (these cross as they are), a failure among them
      local stars, want = {}, {}
      for i = 1, 40 do
        if i % 5 == 0 then stars[i] = setmetatable({ i, i, n = 2 }, {})
        elseif i % 4 == 0 then stars[i] = { i, nil, i, n = 3 }
        else stars[i] = { i, i + 1 } end
        local t = stars[i]
        want[i] = t[1] + (t[2] or 0) + (t[3] or 0)
      end
      local function g(a, b, c)
        if a == 13 or a == 20 then error({ code = a }) end
        return a + (b or 0) + (c or 0)
      end
      r = pool:starmap(g, stars, { chunksize = 40, outcomes = true })
      for i = 1, 40 do
        if i == 13 or i == 20 then
          assert.is_false(r[i].ok)
          assert.are.equal(i, r[i].error.value.code)
        else
          assert.are.same({ ok = true, value = want[i] }, r[i])
        end
      end
      -- a C function as the task: its frame is the user's, not the pool's
      local ok, e = pcall(pool.map, pool, tostring,
                          { 1, setmetatable({}, { __tostring = function() error("no text") end }) })
      assert.is_false(ok)
      assert.are.equal(2, e.task)
      assert.matches("in function 'tostring'", e.msg)
      assert.is_nil(e.msg:find("_run_items", 1, true))
      assert.is_nil(e.msg:find("poolworker", 1, true))
    end)

    it("a task that raises: traceback, e.task, e.value; the pool keeps working", function()
      local pool <close> = mp.Pool(2, { start_method = method })
      local function check(x)
        if x == 4 then error("bad input 4") end
        if x == 6 then error({ why = "six" }) end
        return x
      end
      local ok, e = pcall(pool.map, pool, check, { 1, 2, 3, 4, 5, 6, 7 }, 1)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      assert.is_true(mp.isinstance(e, mp.ProcessException))
      assert.are.equal(4, e.task)   -- the first failure in input order
      assert.matches("task 4 failed", e.msg)
      assert.matches("stack traceback", e.msg)
      assert.matches("pool_spec.lua:%d+: bad input 4", e.msg)
      assert.is_nil(e.exit_code)   -- the worker did not exit
      -- the traceback names the user's function, not the pool's locals
      assert.matches("pool_spec.lua:%d+: in function <[^\n]*pool_spec.lua:%d+>", e.msg)
      assert.is_nil(e.msg:find("in local 'task'", 1, true))
      assert.is_nil(e.msg:find("poolworker", 1, true))
      -- every outcome, without raising
      local r = pool:map(check, { 1, 2, 3, 4, 5, 6, 7 }, { chunksize = 2, outcomes = true })
      assert.are.same({ ok = true, value = 1 }, r[1])
      assert.is_false(r[4].ok)
      assert.are.equal(4, r[4].error.task)
      assert.are.equal("six", r[6].error.value.why)
      assert.are.same({ ok = true, value = 7 }, r[7])
      -- imap raises at the failed item, after the ones before it
      local seen = {}
      ok, e = pcall(function()
        for i in pool:imap(check, { 1, 2, 3, 4, 5 }) do seen[#seen + 1] = i end
      end)
      assert.is_false(ok)
      assert.are.equal(4, e.task)
      assert.are.same({ 1, 2, 3 }, seen)
      assert.are.same({ 1, 2, n = 2 }, pool:map(check, { 1, 2 }))
      -- a result that cannot cross is that task's error
      r = pool:map(function(x)
        if x == 2 then return function() return x end end
        return x
      end, { 1, 2, 3 }, { outcomes = true, chunksize = 3 })
      assert.are.same({ ok = true, value = 1 }, r[1])
      assert.matches("cannot send the task's result", r[2].error.msg)
      assert.are.same({ ok = true, value = 3 }, r[3])
    end)

    it("a worker SIGKILLed mid-task: that task fails, the others run, the worker is replaced", function()
      local pool <close> = mp.Pool(2, { start_method = method })
      local r = pool:map(function(x)
        if x == 3 then
          os.execute("kill -9 " .. tostring(mypid()))
          os.execute("sleep 5")
        end
        if x == 5 then os.exit(7) end
        return mypid()
      end, { 1, 2, 3, 4, 5, 6, 7, 8 }, { chunksize = 4, outcomes = true })
      for i = 1, 8 do
        if i == 3 or i == 5 then
          local e = r[i].error
          assert.is_true(mp.isinstance(e, mp.ProcessExitedException), tostring(e))
          assert.are.equal(i, e.task)
        else
          assert.is_true(r[i].ok)
        end
      end
      assert.are.equal("SIGKILL", r[3].error.signal_name)
      assert.matches("task 3: pool process %d+ terminated with signal SIGKILL", r[3].error.msg)
      assert.are.equal(7, r[5].error.exit_code)
      assert.matches("exit code 7", r[5].error.msg)
      -- the slots were refilled
      local after = pool:map(function() return mypid() end, { 1, 2, 3, 4 }, 1)
      assert.are.equal(4, after.n)
    end)

    it("a task past its timeout: TimeoutError, its worker replaced; retries re-run", function()
      local pool <close> = mp.Pool(2, { start_method = method, timeout = 0.3 })
      local r = pool:map(function(x)
        if x == 2 then os.execute("sleep 30") end
        return x
      end, { 1, 2, 3, 4 }, { outcomes = true, chunksize = 1 })
      assert.is_true(r[1].ok and r[3].ok and r[4].ok)
      local e = r[2].error
      assert.is_true(mp.isinstance(e, mp.TimeoutError))
      assert.is_true(mp.isinstance(e, mp.ProcessException))
      assert.are.equal(2, e.task)
      assert.matches("task 2 timed out after 0.3 seconds", e.msg)
      -- it names the signal that ended its worker
      assert.is_true(e.signal_name == "SIGTERM" or e.signal_name == "SIGKILL", tostring(e.signal_name))
      assert.matches("terminated %(signal " .. e.signal_name .. "%)", e.msg)
      assert.are.equal(-mp.signals[e.signal_name], e.exit_code)
      -- a per-call timeout on apply_async
      local ar = pool:apply_async(function() os.execute("sleep 30") end, {}, { timeout = 0.2 })
      local ok, te = pcall(ar.get, ar)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(te, mp.TimeoutError))
      assert.are.equal(1, te.task)
    end)

    it("retries: a task whose worker died runs again", function()
      local marker = os.tmpname()
      os.remove(marker)
      local pool <close> = mp.Pool(2, { start_method = method, retries = 1 })
      local r = pool:map(function(x)
        if x == 2 and not exists(marker) then
          touch(marker)
          os.execute("kill -9 " .. tostring(mypid()))
          os.execute("sleep 5")
        end
        return x * 10
      end, { 1, 2, 3 }, 1)
      assert.are.same({ 10, 20, 30, n = 3 }, r)
      os.remove(marker)
      -- a task that always kills its worker fails after its retries
      local ok, e = pcall(pool.apply, pool, function() os.exit(3) end)
      assert.is_false(ok)
      assert.are.equal(3, e.exit_code)
    end)

    it("workers SIGKILLed one after another: every retried task runs again, none is lost", function()
      -- Every 5th item kills its worker the first time it runs: items of
      -- dead workers are requeued while earlier requeued ones are being
      -- handed out again (the lists the pool pops from their head).
      local dir = os.tmpname()
      os.remove(dir)
      assert(os.execute("mkdir " .. dir))
      local pool = mp.Pool(2, { start_method = method, retries = 1 })
      local n = 60
      local list = {}
      for i = 1, n do list[i] = i end
      local ar = pool:map_async(function(x)
        local mark = dir .. "/" .. x
        if x % 5 == 0 and not exists(mark) then
          touch(mark)
          os.execute("kill -9 " .. tostring(mypid()))
          os.execute("sleep 5")
        end
        return x * 2
      end, list, 1)
      local r, why = ar:get(120)   -- the hang guard: a lost task never settles
      if r == nil then pool:terminate() else pool:close() pool:join() end
      os.execute("rm -rf " .. dir)
      assert.is_not_nil(r, why)
      assert.are.equal(n, r.n)
      for i = 1, n do assert.are.equal(i * 2, r[i]) end
    end)

    it("maxtasksperchild replaces workers; initializer and initargs", function()
      local prefix = "init:"
      local pool <close> = mp.Pool(1, {
        start_method = method, maxtasksperchild = 2,
        initializer = function(a, b) _G.POOL_STATE = prefix .. a .. b end,
        initargs = { "x", "y" },
      })
      local r = pool:map(function() return mypid() .. " " .. _G.POOL_STATE end,
                         { 1, 2, 3, 4, 5, 6 }, 1)
      local pids = {}
      for i = 1, 6 do
        local pid, state = r[i]:match("^(%d+) (.*)$")
        assert.are.equal("init:xy", state)
        pids[pid] = (pids[pid] or 0) + 1
      end
      local n = 0
      for _, count in pairs(pids) do n = n + 1; assert.are.equal(2, count) end
      assert.are.equal(3, n)
    end)

    it("an initializer that raises: the pool reports it, nothing is left", function()
      local ok, e = pcall(function()
        local pool <close> = mp.Pool(2, { start_method = method,
                                          initializer = function() error("no init") end })
        return pool:map(function(x) return x end, { 1, 2 })
      end)
      assert.is_false(ok)
      assert.matches("no init", tostring(e))
    end)

    it("close + join finish the submitted tasks; terminate fails the pending ones", function()
      local out = os.tmpname()
      os.remove(out)
      local pool = mp.Pool(2, { start_method = method })
      local ar = pool:apply_async(function(path)
        os.execute("sleep 0.2")
        touch(path)
        return "written"
      end, { out })
      pool:close()
      pool:join()
      assert.is_true(exists(out))
      assert.are.equal("written", ar:get())
      os.remove(out)
      local p2 = mp.Pool(2, { start_method = method })
      local slow = p2:apply_async(function() os.execute("sleep 30") end)
      p2:terminate()
      local ok, e = pcall(slow.get, slow)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessException))
      assert.matches("terminated", tostring(e))
      p2:join()
    end)

    it("<close>: a normal exit finishes the tasks, an error exit terminates", function()
      local out = os.tmpname()
      os.remove(out)
      do
        local pool <close> = mp.Pool(2, { start_method = method })
        pool:apply_async(function(path) os.execute("sleep 0.2"); touch(path) end, { out })
      end
      assert.is_true(exists(out))
      os.remove(out)
      local pidfile = os.tmpname()
      local ok = pcall(function()
        local pool <close> = mp.Pool(1, { start_method = method })
        pool:apply_async(function(path)
          local f = io.open(path, "w"); f:write(mypid()); f:close()
          os.execute("sleep 30")
        end, { pidfile })
        H.eventually(function() return #(H.read(pidfile) or "") > 0 end, 20)
        error("leaving")
      end)
      assert.is_false(ok)
      local pid = tonumber(H.read(pidfile))
      os.remove(pidfile)
      assert.is_false(H.alive(pid))
    end)

    it("results keep shared arrays the same memory", function()
      local a = mp.Array("int32", 4)
      local pool <close> = mp.Pool(1, { start_method = method })
      local back = pool:apply(function(arr) arr[1] = 7; return arr end, { a })
      assert.are.equal(7, a[1])
      back[2] = 9
      assert.are.equal(9, a[2])
    end)
  end)
end

describe("mp.Pool under the file_system sharing strategy:", function()
  H.leak_check(before_each, after_each, "file_system")

  for _, method in ipairs(H.methods) do
    it("arrays cross to tasks and back, and no segment is left (" .. method .. ")", function()
      local a = mp.Array("int64", 8)
      local pool <close> = mp.Pool(2, { start_method = method })
      local r = pool:map(function(x)
        x[1][x[2]] = x[2] * 10
        if x[2] == 3 then os.exit(9) end   -- a worker dies holding it
        return x[1]
      end, { { a, 1 }, { a, 2 }, { a, 3 }, { a, 4 } }, { outcomes = true })
      assert.are.same({ 10, 20, 30, 40 }, { a[1], a[2], a[3], a[4] })
      assert.are.equal(9, r[3].error.exit_code)
      r[4].value[5] = 55
      assert.are.equal(55, a[5])
    end)
  end
end)

-- A child interpreter running 'body' with a pool; its pid and its workers'
-- pids go to a file.  Returns the file's name.
local function pool_script(body, method)
  return H.script(("local mp = require 'multiprocessing'\n"
    .. "local pool <close> = mp.Pool(2, { start_method = %q })\n"
    .. "local pids = { io.open('/proc/self/stat'):read('a'):match('^%%d+') }\n"
    .. "for _, w in ipairs(pool.workers) do pids[#pids + 1] = w.pid end\n"
    .. "local pidfile = arg[1]\n"
    .. "local f = io.open(pidfile, 'w') f:write(table.concat(pids, ' ')) f:close()\n"
    .. body):format(method))
end

for _, method in ipairs(H.methods) do
  describe("mp.Pool, interrupted or killed, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("Ctrl-C in map terminates and reaps the workers and raises mp.Interrupted at the user's line", function()
      local pidfile = os.tmpname()
      local script = pool_script("local ok, e = pcall(pool.map, pool, function() os.execute('sleep 30') end, {1, 2})\n"
        .. "print('caught', e, #pool.workers)\n"
        .. "print('type', mp.isinstance(e, mp.Interrupted), e.kind, e.call, e.where)\n", method)
      local run = io.popen("lua5.4 " .. script .. " " .. pidfile .. " 2>&1")
      local pids = H.wait_pids(pidfile)
      os.execute("sleep 0.3; kill -INT " .. pids[1])
      local out = run:read("a")
      run:close()
      os.remove(script)
      os.remove(pidfile)
      assert.truthy(out:find("caught\tinterrupted: SIGINT during Pool.map; the pool was terminated, "
                             .. "its workers reaped", 1, true), out)
      assert.matches("type\ttrue\tinterrupt\tPool.map\t[^\n]*lua_%w+:8\n", out)
      assert.is_false(H.alive(pids[2]))
      assert.is_false(H.alive(pids[3]))
    end)

    it("Ctrl-C at the lua5.4 -i prompt (a pty): interrupted, then the prompt", function()
      local pidfile = os.tmpname()
      local input = os.tmpname()
      local f = assert(io.open(input, "w"))
      f:write(H.PATHS,
        "mp = require 'multiprocessing'\n",
        ("pool = mp.Pool(2, { start_method = %q })\n"):format(method),
        ("f = io.open(%q, 'w') f:write(io.open('/proc/self/stat'):read('a'):match('^%%d+'), ' ', "
         .. "pool.workers[1].pid, ' ', pool.workers[2].pid) f:close()\n"):format(pidfile),
        "pool:apply(function() os.execute('sleep 30') end)\n",
        "print('back at ' .. 'the prompt', pool.state)\n")
      f:close()
      -- script(1) gives the interpreter a terminal; the input is typed in
      local repl = io.popen(("(sleep 1; cat %s; while [ ! -e %s.sent ]; do sleep 0.1; done; sleep 1)"
                             .. " | timeout -s KILL 120 script -qfec 'lua5.4 -i' /dev/null 2>&1"):format(input, input))
      local pids = H.wait_pids(pidfile, 20)
      os.execute("sleep 0.5; kill -INT " .. pids[1])
      touch(input .. ".sent")
      local out = repl:read("a")
      repl:close()
      os.remove(pidfile)
      os.remove(input)
      os.remove(input .. ".sent")
      assert.truthy(out:find("interrupted: SIGINT during Pool.apply; the pool was terminated", 1, true), out)
      assert.truthy(out:find("back at the prompt\tterminate", 1, true), out)
      assert.is_false(H.alive(pids[2]))
      assert.is_false(H.alive(pids[3]))
    end)

    it("lua.c's 'interrupted!' between two waits, a traceback below it, terminates the pool", function()
      -- the REPL's message handler adds the traceback before the pool's
      -- guard sees the error; the hook fires where CI once saw it land, on
      -- the call of the engine's poll()
      local pool = mp.Pool(2, { start_method = method })
      local pids = { pool.workers[1].pid, pool.workers[2].pid }
      debug.sethook(function()
        if debug.getinfo(2, "n").name == "poll" then
          debug.sethook()
          error("interrupted!")
        end
      end, "c")
      local ok, e = xpcall(pool.apply, debug.traceback, pool, function()
        local t = os.time() + 30
        while os.time() < t do end
      end)
      debug.sethook()
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.Interrupted), tostring(e))
      assert.are.equal("Pool.apply", e.call)
      assert.are.equal("terminate", pool.state)
      assert.is_false(H.alive(pids[1]))
      assert.is_false(H.alive(pids[2]))
      pool:close()
    end)

    it("a parent SIGKILLed leaves no worker behind", function()
      local pidfile = os.tmpname()
      local script = pool_script("pool:map(function() os.execute('sleep 30') end, {1, 2})\n", method)
      local run = io.popen("lua5.4 " .. script .. " " .. pidfile .. " 2>&1")
      local pids = H.wait_pids(pidfile)
      os.execute("kill -9 " .. pids[1])
      run:read("a")
      run:close()
      os.remove(script)
      os.remove(pidfile)
      assert.is_true(H.eventually(function()
        return not H.alive(pids[2]) and not H.alive(pids[3])
      end, 10))
    end)
  end)
end

-- A storm of SIGKILLs, run in a child interpreter under timeout(1): the
-- hang guard.  Items kill their own worker the first time they run (a
-- marker file each), in map, imap, imap_unordered and apply_async + get,
-- with maxtasksperchild churning workers meanwhile.
local STORM = [[
local mp = require "multiprocessing"
local dir = arg[1]
local function mypid() return io.open("/proc/self/stat"):read("a"):match("^%%d+") end
local function task(x)
  local mark = dir .. "/" .. x
  if x %% 37 == 0 then
    local f = io.open(mark)
    if f then f:close() else
      io.open(mark, "w"):close()
      os.execute("kill -9 " .. mypid())
    end
  end
  return x * 2
end
local pool <close> = mp.Pool(4, { start_method = %q, retries = 1, maxtasksperchild = 50 })
local n = 2000
local list = {}
for i = 1, n do list[i] = i end
local r = pool:map(task, list, 3)
local bad = 0
for i = 1, n do if r[i] ~= i * 2 then bad = bad + 1 end end
print("map", r.n, bad)
list = {}
for i = 1, n do list[i] = n + i end
local seen, count = {}, 0
for i, v in pool:imap(task, list) do
  if v == (n + i) * 2 then count = count + 1 end
end
print("imap", count)
list = {}
for i = 1, n do list[i] = 2 * n + i end
count = 0
for i, v in pool:imap_unordered(task, list, 5) do
  if not seen[i] and v == (2 * n + i) * 2 then seen[i], count = true, count + 1 end
end
print("unordered", count)
local ars = {}
for i = 1, 400 do ars[i] = pool:apply_async(task, { 3 * n + i }) end
count = 0
for i = 1, 400 do if ars[i]:get() == (3 * n + i) * 2 then count = count + 1 end end
print("apply", count)
]]

for _, method in ipairs(H.methods) do
  describe("mp.Pool in a storm of SIGKILLs, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("map, imap, imap_unordered and apply_async finish with every result", function()
      local dir = os.tmpname()
      os.remove(dir)
      assert(os.execute("mkdir " .. dir))
      local script = H.script(STORM:format(method))
      local run = io.popen(("timeout -s KILL 240 lua5.4 %s %s 2>&1; echo rc=$?"):format(script, dir))
      local out = run:read("a")
      run:close()
      os.remove(script)
      os.execute("rm -rf " .. dir)
      assert.truthy(out:find("map\t2000\t0\n", 1, true), out)
      assert.truthy(out:find("imap\t2000\n", 1, true), out)
      assert.truthy(out:find("unordered\t2000\n", 1, true), out)
      assert.truthy(out:find("apply\t400\n", 1, true), out)
      assert.truthy(out:find("rc=0\n", 1, true), out)
    end)
  end)
end

describe("mp.Pool at scale:", function()
  H.leak_check(before_each, after_each)

  it("Pool(256) runs tasks on all of its workers", function()
    local pool <close> = mp.Pool(256, { start_method = "fork" })
    local list = {}
    for i = 1, 1024 do list[i] = i end
    local r = pool:map(function(x) return x + 1 end, list, 1)
    assert.are.equal(1024, r.n)
    assert.are.equal(1025, r[1024])
    assert.are.equal(256, #pool.workers)
  end)

  it("big tasks with big results do not deadlock the parent against its workers", function()
    -- items and results far bigger than the pool's queues: a parent that
    -- waited on the task queue while every worker waited to post a result
    -- would wait for ever (run apart, under a timeout, so that a hang fails)
    for _, method in ipairs(H.methods) do
      for _, n in ipairs { 1, 2 } do
        local script = H.script(([[
local mp = require "multiprocessing"
local pool <close> = mp.Pool(%d, { start_method = %q })
local list = {}
for i = 1, 8 do list[i] = ("x"):rep(1 << 20) .. i end
local r = pool:map(function(s) return s .. s end, list, 1)
local ars = {}
for i = 1, 8 do ars[i] = pool:apply_async(function(s) return s:rep(3) end, { list[i] }) end
local ok = r.n == 8
for i = 1, 8 do ok = ok and r[i] == list[i] .. list[i] and ars[i]:get() == list[i]:rep(3) end
print(ok and "done" or "wrong")
]]):format(n, method))
        local out = H.sh("timeout -s KILL 120 lua5.4 " .. script .. " 2>&1")
        os.remove(script)
        assert.are.equal("done\n", out, method .. " Pool(" .. n .. ")")
      end
    end
  end)

  it("1,000,000 trivial tasks through imap_unordered with flat parent memory", function()
    local pool <close> = mp.Pool(2, { start_method = "fork" })
    local n = 1000000
    local list = {}
    for i = 1, n do list[i] = i end
    collectgarbage()
    local base = collectgarbage("count")
    local peak, count, sum = 0, 0, 0
    for i, r in pool:imap_unordered(function(x) return x end, list) do
      assert(i == r)
      count, sum = count + 1, sum + r
      if count % 100000 == 0 then
        collectgarbage()
        peak = math.max(peak, collectgarbage("count") - base)
      end
    end
    assert.are.equal(n, count)
    assert.are.equal(n * (n + 1) // 2, sum)
    assert.is_true(peak < 32 * 1024, ("parent grew by %.0f KiB"):format(peak))
  end)

  it("progress = true prints nothing when stderr is not a terminal", function()
    local err = os.tmpname()
    local script = H.script("local mp = require 'multiprocessing'\n"
      .. "local pool <close> = mp.Pool(2, { start_method = 'fork', progress = true })\n"
      .. "local r = pool:map(function(x) return x end, {1, 2, 3})\n"
      .. "print(r.n)\n")
    local out = H.sh("lua5.4 " .. script .. " 2>" .. err)
    assert.are.equal("3\n", out)
    assert.are.equal("", H.read(err))
    -- on a terminal: done/total, rate, failures and ETA
    local tty = H.sh("timeout -s KILL 120 script -qfec 'lua5.4 " .. script .. "' /dev/null")
    os.remove(script)
    os.remove(err)
    assert.matches("3/3 done", tty)
    assert.matches("tasks/s", tty)
    assert.matches("0 failed", tty)
    assert.matches("ETA", tty)
  end)

  it("progress = function(done, total, failed); mp.print and pool:print erase and redraw the line", function()
    local pool <close> = mp.Pool(2, { start_method = "fork", progress = function(done, total, failed)
      _G.seen = _G.seen or {}
      _G.seen[#_G.seen + 1] = { done, total, failed }
    end })
    local r = pool:map(function(x) if x == 3 then error("three") end return x end, { 1, 2, 3, 4 },
                       { outcomes = true, chunksize = 1 })
    assert.are.equal(4, r.n)
    local last = _G.seen[#_G.seen]
    assert.are.same({ 4, 4, 1 }, last)
    _G.seen = nil
    -- on a terminal: the printed text sits on its own line, the progress
    -- line is erased before it and drawn again after it
    local script = H.script("local mp = require 'multiprocessing'\n"
      .. "local pool <close> = mp.Pool(2, { start_method = 'fork', progress = true })\n"
      .. "local r = pool:map(function(x) os.execute('sleep 0.15') return x end, {1, 2, 3, 4, 5, 6}, 1)\n"
      .. "pool:print('after', r.n)\n"
      .. "for i, v in pool:imap(function(x) os.execute('sleep 0.15') return x end, {1, 2, 3, 4}) do\n"
      .. "  if i == 2 then mp.print('middle', v) end\n"
      .. "end\n")
    local tty = H.sh("timeout -s KILL 120 script -qfec 'lua5.4 " .. script .. "' /dev/null")
    os.remove(script)
    assert.truthy(tty:find("\nafter\t6\r?\n", 1), tty)
    -- erased, printed, redrawn
    assert.truthy(tty:find("\r\27%[Kmiddle\t2\r?\n\r%d/4 done"), tty)
  end)
end)

-- Issue 20 item 5: a worker costs the parent one descriptor (its pidfd in
-- the pool's one context); the queues and the board are the pool's.
for _, method in ipairs(H.methods) do
  describe("mp.Pool's descriptors, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    -- our open descriptors, counted by ls through os.execute
    local function nfds()
      local out = os.tmpname()
      assert(os.execute(("ls /proc/%d/fd | wc -l > %s"):format(H.pid(), out)))
      local n = tonumber(H.read(out):match("%d+"))
      os.remove(out)
      return n
    end

    it("Pool(16) costs the parent at most 3 descriptors a worker, its own ones included", function()
      local warm = mp.Pool(1, { start_method = method })   -- a forkserver runs
      warm:close()
      warm:join()
      local before = nfds()
      local pool = mp.Pool(16, { start_method = method })
      assert.are.equal(32, #pool:map(function(x) return x end, (function()
        local t = {}
        for i = 1, 32 do t[i] = i end
        return t
      end)(), 1))
      local used = nfds() - before
      pool:close()
      pool:join()
      assert.is_true(used <= 3 * 16, ("%d descriptors for 16 workers"):format(used))
      assert.are.equal(before, nfds())
    end)

    it("Pool(256) starts and maps under ulimit -n 1024 (soft and hard)", function()
      local script = H.script(([[
local mp = require "multiprocessing"
local pool = mp.Pool(256, { start_method = %q })
local list = {}
for i = 1, 1024 do list[i] = i end
local r = pool:map(function(x) return x * 2 end, list)
local bad = 0
for i = 1, 1024 do if r[i] ~= i * 2 then bad = bad + 1 end end
print("mapped", r.n, bad)
pool:close()
pool:join()
print("joined")
]]):format(method))
      local out = H.sh(("sh -c 'ulimit -n 1024; timeout -s KILL 600 lua5.4 %s' 2>&1; echo rc=$?")
                       :format(script))
      os.remove(script)
      assert.truthy(out:find("mapped\t1024\t0\njoined\nrc=0\n", 1, true), out)
    end)
  end)
end
