--- multiprocessing.poolworker: the body of an mp.Pool worker (pool.lua is
-- the parent's side, and says what the messages hold).  A module of its
-- own, so that a fresh worker (spawn, forkserver) loads only this.
local core = require "multiprocessing.core"

local M = {}

local now, clear, run_items = core._now, core._clear, core._run_items
local unpack, min = table.unpack, math.min
local pcall, type = pcall, type

M.MID = 65536              -- a board word is mid * MID + k: k < MID
local MID = M.MID
local FLUSH = 0.05         -- a worker posts partial results after this long

-- The name of 'fn' as a global or a module's field ("step",
-- "mymod.step"), or nil.
local function global_name(fn)
  for mod, t in pairs(package.loaded) do
    if type(t) == "table" then
      for k, v in pairs(t) do
        if v == fn and type(k) == "string" then
          return mod == "_G" and k or mod .. "." .. k
        end
      end
    end
  end
end

-- How the traceback names the user's function, which the pool's loop calls
-- through its own locals ('task', 'fns[...]') or its C loop: as Lua would
-- name it, by its global name or by where it is defined.
local function user_frame_name(level)
  local info
  repeat   -- up to the first frame of the pool's own loop
    level = level + 1
    info = debug.getinfo(level, "Sf")
    if not info then return nil end
  until info.func == run_items
        or info.source:find("multiprocessing/poolworker%.lua$")
  info = debug.getinfo(level - 1, "Sf")
  if not info or info.what ~= "Lua" then return nil end
  local name = global_name(info.func)
  return name and ("function '%s'"):format(name)
         or ("function <%s:%d>"):format(info.short_src, info.linedefined)
end

local function task_traceback(e, c_loop)
  local text = debug.traceback("", 3)
  -- the frames of the pool's own loop are not the user's: its Lua ones,
  -- and (c_loop: the task ran in it) core._run_items's just below them
  text = text:gsub("\n[^\n]*multiprocessing/poolworker%.lua:.*$", "")
  if c_loop then text = text:gsub("\n%s*%[C%]: in [^\n]*$", "") end
  local name = user_frame_name(3)
  if name then text = text:gsub(": in [^\n]*$", ": in " .. name:gsub("%%", "%%%%")) end
  local msg = (type(e) == "string" or type(e) == "number") and tostring(e)
  if not msg then
    local ok, s = pcall(tostring, e)
    msg = ok and s or ("(error object is a %s value)"):format(type(e))
  end
  return { text:sub(2) .. "\n" .. msg, type(e) ~= "string" and e or nil }
end

-- Posts results; a value that cannot cross becomes that item's error.
local TO_PARENT = "to the pool's parent"
local chunk = core._chunk
-- 'out' as it crosses: its results are only indexed, not walked (codec.c);
-- the head holds every field of 'out' but the results
local function view(out)
  return chunk({ out[1], out[2], out[3], e = out.e, d = out.d, last = out.last,
                 back = out.back, s = out.s },
               out, 4, out[3] - out[2] + 1)
end
local function post(results, out)
  local ok, err = pcall(results.put, results, view(out))
  if ok then return end
  local k0 = out[2]
  out.e = out.e or {}
  for k = k0, out[3] do
    local v = out[3 + k - k0 + 1]
    local sendable, why = pcall(core._check_sendable, v, "result", TO_PARENT,
                                true)
    if not sendable and not out.e[k] then
      out[3 + k - k0 + 1] = nil
      out.e[k] = { "cannot send the task's result: " .. tostring(why) }
    end
  end
  for _, e in pairs(out.e) do
    if not pcall(core._check_sendable, e[2], "error", TO_PARENT, true) then
      e[2] = nil
    end
  end
  ok = pcall(results.put, results, view(out))
  if not ok then error(err, 0) end
end

-- Where a starmap message's argument lists go on after the n that start
-- at msg[p].
local function star_skip(msg, p, n)
  for _ = 1, n do
    local c = msg[p]
    p = c >= 0 and p + 1 + c or p + 2
  end
  return p
end

