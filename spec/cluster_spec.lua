-- multiprocessing.cluster: engine detection from fake environments.  The
-- variables are copied from real runs on the one-box hosts (scripts/onebox/:
-- srun, mpirun, mpiexec.hydra across h1/h2) and, for torchrun, from the
-- environment torch's elastic agent gives its workers.
local cluster = require "multiprocessing.cluster"

-- Environments as the second node (h2) of a two-node job saw them.
local SLURM = {   -- srun -N 2 --ntasks-per-node=1, task 1 of job 1
  SLURMD_NODENAME = "h2", SLURM_CLUSTER_NAME = "onebox", SLURM_CPUS_ON_NODE = "1",
  SLURM_GTIDS = "1", SLURM_JOBID = "1", SLURM_JOB_CPUS_PER_NODE = "1(x2)",
  SLURM_JOB_ID = "1", SLURM_JOB_NAME = "envdump.sh", SLURM_JOB_NODELIST = "h[1-2]",
  SLURM_JOB_NUM_NODES = "2", SLURM_LAUNCH_NODE_IPADDR = "10.99.0.1", SLURM_LOCALID = "0",
  SLURM_NNODES = "2", SLURM_NODEID = "1", SLURM_NODELIST = "h[1-2]", SLURM_NPROCS = "2",
  SLURM_NTASKS = "2", SLURM_NTASKS_PER_NODE = "1", SLURM_PROCID = "1",
  SLURM_SRUN_COMM_HOST = "10.99.0.1", SLURM_STEPID = "0", SLURM_STEP_ID = "0",
  SLURM_STEP_NODELIST = "h[1-2]", SLURM_STEP_NUM_NODES = "2", SLURM_STEP_NUM_TASKS = "2",
  SLURM_STEP_TASKS_PER_NODE = "1(x2)", SLURM_SUBMIT_HOST = "h1", SLURM_TASKS_PER_NODE = "1(x2)",
  SLURM_TOPOLOGY_ADDR = "h2",
}
local SBATCH = {  -- the batch script of sbatch -N2 (not a step: no SLURM_STEP_ID)
  SLURMD_NODENAME = "h1", SLURM_JOBID = "3", SLURM_JOB_ID = "3", SLURM_JOB_NODELIST = "h[1-2]",
  SLURM_JOB_NUM_NODES = "2", SLURM_LOCALID = "0", SLURM_NNODES = "2", SLURM_NODEID = "0",
  SLURM_NODELIST = "h[1-2]", SLURM_PROCID = "0", SLURM_TASKS_PER_NODE = "1(x2)",
}
local OPENMPI = { -- mpirun --host h1,h2 -np 2 --map-by ppr:1:node, rank 1
  OMPI_APP_CTX_NUM_PROCS = "2", OMPI_COMMAND = "envdump.sh", OMPI_COMM_WORLD_LOCAL_RANK = "0",
  OMPI_COMM_WORLD_LOCAL_SIZE = "1", OMPI_COMM_WORLD_NODE_RANK = "0",
  OMPI_COMM_WORLD_RANK = "1", OMPI_COMM_WORLD_SIZE = "2", OMPI_FIRST_RANKS = "0",
  OMPI_MCA_ess_base_jobid = "2330722305",
  OMPI_MCA_orte_hnp_uri = "2330722304.0;tcp://10.99.0.1:42811", OMPI_MCA_orte_num_nodes = "2",
  OMPI_NUM_APP_CTX = "1", OMPI_UNIVERSE_SIZE = "2", PMIX_HOSTNAME = "h2", PMIX_ID = "2330722305.1",
  PMIX_NAMESPACE = "2330722305", PMIX_RANK = "1",
}
local HYDRA = {   -- mpiexec.hydra -hosts h1,h2 -n 2 -ppn 1, rank 1
  HYDI_CONTROL_FD = "7", MPIR_CVAR_CH3_INTERFACE_HOSTNAME = "h2", MPI_LOCALNRANKS = "1",
  MPI_LOCALRANKID = "0", PMI_FD = "12", PMI_RANK = "1", PMI_SIZE = "2",
  GFORTRAN_UNBUFFERED_PRECONNECTED = "y",
}
local HYDRA_PROXY = {  -- its parent's command line
  "/usr/bin/hydra_pmi_proxy", "--control-port", "h1:46719", "--rmk", "user", "--launcher",
  "rsh", "--launcher-exec", "/work/scripts/onebox/nsrsh", "--demux", "poll", "--pgid", "0",
  "--retries", "10", "--usize", "-2", "--pmi-port", "0", "--gpus-per-proc", "-2",
  "--proxy-id", "1",
}
local TORCHRUN = {  -- torchrun --nnodes 2 --nproc-per-node 1, the worker on node 1
  LOCAL_RANK = "0", RANK = "1", GROUP_RANK = "1", ROLE_RANK = "1", ROLE_NAME = "default",
  LOCAL_WORLD_SIZE = "1", WORLD_SIZE = "2", GROUP_WORLD_SIZE = "2", ROLE_WORLD_SIZE = "2",
  MASTER_ADDR = "h1", MASTER_PORT = "29400", TORCHELASTIC_RESTART_COUNT = "0",
  TORCHELASTIC_MAX_RESTARTS = "0", TORCHELASTIC_RUN_ID = "job42",
  TORCHELASTIC_USE_AGENT_STORE = "False", TORCH_NCCL_ASYNC_ERROR_HANDLING = "1",
}

