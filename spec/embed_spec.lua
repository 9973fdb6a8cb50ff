-- Embedding: C hosts with their own SIGCHLD handling, threads, a frame loop,
-- their own binary as the workers' executable, and event loops waiting on
-- ctx:fileno().
local H = require "helpers"
local mp = require "multiprocessing"

local BUILD = os.getenv("LUA_MP_BUILD") or "build"
local CC = "cc -std=c99 -D_GNU_SOURCE -Isrc -o %s %s $(pkg-config --cflags --libs lua5.4) -lpthread 2>&1"

local function compile(source)
  local exe = os.tmpname()
  local out = H.sh(CC:format(exe, source))
  assert(out == "", out)
  return exe
end

local embed_host, thread_host, frame_host
setup(function()
  embed_host = compile("spec/host/embed_host.c")
  thread_host = compile("spec/host/thread_host.c")
  frame_host = compile("examples/frame_host.c")
end)
teardown(function()
  os.remove(embed_host)
  os.remove(thread_host)
  os.remove(frame_host)
end)

-- Chunks are given to hosts in a shell's double quotes, where $ would be
-- the shell's: "$PPID" of a worker's own shell is spelt PPID.
local PRELUDE = H.PATHS .. 'PPID = string.char(36) .. "PPID"; local PPID = PPID\n'

--- A host's output without the fork-in-threads warning (a thread host that
-- forks gets it, rightly).
local function unwarned(out)
  return (out:gsub("lua%-multiprocessing: warning: start method \"fork\"[^\n]*\n", ""))
end

-- The environment of a child host or example, wherever it runs: our module
-- first, as busted has it, with this tree's relative entries made absolute.
local HERE = H.sh("pwd"):gsub("\n", "")
local function absolute(path)
  return (";" .. path):gsub(";%./", ";" .. HERE .. "/"):sub(2)
end
local ENV = ("LUA_PATH=%q LUA_CPATH=%q"):format(absolute(package.path), absolute(package.cpath))

