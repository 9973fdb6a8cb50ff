-- mp.Pool under faults: workers that never start their tasks, initializers
-- that exit, and (below) a seeded random mix of faults with one property:
-- every call returns or raises in bounded time and nothing is left behind.
-- Each case runs in a child interpreter under `timeout -s KILL`, so that a
-- hang is a failure of the spec, not of the run.
local H = require "helpers"

-- Runs 'body' (a script; '%s' in it: the start method) in a child, killed
-- after 'limit' seconds, after the shell command 'prefix' (ulimit); returns
-- its output and "rc=<status>" last.
local function run(body, method, limit, prefix)
  local script = H.script((body:gsub("%%s", method)))
  local p = io.popen(("%s timeout -s KILL %d lua5.4 %s 2>&1; echo rc=$?")
                     :format(prefix or "", limit or 60, script))
  local out = p:read("a")
  p:close()
  os.remove(script)
  return out
end

local HANG_INIT = [[
local mp = require "multiprocessing"
local dir = os.tmpname()
os.remove(dir)
local pool = mp.Pool(2, { start_method = "%s", timeout = 1, initializer = function()
  -- the first worker to get here hangs in its initializer for ever
  if os.execute("mkdir " .. dir .. " 2>/dev/null") then while true do end end
end })
local r, err = pool:map_async(function(x) return x * 10 end, { 1, 2, 3, 4, 5, 6 }, 1):get(30)
print("map", r and table.concat(r, ",") or err)
-- the other calls keep working while the hung start is replaced
print("apply", pool:apply(function(a, b) return a + b end, { 2, 3 }))
pool:close()
pool:join()
print("joined")
os.remove(dir)
]]

local STOPPED_IDLE = [[
local mp = require "multiprocessing"
local pool = mp.Pool(2, { start_method = "%s", timeout = 2 })
-- both workers ready; one of them is stopped while idle
local pids = pool:map(function() os.execute("sleep 0.2")
  return tonumber(io.open("/proc/self/stat"):read("a"):match("^%d+")) end, { 1, 2 }, 1)
os.execute("kill -STOP " .. pids[1])
local r = pool:map(function(x) return x * 10 end, { 1, 2, 3, 4, 5, 6 }, 1)
print("map", table.concat(r, ","))
local n = 0
for _, v in pool:imap_unordered(function(x) return x end, { 1, 2, 3, 4 }) do n = n + v end
print("unordered", n)
pool:close()
pool:join()
print("joined")
]]

local EXIT_INIT = [[
local mp = require "multiprocessing"
local pool = mp.Pool(2, { start_method = "%s", initializer = function() os.exit(CODE) end })
local ok, err = pcall(pool.map, pool, function(x) return x end, { 1, 2, 3 })
print("ok", ok)
print("exited", mp.isinstance(err, mp.ProcessExitedException))
print("exit_code", mp.isinstance(err, mp.ProcessException) and err.exit_code)
print("msg", tostring(err))
pool:terminate()
print("done")
]]

for _, method in ipairs(H.methods) do
  describe("mp.Pool, tasks a worker never starts, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("move to the other worker when an initializer hangs; close and join return", function()
      local out = run(HANG_INIT, method)
      assert.truthy(out:find("map\t10,20,30,40,50,60\n", 1, true), out)
      assert.truthy(out:find("apply\t5\n", 1, true), out)
      assert.truthy(out:find("joined\nrc=0\n", 1, true), out)
    end)

    it("move to the other worker when one is SIGSTOPped while idle", function()
      local out = run(STOPPED_IDLE, method)
      assert.truthy(out:find("map\t10,20,30,40,50,60\n", 1, true), out)
      assert.truthy(out:find("unordered\t10\n", 1, true), out)
      assert.truthy(out:find("joined\nrc=0\n", 1, true), out)
    end)
  end)

  describe("mp.Pool, an initializer that exits, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    for _, code in ipairs { 0, 7 } do
      it(("os.exit(%d) fails the call at once, not an endless respawn"):format(code), function()
        local out = run(EXIT_INIT:gsub("CODE", tostring(code)), method, 30)
        assert.truthy(out:find("ok\tfalse\n", 1, true), out)
        assert.truthy(out:find("exited\ttrue\n", 1, true), out)
        assert.truthy(out:find(("exit_code\t%d\n"):format(code), 1, true), out)
        assert.truthy(out:find("initializer", 1, true), out)
        assert.truthy(out:find("done\nrc=0\n", 1, true), out)
      end)
    end
  end)
