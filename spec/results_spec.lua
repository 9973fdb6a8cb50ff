-- Results and error values that carry descriptors (shared arrays under
-- file_descriptor, queues): they come back through the context's socket
-- beside the report file, and arrive as the same memory / the same queue,
-- under every start method and both sharing strategies.  Nothing may be
-- left open, running or in /dev/shm.
local mp = require "multiprocessing"
local H = require "helpers"

for _, method in ipairs(H.methods) do
  for _, strategy in ipairs(H.STRATEGIES) do
    describe(("results, %s, %s:"):format(method, strategy), function()
      H.leak_check(before_each, after_each, strategy)

      it("an argument returned is the same memory", function()
        local a <close> = mp.Array("int32", 4)
        local results = mp.start_processes(function(_, arr)
          arr[1] = 7
          return arr
        end, { a }, 1, true, false, method)
        local r <close> = results[1]
        assert.is_true(r:is_shared())
        assert.are.equal(7, r[1])
        assert.are.equal(7, a[1])
        r[2] = 5                      -- through the result ...
        assert.are.equal(5, a[2])     -- ... seen through the argument
        a[3] = 9
        assert.are.equal(9, r[3])
      end)

      it("an array the worker made is shared memory in the parent", function()
        local results = mp.start_processes(function(i, s)
          mp.set_sharing_strategy(s)
          local own = mp.Array("int64", { 10 + i, 20 + i })
          local v = mp.Value("double", 1.5)
          return { own = own, v = v }
        end, { strategy }, 2, true, false, method)
        for rank = 0, 1 do
          local r = results[rank + 1]
          assert.is_true(r.own:is_shared())
          assert.matches(strategy, tostring(r.own))
          assert.are.same({ 10 + rank, 20 + rank }, r.own:totable())
          r.own[1] = 99
          assert.are.equal(99, r.own[1])
          assert.are.equal(1.5, r.v.value)
          r.own:close()
          r.v:close()
        end
      end)

      it("the same array returned by every worker is one memory", function()
        local a <close> = mp.Array("int32", 3)
        local results = mp.start_processes(function(i, arr)
          arr[i + 1] = i + 1
          return arr
        end, { a }, 3, true, false, method)
        for rank = 1, 3 do
          assert.are.same({ 1, 2, 3 }, results[rank]:totable())
        end
        results[1][1] = 42
        assert.are.equal(42, results[3][1])
        assert.are.equal(42, a[1])
        for rank = 1, 3 do results[rank]:close() end
      end)

      it("a returned queue works in the parent", function()
        local results = mp.start_processes(function()
          local q = mp.Queue()
          q:put("from the worker")
          return q
        end, {}, 1, true, false, method)
        local q <close> = results[1]
        assert.are.equal("from the worker", q:get(10))
        q:put({ 1, 2 })
        assert.are.same({ 1, 2 }, q:get(10))
      end)

      it("an error value carrying an array arrives as the same memory", function()
        local a <close> = mp.Array("int32", 1)
        local ok, e = pcall(mp.start_processes, function(_, arr)
          arr[1] = 3
          error({ array = arr, own = mp.Array("uint8", { 8 }) })
        end, { a }, 1, true, false, method)
        assert.is_false(ok)
        assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
        local got = e.value.array
        assert.are.equal(3, got[1])
        got[1] = 4
        assert.are.equal(4, a[1])
        assert.are.equal(8, e.value.own[1])
        got:close()
        e.value.own:close()
      end)
    end)
  end
end

