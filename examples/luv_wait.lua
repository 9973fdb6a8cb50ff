-- Waiting for workers inside a libuv event loop (luv): the loop sleeps in
-- epoll until ctx:fileno() says join(0) has news -- a worker exited, or the
-- next step of a termination is due -- or q:fileno() that a Queue may have
-- an item, and never blocks on the workers or the queue.
--
--   lua5.4 examples/luv_wait.lua [start_method]
--
-- (Debian: apt-get install lua-luv.)

local uv = require "luv"
local mp = require "multiprocessing"

local method = arg[1] or "spawn"

--- Calls on_done(ok, result_or_error, wakeups) once ctx has ended; ctx is
-- polled with join(0, grace) each time its descriptor is readable.
local function watch(ctx, grace, on_done)
  local poll = uv.new_poll(ctx:fileno())
  local wakeups = 0
  poll:start("r", function()
    wakeups = wakeups + 1
    local ok, done = pcall(ctx.join, ctx, 0, grace)
    if ok and not done then return end
    poll:stop()
    poll:close()            -- before ctx:close() closes the descriptor
    on_done(ok, ok and ctx:results() or done, wakeups)
    ctx:close()
  end)
end

-- Something else the loop does meanwhile.
local ticks = 0
local ticker = uv.new_timer()
ticker:start(5, 5, function() ticks = ticks + 1 end)

-- The workers report on a Queue as they go; the loop reads it when its
-- descriptor is readable, with get_nowait until it is empty.
local q = mp.Queue()
local reports, by_fd = 0, 0
local qpoll = uv.new_poll(q:fileno())
qpoll:start("r", function()
  while q:get_nowait() ~= nil do
    reports, by_fd = reports + 1, by_fd + 1
  end
end)

local function squares(i, queue)
  os.execute("sleep 0." .. (i + 1))
  queue:put(("worker %d done"):format(i))
  return i * i
end

local function one_fails(i)
  if i == 1 then error("worker 1 cannot go on") end
  os.execute("sleep 30")     -- terminated when worker 1 fails
end

watch(mp.start_processes(squares, { q }, 3, false, false, method), nil, function(ok, r)
  assert(ok, r)
  print(("results %d %d %d"):format(r[1], r[2], r[3]))
  while q:get_nowait() ~= nil do reports = reports + 1 end  -- any left
  print(("queue items %d, read when its descriptor woke the loop: %s"):format(
    reports, by_fd > 0 and "yes" or "none"))
  qpoll:stop()
  qpoll:close()
  watch(mp.start_processes(one_fails, {}, 3, false, false, method), 0.5, function(ok2, e, wakeups)
    assert(not ok2)
    print("raised: " .. e.msg:match("[^\n]*$"))
    print("woken " .. (wakeups < 20 and "a few times" or wakeups .. " times"))
    ticker:stop()
    ticker:close()
  end)
end)

uv.run()
q:close()
print("the loop ran meanwhile: " .. (ticks > 0 and "yes" or "no"))
