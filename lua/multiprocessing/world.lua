--- multiprocessing.world -- where this process stands in a job: its rank,
-- the world's size, its node, and who launched it.
--
--   mp.world() -> {rank=, local_rank=, world_size=, local_world_size=,
--                  group_rank=, group_world_size=, restart_count=,
--                  max_restarts=, run_id=, master_addr=, master_port=,
--                  launcher=, host=}
--   launcher: "slurm" | "openmpi" | "hydra" | "torchrun" | "mprun", or nil
--   when nothing launched this process
--
-- The per-process facts come from the variables a launcher sets (mprun and
-- torchrun set the same names: RANK, LOCAL_RANK, WORLD_SIZE,
-- LOCAL_WORLD_SIZE, GROUP_RANK, and ours where torch says TORCHELASTIC_*:
-- MP_RESTART_COUNT, MP_MAX_RESTARTS, MP_RUN_ID).  The node-level facts come
-- from M.node() alone.  Not launched: rank 0 of a world of 1.
local cluster = require "multiprocessing.cluster"

local M = {}

--- A variable's integer value, 'default' when it is unset (or empty);
-- raises, naming the variable, for anything but an integer in min..max.
local function int(name, default, min, max)
  local raw = os.getenv(name)
  if raw == nil or raw == "" then return default end
  local n = math.tointeger(tonumber(raw))
  if n == nil or n < min or (max and n > max) then
    error(("mp.world: %s must be an integer %s, got '%s'"):format(name,
      max and ("in %d..%d"):format(min, max) or (">= " .. min), raw), 0)
  end
  return n
end

--- Raises unless index < size: "RANK=5 is not below WORLD_SIZE=2".
local function below(index_name, index, size_name, size)
  if index >= size then
    error(("mp.world: %s=%d is not below %s=%d: no such %s in the world")
      :format(index_name, index, size_name, size, index_name:lower():gsub("_", " ")), 0)
  end
end

--- The node-level facts: which node (group) this is among how many, where
-- the job's rendezvous is, and which launcher started the job.
--
-- This is the ONE place that knows about nodes.  In a rank of mprun they are
-- what mprun found once for its node and gave its ranks (GROUP_RANK,
-- GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, MP_LAUNCHER).  Anywhere else
-- -- mprun itself, or a script an engine started without mprun -- they come
-- from multiprocessing.cluster: the engine's own variables (Slurm, Open
-- MPI, Hydra, torchrun), with 'overrides' (nnodes, node_rank, master_addr:
-- mprun's --nnodes, --node-rank, --master-addr) on top.  A process nothing
-- launched is node 0 of 1 with launcher nil; mprun, which always passes its
-- overrides ({} when none), sees launcher "mprun" there.
function M.node(overrides)
  if os.getenv("MP_RUN_ID") ~= nil and overrides == nil then
    return {
      launcher = os.getenv("MP_LAUNCHER") or "mprun",
      group_rank = int("GROUP_RANK", 0, 0),
      group_world_size = int("GROUP_WORLD_SIZE", 1, 1),
      master_addr = os.getenv("MASTER_ADDR"),
      master_port = int("MASTER_PORT", nil, 1, 65535),
      host = cluster.hostname(),
    }
  end
  local node = cluster.detect(nil, overrides)
  if node.launcher == "mprun" and overrides == nil then node.launcher = nil end
  return node
end

--- mp.world(): the table above; a process that no launcher started is
-- rank 0 of a world of 1 (launcher nil).  A process an engine started
-- without mprun (one per node) is rank group_rank of group_world_size, the
-- only one on its node: its own ranks are group_rank * n + i.
--- Every variable is checked: an impossible world (RANK=abc, WORLD_SIZE=-1,
-- RANK=5 of WORLD_SIZE=2, MASTER_PORT=99999999) raises naming the variable,
-- rather than giving two processes the same rank.
local function world()
  local w = M.node()
  below("GROUP_RANK", w.group_rank, "GROUP_WORLD_SIZE", w.group_world_size)
  w.world_size = int("WORLD_SIZE", w.group_world_size, 1)
  w.rank = int("RANK", w.group_rank, 0)
  below("RANK", w.rank, "WORLD_SIZE", w.world_size)
  w.local_world_size = int("LOCAL_WORLD_SIZE", 1, 1)
  w.local_rank = int("LOCAL_RANK", 0, 0)
  below("LOCAL_RANK", w.local_rank, "LOCAL_WORLD_SIZE", w.local_world_size)
  w.restart_count = int("MP_RESTART_COUNT", 0, 0)
  w.max_restarts = int("MP_MAX_RESTARTS", 0, 0)
  w.run_id = os.getenv("MP_RUN_ID")
  return w
end

function M.world()
  local ok, w = pcall(world)
  if not ok then error(w, 2) end   -- at the caller's line
  return w
end

return M