--- 'base' with 'changes' (false removes a variable).
local function with(base, changes)
  local env = {}
  for k, v in pairs(base) do env[k] = v end
  for k, v in pairs(changes or {}) do env[k] = v or nil end
  return env
end

--- A fake system: host "h2", the given ancestors' argument vectors.
local function sys(ancestors)
  return { hostname = function() return "h2" end,
           ancestors = function() return ancestors or { { "/bin/sh" } } end }
end

local function detect(env, overrides, ancestors)
  return cluster.detect(env, overrides, sys(ancestors))
end

--- The facts mprun and mp.world() use.
local function node(f)
  return { f.launcher, f.group_rank, f.group_world_size, f.master_addr, f.master_port, f.host }
end

describe("cluster.expand_hostlist", function()
  local expand = cluster.expand_hostlist

  it("expands ranges and lists, keeping zero padding and order", function()
    assert.are.same({ "node01", "node02", "node03", "node07", "gpu5" },
                    expand("node[01-03,07],gpu5"))
    assert.are.same({ "h1", "h2" }, expand("h[1-2]"))
    assert.are.same({ "n8", "n9", "n10" }, expand("n[8-10]"))
    assert.are.same({ "n008", "n009", "n010" }, expand("n[008-010]"))
    assert.are.same({ "a", "b", "c" }, expand("a,b,c"))
    assert.are.same({}, expand(""))
  end)

  it("expands several brackets in one name, left to right", function()
    assert.are.same({ "r1-n01", "r1-n02", "r2-n01", "r2-n02" }, expand("r[1-2]-n[01-02]"))
    assert.are.same({ "x1.ib", "x3.ib", "y" }, expand("x[1,3].ib,y"))
  end)

  it("refuses malformed lists, naming them", function()
    for _, bad in ipairs { "n[1-2", "n1-2]", "n[2-1]", "n[a-b]", "n[]", "a,,b", "n[[1]]" } do
      local ok, err = pcall(expand, bad)
      assert.is_false(ok, bad)
      assert.matches("bad host list", err, 1, true)
      assert.matches(bad, err, 1, true)
    end
    assert.error_matches(function() expand(nil) end, "cluster.expand_hostlist")
  end)

  it("parses numbers and ranges with one helper (host lists, mprun --ranks)", function()
    assert.are.same({ { lo = 0, hi = 0, width = 1 }, { lo = 2, hi = 3, width = 1 },
                      { lo = 7, hi = 9, width = 2 } }, cluster.ranges("0, 2-3,07 - 09"))
    assert.are.same({ nil, "3-1" }, { cluster.ranges("0,3-1") })
    assert.are.same({ nil, "x" }, { cluster.ranges("x") })
    assert.are.same({ nil, "" }, { cluster.ranges("1,,2") })
  end)

  it("expands Slurm's tasks-per-node counts", function()
    assert.are.same({ 2, 2, 2, 1 }, cluster.expand_counts("2(x3),1"))
    assert.are.same({ 1, 1 }, cluster.expand_counts("1(x2)"))
    assert.has_error(function() cluster.expand_counts("2(x)") end)
  end)
end)

