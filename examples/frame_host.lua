-- The script of examples/frame_host.c: workers started and ended from a
-- 60 Hz frame loop, none of it ever stalling a frame.
--
--   ./frame_host examples/frame_host.lua [start_method [pidfile]]
--
-- 1. four workers compute with the host's own module ("host", registered by
--    the host binary, which is also the workers' executable) and are polled
--    with join(0) until their results are in;
-- 2. four workers that ignore SIGTERM, one of which fails: join(0, 0.5)
--    returns false frame after frame while the others get 0.5 s on their
--    own, then SIGTERM, then (0.5 s later) SIGKILL -- then raises;
-- 3. close() of two such workers, 4. two more left to the garbage
--    collector's incremental steps (3 and 4 three times each), 5. two more
--    still running at lua_close.
-- Every step is timed; the medians and maxima are printed at the end.

local mp = require "multiprocessing"
local host = require "host"

local method = arg[1] or "spawn"
local pidfile = arg[2]
if method ~= "fork" then mp.set_executable(host.executable()) end

local times = { start = {}, join0 = {}, close = {}, gc = {} }

--- Calls f(...) under pcall and files its duration under 'kind'.
local function timed(kind, f, ...)
  local t = host.now()
  local r = table.pack(pcall(f, ...))
  times[kind][#times[kind] + 1] = host.now() - t
  return table.unpack(r, 1, r.n)
end

local function start(fn, args, n)
  local ok, ctx = timed("start", mp.start_processes, fn, args, n, false, false, method)
  assert(ok, ctx)
  if pidfile then
    local f = assert(io.open(pidfile, "a"))
    f:write(table.concat(ctx:pids(), " "), " ")
    f:close()
  end
  return ctx
end

-- Workers: the host's module is there because the worker is the host.
local function compute(i)
  return require("host").registered_by_host and i * 10
end

local function stubborn(i, fail_rank)
  local h = require "host"
  h.ignore_term()
  if i == fail_rank then
    h.sleep(0.2)
    error("worker " .. i .. " gave up")
  end
  while true do h.sleep(0.05) end
end

local function alive(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return false end
  local state = f:read("a"):match("%) (%a)")
  f:close()
  return state ~= "Z"
end

local phase, ctx, polls, pids, left, rounds = "results", nil, 0, nil, nil, 0
local frames = {
  results = function()
    ctx = ctx or start(compute, {}, 4)
    local ok, done = timed("join0", ctx.join, ctx, 0)
    assert(ok, done)
    if done then
      local r = ctx:results()
      print(("results %s %s %s %s"):format(r[1], r[2], r[3], r[4]))
      ctx:close()
      ctx, phase = nil, "failure"
    end
  end,
  failure = function()
    ctx = ctx or start(stubborn, { 0 }, 4)
    local ok, done = timed("join0", ctx.join, ctx, 0, 0.5)
    if ok then
      assert(not done, "a failing context joined")
      polls = polls + 1
      return
    end
    print("raised " .. tostring(done):match("[^\n]*$"))
    print("polls while terminating " .. polls)
    ctx:close()
    ctx, phase, left = nil, "close", 3
  end,
  close = function()
    ctx = ctx or start(stubborn, { -1 }, 2)
    left = left - 1   -- let them start and ignore SIGTERM first
    if left > 0 then return end
    timed("close", ctx.close, ctx)
    ctx, phase = nil, "gc"
  end,
  gc = function()
    if not pids then pids = start(stubborn, { -1 }, 2):pids() end
    timed("gc", collectgarbage, "step")
    if alive(pids[1]) or alive(pids[2]) then return end
    pids, rounds, left = nil, rounds + 1, 3
    phase = rounds < 3 and "close" or "state"
  end,
  state = function()
    _G.still_running = start(stubborn, { -1 }, 2)   -- lua_close ends them
    return false
  end,
}

local function summary()
  for _, kind in ipairs { "start", "join0", "close", "gc" } do
    local t = times[kind]
    table.sort(t)
    if #t > 0 then
      print(("step %s n=%d median %.3f ms max %.3f ms"):format(
        kind, #t, t[(#t + 1) // 2] * 1e3, t[#t] * 1e3))
    end
  end
end

return function()
  if frames[phase]() == false then
    summary()
    return false
  end
  return true
end
