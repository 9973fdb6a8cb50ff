--- multiprocessing.poolsup: mp.Pool's supervision of its workers (pool.lua
-- is the rest of the pool and says what the messages and the board hold):
-- starting the workers, seeing that one died or hangs, failing or retrying
-- the task it was running, and starting another in its place.
--
-- The workers are the ranks of ONE ProcessContext (start_processes of N
-- with the pool's start method, join = false), started in one go; each
-- costs the parent one descriptor (its pidfd), and the pool's queues and
-- board are shared by all.  One worker ends alone (ctx:terminate(grace,
-- rank)) and starts again alone (ctx:restart(rank)).  Its body is
-- poolworker.worker, configured by one table.  The pool decides which
-- worker ends and which task fails or runs again; every signal and wait is
-- the engine's (ctx:terminate, ctx:poll()).
local core = require "multiprocessing.core"
local W = require "multiprocessing.poolworker"
local F = require "multiprocessing.fifo"

local M = {}
local Pool = {}     -- methods that pool.lua adds to its Pool
M.methods = Pool

local now, mk_exception = core._now, core._exception
local MID = W.MID
local push = F.push
local pcall = pcall

M.SLICE = 0.05             -- seconds between looks at the workers
local SLICE = M.SLICE
local KILL_GRACE = 0.5     -- the grace the engine gives a worker ended for
                           -- its timeout: SIGTERM, SIGKILL this long after
local LOST = 0.5           -- a message out of the queue that no worker shows
                           -- this long after one died while taking: lost
local STALL = 1.0          -- the task queue moves on no worker's board this
                           -- long (without a pool timeout): see unblock

-- Is 'err' a Ctrl-C?  Our waits raise mp.Interrupted; a SIGINT that comes
-- while Lua code runs between them (the pool's loop, a poll() of the
-- engine) is raised by lua.c's hook as "<where>: interrupted!", and a
-- message handler may have added a traceback below that line by the time a
-- to-be-closed guard sees it (lua.c's REPL does).  Either way the pool is
-- terminated and mp.Interrupted is raised (_interrupted).
function M.interrupt(err)
  return core.isinstance(err, core.Interrupted)
         or type(err) == "string"
            and err:match("^[^\n]*"):sub(-12) == "interrupted!"
end
local interrupt = M.interrupt

function M.task_name(job, pos)
  return job.kind == "apply" and ("apply_async call %d"):format(pos)
         or ("task %d"):format(pos)
end
local task_name = M.task_name

local function new_worker(slot, pid)
  return { slot = slot, rank = slot - 1, pid = pid, seen = 0, since = now() }
end

-- Starts the pool's workers, all in one start_processes (raises when the
-- start fails, with the core's message as is: called through pcall, the
-- core names no line of ours, and Pool() names the caller's).
function M.start(pool)
  local mp = require "multiprocessing"
  local n = pool.processes
  -- each slot's title made here: a worker that turned its slot into text
  -- would run printf's machinery, pages of libc a fork faults in one by one
  local titles = {}
  for slot = 1, n do
    pool.cur:set(slot, 0)
    titles[slot] = ("pool worker %d (%s)"):format(slot, pool.script)
  end
  local ok, ctx = pcall(mp.start_processes, W.worker, { {
      tasks = pool.tasks, results = pool.results, board = pool.cur,
      title = titles,
      maxtasks = pool.maxtasks, initializer = pool.initializer,
      initargs = pool.initargs } }, n, false, false, pool.start_method)
  if not ok then error(ctx, 0) end
  pool.ctx = ctx
  local pids = pool.ctx:pids()
  for slot = 1, n do pool.workers[slot] = new_worker(slot, pids[slot]) end
end

-- Takes the engine's news of the workers that ended (ctx:poll(), which
-- also advances an ending the engine is carrying out): w.ended = the
-- event, with exitcode, signal and terminated.
function M.poll(self)
  if not self.ctx then return end
  for _, ev in ipairs((self.ctx:poll())) do
    local w = self.workers[ev.rank + 1]
    if w and w.pid == ev.pid then w.ended = ev end
  end
end

-- The item a worker is running: rec, k (0: it took the message and has not
-- started an item; rec.n + 1: it is posting the results); or nil.  The
-- message is w's from then on.
local function running_item(self, w)
  local v = self.cur:get(w.slot)
  if v <= 0 then return nil end
  local rec = self.msgs[v // MID]
  if rec and (rec.w == nil or rec.w == w) then
    rec.w = w
    return rec, v % MID
  end
end

local function exit_text(code)
  if code and code < 0 then
    local name
    for n, num in pairs(core.signals) do
      if num == -code then name = n break end
    end
    return "signal " .. (name or ("<Unknown signal %d>"):format(-code)), name
  end
  return "exit code " .. tostring(code)
end

-- The item 'pos' of 'job' was running in 'w' when it died or timed out.
function Pool:_killed(job, pos, w, code, timeout)
  local tries = job.tries[pos] or 0
  if tries < self.retries then
    job.tries[pos] = tries + 1
    push(self.redo, { job = job, pos = pos })
    return
  end
  local e
  if timeout then
    local text, name = exit_text(code)
    e = mk_exception("timeout", {
      msg = ("%s timed out after %g seconds in pool process %d, which was "
             .. "terminated (%s)"):format(task_name(job, pos), timeout, w.pid,
                                         text),
      task = pos, pid = w.pid, error_pid = w.pid, error_index = w.slot - 1,
      timeout = timeout, exit_code = code, signal_name = name })
  else
    local text, name = exit_text(code)
    e = mk_exception("exited", {
      msg = ("%s: pool process %d terminated with %s while running it")
            :format(task_name(job, pos), w.pid, text),
      task = pos, pid = w.pid, error_pid = w.pid, error_index = w.slot - 1,
      exit_code = code, signal_name = name })
  end
  self:_settle(job, pos, false, e)
end

-- Message 'mid' leaves the pool's books (its items are settled or go
-- elsewhere).
function Pool:_forget(mid)
  self.msgs[mid] = nil
  self.nmsg = self.nmsg - 1
end

-- Items upto+1 .. n of message 'mid' run again (in order, first).
local function redo_rest(self, mid, rec, redo)
  self:_forget(mid)
  for i = rec.upto + 1, rec.n do
    if not rec.job.abandoned then
      push(redo, { job = rec.job, pos = rec.first + i - 1 })
    end
  end
end

-- Puts the items of 'redo' ahead of the pool's redo list.
local function redo_first(self, redo)
  for i = self.redo.head, self.redo.tail do push(redo, self.redo[i]) end
  self.redo = redo
end

-- The pool cannot work (its initializer fails in every worker): raises.
local function break_pool(self, e)
  self.broken = e
  self:terminate()
  error(e, 0)
end

-- Why a worker that died before it was ready breaks the pool, or nil.
local function unready_failure(self, w, code)
  local init = self.init_failed
  if init then
    self.init_failed = nil
    return mk_exception("raised", {
      msg = ("\n\n-- pool process %d failed in its initializer with the "
             .. "following error:\n%s"):format(w.pid, init),
      pid = w.pid, error_pid = w.pid, error_index = w.slot - 1,
      exit_code = code })
  elseif code and code >= 0 then
    -- an initializer that exits (os.exit(0) too): it would do it again in
    -- every new worker
    return mk_exception("exited", {
      msg = ("pool process %d exited with %s in its initializer, before it "
             .. "was ready"):format(w.pid, (exit_text(code))),
      pid = w.pid, error_pid = w.pid, error_index = w.slot - 1,
      exit_code = code })
  end
  -- killed while starting (it happens): the pool gives up when no worker
  -- gets ready before this many die
  self.unready = (self.unready or 0) + 1
  if self.unready > self.processes + 3 then
    return mk_exception("exited", {
      msg = ("pool process %d terminated with %s before it was ready, "
             .. "as did %d others (in the initializer?)")
            :format(w.pid, (exit_text(code)), self.unready - 1),
      pid = w.pid, error_pid = w.pid, error_index = w.slot - 1,
      exit_code = code })
  end
end

-- Worker 'w' has exited: the message it held runs again elsewhere, the
-- item it was running fails (or is retried), and a new worker takes its
-- slot.
function Pool:_lost(w)
  w.lost = true
  -- A worker killed while it wrote its results leaves that message half
  -- written, and the queue's readers wait for its end until some writer
  -- comes to pad it: the parent writes a no-op message itself (not
  -- waiting: a full queue has writers enough).
  pcall(self.results.put, self.results, false, 0)
  self:_drain()
  local code = w.ended.exitcode
  local v = self.cur:get(w.slot)
  local rec, k = running_item(self, w)
  if v == -1 then
    -- it may have died between taking a message and saying so
    self.idle_deaths = self.idle_deaths + 1
  end
  if rec then
    local mid = v // MID
    local redo = F.new()
    for i = rec.upto + 1, rec.n do
      local pos = rec.first + i - 1
      -- the item it was running; or every item, when it died posting
      -- their results (a task that closed its descriptors, say): each
      -- counts as a try, so that this cannot go on for ever
      if i == k or k > rec.n then
        self:_killed(rec.job, pos, w, code, w.killing and w.killing.timeout)
      elseif not rec.job.abandoned then
        push(redo, { job = rec.job, pos = pos })
      end
    end
    self:_forget(mid)
    redo_first(self, redo)
  end
  if v == 0 and not w.killing then
    local e = unready_failure(self, w, code)
    if e then break_pool(self, e) end
  end
  if self.state ~= "terminate" then self:_restart(w) end
end

-- Starts a worker again in w's slot.  A start that fails (EAGAIN, EMFILE,
-- a forkserver that died) leaves the slot down for the next look; the
-- third failure in a row breaks the pool with its error.
function Pool:_restart(w)
  self.cur:set(w.slot, 0)
  local pid, err = self.ctx:restart(w.rank)
  if pid then
    self.workers[w.slot] = new_worker(w.slot, pid)
    return
  end
  local fails = (w.start_fails or 0) + 1
  self.workers[w.slot] = { slot = w.slot, rank = w.rank, start_fails = fails,
                           down = true }
  if fails >= 3 then break_pool(self, err) end
