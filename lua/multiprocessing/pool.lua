--- multiprocessing.pool: mp.Pool and its AsyncResult, a task farm over
-- ProcessContexts.  Its parts: poolcheck.lua (argument checks), fifo.lua
-- (the job and redo lists), poolsup.lua (workers that start, die, hang or
-- retire: the ranks of one ProcessContext), poolworker.lua (a worker's body:
-- take a message of tasks from the pool's one task queue, run them, post
-- the results on its one result queue; a module of its own, which a fresh
-- worker loads quickly).  The parent holds a descriptor per worker (its
-- pidfd) and a few for the whole pool.
--
-- Messages, parent -> workers (the task Queue, which alone carries Lua
-- functions as bytecode: q:_functions()); whichever worker is ready takes
-- the next one:
--   { mid, fid, mode, n, item1, ..., itemn, fns = {[fid] = fn} }
--   mode 0: fn(item); 1: fn(table.unpack(item)); 2 (apply_async): the
--   items are n pairs fid, args and each runs fns[fid](table.unpack(args));
--   false: stop.  A message carries every function it needs.
-- Results, worker -> parent (the result Queue, data only):
--   { mid, k0, k1, r_k0, ..., r_k1, e = {[k] = {text, value}}, d = seconds,
--     s = the worker's slot, last = it retires, back = it ran no further }
--   for items k0..k1 of message mid; a message's results come in order,
--   in one piece or, when its items are slow, in several.  Mid 0: the
--   worker's initializer failed ({ 0, 0, -1, init = traceback }).
-- Which item a worker is running: word 'slot' of the pool's board
-- (core._board, shared memory) = mid * 65536 + k, written before each item
-- (0: starting, -1: idle, k = 0: message taken).  That is how a task
-- timeout is seen and which message and task a dead worker had.
local core = require "multiprocessing.core"
local C = require "multiprocessing.poolcheck"
local F = require "multiprocessing.fifo"
local S = require "multiprocessing.poolsup"

local M = {}

local now, mk_exception = core._now, core._exception
local chunk, new_table, clear = core._chunk, core._table, core._clear
local runs_iter = core._runs
local tmove, floor, min, max = table.move, math.floor, math.min, math.max
local pcall, type = pcall, type
local argerror, describe, check_type = C.argerror, C.describe, C.check_type
local check_count, check_seconds, check_wait = C.check_count, C.check_seconds,
                                               C.check_wait
local check_options, check_sendable, NO_OPTIONS = C.check_options,
                                                  C.check_sendable, C.NO_OPTIONS
local fifo, push, peek, pop, is_empty = F.new, F.push, F.peek, F.pop,
                                        F.is_empty
local task_name = S.task_name

local MAXMSG = 4096        -- items in one message at most
local INFLIGHT = 2         -- messages out per worker at most
local SLICE = S.SLICE      -- seconds between looks at the workers
local TERM_GRACE = 1.0     -- terminate(): the same for the whole pool
local APPLY_BATCH = 1024  -- apply_async calls gathered while workers are busy
local APPLY_IDLE = 64     -- ... or while some worker is idle
local WINDOW = 65536       -- imap: results buffered ahead of the consumer
-- The two queues are small rings: their pages stay mapped in every
-- process, where the first touch of each page of a big ring costs a page
-- fault in each process (15-60 us on a VM) until the ring has gone round
-- once.  A message bigger than a ring goes in pieces.
local RESULTS_CAP, TASKS_CAP = 256 << 10, 256 << 10
local PUT_WAIT, PUT_WAIT_MAX = 0.02, 1  -- seconds a task message may wait
local FDS_PER_WORKER = 1   -- descriptors a worker costs the parent (its pidfd)

local START_METHODS = { fork = true, spawn = true, forkserver = true }

---------------------------------------------------------------------------
-- AsyncResult

-- Moves job.next past the cancelled calls at its head.
local function skip_cancelled(job)
  local skip, pos = job.cancelled, job.next
  while skip[pos] do
    skip[pos], pos = nil, pos + 1
  end
  job.next = pos
  if next(skip) == nil then job.cancelled = nil end
end

local AsyncResult = {}
AsyncResult.__index = AsyncResult
AsyncResult.__name = "multiprocessing.AsyncResult"

local function new_result(pool, opts)
  return setmetatable({ pool = pool, done = false,
                        callback = opts.callback,
                        error_callback = opts.error_callback }, AsyncResult)
end

-- Settles ar with (ok, value) and runs its callback, in the parent.
-- A callback that raises does not stop the pool from taking the other
-- results: its error belongs to this AsyncResult, whose get() raises it.
local function resolve(ar, ok, value)
  ar.done, ar.ok, ar.value = true, ok, value
  local cb = ok and ar.callback or not ok and ar.error_callback
  if cb then
    local cbok, err = pcall(cb, value)
    if not cbok then ar.callback_error = err end
  end
end

-- ar:get() for the public call 'call'.
local function get_value(ar, timeout, call)
  if not ar.done then
    if not ar.pool:_run(function() return ar.done end, timeout, call) then
      return nil, "timeout"
    end
  end
  if ar.callback_error ~= nil then error(ar.callback_error, 0) end
  if not ar.ok then error(ar.value, 0) end
  return ar.value
end

--- ar:get([timeout]) -> the value; raises the task's exception;
-- nil, "timeout" when it is not ready within 'timeout' seconds.
function AsyncResult:get(timeout)
  if timeout ~= nil then timeout = check_wait("AsyncResult.get", timeout) end
  return get_value(self, timeout, "AsyncResult.get")
end

--- ar:wait([timeout]) -> true when ready
function AsyncResult:wait(timeout)
  timeout = check_wait("AsyncResult.wait", timeout)
  if not self.done then
    self.pool:_run(function() return self.done end, timeout,
                   "AsyncResult.wait")
  end
  return self.done
end

function AsyncResult:ready()
  if not self.done then
    self.pool:_run(function() return self.done end, 0, "AsyncResult.ready")
  end
  return self.done
end

--- ar:fileno() -> the pool's waiter, a descriptor readable when results
-- may have arrived or a worker ended (mp.wait then calls ar:ready()); -1
-- once the pool has let its workers go (every result is settled by then).
function AsyncResult:fileno()
  return self.pool:_fileno()
end

--- ar:cancel() -> true when the call had not been sent to a worker: it
-- never runs, ar:get() raises a cancelled error, ar:cancelled() is true.
function AsyncResult:cancel()
  local pool, pos = self.pool, self.task
  local job = pool.applies
  if self.done or not pos or pos < job.next then return false end
  job.cancelled = job.cancelled or {}
  job.cancelled[pos] = true
  self.cancelled_ = true
  pool:_settle(job, pos, false, mk_exception("base", {
    msg = ("apply_async call %d was cancelled"):format(pos), task = pos,
    cancelled = true }))
  if pos == job.next then skip_cancelled(job) end
  return true
end

function AsyncResult:cancelled()
  return self.cancelled_ == true
end

function AsyncResult:successful()
  if not self:ready() then
    error("AsyncResult.successful: the result is not ready", 2)
  end
  return self.ok
end

function AsyncResult:__tostring()
  return ("AsyncResult (%s)"):format(not self.done and "pending" or
                                     self.ok and "done" or "failed")
end

---------------------------------------------------------------------------
-- Pool

local Pool = {}
for k, f in pairs(S.methods) do Pool[k] = f end
Pool.__index = Pool
Pool.__name = "multiprocessing.Pool"

local POOL_OPTIONS = { start_method = true, initializer = true,
                       initargs = true, maxtasksperchild = true,
                       timeout = true, retries = true, progress = true }

-- A job: the tasks of one map/imap/... call, or the stream of apply_async
-- calls (one job per pool, item i = the i-th call).
--   kind: "map" (results table), "imap" (in order), "unordered", "apply"
--   list, n, star, chunksize, next (first undispatched), left (unsettled)
--   results, errors, first_error, tries, outcomes, ...

--- mp.Pool([processes [, opts]])
function M.new(processes, opts)
  local mp = require "multiprocessing"
  if processes == nil then processes = core.cpu_count() end
  check_count("Pool", 1, processes, "processes")
  opts = check_options("Pool", 2, opts, POOL_OPTIONS)
  local method = opts.start_method or mp.get_start_method()
  if not START_METHODS[method] then
    argerror("Pool", 2, ("unknown start method '%s' (expected \"fork\", "
             .. "\"spawn\" or \"forkserver\")"):format(tostring(method)))
  end
  if opts.initializer ~= nil then
    check_type("Pool", 2, opts.initializer, "function")
  end
  if opts.initargs ~= nil then check_type("Pool", 2, opts.initargs, "table") end
  if opts.maxtasksperchild ~= nil then
    check_count("Pool", 2, opts.maxtasksperchild, "maxtasksperchild")
  end
  check_seconds("Pool", 2, opts.timeout, "timeout")
  local retries = opts.retries or 0
  if math.type(retries) ~= "integer" or retries < 0 then
    argerror("Pool", 2, "retries must be a non-negative integer, got "
             .. describe(retries))
  end
  local self = setmetatable({
    processes = processes, start_method = method,
    script = type(arg) == "table" and type(arg[0]) == "string" and arg[0]
             or "lua",
    initializer = opts.initializer, initargs = opts.initargs or {},
    maxtasks = opts.maxtasksperchild, timeout = opts.timeout,
    retries = retries,
    progress = type(opts.progress) == "function" and opts.progress
               or opts.progress and core._isatty(2),
    state = "run", workers = {}, msgs = {}, nextmid = 1, size = 1,
    put_wait = PUT_WAIT,
    queue = fifo(), redo = fifo(), fids = setmetatable(
      {}, { __mode = "k" }), nextfid = 1, active = 0, next_check = 0, nmsg = 0,
    idle_deaths = 0, nretiring = 0,
    ntasks = 0, ndone = 0,      -- tasks given, tasks settled (tostring)
  }, Pool)
  -- each worker costs the parent a descriptor, the pool a few: the soft
  -- limit is raised for them, as mprun does
  core._nofile_at_least(processes * FDS_PER_WORKER + 256)
  self.results = mp.Queue(0, { capacity = RESULTS_CAP })
  self.tasks = mp.Queue(0, { capacity = TASKS_CAP })
  self.tasks:_functions()
  self.cur = core._board(processes)
  self.applies = { kind = "apply", mode = 2, list = {}, n = 0, next = 1,
                   left = 0, chunksize = 1, ars = {}, fids = {}, fns = {},
                   timeouts = {},
                   tries = {}, pool = self }
  local ok, err = pcall(S.start, self)
  if not ok then
    self:terminate()
    error(err, 2)
  end
  return self
end

function Pool:print(...) return M.print(...) end

-- As of now: Pool (fork, 4 workers, 10 tasks pending, 25 done, run)
function Pool:__tostring()
  local alive = self.ctx and S.live_workers(self) or 0
  return ("Pool (%s, %d worker%s, %d task%s pending, %d done, %s)"):format(
    self.start_method, alive, alive == 1 and "" or "s", self.ntasks - self.ndone,
    self.ntasks - self.ndone == 1 and "" or "s", self.ndone, self.state)
end

local function check_running(self, fname, level)
  level = (level or 2) + 1
  if getmetatable(self) ~= Pool then
    error(("bad self to '%s' (Pool expected)"):format(fname), level)
  end
  if self.state ~= "run" then
    error(("%s: the pool is %s"):format(fname, self.state == "close"
          and "closed" or "terminated"), level)
  end
end

-- fn -> its id in this pool, checking once that it can be sent.
local function fn_id(self, fname, fn, level)
  local fid = self.fids[fn]
  if not fid then
    check_sendable(fname, "fn", fn, (level or 2) + 1)
    fid = self.nextfid
    self.nextfid = fid + 1
    self.fids[fn] = fid
  end
  return fid
end

---------------------------------------------------------------------------
-- dispatch: the parent hands runs of items to workers with room

local function enqueue(self, job)
  if not job.queued then
    job.queued = true
    push(self.queue, job)
  end
end

-- The next run of 'job': first position and count, or nil.
local function next_run(self, job)
  local first = job.next
  local rem = job.n - first + 1
  if rem <= 0 or job.abandoned then return nil end
  local n = min(self.size, MAXMSG, (rem + self.processes - 1) // self.processes)
  local cs = job.chunksize
  n = max(cs, n - n % cs)
  if job.window then n = min(n, job.consumed + job.window - first) end
  -- a worker gives back what it has no tasks left for: a message needs
  -- not to be longer than a worker's life
  if self.maxtasks then n = min(n, self.maxtasks) end
  n = min(n, rem)
  local skip = job.cancelled
  if skip then   -- a run stops before a cancelled call
    for pos = first + 1, first + n - 1 do
      if skip[pos] then n = pos - first break end
    end
  end
  if n <= 0 then return nil end
  job.next = first + n
  if skip then skip_cancelled(job) end
  return first, n
end

-- A message the task queue had no room for (put timed out): its run goes
-- back in line, and the pool's loop reads results meanwhile.  The loop
-- never waits on the task queue for long: a worker that cannot post its
-- results (the results queue full) reads no task, and a parent that
-- waited for one to read would wait for ever.  A message bigger than the
-- queue goes in pieces while a worker reads it, and is given up only when
-- no piece is taken for that long (Queue:_put_patient).  The next try
-- waits twice as long: a loaded machine may need it.
local function give_back(self, job, first, n)
  self.put_wait = min(self.put_wait * 2, PUT_WAIT_MAX)
  if job.next == first + n then job.next = first
  else
    for pos = first, first + n - 1 do push(self.redo, { job = job, pos = pos }) end
  end
end

local function send(self, job, first, n)
  local mid = self.nextmid
  self.nextmid = mid + 1
  local msg = { mid, job.fid or 0, job.mode, n }
  if job.mode == 2 then
    local list, fids, fns, sent = job.list, job.fids, job.fns, {}
    for k = 1, n do
      local pos = first + k - 1
      local fid = fids[pos]
      msg[3 + 2 * k], msg[4 + 2 * k] = fid, list[pos]
      sent[fid] = fns[pos]
    end
    msg.fns = sent
  else
    -- the run of the caller's list crosses as a view, not copied into msg
    msg.fns = { [job.fid] = job.fn }
    msg = chunk(msg, job.list, first, n, job.mode == 1)  -- 1: star
  end
  local ok, sent, why = pcall(self.tasks._put_patient, self.tasks, msg, self.put_wait)
  if not (ok and sent) then
    if ok and why == "timeout" then give_back(self, job, first, n)
    else self:_unsent(job, first, n, ok and why or sent) end
    return false
  end
  self.put_wait = PUT_WAIT
  -- dest: a map's results are decoded straight into its table (get_result)
  self.msgs[mid] = { job = job, first = first, n = n, upto = 0,
                     deaths = self.idle_deaths,
                     dest = job.kind == "map" and not job.outcomes
                            and job.results or nil }
  self.nmsg = self.nmsg + 1
  return true
end

-- Sends one message: a requeued item first, else the next run of the
-- first queued job that has one.
local function feed(self)
  local queue = self.queue
  local r = pop(self.redo)
  if r then
    if not r.job.abandoned then return send(self, r.job, r.pos, 1) end
    return
  end
  local sent
  for qi = queue.head, queue.tail do
    local job = queue[qi]
    local first, n = next_run(self, job)
    if first then
      sent = send(self, job, first, n)
      break
    end
  end
  -- jobs fully dispatched leave the queue from its head
  local job = peek(queue)
  while job and (job.next > job.n or job.abandoned) do
    job.queued = false
    pop(queue)
    job = peek(queue)
  end
  return sent
end

local function idle(self)
  return is_empty(self.redo) and is_empty(self.queue)
end

-- Sends work while fewer than INFLIGHT messages per worker are out (in
-- the task queue or being run).
function Pool:_dispatch()
  local limit = INFLIGHT * self.processes
  while self.nmsg < limit and not idle(self) do
    local before, redo = self.nextmid, not is_empty(self.redo)
    if feed(self) == false then return end     -- the queue took nothing
    if self.nextmid == before and not redo then return end  -- nothing to go
  end
end

---------------------------------------------------------------------------
-- settling tasks

local function finish_job(self, job)
  self.active = self.active - 1
  if job.progress then job.progress(true) end
  if job.ar then
    local e = job.errors and job.errors[job.first_error]
    if e and not job.outcomes then resolve(job.ar, false, e)
    else resolve(job.ar, true, job.results) end
  end
end

-- One item of 'job' has its outcome.
local function settle(self, job, pos, ok, value)
  job.left = job.left - 1
  if not job.abandoned then self.ndone = self.ndone + 1 end
  if not ok then job.nfailed = (job.nfailed or 0) + 1 end
  local kind = job.kind
  if kind == "apply" then
    local ar = job.ars[pos]
    job.ars[pos], job.list[pos], job.fids[pos], job.fns[pos],
      job.timeouts[pos], job.tries[pos] = nil, nil, nil, nil, nil, nil
    if job.left == 0 then self.active = self.active - 1 end
    resolve(ar, ok, value)
    return
  end
  if job.outcomes then
    value = ok and { ok = true, value = value } or { ok = false, error = value }
    ok = true
  end
  if kind == "unordered" then      -- a run of one (see imap_iter)
    push(job.runs, { { value }, 1, 1, pos, failed = not ok or nil })
  elseif ok then
    job.results[pos] = value
    if job.got then job.got[pos] = true end
  else
    job.errors = job.errors or {}
    job.errors[pos] = value
    if not job.first_error or pos < job.first_error then
      job.first_error = pos
    end
  end
  if job.left == 0 and not job.abandoned then finish_job(self, job) end
end

Pool._settle = settle

local function task_exception(job, pos, w, e)
  return mk_exception("raised", {
    msg = ("\n\n-- %s failed in pool process %d with the following "
           .. "error:\n%s"):format(task_name(job, pos), w.pid, e[1]),
    task = pos, value = e[2], pid = w.pid, error_pid = w.pid,
    error_index = w.slot - 1,   -- exit_code nil: the worker did not exit
  })
end

-- A message could not be put on the task queue: its items run later when
-- no worker can read it now (all are gone: they are replaced), else they
-- fail with the error.
function Pool:_unsent(job, first, n, err)
  if S.interrupt(err) then self:_interrupted() end
  for pos = first, first + n - 1 do
    if err == "closed" then
      push(self.redo, { job = job, pos = pos })
    else
      settle(self, job, pos, false, mk_exception("base", {
        msg = ("%s could not be sent to the pool's processes: %s")
              :format(task_name(job, pos), tostring(err)),
        task = pos }))
    end
  end
end

-- Message 'mid' (rec) has all its results: its worker ran n items of it
-- (res.back: it had no tasks left for the others, which run elsewhere).
local function message_done(self, mid, rec, res, w)
  if res.back then
    local redo = fifo()
    if not rec.job.abandoned then
      for i = res[3] + 1, rec.n do push(redo, { job = rec.job, pos = rec.first + i - 1 }) end
    end
    for i = self.redo.head, self.redo.tail do push(redo, self.redo[i]) end
    self.redo = redo
  end
  self:_forget(mid)
  local d = res.d
  if d and d < 0.002 then self.size = min(self.size * 4, MAXMSG)
  elseif d and d > 0.02 then self.size = max(1, self.size // 2) end
  -- (not when it is being lost: _lost replaces it itself)
  if res.last and w and not w.lost and self.workers[w.slot] == w then
    self:_retiring(w)
  end
end

-- A results message from a worker; true when 'res' is kept (by an
-- imap_unordered job, which hands out its results from it).
function Pool:_receive(res)
  if not res then return end   -- the parent's own no-op (see _lost)
  local mid, k0, k1 = res[1], res[2], res[3]
  if mid == 0 then             -- an initializer failed (see poolsup's _lost)
    self.init_failed = self.init_failed or res.init
    return
  end
  local rec = self.msgs[mid]
  if not rec or k0 ~= rec.upto + 1 then return end  -- a worker gone since
  self.unready = 0
  local w = rec.w or self.workers[res.s]
  rec.w = w
  local job, errs = rec.job, res.e
  local base = rec.first - 1
  local kind, kept = job.kind, false
  if (kind == "map" or kind == "unordered") and not errs and not job.outcomes then
    if kind == "map" then
      if not res.routed then
        tmove(res, 4, 4 + k1 - k0, rec.first + k0 - 1, job.results)
      end
    else   -- the message's results are handed out from it as they are
      push(job.runs, { res, 4, 4 + k1 - k0, rec.first + k0 - 1 })
      kept = true
    end
    job.left = job.left - (k1 - k0 + 1)
    if not job.abandoned then self.ndone = self.ndone + (k1 - k0 + 1) end
    if job.left == 0 and not job.abandoned then finish_job(self, job) end
  else
    for k = k0, k1 do
      local e = errs and errs[k]
      if e then settle(self, job, base + k, false,
                       task_exception(job, base + k, w, e))
      elseif res.routed then   -- already in place
        settle(self, job, base + k, true, job.results[base + k])
      else settle(self, job, base + k, true, res[4 + k - k0]) end
      -- a callback that terminated the pool has settled everything
      if self.msgs[mid] ~= rec then return end
    end
  end
  rec.upto = k1
  if k1 == rec.n or res.back then message_done(self, mid, rec, res, w) end
  if job.progress then job.progress() end
  return kept
end

-- The next results message, or nil, "timeout" | "closed".  Messages are
-- decoded into one spare table (Queue:_get_into), emptied after each
-- (settled): a big map does not make and drop a table a message.  Without
-- one (an imap_unordered keeps its messages; a callback that drains the
-- queue while a message is being settled), a new one is made as big as
-- its message.  A map's results go straight into its result table, by
-- the routes self.msgs (a record with 'dest', see send): res.routed.
local function get_result(self, timeout)
  local t = self.spare
  self.spare = nil
  local v, why = self.results:_get_into(t or false, timeout, self.msgs)
  if t and v ~= t then self.spare = t end
  return v, why
end

local function settle_message(self, res)
  if not self:_receive(res) and type(res) == "table" then
    clear(res)
    self.spare = res
  end
end

-- Takes every result already queued, without waiting.
function Pool:_drain()
  local results = self.results
  while results:qsize() > 0 do
    local ok, msg = pcall(get_result, self, 0)
    if not ok then self:_queue_error(msg) return end
    if msg == nil then return end   -- a message being written, or dropped
    settle_message(self, msg)
  end
end

---------------------------------------------------------------------------
-- the pool's loop

-- On an error exit of a wait by an interrupt, the workers go.
local function interrupt_guard(self)
  return setmetatable({}, { __close = function(_, err)
    if err ~= nil and S.interrupt(err) then
      if core.isinstance(err, core.Interrupted) then
        if self.state ~= "terminate" then self:terminate() end
      else   -- lua.c's hook raised it: ours replaces it
        self:_interrupted()
      end
    end
  end })
end

-- Runs the pool until done() or 'timeout' seconds (nil: for ever); returns
-- done().  Callbacks run here, in the parent.
function Pool:_run(done, timeout, call)
  self.call = call
  local deadline = timeout and now() + timeout
  local _ <close> = interrupt_guard(self)
  local results = self.results
  while true do
    if self.broken then error(self.broken, 0) end
    self:_dispatch()
    if done() then return true end
    if self.state == "terminate" and self.active == 0 then return done() end
    local slice = deadline and max(0, min(SLICE, deadline - now())) or SLICE
    local ok, msg = true, nil
    if slice > 0 and self.nretiring > 0 then
      -- a worker that retires is exiting: its slot starts again as soon as
      -- the engine sees it go, not at the next look
      ok, msg = pcall(core._poll, { self.ctx:fileno(), results:fileno() },
                      slice, call)
      if ok then ok, msg = pcall(get_result, self, 0) end
      self.next_check = 0
    elseif slice > 0 then
      ok, msg = pcall(get_result, self, slice)
    end
    if not ok then
      self:_queue_error(msg)
    elseif msg ~= nil then
      settle_message(self, msg)
    end
    self:_drain()
    if ok and msg == nil or now() >= self.next_check then self:_check() end
    if deadline and now() >= deadline then
      self:_dispatch()
      return done()
    end
  end
end

---------------------------------------------------------------------------
-- progress line

-- The progress line on the terminal (stderr) while a call draws one, so
-- that M.print can erase it, print, and draw it again.
local drawn = nil

--- mp.print(...), pool:print(...): print(...) to stdout that a progress
-- line on the terminal does not run into: the line is erased, the text
-- printed, the line drawn again under it.
function M.print(...)
  local n = select("#", ...)
  local parts = { ... }
  for i = 1, n do parts[i] = tostring(parts[i]) end
  if drawn then io.stderr:write("\r\27[K") end
  io.stdout:write(table.concat(parts, "\t", 1, n), "\n")
  io.stdout:flush()
  if drawn then io.stderr:write(drawn) end
end

local function progress_line(self, job)
  local report = self.progress
  if not report then return nil end
  local started, last = now(), 0
  return function(final)
    local t = now()
    if not final and t - last < 0.1 then return end
    last = t
    local done = job.n - job.left
    if report ~= true then return report(done, job.n, job.nfailed or 0) end
    local rate = done / max(t - started, 1e-9)
    local eta = rate > 0 and (job.left / rate) or 0
    drawn = ("\r%d/%d done  %.0f tasks/s  %d failed  ETA %ds\27[K")
            :format(done, job.n, rate, job.nfailed or 0, floor(eta + 0.5))
    io.stderr:write(drawn, final and "\n" or "")
    if final then drawn = nil end
  end
end

---------------------------------------------------------------------------
-- the public methods

local MAP_OPTIONS = { chunksize = true, outcomes = true, callback = true,
                      error_callback = true, timeout = true }

-- Checks fn, list, chunksize-or-options and makes the job.
local function new_job(self, fname, kind, fn, list, cs, star, default_cs)
  check_running(self, fname, 3)
  check_type(fname, 1, fn, "function", 3)
  check_type(fname, 2, list, "table", 3)
  local opts = {}
  if type(cs) == "table" then
    opts = check_options(fname, 3, cs, MAP_OPTIONS, 3)
    cs = opts.chunksize
  end
  local n = list.n or #list
  if math.type(n) ~= "integer" or n < 0 then
    argerror(fname, 2, "list.n must be a non-negative integer", 3)
  end
  if cs == nil then
    if default_cs then
      local c, extra = n // (self.processes * 4), n % (self.processes * 4)
      cs = max(1, extra > 0 and c + 1 or c)
    else cs = 1 end
  end
  check_count(fname, 3, cs, "chunksize", 3)
  check_seconds(fname, 3, opts.timeout, "timeout", 3)
  if not core._plain(list, n, star) then
    if star then
      for i = 1, n do
        if type(list[i]) ~= "table" then
          argerror(fname, 2, ("list[%d] must be a table of arguments, got %s")
                             :format(i, describe(list[i])), 3)
        end
      end
    end
    check_sendable(fname, "list", list, 3)
  end
  local fid = fn_id(self, fname, fn, 3)
  local job = { kind = kind, fname = fname, mode = star and 1 or 0, fn = fn, fid = fid,
                list = list, n = n, next = 1, left = n, chunksize = cs,
                results = kind ~= "unordered" and new_table(n, n) or nil, tries = {}, outcomes = opts.outcomes,
                timeout = opts.timeout, pool = self }
  job.progress = progress_line(self, job)
  if n > 0 then
    self.active = self.active + 1
    self.ntasks = self.ntasks + n
    enqueue(self, job)
  end
  return job, opts
end

local function map_results(self, job)
  self:_run(function() return job.left == 0 end, nil, job.fname)
  if job.errors and not job.outcomes then error(job.errors[job.first_error], 0) end
  return job.results
end

--- pool:map(fn, list [, chunksize | opts]) -> {r1, ..., rn, n = n}
function Pool:map(fn, list, chunksize)
  return map_results(self, new_job(self, "Pool.map", "map", fn, list,
                                   chunksize, false, true))
end

--- pool:starmap(fn, list_of_arg_tables [, chunksize | opts])
function Pool:starmap(fn, list, chunksize)
  return map_results(self, new_job(self, "Pool.starmap", "map", fn, list,
                                   chunksize, true, true))
end

local function async_map(self, fname, fn, list, chunksize, star)
  local job, opts = new_job(self, fname, "map", fn, list, chunksize, star,
                            true)
  job.ar = new_result(self, opts)
  if job.n == 0 then resolve(job.ar, true, job.results) end
  self:_run(function() return true end, 0, fname)
  return job.ar
end

--- pool:map_async(fn, list [, chunksize | opts]) -> AsyncResult
function Pool:map_async(fn, list, chunksize)
  return async_map(self, "Pool.map_async", fn, list, chunksize, false)
end

function Pool:starmap_async(fn, list, chunksize)
  return async_map(self, "Pool.starmap_async", fn, list, chunksize, true)
end

-- A job left before its end (a loop that breaks, an error): what was not
-- dispatched is dropped, what runs finishes and is discarded.
local function abandon(self, job)
  if job.left > 0 and not job.abandoned then
    if job.progress then drawn = nil end   -- its line is left as it was
    job.abandoned = true
    self.active = self.active - 1
    self.ntasks = self.ntasks - job.left   -- no longer anyone's (tostring)
  end
end

local function imap_iter(self, fname, kind, fn, list, chunksize)
  local job = new_job(self, fname, kind, fn, list, chunksize, false, false)
  job.consumed, job.window = 0, WINDOW
  local closer = setmetatable({}, { __close = function() abandon(self, job) end })
  local i = 0
  if kind == "imap" then
    local results, got = job.results, {}
    job.got = got
    return function()
      if i >= job.n then return nil end
      i = i + 1
      local pos = i
      self:_run(function()
        return got[pos] or job.errors and job.errors[pos] ~= nil
      end, nil, fname)
      local e = job.errors and job.errors[pos]
      if e then
        abandon(self, job)
        error(e, 0)
      end
      local v = results[pos]
      results[pos], got[pos] = nil, nil
      job.consumed = pos
      return pos, v
    end, nil, nil, closer
  end
  -- results come in runs, in the order they arrive: a run is { values,
  -- first index, last index, position of the first[, failed] }, a whole
  -- message's results or one settled item.  core._runs hands them out;
  -- the consumer's place counts for the window from run to run (the pool
  -- dispatches only in _run, where it is exact).
  local runs = fifo()
  local function arrived() return not is_empty(runs) end
  job.runs = runs
  return runs_iter(job.n, function(handed)
    job.consumed = handed
    if is_empty(runs) then self:_run(arrived, nil, fname) end
    local run = pop(runs)
    if run.failed then   -- a run of one: the failure
      job.consumed = handed + 1
      abandon(self, job)
      error(run[1][run[2]], 0)
    end
    return run[1], run[2], run[3], run[4] - run[2]
  end), nil, nil, closer
end

--- for i, r in pool:imap(fn, list [, chunksize | opts]) -- in input order
function Pool:imap(fn, list, chunksize)
  return imap_iter(self, "Pool.imap", "imap", fn, list, chunksize)
end

--- for i, r in pool:imap_unordered(fn, list [, chunksize | opts])
function Pool:imap_unordered(fn, list, chunksize)
  return imap_iter(self, "Pool.imap_unordered", "unordered", fn, list,
                   chunksize)
end

local APPLY_OPTIONS = { callback = true, error_callback = true, timeout = true }

-- One call of fn(table.unpack(args)) for apply_async and submit ('fname'
-- names it in errors; the checks are inline where they cost: a call per
-- task adds up).
local function apply_task(self, fname, fn, args, opts)
  if self.state ~= "run" then check_running(self, fname, 3) end
  if type(fn) ~= "function" then check_type(fname, 1, fn, "function", 3) end
  if args == nil then args = {}
  elseif type(args) ~= "table" then check_type(fname, 2, args, "table", 3) end
  if opts ~= nil then
    opts = check_options(fname, 3, opts, APPLY_OPTIONS, 3)
    check_seconds(fname, 3, opts.timeout, "timeout", 3)
  else
    opts = NO_OPTIONS
  end
  local fid = self.fids[fn] or fn_id(self, fname, fn, 3)
  for _, v in next, args do
    local t = type(v)
    if t == "table" or t == "function" or t == "userdata" then
      check_sendable(fname, "args", args, 3)
      break
    end
  end
  local job = self.applies
  local pos = job.n + 1
  job.n, job.left = pos, job.left + 1
  self.ntasks = self.ntasks + 1
  job.list[pos], job.fids[pos], job.fns[pos] = args, fid, fn
  job.timeouts[pos] = opts.timeout
  local ar = setmetatable({ pool = self, done = false, task = pos,
                            callback = opts.callback,
                            error_callback = opts.error_callback },
                          AsyncResult)
  job.ars[pos] = ar
  if job.left == 1 then self.active = self.active + 1 end
  enqueue(self, job)
  -- A call goes out at once when the pool is idle; otherwise calls gather
  -- and go out in messages of many (a message per call would cost a
  -- worker's wake-up per call): when APPLY_IDLE wait and a worker is idle,
  -- when APPLY_BATCH wait, or when the parent next waits for results.
  local waiting = pos - job.next + 1
  if self.nmsg == 0 or waiting >= APPLY_BATCH
      or waiting >= APPLY_IDLE and self.nmsg < self.processes then
    self.call = fname
    self:_drain()
    self:_dispatch()
  end
  return ar
end

--- pool:apply_async(fn [, args [, opts]]) -> AsyncResult
function Pool:apply_async(fn, args, opts)
  return apply_task(self, "Pool.apply_async", fn, args, opts)
end

--- pool:submit(fn, ...) -> AsyncResult of fn(...): a future
function Pool:submit(fn, ...)
  return apply_task(self, "Pool.submit", fn, table.pack(...))
end

--- pool:apply(fn [, args]) -> the value, or raises
function Pool:apply(fn, args)
  return get_value(apply_task(self, "Pool.apply", fn, args), nil, "Pool.apply")
end

--- close(): no new tasks; the submitted ones still run.
function Pool:close()
  if self.state == "run" then self.state = "close" end
end

--- join(): after close, waits for every task and every worker.
function Pool:join()
  if self.state == "run" then
    error("Pool.join: the pool is still running (call close or terminate "
          .. "first)", 2)
  end
  if self.state == "close" then
    self:_run(function() return self.active == 0 end, nil, "Pool.join")
    local _ <close> = interrupt_guard(self)
    S.stop_all(self)
    S.finish(self, 0)
    self.state = "joined"
  end
  self:_release()
end

-- Everything still pending fails at once with this exception.
local function fail_pending(self)
  local e = mk_exception("base", {
    msg = "the pool was terminated before the task finished" })
  for mid, rec in pairs(self.msgs) do
    self.msgs[mid] = nil
    for i = rec.upto + 1, rec.n do
      if rec.job.left > 0 then settle(self, rec.job, rec.first + i - 1, false, e) end
    end
  end
  for job in pop, self.queue do
    job.queued = false
    for pos = job.next, job.n do
      if job.left > 0 then settle(self, job, pos, false, e) end
    end
    job.next = job.n + 1
  end
  for r in pop, self.redo do
    if r.job.left > 0 then settle(self, r.job, r.pos, false, e) end
  end
end

--- terminate(): stop now; pending results raise from get().
function Pool:terminate()
  if self.state == "terminate" or self.state == "joined" then return end
  self.state = "terminate"
  -- every worker gets its SIGTERM now and its SIGKILL one grace later,
  -- from the engine: the whole pool ends in about one grace
  S.finish(self, TERM_GRACE)
  pcall(fail_pending, self)
  self.active = 0
  self:_release()
end

-- The waiter (src/pool.c) over the results queue and the workers'
-- context, made on first use.
function Pool:_fileno()
  if self.state == "joined" or self.state == "terminate" then return -1 end
  if not self.waiter then
    self.waiter = core._waiter()
    self.waiter:add(self.results:fileno())
    if self.ctx then self.waiter:add(self.ctx:fileno()) end
  end
  return self.waiter:fileno()
end

function Pool:_release()
  if self.waiter then self.waiter:close() end
  if self.results then self.results:close() end
  if self.tasks then self.tasks:close() end
  if self.cur then self.cur:close() end
end

function Pool:__close(err)
  if err == nil and self.state ~= "terminate" then
    self:close()
    self:join()
  else
    self:terminate()
  end
end

function Pool:__gc()
  if self.state ~= "joined" then pcall(self.terminate, self) end
end

return M
