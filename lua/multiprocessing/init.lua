--- multiprocessing: start Lua worker processes, join them, and get their
-- failures back as exceptions -- torch.multiprocessing for Lua.
--
-- The system work is done in C (multiprocessing.core, src/*.c).  This file
-- is the table of contents of the API: every public name, grouped by
-- concern, each group naming the file that implements it and the spec that
-- covers it.  The core's names that start with "_" are the entry points of
-- spawned workers and the forkserver, and helpers of the Lua layer: they
-- are not exported.
local core = require "multiprocessing.core"

local M = {}

-- Copies the named entries of the core; a name the core lacks is a bug.
local function export(names)
  for _, name in ipairs(names) do
    M[name] = core[name]
    assert(M[name] ~= nil, "multiprocessing.core has no " .. name)
  end
end

-- The version is kept in one place, multiprocessing.h (LMP_VERSION).
M._VERSION = core._VERSION

-- Processes: starting, joining, the handles of the workers.
-- src/context.c, src/join.c, src/worker.c, src/start_*.c;
-- spec/core_spec.lua, spec/results_spec.lua, spec/repl_spec.lua.
export { "start_processes", "spawn", "ProcessContext", "get_all_start_methods" }

-- Processes with different jobs: mp.Process, waiting on whichever object
-- is ready, results as they finish; the processes this one started and
-- its own place among them.  lua/multiprocessing/process.lua (its C:
-- src/select.c, the Process handle's sentinel in src/context.c);
-- spec/process_spec.lua, spec/wait_spec.lua.
do
  local P = require "multiprocessing.process"
  for _, name in ipairs { "Process", "wait", "as_completed", "active_children",
                          "current_process", "parent_process" } do
    M[name] = P[name]
  end
end

-- Failures as exception objects.  src/exception.c; spec/core_spec.lua.
export { "ProcessException", "ProcessRaisedException",
         "ProcessExitedException", "isinstance" }

-- Ctrl-C in any blocking call (not a ProcessException).  src/exception.c;
-- spec/sync_spec.lua, spec/queue_spec.lua, spec/repl_spec.lua.
export { "Interrupted" }

-- Where the library's warnings go (stderr, or a host's handler).
-- src/core.c; spec/embed_spec.lua.
export { "set_warning_handler" }

-- The program of "spawn" and "forkserver" workers.  src/executable.c;
-- spec/spawn_spec.lua.
export { "set_executable", "get_executable" }

-- How shared memory crosses: file_descriptor or file_system.  src/shm.c;
-- spec/sharing_spec.lua.
export { "get_all_sharing_strategies", "get_sharing_strategy",
         "set_sharing_strategy" }

-- Shared arrays.  src/array.c; spec/sharing_spec.lua.
export { "Array", "Value" }

-- Channels.  src/channel.c; spec/queue_spec.lua.
export { "Queue", "SimpleQueue", "JoinableQueue", "Pipe" }

-- Synchronisation.  src/sync.c (waits: src/wait.c); spec/sync_spec.lua.
export { "Lock", "RLock", "Semaphore", "BoundedSemaphore", "Event",
         "Condition", "Barrier" }

-- The codec workers use, for tests and tools.  src/codec.c;
-- spec/codec_spec.lua.
export { "encode", "decode" }

-- Signal names -> numbers.  src/signames.c; spec/core_spec.lua.
export { "signals" }

-- Where this process stands in a job (mprun).
-- lua/multiprocessing/world.lua; spec/mprun_spec.lua.
M.world = require("multiprocessing.world").world

-- Process pools and the start method they use by default; cpu_count (the
-- affinity mask and the cgroup CPU quota: src/cpus.c, also mprun -n auto).
-- lua/multiprocessing/pool.lua (+ poolcheck, fifo, poolsup, poolworker; its C:
-- src/pool.c); spec/pool_spec.lua, spec/mprun_spec.lua.
export { "cpu_count", "TimeoutError" }

local start_method = "spawn"

-- The start methods are listed once, in C (src/context.c).
function M.set_start_method(name)
  local names = core.get_all_start_methods()
  for _, known in ipairs(names) do
    if name == known then
      start_method = name
      return
    end
  end
  for i, known in ipairs(names) do names[i] = ('"%s"'):format(known) end
  local expected = table.concat(names, ", ", 1, #names - 1) .. " or " .. names[#names]
  error(("bad argument #1 to 'set_start_method' (unknown start method "
         .. "'%s'; expected %s)"):format(tostring(name), expected), 2)
end

function M.get_start_method(...)
  if select("#", ...) > 0 then
    error(("bad argument #1 to 'get_start_method' (no argument expected, got %s)")
          :format(type((...))), 2)
  end
  return start_method
end

function M.Pool(processes, opts)
  return require("multiprocessing.pool").new(processes, opts)
end

-- print(...) that a Pool's progress line does not run into (pool.lua).
function M.print(...)
  return require("multiprocessing.pool").print(...)
end

-- torch renamed SpawnContext to ProcessContext; the old name still works and
-- warns once per Lua state.
local warned_spawn_context = false
return setmetatable(M, {
  __index = function(_, name)
    if name == "SpawnContext" then
      if not warned_spawn_context then
        warned_spawn_context = true
        core._warn("multiprocessing.SpawnContext is renamed to ProcessContext; " ..
                   "the old name will be removed")
      end
      return M.ProcessContext
    end
  end,
})
