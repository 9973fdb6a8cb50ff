-- bench/lua_pool.lua METHOD REPS MAPN APPLYN [MAXN]
-- mp.Pool(4) with start method METHOD, the same workloads as
-- bench/py_pool.py.  JSON lines, one sample per repetition (or "skip"):
--   lua_pool_map1: tasks/s of pool:map(f, 1..MAPN, 1)   (chunksize 1)
--   lua_pool_mapdef: tasks/s of pool:map(f, 1..MAPN)    (default chunking)
--   lua_pool_unord: tasks/s of pool:imap_unordered(f, 1..MAPN, c), c the
--     chunksize map's default chunking takes (MAPN / 16, rounded up)
--   lua_pool_starmap: tasks/s of pool:starmap(f, {{1}, ..., {MAPN}})
--     (default chunking)
--   lua_pool_apply: tasks/s of APPLYN apply_async(f, {i}), then get() each
--   lua_pool_start: ms of mp.Pool(4) + close + join, in a fresh process
--     (MAPN = APPLYN = 0: nothing else is measured), alternated with its
--     floor, lua_start (n = 4): start_processes of 4 trivial workers;
--     after the rows above it is lua_pool_start_heap: the same in a
--     process that holds their lists (a 12 MB heap a fork copies)
-- f is function(x) return x end.  The pool is warmed up (one small map)
-- before timing, and the rows of whole chunks by as many calls as they
-- time (see CHUNKED_REPS).  MAPN = APPLYN = 0: only lua_pool_start.
-- MAXN > 0: only
--   lua_pool_maxtasks: tasks/s of pool:map(f, 1..MAXN, 1) on a fresh
--     Pool(4, {maxtasksperchild = 1}) (a worker replaced after every task)
local B = dofile("bench/lib.lua")
local method, reps, mapn, applyn = arg[1], tonumber(arg[2]), tonumber(arg[3]),
                                   tonumber(arg[4])
local maxn = tonumber(arg[5] or "0")
local START = (mapn > 0 or applyn > 0) and "lua_pool_start_heap" or "lua_pool_start"
local NAMES = maxn > 0 and { "lua_pool_maxtasks" } or
  { "lua_pool_map1", "lua_pool_mapdef", "lua_pool_unord", "lua_pool_starmap",
    "lua_pool_apply", START }
local mp, why = B.load_mp()
if mp and not mp.Pool then mp, why = nil, "mp.Pool missing" end
if not mp then
  for _, n in ipairs(NAMES) do B.skip(n, why, { method = method }) end
  return
end

local function f(x) return x end
local list, stars = {}, {}
for i = 1, mapn do list[i], stars[i] = i, { i } end

if maxn > 0 then
  local ok, e = pcall(function()
    local s = {}
    for r = 1, reps do
      local pool <close> = mp.Pool(4, { start_method = method, maxtasksperchild = 1 })
      local t0 = B.now()
      local few = {}
      for i = 1, maxn do few[i] = i end
      assert(pool:map(f, few, 1)[maxn] == maxn)
      s[r] = maxn / (B.now() - t0)
    end
    B.emit { bench = "lua_pool_maxtasks", method = method, samples = s }
  end)
  if not ok then B.skip("lua_pool_maxtasks", e, { method = method }) end
  return
end

-- The rows of whole chunks take milliseconds a call: they run CHUNKED_REPS
-- times, after as many calls that are not timed (Python's too), so that
-- their median is a warmed pool's and not its first calls'.  A first call
-- puts its result table on fresh pages, each a fault (13-18 us on this
-- VM: 6 ms for a map's 1.6 MB), until the collector has freed enough old
-- ones for malloc to reuse: with this script's 12 MB of lists, the first
-- ~15 maps (Python frees at once and warms in 1-2 calls).
local CHUNKED_REPS = 15

local function rate(n, body, times, warm)
  local s = {}
  local pool <close> = mp.Pool(4, { start_method = method })
  pool:map(f, { 1, 2, 3, 4, 5, 6, 7, 8 }, 1)
  for _ = 1, warm or 0 do body(pool) end
  for r = 1, times or reps do
    local t0 = B.now()
    body(pool)
    s[r] = n / (B.now() - t0)
  end
  return s
end

local function measure(name, n, body, times)
  local ok, s = pcall(rate, n, body, times, times)
  if ok then B.emit { bench = name, method = method, samples = s }
  else B.skip(name, s, { method = method }) end
end

-- MAPN = APPLYN = 0: only the start row
if mapn > 0 then
  measure("lua_pool_map1", mapn, function(pool)
  assert(pool:map(f, list, 1)[mapn] == mapn)
end)
measure("lua_pool_mapdef", mapn, function(pool)
  assert(pool:map(f, list)[mapn] == mapn)
end, CHUNKED_REPS)
local cs = (mapn + 15) // 16
measure("lua_pool_unord", mapn, function(pool)
  local got = 0
  for _ in pool:imap_unordered(f, list, cs) do got = got + 1 end
  assert(got == mapn)
end, CHUNKED_REPS)
measure("lua_pool_starmap", mapn, function(pool)
  assert(pool:starmap(f, stars)[mapn] == mapn)
end, CHUNKED_REPS)
measure("lua_pool_apply", applyn, function(pool)
  local ars = {}
  for i = 1, applyn do ars[i] = pool:apply_async(f, { i }) end
  for i = 1, applyn do assert(ars[i]:get() == i) end
end)
end

-- In a fresh process (START == "lua_pool_start") the row's floor is
-- measured beside it: start_processes of 4 trivial workers with the same
-- method, alternated with the pools, so that the drift of a noisy machine
-- hits both alike (measured apart, minutes from each other, their ratio
-- moved 1.37-1.70x between runs of the same code).
local PAIRED = START == "lua_pool_start"
local function trivial() end
local ok, e = pcall(function()
  local s, fl = {}, {}
  local warm = mp.Pool(2, { start_method = method })   -- forkserver: running
  warm:close()
  warm:join()
  if PAIRED then mp.start_processes(trivial, {}, 2, true, false, method) end
  for r = 1, reps do
    local t0 = B.now()
    local pool = mp.Pool(4, { start_method = method })
    pool:close()
    pool:join()
    s[r] = (B.now() - t0) * 1e3
    if PAIRED then
      t0 = B.now()
      mp.start_processes(trivial, {}, 4, true, false, method)
      fl[r] = (B.now() - t0) * 1e3
    end
  end
  B.emit { bench = START, method = method, samples = s }
  if PAIRED then B.emit { bench = "lua_start", method = method, n = 4, samples = fl } end
end)
if not ok then
  B.skip(START, e, { method = method })
  if PAIRED then B.skip("lua_start", e, { method = method, n = 4 }) end
end
