-- A job for the engines on the one-box hosts: the library used without
-- mprun.  The engine starts one copy per node; each asks cluster.detect()
-- which node it is and runs NPER ranks of its own with start_processes,
-- rank = group_rank * NPER + local index.  Each rank prints where it runs,
-- writes into a file_system shared array (a /dev/shm name on its host), and
-- sleeps WORKER_SLEEP seconds in a child shell (a grandchild of the node's
-- copy); rank FAIL_RANK exits 5 instead.  The copy exits with the failing
-- rank's code.
local root = arg[0]:match("^(.*)/scripts/onebox/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
package.cpath = root .. "/" .. (os.getenv("LUA_MP_BUILD") or "build") .. "/?.so;" .. package.cpath

local mp = require "multiprocessing"
local cluster = require "multiprocessing.cluster"

local node = cluster.detect()
local why = cluster.refusal(node)
if why then
  io.stderr:write(node.host, ": ", why, "\n")
  os.exit(2)
end
local nper = tonumber(os.getenv("NPER") or "2")
print(("node %d/%d on %s launcher %s master %s:%d"):format(node.group_rank,
      node.group_world_size, node.host, node.launcher, node.master_addr, node.master_port))
io.stdout:flush()

mp.set_sharing_strategy("file_system")
local shared = mp.Array("int32", nper)

local function rank_main(i, group_rank, n, world, host, arr)
  local rank = group_rank * n + i
  local pid = io.open("/proc/self/stat"):read("l"):match("^%d+")
  print(("rank %d/%d local %d on %s pid %s"):format(rank, world, i, host, pid))
  io.stdout:flush()
  arr[i + 1] = rank
  if rank == tonumber(os.getenv("FAIL_RANK") or "-1") then
    os.execute("sleep 1")
    os.exit(5)
  end
  os.execute("sleep " .. (os.getenv("WORKER_SLEEP") or "0"))
end

local ok, e = pcall(mp.start_processes, rank_main,
                    { node.group_rank, nper, node.group_world_size * nper, node.host, shared },
                    nper, true, false, "spawn")
if not ok then
  io.stderr:write(node.host, ": ", tostring(e), "\n")
  local code = mp.isinstance(e, mp.ProcessExitedException) and e.exit_code or 1
  cluster.abort_job(node, code)
  os.exit(code)
end
print(("node %d done on %s"):format(node.group_rank, node.host))
