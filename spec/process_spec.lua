-- mp.Process: one job in a process of its own, under every start method;
-- active_children, current_process and parent_process that know it.
local mp = require "multiprocessing"
local H = require "helpers"

-- Processes matching an anchored pgrep pattern ('^sleep 4.31'); pgrep
-- without the sanitizer's preload, under which it can hang.
local function survivors(pattern)
  return H.sh(("env -u LD_PRELOAD pgrep -f '%s' || true"):format(pattern))
end

for _, method in ipairs(H.methods) do
  describe("mp.Process under " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function P(fn, args, opts)
      opts = opts or {}
      opts.start_method = method
      return mp.Process(fn, args, opts)
    end

    it("runs target(args...) and keeps every value it returned", function()
      local p = P(function(a, b) return a + b, "two", nil, b end, { 1, 2 })
      assert.is_nil(p.pid)
      assert.is_nil(p.exitcode)
      assert.is_false(p:is_alive())
      p:start()
      assert.is_true(p.pid > 0)
      assert.are.equal(p.pid, p.ident)
      assert.is_true(p:join())
      assert.are.equal(0, p.exitcode)
      assert.are.same({ n = 4, 3, "two", nil, 2 }, table.pack(p:result()))
      assert.is_nil(p:error())
      assert.is_false(p:is_alive())
      assert.are.equal(mp.Process, getmetatable(p))
      assert.is_true(mp.isinstance(p, mp.Process))
      assert.is_false(mp.isinstance({}, mp.Process))
      p:close()
    end)

    it("takes Python's keyword form, closures, and a table with a run method", function()
      local base = 40
      local kw = mp.Process { target = function(x) return base + x end, args = { 2 },
                              name = "adder", start_method = method }
      local job = { greeting = "hello" }
      function job:run(who) return self.greeting .. " " .. who end
      local obj = P(job, { "world" })
      kw:start()
      obj:start()
      assert.is_true(kw:join())
      assert.is_true(obj:join())
      assert.are.equal("adder", kw.name)
      assert.are.equal(42, kw:result())
      assert.are.equal("hello world", obj:result())
      assert.are.equal("hello world", obj:run())   -- in this process
    end)

    it("names itself, and knows its parent, in the child", function()
      local p = P(function()
        local me, parent = mp.current_process(), mp.parent_process()
        return { me.name, me.pid, me.daemon, parent.name, parent.pid, parent.is_alive() }
      end, {}, { name = "worker-a", daemon = true })
      assert.is_true(p.daemon)
      p:start()
      assert.is_true(p:join())
      assert.are.same({ "worker-a", p.pid, true, "MainProcess", H.pid(), true }, p:result())
      assert.is_nil(mp.parent_process())
      assert.are.equal("MainProcess", mp.current_process().name)
    end)

    it("gives default names Process-N, and Process-N:M to a child's children", function()
      local p = P(function(m)
        local q = mp.Process(function() return mp.current_process().name end, {},
                             { start_method = m })
        q:start()
        q:join()
        return { mp.current_process().name, q.name, q:result() }
      end, { method })
      local n = tonumber(p.name:match("^Process%-(%d+)$"))
      assert.is_not_nil(n, p.name)
      p:start()
      assert.is_true(p:join())
      assert.are.same({ p.name, p.name .. ":1", p.name .. ":1" }, p:result())
      local p2 = P(function() end)
      assert.are.equal("Process-" .. (n + 1), p2.name)
    end)

    it("join(timeout) is false while it runs; never raises for the child's failure", function()
      local p = P(function() error("boom") end)
      local slow = P(function() os.execute("sleep 30") end)
      p:start()
      slow:start()
      assert.is_false(slow:join(0))
      assert.is_false(slow:join(0.05))
      assert.is_true(slow:is_alive())
      assert.is_nil(slow.exitcode)
      assert.has_error(function() slow:result() end)
      assert.is_true(p:join())
      assert.is_true(p:join())
      assert.are.equal(1, p.exitcode)
      local e = p:error()
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      assert.truthy(tostring(e):find("boom", 1, true))
      assert.is_nil(p:result())
      slow:kill()
      assert.is_true(slow:join())
      assert.are.equal(-9, slow.exitcode)
      assert.is_nil(slow:error(), "a kill by us is no failure")
    end)

    it("a child that exits or is SIGKILLed fails with ProcessExitedException", function()
      local exits = P(function() os.exit(3) end)
      local killed = P(function()
        os.execute("kill -KILL " .. mp.current_process().pid)
        os.execute("sleep 30")
      end)
      exits:start()
      killed:start()
      assert.is_true(exits:join())
      assert.is_true(killed:join())
      assert.are.equal(3, exits.exitcode)
      assert.are.equal(-9, killed.exitcode)
      local e1, e2 = exits:error(), killed:error()
      assert.is_true(mp.isinstance(e1, mp.ProcessExitedException))
      assert.are.equal(3, e1.exit_code)
      assert.is_true(mp.isinstance(e2, mp.ProcessExitedException))
      assert.are.equal("SIGKILL", e2.signal_name)
    end)

    it("shows in ps as 'lua process <name> (<script>)'", function()
      local q = mp.Queue()
      local p = P(function(queue) queue:get() end, { q }, { name = "indexer" })
      p:start()
      local cmdline = H.eventually(function()
        local text = (H.read("/proc/" .. p.pid .. "/cmdline") or ""):gsub("%z+$", "")
        return text:find("^lua process indexer %(") and text
      end, 10)
      q:put(1)
      assert.is_true(p:join())
      q:close()
      assert.truthy(cmdline, "the title was not set")
      local script = type(arg) == "table" and arg[0] or "lua"
      assert.are.equal(("lua process indexer (%s)"):format(script), cmdline)
    end)

    it("terminate() ends it and its group with SIGTERM", function()
      local p = P(function() os.execute("sleep 30") end)
      p:start()
      local pid = p.pid
      assert.is_true(H.eventually(function() return #H.group(pid) >= 2 end), "sleep started")
      p:terminate()
      assert.is_true(p:join())
      assert.are.equal(-15, p.exitcode)
      assert.are.same({}, H.group(pid))
      p:terminate()   -- ended: nothing to do
      p:kill()
    end)

    it("its sentinel is readable exactly once it has ended", function()
      local q = mp.Queue()
      local p = P(function(queue) queue:get() end, { q })
      p:start()
      local fd = p.sentinel
      assert.are.equal(fd, p:fileno())
      assert.are.same({}, mp.wait({ fd }, 0.05))
      q:put("go")
      assert.are.same({ fd }, mp.wait({ fd }))
      assert.are.same({ p }, mp.wait({ p }, 0))
      assert.is_true(p:join())
      assert.are.same({ fd }, mp.wait({ fd }, 0), "still readable once reaped")
      p:close()
      q:close()
      assert.has_error(function() return p.sentinel end)
    end)

    it("close() refuses a running process; after it the outcome stays", function()
      local p = P(function() os.execute("sleep 30") end)
      p:start()
      assert.has_error(function() p:close() end)
      p:kill()
      p:join()
      p:close()
      p:close()
      assert.are.equal(-9, p.exitcode)
      assert.has_error(function() p:join() end)
      assert.has_error(function() p:start() end)
    end)

    it("<close> and collection kill and reap it", function()
      local pid1, pid2
      do
        local p <close> = P(function() os.execute("sleep 30") end)
        p:start()
        pid1 = p.pid
      end
      assert.is_false(H.alive(pid1))
      do
        local p = P(function() os.execute("sleep 30") end)
        p:start()
        pid2 = p.pid
      end
      collectgarbage()
      collectgarbage()
      assert.is_false(H.alive(pid2))
    end)

    it("is listed by active_children while it runs", function()
      local q = mp.Queue()
      local p = P(function(queue) queue:get() end, { q })
      p:start()
      local list = mp.active_children()
      assert.are.equal(1, #list)
      assert.are.equal(p, list[1])
      q:put(1)
      assert.is_true(p:join())
      assert.are.same({}, mp.active_children())
      q:close()
    end)

    it("starts and joins 200 processes in a loop, leaving nothing", function()
      local sum = 0
      for i = 1, 200 do
        local p = P(function(k) return k * 2 end, { i })
        p:start()
        assert.is_true(p:join())
        sum = sum + p:result()
        if i % 2 == 0 then p:close() end
      end
      assert.are.equal(200 * 201, sum)
    end)

    it("raises for bad arguments, naming the call", function()
      assert.has_error(function() mp.Process(42) end,
        "bad argument #1 to 'Process' (a function or a table with a run method expected, got number)")
      assert.has_error(function() mp.Process(print, 1) end,
        "bad argument #2 to 'Process' (table expected, got number)")
      assert.has_error(function() mp.Process(print, {}, { colour = 1 }) end,
        "bad argument #3 to 'Process' (unknown option 'colour')")
      assert.has_error(function() mp.Process { target = print, bogus = 1 } end,
        "bad argument #1 to 'Process' (unknown field 'bogus')")
      assert.has_error(function() mp.Process(print, {}, { start_method = "thread" }) end)
      local p = P(print)
      assert.has_error(function() p:join() end, "Process.join: the process has not been started")
      assert.has_error(function() p:fileno() end, "Process.fileno: the process has not been started")
      p:start()
      assert.has_error(function() p:start() end, "Process.start: a process can be started only once")
      assert.has_error(function() p:join("x") end)
      p:join()
    end)
  end)

  describe("mp.Process under " .. method .. " when its parent dies:", function()
    it("leaves nothing of 10 live Processes and their children", function()
      local tag = ("431.%d"):format(#method)       -- one marker per method
      local child = H.run_child(([[
        mp = require "multiprocessing"
        procs = {}
        for i = 1, 10 do
          procs[i] = mp.Process(function() os.execute("sleep %s") end, {}, { start_method = %q })
          procs[i]:start()
        end
        pids = {}
        for i, p in ipairs(procs) do pids[i] = p.pid end
        announce(pids)
        mp.Queue():get(600)   -- (no child of ours holds the output pipe)
      ]]):format(tag, method))
      local pids = child:pids()
      local sleeping = H.eventually(function()   -- each has started its sleep
        for i = 2, #pids do if #H.group(pids[i]) < 2 then return false end end
        return true
      end, 30)
      local before = survivors("^sleep " .. tag)
      child:kill("KILL")
      child:wait()
      assert.are.equal(11, #pids)
      assert.is_true(sleeping, "the sleeps did not start")
      assert.are_not.equal("", before)
      assert.is_true(H.eventually(function()
        for i = 2, #pids do if H.alive(pids[i]) then return false end end
        return survivors("^sleep " .. tag) == ""
      end, 10), "left: " .. survivors("^sleep " .. tag))
    end)
  end)
end

describe("mp.Process at the REPL", function()
  it("runs a function typed at the prompt under spawn and forkserver", function()
    local repl = H.repl({
      "mp = require 'multiprocessing'",
      "local_base = 5",
      "function f(x) return x * local_base end",
      "p = mp.Process(function(x) local b = 7 return x * b end, {6}, {start_method = 'spawn'})",
      "p:start() p:join() print('spawn', p:result())",
      "q = mp.Process{target = function() return require('multiprocessing').current_process().name end, start_method = 'forkserver', name = 'fs'}",
      "q:start() q:join() print('forkserver', q:result())",
      "announce({})",
    })
    repl:pids()
    local out = repl:wait()
    assert.truthy(out:find("spawn\t42", 1, true), out)
    assert.truthy(out:find("forkserver\tfs", 1, true), out)
  end)
end)

describe("examples/processes.lua (the README's pipeline)", function()
  H.leak_check(before_each, after_each)

  for _, method in ipairs(H.methods) do
    it("runs producer, transformers and writer under " .. method, function()
      local path = os.tmpname()
      local child = H.run_child(("arg = { %q, %q }\ndofile('examples/processes.lua')\nannounce({})")
                                :format(path, method))
      local out, code = child:wait()
      local text = H.read(path)
      os.remove(path)
      assert.are.equal(0, code, out)
      assert.truthy(out:find("the transformers took 1000 items; the writer wrote 1000 lines", 1, true), out)
      for _, name in ipairs { "producer", "transformer%-1", "transformer%-2", "transformer%-3", "writer" } do
        assert.truthy(out:find(name .. " +ended, exit code 0"), out)
      end
      local seen, lines = {}, 0
      for n, sq in text:gmatch("(%d+) (%d+)\n") do
        n = tonumber(n)
        assert.are.equal(n * n, tonumber(sq))
        assert.is_nil(seen[n])
        seen[n], lines = true, lines + 1
      end
      assert.are.equal(1000, lines)
    end)
  end
end)

describe("the README's example of processes with different jobs", function()
  H.leak_check(before_each, after_each)

  it("runs as printed", function()
    local readme = assert(H.read("README.md"))
    local section = readme:match("\n## Processes with different jobs\n(.-)\n## ")
    local code = assert(section and section:match("```lua\n(.-)```"), "no example found")
    local path = os.tmpname()
    local body = code:gsub('"squares.txt"', (("%q"):format(path):gsub("%%", "%%%%")))
    assert.are_not.equal(code, body)
    local child = H.run_child(body)
    local out, rc = child:wait()
    local text = H.read(path) or ""
    os.remove(path)
    assert.are.equal(0, rc, out)
    assert.truthy(out:find("writer\tended\t0\t1000", 1, true), out)
    local lines = 0
    for _ in text:gmatch("\n") do lines = lines + 1 end
    assert.are.equal(1000, lines)
  end)
end)
