-- The cluster engines for real, on two hosts made of namespaces on this
-- machine (scripts/onebox/): Open MPI's mpirun, MPICH's Hydra mpiexec and
-- Slurm (slurmctld + two slurmd, munge) each start, once per host, mprun
-- (`mprun -n 4 scripts/onebox/rank.lua`) and a script using the library
-- directly (scripts/onebox/job.lua, 4 ranks of start_processes).  Checked: ranks,
-- world size and placement, a failing rank stopping the whole job with its
-- code, two copies per host refused before any rank starts, and nothing --
-- no process, no /dev/shm entry -- left on either host.
-- Skipped, loudly, when an engine is not installed (scripts/install-deps.sh
-- installs them), when this machine gives no right to create namespaces, and
-- under the sanitizer run (the engines' daemons would inherit its preload;
-- the plain run covers them).
local H = require "helpers"

local ENGINES = {
  { name = "openmpi", tools = { "mpirun.openmpi" }, master = "10.99.0.1" },
  { name = "hydra", tools = { "mpiexec.hydra", "bash" }, master = "h1" },
  { name = "slurm", tools = { "srun", "slurmctld", "slurmd", "sinfo", "munged" }, master = "h1",
    wrap = "sh scripts/onebox/slurm-up.sh" },
}

local function why_not(engine)
  if (os.getenv("LD_PRELOAD") or ""):find("asan") then
    return "not under the sanitizer preload (the plain run has them)"
  end
  for _, tool in ipairs(engine.tools) do
    if not os.execute("command -v " .. tool .. " >/dev/null 2>&1 || test -x /usr/sbin/" .. tool) then
      return tool .. " is not installed (sh scripts/install-deps.sh)"
    end
  end
  if not os.execute("unshare --mount --net --uts true 2>/dev/null") then
    return "no right to create namespaces here (needs root with CAP_SYS_ADMIN)"
  end
end

--- The scenarios' results: out[name] = {out=, rc=, secs=, left=, shm=}.
local function run_scenarios(engine, job)
  local dir = H.sh("mktemp -d"):gsub("%s+$", "")
  local cmd = ("sh scripts/onebox/onebox.sh %s sh scripts/onebox/scenarios.sh %s %s %s 2>&1; "
               .. "echo rc=$?"):format(engine.wrap or "", engine.name, job, dir)
  local log = H.sh(cmd)
  local res = {}
  for _, name in ipairs { "ok", "fail", "two" } do
    local r = {}
    for _, part in ipairs { "out", "rc", "secs", "left", "shm" } do
      r[part] = H.read(dir .. "/" .. name .. "." .. part)
    end
    r.rc, r.secs = tonumber(r.rc), tonumber(r.secs)
    res[name] = r
  end
  H.sh("rm -rf '" .. dir .. "'")
  assert(log:match("rc=0\n$"), "the one-box run failed:\n" .. log)
  return res
end

--- "rank R/W local L on HOST" lines as sorted "R@HOST" and the world sizes.
local function ranks(out)
  local placed, worlds = {}, {}
  for r, w, host in out:gmatch("rank (%d+)/(%d+) local %d+ on (%w+)") do
    placed[#placed + 1] = r .. "@" .. host
    worlds[w] = true
  end
  table.sort(placed, function(a, b) return tonumber(a:match("%d+")) < tonumber(b:match("%d+")) end)
  return table.concat(placed, " "), worlds
end

local function nothing_left(r)
  assert.are.equal("", r.left, "processes left on the hosts")
  assert.are.equal("", r.shm, "/dev/shm entries left on the hosts")
end

-- What a failing rank 6 (local rank 2 on h2) makes its node's copy say.
local ROOT_CAUSE = {
  library = { "h2: ProcessExitedException: process 2 terminated with exit code 5" },
  mprun = { "h2:   rank       : 6 (local_rank 2 of 4)", "h2:   exit code  : 5" },
}

for _, engine in ipairs(ENGINES) do
  local skip = why_not(engine)
  if skip then
    io.stderr:write(("\n*** onebox_spec: %s runs SKIPPED: %s ***\n"):format(engine.name, skip))
    pending(engine.name .. " on two one-box hosts: skipped, " .. skip)
  end
  for _, job in ipairs(skip and {} or { "mprun", "library" }) do
    describe(("%s under %s on two one-box hosts"):format(job, engine.name), function()
      local res
      lazy_setup(function() res = run_scenarios(engine, job) end)

      it("runs 4 ranks per host, numbered node-major, and says which engine", function()
        local r = res.ok
        assert.are.equal(0, r.rc, r.out)
        local placed, worlds = ranks(r.out)
        assert.are.equal("0@h1 1@h1 2@h1 3@h1 4@h2 5@h2 6@h2 7@h2", placed, r.out)
        assert.are.same({ ["8"] = true }, worlds)
        local master = {}
        for g, host, launcher, addr, port in
            r.out:gmatch("node (%d)/2 on (%w+) launcher (%w+) master ([^:]+):(%d+)") do
          assert.are.equal(engine.name, launcher)
          assert.are.equal(g == "0" and "h1" or "h2", host)
          master[#master + 1] = addr .. ":" .. port
        end
        assert.are.equal(2, #master, r.out)
        assert.are.equal(master[1], master[2])
        assert.matches("^" .. engine.master:gsub("%.", "%%.") .. ":%d+$", master[1])
        nothing_left(r)
      end)

      it("stops the whole job when a rank on the other host fails", function()
        local r = res.fail
        if engine.name == "slurm" then
          -- srun exits with its tasks' highest status (a killed task's 128+n)
          -- and names the root cause
          assert.are_not.equal(0, r.rc, r.out)
          -- (the failing copy's own last words may be lost: srun kills the
          -- step as soon as it has the exit status)
          assert.matches("h2: task 1: Exited with exit code 5", r.out, 1, true)
        else
          assert.are.equal(5, r.rc, r.out)
          for _, said in ipairs(ROOT_CAUSE[job]) do assert.matches(said, r.out, 1, true) end
        end
        -- the other ranks sleep 600 s: the engine stopped them
        assert.is_true(r.secs < 300, r.out)
        nothing_left(r)
      end)

      it("refuses two copies per host before any rank starts", function()
        local r = res.two
        assert.are_not.equal(0, r.rc)
        assert.matches(engine.name .. " started 2 copies of mprun on host h[12]; run one per node",
                       r.out)
        assert.is_nil(r.out:match("rank %d"), r.out)
        nothing_left(r)
      end)
    end)
  end
end
