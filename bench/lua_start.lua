-- bench/lua_start.lua METHOD REPS N [N...]
-- start+join of N trivial workers (function() end) with
-- mp.start_processes(fn, {}, N, true, false, METHOD), timed in the parent.
-- One untimed warm-up call first (for forkserver: the server is running when
-- timing starts).  One JSON line per N: {"bench":"lua_start","method":M,
-- "n":N,"samples":[ms,...]} or {"bench":"lua_start",...,"skip":"why"}.
-- With METHOD fork, each start alternates with its Lua floor, in the same
-- process: benchclock.fork_floor(N, trivial), N forks whose children keep
-- the guarantees and call the function, and nothing else of ours
-- ({"bench":"floor_fork_lua","n":N,...}).
local B = dofile("bench/lib.lua")
local method, reps = arg[1], tonumber(arg[2])
local BUDGET = 10   -- seconds per N
local ns = {}
for i = 3, #arg do ns[#ns + 1] = tonumber(arg[i]) end

local mp, why = B.load_mp()
local function trivial() end
local PAIRED = method == "fork"

for _, n in ipairs(ns) do
  if not mp then
    B.skip("lua_start", why, { method = method, n = n })
  else
    local ok, e = pcall(mp.start_processes, trivial, {}, math.min(n, 2), true, false, method)
    if not ok then
      B.skip("lua_start", e, { method = method, n = n })
    else
      -- at least 3 repetitions, then stop early past BUDGET seconds (a slow
      -- start method must not eat the whole run)
      local s, fl, t_begin = {}, {}, B.now()
      for r = 1, reps do
        local t0 = B.now()
        ok, e = pcall(mp.start_processes, trivial, {}, n, true, false, method)
        s[r] = (B.now() - t0) * 1e3
        if not ok then break end
        if PAIRED then
          t0 = B.now()
          B.fork_floor(n, trivial)
          fl[r] = (B.now() - t0) * 1e3
        end
        if r >= 3 and B.now() - t_begin > BUDGET then break end
      end
      if ok then
        B.emit { bench = "lua_start", method = method, n = n, samples = s }
        if PAIRED then B.emit { bench = "floor_fork_lua", n = n, samples = fl } end
      else
        B.skip("lua_start", e, { method = method, n = n })
      end
    end
  end
end
