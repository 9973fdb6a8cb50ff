-- bench/lua_msg.lua REPS ROUNDTRIPS MIB_PER_REP SENDS SHM_MIB
-- Messages between the parent and one fork worker, the same protocol as
-- bench/py_msg.py.  JSON lines, one sample per repetition (or "skip"):
--   lua_queue_pingpong / lua_pipe_pingpong: round trips per second of a
--       24-byte string (two mp.Queue / one mp.Pipe; the worker echoes);
--       "cpu": the parent's CPU time per round trip in us (os.clock)
--   lua_queue_mib / lua_pipe_mib: MB/s (10^6 bytes) of 1 MiB strings one way,
--       the worker acknowledging once per repetition with the bytes it got
--   lua_queue_array: us per round trip of an mp.Array("uint8", SHM_MIB MiB),
--       already shared, put on a Queue; the worker reads one element and
--       replies with it
local B = dofile("bench/lib.lua")
local reps, rts, mibs, sends, shm_mib = table.unpack(arg, 1, 5)
reps, rts, mibs, sends, shm_mib = tonumber(reps), tonumber(rts), tonumber(mibs),
  tonumber(sends), tonumber(shm_mib)

local NAMES = { "lua_queue_pingpong", "lua_pipe_pingpong", "lua_queue_mib",
                "lua_pipe_mib", "lua_queue_array" }
local mp, why = B.load_mp()
if not mp then
  for _, n in ipairs(NAMES) do B.skip(n, why) end
  return
end

-- Each measurement fits its count to BUDGET seconds over all repetitions,
-- from the warm-up's speed, so that a slow path (say, an array copied instead
-- of shared) cannot eat the run; the count used is printed beside.
local BUDGET = 5
local function fit(count, per_item_s)
  local n = math.floor(BUDGET / reps / math.max(per_item_s, 1e-9))
  return math.max(3, math.min(count, n))
end

local SMALL = ("m"):rep(24)
local BIG = ("x"):rep(1024 * 1024)
local STOP, SYNC = "stop", "sync"

local function start1(fn, args)
  return mp.start_processes(fn, args, 1, false, false, "fork")
end

local function finish(ctx)
  repeat local done = ctx:join() until done ~= false
end

-- Runs body(); on an error, ends the worker as well as it can.
local function section(name, needs, body)
  for _, f in ipairs(needs) do
    if mp[f] == nil then B.skip(name, "mp." .. f .. " missing") return end
  end
  local ctx
  local ok, e = pcall(body, function(c) ctx = c end)
  if not ok then
    if ctx then
      pcall(function() ctx:terminate() end)
    end
    B.skip(name, e)
  end
end

-- ---- workers ----
local function q_echo(_, qin, qout)
  while true do
    local v = qin:get()
    if v == STOP then return end
    qout:put(v)
  end
end

local function p_echo(_, c)
  while true do
    local v = c:recv()
    if v == STOP then return end
    c:send(v)
  end
end

local function q_sink(_, qin, qout)
  local n = 0
  while true do
    local v = qin:get()
    if v == STOP then return end
    if v == SYNC then qout:put(n); n = 0 else n = n + #v end
  end
end

local function p_sink(_, c)
  local n = 0
  while true do
    local v = c:recv()
    if v == STOP then return end
    if v == SYNC then c:send(n); n = 0 else n = n + #v end
  end
end

-- the element API of Array is tried both ways: a[1], a:get(1)
local function get1(a)
  local ok, v = pcall(function() return a[1] end)
  if ok and v ~= nil then return v end
  return a:get(1)
end
local function set1(a, x)
  if not pcall(function() a[1] = x end) then a:set(1, x) end
end

local function q_array(_, qin, qout)
  while true do
    local a = qin:get()
    if a == STOP then return end
    qout:put(get1(a))
    a = nil
  end
end