describe("cluster.detect", function()
  it("Slurm: the task index, the step's size, its first node, a port from the job", function()
    local f = detect(SLURM)
    assert.are.same({ "slurm", 1, 2, "h1", cluster.derived_port("1.0"), "h2" }, node(f))
    assert.are.equal("1.0", f.job_id)
    assert.are.equal(1, f.local_tasks)
    assert.is_nil(cluster.refusal(f))
    -- the step's node list (a step may use part of the allocation)
    f = detect(with(SLURM, { SLURM_STEP_NODELIST = "gpu[07-08]", SLURM_JOB_NODELIST = "gpu[05-08]" }))
    assert.are.equal("gpu07", f.master_addr)
    f = detect(with(SLURM, { SLURM_STEP_NODELIST = false, SLURM_NODELIST = false,
                             SLURM_JOB_NODELIST = "node[01-03,07],gpu5" }))
    assert.are.equal("node01", f.master_addr)
  end)

  it("Slurm: without the step variables, the job's counts", function()
    local f = detect(with(SLURM, { SLURM_STEP_NUM_TASKS = false, SLURM_STEP_NUM_NODES = false,
                                   SLURM_STEP_TASKS_PER_NODE = false, SLURM_NTASKS = "4",
                                   SLURM_NNODES = "4", SLURM_TASKS_PER_NODE = "1(x4)" }))
    assert.are.same({ "slurm", 1, 4 }, { f.launcher, f.group_rank, f.group_world_size })
    assert.is_nil(cluster.refusal(f))
  end)

  it("Slurm: a batch script is not a step: one machine", function()
    local f = detect(SBATCH)
    assert.are.same({ "mprun", 0, 1, "127.0.0.1", 29500, "h2" }, node(f))
  end)

  it("Open MPI: the world rank, mpirun's host from its contact URI", function()
    local f = detect(OPENMPI)
    assert.are.same({ "openmpi", 1, 2, "10.99.0.1", cluster.derived_port("2330722305"), "h2" },
                    node(f))
    assert.is_nil(cluster.refusal(f))
    f = detect(with(OPENMPI, {
      OMPI_MCA_orte_hnp_uri = "2330722304.0;tcp6://[fd00::1]:55811" }))
    assert.are.equal("fd00::1", f.master_addr)
    -- no contact URI (Open MPI 5): the address is unknown unless given
    f = detect(with(OPENMPI, { OMPI_MCA_orte_hnp_uri = false, OMPI_MCA_ess_base_jobid = false,
                               PMIX_NAMESPACE = "prterun-h1-4242@1" }))
    assert.is_nil(f.master_addr)
    assert.are.equal(cluster.derived_port("prterun-h1-4242@1"), f.master_port)
    assert.are.equal("h1", detect(with(OPENMPI, { OMPI_MCA_orte_hnp_uri = false,
                                                  MASTER_ADDR = "h1" })).master_addr)
  end)

  it("Open MPI inside a Slurm allocation is Open MPI", function()
    local f = detect(with(SLURM, OPENMPI))
    assert.are.equal("openmpi", f.launcher)
  end)

  it("Hydra: PMI_RANK, PMI_SIZE, mpiexec's host from the proxy's control port", function()
    local f = detect(HYDRA, nil, { { "sh", "-c", "mprun" }, HYDRA_PROXY, { "mpiexec.hydra" } })
    assert.are.same({ "hydra", 1, 2, "h1", cluster.derived_port("h1:46719"), "h2" }, node(f))
    assert.is_nil(cluster.refusal(f))
    -- not started by a proxy: no address unless given
    f = detect(HYDRA)
    assert.is_nil(f.master_addr)
    assert.are.equal(29500, f.master_port)
    f = detect(with(HYDRA, { MASTER_ADDR = "10.0.0.1", MASTER_PORT = "4242" }))
    assert.are.same({ "10.0.0.1", 4242 }, { f.master_addr, f.master_port })
  end)

  it("Hydra: PMIX_RANK; PMI_RANK alone outside Slurm", function()
    local f = detect(with(HYDRA, { PMI_RANK = false, PMIX_RANK = "1" }), nil, { HYDRA_PROXY })
    assert.are.same({ "hydra", 1, 2 }, { f.launcher, f.group_rank, f.group_world_size })
    f = detect({ PMI_RANK = "0", PMI_SIZE = "3" })
    assert.are.same({ "hydra", 0, 3 }, { f.launcher, f.group_rank, f.group_world_size })
  end)

  it("srun --mpi=pmi2/pmix (PMI_RANK / PMIX_RANK in a Slurm step) is Slurm", function()
    assert.are.equal("slurm", detect(with(SLURM, { PMI_RANK = "1", PMI_SIZE = "2" })).launcher)
    assert.are.equal("slurm", detect(with(SLURM, { PMIX_RANK = "1" })).launcher)
    -- Hydra bootstrapped by srun: its ranks carry MPI_LOCALNRANKS
    assert.are.equal("hydra", detect(with(SLURM, HYDRA)).launcher)
  end)

  it("torchrun: its GROUP_RANK, GROUP_WORLD_SIZE, MASTER_ADDR and MASTER_PORT", function()
    local f = detect(TORCHRUN)
    assert.are.same({ "torchrun", 1, 2, "h1", 29400, "h2" }, node(f))
    assert.are.equal("job42", f.job_id)
    assert.is_nil(cluster.refusal(f))
    -- an older torchrun without GROUP_WORLD_SIZE: WORLD_SIZE / LOCAL_WORLD_SIZE
    f = detect(with(TORCHRUN, { GROUP_WORLD_SIZE = false, WORLD_SIZE = "6", LOCAL_WORLD_SIZE = "2" }))
    assert.are.equal(3, f.group_world_size)
    -- srun torchrun: torchrun is the nearer launcher
    assert.are.equal("torchrun", detect(with(SLURM, TORCHRUN)).launcher)
    -- mprun's own ranks set GROUP_RANK but are no torchrun workers
    assert.are.equal("mprun", detect({ GROUP_RANK = "0", RANK = "3", MP_RUN_ID = "x" }).launcher)
  end)

  it("none: mprun on one machine", function()
    assert.are.same({ "mprun", 0, 1, "127.0.0.1", 29500, "h2" }, node(detect({})))
    local f = detect({ MASTER_ADDR = "10.1.1.1", MASTER_PORT = "1234" })
    assert.are.same({ "10.1.1.1", 1234 }, { f.master_addr, f.master_port })
    assert.is_nil(cluster.refusal(f))
  end)

  it("reads os.getenv by default, and a getenv-like function", function()
    local f = cluster.detect(nil, nil, sys())
    assert.is_string(f.launcher)
    f = cluster.detect(function(k) return SLURM[k] end, nil, sys())
    assert.are.equal("slurm", f.launcher)
    assert.is_string(cluster.detect().host)
  end)

  it("overrides: --nnodes, --node-rank, --master-addr win", function()
    local f = detect({}, { nnodes = 3, node_rank = 2, master_addr = "10.0.0.9" })
    assert.are.same({ "mprun", 2, 3, "10.0.0.9", 29500, "h2" }, node(f))
    f = detect(SLURM, { master_addr = "ib-h1" })
    assert.are.same({ "slurm", 1, 2, "ib-h1" }, { f.launcher, f.group_rank, f.group_world_size, f.master_addr })
    f = detect({ MASTER_ADDR = "a" }, { nnodes = 2, node_rank = 1, master_addr = "b" })
    assert.are.equal("b", f.master_addr)
    -- two nodes and no address: torchrun's default, the loopback
    f = detect({}, { nnodes = 2, node_rank = 0 })
    assert.are.equal("127.0.0.1", f.master_addr)
  end)

  it("refuses bad overrides and variables, naming them", function()
    local cases = {
      { {}, { nnodes = 0 }, "nnodes must be a whole number >= 1" },
      { {}, { nnodes = 2.5 }, "nnodes must be" },
      { {}, { node_rank = -1 }, "node_rank must be a whole number >= 0" },
      { {}, { master_addr = "" }, "master_addr must be" },
      { {}, { nnodes = 2 }, "nnodes 2 without node_rank" },
      { {}, { nnodes = 2, node_rank = 2 }, "node rank 2 is out of range for 2 nodes" },
      { SLURM, { node_rank = 5 }, "node rank 5 is out of range for 2 nodes" },
      { with(SLURM, { SLURM_PROCID = "x" }), nil, 'SLURM_PROCID="x" is not a whole number' },
      { with(OPENMPI, { OMPI_COMM_WORLD_SIZE = "0" }), nil, "OMPI_COMM_WORLD_SIZE=\"0\"" },
      { with(OPENMPI, { OMPI_COMM_WORLD_RANK = "2" }), nil, "node rank 2 is out of range" },
      { { MASTER_PORT = "70000" }, nil, "MASTER_PORT=70000 is not a port" },
      { { MASTER_PORT = "http" }, nil, 'MASTER_PORT="http"' },
      { with(SLURM, { SLURM_STEP_NODELIST = "h[1-" }), nil, "bad host list" },
    }
    for _, c in ipairs(cases) do
      local ok, err = pcall(detect, c[1], c[2])
      assert.is_false(ok, c[3])
      assert.matches(c[3], err, 1, true)
      assert.matches("^multiprocessing.cluster: ", err)
    end
  end)

  it("derives one port per job, the same on every node, below the ephemeral range", function()
    local seen = {}
    for job = 1, 200 do
      local p = detect(with(SLURM, { SLURM_JOB_ID = tostring(job) })).master_port
      assert.are.equal(p, detect(with(SLURM, { SLURM_JOB_ID = tostring(job), SLURM_PROCID = "0",
                                               SLURM_NODEID = "0" })).master_port)
      assert.is_true(p >= 20000 and p < 30000)
      seen[p] = true
    end
    local distinct = 0
    for _ in pairs(seen) do distinct = distinct + 1 end
    assert.is_true(distinct > 190)
  end)
end)

