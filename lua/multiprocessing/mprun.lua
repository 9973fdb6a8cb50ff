--- multiprocessing.mprun -- the `mprun` command: start N ranks of a Lua
-- script (or chunk, or any program), relay their output line by line,
-- restart them on failure, and say which rank failed first and why.
--
-- Built on the library: each rank is a worker of its own ProcessContext
-- (start_processes with nprocs 1), so per-rank restart and teardown are
-- natural; its error and traceback come back through the report slot.  The
-- C side is multiprocessing.launcher (src/launcher/): pipes, log files, the
-- output relay and the signalfd, apart from the core, whose public faces
-- it uses (Fd objects that cross to workers, ctx:fileno()).  This file is
-- the policy.
--
--   M.main(argv) -> never returns (os.exit with mprun's status)
--   M.parse(argv) -> options, or nil, usage message

-- The core itself, not the multiprocessing module: what mprun uses of it
-- is the core's, and compiling the rest (init.lua, process.lua) would
-- delay every run's first rank.
local core = require "multiprocessing.core"
local launcher = require "multiprocessing.launcher"
local cluster = require "multiprocessing.cluster"
local world = require "multiprocessing.world"

local M = {}

local USAGE = [[
usage: mprun [options] script.lua [args...]   N fresh Lua interpreters run the script
       mprun [options] -e 'lua code'          N copies of a chunk
       mprun [options] -- program [args...]   any program, supervised and logged

options:
  -n, --nprocs N          processes on this machine (default 1; "auto" = number of CPUs)
  --start-method M        spawn (default) | forkserver | fork
  --max-restarts K        restart after a failure, up to K times (default 0)
  --restart group|rank    group (default): tear all down and start all again;
                          rank: restart only the failed rank (K times per rank)
  --grace-period S        SIGTERM, then S seconds, then SIGKILL when tearing down
                          (default 30)
  --timeout S             an attempt fails after S seconds (exit status 124; 0: none)
  --log-dir DIR           output to DIR/<run-id>/attempt_<k>/<rank>/{stdout,stderr}.log
                          only (k: the restart count; on several nodes
                          DIR/<run-id>/<host>/attempt_<k>/<rank>/); made fresh,
                          never through a link: an existing attempt_<k> is refused
  --tee                   with --log-dir: to the console too
  --ranks LIST            which ranks reach the console, e.g. 0,2-3 (default all)
  --no-prefix             no "[rankN]: " line prefixes (default: prefixes when N > 1)
  --quiet                 no status line, no summary on success
  --run-id ID             the run's id (default: the engine's job id, else a fresh one):
                          letters, digits, '.', '_', '-', not starting with '.' or '-'
  --nnodes N              nodes in the job (default: from the cluster engine, else 1)
  --node-rank R           this node's index, 0 .. N-1 (default: from the engine, else 0)
  --master-addr HOST      node 0's address, for the ranks' rendezvous (default: from
                          the engine, else 127.0.0.1)
  -h, --help              this help

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, MP_RESTART_COUNT,
MP_MAX_RESTARTS, MP_RUN_ID, MP_LAUNCHER in its environment (in Lua:
require("multiprocessing").world()), and `arg` as lua5.4 sets it.
Under srun, mpirun, mpiexec or torchrun (one mprun per node), RANK =
GROUP_RANK * N + LOCAL_RANK with GROUP_RANK the node's index from the engine;
--ranks, the "[rankN]: " prefixes and the log files use RANK.
Exit status: 0 when every rank exited 0; else the first failure's exit code,
or 128 + its signal number; 124 on --timeout; 130/143 on SIGINT/SIGTERM;
2 on bad usage or a script that does not load; 127 (126) when the program
after -- is not found (not runnable).  Each failure and restart is said on
stderr as it happens; with --log-dir, a failed rank's error.json and the
run's events.jsonl are kept beside the logs.
]]

local START_METHODS = {}   -- the one list, in C
for _, name in ipairs(core.get_all_start_methods()) do START_METHODS[name] = true end
local SIGNAL_NAME = {}
for name, num in pairs(core.signals) do SIGNAL_NAME[num] = name end
local STATUS_PERIOD = 0.2          -- at most 5 status lines a second
local EXIT_TIMEOUT = 124           -- as timeout(1)

-- --------------------------------------------------------------- options

local function usage_error(fmt, ...)
  error({ usage = fmt:format(...) }, 0)
end