end

for _, method in ipairs(H.methods) do
  describe("mp.Pool futures, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)
    local mp = require "multiprocessing"

    it("submit(fn, ...) passes every argument, nils too, and names itself in errors", function()
      local pool <close> = mp.Pool(2, { start_method = method })
      local ar = pool:submit(function(a, b, c, d) return select("#", a, b, c, d), a, c, d end,
                             1, nil, 3)
      assert.are.equal(4, ar:get())
      local f = pool:submit(function(...) return select("#", ...) end, nil, nil)
      assert.are.equal(2, f:get())
      assert.is_true(f:ready())
      assert.is_true(f:successful())
      local ok, err = pcall(pool.submit, pool, 42)
      assert.is_false(ok)
      assert.matches("bad argument #1 to 'Pool.submit'", err)
      assert.matches("pool_fault_spec", err)  -- the caller's line
      local e = pool:submit(function() error("boom") end)
      ok, err = pcall(e.get, e)
      assert.is_false(ok)
      assert.matches("boom", tostring(err))
    end)

    it("cancel() of a call not yet sent: it never runs, get raises, cancelled() is true", function()
      local dir = os.tmpname()
      os.remove(dir)
      assert(os.execute("mkdir " .. dir))
      local pool <close> = mp.Pool(1, { start_method = method })
      -- the one worker is busy until 'go' exists; calls behind it wait in the parent
      local function block(d)
        while not io.open(d .. "/go") do os.execute("sleep 0.01") end
        return "first"
      end
      local first = pool:submit(block, dir)
      local ars = {}
      for i = 1, 200 do
        ars[i] = pool:submit(function(d, k) io.open(d .. "/ran" .. k, "w"):close() return k end, dir, i)
      end
      -- the last ones are surely still in the parent
      local cancelled = {}
      for i = 150, 200, 2 do
        if ars[i]:cancel() then cancelled[i] = true end
      end
      assert.truthy(next(cancelled), "nothing could be cancelled")
      assert.is_false(first:cancel())          -- sent already
      io.open(dir .. "/go", "w"):close()
      assert.are.equal("first", first:get())
      assert.is_false(first:cancelled())
      for i = 1, 200 do
        if cancelled[i] then
          assert.is_true(ars[i]:cancelled())
          assert.is_true(ars[i]:ready())
          assert.is_false(ars[i]:successful())
          local ok, err = pcall(ars[i].get, ars[i])
          assert.is_false(ok)
          assert.is_true(err.cancelled)
          assert.matches("cancelled", tostring(err))
        else
          assert.are.equal(i, ars[i]:get())
          assert.is_false(ars[i]:cancel())     -- done
        end
        assert.are.equal(not cancelled[i], H.read(dir .. "/ran" .. i) ~= nil, "call " .. i)
      end
      pool:close()
      pool:join()
      os.execute("rm -rf " .. dir)
    end)

    it("fileno() polls readable once a result may have arrived; ready() takes it", function()
      local pool = mp.Pool(1, { start_method = method })
      local ar = pool:submit(function(x) return x + 1 end, 41)
      local fd = ar:fileno()
      assert.is_true(math.type(fd) == "integer" and fd >= 0)
      local spins = 0
      while not ar:ready() do
        ar:wait(0.01)
        spins = spins + 1
        assert.is_true(spins < 5000)
      end
      assert.are.equal(42, ar:get())
      -- one descriptor for the pool, whichever AsyncResult asks
      assert.are.equal(fd, pool:submit(function() end):fileno())
      pool:close()
      pool:join()
      assert.are.equal(-1, ar:fileno())
    end)
  end)
end

