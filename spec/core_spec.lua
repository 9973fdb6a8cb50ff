-- The core runtime: start_processes / spawn, ProcessContext, exceptions,
-- termination and cleanup.  Every spec runs under each start method.
local mp = require "multiprocessing"
local H = require "helpers"


local function sleep_forever()
  os.execute("sleep 30")
end

for _, method in ipairs(H.methods) do
  describe("start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function start(fn, args, n, join, daemon)
      return mp.start_processes(fn, args, n, join, daemon, method)
    end

    it("runs fn in every worker and returns after all exited 0", function()
      local results = start(function() end, {}, 3)
      assert.are.equal(3, results.n)
    end)

    it("passes the rank first, then the args, 0-based like torch", function()
      local results = start(function(i, a, b) return { i, a, b } end,
                            { "x", 42 }, 2)
      assert.are.same({ { 0, "x", 42 }, { 1, "x", 42 }, n = 2 }, results)
    end)

    -- a fork's identity table is made by its parent (a child that made
    -- it would fault in pages of the parent's heap): each worker has its own
    it("runs fn with the collector as the parent had it, and its identity", function()
      local function probe(rank)
        local garbage = {}
        for k = 1, 2000 do garbage[k] = { k } end   -- a collection may run
        local me = mp.current_process()
        return { collectgarbage("isrunning"), me.rank == rank, me.daemon,
                 #garbage }
      end
      assert.are.same({ { true, true, false, 2000 }, { true, true, false, 2000 }, n = 2 },
                      start(probe, {}, 2))
      assert.are.same({ true, true, true, 2000 }, start(probe, {}, 1, true, true)[1])
      collectgarbage("stop")
      local ok, r = pcall(start, probe, {}, 1)
      local parent_running = collectgarbage("isrunning")
      collectgarbage("restart")
      assert.is_true(ok, r)
      assert.is_false(parent_running)   -- a start does not collect for it
      -- a fork has the parent's collector; spawn and forkserver their own
      assert.are.same({ method ~= "fork", true, false, 2000 }, r[1])
      assert.is_true(collectgarbage("isrunning"))
      -- nested: a worker that starts workers keeps its own identity
      local nested = start(function(rank)
        local inner = mp.start_processes(function(i) return mp.current_process().rank * 10 + i end,
                                         {}, 2, true, false, "fork")
        return { rank, mp.current_process().rank, inner[1], inner[2] }
      end, {}, 2)
      assert.are.same({ { 0, 0, 0, 11 }, { 1, 1, 0, 11 }, n = 2 }, nested)
    end)

    -- glibc merges every small freed chunk it holds at the first larger
    -- request (malloc_consolidate): in a fork, a write beside each, on
    -- pages the parent shares -- about a thousand page faults here for one string,
    -- unless the parent merged them before it forked (sys.h)
    if method == "fork" then
      it("leaves a worker's first large allocation no copy of the parent's free lists", function()
        local keep = {}
        for k = 1, 40000 do keep[k] = { k } end
        for k = 1, 40000, 2 do keep[k] = false end   -- 20000 small holes
        collectgarbage()
        collectgarbage()
        local r = start(function()
          local function minflt()   -- field 10 of /proc/self/stat
            local f = assert(io.open("/proc/self/stat"))
            local s = f:read("a")
            f:close()
            return tonumber(s:match("%) %S+" .. (" %S+"):rep(6) .. " (%d+)"))
          end
          collectgarbage("stop")    -- a step would write pages of its own
          local before = minflt()
          local s = ("x"):rep(4000)   -- past malloc's small sizes
          return { minflt() - before, #s }
        end, {}, 1)
        assert.are.equal(4000, r[1][2])
        assert.is_true(r[1][1] < 200, "page faults: " .. r[1][1])
        assert.are.equal(40000, #keep)
      end)
    end

    it("honours args.n so trailing nils are passed", function()
      local results = start(function(_, a, b, c)
        return select("#", a, b, c) .. tostring(b)
      end, { n = 3, 1 }, 1)
      assert.are.equal("3nil", results[1])
    end)

    it("returns a context with join=false, and join is repeatable", function()
      local ctx = start(function() end, {}, 2, false)
      assert.is_true(mp.isinstance(ctx, mp.ProcessContext))
      assert.are.equal(2, #ctx:pids())
      assert.is_true(ctx:join())
      assert.is_true(ctx:join())
      assert.are.equal(0, ctx.processes[1].exitcode)
      assert.are.equal(0, ctx.processes[2].exitcode)
      assert.is_false(ctx.processes[1]:is_alive())
    end)

    it("gives per-rank process objects with pid and exitcode", function()
      local ctx = start(function(i) if i == 1 then os.execute("sleep 0.3") end end,
                        {}, 2, false)
      local p = ctx.processes[2]
      assert.are.equal(ctx:pids()[2], p.pid)
      assert.is_nil(p.exitcode)
      assert.is_true(p:is_alive())
      assert.is_true(ctx:join())
      assert.are.equal(0, p.exitcode)
    end)

    it("raises ProcessRaisedException with the worker's traceback", function()
      local ok, e = pcall(start, function(i)
        if i == 1 then error("boom in worker") end
      end, {}, 2)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      assert.is_true(mp.isinstance(e, mp.ProcessException))
      assert.is_false(mp.isinstance(e, mp.ProcessExitedException))
      assert.are.equal(1, e.error_index)
      assert.are.equal(e.error_pid, e.pid)
      assert.are.equal("ProcessRaisedException: " .. e.msg, tostring(e))
      local head = "\n\n-- Process 1 terminated with the following error:\n"
      assert.are.equal(head, e.msg:sub(1, #head))
      assert.truthy(e.msg:find("stack traceback", 1, true))
      assert.are.equal("boom in worker", e.msg:sub(-#"boom in worker"))
      assert.truthy(e.msg:find("core_spec.lua:%d+: boom in worker$"))
    end)

    it("raises for an exception in every worker and keeps the others", function()
      local ok, e = pcall(start, function(i) error("fail " .. i) end, {}, 3)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      local seen = { [e.error_index] = true }
      for _, f in ipairs(e.failures) do
        assert.is_true(mp.isinstance(f, mp.ProcessRaisedException))
        assert.truthy(f.msg:find("fail " .. f.error_index .. "$"))
        seen[f.error_index] = true
      end
      assert.truthy(e.msg:find("fail " .. e.error_index .. "$"))
      -- the others either failed on their own (in failures) or were terminated
      assert.is_true(#e.failures <= 2)
    end)

    it("keeps every failure in e.failures when the grace lets them all fail", function()
      local ctx = start(function(i)
        os.execute("sleep 0.1")
        error("fail " .. i)
      end, {}, 3, false)
      local ok, e = pcall(ctx.join, ctx, nil, 10)
      assert.is_false(ok)
      assert.are.equal(2, #e.failures)
      local ranks = { [e.error_index] = true }
      for _, f in ipairs(e.failures) do ranks[f.error_index] = true end
      assert.are.same({ [0] = true, true, true }, ranks)
    end)

    -- only a fork inherits its parent's contexts (spawn refuses to send one)
    if method == "fork" then
    it("a worker that closes an inherited context harms none of its workers", function()
      local other = start(function() os.execute("sleep 0.5") end, {}, 2, false)
      local pids = other:pids()
      local results = start(function(_, ctx)
        ctx:close()
        return (pcall(ctx.join, ctx))
      end, { other }, 1)
      assert.is_false(results[1])
      for _, pid in ipairs(pids) do assert.is_true(H.alive(pid)) end
      assert.is_true(other:join())
    end)
    end

    it("reports a worker killed by SIGABRT", function()
      local ok, e = pcall(start, function()
        os.execute("kill -ABRT $PPID; sleep 5")
      end, {}, 1)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessExitedException))
      assert.are.equal("process 0 terminated with signal SIGABRT", e.msg)
      assert.are.equal(-6, e.exit_code)
      assert.are.equal("SIGABRT", e.signal_name)
    end)

    it("reports exit(123) and leaves nothing alive", function()
      local ctx = start(function(i)
        if i == 1 then os.exit(123) end
        sleep_forever()
      end, {}, 2, false)
      local pids = ctx:pids()
      local ok, e = pcall(ctx.join, ctx)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessExitedException))
      assert.are.equal("process 1 terminated with exit code 123", e.msg)
      assert.are.equal(123, e.exit_code)
      assert.is_nil(e.signal_name)
      assert.are.same({}, e.failures)
      for _, pid in ipairs(pids) do assert.is_false(H.alive(pid)) end
      -- join keeps raising the same failure
      local ok2, e2 = pcall(ctx.join, ctx)
      assert.is_false(ok2)
      assert.are.equal(e, e2)
    end)

    it("raises for an exception after another worker succeeded", function()
      local ok, e = pcall(start, function(i)
        if i == 1 then
          os.execute("sleep 0.2")
          error("late failure")
        end
      end, {}, 2)
      assert.is_false(ok)
      assert.are.equal(1, e.error_index)
      assert.truthy(e.msg:find("late failure$"))
    end)

    it("reports a worker terminated by an outside SIGTERM", function()
      local ctx = start(sleep_forever, {}, 2, false)
      os.execute("kill -TERM " .. ctx:pids()[1])
      local ok, e = pcall(ctx.join, ctx)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessExitedException))
      assert.are.equal("process 0 terminated with signal SIGTERM", e.msg)
      assert.are.equal(-15, e.exit_code)
    end)

    it("waits grace_period for the others before terminating them", function()
      local ctx = start(function(i)
        if i == 0 then error("first") end
        os.execute("sleep 0.3")
      end, {}, 2, false)
      local ok, e = pcall(ctx.join, ctx, nil, 10)
      assert.is_false(ok)
      assert.are.equal(0, e.error_index)
      assert.are.equal(0, ctx.processes[2].exitcode)
    end)

    it("terminates the others at once without a grace_period", function()
      local ctx = start(function(i)
        if i == 0 then error("first") end
        sleep_forever()
      end, {}, 2, false)
      local ok = pcall(ctx.join, ctx)
      assert.is_false(ok)
      assert.are.equal(-15, ctx.processes[2].exitcode)
    end)

    it("kills the workers' children with them", function()
      local file = os.tmpname()
      local ok = pcall(start, function()
        os.execute("sleep 30 & echo $! > " .. file)
        error("leaving a grandchild behind")
      end, {}, 1)
      assert.is_false(ok)
      local pid = tonumber(H.read(file))
      os.remove(file)
      assert.is_truthy(pid)
      assert.is_true(H.eventually(function() return not H.alive(pid) end, 2))
    end)

    it("returns false when join times out, then true", function()
      local ctx = start(function() os.execute("sleep 0.3") end, {}, 2, false)
      assert.is_false(ctx:join(0.01))
      assert.is_false(ctx:join(0))
      assert.is_true(ctx:join(10))
    end)

    it("terminates and reaps on close of a to-be-closed context", function()
      local pids
      do
        local ctx <close> = start(sleep_forever, {}, 2, false)
        pids = ctx:pids()
        assert.is_true(H.alive(pids[1]))
      end
      for _, pid in ipairs(pids) do assert.is_false(H.alive(pid)) end
    end)

    it("has no results when it was closed before its workers finished", function()
      local ctx = start(sleep_forever, {}, 1, false)
      ctx:close(0)
      local ok, err = pcall(ctx.results, ctx)
      assert.is_false(ok)
      assert.truthy(err:find("closed before its workers finished", 1, true), err)
    end)

    it("terminates and reaps when a context is collected", function()
      local pids = start(sleep_forever, {}, 2, false):pids()
      collectgarbage()
      collectgarbage()
      for _, pid in ipairs(pids) do assert.is_false(H.alive(pid)) end
    end)

    it("sends a structured error value back in e.value", function()
      local ok, e = pcall(start, function()
        error({ code = 42, reason = "disk full" })
      end, {}, 1)
      assert.is_false(ok)
      assert.are.same({ code = 42, reason = "disk full" }, e.value)
      assert.truthy(e.msg:find("(error object is a table value)", 1, true))
    end)

    it("uses __tostring of an error value, even one that fails", function()
      local ok, e = pcall(start, function(i)
        local mt = { __tostring = i == 0 and function() return "custom text" end
                                      or function() error("broken tostring") end }
        error(setmetatable({}, mt))
      end, {}, 2)
      assert.is_false(ok)
      local all = { e, table.unpack(e.failures) }
      for _, x in ipairs(all) do
        if x.error_index == 0 then
          assert.truthy(x.msg:find("custom text$"))
        else
          assert.truthy(x.msg:find("__tostring failed", 1, true))
        end
      end
    end)

    it("caps a huge error report with a visible marker", function()
      local ok, e = pcall(start, function()
        error(string.rep("x", 8 * 1024 * 1024) .. "END")
      end, {}, 1)
      assert.is_false(ok)
      assert.truthy(#e.msg < 2 * 1024 * 1024)
      assert.truthy(e.msg:find("bytes of this error report omitted", 1, true))
      assert.are.equal("END", e.msg:sub(-3))
    end)

    it("does not print output buffered before the start twice", function()
      local out = H.run_child(([[
        local mp = require "multiprocessing"
        io.write("before;")
        mp.start_processes(function() io.write("worker;") end, {}, 2, true, false, %q)
        io.write("after")
      ]]):format(method)):wait()
      assert.are.equal("before;worker;worker;after", out)
    end)

    it("takes the workers and their children down when the parent is SIGKILLed", function()
      local child = H.run_child(([[
        local mp = require "multiprocessing"
        local ctx = mp.start_processes(function() os.execute("sleep 30") end, {}, 2, false, false, %q)
        -- each worker has started its shell, and the shell its sleep
        for _, pid in ipairs(ctx:pids()) do
          local function child(p)
            local f = io.open("/proc/" .. p .. "/task/" .. p .. "/children")
            return f and f:read("a"):match("%%d+")
          end
          repeat until child(pid) and child(child(pid))
        end
        announce(ctx:pids())
        ctx:join()
      ]]):format(method), { stderr = false })
      local list = child:pids()
      assert.are.equal(3, #list)
      child:kill("KILL")
      child:wait()
      for i = 2, 3 do
        assert.is_true(H.eventually(function() return not H.alive(list[i]) end, 2))
        -- nothing left in the worker's process group: no orphaned sleep
        assert.is_true(H.eventually(function() return #H.group(list[i]) == 0 end, 2),
                       "children of worker " .. list[i] .. " left")
      end
    end)

    it("kills and reaps the started workers when a start fails midway", function()
      -- few enough descriptors that the 64 workers cannot all get a pidfd
      local out = H.run_child(([[
        local mp = require "multiprocessing"
        local core = require "multiprocessing.core"
        local ok, err = pcall(mp.start_processes, function() os.execute("sleep 30") end,
                              {}, 64, true, false, %q)
        local me = io.open("/proc/self/stat"):read("a"):match("^%%d+")
        local server = core._forkserver_info and core._forkserver_info()
        local left = 0
        for pid in io.open("/proc/" .. me .. "/task/" .. me .. "/children"):read("a"):gmatch("%%d+") do
          if not (server and tonumber(pid) == server.pid) then left = left + 1 end
        end
        print(ok, err)
        print("children left: " .. left)
      ]]):format(method), { command = "ulimit -n 40; lua5.4 %s" }):wait()
      assert.truthy(out:find("false\tcannot start 64 processes with start method \"" ..
                             method .. "\" %(%d+ started, now terminated%): "), out)
      assert.truthy(out:find("Too many open files", 1, true), out)
      assert.truthy(out:find("children left: 0", 1, true), out)
    end)

    it("terminates the workers on Ctrl-C during join", function()
      local child = H.run_child(([[
        local mp = require "multiprocessing"
        local ctx = mp.start_processes(function() os.execute("sleep 30") end, {}, 2, false, false, %q)
        announce(ctx:pids())
        local ok, err = pcall(ctx.join, ctx)
        print(ok, err, err.kind, err.call, mp.isinstance(err, mp.Interrupted))
        print("again", select(2, pcall(ctx.join, ctx)) == err)
        print(ctx.processes[1].exitcode, ctx.processes[2].exitcode)
      ]]):format(method))
      local list = child:pids()
      child:kill("INT")
      local out = child:wait()
      assert.truthy(out:find("false\tinterrupted: SIGINT during ProcessContext.join; every worker "
                             .. "was terminated and reaped\tinterrupt\tProcessContext.join\ttrue\n", 1, true), out)
      assert.truthy(out:find("again\ttrue", 1, true), out)
      assert.truthy(out:find("-15\t-15", 1, true), out)
      assert.is_false(H.alive(list[2]))
      assert.is_false(H.alive(list[3]))
    end)
  end)
end

describe("bad arguments", function()
  H.leak_check(before_each, after_each)

  local function f() end
  local cases = {
    { "fn not a function", { 42 }, "bad argument #1 to '[%w.]*start_processes' %(function expected, got number%)" },
    { "args not a table", { f, "x" }, "bad argument #2 to '[%w.]*start_processes' %(table expected, got string%)" },
    { "nprocs zero", { f, {}, 0 }, "bad argument #3 to '[%w.]*start_processes' %(positive integer expected, got 0%)" },
    { "nprocs negative", { f, {}, -2 }, "bad argument #3 .*positive integer expected, got %-2" },
    { "nprocs fractional", { f, {}, 1.5 }, "bad argument #3 .*positive integer expected, got 1.5" },
    { "nprocs a string", { f, {}, "2" }, "bad argument #3 .*positive integer expected, got string" },
    { "join not a boolean", { f, {}, 1, "yes" }, "bad argument #4 .*boolean expected, got string" },
    { "daemon not a boolean", { f, {}, 1, true, 1 }, "bad argument #5 .*boolean expected, got number" },
    { "unknown start method", { f, {}, 1, true, false, "thread" },
      "bad argument #6 to '[%w.]*start_processes' %(unknown start method 'thread'" },
  }
  for _, case in ipairs(cases) do
    it("rejects " .. case[1] .. " before starting anything", function()
      local ok, err = pcall(mp.start_processes, table.unpack(case[2], 1, 6))
      assert.is_false(ok)
      assert.truthy(tostring(err):find(case[3]), err)
      assert.are.same({}, H.children())
    end)
  end

  it("takes a negative join timeout as 0 and rejects a non-number", function()
    local ctx = mp.start_processes(f, {}, 1, false, false, "fork")
    local ok, err = pcall(function() return ctx:join(-1) end)
    assert.is_true(ok, err)
    assert.is_boolean(err)
    ok, err = pcall(function() return ctx:join("soon") end)
    assert.is_false(ok)
    assert.truthy(err:find("bad argument #1 to 'ProcessContext.join' %(number of seconds expected, got string%)"), err)
    ok, err = pcall(function() return ctx:join(0 / 0) end)
    assert.is_false(ok)
    assert.truthy(err:find("timeout is NaN"), err)
    ok, err = pcall(function() return ctx:join(1, -2) end)
    assert.is_false(ok)
    assert.truthy(err:find("bad argument #2 to 'ProcessContext.join' %(grace_period must be"), err)
    assert.is_true(ctx:join())
  end)
end)

describe("exceptions", function()
  it("isinstance answers for any value", function()
    for _, v in ipairs({ "str", 1, true, {}, print, io.stdout }) do
      assert.is_false(mp.isinstance(v, mp.ProcessException))
    end
    assert.is_false(mp.isinstance(nil, mp.ProcessException))
  end)

  it("an uncaught exception prints its full message in lua5.4", function()
    local out, code = H.run_child([[
      local mp = require "multiprocessing"
      mp.start_processes(function() error("uncaught in worker") end, {}, 1, true, false, "fork")
    ]]):wait()
    assert.truthy(out:find("-- Process 0 terminated with the following error:", 1, true), out)
    assert.truthy(out:find("uncaught in worker", 1, true), out)
    assert.are.equal(1, code, out)
  end)

  it("SpawnContext is ProcessContext", function()
    assert.are.equal(mp.ProcessContext, mp.SpawnContext)
  end)
end)

-- Issue 8, defect 13: the context's, process's and exception's functions
-- name themselves and count arguments as written.
describe("method errors name the method", function()
  H.leak_check(before_each, after_each)

  it("ProcessContext and Process methods, called wrongly", function()
    local ctx = mp.start_processes(function() end, {}, 1, false, false, "fork")
    local p = ctx.processes[1]
    local cases = {
      { function() return ctx:join("x") end,
        "bad argument #1 to 'ProcessContext.join' %(number of seconds expected, got string%)" },
      { function() return ctx:close("x") end,
        "bad argument #1 to 'ProcessContext.close' %(grace_period must be" },
      { function() return ctx.join(p) end,
        "calling 'ProcessContext.join' on bad self %(ProcessContext expected, got multiprocessing.Process%)" },
      { function() return ctx.pids(1) end,
        "calling 'ProcessContext.pids' on bad self %(ProcessContext expected, got number%)" },
      { function() return ctx.results({}) end,
        "calling 'ProcessContext.results' on bad self %(ProcessContext expected, got table%)" },
      { function() return p.terminate(5) end,
        "calling 'Process.terminate' on bad self %(Process expected, got number%)" },
      { function() return p.kill(ctx) end,
        "calling 'Process.kill' on bad self %(Process expected, got multiprocessing.ProcessContext%)" },
      { function() return p.is_alive() end,
        "calling 'Process.is_alive' on bad self %(Process expected, got no value%)" },
    }
    for _, case in ipairs(cases) do
      local ok, err = pcall(case[1])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(case[2]), err)
      assert.falsy(tostring(err):find("'?'", 1, true), err)
    end
    assert.is_true(ctx:join())
  end)

  it("the module's functions name themselves", function()
    local cases = {
      { function() return mp.isinstance(1, 2) end,
        "bad argument #2 to '[%w.]*isinstance' %(table expected, got number%)" },
      { function() return mp.set_sharing_strategy({}) end,
        "bad argument #1 to '[%w.]*set_sharing_strategy' %(string expected, got table%)" },
      { function() return mp.spawn(f) end,
        "bad argument #1 to '[%w.]*spawn' %(function expected, got nil%)" },
    }
    for _, case in ipairs(cases) do
      local ok, err = pcall(case[1])
      assert.is_false(ok)
      assert.truthy(tostring(err):find(case[2]), err)
    end
  end)
end)

-- Issue 8, defect 12: a worker does not keep the signals its parent
-- blocked.  Lua cannot block signals: a parent with SIGUSR1, SIGHUP and
-- SIGPIPE blocked is made by python3, whose mask survives its exec.
local HAS_PYTHON = os.execute("python3 -c '' 2>/dev/null")
for _, method in ipairs(H.methods) do
  describe("signal mask, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function blocked(status)
      return status:match("SigBlk:%s*(%x+)")
    end

    it("a worker starts with no signal blocked", function()
      if not HAS_PYTHON then
        pending("python3 is needed to start a parent with signals blocked")
        return
      end
      local out = H.run_child(([[
        local mp = require "multiprocessing"
        local f = io.open("/proc/self/status")
        io.write(f:read("a"):match("SigBlk:%%s*%%x+"), "\n")
        f:close()
        local r = mp.start_processes(function()
          local g = io.open("/proc/self/status")
          local s = g:read("a")
          g:close()
          return s:match("SigBlk:%%s*%%x+")
        end, {}, 2, true, false, %q)
        io.write(r[1], "\n", r[2], "\n")
      ]]):format(method), { command = "python3 -c 'import os, signal; "
        .. "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1, signal.SIGHUP, signal.SIGPIPE}); "
        .. "os.execvp(\"lua5.4\", [\"lua5.4\", \"%s\"])'" }):wait()
      local lines = {}
      for line in out:gmatch("[^\n]+") do lines[#lines + 1] = line end
      assert.are.equal(3, #lines, out)
      assert.are_not.equal(0, tonumber(blocked(lines[1]), 16), out)  -- the parent's
      assert.are.equal(0, tonumber(blocked(lines[2]), 16), out)
      assert.are.equal(0, tonumber(blocked(lines[3]), 16), out)
    end)
  end)
end

-- Issue 8, defect 8: a worker's file_system tracker cannot be killed with
-- the worker's process group.  A parent that leaves every name to the
-- trackers (it ends without closing its state) runs 20 small jobs whose
-- workers each start one; once the parent is gone, every name goes.
for _, method in ipairs(H.methods) do
  describe("file_system trackers of workers, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("no segment outlives the job", function()
      local shm = H.shm()
      local out = H.run_child(([[
        local mp = require "multiprocessing"
        local keep = {}
        for _ = 1, 20 do
          keep[#keep + 1] = mp.start_processes(function()
            local m = require "multiprocessing"
            m.set_sharing_strategy("file_system")
            return m.Array("int32", 4)
          end, {}, 2, true, false, %q)
        end
        io.write(#keep, " jobs")
        os.exit(0, false)   -- no lua_close: the names are the trackers'
      ]]):format(method)):wait()
      assert.are.equal("20 jobs", out)
      assert.is_truthy(H.eventually(function()
        return #H.shm() == #shm
      end, 20), table.concat(H.shm(), " "))
      assert.are.same(shm, H.shm())
    end)
  end)
end

-- active_children() and current_process(), after CPython's _TestProcess
-- (test_current, test_process, test_active_children, test_terminate).
for _, method in ipairs(H.methods) do
  describe("active_children and current_process, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function start(fn, args, n, daemon)
      return mp.start_processes(fn, args or {}, n or 1, false, daemon or false, method)
    end

    -- a worker that waits until the parent creates 'path'
    local function wait_for(_, path)
      for _ = 1, 6000 do
        local f = io.open(path)
        if f then f:close() return end
        os.execute("sleep 0.01")
      end
    end

    local function gate()
      local path = os.tmpname()
      os.remove(path)
      return path, function() io.open(path, "w"):close() end
    end

    it("test_current: the parent is MainProcess", function()
      local current = mp.current_process()
      assert.is_true(current.is_alive())
      assert.is_false(current.daemon)
      assert.are.equal(H.pid(), current.ident)
      assert.are.equal(H.pid(), current.pid)
      assert.is_nil(current.exitcode)
      assert.are.equal("MainProcess", current.name)
      assert.is_nil(current.rank)
    end)

    it("test_process: a worker knows its pid, name, rank and daemon flag", function()
      for _, daemon in ipairs({ false, true }) do
        local ctx = start(function()
          local c = require("multiprocessing").current_process()
          return { pid = c.pid, ident = c.ident, name = c.name, rank = c.rank,
                   daemon = c.daemon, alive = c.is_alive() }
        end, {}, 2, daemon)
        assert.is_true(ctx:join())
        local results = ctx:results()
        for rank = 0, 1 do
          local r, p = results[rank + 1], ctx.processes[rank + 1]
          assert.are.equal(p.pid, r.pid)
          assert.are.equal(p.pid, r.ident)
          assert.are.equal(p.pid, p.ident)
          assert.are.equal(rank, r.rank)
          assert.are.equal(p.name, r.name)
          assert.are.equal("string", type(r.name))
          assert.are_not.equal("MainProcess", r.name)
          assert.are.equal(daemon, r.daemon)
          assert.are.equal(daemon, p.daemon)
          assert.is_true(r.alive)
        end
      end
    end)

    it("test_active_children: a list with the live workers, then without", function()
      assert.are.equal("table", type(mp.active_children()))
      local before = #mp.active_children()
      local path, open = gate()
      local ctx = start(wait_for, { path }, 2, true)
      local kids = mp.active_children()
      assert.are.equal(before + 2, #kids)
      local found = {}
      for _, k in ipairs(kids) do
        for rank, p in ipairs(ctx.processes) do
          if rawequal(k, p) then found[rank] = true end
        end
      end
      assert.are.same({ true, true }, found)
      open()
      assert.is_true(ctx:join())
      os.remove(path)
      for _, k in ipairs(mp.active_children()) do
        assert.is_false(rawequal(k, ctx.processes[1]) or rawequal(k, ctx.processes[2]))
      end
      assert.are.equal(before, #mp.active_children())
    end)

    it("reaps the workers that exited, as Python's does", function()
      local path, open = gate()
      local ctx = start(function(i, p)
        if i == 1 then wait_for(i, p) end
      end, { path }, 2)
      local first = ctx.processes[1]
      assert.is_truthy(H.eventually(function()
        return #mp.active_children() == 1
      end, 30))
      assert.is_true(rawequal(ctx.processes[2], mp.active_children()[1]))
      -- rank 0 was reaped: its exit code is known, it is no zombie
      assert.are.equal(0, first.exitcode)
      assert.is_nil(H.state(first.pid))
      open()
      assert.is_true(ctx:join())
      os.remove(path)
      assert.are.same({}, mp.active_children())
    end)

    it("test_terminate: a terminated worker leaves the list", function()
      local ctx = start(function() os.execute("sleep 30") end, {}, 1, true)
      local p = ctx.processes[1]
      assert.is_true(p:is_alive())
      assert.is_true(rawequal(p, mp.active_children()[1]))
      assert.is_nil(p.exitcode)
      p:terminate()
      assert.is_truthy(H.eventually(function() return not p:is_alive() end, 30))
      assert.are.same({}, mp.active_children())
      pcall(ctx.join, ctx)
    end)

    it("a closed context's workers are not listed", function()
      local ctx = start(function() os.execute("sleep 30") end, {}, 2)
      assert.are.equal(2, #mp.active_children())
      ctx:close(0)
      assert.are.same({}, mp.active_children())
    end)

    it("in a worker: its own children, not its siblings", function()
      local ctx = start(function()
        local m = require "multiprocessing"
        local inner = m.start_processes(function() os.execute("sleep 30") end,
                                        {}, 1, false, false, "fork")
        local n = #m.active_children()
        inner:close(0)
        return n
      end, {}, 2)
      assert.is_true(ctx:join())
      assert.are.same({ 1, 1, n = 2 }, ctx:results())
    end)
  end)
end

-- Issue 16, item 1: one supervision engine.  ctx:terminate([grace]) never
-- waits, ctx:poll() reports each worker that ended (and moves a terminate
-- on), ctx:restart(rank) starts a worker again in its slot; fileno() wakes
-- an event loop for the SIGKILL step.  No timed asserts: the engine sends
-- SIGKILL only from a poll or a join, so what runs before one is certain.
local raw_dir = os.tmpname()
local raw_so = raw_dir .. ".d/raw.so"
local raw
setup(function()
  os.execute("mkdir -p " .. raw_dir .. ".d")
  local out = H.sh(("cc -std=c99 -D_GNU_SOURCE -shared -fPIC -o %s spec/host/raw.c "
                    .. "$(pkg-config --cflags lua5.4) 2>&1"):format(raw_so))
  assert(out == "", out)
  raw = assert(package.loadlib(raw_so, "luaopen_raw"))()
end)
teardown(function()
  os.remove(raw_so)
  os.remove(raw_dir .. ".d")
  os.remove(raw_dir)
end)

for _, method in ipairs(H.methods) do
  describe("supervision engine, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function start(fn, args, n)
      return mp.start_processes(fn, args, n, false, false, method)
    end

    --- Workers that ignore SIGTERM: only the SIGKILL step ends them.
    local function stubborn(n)
      local ready <close> = mp.Queue()
      local ctx = start(function(_, so, q)
        assert(package.loadlib(so, "luaopen_raw"))().ignore_term()
        q:put("ready")
        local e = mp.Event()
        while true do e:wait(60) end
      end, { raw_so, ready }, n)
      for _ = 1, n do assert.are.equal("ready", ready:get(60)) end
      return ctx
    end

    --- Polls until 'n' events have come (each wake of fileno() first);
    -- returns them by rank, and how many wakes it took.
    local function events(ctx, n)
      local got, count, wakes = {}, 0, 0
      local fd = ctx:fileno()
      while count < n do
        assert(raw.poll(fd, 60000), "fileno() never woke")
        wakes = wakes + 1
        for _, ev in ipairs((ctx:poll())) do
          assert.is_nil(got[ev.rank], "one event per worker")
          got[ev.rank] = ev
          count = count + 1
        end
      end
      return got, wakes
    end

    it("terminate() of 8 workers that ignore SIGTERM returns at once; fileno() wakes for the SIGKILL", function()
      local ctx = stubborn(8)
      local pids = ctx:pids()
      ctx:terminate(600)
      for _, pid in ipairs(pids) do assert.is_true(H.alive(pid)) end
      local evs, due = ctx:poll()
      assert.are.same({}, evs)
      assert.is_true(due > 1 and due <= 600, tostring(due))
      ctx:terminate(1000)                       -- a longer grace changes nothing
      assert.is_true(select(2, ctx:poll()) <= 600)
      ctx:terminate(0.2)                        -- a shorter one brings SIGKILL forward
      due = select(2, ctx:poll())
      assert.is_true(due == nil or due <= 0.2, tostring(due))
      local got, wakes = events(ctx, 8)
      for rank = 0, 7 do
        local ev = got[rank]
        assert.are.equal(pids[rank + 1], ev.pid)
        assert.are.equal(-9, ev.exitcode)
        assert.are.equal("SIGKILL", ev.signal)
        assert.is_true(ev.terminated)
      end
      assert.is_true(wakes < 40, "woken " .. wakes .. " times")
      assert.are.same({ {}, nil }, { ctx:poll() })
      assert.is_true(ctx:join())                -- ended by terminate: no failure
      ctx:close()
    end)

    it("terminate(grace, rank) ends that worker alone, on the same SIGTERM -> grace -> SIGKILL steps", function()
      local ctx = stubborn(3)
      local pids = ctx:pids()
      ctx:terminate(600, 1)
      local evs, due = ctx:poll()
      assert.are.same({}, evs)
      assert.is_true(due > 1 and due <= 600, tostring(due))
      for _, pid in ipairs(pids) do assert.is_true(H.alive(pid)) end
      ctx:terminate(0.2, 1)                     -- a shorter grace brings its SIGKILL forward
      local got = events(ctx, 1)
      assert.are.equal(pids[2], got[1].pid)
      assert.are.equal(-9, got[1].exitcode)
      assert.is_true(got[1].terminated)
      assert.is_true(H.alive(pids[1]) and H.alive(pids[3]))
      assert.is_nil(select(2, ctx:poll()))      -- nothing else is due
      ctx:terminate(0, 2)                       -- 0: SIGKILL now
      got = events(ctx, 1)
      assert.are.equal(-9, got[2].exitcode)
      assert.is_true(ctx.processes[1]:is_alive())
      assert.has_error(function() ctx:terminate(1, 3) end, "bad argument #2 to 'ProcessContext.terminate' (rank from 0 to 2 expected, got 3)")
      ctx:terminate(0)
      assert.is_true(ctx:join(60))              -- ended by us: no failure
      ctx:close()
    end)

    it("terminate(0) kills at once; terminate after the end changes nothing", function()
      local ctx = stubborn(3)
      ctx:terminate(0)
      assert.is_true(ctx:join(60))
      for _, p in ipairs(ctx.processes) do assert.are.equal(-9, p.exitcode) end
      ctx:terminate()
      ctx:terminate(0)
      ctx:close()
      ctx:terminate()
    end)

    it("poll() reports how each worker ended, once, and never raises", function()
      local ctx = start(function(i)
        if i == 1 then os.exit(3) end
        if i == 2 then os.execute("kill -KILL $PPID; sleep 30") end
        if i == 3 then error("boom") end
        return i
      end, {}, 4)
      local now = require("multiprocessing.core")._now
      local before = now()
      local got = events(ctx, 4)
      assert.are.same({ 0, 3, -9, 1 }, { got[0].exitcode, got[1].exitcode, got[2].exitcode, got[3].exitcode })
      assert.are.equal("SIGKILL", got[2].signal)
      assert.is_nil(got[0].signal)
      assert.is_nil(got[1].signal)
      for rank = 0, 3 do
        assert.is_false(got[rank].terminated)
        assert.are.equal(ctx:pids()[rank + 1], got[rank].pid)
        assert.is_true(got[rank].at <= now())
        assert.is_true(got[rank].at + 600 > before)
      end
      assert.are.same({ {}, nil }, { ctx:poll() })
      -- join still applies its policy to what failed on its own
      local ok, e = pcall(ctx.join, ctx)
      assert.is_false(ok)
      assert.are.equal(1, e.error_index)
      assert.are.equal(3, e.exit_code)
      ctx:close()
    end)

    it("a context driven by poll() starts no teardown of its own", function()
      local go <close> = mp.Queue()
      local ctx = start(function(i, q)
        if i == 0 then error("first") end
        return q:get(60)
      end, { go }, 2)
      local got = events(ctx, 1)
      assert.are.equal(1, got[0].exitcode)
      assert.is_nil(select(2, ctx:poll()))     -- no step is due
      assert.is_true(ctx.processes[2]:is_alive())
      go:put("done")
      got = events(ctx, 1)
      assert.are.equal(0, got[1].exitcode)
      assert.is_false(got[1].terminated)
      assert.is_false(pcall(ctx.join, ctx))     -- rank 0 failed on its own
      ctx:close()
    end)

    it("restart(rank) runs the same fn and args again in that slot", function()
      local seen <close> = mp.Queue()
      local ctx = start(function(i, q, word)
        q:put({ i, mp.current_process().pid })
        if i == 1 then error(word) end
        return word .. i
      end, { seen, "w" }, 2)
      local got = events(ctx, 2)
      local old = got[1].pid
      assert.are.equal(1, got[1].exitcode)
      local pid = assert(ctx:restart(1))
      assert.are_not.equal(old, pid)
      assert.are.equal(pid, ctx:pids()[2])
      assert.is_true(ctx.processes[2].pid == pid)
      got = events(ctx, 1)
      assert.are.equal(pid, got[1].pid)
      local ranks = {}
      for _ = 1, 3 do
        local r = seen:get(60)
        ranks[#ranks + 1] = r[1]
      end
      table.sort(ranks)
      assert.are.same({ 0, 1, 1 }, ranks)
      -- it failed again: the new failure is the one join raises
      local ok, e = pcall(ctx.join, ctx)
      assert.is_false(ok)
      assert.are.equal(pid, e.pid)
      assert.matches("w", e.msg)
      ctx:close()
    end)

    it("restart(rank) clears the old result; join gives the new worker's", function()
      local jobs <close> = mp.Queue()
      local ctx = start(function(i, qq)
        local n = qq:get(60)
        if n == "fail" then os.exit(5) end
        return n .. i
      end, { jobs }, 1)
      jobs:put("fail")
      assert.are.equal(5, events(ctx, 1)[0].exitcode)
      jobs:put("ok")
      assert(ctx:restart(0))
      assert.is_true(ctx:join(60))
      assert.are.same({ "ok0", n = 1 }, ctx:results())
      ctx:close()
    end)

    it("a context of one worker restarts again and again, its descriptors made anew", function()
      local seen <close> = mp.Queue()
      local ctx = start(function(_, q, n) q:put(n) return n end, { seen, 7 }, 1)
      for round = 1, 3 do
        assert.are.equal(7, seen:get(60))
        local got = events(ctx, 1)
        assert.are.equal(0, got[0].exitcode, "round " .. round)
        if round < 3 then assert(ctx:restart(0)) end
      end
      assert.is_true(ctx:join(60))
      assert.are.same({ 7, n = 1 }, ctx:results())
      ctx:close()
    end)

    it("restart refuses a running worker, an untold end, a bad rank, a closed context", function()
      local go <close> = mp.Queue()
      local ctx = start(function(_, q) return q:get(60) end, { go }, 2)
      assert.matches("ProcessContext.restart: process 0 has not ended",
                     select(2, pcall(ctx.restart, ctx, 0)))
      assert.matches("bad argument #1 to 'ProcessContext.restart'.*rank from 0 to 1",
                     select(2, pcall(ctx.restart, ctx, 2)))
      go:put(1)
      go:put(2)
      assert.is_true(H.eventually(function() return not ctx.processes[1]:is_alive() end, 60))
      assert.matches("has not ended, or poll%(%) has not reported",
                     select(2, pcall(ctx.restart, ctx, 0)))
      assert.is_true(ctx:join(60))
      assert.matches("the context is closed", select(2, pcall(ctx.restart, ctx, 0)))
      ctx:close()
    end)

    it("restart during a terminate is refused", function()
      local ctx = start(function(i) if i == 0 then return end os.execute("sleep 30") end, {}, 2)
      events(ctx, 1)
      ctx:terminate(0)
      assert.matches("being terminated", select(2, pcall(ctx.restart, ctx, 0)))
      assert.is_true(ctx:join(60))
      ctx:close()
    end)

    if method ~= "fork" then
      it("restart returns nil and a message when the start fails", function()
        local exe = mp.get_executable()
        local ctx = start(function() end, {}, 2)
        events(ctx, 2)
        mp.set_executable("/bin/true")         -- runs, but not the protocol
        local ok, pid, msg = pcall(ctx.restart, ctx, 1)
        mp.set_executable(exe)
        assert.is_true(ok, pid)
        assert.is_nil(pid)
        assert.matches("cannot restart process 1 with start method \"" .. method .. "\"", msg)
        assert.are.same({}, (ctx:poll()))      -- it ended as before, told already
        local again = assert(ctx:restart(1))  -- and may be tried again
        assert.are.equal(again, events(ctx, 1)[1].pid)
        assert.is_true(ctx:join(60))
        ctx:close()
      end)
    end
  end)
end

-- Issue 16, item 4: one source of truth.  The start methods are one list in
-- C; an exception carries what a caller needs as fields (e.kind,
-- e.traceback, e.message), so no Lua code reads another layer's prose.
describe("one source of truth", function()
  H.leak_check(before_each, after_each)

  it("get_all_start_methods is the list start_processes and set_start_method check", function()
    assert.are.same({ "fork", "spawn", "forkserver" }, mp.get_all_start_methods())
    local t = mp.get_all_start_methods()
    t[1] = "changed"                           -- a fresh table each time
    assert.are.equal("fork", mp.get_all_start_methods()[1])
    local _, err = pcall(mp.set_start_method, "threads")
    assert.matches("unknown start method 'threads'; expected \"fork\", \"spawn\" or \"forkserver\"", err)
    _, err = pcall(mp.start_processes, function() end, {}, 1, true, false, "threads")
    assert.matches("unknown start method 'threads' %(expected \"fork\", \"spawn\" or \"forkserver\"%)", err)
    local before = mp.get_start_method()
    for _, m in ipairs(mp.get_all_start_methods()) do
      mp.set_start_method(m)
      assert.are.equal(m, mp.get_start_method())
    end
    mp.set_start_method(before)
  end)

  for _, method in ipairs(H.methods) do
    it("an exception says its kind, the worker's traceback and its own message apart, " .. method, function()
      local ok, e = pcall(mp.start_processes, function()
        error("boom\nsecond line", 0)
      end, {}, 1, true, false, method)
      assert.is_false(ok)
      assert.are.equal("raised", e.kind)
      assert.are.equal("boom\nsecond line", e.message)
      assert.matches("^stack traceback:\n", e.traceback)
      assert.is_nil(e.traceback:find("boom", 1, true))
      assert.truthy(e.msg:find(e.traceback .. "\n" .. e.message, 1, true))
      ok, e = pcall(mp.start_processes, function() error({ code = 7 }) end, {}, 1, true, false, method)
      assert.is_false(ok)
      assert.are.equal("raised", e.kind)
      assert.are.equal(7, e.value.code)
      assert.matches("^%(error object is a table value%)$", e.message)
      ok, e = pcall(mp.start_processes, function() os.exit(4) end, {}, 1, true, false, method)
      assert.is_false(ok)
      assert.are.equal("exited", e.kind)
      assert.is_nil(e.traceback)
      assert.is_nil(e.message)
    end)
  end
end)

-- Issue 20, item 7: fileno() after close() raises, as Queue:fileno() does,
-- instead of opening an epoll and a timerfd held until collection; after a
-- join that settled the context it still answers (readable for good).
for _, method in ipairs(H.methods) do
  describe("fileno after close, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("raises after close(), answers after a settled join", function()
      local ctx = mp.start_processes(function() end, {}, 1, false, false, method)
      assert.is_true(ctx:join(60))
      local fd = ctx:fileno()
      assert.is_true(raw.poll(fd, 0))
      ctx:close()
      assert.matches("ProcessContext.fileno: the context is closed", select(2, pcall(ctx.fileno, ctx)))
      ctx = mp.start_processes(function() os.execute("sleep 30") end, {}, 1, false, false, method)
      ctx:close()
      assert.matches("ProcessContext.fileno: the context is closed", select(2, pcall(ctx.fileno, ctx)))
    end)
  end)
end
