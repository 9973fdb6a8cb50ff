--- multiprocessing: start Lua worker processes, join them, and get their
-- failures back as exceptions -- torch.multiprocessing for Lua.
--
-- The system work is done in C (multiprocessing.core); this layer re-exports
-- it and adds what is convenient to write in Lua.
local core = require "multiprocessing.core"

-- Everything public of the core; names starting with "_" are the entry
-- points of spawned workers and the forkserver, and test hooks.
local M = {}
for name, value in pairs(core) do
  if name:sub(1, 1) ~= "_" then M[name] = value end
end

-- The version is kept in one place, multiprocessing.h (LMP_VERSION).
M._VERSION = core._VERSION

-- mp.world(): rank, world size, node and launcher of this process.
M.world = require("multiprocessing.world").world

-- Process pools (pool.lua) and the start method they use by default.
local start_method = "spawn"
local start_methods = { fork = true, spawn = true, forkserver = true }

function M.set_start_method(name)
  if not start_methods[name] then
    error(("bad argument #1 to 'set_start_method' (unknown start method "
           .. "'%s'; expected \"fork\", \"spawn\" or \"forkserver\")")
          :format(tostring(name)), 2)
  end
  start_method = name
end

function M.get_start_method() return start_method end

function M.Pool(processes, opts)
  return require("multiprocessing.pool").new(processes, opts)
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