--- A check before anything starts that is not about the options: its own
-- exit status (127, 126 as a shell's), no "Try --help".
local function refuse(status, fmt, ...)
  error({ usage = fmt:format(...), status = status }, 0)
end

local function integer(name, value, min)
  local n = math.tointeger(tonumber(value or ""))
  if n == nil or n < min then
    usage_error("%s must be an integer >= %d, got '%s'", name, min, tostring(value))
  end
  return n
end

local function seconds(name, value)
  local s = tonumber(value or "")
  if s == nil or s ~= s or s < 0 or s == math.huge then
    usage_error("%s must be a number of seconds >= 0, got '%s'", name, tostring(value))
  end
  return s
end

-- "0,2-3" -> {[0]=true, [2]=true, [3]=true}, each below n.
local function rank_set(spec, n)
  local set = {}
  local ranges, bad = cluster.ranges(spec)
  if not ranges then usage_error("--ranks: bad item '%s' in '%s'", bad, spec) end
  for _, r in ipairs(ranges) do
    if r.hi >= n then
      usage_error("--ranks: rank %d is out of range (world size %d: ranks 0-%d)", r.hi, n, n - 1)
    end
    for k = r.lo, r.hi do set[k] = true end
  end
  return set
end

local check_what   -- below

-- Options that take a value: name -> the field it sets.
local VALUED = {
  ["-n"] = "nprocs", ["--nprocs"] = "nprocs", ["--start-method"] = "start_method",
  ["--max-restarts"] = "max_restarts", ["--restart"] = "restart",
  ["--grace-period"] = "grace_period", ["--timeout"] = "timeout",
  ["--log-dir"] = "log_dir", ["--ranks"] = "ranks", ["--run-id"] = "run_id",
  ["-e"] = "code", ["--nnodes"] = "nnodes", ["--node-rank"] = "node_rank",
  ["--master-addr"] = "master_addr",
}
local FLAGS = {
  ["--tee"] = "tee", ["--no-prefix"] = "no_prefix", ["--quiet"] = "quiet",
  ["-h"] = "help", ["--help"] = "help",
}

--- The raw options and what to run: {field = string or true, script=,
-- program=, args = {...}}.
local function scan(argv)
  local o, i = { args = {} }, 1
  while i <= #argv do
    local a = argv[i]
    local name, inline = a:match("^(%-%-[%w-]+)=(.*)$")
    if not name and a:match("^%-n.") then name, inline = "-n", a:sub(3) end
    name = name or a
    if a == "--" then
      if i == #argv then usage_error("-- must be followed by a program") end
      o.program = table.move(argv, i + 1, #argv, 1, {})
      return o
    elseif VALUED[name] then
      local value = inline
      if value == nil then
        i = i + 1
        value = argv[i]
        if value == nil then usage_error("option %s needs a value", name) end
      end
      o[VALUED[name]] = value
    elseif FLAGS[name] and inline == nil then
      o[FLAGS[name]] = true
    elseif a:match("^%-.") then
      usage_error("unknown option '%s'", a)
    else
      o.script = a
      table.move(argv, i + 1, #argv, 1, o.args)
      return o
    end
    i = i + 1
  end
  return o
end

local function fresh_run_id()
  local f = io.open("/dev/urandom", "rb")
  local bytes = f and f:read(6) or tostring(os.time())
  if f then f:close() end
  return (bytes:gsub(".", function(c) return ("%02x"):format(c:byte()) end))
end

--- The node's facts (world.node) under the --nnodes, --node-rank and
-- --master-addr overrides; refuses, before any rank starts, what cannot be
-- numbered: more than one mprun per node, -n auto on several nodes.
local function node_of(o)
  if o.master_addr == "" then usage_error("--master-addr must not be empty") end
  local overrides = {
    nnodes = o.nnodes and integer("--nnodes", o.nnodes, 1),
    node_rank = o.node_rank and integer("--node-rank", o.node_rank, 0),
    master_addr = o.master_addr,
    names = { nnodes = "--nnodes", node_rank = "--node-rank", master_addr = "--master-addr" },
  }
  local ok, node = pcall(world.node, overrides)
  if not ok then usage_error("%s", (tostring(node):gsub("^multiprocessing%.cluster: ", ""))) end
  local why = cluster.refusal(node)
  if why then usage_error("%s", why) end
  if o.auto and node.group_world_size > 1 then
    usage_error("-n auto on %d nodes: their CPU counts may differ and the ranks would "
                .. "not line up; give -n a number", node.group_world_size)
  end
  return node
end

--- A name that is one path component and nothing else: no '/', no '..',
-- no hidden file, no option-like start.
local function safe_name(s)
  return #s <= 200 and s:match("^[%w_][%w._-]*$") ~= nil
end

--- Under an engine, a run id every node shares: its job id.
local function job_run_id(node)
  if node.launcher == "mprun" or not node.job_id then return nil end
  return (node.launcher .. "-" .. node.job_id):gsub("[^%w._-]", "_")
end

--- "put it after --" when the script named looks like a program: a file
-- that is executable, or a command found in PATH.
local function program_hint(o, raw_n)
  if not launcher._executable(o.script) then return "" end
  local words = { o.script }
  for _, a in ipairs(o.args) do
    words[#words + 1] = a:match("^[%w%./_=:,+-]+$") and a or ("'" .. a:gsub("'", "'\\''") .. "'")
  end
  return ("\nmprun: to run a program, put it after '--': mprun -n %s -- %s")
    :format(raw_n or "1", table.concat(words, " "))
end

--- What is to run loads (a script, -e code) or can be run (a program),
-- before N copies of it start.
function check_what(o)
  if o.code then
    local chunk, err = load(o.code, "=(command line)")
    if not chunk then usage_error("-e: the code does not load: %s", err) end
  elseif o.script then
    local f, err = io.open(o.script, "r")
    if not f then usage_error("cannot read the script: %s%s", err, program_hint(o, o.raw_n)) end
    f:close()
    local chunk
    chunk, err = loadfile(o.script)
    if not chunk then
      usage_error("the script does not load: %s%s", err, program_hint(o, o.raw_n))
    end
  elseif o.program then
    local ok, err, status = launcher._executable(o.program[1])
    if not ok then refuse(status, "%s (nothing was started)", err) end
  end
end

--- Options, checked: everything a run needs, or raises {usage = message}.
local function check(o)
  if o.help then return o end
  local what = (o.script and 1 or 0) + (o.code and 1 or 0) + (o.program and 1 or 0)
  if what == 0 then usage_error("no script, -e code or -- program given") end
  if what > 1 then usage_error("give one of: a script, -e code, -- program") end
  o.raw_n = o.nprocs
  if o.nprocs == "auto" then
    o.auto = true
    o.nprocs = core.cpu_count()
  else
    o.nprocs = integer("-n/--nprocs", o.nprocs or "1", 1)
  end
  o.start_method = o.start_method or "spawn"
  if not START_METHODS[o.start_method] then
    usage_error("--start-method must be one of %s, got '%s'",
                table.concat(core.get_all_start_methods(), ", "), o.start_method)
  end
  o.max_restarts = integer("--max-restarts", o.max_restarts or "0", 0)
  o.restart = o.restart or "group"
  if o.restart ~= "group" and o.restart ~= "rank" then
    usage_error("--restart must be group or rank, got '%s'", o.restart)
  end
  o.grace_period = seconds("--grace-period", o.grace_period or "30")
  if o.timeout then
    o.timeout = seconds("--timeout", o.timeout)
    if o.timeout == 0 then o.timeout = nil end   -- as timeout(1): 0 is none
  end
  o.node = node_of(o)
  o.first_rank = o.node.group_rank * o.nprocs
  o.ranks = o.ranks and rank_set(o.ranks, o.node.group_world_size * o.nprocs)
  if o.run_id and not safe_name(o.run_id) then
    usage_error("--run-id must be one path component of letters, digits, '.', '_' and '-' "
                .. "(not starting with '.' or '-'), got '%s'", o.run_id)
  end
  o.run_id = o.run_id or job_run_id(o.node) or fresh_run_id()
  if o.log_dir then
    local ok, err = launcher._makedirs(o.log_dir)
    if o.log_dir == "" or not ok then usage_error("--log-dir: %s", err or "empty") end
  end
  if o.tee and not o.log_dir then
    usage_error("--tee needs --log-dir (without --log-dir the output goes to the console only)")
  end
  o.prefix = o.nprocs > 1 and not o.no_prefix
  check_what(o)
  return o
end

--- parse(argv) -> options, or nil and the usage message.
-- A check before start that failed gives its exit status as well (127:
-- the program is not found, 126: not runnable).
function M.parse(argv)
  local ok, o = pcall(function() return check(scan(argv)) end)
  if ok then return o end
  if type(o) == "table" and o.usage then return nil, o.usage, o.status end
  error(o, 0)
end

-- ------------------------------------------------------------ the rank side

-- Runs in the worker (sent as bytecode: no upvalues but _ENV).  Takes the
-- pipes or log files as stdin/stdout/stderr, sets the environment, then
-- runs the script, the chunk or the program; errors reach the launcher
-- through the report, with their traceback.
local function rank_main(_, job)
  local mpcore = require "multiprocessing.core"
  mpcore._set_title(job.title)   -- what ps and top show
  -- by its file, as the core was loaded: no search of package.path and
  -- package.cpath (a dozen failed opens in every rank); searched only if
  -- that file cannot be loaded
  package.preload["multiprocessing.launcher"] =
    job.launcher and package.loadlib(job.launcher, "luaopen_multiprocessing_launcher")
  local c = require "multiprocessing.launcher"
  c._rank_stdio(job.stdin, job.stdout, job.stderr, job.linebuf)
  c._nofile(job.nofile)   -- the limit mprun was given, not the one it raised
  for name, value in pairs(job.env) do c._setenv(name, value) end
  if job.program then c._run_program(job.program) end
  local chunk, err
  if job.script then
    chunk, err = loadfile(job.script)
  else
    chunk, err = load(job.code, "=(command line)")
  end
  if not chunk then error(err, 0) end
  _ENV.arg = job.arg  -- the script's own global, as lua.c sets it
  chunk(table.unpack(job.args, 1, #job.args))
end

--- The `arg` table lua5.4 would give: the interpreter at -1 (script) or 0
-- (-e: lua.c then has no script, and the options are arg[1], arg[2]).
-- The interpreter is named as mprun's own was (o.interpreter), else by
-- its path.
local function lua_arg(o)
  local exe = o.interpreter or core.get_executable()
  if o.script then
    local t = { [-1] = exe, [0] = o.script }
    table.move(o.args, 1, #o.args, 1, t)
    return t
  end
  return { [0] = exe, "-e", o.code }
end

-- ------------------------------------------------------------- the run

-- ------------------------------------------------------- records (JSON)

local JSON_ESC = { ['"'] = '\\"', ["\\"] = "\\\\", ["\n"] = "\\n", ["\r"] = "\\r", ["\t"] = "\\t" }

--- A flat record as one line of JSON: strings, numbers, booleans (keys
-- sorted, so that the lines are stable).
local function json(t)
  local keys, out = {}, {}
  for k in pairs(t) do keys[#keys + 1] = k end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v = t[k]
    if type(v) == "string" then
      v = '"' .. v:gsub('[%c"\\]', function(c)
        return JSON_ESC[c] or ("\\u%04x"):format(c:byte())
      end) .. '"'
    elseif math.type(v) == "float" then
      v = v ~= v and "null" or ("%.17g"):format(v)
    else
      v = tostring(v)
    end
    out[#out + 1] = ('"%s":%s'):format(k, v)
  end
  return "{" .. table.concat(out, ",") .. "}"
end

local function iso(t) return os.date("!%Y-%m-%dT%H:%M:%SZ", math.floor(t)) end

local Run = {}
Run.__index = Run

--- Whether a rank's output reaches the console.
local function shown(o, r)
  return (o.log_dir == nil or o.tee == true) and (o.ranks == nil or o.ranks[r] == true)
end

--- A directory of the log tree, made (or, 'fresh' false, taken) through
-- its parent's descriptor; refuses links and what is not ours.
local function log_subdir(parent, name, fresh, path)
  local dir, why, reason = launcher._subdir(parent, name, fresh)
  if dir then return dir end
  if reason == "exists" then
    error(("--log-dir: %s exists already: mprun makes the directories of each attempt "
           .. "itself and never writes into one it did not make (use another --run-id, "
           .. "or remove it)"):format(path), 0)
  end
  error(("--log-dir: refusing %s: %s"):format(path, why), 0)
end

--- Opens DIR/<run-id> (DIR/<run-id>/<host> on several nodes): the
-- directory every attempt's directory is made in.
function Run:open_logs()
  local o = self.o
  local root, why = launcher._opendir(o.log_dir)
  if not root then error(("--log-dir: cannot open %s: %s"):format(o.log_dir, why), 0) end
  self.log_path = o.log_dir .. "/" .. o.run_id
  local ok, dir = pcall(log_subdir, root, o.run_id, false, self.log_path)
  root:close()
  if not ok then error(dir, 0) end
  if o.node.group_world_size > 1 then
    -- several nodes: a directory per host, so no two nodes share a file
    local host = o.node.host:gsub("[^%w._-]", "_"):gsub("^[.-]", "_")
    self.log_path = self.log_path .. "/" .. host
    ok, root = pcall(log_subdir, dir, host, false, self.log_path)
    dir:close()
    if not ok then error(root, 0) end
    dir = root
  end
  self.log_root, self.attempt_dirs = dir, {}
end

--- The directory attempt_<k>, made fresh by this run (once).
function Run:attempt_dir(k)
  local dir = self.attempt_dirs[k]
  if not dir then
    dir = log_subdir(self.log_root, "attempt_" .. k, true,
                     ("%s/attempt_%d"):format(self.log_path, k))
    self.attempt_dirs[k] = dir
  end
  return dir
end

--- The rank's directory of this attempt, made fresh: attempt_<k>/<rank>.
function Run:rank_dir(rank)
  if rank.log_dir then rank.log_dir:close() end
  local name = tostring(rank.global)
  rank.log_dir = log_subdir(self:attempt_dir(rank.restarts), name, true,
    ("%s/attempt_%d/%s"):format(self.log_path, rank.restarts, name))
  return rank.log_dir
end

--- Where a rank's stdout (stream 1) or stderr (2) goes, for the worker:
-- a pipe to the relay (console, and a log file through the relay), a log
-- file directly, or /dev/null.  Returns the worker's end.
function Run:stream(rank, stream)
  local o, file = self.o, nil
  if o.log_dir then
    local name = stream == 1 and "stdout.log" or "stderr.log"
    local why
    file, why = launcher._create(rank.log_dir, name)
    if not file then
      error(("--log-dir: cannot create %s/attempt_%d/%d/%s: %s"):format(
        self.log_path, rank.restarts, rank.global, name, why), 0)
    end
  end
  if not shown(o, rank.global) then
    return file or assert(launcher._open("/dev/null", "w"))
  end
  local r, w = launcher._pipe()
  rank.sources[#rank.sources + 1] =
    self.relay:add(r, stream, o.prefix and ("[rank%d]: "):format(rank.global) or nil, file)
  return w
end

--- A rank's environment.  Which node this is among how many comes from
-- world.node(), the one place that knows about nodes (one machine: node 0
-- of 1; under a cluster engine, what it says); the global rank counts the
-- nodes before ours.
function Run:env(rank)
  local o, node = self.o, self.o.node
  local env = {
    RANK = tostring(rank.global), LOCAL_RANK = tostring(rank.r),
    WORLD_SIZE = tostring(node.group_world_size * o.nprocs),
    LOCAL_WORLD_SIZE = tostring(o.nprocs),
    GROUP_RANK = tostring(node.group_rank),
    GROUP_WORLD_SIZE = tostring(node.group_world_size),
    MASTER_ADDR = node.master_addr,
    MP_LAUNCHER = node.launcher,
    MP_RESTART_COUNT = tostring(rank.restarts),
    MP_MAX_RESTARTS = tostring(o.max_restarts),
    MP_RUN_ID = o.run_id,
  }
  if node.master_port then env.MASTER_PORT = tostring(node.master_port) end
  return env
end

--- Starts (or restarts) a rank: its streams, then its worker.
function Run:start(rank)
  local o = self.o
  rank.sources, rank.stopping, rank.timed_out = {}, false, false
  local job = {
    env = self:env(rank), program = o.program, script = o.script,
    code = o.code, args = o.args, arg = self.arg, linebuf = self.linebuf,
    nofile = self.nofile, launcher = self.launcher,
    title = ("mprun[%d/%d] %s"):format(rank.global, o.node.group_world_size * o.nprocs,
                                       self.what),
  }
  local ok, ctx = pcall(function()
    job.stdin = self.stdin and launcher._open("/dev/null", "r") or nil
    if o.log_dir then self:rank_dir(rank) end
    job.stdout = self:stream(rank, 1)
    job.stderr = self:stream(rank, 2)
    -- through pcall: the core's message without a position of ours
    local started, c = pcall(core.start_processes, rank_main, { job }, 1, false, false,
                             o.start_method)
    if not started then error(c, 0) end
    local fine, fd = pcall(c.fileno, c)
    if not fine then
      c:close(0)
      error(fd, 0)
    end
    return c, fd
  end)
  for _, k in ipairs { "stdin", "stdout", "stderr" } do
    if job[k] then job[k]:close() end   -- the worker has its own copies
  end
  if not ok then
    for _, id in ipairs(rank.sources) do self.relay:drain(id) end
    error(("cannot start rank %d: %s"):format(rank.r, tostring(ctx)), 0)
  end
  rank.ctx, rank.pid, rank.state = ctx, ctx:pids()[1], "running"
  rank.started, rank.started_wall = core._now(), os.time()
  self.fds[rank.r + 1] = ctx:fileno()
  self:event { event = "started", rank = rank.global, attempt = rank.restarts, pid = rank.pid }
end

function Run:start_all()
  self.failures, self.root = {}, nil
  for _, rank in ipairs(self.ranks) do
    rank.restarts = self.attempt
    self:start(rank)
  end
end

--- Ends a rank through the engine: ctx:terminate(grace) sends SIGTERM (and
-- SIGCONT) to the worker and its process group now and SIGKILL once the
-- grace has passed (0: now); the context's fileno() wakes the loop for each
-- step.  mprun keeps no timing of its own: only which rank ends, and why.
local function end_rank(self, rank, kill)
  rank.stopping = true
  rank.ctx:terminate(kill and 0 or self.o.grace_period)
end

--- SIGTERM (SIGKILL with 'sig' "SIGKILL") to every running rank, through
-- the engine.  A rank that has already exited is left for the loop to
-- judge: it failed (or not) on its own, before we ended it.  Returns how
-- many ranks were ended.
function Run:teardown(sig)
  local n = 0
  for _, rank in ipairs(self.ranks) do
    if rank.ctx and (not rank.stopping or sig == "SIGKILL") then
      if rank.ctx.processes[1]:is_alive() then
        n = n + 1
        end_rank(self, rank, sig == "SIGKILL")
      else
        self.dead[#self.dead + 1] = rank
      end
    end
  end
  self.tearing = true
  if sig ~= "SIGKILL" and not self.kill_shown then
    self.kill_shown = core._now() + self.o.grace_period   -- the countdown shown only
  end
  return n
end

--- A failure as the summary shows it, from the rank's exception.
local function failure_of(rank, e, timeout)
  local f = { rank = rank.r, pid = rank.pid, restarts = rank.restarts,
              time = os.time(), started = rank.started_wall }
  if timeout then
    f.timeout = timeout
    return f
  end
  local code = type(e) == "userdata" and e.exit_code
  if code and code < 0 then
    f.signal = e.signal_name or ("signal " .. -code)
    f.signum = -code
  else
    f.exit_code = code or 1
  end
  if core.isinstance(e, core.ProcessRaisedException) then
    f.traceback = tostring(e.msg):gsub("^%s*%-%- Process %d+ terminated with the following error:\n", "")
    f.message = type(e.message) == "string" and e.message or nil
  elseif type(e) ~= "userdata" then
    f.traceback = tostring(e)
  end
  if not f.message and f.traceback then   -- its first line that is not a frame
    for line in (f.traceback .. "\n"):gmatch("(.-)\n") do
      if line ~= "" and not line:find("^\t") and line ~= "stack traceback:" then
        f.message = line
        break
      end
    end
  end
  return f
end

--- How a failure ended, in a few words: "exit 1: train.lua:12: loss is
-- NaN", "SIGSEGV", "timeout after 5s".
local function how(f)
  if f.timeout then return ("timeout after %gs"):format(f.timeout) end
  if f.signal then return f.signal end
  local msg = f.message and (": " .. f.message:match("^[^\n]*")) or ""
  return ("exit %d%s"):format(f.exit_code, msg)
end

--- A failure that counts: recorded, said on stderr (one line), written
-- to the log dir.  'restart' (true when a restart follows) adds "restart
-- k of K (group|rank)".
function Run:failed(f, restart)
  if self.root == nil then self.root = f else self.failures[#self.failures + 1] = f end
  self:tell(f, restart)
end

--- Says a failure: one line on stderr, an event, error.json.
function Run:tell(f, restart)
  local o = self.o
  local who = f.rank == "all" and ("attempt %d"):format(f.restarts)
              or ("rank %d"):format(o.first_rank + f.rank)
  local line = ("mprun: %s failed (%s)"):format(who, how(f))
  if restart then
    line = line .. ("; restart %d of %d (%s)"):format(restart, o.max_restarts, o.restart)
  end
  self:say(line .. "\n")
  self:event { event = "failed", rank = f.rank == "all" and -1 or o.first_rank + f.rank,
               attempt = f.restarts, exit_code = f.exit_code, signal = f.signal,
               timeout = f.timeout, message = f.message, restart = restart }
  self:error_json(f)
end

--- attempt_<k>/<rank>/error.json: the whole failure record of a rank.
function Run:error_json(f)
  local rank = f.rank ~= "all" and self.ranks[f.rank + 1]
  if not (self.o.log_dir and rank and rank.log_dir) then return end
  local file = launcher._create(rank.log_dir, "error.json")
  if not file then return end
  launcher._write(file, json {
    rank = self.o.first_rank + f.rank, local_rank = f.rank, attempt = f.restarts,
    pid = f.pid, host = self.o.node.host, exit_code = f.exit_code, signal = f.signal,
    timeout = f.timeout, message = f.message, traceback = f.traceback,
    started = f.started and iso(f.started), ended = iso(f.time),
    run_id = self.o.run_id,
  } .. "\n")
  file:close()
end

--- One line of the run's events.jsonl (with --log-dir).
function Run:event(t)
  if not self.events then return end
  t.time = iso(os.time())
  launcher._write(self.events, json(t) .. "\n")
end

--- A rank's worker exited: reap it, take its last output, decide.
function Run:exited(rank)
  local ok, e = pcall(rank.ctx.join, rank.ctx, 0)
  if ok and e == false then return end   -- not yet (an engine step, or spurious)
  for _, id in ipairs(rank.sources) do self.relay:drain(id) end
  rank.ctx:close(0)
  rank.ctx = nil
  self.fds[rank.r + 1] = false
  if ok and not rank.timed_out then   -- exit 0, or ended by ctx:terminate
    rank.state = rank.stopping and "stopped" or "done"
    self:event { event = "exited", rank = rank.global, attempt = rank.restarts,
                 terminated = rank.stopping }
    return
  end
  if rank.stopping and not rank.timed_out then
    rank.state = "stopped"
    return
  end
  rank.state = "failed"
  local f = failure_of(rank, e, rank.timed_out and self.o.timeout)
  local o = self.o
  if o.restart == "rank" and rank.restarts < o.max_restarts and not self.signal
     and not self.final then
    self:tell(f, rank.restarts + 1)   -- restarted: not one of the run's failures
    self.restarts = self.restarts + 1
    rank.restarts = rank.restarts + 1
    self:start(rank)
    return
  end
  local restart = o.restart == "group" and not self.tearing and not self.signal
                  and self.attempt < o.max_restarts and self.attempt + 1 or nil
  self:failed(f, restart)
  if o.restart == "rank" then self.final = true end
  self:teardown()
end

function Run:running()
  local n = 0
  for _, rank in ipairs(self.ranks) do
    if rank.ctx then n = n + 1 end
  end
  return n
end

--- Checks the deadlines: the grace period, --timeout.
function Run:tick(now)
  local limit = self.o.timeout
  if not limit then return end
  if self.o.restart == "group" then
    -- a teardown under way (a failure, a signal) is not timed out on top
    if not self.timed_out and not self.tearing and now - self.attempt_started >= limit then
      self.timed_out = true
      self:failed({ rank = "all", timeout = limit, time = os.time(),
                    restarts = self.attempt },
                  self.attempt < self.o.max_restarts and self.attempt + 1 or nil)
      self:teardown()
    end
    return
  end
  for _, rank in ipairs(self.ranks) do
    if rank.ctx and not rank.stopping and now - rank.started >= limit then
      rank.timed_out = true
      end_rank(self, rank)
    end
  end
end

--- The next moment the loop must wake up for, as a timeout (-1: none).
function Run:next_wake(now)
  local t = math.huge
  if self.o.timeout then
    if self.o.restart == "group" then
      if not self.timed_out and not self.tearing then
        t = math.min(t, self.attempt_started + self.o.timeout)
      end
    else
      for _, rank in ipairs(self.ranks) do
        if rank.ctx and not rank.stopping then
          t = math.min(t, rank.started + self.o.timeout)
        end
      end
    end
  end
  if self.status then t = math.min(t, now + STATUS_PERIOD) end
  if t == math.huge then return -1 end
  return math.max(0, t - now)
end

function Run:draw_status(now)
  if not self.status or now - self.drawn < STATUS_PERIOD then return end
  self.drawn = now
  local count = { running = 0, done = 0, failed = 0, stopped = 0 }
  for _, rank in ipairs(self.ranks) do count[rank.state] = count[rank.state] + 1 end
  local text = ("mprun %s: %d running, %d done, %d failed, %d restarts, %.1fs")
    :format(self.o.run_id, count.running, count.done, count.failed + count.stopped,
            self.restarts, now - self.t0)
  if self.signal and self.kill_shown then
    text = ("mprun %s: %s: %d running, SIGKILL in %d s")
      :format(self.o.run_id, self.signal, count.running,
              math.max(0, math.ceil(self.kill_shown - now)))
  end
  self.relay:status(text)
end

function Run:on_signal(sig)
  if sig == "SIGPIPE" then return end
  if self.signal then   -- the second one: no more grace
    self:teardown("SIGKILL")
    return
  end
  self.signal = sig
  local n = self:teardown()
  local again = sig == "SIGINT" and "Ctrl-C" or sig
  self:say(("mprun: %s: sent SIGTERM to %d rank%s; SIGKILL in %g s; %s again to kill now\n")
    :format(sig, n, n == 1 and "" or "s", self.o.grace_period, again))
  self:event { event = "signal", signal = sig, terminated = n }
  self.drawn = -math.huge   -- the countdown at once
end

--- Everything of the attempt is reaped: the next attempt, or the end.
function Run:attempt_over()
  local o = self.o
  if self.signal or not self.root then return true end
  if o.restart == "group" and self.attempt < o.max_restarts then
    self.attempt = self.attempt + 1
    self.restarts = self.restarts + 1
    self:event { event = "restart", scope = "group", attempt = self.attempt }
    self.kill_shown, self.timed_out, self.tearing = nil, false, false
    self.attempt_started = core._now()
    self:start_all()
    return false
  end
  return true
end

-- ---------------------------------------------------------------- summary

local RULE = ("="):rep(60)

--- The label and the value of a failure's cause.
local function what_failed(f)
  if f.timeout then return "timeout", ("the attempt ran over %gs"):format(f.timeout) end
  if f.signal then
    return "signal", ("%s (exit status %d)"):format(f.signal, 128 + f.signum)
  end
  return "exit code", tostring(f.exit_code)
end

--- The lines of one failure ('run' gives the world around it).
local function describe(out, f, run)
  local n, node = run.o.nprocs, run.o.node
  if f.rank == "all" then
    out[#out + 1] = "  rank       : all"
  else
    out[#out + 1] = ("  rank       : %d (local_rank %d of %d)")
      :format(node.group_rank * n + f.rank, f.rank, n)
  end
  out[#out + 1] = ("  host       : %s"):format(node.host)
  if f.pid then out[#out + 1] = ("  pid        : %d"):format(f.pid) end
  out[#out + 1] = ("  attempt    : %d"):format(f.restarts)
  out[#out + 1] = ("  %-10s : %s"):format(what_failed(f))
  out[#out + 1] = ("  time       : %s"):format(os.date("!%Y-%m-%d %H:%M:%S UTC", f.time))
  if f.traceback then
    out[#out + 1] = "  traceback  :"
    for line in (f.traceback .. "\n"):gmatch("(.-)\n") do
      -- the frames of rank_main are mprun's, not the user's
      if not (line:find("^\t") and line:find("multiprocessing/mprun.lua:", 1, true)) then
        out[#out + 1] = "    " .. line
      end
    end
  end
end

function Run:summary()
  local o, root = self.o, self.root
  local what = o.program and o.program[1] or o.script or "-e"
  local attempt = o.restart == "group" and ("attempt " .. self.attempt)
                  or ("%d rank restart%s"):format(self.restarts, self.restarts == 1 and "" or "s")
  local out = {
    RULE,
    ("mprun: %s FAILED (run id %s, %s, %d rank%s)"):format(what, o.run_id,
      attempt, o.nprocs, o.nprocs == 1 and "" or "s"),
    ("-"):rep(60),
    "Root cause (first failure):",
  }
  describe(out, root, self)
  if #self.failures > 0 then
    out[#out + 1] = ("-"):rep(60)
    out[#out + 1] = "Other failures:"
    for _, f in ipairs(self.failures) do describe(out, f, self) end
  end
  out[#out + 1] = RULE
  return table.concat(out, "\n") .. "\n"
end

--- Writes mprun's own lines to stderr; on several nodes each starts with
-- the host's name, so the engine's merged output says which node spoke.
function Run:say(text)
  local node = self.o.node
  if node.group_world_size > 1 then
    text = text:gsub("[^\n]*\n", function(line) return node.host .. ": " .. line end)
  end
  if self.status and self.relay then self.relay:status(nil) end
  io.stderr:write(text)
  io.stderr:flush()
  self.drawn = -math.huge   -- redrawn below the line
end

function Run:close_logs()
  if self.events then self.events:close() end
  for _, dir in pairs(self.attempt_dirs or {}) do dir:close() end
  for _, rank in ipairs(self.ranks) do
    if rank.log_dir then rank.log_dir:close() end
  end
  if self.log_root then self.log_root:close() end
end

--- mprun's exit status.
function Run:status_code()
  if self.signal then return 128 + (self.signal == "SIGINT" and 2 or
                                    self.signal == "SIGHUP" and 1 or 15) end
  local f = self.root
  if not f then return 0 end
  if f.timeout then return EXIT_TIMEOUT end
  if f.signal then return 128 + f.signum end
  if f.exit_code < 1 or f.exit_code > 255 then return 1 end
  return f.exit_code
end

-- ------------------------------------------------------------------- main

--- Runs the job described by the options; returns mprun's exit status.
function M.run(o)
  local self = setmetatable({
    o = o, attempt = 0, restarts = 0, ranks = {},
    fds = { n = o.nprocs },   -- each rank's ctx:fileno(), or false
    failures = {}, dead = {}, arg = o.program == nil and lua_arg(o) or nil,
    what = table.concat(o.program or (o.script and { o.script, table.unpack(o.args) })
                        or { "-e", o.code }, " "),
    stdin = core._isatty(0), linebuf = core._isatty(1), t0 = core._now(), drawn = -math.huge,
    status = not o.quiet and core._isatty(2),
  }, Run)
  local S = core.signals
  self.sigfd = launcher._signalfd(S.SIGINT, S.SIGTERM, S.SIGHUP, S.SIGPIPE)
  self.nofile = launcher._nofile()   -- each rank costs mprun about 7 descriptors
  self.launcher = launcher._path()   -- the ranks load it from there
  self.relay = launcher._relay(1, 2, 2)
  for r = 0, o.nprocs - 1 do
    self.ranks[r + 1] = { r = r, global = o.first_rank + r, restarts = 0, state = "running",
                          sources = {} }
    self.fds[r + 1] = false
  end
  self.attempt_started = self.t0
  if o.log_dir then
    local ok, err = pcall(function()
      self:open_logs()
      self:attempt_dir(0)
      local why
      self.events, why = launcher._create(self.log_root, "events.jsonl")
      if not self.events then
        error(("--log-dir: cannot create %s/events.jsonl: %s"):format(self.log_path, why), 0)
      end
    end)
    if not ok then
      self:say("mprun: " .. tostring(err) .. "\n")
      self:close_logs()
      self.relay:close()
      self.relay = nil
      self.sigfd:close()
      return 2
    end
  end
  self:event { event = "run", run_id = o.run_id, nprocs = o.nprocs, host = o.node.host,
               restart = o.restart, max_restarts = o.max_restarts }
  local ok, err = pcall(self.start_all, self)
  if not ok then
    self:teardown("SIGKILL")
    self.start_error = err
  end
  while true do
    if self:running() == 0 and (self.start_error or self:attempt_over()) then break end
    local now = core._now()
    -- a rank found dead already (teardown reaped it) has no pidfd to wake us
    local wake = #self.dead > 0 and 0 or self:next_wake(now)
    local exited, signum = self.relay:wait(wake, self.fds, self.sigfd)
    local sig = signum and SIGNAL_NAME[signum]
    for _, i in ipairs(exited) do self.dead[#self.dead + 1] = self.ranks[i] end
    while #self.dead > 0 do
      local rank = table.remove(self.dead, 1)
      if rank.ctx then
        ok, err = pcall(self.exited, self, rank)
        if not ok then
          self.start_error = self.start_error or err
          self:teardown("SIGKILL")
        end
      end
    end
    if sig then self:on_signal(sig) end
    now = core._now()
    self:tick(now)
    self:draw_status(now)
  end
  local lost = self.relay:close()
  self.relay = nil
  if lost then self:say("mprun: " .. lost .. "\n") end
  local code = self:status_code()
  if self.start_error then
    self:say("mprun: " .. tostring(self.start_error) .. "\n")
    code = 1
  elseif self.signal then
    self:say(("mprun: %s: every rank was terminated (run id %s)\n")
      :format(self.signal, o.run_id))
  elseif self.root then
    self:say(self:summary())
  elseif not o.quiet then
    self:say(("mprun: %d rank%s finished (run id %s, %d restart%s, %.2fs)\n")
      :format(o.nprocs, o.nprocs == 1 and "" or "s", o.run_id, self.restarts,
              self.restarts == 1 and "" or "s", core._now() - self.t0))
  end
  if self.log_path and (code ~= 0 or not o.quiet) then
    self:say(("mprun: logs in %s/\n"):format(self.log_path))
  end
  self:event { event = "end", status = code, restarts = self.restarts }
  self.sigfd:close()
  self:close_logs()
  return code
end

--- The command: parses argv (a lua5.4 `arg` table), runs, exits.
function M.main(argv)
  local o, err, status = M.parse(argv)
  local lowest = 0
  while argv[lowest - 1] ~= nil do lowest = lowest - 1 end
  if o and lowest < 0 then o.interpreter = argv[lowest] end
  if not o and status then
    io.stderr:write("mprun: ", err, "\n")
    os.exit(status)
  elseif not o then
    io.stderr:write("mprun: ", err, "\nTry 'mprun --help' for the options.\n")
    os.exit(2)
  end
  if o.help then
    io.stdout:write(USAGE)
    os.exit(0)
  end
  io.stdout:flush()
  local code = M.run(o)
  -- Hydra stops the other nodes only when told (cluster.abort_job)
  if code ~= 0 then cluster.abort_job(o.node, code) end
  os.exit(code)
end

return M
