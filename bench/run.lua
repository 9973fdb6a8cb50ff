-- bench/run.lua -- the driver of `make bench` (scripts/bench.sh builds the
-- floors into build/bench/ and runs this from the top of the tree).
--
-- Every measurement runs as its own process, under timeout(1), and prints
-- JSON lines with one sample per repetition: the C floors (build/bench/*),
-- the Python peers (bench/py_*.py) and the Lua side (bench/lua_*.lua, which
-- load the library).  This driver takes medians and prints one table per
-- issue.  A measurement that fails, times out or reports "skip" prints a
-- "skipped: <why>" row and the run goes on; the exit status is always 0.
--
-- Columns: median (and the p25-p75 spread of the samples) of repeated runs;
-- "x floor" is the cost per operation relative to the floor of the same
-- table (time / floor time, or floor rate / rate): 1.00x is the floor,
-- higher is slower; "vs Python" is how many times faster than the Python
-- peer of the same row (its time / our time), measured in the same run.
--
-- Environment: BENCH_QUICK=1 for fewer repetitions (a smoke run);
-- PYTHON (default python3), LUA (default lua5.4), TORCH_PYTHON (a Python
-- that imports torch, for torch's rows; default: PYTHON or /usr/bin/python3,
-- whichever does); BENCH_TOLERANCE,
-- BENCH_REMEASURE, BENCH_REMEASURE_BUDGET (bench/guard.lua: the closing
-- comparison with bench/baseline.json, which measures worse rows again).
package.path = "./bench/?.lua;" .. package.path
local json = require "json"
local guard = require "guard"   -- last.json and the comparison with bench/baseline.json

local QUICK = os.getenv("BENCH_QUICK") == "1"
local LUA = os.getenv("LUA") or "lua5.4"
local PYTHON = os.getenv("PYTHON") or "python3"
local BIN = "build/bench/"

local function reps(n) return QUICK and math.max(3, n // 5) or n end

-- ---------------------------------------------------------------- running
local function shell_ok(cmd)
  local ok = os.execute(cmd .. " >/dev/null 2>&1")
  return ok == true
end

local function readline(cmd)
  local f = io.popen(cmd .. " 2>/dev/null")
  if not f then return nil end
  local s = f:read("l")
  f:close()
  return s
end

local ERRFILE = os.tmpname()
-- where the mprun rows' commands write their lines (removed at the end: a
-- re-measure may run them again)
local OUTFILE = os.tmpname()

-- The line of a failed command's stderr that says why: the last line of a
-- Python traceback, else the first non-empty line (a Lua error message).
local function errline(path)
  local f = io.open(path)
  if not f then return nil end
  local first, last, traceback
  for l in f:lines() do
    if l:match("%S") then
      first = first or l
      last = l
      if l:match("^Traceback") then traceback = true end
    end
  end
  f:close()
  local s = traceback and last or first
  if s and #s > 160 then s = s:sub(1, 157) .. "..." end
  return s
end

-- results[key] = decoded object (samples merged over calls); skips[key] = why
local results, skips = {}, {}

local function keyof(o)
  local k = o.bench
  if o.method then k = k .. "/" .. o.method end
  if o.n then k = k .. "/" .. math.tointeger(o.n) end
  return k
end

-- Runs one measurement command (timeout seconds), records every JSON line it
-- prints; returns the number of lines recorded, when the command failed
-- why, and the list of keys it printed.
local function run(cmd, timeout, label)
  io.stderr:write(string.format("bench: %s ...\n", label or cmd))
  local f = io.popen(string.format("timeout -k 5 %d %s 2>%s", timeout, cmd, ERRFILE))
  local got, printed = 0, {}
  for line in f:lines() do
    if line:match("^%s*{") then
      local o, e = json.decode(line)
      if o and o.bench then
        local k = keyof(o)
        printed[#printed + 1] = k
        if o.skip then
          skips[k] = o.skip
        else
          local r = results[k]
          if r and r.samples and o.samples then
            for _, x in ipairs(o.samples) do r.samples[#r.samples + 1] = x end
          else
            results[k] = o
          end
        end
        got = got + 1
      else
        io.stderr:write("bench: bad output line: ", line, " (", tostring(e), ")\n")
      end
    end
  end
  local _, how, code = f:close()
  local why
  if how == "exit" and code == 124 then
    why = string.format("timed out after %d s", timeout)
  elseif how ~= "exit" or code ~= 0 then
    local st = how == "signal" and ("killed by signal " .. tostring(code))
      or ("exit status " .. tostring(code))
    local line = errline(ERRFILE)
    why = line and (line .. " (" .. st .. ")") or st
  end
  if why then io.stderr:write("bench: ", label or cmd, ": ", why, "\n") end
  return got, why, printed
end

-- Every measurement command of the run, in order: { keys (declared and
-- printed), cmd, timeout, label, seconds }.  A re-measure (bench/guard.lua)
-- runs again those that yield a flagged row's keys.
local calls, remeasuring = {}, false

-- run, and mark each of 'keys' that got no result skipped, with the reason
local function run_or_skip(keys, cmd, timeout, label)
  local t0 = os.time()
  local _, why, printed = run(cmd, timeout, label)
  for _, k in ipairs(keys) do
    if not results[k] then skips[k] = skips[k] or why or "no output" end
  end
  if not remeasuring then
    local all, seen = {}, {}
    for _, list in ipairs { keys, printed } do
      for _, k in ipairs(list) do
        if not seen[k] then all[#all + 1], seen[k] = k, true end
      end
    end
    calls[#calls + 1] = { keys = all, cmd = cmd, timeout = timeout, label = label, seconds = os.time() - t0 }
  end
end

-- ------------------------------------------------------------- statistics
local function sorted(t)
  local s = {}
  for i, x in ipairs(t) do s[i] = x end
  table.sort(s)
  return s
end

local function quantile(t, q)
  local s = sorted(t)
  if #s == 0 then return nil end
  local p = 1 + (#s - 1) * q
  local lo = math.floor(p)
  local hi = math.min(lo + 1, #s)
  return s[lo] + (s[hi] - s[lo]) * (p - lo)
end

local function median(t) return t and quantile(t, 0.5) end

local function med(key, field, res)
  local r = (res or results)[key]
  if not r then return nil end
  return median(r[field or "samples"])
end

-- -------------------------------------------------------------- printing
local function fmtnum(x)
  if x == nil then return "-" end
  local a = math.abs(x)
  if a >= 1e6 then return string.format("%.2fM", x / 1e6)
  elseif a >= 1e4 then return string.format("%.1fk", x / 1e3)
  elseif a >= 100 then return string.format("%.0f", x)
  elseif a >= 10 then return string.format("%.1f", x)
  elseif a >= 1 then return string.format("%.2f", x)
  else return string.format("%.3f", x) end
end

local function fmtx(x)
  if x == nil then return "" end
  if x >= 100 then return string.format("%.0fx", x) end
  if x >= 10 then return string.format("%.1fx", x) end
  return string.format("%.2fx", x)
end

local function tabulate(headers, rows)
  local w = {}
  for i, h in ipairs(headers) do w[i] = #h end
  for _, r in ipairs(rows) do
    if r.skip then w[1] = math.max(w[1], #r[1])
    elseif not r.note then
      for i = 1, #headers do w[i] = math.max(w[i], #(r[i] or "")) end
    end
  end
  local function line(cells)
    local out = {}
    for i = 1, #headers do
      local c = cells[i] or ""
      if i == 1 then out[i] = c .. string.rep(" ", w[i] - #c)
      else out[i] = string.rep(" ", w[i] - #c) .. c end
    end
    return "  " .. table.concat(out, "  "):gsub("%s+$", "")
  end
  print(line(headers))
  local dash = {}
  for i = 1, #headers do dash[i] = string.rep("-", w[i]) end
  print("  " .. table.concat(dash, "  "))
  for _, r in ipairs(rows) do
    if r.note then print("    " .. r.note)
    elseif r.skip then print("  " .. r[1] .. string.rep(" ", w[1] - #r[1]) .. "  skipped: " .. r.skip)
    else print(line(r)) end
  end
end

local HEAD = { "row", "median", "unit", "p25..p75", "x floor", "vs Python", "target" }

-- One row.  spec = { name, key, unit, field, rate = true (higher is better),
--   floor = key of the floor, py = key of the Python peer,
--   target = { max = x floor limit } or { abs = limit in the row's unit } }

-- The figures of one row from a set of results (this run's, or a
-- re-measure's): median, p25, p75, x floor, vs Python; nil without a result.
local function figures(spec, res)
  local r = res[spec.key]
  local samples = r and r[spec.field or "samples"]
  if not samples or #samples == 0 then return nil end
  local m = median(samples)
  local p25, p75 = quantile(samples, 0.25), quantile(samples, 0.75)
  local function cost(other)      -- our cost per op relative to 'other'
    if not other or other == 0 or m == 0 then return nil end
    if spec.rate then return other / m else return m / other end
  end
  local xf, vp
  if spec.floor then xf = cost(med(spec.floor, spec.floor_field, res)) end
  if spec.is_floor then xf = 1 end
  if spec.py then
    local c = cost(med(spec.py, spec.py_field, res))
    if c then vp = 1 / c end
  end
  return m, p25, p75, xf, vp
end

local function row(rows, spec)
  local m, p25, p75, xf, vp = figures(spec, results)
  if not m then
    local why = skips[spec.key] or "no result"
    -- a skip reason is free text: it runs past the columns
    rows[#rows + 1] = { spec.name, skip = (why:gsub("^skipped: ", "")) }
    guard.skip(spec, rows[#rows].skip)
    return
  end
  local tgt = ""
  if spec.target then
    local t = spec.target
    if t.max and xf then
      tgt = string.format("<= %.1fx %s", t.max, xf <= t.max and "ok" or "MISS")
    elseif t.abs then
      tgt = string.format("< %s %s %s", fmtnum(t.abs), spec.unit,
        m < t.abs and "ok" or "MISS")
    end
  end
  rows[#rows + 1] = { spec.name, fmtnum(m), spec.unit,
    fmtnum(p25) .. ".." .. fmtnum(p75), fmtx(xf), vp and fmtx(vp) or "", tgt }
  guard.record(spec, m, p25, p75, xf, vp)
end

local function section(title)
  guard.table(title)
  print("")
  print(title)
  print(string.rep("=", #title))
end

-- ------------------------------------------------------------------ setup
local has_python = shell_ok("command -v " .. PYTHON)
local function pyver()
  return has_python and readline(PYTHON .. " -c 'import sys; print(sys.version.split()[0])'")
end
local nproc = readline("nproc") or "?"
local kernel = readline("uname -sr") or "?"
local cpu = readline("sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1") or "?"
local luav = (readline(LUA .. " -v") or "?"):match("^Lua [%d.]+") or "?"
local t_start = os.time()

print("lua-multiprocessing benchmarks" .. (QUICK and " (BENCH_QUICK: fewer repetitions)" or ""))
print(string.format("machine: %s cores, %s, %s", nproc, kernel, cpu))
print(string.format("lua: %s; python: %s; date: %s", luav,
  has_python and (pyver() or "?") or "missing (python rows skipped)",
  os.date("!%Y-%m-%d %H:%M UTC")))
local function loadavg()
  local f = io.open("/proc/loadavg")
  local s = f and f:read("l") or "?"
  if f then f:close() end
  return s:match("^(%S+ %S+ %S+)") or s
end
local load_before = loadavg()
-- CPU pressure (/proc/pressure/cpu, "some"): the share of the time some
-- runnable task waited for a CPU; over the measurements, beside the loads
-- (nil where the kernel has no PSI)
local function cpu_waited()
  local f = io.open("/proc/pressure/cpu")
  local u = io.open("/proc/uptime")
  if not (f and u) then
    if f then f:close() end
    if u then u:close() end
    return nil
  end
  local us = tonumber(f:read("l"):match("total=(%d+)"))
  local up = tonumber(u:read("l"):match("^(%S+)"))
  f:close()
  u:close()
  return us and up and { us = us, up = up }
end
local psi_start = cpu_waited()
print(string.format("load average before the run: %s (other work on the machine skews every row)", load_before))
print("medians of repeated runs (p25..p75 beside); 'x floor' = cost per operation / the floor's,")
print("'vs Python' = times faster than the Python peer; all ratios from this one run.")

-- Runs a peer's script under 'python' as run_or_skip does; with no such
-- Python, its rows are skipped, saying 'why'.
local function python_peer(python, why)
  return function(keys, script, args, timeout)
    if not python then
      for _, k in ipairs(keys) do skips[k] = why end
      return
    end
    run_or_skip(keys, python .. " bench/" .. script .. " " .. args, timeout, script .. " " .. args)
  end
end
local py = python_peer(has_python and PYTHON, "python3 not found")

-- torch's peers (torch.multiprocessing, torchrun) run under the first of
-- $TORCH_PYTHON, $PYTHON and /usr/bin/python3 that imports torch (Debian's
-- python3-torch is /usr/bin/python3's); with none, their rows say so.
local TORCH_PY
for _, p in ipairs { os.getenv("TORCH_PYTHON") or false, PYTHON, "/usr/bin/python3" } do
  if p and shell_ok(p .. " -c 'import torch.multiprocessing'") then
    TORCH_PY = p
    break
  end
end
local NOTORCH = "no python3 here imports torch (apt-get install python3-torch, or TORCH_PYTHON=...)"
local torch = python_peer(TORCH_PY, NOTORCH)

local function floor(keys, prog, args, timeout)
  if not shell_ok("test -x " .. BIN .. prog) then
    for _, k in ipairs(keys) do skips[k] = BIN .. prog .. " not built" end
    return
  end
  run_or_skip(keys, BIN .. prog .. " " .. args, timeout, prog .. " " .. args)
end

local function lua(keys, script, args, timeout)
  run_or_skip(keys, LUA .. " bench/" .. script .. " " .. args, timeout, script .. " " .. args)
end

-- ============================================================ measurement
-- Issue 2: start+join of N trivial fork workers.  Floor and ours alternate in
-- two rounds, so that drift of a noisy machine hits both alike.
local NS = { 1, 16, 64 }
local function keys(prefix, method, ns)
  local t = {}
  for _, n in ipairs(ns) do t[#t + 1] = prefix .. (method and ("/" .. method) or "") .. "/" .. n end
  return t
end
for _ = 1, 2 do
  floor(keys("floor_fork", nil, NS), "floor_fork", reps(15) .. " 1 16 64", 120)
  -- ours alternates with its Lua floor (floor_fork_lua) in one process
  lua(table.move(keys("floor_fork_lua", nil, NS), 1, #NS, #NS + 1, keys("lua_start", "fork", NS)),
      "lua_start.lua", "fork " .. reps(15) .. " 1 16 64", 120)
  floor(keys("floor_fork_safe", nil, NS), "floor_fork", "--safe " .. reps(15) .. " 1 16 64", 120)
end
-- Issue 17: system calls per fork worker, ours and the floor's (strace -f -c;
-- skipped, saying so, where strace is missing).
lua({ "syscalls/fork/64", "floor_syscalls/64", "floor_syscalls_safe/64" }, "lua_syscalls.lua",
    reps(10) .. " 64", 240)
py({ "py_start/fork/1" }, "py_start.py", "fork " .. reps(30) .. " 1", 120)
py({ "py_start/fork/16" }, "py_start.py", "fork " .. reps(10) .. " 16", 120)
py({ "py_start/fork/64" }, "py_start.py", "fork " .. reps(5) .. " 64", 120)

for _ = 1, 2 do
  floor({ "floor_fork/8" }, "floor_fork", reps(15) .. " 8", 60)
  lua({ "lua_fail" }, "lua_fail.lua", reps(10), 120)
end
py({ "py_fail" }, "py_fail.py", reps(20), 120)
torch({ "torch_fail" }, "py_torch.py", "fail " .. reps(5), 180)

-- Issue 3: 16 trivial workers under each start method.
for _ = 1, 2 do
  floor({ "floor_fork/16" }, "floor_fork", reps(15) .. " 16", 60)
  floor({ "floor_spawn/16" }, "floor_spawn", reps(15) .. " " .. LUA .. " 16", 120)
  for _, m in ipairs { "fork", "spawn", "forkserver" } do
    lua({ "lua_start/" .. m .. "/16" }, "lua_start.lua", m .. " " .. reps(15) .. " 16", 120)
  end
end
py({ "py_start/spawn/16" }, "py_start.py", "spawn " .. reps(5) .. " 16", 150)
py({ "py_start/forkserver/16" }, "py_start.py", "forkserver " .. reps(7) .. " 16", 150)
torch({ "torch_start/fork/16" }, "py_torch.py", "start fork " .. reps(5) .. " 16", 180)
-- each spawned torch worker imports torch (~1.5 s of CPU): one round
if QUICK then
  skips["torch_start/spawn/16"] = "BENCH_QUICK: torch's spawn takes ~25 s for 16"
else
  torch({ "torch_start/spawn/16" }, "py_torch.py", "start spawn 1 16", 300)
end

-- Issue 4: messages.
-- Two rounds of 3 repetitions each, floor, ours and Python's in turn (a
-- quick run: one round of the same sizes; at a fifth of them a warm-up
-- weighs more, and the ping-pong's ratio moved 30-60 %).
local MREPS, RTS, MIBS, SENDS, SHM = 3, 5000, 100, 500, 256
local msgargs = string.format("%d %d %d %d %d", MREPS, RTS, MIBS, SENDS, SHM)
for _ = 1, QUICK and 1 or 2 do
  floor({ "floor_pipe_pingpong", "floor_pipe_mib" }, "floor_pipe",
    string.format("%d %d %d", MREPS, RTS, MIBS), 120)
  floor({ "floor_fdpass" }, "floor_fdpass", string.format("%d %d %d", MREPS, SENDS, SHM), 60)
  lua({ "lua_queue_pingpong", "lua_pipe_pingpong", "lua_queue_mib", "lua_pipe_mib",
        "lua_queue_array" }, "lua_msg.lua", msgargs, 150)
  py({ "py_queue_pingpong", "py_pipe_pingpong", "py_queue_mib", "py_pipe_mib",
       "py_queue_shm" }, "py_msg.py", msgargs, 150)
end

-- Issue 13: mp.Pool(4) against multiprocessing.Pool(4), same workloads;
-- pool start+close+join against start_processes of 4 with the same method.
-- The maps keep their size in a quick run: a map call has a fixed cost, so
-- at 20,000 tasks its rate and its ratio to Python's are not the full run's
-- (chunksize 1: 90-133x Python against the baseline's 276x, REGRESSED in a
-- smoke run of an unchanged tree).
local PMAP, PAPPLY = 100000, QUICK and 5000 or 20000
for _ = 1, QUICK and 1 or 2 do
  lua({ "lua_pool_map1/fork", "lua_pool_mapdef/fork", "lua_pool_unord/fork", "lua_pool_starmap/fork",
        "lua_pool_apply/fork", "lua_pool_start_heap/fork" }, "lua_pool.lua",
      string.format("fork %d %d %d", reps(5), PMAP, PAPPLY), 240)
  py({ "py_pool_map1/fork", "py_pool_mapdef/fork", "py_pool_unord/fork", "py_pool_starmap/fork",
       "py_pool_apply/fork", "py_pool_start_heap/fork" },
     "py_pool.py", string.format("fork %d %d %d", reps(3), PMAP, PAPPLY), 300)
end
-- issue 20 item 8: a worker replaced after every task; tasks per second,
-- so Python's row, which takes ~0.2 s a task on this VM, runs a tenth
local PMAXT = QUICK and 100 or 2000
lua({ "lua_pool_maxtasks/fork" }, "lua_pool.lua", string.format("fork 1 0 0 %d", PMAXT), 300)
py({ "py_pool_maxtasks/fork" }, "py_pool.py", string.format("fork 1 0 0 %d", PMAXT // 10), 300)

-- Issue 17: the codec alone, against pickle and memcpy of the same bytes.
for _ = 1, QUICK and 1 or 2 do
  lua({ "lua_codec/ints", "lua_codec/floats", "lua_codec/strings", "lua_codec/nested",
        "floor_memcpy/ints", "floor_memcpy/floats", "floor_memcpy/strings", "floor_memcpy/nested" },
      "lua_codec.lua", tostring(reps(5)), 180)
  py({ "py_codec/ints", "py_codec/floats", "py_codec/strings", "py_codec/nested" },
     "py_codec.py", tostring(reps(5)), 240)
end
-- Pool start in a fresh process, its floor (start_processes of 4, the
-- same method) alternated with it in that process
for _, m in ipairs { "fork", "spawn", "forkserver" } do
  lua({ "lua_pool_start/" .. m, "lua_start/" .. m .. "/4" }, "lua_pool.lua",
      string.format("%s %d 0 0", m, reps(15)), 120)
  py({ "py_pool_start/" .. m }, "py_pool.py", string.format("%s %d 0 0", m, reps(3)), 240)
end

-- Issue 9: the example engine host's frames while workers start, are
-- polled, fail and are closed (the host's module path is this tree's).
lua({ "lua_frames/fork", "lua_frames/spawn", "lua_frames/forkserver" }, "lua_frames.lua",
    tostring(reps(5)), 300)

-- ================================================================ tables
-- Results of the repeated rounds above are pooled per key.
section("Issue 2: start+join of N trivial fork workers (function() end)")
for _, n in ipairs(NS) do
  local rows = {}
  local fk = "floor_fork/" .. n
  row(rows, { name = "C fork+_exit+waitpid (floor)", key = fk, unit = "ms", is_floor = true })
  row(rows, { name = "lua mp.start_processes fork", key = "lua_start/fork/" .. n, unit = "ms",
              floor = fk, py = "py_start/fork/" .. n, target = { max = 1.5 } })
  row(rows, { name = "python multiprocessing fork", key = "py_start/fork/" .. n, unit = "ms",
              floor = fk })
  row(rows, { name = "C floor + each worker's guarantees", key = "floor_fork_safe/" .. n, unit = "ms",
              floor = fk })
  row(rows, { name = "Lua floor: the guarantees + fn called", key = "floor_fork_lua/" .. n, unit = "ms",
              floor = fk })
  print("")
  print(string.format("N = %d", n))
  tabulate(HEAD, rows)
  local l, g, lf = med("lua_start/fork/" .. n), med("floor_fork_safe/" .. n), med("floor_fork_lua/" .. n)
  if l and g then
    print(string.format("    lua against the floor with the guarantees: %s", fmtx(l / g)))
  end
  if l and lf then
    print(string.format("    lua against the Lua floor (measured beside it): %s", fmtx(l / lf)))
  end
end
print("    the guarantees: the child's own group, SIGINT's handler dropped, the lifeline, its name;")
print("    the parent's pidfd, group sweep and reap through it (bench/guarantees.h).  The Lua floor:")
print("    forks of the bench's own Lua process that keep them and call fn(i) with lua_pcall, then")
print("    flush and _exit (benchclock.fork_floor): what any fork worker running Lua does")

section("Issue 2: failure latency, 8 fork workers, worker 3 raises, the others sleep")
do
  local rows = {}
  row(rows, { name = "C fork+_exit+waitpid of 8 (floor of the start)", key = "floor_fork/8",
              unit = "ms", is_floor = true })
  row(rows, { name = "lua: start -> exception held, all reaped", key = "lua_fail", unit = "ms",
              py = "py_fail", target = { abs = 5 } })
  row(rows, { name = "lua: start_processes alone (join=false)", key = "lua_fail", field = "start",
              unit = "ms", floor = "floor_fork/8", py = "py_fail", py_field = "start" })
  row(rows, { name = "python wait loop: start -> exception, reaped", key = "py_fail", unit = "ms" })
  row(rows, { name = "python: starting the 8", key = "py_fail", field = "start", unit = "ms",
              floor = "floor_fork/8" })
  row(rows, { name = "torch start_processes: start -> ProcessRaisedException", key = "torch_fail",
              unit = "ms" })
  tabulate(HEAD, rows)
  local l, t = med("lua_fail"), med("torch_fail")
  if l and t then print(string.format("    vs torch: %s faster", fmtx(t / l))) end
  local lf, pf = results.lua_fail, results.py_fail
  local function after(r)
    if not r then return nil end
    return median(r.samples) - median(r.start)
  end
  if lf or pf then
    local a = after(lf)
    print(string.format("    after the start (median total - median start): lua %s ms%s, python %s ms",
      fmtnum(a), a and (a < 5 and " (< 5 ms ok)" or " (>= 5 ms MISS)") or "", fmtnum(after(pf))))
  end
  if lf and lf.left then
    print(string.format("    lua: children of the parent still present when the exception arrived: %d (0 = all reaped)",
      math.tointeger(lf.left) or lf.left))
  end
end

section("Issue 3: start+join of 16 trivial workers per start method")
do
  local rows = {}
  row(rows, { name = "C fork+_exit+waitpid x16 (fork floor)", key = "floor_fork/16", unit = "ms",
              is_floor = true })
  row(rows, { name = "C posix_spawn `lua5.4 -e ''` x16 (spawn floor)", key = "floor_spawn/16",
              unit = "ms", is_floor = true })
  row(rows, { name = "lua fork", key = "lua_start/fork/16", unit = "ms", floor = "floor_fork/16",
              py = "py_start/fork/16", target = { max = 1.5 } })
  row(rows, { name = "lua spawn", key = "lua_start/spawn/16", unit = "ms", floor = "floor_spawn/16",
              py = "py_start/spawn/16", target = { max = 1.5 } })
  row(rows, { name = "lua forkserver (server running)", key = "lua_start/forkserver/16", unit = "ms",
              floor = "floor_fork/16", py = "py_start/forkserver/16", target = { max = 2 } })
  row(rows, { name = "python fork (issue 2 run)", key = "py_start/fork/16", unit = "ms",
              floor = "floor_fork/16" })
  row(rows, { name = "python spawn", key = "py_start/spawn/16", unit = "ms", floor = "floor_spawn/16" })
  row(rows, { name = "python forkserver (server running)", key = "py_start/forkserver/16", unit = "ms",
              floor = "floor_fork/16" })
  row(rows, { name = "torch start_processes, fork", key = "torch_start/fork/16", unit = "ms",
              floor = "floor_fork/16" })
  row(rows, { name = "torch start_processes, spawn (one round)", key = "torch_start/spawn/16",
              unit = "ms", floor = "floor_spawn/16" })
  tabulate(HEAD, rows)
  local vs = {}
  for _, m in ipairs { "fork", "spawn" } do
    local l, t = med("lua_start/" .. m .. "/16"), med("torch_start/" .. m .. "/16")
    if l and t then vs[#vs + 1] = string.format("%s %s", m, fmtx(t / l)) end
  end
  if #vs > 0 then print("    vs torch (times faster): " .. table.concat(vs, ", ")) end
  print("    x floor: spawn rows against the posix_spawn floor, fork and forkserver rows against the fork floor")
end

section("Issue 17: system calls per fork worker, parent and child together (strace -f -c)")
do
  local rows = {}
  row(rows, { name = "C fork+_exit+waitpid (floor)", key = "floor_syscalls/64", unit = "calls",
              is_floor = true })
  row(rows, { name = "lua mp.start_processes fork, 64 workers", key = "syscalls/fork/64",
              unit = "calls", floor = "floor_syscalls/64", target = { abs = 12 } })
  row(rows, { name = "C floor + each worker's guarantees", key = "floor_syscalls_safe/64",
              unit = "calls", floor = "floor_syscalls/64" })
  tabulate(HEAD, rows)
  local r = results["syscalls/fork/64"]
  if r and r.calls then print("    ours by call: " .. r.calls) end
  print("    per worker, start to reap; exit_group returns nowhere, so strace counts it on neither side")
end

section("Issue 4: messages between the parent and one fork worker")
do
  local rows = {}
  print("")
  print("24-byte message ping-pong (round trips per second; higher is better)")
  row(rows, { name = "C pipes, one write per message (floor)", key = "floor_pipe_pingpong",
              unit = "rt/s", rate = true, is_floor = true })
  row(rows, { name = "lua mp.Queue (two queues)", key = "lua_queue_pingpong", unit = "rt/s",
              rate = true, floor = "floor_pipe_pingpong", py = "py_queue_pingpong" })
  row(rows, { name = "lua mp.Pipe", key = "lua_pipe_pingpong", unit = "rt/s", rate = true,
              floor = "floor_pipe_pingpong", py = "py_pipe_pingpong" })
  row(rows, { name = "python Queue (two queues)", key = "py_queue_pingpong", unit = "rt/s",
              rate = true, floor = "floor_pipe_pingpong" })
  row(rows, { name = "python Pipe", key = "py_pipe_pingpong", unit = "rt/s", rate = true,
              floor = "floor_pipe_pingpong" })
  tabulate(HEAD, rows)
  local function rt_us(k)
    local m = med(k)
    return m and fmtnum(1e6 / m) or "-"
  end
  local function cpu_us(k)
    local m = med(k, "cpu")
    return m and fmtnum(m) or "-"
  end
  local PP = { { "floor", "floor_pipe_pingpong" }, { "lua Queue", "lua_queue_pingpong" },
               { "lua Pipe", "lua_pipe_pingpong" }, { "python Queue", "py_queue_pingpong" },
               { "python Pipe", "py_pipe_pingpong" } }
  local a, b = {}, {}
  for i, p in ipairs(PP) do
    a[i] = p[1] .. " " .. rt_us(p[2])
    b[i] = p[1] .. " " .. cpu_us(p[2])
  end
  print("    round trip in us: " .. table.concat(a, ", "))
  print("    parent CPU per round trip in us: " .. table.concat(b, ", "))

  rows = {}
  print("")
  print("1 MiB strings one way (MB/s, 10^6 bytes; higher is better)")
  row(rows, { name = "C pipe, 1 MiB writes (floor)", key = "floor_pipe_mib", unit = "MB/s",
              rate = true, is_floor = true })
  row(rows, { name = "lua mp.Queue", key = "lua_queue_mib", unit = "MB/s", rate = true,
              floor = "floor_pipe_mib", py = "py_queue_mib" })
  row(rows, { name = "lua mp.Pipe", key = "lua_pipe_mib", unit = "MB/s", rate = true,
              floor = "floor_pipe_mib", py = "py_pipe_mib" })
  row(rows, { name = "python Queue", key = "py_queue_mib", unit = "MB/s", rate = true,
              floor = "floor_pipe_mib" })
  row(rows, { name = "python Pipe", key = "py_pipe_mib", unit = "MB/s", rate = true,
              floor = "floor_pipe_mib" })
  tabulate(HEAD, rows)

  rows = {}
  print("")
  print(string.format("an already shared %d MiB array through a Queue; the worker reads one element and replies (us per send)", SHM))
  row(rows, { name = "C memfd by SCM_RIGHTS, mmap+read+munmap (floor)", key = "floor_fdpass",
              unit = "us", is_floor = true })
  row(rows, { name = "lua mp.Array('uint8') via mp.Queue", key = "lua_queue_array", unit = "us",
              floor = "floor_fdpass", py = "py_queue_shm", target = { abs = 50 } })
  row(rows, { name = "python SharedMemory via Queue", key = "py_queue_shm", unit = "us",
              floor = "floor_fdpass" })
  tabulate(HEAD, rows)
  local la = results.lua_queue_array
  local qp = med("lua_queue_pingpong")
  if la then
    print(string.format("    lua: creating the shared array took %s ms; a send minus one 24-byte Queue round trip: %s us (torch: ~700 us)",
      fmtnum(la.create_ms), qp and fmtnum(median(la.samples) - 1e6 / qp) or "-"))
  end
end

-- ================================================ Issue 10: mprun
-- Whole commands, start to exit, timed by build/bench/time_cmd (posix_spawn
-- and wait, like the floors): mprun against 16 posix_spawns of the bare
-- interpreter, torchrun when it is installed, and 4 ranks' output through
-- mprun against the same 4 programs writing straight to a file.
do
  local MPRUN = "./scripts/mprun"
  local OUT = OUTFILE
  local LINES = QUICK and 100000 or 1000000
  local chunk = string.format("'local r = os.getenv(\"RANK\") for i = 1, %d do "
    .. "io.write(r, \" line \", i, \"\\n\") end'", LINES)
  local function timed(key, reps_, par, cmd, timeout)
    floor({ key }, "time_cmd", string.format("%s %d %d %s %s", key, reps_, par, OUT, cmd), timeout)
  end
  for _ = 1, 2 do
    floor({ "floor_spawn/16" }, "floor_spawn", reps(15) .. " " .. LUA .. " 16", 120)
    timed("mprun_start", reps(15), 1, MPRUN .. " -n 16 --quiet -e ''", 120)
    timed("lines_direct", reps(5), 4, LUA .. " -e " .. chunk, 300)
    timed("lines_mprun", reps(5), 1, MPRUN .. " -n 4 --quiet -e " .. chunk, 300)
  end
  -- torchrun: torch's own launcher, mended for Debian's torch 1.13 under
  -- Python 3.11 (bench/torchrun.py says how); GNU parallel: the shell's
  -- way to run 16 programs at once, and to relay their lines tagged
  if TORCH_PY then
    local script = os.tmpname()
    timed("torchrun_start", QUICK and 1 or 3, 1,
          TORCH_PY .. " bench/torchrun.py --nproc_per_node 16 " .. script, 600)
    os.remove(script)
  else
    skips.torchrun_start = NOTORCH
  end
  if shell_ok("command -v parallel") then
    local ranks = "::: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"
    timed("parallel_start", reps(5), 1,
          "parallel --will-cite -j 16 -N0 " .. LUA .. " -e \"''\" " .. ranks, 120)
    timed("parallel_lines", reps(5), 1, "parallel --will-cite -q -j 4 --line-buffer --tag env RANK={} "
          .. LUA .. " -e " .. chunk .. " ::: 0 1 2 3", 300)
  else
    skips.parallel_start = "GNU parallel not installed (apt-get install parallel)"
    skips.parallel_lines = skips.parallel_start
  end

  section("Issue 10: mprun")
  local rows = {}
  print("")
  print("start to exit of 16 ranks of an empty chunk")
  row(rows, { name = "C posix_spawn `lua5.4 -e ''` x16 (floor)", key = "floor_spawn/16",
              unit = "ms", is_floor = true })
  row(rows, { name = "mprun -n 16 -e ''", key = "mprun_start", unit = "ms",
              floor = "floor_spawn/16", target = { max = 1.5 } })
  row(rows, { name = "torchrun --nproc_per_node 16 (empty script)", key = "torchrun_start",
              unit = "ms", floor = "floor_spawn/16" })
  row(rows, { name = "GNU parallel -j 16, 16 x lua5.4 -e ''", key = "parallel_start",
              unit = "ms", floor = "floor_spawn/16" })
  tabulate(HEAD, rows)
  local m = med("mprun_start")
  for _, peer in ipairs { { "torchrun", "torchrun_start" }, { "GNU parallel", "parallel_start" } } do
    local t = med(peer[2])
    if m and t then print(string.format("    %s / mprun: %s", peer[1], fmtx(t / m))) end
  end

  rows = {}
  print("")
  print(string.format("4 ranks printing %d short lines each (ms; stdout to a file)", LINES))
  row(rows, { name = "4 x lua5.4 writing straight to the file (floor)", key = "lines_direct",
              unit = "ms", is_floor = true })
  row(rows, { name = "mprun -n 4, prefixed lines relayed to the file", key = "lines_mprun",
              unit = "ms", floor = "lines_direct" })
  row(rows, { name = "GNU parallel -j 4 --line-buffer --tag, the same 4", key = "parallel_lines",
              unit = "ms", floor = "lines_direct" })
  tabulate(HEAD, rows)
  local l = med("lines_mprun")
  if l then
    print(string.format("    mprun relays %s lines/s", fmtnum(4 * LINES / (l / 1e3))))
  end
end

section("Issue 13: mp.Pool(4) vs multiprocessing.Pool(4), trivial tasks f(x) = x")
do
  local rows = {}
  print("")
  print("tasks per second (higher is better)")
  row(rows, { name = string.format("lua map, %d tasks, chunksize 1", PMAP), key = "lua_pool_map1/fork",
              unit = "tasks/s", rate = true, py = "py_pool_map1/fork" })
  row(rows, { name = string.format("lua apply_async+get, %d tasks", PAPPLY), key = "lua_pool_apply/fork",
              unit = "tasks/s", rate = true, py = "py_pool_apply/fork" })
  row(rows, { name = string.format("lua map, %d tasks, default chunking", PMAP),
              key = "lua_pool_mapdef/fork", unit = "tasks/s", rate = true,
              py = "py_pool_mapdef/fork" })
  row(rows, { name = string.format("lua imap_unordered, %d tasks, chunksize %d", PMAP, (PMAP + 15) // 16),
              key = "lua_pool_unord/fork", unit = "tasks/s", rate = true, py = "py_pool_unord/fork" })
  row(rows, { name = string.format("lua starmap, %d tasks, default chunking", PMAP),
              key = "lua_pool_starmap/fork", unit = "tasks/s", rate = true, py = "py_pool_starmap/fork" })
  row(rows, { name = string.format("lua map, %d tasks, maxtasksperchild = 1", PMAXT),
              key = "lua_pool_maxtasks/fork", unit = "tasks/s", rate = true, py = "py_pool_maxtasks/fork" })
  row(rows, { name = "python map, chunksize 1", key = "py_pool_map1/fork", unit = "tasks/s",
              rate = true })
  row(rows, { name = "python apply_async+get", key = "py_pool_apply/fork", unit = "tasks/s",
              rate = true })
  row(rows, { name = "python map, default chunking", key = "py_pool_mapdef/fork", unit = "tasks/s",
              rate = true })
  row(rows, { name = "python imap_unordered, same chunksize", key = "py_pool_unord/fork", unit = "tasks/s",
              rate = true })
  row(rows, { name = "python starmap, default chunking", key = "py_pool_starmap/fork", unit = "tasks/s",
              rate = true })
  row(rows, { name = string.format("python map, %d tasks, maxtasksperchild = 1", PMAXT // 10),
              key = "py_pool_maxtasks/fork", unit = "tasks/s", rate = true })
  tabulate(HEAD, rows)
  -- the floor: a task through a pool that sent one message each way per
  -- task could not beat one Queue round trip
  local rt = med("lua_queue_pingpong")
  if rt then
    local function per(k)
      local m = med(k)
      return m and fmtx(m / rt) or "-"
    end
    print(string.format("    floor: raw mp.Queue round trips, %s rt/s in this run; tasks per round trip's time: "
      .. "map chunksize 1 %s, apply_async %s, map default chunking %s", fmtnum(rt),
      per("lua_pool_map1/fork"), per("lua_pool_apply/fork"), per("lua_pool_mapdef/fork")))
  end
  local function ratio(a, b)
    local x, y = med(a), med(b)
    return x and y and x / y
  end
  local function verdict(r, want)
    if not r then return "-" end
    return string.format("%s (target >= %gx: %s)", fmtx(r), want, r >= want and "ok" or "MISS")
  end
  print("    vs Python: map chunksize 1 " .. verdict(ratio("lua_pool_map1/fork", "py_pool_map1/fork"), 10)
        .. "; apply_async " .. verdict(ratio("lua_pool_apply/fork", "py_pool_apply/fork"), 10)
        .. "; map default chunking " .. verdict(ratio("lua_pool_mapdef/fork", "py_pool_mapdef/fork"), 2))
  local mt = med("lua_pool_maxtasks/fork")
  if mt then
    print(string.format("    maxtasksperchild = 1: %s ms a task with its worker's replacement (python %s ms)",
      fmtnum(1e3 / mt), med("py_pool_maxtasks/fork") and fmtnum(1e3 / med("py_pool_maxtasks/fork")) or "-"))
  end

  rows = {}
  print("")
  print("pool of 4: start + close + join (ms); floor: start_processes of 4 trivial workers, same method,")
  print("alternated with the pools in one process")
  for _, m in ipairs { "fork", "spawn", "forkserver" } do
    row(rows, { name = "lua start_processes x4, " .. m .. " (floor)", key = "lua_start/" .. m .. "/4",
                unit = "ms", is_floor = true })
    row(rows, { name = "lua mp.Pool(4), " .. m, key = "lua_pool_start/" .. m, unit = "ms",
                floor = "lua_start/" .. m .. "/4", py = "py_pool_start/" .. m, target = { max = 1.5 } })
    row(rows, { name = "python Pool(4), " .. m, key = "py_pool_start/" .. m, unit = "ms",
                floor = "lua_start/" .. m .. "/4" })
  end
  -- the same after the throughput rows, in their process: each fork copies
  -- its 12 MB heap (Python's, its lists)
  row(rows, { name = "lua mp.Pool(4), fork, 12 MB heap", key = "lua_pool_start_heap/fork", unit = "ms",
              floor = "lua_start/fork/4", py = "py_pool_start_heap/fork" })
  row(rows, { name = "python Pool(4), fork, after its maps", key = "py_pool_start_heap/fork", unit = "ms",
              floor = "lua_start/fork/4" })
  tabulate(HEAD, rows)
end

section("Issue 17: the codec, encode + decode, against pickle (protocol 5) and memcpy of the same bytes")
do
  local KINDS = { { "ints", "10^6 integers" }, { "floats", "10^6 floats" },
                  { "strings", "10^5 short strings" }, { "nested", "10^4 records {id, name, score, tags = {2}}" } }
  local rows = {}
  print("ns per element (per record for nested); x floor: against one memcpy of our encoding's bytes")
  for _, k in ipairs(KINDS) do
    local kind = k[1]
    row(rows, { name = "memcpy of the encoding, " .. k[2] .. " (floor)", key = "floor_memcpy/" .. kind,
                unit = "ns", is_floor = true })
    row(rows, { name = "lua core.encode + core.decode, " .. k[2], key = "lua_codec/" .. kind, unit = "ns",
                floor = "floor_memcpy/" .. kind, py = "py_codec/" .. kind })
    row(rows, { name = "python pickle.dumps + loads, " .. k[2], key = "py_codec/" .. kind, unit = "ns",
                floor = "floor_memcpy/" .. kind })
  end
  tabulate(HEAD, rows)
  for _, k in ipairs(KINDS) do
    local l, p = results["lua_codec/" .. k[1]], results["py_codec/" .. k[1]]
    if l then
      print(string.format("    %-8s lua encode %s + decode %s ns, %s bytes; python dumps %s + loads %s ns, %s bytes",
        k[1], fmtnum(median(l.enc)), fmtnum(median(l.dec)), fmtnum(l.bytes),
        p and fmtnum(median(p.enc)) or "-", p and fmtnum(median(p.dec)) or "-", p and fmtnum(p.bytes) or "-"))
    end
  end
end

section("Issue 9: an engine's 60 Hz frame loop (examples/frame_host) during start, polls and a failure")
do
  local BUDGET = 1000 / 60
  print(string.format("worst frame of each run (frame budget %.2f ms), and the worst step of each kind in it;", BUDGET))
  print("the failure: 4 workers ignoring SIGTERM, one fails; join(0, 0.5) polled each frame until SIGKILL")
  for _, m in ipairs { "fork", "spawn", "forkserver" } do
    local rows, k = {}, "lua_frames/" .. m
    row(rows, { name = "worst frame", key = k, unit = "ms", target = { abs = BUDGET } })
    row(rows, { name = "worst join(0) step", key = k, field = "join0", unit = "ms", target = { abs = 5 } })
    row(rows, { name = "close() of TERM-ignoring workers", key = k, field = "close", unit = "ms",
                target = { abs = 5 } })
    row(rows, { name = "worst GC step (collects a context)", key = k, field = "gc", unit = "ms",
                target = { abs = 5 } })
    print("")
    print("start method " .. m .. " (spawn, forkserver: the workers are the host binary)")
    tabulate(HEAD, rows)
  end
end

-- ============================================================ re-measure
-- bench/guard.lua asks for this when rows compare worse than the baseline:
-- 'specs' (id -> the row's spec) are measured again, by running once more
-- each command of the run that yielded a key of theirs (the row's own, its
-- floor's, its Python peer's), in the run's order, into fresh results.  A
-- command the run repeated in rounds runs once: a re-measure is one round.
-- What those commands took in the run must fit in 'budget' seconds: rows
-- are taken cheapest first while they fit, the others are left out.
-- Returns id -> { x_floor, vs_python } for the rows measured, the seconds
-- it took, the labels of the commands run and the ids left out.
local function calls_of(spec)
  local need = { [spec.key] = true }
  if spec.floor then need[spec.floor] = true end
  if spec.py then need[spec.py] = true end
  local set, first = {}, {}
  for i, c in ipairs(calls) do
    first[c.cmd] = first[c.cmd] or i
    for _, k in ipairs(c.keys) do
      if need[k] then
        set[first[c.cmd]] = true
        break
      end
    end
  end
  return set
end

local function remeasure(specs, budget)
  local cand = {}
  for id, s in pairs(specs) do
    local set, cost = calls_of(s), 0
    for i in pairs(set) do cost = cost + calls[i].seconds end
    cand[#cand + 1] = { id = id, set = set, cost = cost }
  end
  table.sort(cand, function(a, b) return a.cost < b.cost or (a.cost == b.cost and a.id < b.id) end)
  local chosen, take, spent, left_out = {}, {}, 0, {}
  for _, c in ipairs(cand) do
    local extra = 0
    for i in pairs(c.set) do if not take[i] then extra = extra + calls[i].seconds end end
    if spent + extra <= budget then
      for i in pairs(c.set) do take[i] = true end
      spent = spent + extra
      chosen[c.id] = specs[c.id]
    else
      left_out[#left_out + 1] = c.id
    end
  end
  local saved_results, saved_skips = results, skips
  results, skips, remeasuring = {}, {}, true
  local t0 = os.time()
  local labels = {}
  for i, c in ipairs(calls) do
    if take[i] then
      run_or_skip(c.keys, c.cmd, c.timeout, c.label .. " (re-measure)")
      labels[#labels + 1] = #c.label > 40 and (c.label:sub(1, 37) .. "...") or c.label
    end
  end
  local fresh = {}
  for id, s in pairs(chosen) do
    local _, _, _, xf, vp = figures(s, results)
    fresh[id] = { x_floor = xf, vs_python = vp }
  end
  results, skips, remeasuring = saved_results, saved_skips, false
  return fresh, os.time() - t0, labels, left_out
end

local commit = readline("git rev-parse --short HEAD") or "?"
if readline("git status --porcelain --untracked-files=no | head -1") then commit = commit .. "+dirty" end
local load_after = loadavg()
local psi_end = cpu_waited()
local pressure = psi_start and psi_end and psi_end.up > psi_start.up
  and (psi_end.us - psi_start.us) / 1e6 / (psi_end.up - psi_start.up) or nil
guard.finish({ run = string.format("%s run of %s, commit %s, load %s -> %s%s", QUICK and "BENCH_QUICK" or "full",
                                   os.date("!%Y-%m-%d %H:%M UTC", t_start), commit, load_before, load_after,
                                   pressure and string.format(", CPU pressure %.0f %%", pressure * 100) or ""),
               date = os.date("!%Y-%m-%dT%H:%M:%SZ", t_start), commit = commit, quick = QUICK,
               load_before = load_before, load_after = load_after, cpu_pressure = pressure,
               seconds = os.time() - t_start }, QUICK,
             remeasure)
print("")
print(string.format("bench: done in %d s; load average after the run: %s", os.time() - t_start, load_after))
os.remove(ERRFILE)
os.remove(OUTFILE)
os.exit(0)