describe("cluster.refusal", function()
  local function refusal(env, ancestors)
    return cluster.refusal(detect(env, nil, ancestors))
  end

  it("more than one copy on this node, from each engine's local count", function()
    assert.matches("slurm started 2 copies of mprun on host h2; run one per node %(srun "
                   .. "%-%-ntasks%-per%-node=1%) and give mprun %-n the ranks per node",
                   refusal(with(SLURM, { SLURM_NODEID = "0", SLURM_PROCID = "0",
                                         SLURM_STEP_NUM_TASKS = "3",
                                         SLURM_STEP_TASKS_PER_NODE = "2,1" })))
    assert.matches("openmpi started 2 copies of mprun on host h2; run one per node %(mpirun "
                   .. "%-%-map%-by ppr:1:node%)",
                   refusal(with(OPENMPI, { OMPI_COMM_WORLD_LOCAL_SIZE = "2",
                                           OMPI_COMM_WORLD_SIZE = "4" })))
    assert.matches("hydra started 2 copies .* %(mpiexec %-ppn 1%)",
                   refusal(with(HYDRA, { MPI_LOCALNRANKS = "2" })))
    assert.matches("torchrun started 4 copies .* %(torchrun %-%-nproc%-per%-node 1%)",
                   refusal(with(TORCHRUN, { LOCAL_WORLD_SIZE = "4", WORLD_SIZE = "8",
                                            GROUP_WORLD_SIZE = "2" })))
  end)

  it("a node with one copy refuses too when the engine says another node has more", function()
    -- srun -N 2 -n 3: h2 has one task, h1 two
    assert.matches("slurm started 3 copies of mprun on 2 nodes: some node runs more than one",
                   refusal(with(SLURM, { SLURM_PROCID = "2", SLURM_STEP_NUM_TASKS = "3",
                                         SLURM_STEP_TASKS_PER_NODE = "2,1" })))
    -- mpirun -np 3 on two nodes
    assert.matches("openmpi started 3 copies of mprun on 2 nodes",
                   refusal(with(OPENMPI, { OMPI_COMM_WORLD_SIZE = "3" })))
  end)

  it("differing command lines (MPMD) under Open MPI", function()
    assert.matches("openmpi started 2 different command lines %(MPMD ':'%)",
                   refusal(with(OPENMPI, { OMPI_NUM_APP_CTX = "2" })))
  end)
end)