---------------------------------------------------------------------------
-- The property, on a seeded random mix of faults.  A round (ROUND below, in
-- a child interpreter) makes a pool with a random initializer fault and
-- options, and makes random calls whose tasks fail in random ways, while an
-- injector SIGKILLs and SIGSTOPs random workers (idle, busy or starting).
-- Every call must return or raise within BOUND(call) seconds, close() +
-- join() or terminate() must return, and nothing may be left behind.
-- Bound of a call: every try of every task may cost the pool's timeout
-- (1 s) + the kill grace (0.5 s) + the time untaken work waits before it
-- moves (0.5 s) + a look (0.05 s), plus SLACK (20 s, for a loaded machine).

local ROUND = [==[
local mp = require "multiprocessing"
local seed, method, dir, fdt = tonumber(arg[1]), arg[2], arg[3], arg[4]
math.randomseed(seed)
local R = math.random
if fdt ~= "" then package.cpath = fdt .. "/?.so;" .. package.cpath end
local TIMEOUT, STEP, SLACK = 1, 2.05, 20
local now = require("multiprocessing.core")._now
local function pick(t) return t[R(#t)] end
local function say(...) io.write(table.concat({ ... }, "\t"), "\n") io.flush() end

local init_fault = pick { "none", "none", "none", "none", "hang1", "raise", "exit0", "exit3" }
local retries, procs = R(0, 2), R(1, 4)
local opts = { start_method = method, timeout = TIMEOUT, retries = retries,
               initargs = { dir, init_fault } }
if R(4) == 1 then opts.maxtasksperchild = R(1, 5) end
function opts.initializer(d, f)
  local pid = io.open("/proc/self/stat"):read("a"):match("^%d+")
  io.open(d .. "/pid." .. pid, "w"):close()
  if f == "hang1" and os.execute("mkdir " .. d .. "/init 2>/dev/null") then
    while true do end
  end
  if f == "raise" then error("initializer fault") end
  if f == "exit0" then os.exit(0) end
  if f == "exit3" then os.exit(3) end
end
say("pool", procs, init_fault, retries, opts.maxtasksperchild or "-")
local pool = mp.Pool(procs, opts)

-- the injector: a child of ours that signals random workers for a while
local injector = os.tmpname()
local f = io.open(injector, "w")
f:write(([[
math.randomseed(%d)
local dir = %q
for _ = 1, 40 do
  os.execute("sleep 0.2")
  local f = io.open(dir .. "/stop")
  if f then f:close() return end
  if math.random(3) == 1 then
    local pids = {}
    local ls = io.popen("ls " .. dir)
    for name in ls:lines() do pids[#pids + 1] = name:match("^pid%%.(%%d+)$") end
    ls:close()
    if #pids > 0 then
      local sig = math.random(2) == 1 and "KILL" or "STOP"
      os.execute("kill -" .. sig .. " " .. pids[math.random(#pids)] .. " 2>/dev/null")
    end
  end
end
]]):format(seed, dir))
f:close()
local inj = io.popen("lua5.4 " .. injector, "w")

-- a task: its kind decides what it does; '1' kinds fail on their first try only
local function task(x, d, kind)
  local pid = io.open("/proc/self/stat"):read("a"):match("^%d+")
  io.open(d .. "/pid." .. pid, "w"):close()
  local first = kind:sub(-1) ~= "1"
      or os.execute("mkdir " .. d .. "/t" .. x .. " 2>/dev/null")
  local k = kind:gsub("1$", "")
  if first then
    if k == "sleep" then os.execute("sleep 0.05")
    elseif k == "raise" then error("task fault " .. x)
    elseif k == "kill" then os.execute("kill -KILL " .. pid)
    elseif k == "stop" then os.execute("kill -STOP " .. pid)
    elseif k == "hang" then while true do end
    elseif k == "exit" then os.exit(5)
    elseif k == "closefds" then
      local fdtool = require "fdtool"
      fdtool.quiet()
      for fd = 3, 30 do fdtool.close(fd) end
    end
  end
  return x * 2
end

local KINDS = { "ok", "ok", "ok", "ok", "ok", "ok", "sleep", "raise", "kill1", "kill",
                "stop1", "hang1", "hang", "exit", fdt ~= "" and "closefds" or "ok" }
local nextx, worst = 0, 0
for c = 1, R(2, 5) do
  local n = R(1, 10)
  local args, faulty = {}, 0
  for i = 1, n do
    nextx = nextx + 1
    local kind = R(3) == 1 and pick(KINDS) or "ok"
    if kind ~= "ok" then faulty = faulty + 1 end
    args[i] = { nextx, dir, kind }
  end
  local how = pick { "map", "imap", "imap_unordered", "apply_async" }
  local copts = R(2) == 1 and { timeout = TIMEOUT } or nil
  local bound = (n + (faulty + 4) * (retries + 1)) * STEP + SLACK
  local t0c = now()
  local ok, err = pcall(function()
    local bad = 0
    if how == "map" then
      local r = pool:starmap(task, args, copts)
      for i = 1, n do if r[i] ~= args[i][1] * 2 then bad = bad + 1 end end
    elseif how == "imap" or how == "imap_unordered" then
      local xs = {}
      for i = 1, n do xs[i] = i end
      for i, v in pool[how](pool, function(i) return task(table.unpack(args[i])) end, xs, copts) do
        if v ~= args[i][1] * 2 then bad = bad + 1 end
      end
    else
      local ars = {}
      for i = 1, n do ars[i] = pool:apply_async(task, args[i], copts) end
      for i = 1, n do
        local v = ars[i]:get()
        if v ~= args[i][1] * 2 then bad = bad + 1 end
      end
    end
    assert(bad == 0, "wrong results: " .. bad)
  end)
  local took = now() - t0c
  worst = math.max(worst, took / bound)
  say("call", c, how, n, faulty, ok and "returned" or "raised", ("%.2f"):format(took), ("%.1f"):format(bound))
  if not ok and tostring(err):find("wrong results", 1, true) then say("WRONG", tostring(err)) end
  if took > bound then say("SLOW", c, took, bound) end
end
io.open(dir .. "/stop", "w"):close()
inj:close()
os.remove(injector)
local t0 = now()
if R(2) == 1 then
  pool:close()
  local ok, err = pcall(pool.join, pool)
  say("join", ok and "returned" or "raised: " .. tostring(err))
else
  pool:terminate()
  say("terminate", "returned")
end
local took = now() - t0
if took > procs * 2 + SLACK then say("SLOW", "end", took) end
say("END")
]==]

local function fault_rounds(method, rounds, seconds)
  local fdtool_dir = os.tmpname()
  os.remove(fdtool_dir)
  os.execute("mkdir -p " .. fdtool_dir)
  local here = debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$") or "spec"
  local built = os.execute(("cc -std=c99 -D_GNU_SOURCE -shared -fPIC -o %s/fdtool.so "
                            .. "%s/host/fdtool.c $(pkg-config --cflags lua5.4) 2>/dev/null")
                           :format(fdtool_dir, here))
  local script = H.script(ROUND)
  local base = tonumber(os.getenv("POOL_FAULT_SEED") or "") or os.time()
  local t0, done = os.time(), 0
  while done < rounds or seconds and os.time() - t0 < seconds do
    local seed = base + done
    local dir = os.tmpname()
    os.remove(dir)
    os.execute("mkdir " .. dir)
    local p = io.popen(("timeout -s KILL 300 lua5.4 %s %d %s %s %s 2>&1; echo rc=$?")
                       :format(script, seed, method, dir, built and fdtool_dir or ""))
    local out = p:read("a")
    p:close()
    -- every worker that ever ran in this round is gone
    local left = {}
    for name in io.popen("ls " .. dir):lines() do
      local pid = name:match("^pid%.(%d+)$")
      if pid and H.alive(tonumber(pid)) then left[#left + 1] = pid end
    end
    os.execute("rm -rf " .. dir)
    local why = ("seed %d (POOL_FAULT_SEED=%d, start method %s):\n%s")
                :format(seed, seed, method, out)
    assert.truthy(out:find("END\nrc=0\n", 1, true), why)
    assert.falsy(out:find("SLOW", 1, true), why)
    assert.falsy(out:find("WRONG", 1, true), why)
    assert.are.same({}, left, why)
    done = done + 1
  end
  os.remove(script)
  os.execute("rm -rf " .. fdtool_dir)
  return done
end

for _, method in ipairs(H.methods) do
  describe("mp.Pool under random faults, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("every call returns or raises in bounded time; join and terminate return; nothing is left", function()
      local soak = tonumber(os.getenv("POOL_SOAK_SECONDS") or "")
      local n = fault_rounds(method, soak and 1 or 3, soak)
      if soak then print(("\n%s: %d rounds clean in %d s"):format(method, n, soak)) end
    end)
  end)
end

for _, method in ipairs(H.methods) do
  describe("mp.Pool and the descriptor limit, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("Pool(24) starts under a soft limit of 64 descriptors (raised as mprun does)", function()
      local hard = tonumber(H.sh("sh -c 'ulimit -Hn'"):match("%d+") or "")
      if hard and hard < 400 then pending("the hard limit is " .. hard) return end
      local out = run([[
local mp = require "multiprocessing"
local pool = mp.Pool(24, { start_method = "%s" })
local r = pool:map(function(x) return x + 1 end, { 1, 2, 3 })
print("map", r[1], r[2], r[3])
pool:close()
pool:join()
print("done")
]], method, 120, "ulimit -Sn 64;")
      assert.truthy(out:find("map\t2\t3\t4\n", 1, true), out)
      assert.truthy(out:find("done\nrc=0\n", 1, true), out)
    end)

    it("a Pool that cannot start raises at the caller's line, with the core's reason", function()
      local out = run([[
local mp = require "multiprocessing"
local ok, e = pcall(function()
  local pool = mp.Pool(30, { start_method = "%s" })  -- line 4 (H.PATHS first)
  return pool
end)
print(ok, e)
local again = mp.start_processes(function(i) return i end, {}, 2, true, false, "%s")
print("again", again.n)
]], method, 120, "ulimit -n 40;")
      assert.truthy(out:find("false\t[^\n]*:4: cannot start 30 processes with start method \""
                             .. method .. "\" %(%d+ started, now terminated%): "), out)
      assert.falsy(out:find("multiprocessing/pool", 1, true), out)
      assert.truthy(out:find("again\t2\nrc=0\n", 1, true), out)
    end)
  end)
end

-- terminate(): every worker gets SIGTERM at once and SIGKILL one grace (1 s)
-- later from the engine, so 8 workers that ignore SIGTERM take about one
-- grace, not eight.  The bound (3 graces) leaves room for a loaded machine.
for _, method in ipairs(H.methods) do
  describe("mp.Pool:terminate, start method " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("ends 8 workers that ignore SIGTERM in about one grace, not eight", function()
      local out = run([[
local dir = os.tmpname()
os.remove(dir)
os.execute("mkdir " .. dir)
assert(os.execute("cc -std=c99 -shared -fPIC -o " .. dir .. "/sigtool.so spec/host/sigtool.c "
                  .. "$(pkg-config --cflags lua5.4)"))
local mp = require "multiprocessing"
local now = require("multiprocessing.core")._now
local pool = mp.Pool(8, { start_method = "%s", initargs = { dir }, initializer = function(d)
  package.cpath = d .. "/?.so;" .. package.cpath
  assert(require("sigtool").ignore_term())
  local pid = io.open("/proc/self/stat"):read("a"):match("^%d+")
  io.open(d .. "/pid." .. pid, "w"):close()
end })
-- every worker has run its initializer
local n = 0
for _ = 1, 3000 do
  n = 0
  for name in io.popen("ls " .. dir):lines() do
    if name:match("^pid%.") then n = n + 1 end
  end
  if n == 8 then break end
  os.execute("sleep 0.01")
end
print("ready", n)
local t0 = now()
pool:terminate()
local took = now() - t0
print("within 3 graces", took < 3, took)
for name in io.popen("ls " .. dir):lines() do
  local pid = name:match("^pid%.(%d+)$")
  if pid and io.open("/proc/" .. pid .. "/stat") then
    local state = io.open("/proc/" .. pid .. "/stat"):read("a"):match("%) (%a)")
    if state ~= "Z" then print("alive", pid) end
  end
end
os.execute("rm -rf " .. dir)
print("done")
]], method, 120)
      assert.truthy(out:find("ready\t8\n", 1, true), out)
      assert.truthy(out:find("within 3 graces\ttrue", 1, true), out)
      assert.falsy(out:find("alive", 1, true), out)
      assert.truthy(out:find("done\nrc=0\n", 1, true), out)
    end)
  end)
end
