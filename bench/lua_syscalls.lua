-- bench/lua_syscalls.lua REPS N
-- System calls per worker of the fork path (the parent's and the child's
-- together), counted by `strace -f -c`: ours, REPS x
-- mp.start_processes(function() end, {}, N, true, false, "fork"), beside the
-- C floor's (build/bench/floor_fork: fork, _exit, waitpid).  Each side is
-- counted twice, with 1 and with 1 + REPS rounds, and the difference is
-- divided by REPS * N: what loading Lua, the library or the floor costs once
-- drops out.  The C floor is counted bare and with what each of our workers
-- must do (floor_fork --safe: its group, handler, lifeline, name, pidfd and
-- sweep), {"bench":"floor_syscalls_safe",...}.  (exit_group never returns, so strace -c counts it on neither
-- side.)  Prints {"bench":"syscalls","method":"fork","n":N,"samples":[x]},
-- {"bench":"floor_syscalls","n":N,"samples":[x]} and the calls of ours by
-- name in "calls"; or skips, saying why (no strace, no ptrace).
local B = dofile("bench/lib.lua")
local reps, n = tonumber(arg[1]) or 10, tonumber(arg[2]) or 64
local LUA = os.getenv("LUA") or "lua5.4"
local OUT = os.tmpname()

local function skip(why)
  B.skip("syscalls", why, { method = "fork", n = n })
  B.skip("floor_syscalls", why, { n = n })
  B.skip("floor_syscalls_safe", why, { n = n })
end

-- The calls of a `strace -c` summary: name -> count (errors included).
local function counts(path)
  local t = {}
  for l in io.lines(path) do
    local c, name = l:match("^%s*[%d.]+%s+[%d.]+%s+%d+%s+(%d+)%s+%d*%s*([%w_]+)%s*$")
    if c and name ~= "total" then t[name] = tonumber(c) end
  end
  return t
end

-- strace -f -c of 'cmd'; the counts, or nil and why.
local function strace(cmd)
  local ok = os.execute(string.format("strace -f -c -o %s %s >/dev/null 2>&1", OUT, cmd))
  if not ok then return nil, "strace -f -c " .. cmd .. " failed (no ptrace here?)" end
  return counts(OUT)
end

-- Per worker, by call: (counts of 1 + reps rounds - counts of 1) / (reps * n).
local function per_worker(cmd_of)
  local a, why = strace(cmd_of(1))
  if not a then return nil, why end
  local b
  b, why = strace(cmd_of(1 + reps))
  if not b then return nil, why end
  local t, total = {}, 0
  for name, c in pairs(b) do
    local d = (c - (a[name] or 0)) / (reps * n)
    if d >= 0.05 then t[name] = d; total = total + d end
  end
  return t, total
end

if not os.execute("command -v strace >/dev/null 2>&1") then
  skip("strace not found (apt-get install -y strace; scripts/install-deps.sh installs it)")
  os.exit(0)
end
local mp, why = B.load_mp()
if not mp then skip(why) os.exit(0) end

local ours, ototal = per_worker(function(r)
  return string.format("%s -e %q", LUA, string.format(
    "package.path = './lua/?.lua;./lua/?/init.lua;' .. package.path; " ..
    "package.cpath = './build/?.so;' .. package.cpath; " ..
    "local mp = require 'multiprocessing'; " ..
    "for _ = 1, %d do mp.start_processes(function() end, {}, %d, true, false, 'fork') end", r, n))
end)
if not ours then skip(ototal) os.exit(0) end
local floor, ftotal = per_worker(function(r)
  return string.format("build/bench/floor_fork %d %d", r - 1, n)  -- + its warm-up round
end)
if not floor then skip(ftotal) os.exit(0) end
-- the same in C with what each of our workers must do (floor_fork --safe)
local safe, stotal = per_worker(function(r)
  return string.format("build/bench/floor_fork --safe %d %d", r - 1, n)
end)
if not safe then skip(stotal) os.exit(0) end
os.remove(OUT)

local names = {}
for name in pairs(ours) do names[#names + 1] = name end
table.sort(names, function(x, y)
  if ours[x] ~= ours[y] then return ours[x] > ours[y] end
  return x < y
end)
local parts = {}
for _, name in ipairs(names) do
  parts[#parts + 1] = string.format("%s %.2f", name, ours[name])
end
B.emit { bench = "syscalls", method = "fork", n = n, samples = { ototal }, calls = table.concat(parts, ", ") }
B.emit { bench = "floor_syscalls", n = n, samples = { ftotal } }
B.emit { bench = "floor_syscalls_safe", n = n, samples = { stotal } }