--- Waits until none of 'pids' is alive (they are not our children: an
-- orphan is reaped by init); returns the ones still alive.
local function survivors(pids, seconds)
  H.eventually(function()
    for _, pid in ipairs(pids) do if H.alive(pid) then return false end end
    return true
  end, seconds or 10)
  local left = {}
  for _, pid in ipairs(pids) do if H.alive(pid) then left[#left + 1] = pid end end
  return left
end

local function read_pids(file)
  local pids = {}
  for pid in (H.read(file) or ""):gmatch("%d+") do pids[#pids + 1] = tonumber(pid) end
  return pids
end

-- How a host handles SIGCHLD, and whether the kernel's pidfd exit info is
-- used (Linux >= 6.15) or not (LUA_MP_NO_PIDFD_EXIT_INFO=1: a 6.1 kernel).
local MODES = { "reap", "ignore", "nocldwait" }
local KERNELS = { { name = "pidfd exit info", env = "" },
                  { name = "no pidfd exit info (6.1)", env = "LUA_MP_NO_PIDFD_EXIT_INFO=1" } }

for _, kernel in ipairs(KERNELS) do
for _, mode in ipairs(MODES) do
for _, method in ipairs(H.methods) do
  describe(("a host with two states, SIGCHLD %s, %s, %s:"):format(mode, kernel.name, method), function()
    H.leak_check(before_each, after_each)

    local function run_host(start, join)
      return H.sh(("%s %s %q %q %s 2>&1; echo rc=$?"):format(
        kernel.env, embed_host, PRELUDE .. start, join, mode))
    end

    it("joins each state's workers with their own results", function()
      local out = run_host(([[
        mp = require "multiprocessing"
        ctx = mp.start_processes(function(i, s) return s * 10 + i end, { STATE }, 3, false, false, %q)
      ]]):format(method), [[
        assert(ctx:join(), "join")
        local r = ctx:results()
        print(("state %d: %d %d %d"):format(STATE, r[1], r[2], r[3]))
      ]])
      assert.are.equal("state 0: 0 1 2\nstate 1: 10 11 12\nrc=0\n", out)
    end)

    it("still reports the exit codes and signals the host's handling would take", function()
      local out = run_host(([[
        mp = require "multiprocessing"
        local state = STATE
        ctx = mp.start_processes(function(i)
          if i == 1 then os.exit(40 + state) end
          if i == 2 then os.execute("kill -ABRT " .. PPID .. "; sleep 5") end
        end, {}, 3, false, false, %q)
      ]]):format(method), [[
        local ok, e = pcall(ctx.join, ctx, nil, 10)
        local codes = {}
        for _, f in ipairs(e.failures) do codes[#codes + 1] = f.msg end
        print(ok, e, table.concat(codes, "; "))
      ]])
      assert.are.equal(
        "false\tProcessExitedException: process 1 terminated with exit code 40\tprocess 2 terminated with signal SIGABRT\n" ..
        "false\tProcessExitedException: process 1 terminated with exit code 41\tprocess 2 terminated with signal SIGABRT\nrc=0\n", out)
    end)

    it("terminates workers still running when the state closes", function()
      local pidfile = os.tmpname()
      local out = run_host(([[
        mp = require "multiprocessing"
        ctx = mp.start_processes(function() os.execute("sleep 30") end, {}, 2, false, false, %q)
      ]]):format(method), ([[
        local f = io.open(%q, "a") f:write(table.concat(ctx:pids(), " "), " ") f:close()
      ]]):format(pidfile))
      assert.are.equal("rc=0\n", out)
      local pids = read_pids(pidfile)
      os.remove(pidfile)
      assert.are.equal(4, #pids)
      assert.are.same({}, survivors(pids))
    end)

    if mode == "ignore" then
      -- SIG_IGN: the kernel reaps at once, so nobody can wait for the status
      it("says the status is unknown when it truly is, never a wrong code", function()
        local out = run_host(([[
          mp = require "multiprocessing"
          ctx = mp.start_processes(function() os.execute("kill -KILL " .. PPID .. "; sleep 5") end, {}, 1, false, false, %q)
        ]]):format(method), [[
          local ok, e = pcall(ctx.join, ctx)
          print(ok, e.exit_code, e)
        ]])
        if kernel.env == "" then
          assert.are.equal(("false\t-9\tProcessExitedException: process 0 terminated with signal SIGKILL\n"):rep(2) .. "rc=0\n", out)
        else
          assert.are.equal(("false\tnil\tProcessExitedException: process 0 terminated and another waiter took its exit " ..
            "status (does the host ignore or reap SIGCHLD?)\n"):rep(2) .. "rc=0\n", out)
        end
      end)
    end
  end)
end
end
end

for _, method in ipairs(H.methods) do
  describe("workers started from a short-lived thread, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("live on after the thread exits, and are joined from another", function()
      local out = H.sh(("%s %q %q 2>&1; echo rc=$?"):format(thread_host, PRELUDE .. ([[
        mp = require "multiprocessing"
        ctx = mp.start_processes(function(i) os.execute("sleep 0.3") return i + 1 end, {}, 2, false, false, %q)
      ]]):format(method), [[
        assert(ctx:join(), "join")
        print(ctx:results()[1], ctx:results()[2])
      ]]))
      assert.are.equal("1\t2\nrc=0\n", unwarned(out))
    end)

    -- (no comments in these chunks: the shell joins their lines)
    it("die with their groups when the process dies", function()
      -- each worker starts a sleep, then the host SIGKILLs itself
      local pidfile = os.tmpname()
      local tag = ("30.%d"):format(70 + #method)   -- one sleep per method
      H.sh(("%s %q %q 2>&1"):format(thread_host, PRELUDE .. ([[
        mp = require "multiprocessing"
        ctx = mp.start_processes(function() os.execute("sleep %s") end, {}, 2, false, false, %q)
      ]]):format(tag, method), ([[
        for _, pid in ipairs(ctx:pids()) do
          repeat
            local f = io.open("/proc/" .. pid .. "/task/" .. pid .. "/children")
            local kids = f and f:read("a") or ""
            if f then f:close() end
          until kids:match("%%d")
        end
        local f = io.open(%q, "w")
        f:write(table.concat(ctx:pids(), " "))
        f:close()
        os.execute("kill -KILL " .. PPID)
      ]]):format(pidfile)))
      local pids = read_pids(pidfile)
      os.remove(pidfile)
      assert.are.equal(2, #pids)
      assert.are.same({}, survivors(pids))
      assert.is_true(H.eventually(function()
        -- (pgrep deadlocks at start with the sanitizer's runtime preloaded)
        return H.sh("env -u LD_PRELOAD pgrep -f '^sleep " .. tag .. "' || true") == ""
      end, 10))
    end)
  end)
end

-- The example host: a 60 Hz loop, a second thread, a host-registered
-- module, and its own binary as the workers' executable.
local function step_stats(out, kind)
  local median, max = out:match("step " .. kind .. " n=%d+ median ([%d.]+) ms max ([%d.]+) ms")
  return tonumber(median), tonumber(max)
end

for _, method in ipairs(H.methods) do
  describe("the frame-loop host (examples/frame_host), " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("never stalls a frame: start, join(0), close, GC and lua_close with TERM-ignoring workers", function()
      local pidfile = os.tmpname()
      local out = H.sh(("cd / && %s %s %s/examples/frame_host.lua %s %s 2>&1; echo rc=$?"):format(
        ENV, frame_host, HERE, method, pidfile))
      local pids = read_pids(pidfile)
      os.remove(pidfile)
      assert.matches("rc=0\n$", out)
      -- the workers are the host binary, with the host's own module
      assert.matches("results 0 10 20 30\n", out)
      assert.matches("raised [^\n]*worker 0 gave up\n", out)
      -- termination went on over many polls (SIGTERM, 0.5 s, SIGKILL), each
      -- one returning false at once, instead of one call blocking through it
      local polls = tonumber(out:match("polls while terminating (%d+)"))
      assert.is_true(polls >= 10, out)
      -- A step that blocked would take the 0.5 s grace; each step's median
      -- stays a tenth of that (idle: under 1 ms; beside two busy loops on
      -- a 2-core machine close and GC measured 6-8 ms, as they wait for
      -- the kernel to take SIGKILLed workers down), and the maximum far
      -- below it (a loaded machine may deschedule us in any step).
      for _, kind in ipairs { "join0", "close", "gc" } do
        local median, max = step_stats(out, kind)
        assert.is_truthy(median, kind .. " not measured:\n" .. out)
        assert.is_true(median < 50, kind .. " median " .. median .. " ms\n" .. out)
        assert.is_true(max < 250, kind .. " max " .. max .. " ms\n" .. out)
      end
      local close_state = tonumber(out:match("lua_close ([%d.]+) ms"))
      assert.is_true(close_state < 250, out)
      -- 4 + 4 + 3 x 2 + 3 x 2 + 2 workers, every one gone
      assert.are.equal(22, #pids)
      assert.are.same({}, survivors(pids))
      -- fork in a host with two threads: warned once, naming the safe methods
      local _, warnings = out:gsub("start method \"fork\" in a process with %d+ threads", "")
      assert.are.equal(method == "fork" and 1 or 0, warnings)
      if method == "fork" then
        assert.matches("use start method \"spawn\" or \"forkserver\"", out)
      end
    end)

    -- An exiting worker closes its descriptors before it becomes reapable:
    -- the reports' socket may end (and wake the loop once) a moment before
    -- the worker's pidfd is readable.
    it("ctx:fileno() is readable with poll(2) when join(0) has news", function()
      local script = H.script(([[
        local mp = require "multiprocessing"
        local host = require "host"
        if %q ~= "fork" then mp.set_executable(host.executable()) end
        local function start(fn, args, n)
          return mp.start_processes(fn, args, n, false, false, %q)
        end
        local ctx = start(function(i) require("host").sleep(0.3 + 0.6 * i) return i end, {}, 2)
        local fd = ctx:fileno()
        assert(ctx:fileno() == fd, "one descriptor")
        assert(not host.poll(fd, 0), "readable while both run")
        assert(host.poll(fd, 20000), "worker 0 exited")
        assert(ctx:join(0) == false)
        assert(not host.poll(fd, 0), "still readable after join(0) took the news")
        assert(host.poll(fd, 20000), "worker 1 exited")
        local wakes = 1
        while not ctx:join(0) do
          assert(host.poll(fd, 20000), "worker 1 is reapable")
          wakes = wakes + 1
        end
        assert(wakes <= 2, "woken " .. wakes .. " times for one exit")
        assert(host.poll(fd, 0), "readable for good once settled")
        print("results", ctx:results()[1], ctx:results()[2])
        ctx:close()
        -- termination: the timer wakes the loop for the SIGKILL step
        ctx = start(function(i)
          local h = require "host"
          h.ignore_term()
          if i == 0 then error("first") end
          while true do h.sleep(0.05) end
        end, {}, 3)
        fd = ctx:fileno()
        local wakeups = 0
        while true do
          assert(host.poll(fd, 20000), "no wake-up")
          wakeups = wakeups + 1
          local ok, done = pcall(ctx.join, ctx, 0, 0.3)
          if not ok then print("raised", done.error_index) break end
          assert(not done)
        end
        print("wakeups", wakeups < 40 and "few" or wakeups)
        ctx:close()
        return function() return false end
      ]]):format(method, method), "")
      local out = H.sh(("%s %s %s 2>&1; echo rc=$?"):format(ENV, frame_host, script))
      os.remove(script)
      assert.matches("^results\t0\t1\nraised\t0\nwakeups\tfew\nframes [^\n]*\nrc=0\n$", unwarned(out))
    end)
  end)
end

describe("a wrong executable", function()
  H.leak_check(before_each, after_each)

  for _, method in ipairs { "spawn", "forkserver" } do
    it("fails the start at once, naming it, under " .. method, function()
      mp.set_executable("/bin/true")
      local ok, err = pcall(mp.start_processes, function() return 1 end, {}, 2, true, false, method)
      mp.set_executable(nil)
      assert.is_false(ok)
      assert.truthy(err:find("/bin/true is not a worker executable", 1, true), err)
      assert.truthy(err:find("lmp_worker_main", 1, true), err)
    end)
  end

  it("a host binary that calls lmp_worker_main is one, and is asked only once", function()
    local out = H.sh(("%s %s %s 2>&1"):format(ENV, frame_host, H.script([[
      local mp = require "multiprocessing"
      mp.set_executable(require("host").executable())
      for _, m in ipairs { "spawn", "spawn", "forkserver" } do
        local r = mp.start_processes(function(i) return require("host").registered_by_host and i end, {}, 2, true, false, m)
        print(m, r[1], r[2])
      end
      return function() return false end
    ]], "")))
    assert.matches("^spawn\t0\t1\nspawn\t0\t1\nforkserver\t0\t1\n", out)
  end)
end)

describe("the warning channel", function()
  H.leak_check(before_each, after_each)

  it("goes to a handler when one is set, else to stderr", function()
    local seen = {}
    mp.set_warning_handler(function(msg) seen[#seen + 1] = msg end)
    local r = mp.spawn(function(i) return i end, {}, 1, true, false, "fork")
    mp.set_warning_handler(nil)
    assert.are.equal(0, r[1])
    assert.are.equal(1, #seen)
    assert.matches("only supports start_method \"spawn\"", seen[1])
    local out = H.sh(("lua5.4 -e %q 2>&1 >/dev/null"):format(H.PATHS .. [[
      require("multiprocessing").spawn(function() end, {}, 1, true, false, "fork")]]))
    assert.matches("^lua%-multiprocessing: warning: multiprocessing.spawn only supports", out)
  end)
end)

describe("the worker program", function()
  it("is the worker entry of multiprocessing.h, and still runs -e chunks", function()
    local exe = BUILD .. "/multiprocessing/worker"
    assert.are.equal("7\n", H.sh(exe .. " -e 'print(3 + 4)' 2>&1"))
    assert.matches("usage", H.sh(exe .. " 2>&1"))
  end)
end)

-- The event-loop examples, run as a user would: from another directory.
for _, example in ipairs { { file = "luv_wait", lib = "luv" }, { file = "cqueues_wait", lib = "cqueues" } } do
  describe("examples/" .. example.file .. ".lua", function()
    H.leak_check(before_each, after_each)
    for _, method in ipairs(H.methods) do
      it("waits on ctx:fileno() and a Queue's fileno() in its loop under " .. method, function()
        -- (asked of another interpreter: loading luv here opens its loop's fds)
        if H.sh(("lua5.4 -e 'require %q' 2>&1"):format(example.lib)) ~= "" then
          error(example.lib .. " is not installed (sh scripts/install-deps.sh installs it)")
        end
        local out = H.sh(("cd / && %s timeout 120 lua5.4 %s/examples/%s.lua %s 2>&1; echo rc=$?"):format(
          ENV, HERE, example.file, method))
        assert.is_falsy(out:find("woke the loop: none", 1, true), out)
        assert.matches("^results 0 1 4\nqueue items 3, read when its descriptor woke [^\n]*\n" ..
                       "raised: [^\n]*worker 1 cannot go on\nwoken a few times\n" ..
                       "the loop ran meanwhile: yes\nrc=0\n$", unwarned(out))
      end)
    end
  end)
end