describe("cluster.abort_job", function()
  local H = require "helpers"
  H.leak_check(before_each, after_each)

  it("sends PMI's abort with the exit code over Hydra's PMI_FD", function()
    local name = os.tmpname()
    local f = assert(io.open(name, "w"))
    local fd = H.sh(("ls -l /proc/%d/fd"):format(H.pid()))
                :match("(%d+) %-> " .. name:gsub("%p", "%%%0") .. "\n")
    assert.is_truthy(fd, "the temporary file's descriptor")
    local facts = detect(HYDRA, nil, { HYDRA_PROXY })
    assert.is_true(cluster.abort_job(facts, 7, with(HYDRA, { PMI_FD = fd })))
    f:close()
    assert.are.equal("cmd=abort exitcode=7\n", H.read(name))
    os.remove(name)
  end)

  it("does nothing where the exit itself stops the job", function()
    for _, env in ipairs { SLURM, OPENMPI, TORCHRUN, {} } do
      assert.is_false(cluster.abort_job(detect(env), 5, with(env, { PMI_FD = "1" })))
    end
    assert.is_false(cluster.abort_job(detect(HYDRA), 5, with(HYDRA, { PMI_FD = false })))
  end)
end)

describe("mprun under an engine", function()
  local H = require "helpers"
  H.leak_check(before_each, after_each)

  local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

  --- mprun with the engine's variables (a table) in its environment;
  -- returns stdout, stderr, exit status.
  local function mprun(env, args)
    local vars = {}
    for k, v in pairs(env) do vars[#vars + 1] = k .. "=" .. q(v) end
    local out, err = os.tmpname(), os.tmpname()
    local _, _, code = os.execute(("env %s ./scripts/mprun %s >%s 2>%s </dev/null")
                                  :format(table.concat(vars, " "), args, out, err))
    local o, e = H.read(out), H.read(err)
    os.remove(out)
    os.remove(err)
    return o, e, code
  end

  local sorted_lines = H.sorted_lines

  local SHOW = q(H.PATHS .. [[
    local w = require("multiprocessing").world()
    local v = {}
    for _, k in ipairs { "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                         "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "MP_LAUNCHER",
                         "MP_RUN_ID" } do v[#v + 1] = os.getenv(k) end
    for _, x in ipairs { w.launcher, w.rank, w.world_size, w.group_rank, w.master_addr } do
      v[#v + 1] = tostring(x)
    end
    print(table.concat(v, " "))]])

  it("numbers its ranks from the node's index: RANK = GROUP_RANK * n + LOCAL_RANK", function()
    local out, err, code = mprun(SLURM, "-n 4 -e " .. SHOW)
    assert.are.equal(0, code, err)
    local port = cluster.derived_port("1.0")
    local want = {}
    for l = 0, 3 do
      want[#want + 1] = ("[rank%d]: %d %d 8 4 1 2 h1 %d slurm slurm-1.0 slurm %d 8 1 h1")
                        :format(4 + l, 4 + l, l, port, 4 + l)
    end
    assert.are.same(want, sorted_lines(out))
    -- the summary says which host spoke
    assert.matches("^" .. cluster.hostname():gsub("%p", "%%%0") .. ": mprun: 4 ranks finished "
                   .. "%(run id slurm%-1%.0,", err)
  end)

  it("under Open MPI, Hydra and torchrun alike", function()
    for env, want in pairs {
      [OPENMPI] = "[rank2]: 2 0 4 2 1 2 10.99.0.1",
      [TORCHRUN] = "[rank2]: 2 0 4 2 1 2 h1 29400 torchrun",
      [HYDRA] = "[rank2]: 2 0 4 2 1 2",   -- no proxy above us: no address
    } do
      local out, err, code = mprun(env, "-n 2 -e " .. SHOW)
      assert.are.equal(0, code, err)
      assert.are.equal(want, sorted_lines(out)[1]:sub(1, #want))
    end
  end)

  it("takes --nnodes, --node-rank and --master-addr over the engine's", function()
    local out, err, code = mprun({}, "-n 2 --nnodes 3 --node-rank 2 --master-addr 10.0.0.9 "
                                 .. "--run-id r -e " .. SHOW)
    assert.are.equal(0, code, err)
    assert.are.same({ "[rank4]: 4 0 6 2 2 3 10.0.0.9 29500 mprun r mprun 4 6 2 10.0.0.9",
                      "[rank5]: 5 1 6 2 2 3 10.0.0.9 29500 mprun r mprun 5 6 2 10.0.0.9" },
                    sorted_lines(out))
    out, err, code = mprun(SLURM, "-n 1 --node-rank 0 --master-addr ib0 -e " .. SHOW)
    assert.are.equal(0, code, err)
    assert.matches("^0 0 2 1 0 2 ib0 ", out)
  end)

  it("refuses, before any rank starts, what cannot be numbered", function()
    local marker = os.tmpname()
    os.remove(marker)
    local touch = "-e " .. q(("io.open(%q, 'w'):close()"):format(marker))
    for _, c in ipairs {
      { with(SLURM, { SLURM_NODEID = "0", SLURM_PROCID = "0", SLURM_STEP_TASKS_PER_NODE = "2,1",
                      SLURM_STEP_NUM_TASKS = "3" }), "-n 2",
        "slurm started 2 copies of mprun on host " .. cluster.hostname() },
      { with(OPENMPI, { OMPI_COMM_WORLD_SIZE = "3" }), "-n 2",
        "openmpi started 3 copies of mprun on 2 nodes" },
      { SLURM, "-n auto", "-n auto on 2 nodes" },
      { {}, "--nnodes 2 --node-rank 2", "--node-rank 2 is out of range for 2 nodes (--nnodes 2)" },
      { {}, "--nnodes 0", "--nnodes must be an integer >= 1" },
      { {}, "--nnodes 2", "--nnodes 2 without --node-rank: say which node this is" },
      { {}, "--master-addr ''", "--master-addr must not be empty" },
    } do
      local out, err, code = mprun(c[1], c[2] .. " " .. touch)
      assert.are.equal(2, code, c[3])
      assert.are.equal("", out)
      assert.matches(c[3], err, 1, true)
      assert.is_nil(io.open(marker), "a rank started")
    end
  end)

  it("writes its logs under a directory per host", function()
    local dir = H.sh("mktemp -d"):gsub("%s+$", "")
    local _, err, code = mprun(SLURM, "-n 2 --log-dir " .. dir .. " -e 'print(os.getenv(\"RANK\"))'")
    assert.are.equal(0, code, err)
    local host = cluster.hostname()
    for r = 2, 3 do
      assert.are.equal(r .. "\n", H.read(("%s/slurm-1.0/%s/attempt_0/%d/stdout.log")
                                         :format(dir, host, r)))
    end
    H.sh("rm -rf " .. q(dir))
  end)

  it("prefixes its failure summary with the host's name", function()
    local _, err, code = mprun(SLURM, "-n 2 -e 'if os.getenv(\"LOCAL_RANK\") == \"1\" then os.exit(7) end'")
    assert.are.equal(7, code)
    local host = cluster.hostname():gsub("%p", "%%%0")
    for line in err:gmatch("([^\n]*)\n") do assert.matches("^" .. host .. ": ", line) end
    assert.matches(host .. ":   rank       : 3 %(local_rank 1 of 2%)", err)
  end)
end)
