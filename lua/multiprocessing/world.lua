--- multiprocessing.world -- where this process stands in a job: its rank,
-- the world's size, its node, and who launched it.
--
--   mp.world() -> {rank=, local_rank=, world_size=, local_world_size=,
--                  group_rank=, group_world_size=, restart_count=,
--                  max_restarts=, run_id=, master_addr=, master_port=,
--                  launcher=}
--
-- The per-process facts come from the variables a launcher sets (mprun and
-- torchrun set the same names: RANK, LOCAL_RANK, WORLD_SIZE,
-- LOCAL_WORLD_SIZE, GROUP_RANK, and ours where torch says TORCHELASTIC_*:
-- MP_RESTART_COUNT, MP_MAX_RESTARTS, MP_RUN_ID).  The node-level facts come
-- from M.node() alone.  Not launched: rank 0 of a world of 1.
local M = {}

local function int(name, default)
  local n = math.tointeger(tonumber(os.getenv(name) or ""))
  if n == nil then return default end
  return n
end

--- The node-level facts: which node (group) this is among how many, where
-- the job's rendezvous is, and which launcher started the job.
--
-- This is the ONE place that knows about nodes.  Today it knows one
-- machine: mprun sets GROUP_RANK (0) and MP_RUN_ID, and the defaults are
-- those of a single node.  Engine detection (Slurm, Open MPI, Hydra,
-- torchrun) belongs here: it returns the same fields, filled from the
-- engine's own variables, and every caller gets it through this function:
-- mp.world() in a rank, and mprun, which gives its ranks GROUP_RANK,
-- GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT from it and counts RANK and
-- WORLD_SIZE over the nodes (its --nnodes/--node-rank options belong here
-- too, as overrides of what this returns).
function M.node()
  local launched = os.getenv("MP_RUN_ID") ~= nil
  return {
    launcher = launched and "mprun" or nil,
    group_rank = int("GROUP_RANK", 0),
    group_world_size = int("GROUP_WORLD_SIZE", 1),
    master_addr = os.getenv("MASTER_ADDR") or "127.0.0.1",
    master_port = int("MASTER_PORT", nil),
  }
end

--- mp.world(): the table above; a process that no launcher started is
-- rank 0 of a world of 1 (launcher nil).
function M.world()
  local w = M.node()
  w.rank = int("RANK", 0)
  w.world_size = int("WORLD_SIZE", 1)
  w.local_rank = int("LOCAL_RANK", w.rank)
  w.local_world_size = int("LOCAL_WORLD_SIZE", w.world_size)
  w.restart_count = int("MP_RESTART_COUNT", 0)
  w.max_restarts = int("MP_MAX_RESTARTS", 0)
  w.run_id = os.getenv("MP_RUN_ID")
  return w
end

return M