-- Runs the items of one message into 'out' (empty), all in one protected
-- call while they succeed: the error handler records a failure, and the
-- loop goes on from the next item.  Partial results go out every FLUSH
-- seconds (the clock is read per item only once items are seen to be
-- slow), and 'out' is emptied for the rest.
local function run_message(msg, n, fns, results, mark, slot, out)
  local mid, mode = msg[1], msg[3]
  local fn = fns[msg[2]]
  local base, start = mid * MID, now()
  -- p: where the next item's argument list starts (mode 1: a count c and
  -- c values, or -1 and a value as it was; codec.c's encode_args)
  local k0, k, p = 1, 0, 5
  out[1], out[2], out.s = mid, 1, slot
  local flushed, stride = start, 1
  local function body()
    local mark_, task, msg_, base_ = mark, fn, msg, base
    while k < n do
      -- items k+1 .. last; item i's result goes to out[i + off]
      local last, o, off = min(n, k + stride), out, 4 - k0
      if mode ~= 2 then   -- in C: core._run_items
        p = run_items(mark_, base_, task, msg_, k + 1, last, o, off,
                      mode == 1 and p or nil)
        k = last
      else
        for i = k + 1, last do
          k = i
          mark_(base_ + i)
          local args = msg_[4 + 2 * i]
          o[i + off] = fns[msg_[3 + 2 * i]](unpack(args, 1, args.n or #args))
        end
      end
      if k < n then
        -- fast items: look at the clock every 64th; slow ones: every one
        local t = now()
        stride = (t - flushed) / (k - k0 + 1) > 1e-3 and 1 or 64
        if t - flushed >= FLUSH then
          out[3] = k
          post(results, out)
          clear(out)
          k0, flushed = k + 1, t
          out[1], out[2], out.s = mid, k0, slot
        end
      end
    end
  end
  local function failed(e)
    -- the item that raised is the one marked (_run_items's loop does not
    -- say where it was); one that raised before it marked any: the next.
    -- k and p are still where the failed call of _run_items began: the
    -- lists of at most a stride of items are skipped, not the message's.
    if mode ~= 2 then
      local at = (mark() or 0) - base
      at = at > k and at or k + 1
      if mode == 1 then p = star_skip(msg, p, at - k) end
      k = at
    end
    out[4 + k - k0] = nil   -- (out may hold an earlier message's results)
    out.e = out.e or {}
    out.e[k] = task_traceback(e, mode ~= 2)
  end
  while k < n do xpcall(body, failed) end
  out[3], out.d = n, now() - start
end

--- The body of a pool worker (a module function: it crosses by reference),
-- rank 'rank' of the pool's one context, configured by one table
-- (poolsup.start): { tasks = the pool's task Queue, results = its result
-- Queue, board = its board (word rank + 1 is this worker's), title = the
-- process title of each slot, maxtasks, initializer,
-- initargs }.
-- Every worker takes from the one task Queue: a message goes to whichever
-- is ready first, and each message carries the functions it needs.
function M.worker(rank, cfg)
  local tasks, results, maxtasks = cfg.tasks, cfg.results, cfg.maxtasks
  local init, initargs = cfg.initializer, cfg.initargs
  local slot = rank + 1
  tasks:_functions()
  -- what ps, pgrep -f and top show (COMMON interface 4)
  core._set_title(cfg.title[slot])
  local mark = cfg.board:marker(slot)
  if init then
    local ok, e = xpcall(init, function(e)
      return { e, task_traceback(e) }
    end, unpack(initargs, 1, initargs.n or #initargs))
    if not ok then
      pcall(results.put, results, { 0, 0, -1, init = e[2][1] })
      error(e[1], 0)
    end
  end
  mark(-1)
  local count = 0
  -- every message is decoded into the one table 'msg', and its results
  -- gathered in the one table 'out': a worker that made and dropped two
  -- tables as big as its messages each time would have the collector walk
  -- the heap it shares with its parent (fork), which copies every page of
  -- it.  The next message is written over them (its items and fields; what
  -- lies past them is never read), and they are emptied only when no
  -- message is waiting: a worker about to wait holds nothing of its tasks
  -- (unless the message it saw went to another worker first), and a busy
  -- one does not pay twice per item for it.
  local msg, out = {}, {}
  while true do
    if not tasks:_get_into(msg) then return end
    local mid, n = msg[1], msg[4]
    mark(mid * MID)                -- taken, no item started: see poolsup
    -- a message may hold more items than this worker has left to run: it
    -- runs what it may and gives the rest back (out.back)
    local m = maxtasks and min(n, maxtasks - count) or n
    run_message(msg, m, msg.fns, results, mark, slot, out)
    count = count + m
    -- its last message says so: the parent starts the next worker at once
    local last = maxtasks and count >= maxtasks
    out.last, out.back = last or nil, m < n or nil
    mark(mid * MID + n + 1)        -- posting: see poolsup's lost
    post(results, out)
    if last then return end        -- (the slot is the next worker's now)
    if tasks:qsize() == 0 then
      clear(msg)
      clear(out)
    else
      out.e, out.d = nil, nil
    end
    mark(-1)
  end
end

return M
