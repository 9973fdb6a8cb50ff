-- Waiting for workers in a cqueues controller: a coroutine sleeps in
-- cqueues.poll on ctx:fileno() while other coroutines run, and calls
-- join(0) only when the descriptor says it has news; another reads a Queue
-- the workers report on when q:fileno() says it may have an item.
--
--   lua5.4 examples/cqueues_wait.lua [start_method]
--
-- (Debian: apt-get install lua-cqueues.)

local cqueues = require "cqueues"
local mp = require "multiprocessing"

local method = arg[1] or "spawn"

--- What cqueues.poll waits on: an object with :pollfd() and :events().
local function readable(fd)
  return { pollfd = function() return fd end, events = function() return "r" end }
end

--- In a coroutine of the controller: waits for ctx to end; returns
-- pcall's results of the last join(0, grace), and the number of wake-ups.
local function wait(ctx, grace)
  local fd, wakeups = readable(ctx:fileno()), 0
  while true do
    cqueues.poll(fd)
    wakeups = wakeups + 1
    local ok, done = pcall(ctx.join, ctx, 0, grace)
    if not ok or done then
      local result = ok and ctx:results() or done
      -- cqueues keeps descriptors in its own epoll: tell it before the
      -- number is closed (and reused by the next context)
      cqueues.cancel(fd:pollfd())
      ctx:close()
      return ok, result, wakeups
    end
  end
end

local cq = cqueues.new()
local finished, ticks = false, 0
local q = mp.Queue()
local reports = 0

cq:wrap(function()   -- the queue's reader, until the item "end"
  local fd = readable(q:fileno())
  repeat
    cqueues.poll(fd)
    local item
    repeat
      item = q:get_nowait()
      if item ~= nil and item ~= "end" then reports = reports + 1 end
    until item == nil or item == "end"
  until item == "end"
  cqueues.cancel(fd:pollfd())
  print(("queue items %d, read when its descriptor woke the reader"):format(reports))
end)

cq:wrap(function()
  local ok, r = wait(mp.start_processes(function(i, queue)
    os.execute("sleep 0." .. (i + 1))
    queue:put(("worker %d done"):format(i))
    return i * i
  end, { q }, 3, false, false, method))
  assert(ok, r)
  print(("results %d %d %d"):format(r[1], r[2], r[3]))
  q:put("end")
  cqueues.sleep(0)   -- let the reader finish first
  local ok2, e, wakeups = wait(mp.start_processes(function(i)
    if i == 1 then error("worker 1 cannot go on") end
    os.execute("sleep 30")
  end, {}, 3, false, false, method), 0.5)
  assert(not ok2)
  print("raised: " .. e.msg:match("[^\n]*$"))
  print("woken " .. (wakeups < 20 and "a few times" or wakeups .. " times"))
  finished = true
end)

cq:wrap(function()   -- something else the controller does meanwhile
  while not finished do
    ticks = ticks + 1
    cqueues.sleep(0.005)
  end
end)

assert(cq:loop())
q:close()
print("the loop ran meanwhile: " .. (ticks > 0 and "yes" or "no"))
