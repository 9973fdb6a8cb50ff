-- A rank of mprun on the one-box hosts: the engine starts one mprun per
-- host (`mprun -n 4 scripts/onebox/rank.lua`), mprun starts this 4 times.
-- Prints what mp.world() says (local rank 0 also the node's line, as
-- job.lua does), holds a file_system shared array (a /dev/shm name on its
-- host), and sleeps WORKER_SLEEP seconds in a child shell; rank FAIL_RANK
-- exits 5 instead.
local root = arg[0]:match("^(.*)/scripts/onebox/[^/]*$") or "."
package.path = root .. "/lua/?.lua;" .. root .. "/lua/?/init.lua;" .. package.path
package.cpath = root .. "/" .. (os.getenv("LUA_MP_BUILD") or "build") .. "/?.so;" .. package.cpath

local mp = require "multiprocessing"

local w = mp.world()
if w.local_rank == 0 then
  print(("node %d/%d on %s launcher %s master %s:%d"):format(w.group_rank,
        w.group_world_size, w.host, w.launcher, w.master_addr, w.master_port))
end
local pid = io.open("/proc/self/stat"):read("l"):match("^%d+")
print(("rank %d/%d local %d on %s pid %s"):format(w.rank, w.world_size, w.local_rank, w.host, pid))
io.stdout:flush()
mp.set_sharing_strategy("file_system")
local shared = mp.Array("int32", 1)
shared[1] = w.rank
if w.rank == tonumber(os.getenv("FAIL_RANK") or "-1") then
  os.execute("sleep 1")
  os.exit(5)
end
os.execute("sleep " .. (os.getenv("WORKER_SLEEP") or "0"))
