-- bench/lua_pool.lua METHOD REPS MAPN APPLYN
-- mp.Pool(4) with start method METHOD, the same workloads as
-- bench/py_pool.py.  JSON lines, one sample per repetition (or "skip"):
--   lua_pool_map1: tasks/s of pool:map(f, 1..MAPN, 1)   (chunksize 1)
--   lua_pool_mapdef: tasks/s of pool:map(f, 1..MAPN)    (default chunking)
--   lua_pool_apply: tasks/s of APPLYN apply_async(f, {i}), then get() each
--   lua_pool_start: ms of mp.Pool(4) + close + join
-- f is function(x) return x end.  The pool is warmed up (one small map)
-- before timing.  MAPN = APPLYN = 0: only lua_pool_start.
local B = dofile("bench/lib.lua")
local method, reps, mapn, applyn = arg[1], tonumber(arg[2]), tonumber(arg[3]),
                                   tonumber(arg[4])
local NAMES = { "lua_pool_map1", "lua_pool_mapdef", "lua_pool_apply",
                "lua_pool_start" }
local mp, why = B.load_mp()
if mp and not mp.Pool then mp, why = nil, "mp.Pool missing" end
if not mp then
  for _, n in ipairs(NAMES) do B.skip(n, why, { method = method }) end
  return
end

local function f(x) return x end
local list = {}
for i = 1, mapn do list[i] = i end

local function rate(n, body)
  local s = {}
  local pool <close> = mp.Pool(4, { start_method = method })
  pool:map(f, { 1, 2, 3, 4, 5, 6, 7, 8 }, 1)
  for r = 1, reps do
    local t0 = B.now()
    body(pool)
    s[r] = n / (B.now() - t0)
  end
  return s
end

local function measure(name, n, body)
  local ok, s = pcall(rate, n, body)
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
end)
measure("lua_pool_apply", applyn, function(pool)
  local ars = {}
  for i = 1, applyn do ars[i] = pool:apply_async(f, { i }) end
  for i = 1, applyn do assert(ars[i]:get() == i) end
end)
end

local ok, e = pcall(function()
  local s = {}
  local warm = mp.Pool(2, { start_method = method })   -- forkserver: running
  warm:close()
  warm:join()
  for r = 1, reps do
    local t0 = B.now()
    local pool = mp.Pool(4, { start_method = method })
    pool:close()
    pool:join()
    s[r] = (B.now() - t0) * 1e3
  end
  B.emit { bench = "lua_pool_start", method = method, samples = s }
end)
if not ok then B.skip("lua_pool_start", e, { method = method }) end
