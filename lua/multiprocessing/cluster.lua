--- multiprocessing.cluster: which cluster engine started this process, and
-- what it says about the node.
--
-- On a cluster, an engine -- Slurm's srun, Open MPI's mpirun, MPICH's Hydra
-- mpiexec, torchrun -- starts one copy of a program (mprun, or a script
-- using the library) per node.  detect() reads the engine's environment and
-- returns the node-level facts every copy needs to number its own ranks:
--
--   launcher          "slurm" | "openmpi" | "hydra" | "torchrun" | "mprun"
--   group_rank        this node's index, 0 .. group_world_size-1
--   group_world_size  how many nodes (copies) the job has
--   master_addr       node 0's address as the engine gives it (nil when
--                     the engine does not say and nothing overrides it)
--   master_port       a port for the job's rendezvous: the engine's or the
--                     environment's MASTER_PORT, else derived from the job id
--                     so that every node computes the same one
--   job_id            an id every node of the job shares (nil if none)
--   local_tasks       how many copies the engine started on this node
--   host              this machine's host name
-- and, for refusal(), what the engine says about the other nodes: copies
-- (how many it started in all), nodes (on how many nodes), app_contexts
-- (how many different command lines).
--
-- Which engine (the first that matches; the nearest launcher wins when one
-- runs inside another's allocation):
--   torchrun  TORCHELASTIC_RUN_ID and GROUP_RANK: GROUP_RANK,
--             GROUP_WORLD_SIZE (else WORLD_SIZE / LOCAL_WORLD_SIZE),
--             MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE
--   openmpi   OMPI_COMM_WORLD_RANK: OMPI_COMM_WORLD_RANK/SIZE/LOCAL_SIZE;
--             node 0 = mpirun's host, from the address in
--             OMPI_MCA_orte_hnp_uri (Open MPI 4); job id
--             OMPI_MCA_ess_base_jobid, else PMIX_NAMESPACE
--   hydra     MPI_LOCALNRANKS, or PMI_RANK / PMIX_RANK outside a Slurm step:
--             PMI_RANK (PMIX_RANK), PMI_SIZE, MPI_LOCALNRANKS; node 0 =
--             mpiexec's host and the job id from the `--control-port
--             HOST:PORT` of the hydra_pmi_proxy that started us
--   slurm     SLURM_STEP_ID and SLURM_PROCID (a task of an srun step; a
--             batch script itself is not one): SLURM_PROCID,
--             SLURM_STEP_NUM_TASKS (SLURM_NTASKS), SLURM_STEP_NUM_NODES
--             (SLURM_NNODES), SLURM_STEP_TASKS_PER_NODE with SLURM_NODEID;
--             node 0 = the first host of SLURM_STEP_NODELIST
--             (SLURM_JOB_NODELIST) expanded; job id SLURM_JOB_ID.SLURM_STEP_ID
--   mprun     none of those: one machine, 127.0.0.1, MASTER_PORT or 29500
--             (with --nnodes N: still 127.0.0.1 unless given, as torchrun)
-- An engine that does not tell node 0's address (Open MPI 5, Hydra not
-- started by its proxy) leaves master_addr nil on a job of several nodes.
-- MASTER_ADDR and MASTER_PORT in the environment (e.g. `srun
-- --export=ALL,MASTER_ADDR=...`, `mpirun -x`, `mpiexec -genv`) win over what
-- is derived; the overrides (mprun's --nnodes, --node-rank, --master-addr)
-- win over everything.
local M = {}

local DEFAULT_PORT = 29500          -- torch's, for one machine
local PORT_BASE, PORT_SPAN = 20000, 10000  -- derived ports: below Linux's
                                           -- ephemeral range (32768-)

local function fail(fmt, ...)
  error("multiprocessing.cluster: " .. fmt:format(...), 0)
end

--- A whole number >= 'min' from an engine's variable, or nil when unset;
-- raises naming the variable when it is set to anything else.
local function count(get, name, min)
  local s = get(name)
  if s == nil or s == "" then return nil end
  local n = math.tointeger(tonumber(s))
  if not n or n < (min or 0) or not s:match("^%s*%d+%s*$") then
    fail("%s=%q is not a whole number >= %d", name, s, min or 0)
  end
  return n
end

--- Splits 's' at the commas outside brackets.
local function top_level_items(s)
  local items, depth, start = {}, 0, 1
  for i = 1, #s do
    local c = s:sub(i, i)
    if c == "[" then depth = depth + 1
    elseif c == "]" then depth = depth - 1
    elseif c == "," and depth == 0 then
      items[#items + 1] = s:sub(start, i - 1)
      start = i + 1
    end
    if depth < 0 or depth > 1 then fail("bad host list %q: unbalanced brackets", s) end
  end
  if depth ~= 0 then fail("bad host list %q: unbalanced brackets", s) end
  items[#items + 1] = s:sub(start)
  return items
end

--- A list of numbers and ranges, "0,2-3" or Slurm's "01-03,07": a list of
-- {lo =, hi =, width = digits of lo} (lo <= hi; spaces around the numbers
-- allowed), or nil and the first bad item.  The one range parser: Slurm's
-- host lists here, mprun's --ranks.
function M.ranges(s)
  local out = {}
  for item in (s .. ","):gmatch("([^,]*),") do
    local lo, hi = item:match("^%s*(%d+)%s*%-%s*(%d+)%s*$")
    if not lo then lo = item:match("^%s*(%d+)%s*$"); hi = lo end
    if not lo or tonumber(hi) < tonumber(lo) then return nil, item end
    out[#out + 1] = { lo = tonumber(lo), hi = tonumber(hi), width = #lo }
  end
  return out
end

--- The numbers of one bracket's ranges ("01-03,07"), as strings keeping the
-- zero padding of each range's first number, as Slurm writes them.
local function range_numbers(inner, list)
  local out = {}
  local ranges, bad = M.ranges(inner)
  if not ranges then fail("bad host list %q: bad range %q", list, bad) end
  for _, r in ipairs(ranges) do
    for n = r.lo, r.hi do out[#out + 1] = ("%0" .. r.width .. "d"):format(n) end
  end
  return out
end

--- Appends the hosts of one item ("rack[1-2]-n[01-02]") to 'out': each
-- bracket multiplies, left to right.
local function expand_item(item, list, out, prefix)
  local head, inner, rest = item:match("^([^%[]*)%[([^%]]*)%](.*)$")
  if not head then
    if item:find("[%[%]]") then fail("bad host list %q: unbalanced brackets", list) end
    out[#out + 1] = prefix .. item
    return
  end
  for _, n in ipairs(range_numbers(inner, list)) do
    expand_item(rest, list, out, prefix .. head .. n)
  end
end

--- Slurm's compressed host list ("node[01-03,07],gpu5") as a list of host
-- names in order ({"node01", "node02", "node03", "node07", "gpu5"}).
-- Raises on a malformed list.
function M.expand_hostlist(list)
  if type(list) ~= "string" then
    error(("bad argument #1 to 'cluster.expand_hostlist' (string expected, got %s)")
          :format(type(list)), 2)
  end
  local out = {}
  if list == "" then return out end
  for _, item in ipairs(top_level_items(list)) do
    if item == "" then fail("bad host list %q: empty entry", list) end
    expand_item(item, list, out, "")
  end
  return out
end

--- Slurm's tasks per node ("2(x3),1") as a list ({2, 2, 2, 1}).
function M.expand_counts(counts)
  local out = {}
  for item in (counts .. ","):gmatch("([^,]*),") do
    local n, times = item:match("^(%d+)%(x(%d+)%)$")
    if not n then n, times = item:match("^(%d+)$"), 1 end
    if not n then fail("bad tasks-per-node list %q", counts) end
    for _ = 1, tonumber(times) do out[#out + 1] = tonumber(n) end
  end
  return out
end

--- FNV-1a of 's', 32 bits: a port every node derives alike from the job id.
local function derived_port(job_id)
  local h = 2166136261
  for i = 1, #job_id do
    h = ((h ~ job_id:byte(i)) * 16777619) & 0xffffffff
  end
  return PORT_BASE + h % PORT_SPAN
end
M.derived_port = derived_port

--- The address in an Open MPI contact URI ("1234.0;tcp://10.0.0.1:4242;...").
local function uri_address(uri)
  return uri:match(";tcp://([^:;]+):%d+") or uri:match(";tcp6://%[([^%]]+)%]:%d+")
end

-- What the system says, for detect(); specs pass their own.
local function read_file(path)
  local f = io.open(path)
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end

--- The argument vectors of our ancestors, parent first (at most 8, stopping
-- at pid 1).
local function ancestors()
  local out = {}
  local pid = (read_file("/proc/self/stat") or ""):match("%) %a (%d+)")
  while pid and tonumber(pid) > 1 and #out < 8 do
    local argv = {}
    for a in (read_file("/proc/" .. pid .. "/cmdline") or ""):gmatch("([^%z]*)%z") do
      argv[#argv + 1] = a
    end
    out[#out + 1] = argv
    pid = (read_file("/proc/" .. pid .. "/stat") or ""):match("%) %a (%d+)")
  end
  return out
end

--- This machine's host name (the UTS namespace's, as hostname(1) says).
function M.hostname()
  return ((read_file("/proc/sys/kernel/hostname") or "localhost"):gsub("%s+$", ""))
end

M.system = { ancestors = ancestors, hostname = M.hostname }

--- Hydra's proxy command line: "--control-port HOST:PORT" of the nearest
-- hydra_pmi_proxy among our ancestors, or nil.
local function hydra_control_port(sys)
  for _, argv in ipairs(sys.ancestors()) do
    if (argv[1] or ""):match("hydra_pmi_proxy$") then
      for i = 2, #argv - 1 do
        if argv[i] == "--control-port" then return argv[i + 1] end
      end
    end
  end
end

-- One function per engine: nil when the environment is not its, else the
-- facts it gives (fields of detect()'s result; what it does not give left
-- nil).

local function torchrun(get)
  if not (get("TORCHELASTIC_RUN_ID") and get("GROUP_RANK")) then return nil end
  local local_size = count(get, "LOCAL_WORLD_SIZE", 1)
  local groups = count(get, "GROUP_WORLD_SIZE", 1)
  if not groups and local_size and count(get, "WORLD_SIZE", 1) then
    groups = count(get, "WORLD_SIZE", 1) // local_size
  end
  return {
    launcher = "torchrun",
    group_rank = count(get, "GROUP_RANK"),
    group_world_size = groups,
    local_tasks = local_size,
    job_id = get("TORCHELASTIC_RUN_ID"),
  }
end

local function openmpi(get)
  if not get("OMPI_COMM_WORLD_RANK") then return nil end
  local uri = get("OMPI_MCA_orte_hnp_uri")
  return {
    launcher = "openmpi",
    group_rank = count(get, "OMPI_COMM_WORLD_RANK"),
    group_world_size = count(get, "OMPI_COMM_WORLD_SIZE", 1),
    local_tasks = count(get, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
    nodes = count(get, "OMPI_MCA_orte_num_nodes", 1),
    app_contexts = count(get, "OMPI_NUM_APP_CTX", 1),
    master_addr = uri and uri_address(uri),
    job_id = get("OMPI_MCA_ess_base_jobid") or get("PMIX_NAMESPACE"),
  }
end

local function hydra(get, sys)
  local rank_var = get("PMI_RANK") and "PMI_RANK" or get("PMIX_RANK") and "PMIX_RANK"
  if not (get("MPI_LOCALNRANKS") or (rank_var and not get("SLURM_STEP_ID"))) then
    return nil
  end
  local control = hydra_control_port(sys)
  return {
    launcher = "hydra",
    group_rank = rank_var and count(get, rank_var) or nil,
    group_world_size = count(get, "PMI_SIZE", 1),
    local_tasks = count(get, "MPI_LOCALNRANKS", 1),
    master_addr = control and control:match("^(.*):%d+$"),
    job_id = control,
  }
end

local function slurm(get)
  if not (get("SLURM_STEP_ID") and get("SLURM_PROCID")) then return nil end
  local nodelist = get("SLURM_STEP_NODELIST") or get("SLURM_JOB_NODELIST")
                   or get("SLURM_NODELIST")
  local per_node = get("SLURM_STEP_TASKS_PER_NODE") or get("SLURM_TASKS_PER_NODE")
  local node = count(get, "SLURM_NODEID")
  local job = get("SLURM_JOB_ID") or get("SLURM_JOBID")
  return {
    launcher = "slurm",
    group_rank = count(get, "SLURM_PROCID"),
    group_world_size = count(get, "SLURM_STEP_NUM_TASKS", 1) or count(get, "SLURM_NTASKS", 1),
    nodes = count(get, "SLURM_STEP_NUM_NODES", 1) or count(get, "SLURM_NNODES", 1),
    local_tasks = per_node and node and M.expand_counts(per_node)[node + 1] or nil,
    master_addr = nodelist and M.expand_hostlist(nodelist)[1],
    job_id = job and (job .. "." .. get("SLURM_STEP_ID")),
  }
end

local ENGINES = { torchrun, openmpi, hydra, slurm }

--- An override's name in messages: the caller's own (overrides.names:
-- mprun's --node-rank), else the key.
local function named(o, k)
  return o.names and o.names[k] or k
end

local function check_overrides(o)
  for _, k in ipairs { "nnodes", "node_rank" } do
    local v = o[k]
    if v ~= nil and (math.type(v) ~= "integer" or v < (k == "nnodes" and 1 or 0)) then
      fail("%s must be a whole number >= %d, got %s", named(o, k), k == "nnodes" and 1 or 0,
           tostring(v))
    end
  end
  if o.master_addr ~= nil and (type(o.master_addr) ~= "string" or o.master_addr == "") then
    fail("%s must be a non-empty string", named(o, "master_addr"))
  end
end

--- The node-level facts (see the top of this file) of the engine that
-- started this process.  'env' is a table of environment variables or a
-- function like os.getenv (default: os.getenv); 'overrides' may set
-- nnodes, node_rank, master_addr; 'sys' replaces M.system (ancestors,
-- hostname) for tests.  Raises when the engine's variables are malformed or
-- disagree with the overrides.
function M.detect(env, overrides, sys)
  local get = type(env) == "table" and function(k) return env[k] end or env or os.getenv
  overrides = overrides or {}
  sys = sys or M.system
  check_overrides(overrides)
  local facts
  for _, engine in ipairs(ENGINES) do
    facts = engine(get, sys)
    if facts then break end
  end
  if facts then facts.copies = facts.group_world_size end
  facts = facts or { launcher = "mprun", group_rank = 0, group_world_size = 1, local_tasks = 1 }
  if not facts.group_rank or not facts.group_world_size then
    fail("%s started this process but did not say its rank and size", facts.launcher)
  end
  facts.group_world_size = overrides.nnodes or facts.group_world_size
  facts.group_rank = overrides.node_rank or facts.group_rank
  if facts.group_rank >= facts.group_world_size then
    fail("%s %d is out of range for %d node%s%s",
         overrides.node_rank and overrides.names and named(overrides, "node_rank") or "node rank",
         facts.group_rank, facts.group_world_size, facts.group_world_size == 1 and "" or "s",
         overrides.nnodes and overrides.names
           and (" (%s %d)"):format(named(overrides, "nnodes"), overrides.nnodes) or "")
  end
  if overrides.nnodes and overrides.nnodes > 1 and facts.launcher == "mprun"
     and not overrides.node_rank then
    fail("%s %d without %s: say which node this is", named(overrides, "nnodes"),
         overrides.nnodes, named(overrides, "node_rank"))
  end
  facts.master_addr = overrides.master_addr or get("MASTER_ADDR") or facts.master_addr
  if not facts.master_addr and (facts.group_world_size == 1 or facts.launcher == "mprun") then
    facts.master_addr = "127.0.0.1"
  end
  local port = get("MASTER_PORT")
  if port then
    facts.master_port = count(get, "MASTER_PORT", 1)
    if facts.master_port > 65535 then fail("MASTER_PORT=%s is not a port", port) end
  else
    facts.master_port = facts.job_id and derived_port(facts.job_id) or DEFAULT_PORT
  end
  facts.host = sys.hostname()
  return facts
end

local HOW = {
  slurm = "srun --ntasks-per-node=1",
  openmpi = "mpirun --map-by ppr:1:node",
  hydra = "mpiexec -ppn 1",
  torchrun = "torchrun --nproc-per-node 1",
}

--- Why mprun must not run its ranks under these facts, or nil: more than
-- one copy per node (their LOCAL_RANKs, log directories and CPUs would
-- collide), or copies started from differing command lines.  Each node finds
-- the same answer from its own environment wherever the engine tells every
-- node about the others (the task counts of Slurm and Open MPI), so the whole
-- job stops before any rank starts.
function M.refusal(facts)
  local engine, how = facts.launcher, HOW[facts.launcher]
  local per_node = "run one per node (" .. (how or "") .. ") and give mprun -n the ranks per node"
  if facts.local_tasks and facts.local_tasks > 1 then
    return ("%s started %d copies of mprun on host %s; %s"):format(
      engine, facts.local_tasks, facts.host, per_node)
  end
  if facts.nodes and facts.copies and facts.nodes ~= facts.copies then
    return ("%s started %d copies of mprun on %d nodes: some node runs more than one; %s")
           :format(engine, facts.copies, facts.nodes, per_node)
  end
  if facts.app_contexts and facts.app_contexts > 1 then
    return ("%s started %d different command lines (MPMD ':'); the nodes must all "
            .. "run the same mprun -n"):format(engine, facts.app_contexts)
  end
  return nil
end

--- Makes the engine stop the whole job with exit status 'code' when this
-- node fails: call it before exiting non-zero.  srun --kill-on-bad-exit,
-- mpirun and torchrun's rendezvous react to the exit itself; Hydra stops
-- the other nodes only when a process dies by a signal or aborts through
-- PMI, so under Hydra this sends PMI's abort over the PMI_FD it gave us,
-- half a second after the call (mpiexec then kills every node and exits
-- with 'code').  Returns true when a message was sent.
function M.abort_job(facts, code, env)
  local get = type(env) == "table" and function(k) return env[k] end or env or os.getenv
  local fd = math.tointeger(tonumber(get("PMI_FD") or ""))
  if facts.launcher ~= "hydra" or not fd or fd < 0 then return false end
  code = math.tointeger(code) or 1
  -- bash: dash cannot redirect to a descriptor above 9.  The pause first:
  -- the proxy kills us on the abort, and what we wrote last (the summary)
  -- must have left our pipes by then.
  return os.execute(("exec bash -c 'sleep 0.5; printf \"cmd=abort exitcode=%d\\\\n\" >&%d' "
                     .. "2>/dev/null"):format(code, fd)) == true
end

return M