end

-- Messages out of the queue that no worker shows and no result names,
-- after a worker died between taking a message and saying so (board -1):
-- the oldest of them is the one it took.  Such a message is sent again
-- when it stays so for LOST seconds.  (A live worker says so within
-- microseconds of its get; one that was only slow runs it twice, the
-- first run's results are dropped.)
local function recover(self, t)
  local unowned = {}
  for mid, rec in pairs(self.msgs) do
    if not rec.w and rec.upto == 0 and rec.deaths < self.idle_deaths then
      unowned[#unowned + 1] = mid
    else
      rec.lost_at = nil
    end
  end
  if #unowned == 0 then return end
  table.sort(unowned)
  local out = #unowned - self.tasks:qsize()
  local redo = F.new()
  for i, mid in ipairs(unowned) do
    local rec = self.msgs[mid]
    if i > out then
      rec.lost_at = nil
    else
      rec.lost_at = rec.lost_at or t
      if t - rec.lost_at > LOST then redo_rest(self, mid, rec, redo) end
    end
  end
  redo_first(self, redo)
end

-- Whether process 'pid' is stopped (SIGSTOP, SIGTSTP, a tracer).
local function stopped(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return false end
  local state = f:read("a"):match("%) (%a)")
  f:close()
  return state == "T" or state == "t"
end

-- The idle workers (board -1) that are stopped are ended.  An idle worker
-- waits in the task queue's get holding its read lock, so one stopped
-- there stops every other reader too: messages wait in the queue, and no
-- board moves.  It has taken nothing, so no task fails.  (One stopped in
-- its initializer, board 0, holds no lock and blocks nobody.)
local function end_stopped(self, also_starting)
  for _, w in ipairs(self.workers) do
    local v = not w.down and not w.ended and not w.killing
              and self.cur:get(w.slot)
    if v and (v == -1 and stopped(w.pid) or also_starting and v == 0) then
      w.killing = {}
      self.ctx:terminate(KILL_GRACE, w.rank)
    end
  end
end

-- Messages wait in the task queue and no board has moved for the pool's
-- timeout (STALL without one): a stopped idle worker may hold the queue.
local function unblock(self, t)
  if self.moved or self.tasks:qsize() == 0 then
    self.stall_at = nil
  elseif not self.stall_at then
    self.stall_at = t
  elseif t - self.stall_at > (self.timeout or STALL) then
    self.stall_at = nil
    end_stopped(self, false)
  end
  self.moved = false
end

-- A live worker: ended (by the engine) when its task has run past its
-- timeout.
local function watch(self, w, t)
  if w.killing then return end   -- the engine is ending it
  local v = self.cur:get(w.slot)
  if v ~= w.seen then
    w.seen, w.since, self.moved = v, t, true
    running_item(self, w)        -- the message is w's
    return
  end
  if v <= 0 then return end
  local rec, k = running_item(self, w)
  if not rec or k < 1 or k > rec.n then return end   -- none, or posting
  local job, pos = rec.job, rec.first + k - 1
  local limit = job.kind == "apply" and job.timeouts[pos] or job.timeout
                or self.timeout
  if limit and t - w.since > limit then
    w.killing = { timeout = limit }
    self.ctx:terminate(KILL_GRACE, w.rank)
  end
end

-- Worker 'w' has posted its last results (maxtasksperchild) and exits: a
-- new worker takes its slot once the engine has seen it go.
function Pool:_retiring(w)
  w.retiring = true
  self.nretiring = self.nretiring + 1
end

-- Looks at every worker: dead ones are replaced, hung tasks killed, down
-- slots started again.
function Pool:_check()
  local t = now()
  self.next_check = t + SLICE
  M.poll(self)
  for _, w in ipairs(self.workers) do
    if w.down then
      if self.state ~= "terminate" then self:_restart(w) end
    elseif w.ended and w.retiring then
      self.nretiring = self.nretiring - 1
      if self.state ~= "terminate" then self:_restart(w) end
    elseif w.ended then
      self:_lost(w)
    else
      watch(self, w, t)
    end
  end
  if self.idle_deaths > 0 then recover(self, t) end
  unblock(self, t)
end

-- The workers that run.
local function live_workers(self)
  local n = 0
  for _, w in ipairs(self.workers) do
    if not w.down and not w.ended then n = n + 1 end
  end
  return n
end
M.live_workers = live_workers

-- join(): every worker gets a stop message and is waited for.  With a
-- pool timeout, when stop messages are still untaken that long after, the
-- workers still in their initializer and the stopped idle ones are ended.
function M.stop_all(self)
  local t0, ctx = now(), self.ctx
  M.poll(self)
  for _, w in ipairs(self.workers) do
    if not w.down and not w.ended and not w.retiring then
      pcall(self.tasks.put, self.tasks, false)
    end
  end
  local fd = ctx:fileno()
  while true do
    M.poll(self)
    if live_workers(self) == 0 then return end
    -- a task of a job left early (an imap that raised) may still run: its
    -- timeout holds here too
    local t = now()
    for _, w in ipairs(self.workers) do
      if not w.down and not w.ended then watch(self, w, t) end
    end
    if self.timeout and now() - t0 > self.timeout
        and self.tasks:qsize() > 0 then
      end_stopped(self, true)
    end
    local ok, err = pcall(core._poll, { fd }, SLICE, "Pool.join")
    if not ok then
      if interrupt(err) then
        self.call = "Pool.join"
        self:_interrupted()
      end
      error(err, 0)
    end
  end
end

-- The workers are gone (or going): the context is reaped and closed, and
-- the messages no worker took are read from the task queue, so that what
-- they hold (file_system references of arrays) is given back.
function M.finish(self, grace)
  local ctx = self.ctx
  if not ctx then return end
  self.ctx = nil
  ctx:terminate(grace)
  pcall(ctx.join, ctx)
  ctx:close()
  local q = self.tasks
  while q:qsize() > 0 do
    local ok, msg = pcall(q.get, q, 0)
    if not ok or msg == nil then break end
  end
end

-- Ctrl-C in a wait of the pool's: the pool is terminated, and the
-- interrupt is raised as the public call's (self.call), at the user's line.
function Pool:_interrupted()
  self:terminate()
  core._interrupt(self.call or "Pool", "the pool was terminated, its workers "
                  .. "reaped")
end

-- An error from the results queue.  (When every worker is gone, a get
-- returns nil, "closed": the loop looks at the workers as after a
-- timeout, and replaces them.)
function Pool:_queue_error(err)
  if interrupt(err) then self:_interrupted() end
  error(err, 0)
end

return M
