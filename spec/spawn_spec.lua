-- Fresh-interpreter start methods, "spawn" and "forkserver": what crosses to
-- a worker (closures, upvalues, module functions, args), what is refused, the
-- environment a worker gets, the executable, and the forkserver's life.
local mp = require "multiprocessing"
local core = require "multiprocessing.core"
local H = require "helpers"

local BUILD = os.getenv("LUA_MP_BUILD") or "build"

local function now()
  local f = io.popen("date +%s.%N")
  local t = tonumber(f:read("a"))
  f:close()
  return t
end

-- A module directory on package.path for the whole file.
local MODDIR = os.tmpname()
os.remove(MODDIR)
os.execute("mkdir -p " .. MODDIR)
H.write(MODDIR .. "/spawnspec_mod.lua", [[
local M = { state = "initialised by require" }
function M.work(i, x) return ("mod %d %s %s"):format(i, tostring(x), M.state) end
return M
]])
package.path = MODDIR .. "/?.lua;" .. package.path
local mymod = require "spawnspec_mod"
mymod.state = "changed in the parent"

teardown(function()
  os.remove(MODDIR .. "/spawnspec_mod.lua")
  os.remove(MODDIR)
end)

for _, method in ipairs({ "spawn", "forkserver" }) do
  describe("start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function start(fn, args, n, join)
      return mp.start_processes(fn, args, n, join, false, method)
    end

    it("sends a closure with upvalues of every sendable kind", function()
      local n, s, yes, no = 42, "text\0bin", true, false
      local t = { nested = { deep = { 1, 2.5, "three" } } }
      local function helper(x) return x * 2 end
      local results = start(function(i)
        return { i, n, s, yes, no, t.nested.deep, helper(21), math.type(t.nested.deep[2]) }
      end, {}, 2)
      assert.are.same({ 0, 42, "text\0bin", true, false, { 1, 2.5, "three" }, 42, "float" },
                      results[1])
      assert.are.equal(1, results[2][1])
      assert.are.equal(2, results.n)
    end)

    it("keeps shared upvalues shared", function()
      local counter = 0
      local function inc() counter = counter + 1 end
      local function get() return counter end
      local results = start(function() inc(); inc(); inc(); return get() end, {}, 1)
      assert.are.equal(3, results[1])
      assert.are.equal(0, counter)
    end)

    it("keeps cycles and shared references in args", function()
      local a = { name = "a" }
      a.self = a
      local b = { a, a, back = a }
      local results = start(function(_, x, y)
        return x.self == x and y[1] == x and y[2] == x and y.back == x and x.name
      end, { a, b }, 1)
      assert.are.equal("a", results[1])
    end)

    it("sends a module's function by reference: the worker requires it", function()
      local results = start(mymod.work, { "arg" }, 2)
      assert.are.equal("mod 0 arg initialised by require", results[1])
      assert.are.equal("mod 1 arg initialised by require", results[2])
    end)

    it("sends a module table upvalue by reference", function()
      local results = start(function() return mymod.state end, {}, 1)
      assert.are.equal("initialised by require", results[1])
    end)

    it("passes the same rank and args as fork", function()
      local results = start(function(i, a, b) return { i, a, b } end, { "x", 42 }, 3)
      assert.are.same({ { 0, "x", 42 }, { 1, "x", 42 }, { 2, "x", 42 }, n = 3 }, results)
    end)

    it("rejects an unsendable upvalue before any worker starts", function()
      local sock = io.stdout
      local function worker() return sock end
      local ok, err = pcall(start, worker, {}, 2)
      assert.is_false(ok)
      assert.are.equal("cannot send upvalue 'sock' of function 'worker' (userdata) " ..
                       "to a spawned process: pass it differently or use start_method \"fork\"",
                       err)
      assert.are.same({}, H.children())
    end)

    it("rejects unsendable args, threads and C functions with their path", function()
      local ok, err = pcall(start, function() end, { { conn = io.stdin } }, 1)
      assert.is_false(ok)
      assert.truthy(err:find("cannot send args[1].conn (userdata)", 1, true), err)
      local co = coroutine.create(function() end)
      ok, err = pcall(start, function() return co end, {}, 1)
      assert.is_false(ok)
      assert.truthy(err:find("upvalue 'co' of function '.-' %(thread%)"), err)
      local cf = core.encode
      ok, err = pcall(start, function() return cf end, {}, 1)
      assert.is_true(ok)  -- a module's C function goes by reference
      ok, err = pcall(start, function() return debug.upvalueid end, { string.gmatch("", "") }, 1)
      assert.is_false(ok)
      assert.truthy(err:find("cannot send args[1] (function)", 1, true), err)
      assert.are.same({}, H.children())
    end)

    it("does not copy globals, and says so in the exception", function()
      rawset(_G, "spawnspec_global", function() return 1 end)
      local ok, e = pcall(start, function() return spawnspec_global() end, {}, 1)
      rawset(_G, "spawnspec_global", nil)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      assert.truthy(e.msg:find("attempt to call a nil value (global 'spawnspec_global')", 1, true), e.msg)
      assert.truthy(e.msg:find("(hint: the parent has a global 'spawnspec_global'", 1, true), e.msg)
    end)

    it("gives the worker package.path, package.cpath, cwd, environment, arg", function()
      local results = start(function()
        local p = io.popen("pwd")
        local cwd = p:read("l")
        p:close()
        return { package.path, package.cpath, cwd, os.getenv("HOME"), os.getenv("PATH"), arg }
      end, {}, 1)
      local p = io.popen("pwd")
      local cwd = p:read("l")
      p:close()
      local r = results[1]
      assert.are.equal(package.path, r[1])
      assert.are.equal(package.cpath, r[2])
      assert.are.equal(cwd, r[3])
      assert.are.equal(os.getenv("HOME"), r[4])
      assert.are.equal(os.getenv("PATH"), r[5])
      assert.are.same(arg[0], r[6][0])
      assert.are.same(arg[1], r[6][1])
    end)

    it("returns results and decodes structured errors", function()
      local results = start(function(i) return { rank = i, list = { i, i * 2 } } end, {}, 2)
      assert.are.same({ { rank = 0, list = { 0, 0 } }, { rank = 1, list = { 1, 2 } }, n = 2 },
                      results)
      local ok, e = pcall(start, function() error({ code = 42, reason = "disk full" }) end, {}, 1)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      assert.are.same({ code = 42, reason = "disk full" }, e.value)
    end)

    it("shows the user's file and line in a worker's traceback", function()
      local ok, e = pcall(start, function() error("located") end, {}, 1)
      assert.is_false(ok)
      assert.truthy(e.msg:find("spawn_spec.lua:%d+: located$"), e.msg)
    end)

    it("turns a module the worker cannot require into that worker's error", function()
      package.loaded.spawnspec_ghost = { value = 1 }
      local ghost = package.loaded.spawnspec_ghost
      local ok, e = pcall(start, function() return ghost.value end, {}, 2)
      package.loaded.spawnspec_ghost = nil
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.ProcessRaisedException))
      assert.truthy(e.msg:find("module 'spawnspec_ghost' not found", 1, true), e.msg)
    end)

    it("encodes big args once, not once per worker", function()
      local big = string.rep("x", 64 * 1024 * 1024)
      local function fn(_, b) return #b end
      local t0 = now()
      local ctx1 = start(fn, { big }, 1, false)
      local one = now() - t0
      assert.is_true(ctx1:join())
      ctx1 = nil
      collectgarbage()
      t0 = now()
      local ctx4 = start(fn, { big }, 4, false)
      local four = now() - t0
      assert.is_true(ctx4:join())
      assert.are.same({ #big, #big, #big, #big, n = 4 }, ctx4:results())
      -- encoding once: four workers cost about one encoding, not four
      assert.is_true(four < 2 * one + 0.25, ("1 worker %.3f s, 4 workers %.3f s"):format(one, four))
      ctx4 = nil
      big = nil
      collectgarbage()
    end)

    it("runs a function defined at the lua5.4 -i prompt", function()
      local out = H.repl({
        "mp = require 'multiprocessing'",
        "k = 7",
        "local_up = 3",
        "function f(i, a) return a * 10 + i end",
        ("r = mp.start_processes(f, { 4 }, 2, true, false, %q)"):format(method),
        "print('results', r[1], r[2], r.n)",
        "function g() return h() end",
        "function h() end",
        ("ok, e = pcall(mp.start_processes, g, {}, 1, true, false, %q)"):format(method),
        "print(ok, e.msg)",
      }):wait()
      assert.truthy(out:find("results\t40\t41\t2", 1, true), out)
      assert.truthy(out:find("attempt to call a nil value (global 'h')", 1, true), out)
      assert.truthy(out:find("hint: the parent has a global 'h'", 1, true), out)
    end)

    it("runs workers with the embedding worker executable", function()
      local exe = BUILD .. "/multiprocessing/worker"
      local old = mp.get_executable()
      mp.set_executable(exe)
      assert.are.equal(exe, mp.get_executable())
      local ok, results = pcall(start, function(i)
        local f = io.open("/proc/self/exe")
        f:close()
        return i
      end, {}, 2)
      mp.set_executable(nil)
      assert.is_true(ok, results)
      assert.are.same({ 0, 1, n = 2 }, results)
      assert.are.equal(old, mp.get_executable())
    end)
  end)
end

describe("the executable", function()
  H.leak_check(before_each, after_each)

  it("is the running stock interpreter by default", function()
    local self = H.sh("readlink /proc/" .. H.pid() .. "/exe"):gsub("\n$", "")
    assert.are.equal(self, mp.get_executable())
  end)

  -- What a worker runs, seen from inside: its program, the collector's mode
  -- (lua5.4 and the worker program run chunks generational) and 'arg'.
  local function inside(method)
    return mp.start_processes(function()
      local f = io.popen("readlink /proc/$PPID/exe")
      local exe = f:read("l")
      f:close()
      return { exe = exe, gc = collectgarbage("incremental") }
    end, {}, 1, true, false, method)[1]
  end

  it("runs fresh workers as the worker program, the same Lua without readline", function()
    local program = H.sh("readlink -f " .. BUILD .. "/multiprocessing/worker"):gsub("\n$", "")
    local self = H.sh("readlink /proc/" .. H.pid() .. "/exe"):gsub("\n$", "")
    assert.are.same({ exe = program, gc = "generational" }, inside("spawn"))
    -- the forkserver is the worker program too; its workers are its forks
    assert.are.equal(program, inside("forkserver").exe)
    assert.are.equal(self, mp.get_executable())
    -- chosen, the interpreter runs as itself
    mp.set_executable(self)
    local ok, seen = pcall(inside, "spawn")
    mp.set_executable(nil)
    assert.is_true(ok, seen)
    assert.are.same({ exe = self, gc = "generational" }, seen)
  end)

  it("a fresh worker catches no signal its parent did, and what its parent ignores stays ignored", function()
    -- the parent, lua5.4, catches SIGINT (bit 1 of SigCgt) while its chunk
    -- runs; the shell makes it ignore SIGUSR2 (bit 11 of SigIgn)
    local out = H.run_child([[
      local mp = require "multiprocessing"
      local function masks()
        local f = io.open("/proc/self/status")
        local s = f:read("a")
        f:close()
        return tonumber(s:match("SigIgn:%s*(%x+)"), 16), tonumber(s:match("SigCgt:%s*(%x+)"), 16)
      end
      local ign, cgt = masks()
      print("parent", ign & (1 << 11) ~= 0, cgt & (1 << 1) ~= 0)
      for _, m in ipairs({ "spawn", "forkserver" }) do
        local r = mp.start_processes(function() return { masks() } end, {}, 2, true, false, m)
        -- (under the sanitizers a process catches SIGSEGV and its kin)
        print(m, r[1][1] & (1 << 11) ~= 0, r[1][2] & (1 << 1), r[2][2] & (1 << 1))
      end
    ]], { command = "sh -c \"trap '' USR2; exec lua5.4 %s\"" }):wait()
    assert.are.equal("parent\ttrue\ttrue\nspawn\ttrue\t0\t0\nforkserver\ttrue\t0\t0\n", out)
  end)

  it("the worker program runs -e chunks as lua5.4 does: arg, LUA_INIT first", function()
    local program = BUILD .. "/multiprocessing/worker"
    local init = os.tmpname()
    H.write(init, "from_file = 'file'\n")
    local out = H.sh("env -u LUA_INIT_5_4 LUA_INIT='from_init = 1' " .. program ..
                     " -e 'print(from_init, arg[0] == \"" .. program .. "\", arg[1], #arg)'" ..
                     " -e 'print(collectgarbage(\"incremental\"))'")
    assert.are.equal("1\ttrue\t-e\t4\ngenerational\n", out)
    out = H.sh("LUA_INIT_5_4='@" .. init .. "' LUA_INIT='error()' " .. program ..
               " -e 'print(from_file)'")
    assert.are.equal("file\n", out)
    out = H.sh("env -u LUA_INIT_5_4 LUA_INIT='error(\"no init\")' " .. program ..
               " -e 'print(1)' 2>&1; echo \"status $?\"")
    os.remove(init)
    assert.truthy(out:find("^" .. program:gsub("%p", "%%%0") .. ": LUA_INIT:1: no init\n"), out)
    assert.truthy(out:find("\nstatus 1\n$"), out)
  end)

  it("set_executable refuses what it cannot execute", function()
    local ok, err = pcall(mp.set_executable, "/nonexistent/lua")
    assert.is_false(ok)
    assert.truthy(err:find("bad argument #1 to '[%w.]*set_executable' %(.*No such file"), err)
    ok, err = pcall(mp.set_executable, "/tmp")
    assert.is_false(ok)
    assert.truthy(err:find("bad argument #1 to '[%w.]*set_executable'"), err)
  end)

  it("a worker executable that cannot start fails the start with its reason", function()
    local fake = os.tmpname()
    H.write(fake, "#!/nonexistent/interpreter\n")
    os.execute("chmod +x " .. fake)
    mp.set_executable(fake)
    local ok, err = pcall(mp.start_processes, function() end, {}, 2, true, false, "spawn")
    mp.set_executable(nil)
    os.remove(fake)
    assert.is_false(ok)
    assert.truthy(err:find("cannot start " .. fake .. ": No such file or directory", 1, true), err)
    assert.are.same({}, H.children())
  end)

  it("the worker executable is the default in an embedding host", function()
    local exe = BUILD .. "/multiprocessing/worker"
    local out = H.run_child([[
      local mp = require "multiprocessing"
      print(mp.get_executable())
      for _, m in ipairs({ "spawn", "forkserver" }) do
        local r = mp.start_processes(function(i) return i * 2 end, {}, 2, true, false, m)
        print(m, r[1], r[2])
      end
    ]], { command = exe .. " -e 'dofile(\"%s\")'" }):wait()
    local real = H.sh("readlink -f " .. exe):gsub("\n$", "")
    assert.are.equal(real .. "\nspawn\t0\t2\nforkserver\t0\t2\n", out)
  end)
end)

describe("the forkserver", function()
  H.leak_check(before_each, after_each)

  local function trivial(i) return i end

  it("is restarted after it was killed", function()
    mp.start_processes(trivial, {}, 1, true, false, "forkserver")
    local first = core._forkserver_info()
    assert.is_truthy(first)
    os.execute("kill -KILL " .. first.pid)
    assert.is_true(H.eventually(function() return not H.alive(first.pid) end, 5))
    local results = mp.start_processes(trivial, {}, 3, true, false, "forkserver")
    assert.are.same({ 0, 1, 2, n = 3 }, results)
    local second = core._forkserver_info()
    assert.are_not.equal(first.pid, second.pid)
    -- the dead one was reaped, not left a zombie
    assert.is_nil(H.state(first.pid))
  end)

  it("is one process for many contexts", function()
    mp.start_processes(trivial, {}, 1, true, false, "forkserver")
    local pid = core._forkserver_info().pid
    for _ = 1, 3 do mp.start_processes(trivial, {}, 2, true, false, "forkserver") end
    assert.are.equal(pid, core._forkserver_info().pid)
  end)

  it("its workers and itself die when the parent is SIGKILLed", function()
    local child = H.run_child([[
      local mp = require "multiprocessing"
      local ctx = mp.start_processes(function() os.execute("sleep 30") end, {}, 2, false, false, "forkserver")
      local pids = ctx:pids()
      table.insert(pids, 1, require("multiprocessing.core")._forkserver_info().pid)
      announce(pids)
      ctx:join()
    ]], { stderr = false })
    local list = child:pids()
    assert.are.equal(4, #list)
    child:kill("KILL")
    child:wait()
    for i = 2, 4 do
      assert.is_true(H.eventually(function() return not H.alive(list[i]) end, 5))
    end
  end)

  it("leaves no zombie and no running server when the state closes", function()
    local out = H.run_child([[
      -- finalisers run in reverse order: this one runs after the server's
      setmetatable({}, { __gc = function()
        local pid = io.open("/proc/self/stat"):read("a"):match("^%d+")
        local children = io.open(("/proc/%d/task/%d/children"):format(pid, pid)):read("a")
        io.stdout:write("children at close: [", children, "]\n")
      end })
      local mp = require "multiprocessing"
      mp.start_processes(function() end, {}, 2, true, false, "forkserver")
      io.stdout:write("server ", require("multiprocessing.core")._forkserver_info().pid, "\n")
    ]]):wait()
    local pid = tonumber(out:match("server (%d+)"))
    assert.is_truthy(pid, out)
    assert.truthy(out:find("children at close: []", 1, true), out)
    assert.is_nil(H.state(pid))
  end)
end)

-- Issue 8, defect 12: a fresh worker gets the descriptors the protocol
-- passes and nothing else of the parent's -- not Lua's io.open files (which
-- are not close-on-exec), not a host's sockets -- as Python's spawn does.
-- The forkserver too: its workers are forks of it.
for _, method in ipairs({ "spawn", "forkserver" }) do
  describe("descriptors a " .. method .. " worker inherits:", function()
    H.leak_check(before_each, after_each)

    it("none of the parent's own files (io.open) reach the worker", function()
      local path = os.tmpname()
      local files = {}   -- enough that some lie above the protocol's
      for k = 1, 12 do files[k] = assert(io.open(path, "w")) end
      local results = mp.start_processes(function(_, p)
        local list = os.tmpname()
        os.execute(("ls -l /proc/$PPID/fd > %s"):format(list))  -- the worker's
        local h = io.open(list)
        local text = h:read("a")
        h:close()
        os.remove(list)
        return { inherited = text:find(p, 1, true) ~= nil, listing = text }
      end, { path }, 2, true, false, method)
      for rank = 1, 2 do
        assert.is_false(results[rank].inherited, results[rank].listing)
      end
      local server = H.forkserver()
      if method == "forkserver" and server then
        assert.is_nil(H.fd_listing(server.pid):find(path, 1, true))
      end
      for _, fh in ipairs(files) do fh:close() end
      os.remove(path)
    end)

    it("a worker's descriptors are the protocol's and its own", function()
      local path = os.tmpname()
      local files = {}
      for k = 1, 12 do files[k] = assert(io.open(path, "w")) end
      local results = mp.start_processes(function()
        local list = os.tmpname()
        os.execute(("ls /proc/$PPID/fd > %s"):format(list))
        local n = 0
        for _ in io.lines(list) do n = n + 1 end
        os.remove(list)
        return n
      end, {}, 1, true, false, method)
      for _, fh in ipairs(files) do fh:close() end
      os.remove(path)
      -- 0-2, the reports file and its socket, the listing's own: far
      -- below what the parent holds (busted's, the twelve files)
      assert.is_true(results[1] <= 8, tostring(results[1]))
    end)
  end)
end

-- Issue 19, item 4: what ps, pgrep -f and top show for a worker, under
-- every start method: a plain worker as "lua worker <rank>/<n> (<script>)",
-- a title of its own with core._set_title, the thread name its first 15
-- bytes; the command line a spawned worker starts with is short (the
-- bootstrap comes in its environment, which the worker then drops).
for _, method in ipairs(H.methods) do
  describe("process titles under " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    -- fn(rank, out) runs in each worker; what the worker's shell saw of it
    -- (ps of $PPID, the worker) is returned per rank.
    local function seen(n, title)
      return mp.start_processes(function(i, t)
        local c = require "multiprocessing.core"
        if t then c._set_title(t:format(i)) end
        local out = os.tmpname()
        -- (procps under the sanitizer build's LD_PRELOAD deadlocks)
        os.execute(("{ unset LD_PRELOAD; ps -o args= -p $PPID; cat /proc/$PPID/comm; " ..
                    "pgrep -f '^lua worker %d/' | grep -qx $PPID && echo found; " ..
                    "echo boot=${LUA_MP_BOOT+set} " ..
                    "; } > %s 2>&1"):format(i, out))
        local f = io.open(out)
        local text = f:read("a")
        f:close()
        os.remove(out)
        return { text = text, boot = os.getenv("LUA_MP_BOOT") }
      end, { title }, n, true, false, method)
    end

    it("a plain worker is 'lua worker <rank>/<n> (<script>)' in ps and pgrep -f", function()
      local script = arg and arg[0] or "?"
      local results = seen(2)
      for rank = 0, 1 do
        local text = results[rank + 1].text
        local args, comm, found, boot = text:match("^([^\n]*)\n([^\n]*)\n([^\n]*)\n([^\n]*)\n")
        assert.are.equal(("lua worker %d/2 (%s)"):format(rank, script), args, text)
        assert.are.equal(("lua worker %d/2 (%s)"):format(rank, script):sub(1, 15), comm)
        assert.are.equal("found", found, text)
        assert.are.equal("boot=", boot, text)   -- its children do not get it
        assert.is_nil(results[rank + 1].boot)
      end
    end)

    it("core._set_title sets a worker's command line and thread name", function()
      local long = "mprun[%d/16] train.lua --lr 0.1 " .. ("--option-%d "):rep(20):format(
        1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20)
      local results = seen(1, long)
      local args, comm = results[1].text:match("^([^\n]*)\n([^\n]*)\n")
      assert.are.equal(long:format(0), args, results[1].text)
      assert.are.equal("mprun[0/16] tra", comm)
      -- the environment still works after the title took its room
      assert.is_nil(results[1].boot)
    end)
  end)
end

describe("a spawned worker's command line", function()
  H.leak_check(before_each, after_each)

  it("is short until the worker sets its title, and carries no bootstrap", function()
    local ctx = mp.start_processes(function() os.execute("sleep 1") end, {}, 1, false, false, "spawn")
    local pid = ctx:pids()[1]
    -- whatever moment ps catches it at: the short line or the title
    local args = H.sh("env -u LD_PRELOAD ps -o args= -p " .. pid):gsub("\n$", "")
    ctx:join()
    assert.is_true(#args < 120, args)
    assert.is_nil(args:find("package.cpath", 1, true), args)
  end)
end)

-- Issue 20, item 3: a worker that closes its inherited descriptors (3..30,
-- as daemon-style code does), dup2s over them, or blocks or ignores
-- SIGRTMAX-2 does not outlive its SIGKILLed parent, nor does anything in its
-- process group (a `sleep` it started), under every start method.  The
-- parent is a lua5.4 child that starts the worker and is SIGKILLed.
describe("a worker cannot outlive its SIGKILLed parent", function()
  local DIR = os.tmpname()
  os.remove(DIR)
  os.execute("mkdir -p " .. DIR)
  setup(function()
    local out = H.sh(("cc -shared -fPIC %s -o %s/spec_detachtool.so spec/host/detachtool.c 2>&1"):format(
      H.sh("pkg-config --cflags lua5.4"):gsub("\n", ""), DIR))
    assert(out == "", out)
  end)
  teardown(function()
    os.remove(DIR .. "/spec_detachtool.so")
    os.remove(DIR)
  end)

  local cases = {
    ["closes descriptors 3..30"] = "t.close_range(3, 30)",
    ["dup2s over descriptors 3..30"] = "t.dup2_over(3, 30)",
    ["blocks SIGRTMAX-2"] = "t.block(2)",
    ["ignores SIGRTMAX-2"] = "t.ignore(2)",
    ["does nothing special"] = "",
  }
  local serial = 0
  for _, method in ipairs(H.methods) do
    for name, action in pairs(cases) do
      it(method .. ": one that " .. name, function()
        serial = serial + 1
        local marker = ("431.%d%d"):format(serial, math.random(100000, 999999))
        local child = H.run_child(([[
          package.cpath = %q .. "/?.so;" .. package.cpath
          local mp = require "multiprocessing"
          local ctx = mp.start_processes(function(_, marker)
            local t = require "spec_detachtool"
            %s
            os.execute("sleep " .. marker)
          end, { %q }, 1, false, false, %q)
          announce(ctx:pids())
          ctx:join()
        ]]):format(DIR, action, marker, method), { stderr = false })
        local pids = child:pids()
        local worker = pids[2]
        -- the worker's sleep runs: then the parent goes
        assert.is_true(H.eventually(function()
          return H.sh("env -u LD_PRELOAD pgrep -f '^sleep " .. marker .. "' || true") ~= ""
        end, 20))
        child:kill("KILL")
        child:wait()
        local gone = H.eventually(function()
          return H.sh("env -u LD_PRELOAD pgrep -f '^sleep " .. marker .. "' || true") == ""
                 and not H.alive(worker)
        end, 10)
        -- (pkill, as pgrep, deadlocks with the sanitizer's runtime preloaded)
        os.execute("env -u LD_PRELOAD pkill -KILL -f '^sleep " .. marker .. "'")
        assert.is_true(gone, "the worker or its sleep outlived the parent")
      end)
    end
  end
end)

-- Issue 19, item 5: a worker's traceback names the user's functions and
-- chunks (`train.lua:5: in function 'step'`), not the library's locals.
describe("a worker's traceback", function()
  H.leak_check(before_each, after_each)

  for _, method in ipairs(H.methods) do
    it("names the user's function under " .. method, function()
      local function step() error("loss is NaN") end
      local function train() step() end
      local ok, e = pcall(mp.start_processes, train, {}, 1, true, false, method)
      assert.is_false(ok)
      local tb = e.traceback or tostring(e)
      assert.matches("spawn_spec%.lua:%d+: in function 'step'", tb)
      assert.is_nil(tb:find("in upvalue", 1, true), tb)
      assert.is_nil(tb:find("in local", 1, true), tb)
      assert.is_nil(tb:find("multiprocessing/", 1, true), tb)
    end)
  end
end)
