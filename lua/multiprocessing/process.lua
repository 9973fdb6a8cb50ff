--- multiprocessing.process: processes with different jobs.
--
--   mp.Process        one job in a process of its own (Python's Process)
--   mp.wait           whichever of many objects is ready first
--                     (Python's multiprocessing.connection.wait)
--   mp.as_completed   results as they finish (concurrent.futures')
--   mp.active_children, mp.current_process, mp.parent_process, which know
--   these processes
--
-- A Process is a ProcessContext of one worker (start_processes with
-- join = false), so it has every guarantee of a worker: its own process
-- group, it dies with its parent, its job and arguments cross under every
-- start method, and nothing is left once it is joined, closed or
-- collected.  Its sentinel is a pidfd of that worker (the handle's
-- fileno(), src/context.c).  mp.wait sleeps in one poll(2) over the
-- objects' descriptors (core._poll, src/select.c); which of them are ready
-- is decided here.
local core = require "multiprocessing.core"

local M = {}

local now, isinstance = core._now, core.isinstance
local unpack = table.unpack
local type, pcall, error = type, pcall, error

---------------------------------------------------------------------------
-- argument checks

local function argerror(fname, i, msg, level)
  error(("bad argument #%d to '%s' (%s)"):format(i, fname, msg), level + 1)
end

-- nil, or a number of seconds (negative: 0); NaN and others raise.
-- A function that takes no argument was given some.
local function check_none(fname, n, first)
  if n > 0 then argerror(fname, 1, "no argument expected, got " .. type(first), 3) end
end

local function check_timeout(fname, i, v, level)
  if v == nil then return nil end
  if type(v) ~= "number" or v ~= v then
    argerror(fname, i, "timeout must be a number of seconds or nil, got "
             .. (type(v) == "number" and "nan" or type(v)), level + 1)
  end
  return v < 0 and 0 or v
end

local function check_method(fname, i, name, level)
  local known = core.get_all_start_methods()
  for _, m in ipairs(known) do
    if m == name then return name end
  end
  argerror(fname, i, ("unknown start method '%s' (expected one of: %s)")
           :format(tostring(name), table.concat(known, ", ")), level + 1)
end

---------------------------------------------------------------------------
-- who this process is

-- Python's _identity: {} in the main process; in a child of mp.Process,
-- its parent's identity and its own number.  'count' numbers the
-- Processes made here (their default names: "Process-1", "Process-1:2").
-- In a child, 'pid' is its own pid, 'name', 'daemon' and 'parent' what its
-- parent gave it: a process forked from that child (a plain worker) finds
-- another pid there, and is not that child.
local me = { identity = {}, count = 0 }

local function is_me(pid)
  return me.pid ~= nil and me.pid == pid
end

--- mp.current_process(): core's description of this process, with the
-- name and daemon flag of the mp.Process it runs, if it runs one.
function M.current_process(...)
  check_none("current_process", select("#", ...), ...)
  local t = core.current_process()
  if is_me(t.pid) then t.name, t.daemon = me.name, me.daemon end
  return t
end

--- mp.parent_process(): in a worker, {pid, ident, name, is_alive}
-- of the process that started it; nil in the main process.
function M.parent_process()
  local t = core.current_process()
  if t.rank == nil then return nil end
  local given = is_me(t.pid) and me.parent or {}
  local pid = given.pid or t.ppid
  return {
    pid = pid, ident = pid, name = given.name or "MainProcess",
    -- a child is given to init when its parent dies
    is_alive = function() return core.current_process().ppid == pid end,
  }
end

-- In the child, before its job: who it is, and what ps shows.
function M._enter(info)
  me = { identity = info.identity, count = 0, pid = core.current_process().pid,
         name = info.name, daemon = info.daemon, parent = info.parent }
  core._set_title(("lua process %s (%s)"):format(info.name, info.script))
end

-- The body of every Process's worker: the job's values, packed.
local function child_main(_, target, args, info)
  require("multiprocessing.process")._enter(info)
  if type(target) == "table" then
    return table.pack(target:run(table.unpack(args, 1, args.n or #args)))
  end
  return table.pack(target(table.unpack(args, 1, args.n or #args)))
end

---------------------------------------------------------------------------
-- Process

local Process = {}
local methods = {}
Process.__methods = methods
Process.__name = "multiprocessing.Process"

-- The Process objects of the handles of their workers, for
-- active_children (weak: a Process nobody holds is collected, and killed).
local owners = setmetatable({}, { __mode = "k" })

local OPTIONS = { name = "string", daemon = "boolean", start_method = "string" }

local function check_options(fname, i, opts, known, level)
  if opts == nil then return {} end
  if type(opts) ~= "table" then
    argerror(fname, i, "table of options expected, got " .. type(opts), level + 1)
  end
  for k, v in pairs(opts) do
    if not known[k] then
      argerror(fname, i, ("unknown option '%s'"):format(tostring(k)), level + 1)
    elseif type(v) ~= known[k] then
      argerror(fname, i, ("option '%s' must be a %s, got %s")
               :format(k, known[k], type(v)), level + 1)
    end
  end
  return opts
end

local function is_job(v)
  return type(v) == "function"
      or type(v) == "table" and type(v.run) == "function"
end

local KEYWORDS = { target = "any", args = "any", name = "string",
                   daemon = "boolean", start_method = "string" }

-- Python's keyword form, mp.Process{target = fn, args = {...}, ...}: a
-- table whose target is given, or that has no run method of its own.
local function from_keywords(t)
  local known = {}
  for k, v in pairs(KEYWORDS) do known[k] = v end
  for k, v in pairs(t) do
    if not known[k] then
      argerror("Process", 1, ("unknown field '%s'"):format(tostring(k)), 3)
    elseif known[k] ~= "any" and type(v) ~= known[k] then
      argerror("Process", 1, ("field '%s' must be a %s, got %s")
               :format(k, known[k], type(v)), 3)
    end
  end
  return t.target, t.args, t, "field 'target'", "field 'args'"
end

--- mp.Process(target [, args [, opts]]) or mp.Process{target =, args =,
-- name =, daemon =, start_method =}: a process that will run
-- target(table.unpack(args)) -- or target:run(...) when target is a table
-- with a run method -- once started.
local function new(_, target, args, opts)
  local tname, aname = "argument #1", "argument #2"
  if type(target) == "table" and (target.target ~= nil
                                   or type(target.run) ~= "function") then
    if args ~= nil or opts ~= nil then
      argerror("Process", 2, "no arguments after a table of fields", 2)
    end
    target, args, opts, tname, aname = from_keywords(target)
  else
    opts = check_options("Process", 3, opts, OPTIONS, 2)
  end
  if not is_job(target) then
    error(("bad %s to 'Process' (a function or a table with a run method "
           .. "expected, got %s)"):format(tname, type(target)), 2)
  end
  if args ~= nil and type(args) ~= "table" then
    error(("bad %s to 'Process' (table expected, got %s)")
          :format(aname, type(args)), 2)
  end
  local method = opts.start_method
  if method ~= nil then check_method("Process", 3, method, 2) end
  me.count = me.count + 1
  local identity = { table.unpack(me.identity) }
  identity[#identity + 1] = me.count
  local daemon = opts.daemon
  if daemon == nil then daemon = M.current_process().daemon or false end
  return setmetatable({
    name = opts.name or "Process-" .. table.concat(identity, ":"),
    daemon = daemon, start_method = method,
    _target = target, _args = args or {}, _identity = identity,
  }, Process)
end

-- The process has been started and not closed: its context.
local function started(self, fname)
  if self._closed then error(fname .. ": the process object is closed", 3) end
  if not self._ctx then
    error(fname .. ": the process has not been started", 3)
  end
  return self._ctx
end

function methods:start()
  if self._closed then error("Process.start: the process object is closed", 2) end
  if self._ctx then
    error("Process.start: a process can be started only once", 2)
  end
  local parent = M.current_process()
  local info = { name = self.name, daemon = self.daemon, identity = self._identity,
                 parent = { pid = parent.pid, name = parent.name },
                 script = type(arg) == "table" and type(arg[0]) == "string"
                          and arg[0] or "lua" }
  local method = self.start_method or require("multiprocessing").get_start_method()
  local ok, ctx = pcall(core.start_processes, child_main,
                        { self._target, self._args, info }, 1, false,
                        self.daemon, method)
  if not ok then error("Process.start: " .. tostring(ctx), 2) end
  self._ctx, self._h = ctx, ctx.processes[1]
  owners[self._h] = self
end

-- The join (or join(0)) that found the worker gone: its outcome.  A death
-- we caused (ctx:terminate) is no failure: join returns true, with no
-- results to read.
local function settle(self, ok, v)
  if ok then
    local got, results = pcall(self._ctx.results, self._ctx)
    self._result = got and results[1] or nil
  else
    self._error = v
  end
  self._done = true
end

--- p:join([timeout]) -> true once the process has ended, false when
-- 'timeout' passed first.  Its failure is p:error(), never raised here.
function methods:join(timeout)
  local ctx = started(self, "Process.join")
  timeout = check_timeout("Process.join", 1, timeout, 2)
  if self._done then return true end
  local ok, v = pcall(ctx.join, ctx, timeout)
  if ok and not v then return false end
  if ok or isinstance(v, core.ProcessException) then
    settle(self, ok, v)
    return true
  end
  -- Ctrl-C (the worker was terminated and reaped), or a bug: raised
  if not self._h:is_alive() then self._done = true end
  error(v, 0)
end

function methods:is_alive()
  if self._closed then error("Process.is_alive: the process object is closed", 2) end
  if not self._ctx or self._done then return false end
  return self._h:is_alive()
end

-- The process has ended: its outcome is settled (a join that returns at
-- once).  Raises when it runs.
local function outcome(self, fname)
  if self._done then return end
  started(self, fname)
  if self._h:is_alive() then
    error(fname .. ": the process is still running (join it first)", 3)
  end
  self:join()
end

--- p:result() -> what the job returned (every value), or nothing when it
-- failed (see p:error()).
function methods:result()
  outcome(self, "Process.result")
  local r = self._result
  if r then return unpack(r, 1, r.n) end
end

--- p:error() -> the ProcessRaisedException or ProcessExitedException of
-- a job that failed, or nil.
function methods:error()
  outcome(self, "Process.error")
  return self._error
end

-- The engine's termination (ctx:terminate): SIGTERM now, SIGKILL once
-- 'grace' seconds have passed (advanced by join), never blocking.
local function signal(self, fname, grace)
  started(self, fname)
  if self._done or not self._h:is_alive() then return end
  self._ctx:terminate(grace)
end

--- p:terminate(): SIGTERM (and SIGCONT) to the process and its group, and
-- SIGKILL 30 s later if it still runs; p:kill(): SIGKILL now.  Nothing
-- once it has ended.  The death they cause is no failure.
function methods:terminate() signal(self, "Process.terminate", nil) end
function methods:kill() signal(self, "Process.kill", 0) end

--- p:fileno() (p.sentinel): a descriptor readable once the process has
-- ended; valid until p:close() or collection.
function methods:fileno()
  started(self, "Process.fileno")
  return self._h:fileno()
end

--- p:run(): the job, in this process (what the started process runs).
function methods:run()
  local args = self._args
  if type(self._target) == "table" then
    return self._target:run(unpack(args, 1, args.n or #args))
  end
  return self._target(unpack(args, 1, args.n or #args))
end

--- p:close(): gives back what the process object holds; it must have
-- ended.  Its result, error and exitcode stay readable.
function methods:close()
  if self._closed then return end
  if self._ctx then
    if self:is_alive() then
      error("Process.close: the process is still running (join, terminate "
            .. "or kill it first)", 2)
    end
    self:join()
    self._exitcode = self._h.exitcode
    self._h:close()
    self._ctx:close()
  end
  self._closed = true
end

-- <close>, __gc: kill the process if it runs, reap it, close.
local function discard(self)
  local ctx = self._ctx
  if not ctx or self._closed then return end
  ctx:close()                        -- SIGKILL to what runs, and reaping
  local h = self._h                  -- not ours in a forked worker: pcall
  local ok, code = pcall(function() return h.exitcode end)
  self._exitcode = ok and code or nil
  pcall(h.close, h)
  self._closed = true
end
Process.__close = discard
Process.__gc = discard

local fields = {
  pid = function(self) return self._h and self._h.pid end,
  exitcode = function(self)
    if self._closed then return self._exitcode end
    return self._h and self._h.exitcode
  end,
  sentinel = function(self) return self:fileno() end,
}
fields.ident = fields.pid

function Process.__index(self, key)
  local f = fields[key]
  if f then return f(self) end
  return methods[key]
end

function Process.__tostring(self)
  local state
  if not self._ctx then state = "initial"
  elseif self:is_alive() then state = ("pid %d, running"):format(self.pid)
  else state = ("pid %d, exitcode %s"):format(self.pid, tostring(self.exitcode))
  end
  return ("Process '%s' (%s)"):format(self.name, state)
end

-- mp.Process: the constructor, and the type: the metatable of every
-- Process, so getmetatable(p) == mp.Process and mp.isinstance(p, mp.Process).
M.Process = setmetatable(Process, { __call = new })

--- mp.active_children(): the live workers this process started, as
-- mp.Process objects where they are one.
function M.active_children(...)
  check_none("active_children", select("#", ...), ...)
  local list = core.active_children()
  for i, h in ipairs(list) do list[i] = owners[h] or h end
  return list
end

---------------------------------------------------------------------------
-- wait

local function index(o, k) return o[k] end

-- The descriptor of object 'o' and its ready method, if any.
local function waitable(fname, o, i)
  if math.type(o) == "integer" then return o, nil end
  local t = type(o)
  local fileno, ready
  if t == "table" or t == "userdata" then   -- (a userdata may not index)
    local ok
    ok, fileno = pcall(index, o, "fileno")
    if not ok then fileno = nil end
    ok, ready = pcall(index, o, "ready")
    if not ok or type(ready) ~= "function" then ready = nil end
  end
  if type(fileno) ~= "function" then
    argerror(fname, 1, ("objects[%d] is a %s: a descriptor or an object "
             .. "with a fileno() method expected"):format(i, t), 3)
  end
  local ok, fd = pcall(fileno, o)
  if not ok then
    argerror(fname, 1, ("objects[%d]: %s"):format(i, tostring(fd)), 3)
  end
  if math.type(fd) ~= "integer" then
    argerror(fname, 1, ("objects[%d]:fileno() gave a %s, not a descriptor")
             :format(i, type(fd)), 3)
  end
  return fd, ready
end

-- The wait of mp.wait and as_completed ('fname'): the objects of the list
-- that are ready, in its order, or {} once 'timeout' (nil: none) passed.
local function wait(fname, objects, timeout)
  local n = #objects
  local fds, ready = {}, {}
  for i = 1, n do fds[i], ready[i] = waitable(fname, objects[i], i) end
  local deadline = timeout and now() + timeout
  local readable, first = core._poll(fds, 0, fname), true
  while true do
    local out = {}
    for i = 1, n do
      local r = readable[i]
      if r == "invalid" then
        argerror(fname, 1, ("objects[%d]'s descriptor %d is not open")
                 :format(i, fds[i]), 3)
      end
      -- ready() is asked after its descriptor was readable, and once
      -- before the first sleep (it may have finished while nobody looked)
      if ready[i] then r = (r or first) and ready[i](objects[i]) end
      if r then out[#out + 1] = objects[i] end
    end
    if #out > 0 then return out end
    local left = deadline and deadline - now()
    if left and left <= 0 then return out end
    readable, first = core._poll(fds, left, fname), false
  end
end

--- mp.wait(objects [, timeout]) -> the objects that are ready, in the
-- order given; {} when 'timeout' passed first.
function M.wait(objects, timeout)
  if type(objects) ~= "table" then
    argerror("multiprocessing.wait", 1, "table expected, got " .. type(objects), 2)
  end
  timeout = check_timeout("multiprocessing.wait", 2, timeout, 2)
  return wait("multiprocessing.wait", objects, timeout)
end

--- mp.as_completed(results [, timeout]) -> an iterator over the objects of
-- 'results' (AsyncResults; anything mp.wait takes) as they finish; raises
-- mp.TimeoutError when 'timeout' seconds (from this call) pass first.
function M.as_completed(results, timeout)
  local fname = "multiprocessing.as_completed"
  if type(results) ~= "table" then
    argerror(fname, 1, "table expected, got " .. type(results), 2)
  end
  timeout = check_timeout(fname, 2, timeout, 2)
  local pending, seen = {}, {}
  for i = 1, #results do
    local o = results[i]
    waitable(fname, o, i)
    if not seen[o] then
      seen[o] = true
      pending[#pending + 1] = o
    end
  end
  local total, done = #pending, {}
  local deadline = timeout and now() + timeout
  return function()
    if (done.head or 1) > #done and #pending > 0 then
      local left = deadline and math.max(0, deadline - now())
      local ready = wait(fname, pending, left)
      if #ready == 0 then
        error(core._exception("timeout", {
          msg = ("%s: %d (of %d) unfinished after %g seconds")
                :format(fname, #pending, total, timeout),
          kind = "timeout", call = fname, timeout = timeout,
          unfinished = pending,
        }), 2)
      end
      local taken = {}
      for _, o in ipairs(ready) do taken[o] = true end
      local rest = {}
      for _, o in ipairs(pending) do
        if not taken[o] then rest[#rest + 1] = o end
      end
      pending, done = rest, ready
      done.head = 1
    end
    local head = done.head
    if head == nil or head > #done then return nil end
    done.head = head + 1
    return done[head]
  end
end

return M
