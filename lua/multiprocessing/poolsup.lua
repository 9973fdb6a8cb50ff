--- multiprocessing.poolsup: mp.Pool's supervision of its workers (pool.lua
-- is the rest of the pool and says what the messages and the board hold):
-- starting a worker in a slot, seeing that one died or hangs, failing or
-- retrying the task it was running, and starting another in its place.
--
-- Each worker is a ProcessContext of one process (start_processes with the
-- pool's start method, join = false), so one worker can be ended and
-- replaced without touching the others, and dies with the parent like any
-- worker.  Its body is poolworker.worker, configured by one table.  The
-- pool decides which worker ends and which task fails or runs again; every
-- signal and wait is the engine's (ctx:terminate(grace), ctx:poll()).
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
local STUCK = 0.5          -- a worker's untaken messages move after this long

local function mp_isinstance(v, tname)
  local mp = require "multiprocessing"
  return mp.isinstance(v, mp[tname])
end

function M.task_name(job, pos)
  return job.kind == "apply" and ("apply_async call %d"):format(pos)
         or ("task %d"):format(pos)
end
local task_name = M.task_name

-- Starts a worker in 'slot' of 'pool' and returns it (raises when the
-- start fails).
function M.new_worker(pool, slot)
  local mp = require "multiprocessing"
  local q = mp.Queue()
  q:_functions()
  pool.cur:set(slot, 0)
  local ok, ctx = pcall(mp.start_processes, W.worker, { {
      tasks = q, results = pool.results, board = pool.cur, slot = slot,
      title = ("pool worker %d (%s)"):format(slot, pool.script),
      maxtasks = pool.maxtasks, initializer = pool.initializer,
      initargs = pool.initargs } }, 1, false, false, pool.start_method)
  if not ok then
    q:close()
    error(ctx, 0)
  end
  local w = { slot = slot, ctx = ctx, q = q, pid = ctx:pids()[1], inflight = {}, nmsg = 0,
              assigned = 0, size = 1, fns = {}, nfns = 0,
              seen = 0, since = now() }
  pool.workers[slot] = w
  if pool.waiter then pool.waiter:add(ctx:fileno()) end
  return w
end
local new_worker = M.new_worker

-- The item a worker was running: rec, k; or nil.
local function running_item(self, w)
  local v = self.cur:get(w.slot)
  if v <= 0 then return nil end
  local rec = self.msgs[v // MID]
  if rec and rec.w == w then return rec, v % MID end
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

-- The end of worker 'w' as the engine reported it (ctx:poll(): its event,
-- with exitcode and signal), or nil while it runs.  Polling also advances
-- an ending the engine is carrying out (SIGKILL once the grace is over).
local function ended(w)
  if not w.ended then w.ended = w.ctx:poll()[1] end
  return w.ended
end
M.ended = ended

-- Ends worker 'w' and its queue: the engine sends SIGTERM and SIGKILL after
-- 'grace' seconds (0: SIGKILL now), and the worker is reaped.  The
-- messages it never took are read here: what they hold (file_system
-- references of arrays) is given back when they are collected, not lost
-- with the queue.
function M.retire(w, grace)
  if not ended(w) then
    w.ctx:terminate(grace)
    pcall(w.ctx.join, w.ctx)
  end
  w.ctx:close()
  local q = w.q
  while q:qsize() > 0 do
    local ok, msg = pcall(q.get, q, 0)
    if not ok or msg == nil then break end
  end
  q:close()
  w.ctx = nil
end

-- Worker 'w' has exited: its unfinished items run again elsewhere, the one
-- it was running fails (or is retried), and a new worker takes its slot.
function Pool:_lost(w)
  w.lost = true
  -- A worker killed while it wrote its results leaves that message half
  -- written, and the queue's readers wait for its end until some writer
  -- comes to pad it: the parent writes a no-op message itself (not
  -- waiting: a full queue has writers enough).
  pcall(self.results.put, self.results, false, 0)
  self:_drain()
  local code = ended(w).exitcode
  local ok, err = pcall(w.ctx.join, w.ctx, 0)
  local rec, k = running_item(self, w)
  local mids = {}
  for mid in pairs(w.inflight) do mids[#mids + 1] = mid end
  table.sort(mids)
  local redo = F.new()
  self.nmsg = self.nmsg - #mids
  for _, mid in ipairs(mids) do
    local r = self.msgs[mid]
    self.msgs[mid] = nil
    for i = r.upto + 1, r.n do
      local pos = r.first + i - 1
      -- the item it was running; or every item, when it died posting
      -- their results (a task that closed its descriptors, say): each
      -- counts as a try, so that this cannot go on for ever
      if r == rec and (i == k or k > r.n) then
        self:_killed(r.job, pos, w, code, w.killing and w.killing.timeout)
      elseif not r.job.abandoned then
        push(redo, { job = r.job, pos = pos })
      end
    end
  end
  -- requeued items go first, in order
  for i = self.redo.head, self.redo.tail do push(redo, self.redo[i]) end
  self.redo = redo
  local started = self.cur:get(w.slot) ~= 0
  M.retire(w, 0)
  w.inflight = {}
  if not ok and not started
      and mp_isinstance(err, "ProcessRaisedException") then
    -- the worker itself failed (its initializer): the pool cannot work
    self.broken = err
  elseif not started and code and code >= 0 then
    -- an initializer that exits (os.exit(0) too): it would do it again in
    -- every new worker
    self.broken = mk_exception("exited", {
      msg = ("pool process %d exited with %s in its initializer, before it "
             .. "was ready"):format(w.pid, (exit_text(code))),
      pid = w.pid, error_pid = w.pid, error_index = w.slot - 1,
      exit_code = code })
  elseif not started then
    -- killed while starting (it happens): the pool gives up when no
    -- worker gets ready before this many die
    self.unready = (self.unready or 0) + 1
    if self.unready > self.processes + 3 then
      self.broken = mk_exception("exited", {
        msg = ("pool process %d terminated with %s before it was ready, "
               .. "as did %d others (in the initializer?)")
              :format(w.pid, (exit_text(code)), self.unready - 1),
        pid = w.pid, error_pid = w.pid, error_index = w.slot - 1,
        exit_code = code })
    end
  end
  if self.broken then
    self:terminate()
    error(self.broken, 0)
  end
  if self.state ~= "terminate" then self:_restart(w) end
end

-- Starts a worker in w's slot.  A start that fails (EAGAIN, EMFILE, a
-- forkserver that died) leaves the slot empty for the next look; the
-- third failure in a row breaks the pool with its error.
function Pool:_restart(w)
  local ok, err = pcall(new_worker, self, w.slot)
  if ok then return end
  local fails = (w.start_fails or 0) + 1
  self.workers[w.slot] = { slot = w.slot, start_fails = fails, inflight = {},
                           nmsg = 0, assigned = 0, fns = {}, nfns = 0 }
  if fails >= 3 then
    self.broken = err
    self:terminate()
    error(err, 0)
  end
end

-- Takes back the messages worker 'w' has not taken from its queue: their
-- items go first in the redo list, for the other workers.  What w has
-- taken meanwhile stays its own (each message goes to one reader).  The
-- functions those messages carried never reached w: its cache starts again.
local function take_back(self, w)
  local q, back = w.q, F.new()
  while q:qsize() > 0 do
    local ok, msg = pcall(q.get, q, 0)
    if not ok or not msg then break end
    local mid = msg[1]
    local r = self.msgs[mid]
    if r and r.w == w then
      self.msgs[mid], w.inflight[mid] = nil, nil
      w.nmsg, self.nmsg = w.nmsg - 1, self.nmsg - 1
      w.assigned = w.assigned - r.n
      if not r.job.abandoned then
        for pos = r.first, r.first + r.n - 1 do
          push(back, { job = r.job, pos = pos })
        end
      end
    end
  end
  w.fns, w.nfns, w.reset = {}, 0, true
  for i = self.redo.head, self.redo.tail do push(back, self.redo[i]) end
  self.redo = back
end

-- Whether a worker other than 'w' is ready to take work.
local function other_ready(self, w)
  for _, o in ipairs(self.workers) do
    if o ~= w and o.ctx and not o.killing and not o.stuck
        and self.cur:get(o.slot) ~= 0 then
      return true
    end
  end
  return false
end

-- Whether process 'pid' is stopped (SIGSTOP, SIGTSTP, a tracer).
local function stopped(pid)
  local f = io.open("/proc/" .. pid .. "/stat")
  if not f then return false end
  local state = f:read("a"):match("%) (%a)")
  f:close()
  return state == "T" or state == "t"
end

-- A worker not running a task while messages wait for it: it is still in
-- its initializer (board 0), or stopped, or blocked.  After STUCK seconds
-- its messages go to another worker that is ready, and it gets no more
-- until it is seen to move.  One that is ready (board -1), or stopped,
-- and still has not taken them after the pool's timeout is ended like a
-- hung task (no task has started, so none fails: they run elsewhere).  An
-- initializer that runs may take as long as it likes.
local function watch_waiting(self, w, t, v)
  if w.nmsg == 0 and not w.stuck then
    w.waiting = nil
    return
  end
  w.waiting = w.waiting or t
  local waited = t - w.waiting
  if self.timeout and waited > self.timeout and (v < 0 or stopped(w.pid)) then
    w.killing = {}
    w.ctx:terminate(KILL_GRACE)
  elseif w.nmsg > 0 and waited > STUCK and other_ready(self, w) then
    w.stuck = true
    take_back(self, w)
  end
end

-- A live worker: ended (by the engine) when its task has run past its
-- timeout.
local function watch(self, w, t)
  if w.killing then return end   -- the engine is ending it
  local v = self.cur:get(w.slot)
  if v ~= w.seen then
    w.seen, w.since, w.waiting, w.stuck = v, t, nil, nil
    return
  end
  if v <= 0 then return watch_waiting(self, w, t, v) end
  local rec, k = running_item(self, w)
  if not rec or k > rec.n then return end   -- none, or posting results
  local job, pos = rec.job, rec.first + k - 1
  local limit = job.kind == "apply" and job.timeouts[pos] or job.timeout
                or self.timeout
  if limit and t - w.since > limit then
    w.killing = { timeout = limit }
    w.ctx:terminate(KILL_GRACE)
  end
end

-- Worker 'w' has posted its last results (maxtasksperchild) and exits: a
-- new worker takes its slot now, and it is reaped once it has gone.
function Pool:_retiring(w)
  local r = self.retiring
  r[#r + 1] = w
  if self.state ~= "terminate" then self:_restart(w) end
end

-- for _, w in all_workers(pool): the workers in the slots, then the
-- retiring ones.
function M.all_workers(self)
  local list = {}
  for _, w in ipairs(self.workers) do list[#list + 1] = w end
  for _, w in ipairs(self.retiring) do list[#list + 1] = w end
  return ipairs(list)
end

-- Reaps the retiring workers that have gone.
local function reap_retiring(self)
  local r, keep = self.retiring, {}
  for _, w in ipairs(r) do
    if ended(w) then
      pcall(w.ctx.join, w.ctx, 0)
      M.retire(w, 0)
    else
      keep[#keep + 1] = w
    end
  end
  self.retiring = keep
end

-- Looks at every worker: dead ones are replaced, hung tasks killed, empty
-- slots filled again.
function Pool:_check()
  local t = now()
  self.next_check = t + SLICE
  if #self.retiring > 0 then reap_retiring(self) end
  for _, w in ipairs(self.workers) do
    if not w.ctx then
      if w.start_fails and self.state ~= "terminate" then self:_restart(w) end
    elseif ended(w) then
      self:_lost(w)
    else
      watch(self, w, t)
    end
  end
end

-- join(): every worker gets its stop message and is waited for.  With a
-- pool timeout, one that has not taken it that long after (hung in its
-- initializer, or stopped) is ended.
function M.stop_all(self)
  local t0 = now()
  for _, w in ipairs(self.workers) do
    if w.ctx then pcall(w.q.put, w.q, false) end
  end
  while true do
    local live
    for _, w in M.all_workers(self) do
      if w.ctx then
        if ended(w) then
          pcall(w.ctx.join, w.ctx, 0)
          M.retire(w, 0)
        elseif self.timeout and now() - t0 > self.timeout
            and w.q:qsize() > 0 and not w.killing then
          w.killing = {}
          w.ctx:terminate(KILL_GRACE)
          live = live or w
        else
          live = live or w
        end
      end
    end
    if not live then return end
    local ok, err = pcall(live.ctx.join, live.ctx, SLICE)
    if not ok and core.isinstance(err, core.Interrupted) then
      self.call = "Pool.join"
      self:_interrupted()
    end
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
  if core.isinstance(err, core.Interrupted) then self:_interrupted() end
  error(err, 0)
end

return M