describe("results with descriptors", function()
  H.leak_check(before_each, after_each)

  it("come back from many workers, more than one message's worth each", function()
    local results = mp.start_processes(function(i)
      local list = {}
      for k = 1, 300 do list[k] = mp.Array("int32", { i * 1000 + k }) end
      return list
    end, {}, 3, true, false, "fork")
    for rank = 0, 2 do
      local list = results[rank + 1]
      assert.are.equal(300, #list)
      assert.are.equal(rank * 1000 + 1, list[1][1])
      assert.are.equal(rank * 1000 + 300, list[300][1])
      for _, arr in ipairs(list) do arr:close() end
    end
  end)

  it("are closed with the context when nobody takes them", function()
    local ctx = mp.start_processes(function()
      error({ q = mp.Queue() })
    end, {}, 1, false, false, "spawn")
    assert.has_error(function() ctx:join(10) end)
    ctx:close()
  end)
end)

-- Issue 8, defect 9: shared memory the workers of a context returned is
-- given back when the context ends without anybody taking it -- not when
-- the parent exits.  The checks run before any collection: the context's
-- end frees it, not the garbage collector.
for _, method in ipairs(H.methods) do
  for _, strategy in ipairs(H.STRATEGIES) do
    describe(("results nobody takes, %s, %s:"):format(method, strategy), function()
      H.leak_check(before_each, after_each, strategy)

      local function make_array(_, s)
        local m = require "multiprocessing"
        m.set_sharing_strategy(s)
        return { a = m.Array("int32", 4), v = m.Value("double", 2) }
      end

      local function wait_exit(p)
        assert.is_truthy(H.eventually(function() return not p:is_alive() end, 30))
      end

      it("closed before results(): the arrays are freed at close", function()
        local shm, fds = H.shm(), H.fds()
        local ctx = mp.start_processes(make_array, { strategy }, 2, false,
                                       false, method)
        for _, p in ipairs(ctx.processes) do wait_exit(p) end
        ctx:close()
        assert.are.same(shm, H.shm())
        assert.are.same(fds, H.fds())
      end)

      it("a context that failed: the other workers' arrays are freed", function()
        local shm, fds = H.shm(), H.fds()
        local go = os.tmpname()
        os.remove(go)
        local ctx = mp.start_processes(function(i, s, path)
          if i == 0 then return make_array(i, s) end
          -- fails only once rank 0 has returned (the parent says so)
          for _ = 1, 3000 do
            local f = io.open(path)
            if f then f:close() break end
            os.execute("sleep 0.01")
          end
          error("rank 1 fails after rank 0 returned")
        end, { strategy, go }, 2, false, false, method)
        wait_exit(ctx.processes[1])
        io.open(go, "w"):close()
        local ok, e = pcall(ctx.join, ctx)
        os.remove(go)
        assert.is_false(ok)
        assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
        assert.are.equal(1, e.error_index)
        assert.are.same(shm, H.shm())
        assert.are.same(fds, H.fds())
      end)
    end)
  end
end

-- Issue 8, defects 11 and 14: what the parent cannot receive.
for _, method in ipairs(H.methods) do
  describe(("results and error values that cannot cross, %s:"):format(method), function()
    H.leak_check(before_each, after_each)

    local function start(fn, n, join)
      return mp.start_processes(fn, {}, n or 1, join, false, method)
    end

    -- a module only the worker has: its function goes as a module
    -- reference, which the parent cannot resolve
    local function worker_only(i)
      package.preload["results_spec_worker_only"] = function()
        return { f = function() end }
      end
      if i == 0 then return require("results_spec_worker_only").f end
    end

    it("an undecodable result raises a ProcessException naming the process", function()
      local ctx = start(worker_only, 2, false)
      local ok, e = pcall(ctx.join, ctx)
      assert.is_false(ok)
      assert.are.equal("userdata", type(e))
      assert.is_true(mp.isinstance(e, mp.ProcessException))
      assert.are.equal(0, e.error_index)
      assert.are.equal(ctx.processes[1].pid, e.pid)
      assert.are.equal(ctx.processes[1].pid, e.error_pid)
      assert.matches("process 0 %(pid %d+%)", e.msg)
      assert.matches("result", e.msg)
      assert.matches("results_spec_worker_only", e.msg)
      assert.are.equal("ProcessException: " .. e.msg, tostring(e))  -- its type first
      assert.are.equal("result", e.kind)
      -- the same exception again, from join and results
      local ok2, e2 = pcall(ctx.join, ctx)
      assert.is_false(ok2)
      assert.are.equal(e, e2)
      local ok3, e3 = pcall(ctx.results, ctx)
      assert.is_false(ok3)
      assert.are.equal(e, e3)
    end)

    it("start_processes with join raises it too", function()
      local ok, e = pcall(start, worker_only, 1, true)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessException))
      assert.are.equal(0, e.error_index)
    end)

    it("error({code = 1, f = function() end}) keeps code and describes f", function()
      local ok, e = pcall(start, function()
        error({ code = 1, f = function() end, nested = { t = coroutine.create(print),
                                                           u = io.stdout, 7 } })
      end, 1, true)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      assert.are.equal("table", type(e.value))
      assert.are.equal(1, e.value.code)
      assert.are.equal("<function>", e.value.f)
      assert.are.equal("<thread>", e.value.nested.t)
      assert.are.equal("<userdata>", e.value.nested.u)
      assert.are.equal(7, e.value.nested[1])
    end)

    it("an error value's fields cross even when its class cannot", function()
      local ok, e = pcall(start, function()
        local Err = { __tostring = function(self) return "Err " .. self.code end }
        error(setmetatable({ code = 2, why = "bad" }, Err))
      end, 1, true)
      assert.is_false(ok)
      assert.are.same({ code = 2, why = "bad" }, e.value)
      assert.matches("Err 2", e.msg)
    end)

    it("a function error value is described", function()
      local ok, e = pcall(start, function() error(print) end, 1, true)
      assert.is_false(ok)
      assert.are.equal(print, e.value)   -- a module function still crosses
      ok, e = pcall(start, function() error(function() end) end, 1, true)
      assert.is_false(ok)
      assert.are.equal("<function>", e.value)
    end)

    it("a result keeps refusing what cannot cross", function()
      local ok, e = pcall(start, function() return { f = function() end } end, 1, true)
      assert.is_false(ok)
      assert.matches("cannot send result.f %(function%)", e.msg)
    end)
  end)
end
