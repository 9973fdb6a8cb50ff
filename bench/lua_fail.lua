-- bench/lua_fail.lua REPS
-- Failure latency: 8 fork workers; worker 3 raises error("boom") at once,
-- the others sleep.
--
-- How the sleepers sleep: benchclock.sleep(30), i.e. nanosleep(2) from the
-- bench's own tiny C module (bench/benchclock.c), loaded in the parent before
-- the fork so the forked workers have it.  It blocks without CPU (no
-- busy-wait, which would steal one of the 2 cores from the parent) and without
-- forking a shell in the timed window (os.execute("sleep 30") would).  The
-- library's SIGTERM ends it (default action).
--
-- Measured per repetition, alternating:
--   total: from the call of mp.start_processes(fn, {}, 8, true, false,
--          "fork") until the pcall around it returns the exception, which the
--          library raises only once every worker is reaped;
--   start: mp.start_processes(fn, {}, 8, false, false, "fork") alone (then
--          ctx:join() untimed), for context.
-- After each repetition (untimed) the children of this process are counted in
-- /proc: "left" is the most seen, 0 when all were reaped before the raise.
local B = dofile("bench/lib.lua")
local reps = tonumber(arg[1]) or 20
local NPROCS, FAILING = 8, 3

local mp, why = B.load_mp()
if not mp then B.skip("lua_fail", why) return end

local sleep = B.sleep
local function worker(i)
  if i == FAILING then error("boom") end
  sleep(30)
end

local function check(ok, e)
  if ok then return "start_processes returned without raising" end
  local m = type(e) == "table" and e.msg or tostring(e)
  if not tostring(m):find("boom", 1, true) then
    return "unexpected error: " .. B.reason(e)
  end
end

-- warm-up
local ok, e = pcall(mp.start_processes, worker, {}, NPROCS, true, false, "fork")
local bad = check(ok, e)
if bad then B.skip("lua_fail", bad) return end

local total, start, left = {}, {}, 0
for r = 1, reps do
  local t0 = B.now()
  ok, e = pcall(mp.start_processes, worker, {}, NPROCS, true, false, "fork")
  total[r] = (B.now() - t0) * 1e3
  bad = check(ok, e)
  if bad then B.skip("lua_fail", bad) return end
  left = math.max(left, B.children() or 0)

  t0 = B.now()
  local okc, ctx = pcall(mp.start_processes, worker, {}, NPROCS, false, false, "fork")
  start[r] = (B.now() - t0) * 1e3
  if not okc then B.skip("lua_fail", ctx) return end
  ok, e = pcall(function() repeat local done = ctx:join() until done ~= false end)
  bad = check(ok, e)
  if bad then B.skip("lua_fail", bad) return end
end
B.emit { bench = "lua_fail", samples = total, start = start, left = left }