-- ---- ping-pong ----
section("lua_queue_pingpong", { "Queue" }, function(keep)
  local q1, q2 = mp.Queue(), mp.Queue()
  local ctx = start1(q_echo, { q1, q2 }); keep(ctx)
  local t0 = B.now()
  for _ = 1, 200 do q1:put(SMALL); assert(q2:get() == SMALL, "echo mismatch") end
  local n = fit(rts, (B.now() - t0) / 200)
  local s, cpu = {}, {}
  for r = 1, reps do
    t0 = B.now()
    local c0 = os.clock()
    for _ = 1, n do q1:put(SMALL); q2:get() end
    s[r] = n / (B.now() - t0)
    cpu[r] = (os.clock() - c0) * 1e6 / n
  end
  q1:put(STOP); finish(ctx)
  B.emit { bench = "lua_queue_pingpong", count = n, cpu = cpu, samples = s }
end)

section("lua_pipe_pingpong", { "Pipe" }, function(keep)
  local a, b = mp.Pipe()
  local ctx = start1(p_echo, { b }); keep(ctx)
  local t0 = B.now()
  for _ = 1, 200 do a:send(SMALL); assert(a:recv() == SMALL, "echo mismatch") end
  local n = fit(rts, (B.now() - t0) / 200)
  local s, cpu = {}, {}
  for r = 1, reps do
    t0 = B.now()
    local c0 = os.clock()
    for _ = 1, n do a:send(SMALL); a:recv() end
    s[r] = n / (B.now() - t0)
    cpu[r] = (os.clock() - c0) * 1e6 / n
  end
  a:send(STOP); finish(ctx)
  B.emit { bench = "lua_pipe_pingpong", count = n, cpu = cpu, samples = s }
end)

-- ---- 1 MiB one way ----
section("lua_queue_mib", { "Queue" }, function(keep)
  local q1, q2 = mp.Queue(), mp.Queue()
  local ctx = start1(q_sink, { q1, q2 }); keep(ctx)
  local s, m = {}, 10                     -- r = 0: warm-up with 10
  for r = 0, reps do
    local t0 = B.now()
    for _ = 1, m do q1:put(BIG) end
    q1:put(SYNC)
    local n = q2:get()
    assert(n == m * #BIG, "sink got " .. tostring(n) .. " bytes")
    if r > 0 then s[r] = m * #BIG / 1e6 / (B.now() - t0)
    else m = fit(mibs, (B.now() - t0) / m) end
  end
  q1:put(STOP); finish(ctx)
  B.emit { bench = "lua_queue_mib", count = m, samples = s }
end)

section("lua_pipe_mib", { "Pipe" }, function(keep)
  local a, b = mp.Pipe()
  local ctx = start1(p_sink, { b }); keep(ctx)
  local s, m = {}, 10
  for r = 0, reps do
    local t0 = B.now()
    for _ = 1, m do a:send(BIG) end
    a:send(SYNC)
    local n = a:recv()
    assert(n == m * #BIG, "sink got " .. tostring(n) .. " bytes")
    if r > 0 then s[r] = m * #BIG / 1e6 / (B.now() - t0)
    else m = fit(mibs, (B.now() - t0) / m) end
  end
  a:send(STOP); finish(ctx)
  B.emit { bench = "lua_pipe_mib", count = m, samples = s }
end)

-- ---- a big shared array through a Queue ----
section("lua_queue_array", { "Array", "Queue" }, function(keep)
  local t0 = B.now()
  -- raw shared memory, as the Python peer's SharedMemory: a synchronised
  -- Array (the default) also carries its lock, one more descriptor (~1 us)
  local arr = mp.Array("uint8", shm_mib * 1024 * 1024, { lock = false })
  local ok, r = pcall(function() return arr:share_memory() end)
  if ok and r ~= nil and r ~= true then arr = r end
  local create_ms = (B.now() - t0) * 1e3
  set1(arr, 42)
  local q1, q2 = mp.Queue(), mp.Queue()
  local ctx = start1(q_array, { q1, q2 }); keep(ctx)
  local s, m = {}, 3                      -- rep = 0: warm-up with 3
  for rep = 0, reps do
    t0 = B.now()
    for _ = 1, m do
      q1:put(arr)
      local v = q2:get()
      assert(v == 42, "worker read " .. tostring(v) .. ", not 42")
    end
    if rep > 0 then s[rep] = (B.now() - t0) * 1e6 / m
    else m = fit(sends, (B.now() - t0) / m) end
  end
  q1:put(STOP); finish(ctx)
  B.emit { bench = "lua_queue_array", mib = shm_mib, create_ms = create_ms,
           shared_ok = ok, count = m, samples = s }
end)
