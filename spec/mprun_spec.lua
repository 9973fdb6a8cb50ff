-- mprun, driven as a user drives it: a subprocess (through a pty for the
-- status line), its output, its files, its exit status, and what it leaves.
local H = require "helpers"

local MPRUN = "./scripts/mprun"

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function tmpdir()
  return (H.sh("mktemp -d"):gsub("%s+$", ""))
end

--- Runs a shell command line; returns stdout, stderr, exit status.
local function sh(cmd)
  local out, err = os.tmpname(), os.tmpname()
  local _, _, code = os.execute(("%s >%s 2>%s </dev/null"):format(cmd, out, err))
  local o, e = H.read(out), H.read(err)
  os.remove(out)
  os.remove(err)
  return o, e, code
end

--- mprun with these arguments (already quoted as needed).
local function mprun(args) return sh(MPRUN .. " " .. args) end

--- Its lines, sorted: ranks run in parallel, only lines are whole.
local sorted_lines = H.sorted_lines

--- Pids whose command line (arguments joined by spaces) matches the Lua
-- pattern; read from /proc here, not with pgrep (which can hang under the
-- ASan preload of make check-asan).
local function matching(pattern)
  local out = {}
  for dir in H.sh("ls /proc"):gmatch("(%d+)\n") do
    local cmd = H.read("/proc/" .. dir .. "/cmdline")
    if cmd and cmd:gsub("%z", " "):match(pattern) and H.alive(dir) then
      out[#out + 1] = tonumber(dir)
    end
  end
  return out
end

--- Waits until no process matches the pattern; true when none.
local function gone(pattern)
  return H.eventually(function() return #matching(pattern) == 0 end, 10)
end

describe("mprun", function()
  H.leak_check(before_each, after_each)

  describe("ranks", function()
    it("sets the torchrun variables and ours, per rank", function()
      local out, err, code = mprun("-n 3 --run-id job7 --max-restarts 2 -e " .. q[[
        local v = {}
        for _, k in ipairs { "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                             "GROUP_RANK", "MP_RESTART_COUNT", "MP_MAX_RESTARTS",
                             "MP_RUN_ID" } do v[#v + 1] = k .. "=" .. os.getenv(k) end
        print(table.concat(v, " "))]])
      assert.are.equal(0, code, err)
      local lines = sorted_lines(out)
      assert.are.equal(3, #lines)
      for r = 0, 2 do
        assert.are.equal(("[rank%d]: RANK=%d LOCAL_RANK=%d WORLD_SIZE=3 LOCAL_WORLD_SIZE=3 "
          .. "GROUP_RANK=0 MP_RESTART_COUNT=0 MP_MAX_RESTARTS=2 MP_RUN_ID=job7"):format(r, r, r),
          lines[r + 1])
      end
    end)

    it("gives mp.world() in a rank, and rank 0 of 1 when not launched", function()
      local out, err, code = mprun("-n 2 --run-id w1 -e " .. q(H.PATHS .. [[
        local w = require("multiprocessing").world()
        print(w.rank, w.local_rank, w.world_size, w.local_world_size, w.group_rank,
              w.restart_count, w.run_id, w.launcher)]]))
      assert.are.equal(0, code, err)
      assert.are.same({ "[rank0]: 0\t0\t2\t2\t0\t0\tw1\tmprun",
                        "[rank1]: 1\t1\t2\t2\t0\t0\tw1\tmprun" }, sorted_lines(out))
      local w = require("multiprocessing").world()
      if os.getenv("MP_RUN_ID") == nil then
        assert.are.equal(0, w.rank)
        assert.are.equal(1, w.world_size)
        assert.are.equal(0, w.group_rank)
        assert.is_nil(w.launcher)
      end
    end)

    local impossible = {
      { "RANK=abc", "RANK must be an integer >= 0, got 'abc'" },
      { "RANK=-1", "RANK must be an integer >= 0, got '-1'" },
      { "WORLD_SIZE=-1", "WORLD_SIZE must be an integer >= 1, got '-1'" },
      { "WORLD_SIZE=0", "WORLD_SIZE must be an integer >= 1, got '0'" },
      { "RANK=5 WORLD_SIZE=2", "RANK=5 is not below WORLD_SIZE=2" },
      { "LOCAL_RANK=-7", "LOCAL_RANK must be an integer >= 0, got '-7'" },
      { "LOCAL_RANK=2 LOCAL_WORLD_SIZE=2", "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2" },
      { "LOCAL_WORLD_SIZE=x", "LOCAL_WORLD_SIZE must be an integer >= 1, got 'x'" },
      { "MP_RUN_ID=r MASTER_PORT=99999999", "MASTER_PORT must be an integer in 1..65535" },
      { "MP_RUN_ID=r GROUP_RANK=2 GROUP_WORLD_SIZE=2", "GROUP_RANK=2 is not below GROUP_WORLD_SIZE=2" },
      { "MP_RUN_ID=r GROUP_WORLD_SIZE=0", "GROUP_WORLD_SIZE must be an integer >= 1" },
      { "MP_RESTART_COUNT=1.5", "MP_RESTART_COUNT must be an integer >= 0, got '1.5'" },
      { "MP_MAX_RESTARTS=-2", "MP_MAX_RESTARTS must be an integer >= 0" },
    }
    for _, case in ipairs(impossible) do
      it("mp.world() raises naming the variable for " .. case[1], function()
        local script = H.script([[print(require("multiprocessing").world().rank)]])
        local out, err, code = sh(("env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u LOCAL_WORLD_SIZE "
          .. "-u GROUP_RANK -u GROUP_WORLD_SIZE -u MP_RUN_ID -u MASTER_PORT %s lua5.4 %s")
          :format(case[1], q(script)))
        os.remove(script)
        assert.are_not.equal(0, code)
        assert.are.equal("", out)
        assert.matches("mp.world: " .. case[2], err, 1, true)
        assert.is_truthy(err:find(script .. ":2: mp.world: ", 1, true), err)  -- the caller's line
      end)
    end

    it("mp.world() takes a possible world as it is", function()
      local script = H.script([[local w = require("multiprocessing").world()
        print(w.rank, w.world_size, w.local_rank, w.local_world_size, w.master_port)]])
      local out, err, code = sh(("env RANK=3 WORLD_SIZE=4 LOCAL_RANK=1 LOCAL_WORLD_SIZE=2 "
        .. "MP_RUN_ID=r MASTER_PORT=29501 lua5.4 %s"):format(q(script)))
      os.remove(script)
      assert.are.equal(0, code, err)
      assert.are.equal("3\t4\t1\t2\t29501\n", out)
    end)

    for _, method in ipairs(H.methods) do
      it("shows each rank in ps as mprun[<rank>/<n>] <script> <args> (" .. method .. ")", function()
        local marker = os.tmpname()
        local script = H.script(([[
          io.open(%q, "a"):write("up\n"):close()
          os.execute("sleep 3.17")]]):format(marker), "")
        local runner = ("%s -n 2 --start-method %s %s --lr 0.1 >/dev/null 2>&1 &")
                       :format(MPRUN, method, q(script))
        os.execute(runner)
        assert.is_truthy(H.eventually(function()
          return select(2, (H.read(marker) or ""):gsub("up", "")) >= 2
        end, 30))
        local shown = {}
        for line in H.sh("env -u LD_PRELOAD ps -eo args"):gmatch("[^\n]+") do shown[line:gsub("%s+$", "")] = true end
        for r = 0, 1 do
          local want = ("mprun[%d/2] %s --lr 0.1"):format(r, script)
          assert.is_truthy(shown[want], want)
        end
        assert.is_true(gone("^sleep 3%.17"))
        os.remove(marker)
        os.remove(script)
      end)
    end

    it("sets arg and ... as lua5.4 does for a script", function()
      local script = H.script([[print(arg[0], arg[1], arg[2], #arg, select("#", ...), ...)]], "")
      local out, err, code = mprun(q(script) .. " a 'b c'")
      assert.are.equal(0, code, err)
      assert.are.equal(("%s\ta\tb c\t2\t2\ta\tb c\n"):format(script), out)
      local direct = H.sh("lua5.4 " .. q(script) .. " a 'b c'")
      assert.are.equal(direct, out)
      os.remove(script)
    end)

    it("gives options after the script to the script", function()
      local script = H.script([[print(...)]], "")
      local out, _, code = mprun(q(script) .. " -n 5 --help")
      assert.are.equal(0, code)
      assert.are.equal("-n\t5\t--help\n", out)
      os.remove(script)
    end)

    it("-n auto starts one rank per CPU", function()
      local out, err, code = mprun("-n auto --no-prefix -e 'print(os.getenv(\"WORLD_SIZE\"))'")
      assert.are.equal(0, code, err)
      local n = tonumber(H.sh("nproc"))
      assert.are.equal((n .. "\n"):rep(n), out)
    end)

    it("-n auto, mp.cpu_count() and Pool() count the CPUs of the affinity mask", function()
      local out, err, code = sh("taskset -c 0 " .. MPRUN .. " -n auto --no-prefix -e " .. q(H.PATHS .. [[
        local mp = require("multiprocessing")
        local pool = mp.Pool()
        print(os.getenv("WORLD_SIZE"), mp.cpu_count(), pool.processes)
        pool:close(); pool:join()]]))
      assert.are.equal(0, code, err)
      assert.are.equal("1\t1\t1\n", out)
    end)

    it("cpu_count() honours a cgroup v2 cpu.max quota, rounded up", function()
      if not os.execute("unshare -m true 2>/dev/null") then
        pending("unshare -m is not allowed here")
        return
      end
      local n = tonumber(H.sh("nproc"))
      local script = H.script([[print(require("multiprocessing").cpu_count())]])
      local function under(max)
        return sh(("unshare -m sh -c %s"):format(q(
          ("mount -t tmpfs cg /sys/fs/cgroup && echo %s > /sys/fs/cgroup/cpu.max && lua5.4 %s")
          :format(q(max), q(script)))))
      end
      local out, err, code = under("50000 100000")
      assert.are.equal(0, code, err)
      assert.are.equal("1\n", out)
      out = under("max 100000")
      assert.are.equal(n .. "\n", out)
      out = under(("%d 100000"):format(n * 100000 - 1))   -- just under n: n
      assert.are.equal(n .. "\n", out)
      os.remove(script)
    end)

    it("runs more ranks than the soft fd limit would hold; ranks keep that limit", function()
      local out, err, code = sh("ulimit -Sn 64 && " .. MPRUN .. " -n 24 --quiet --no-prefix -e "
        .. q[[local f = io.popen("ulimit -Sn"); io.write(f:read("a")); f:close()]])
      assert.are.equal(0, code, err)
      assert.are.equal(("64\n"):rep(24), out)
    end)

    for _, method in ipairs(H.methods) do
      it("runs ranks with start method " .. method, function()
        local out, err, code = mprun("-n 2 --start-method " .. method ..
                                     " -e 'print(os.getenv(\"RANK\"))'")
        assert.are.equal(0, code, err)
        assert.are.same({ "[rank0]: 0", "[rank1]: 1" }, sorted_lines(out))
      end)
    end

    it("supervises any program after --", function()
      local out, err, code = mprun("-n 2 -- sh -c 'echo out $RANK; echo err $RANK >&2; exit 0'")
      assert.are.equal(0, code, err)
      assert.are.same({ "[rank0]: out 0", "[rank1]: out 1" }, sorted_lines(out))
      assert.matches("%[rank0%]: err 0\n", err)
      assert.matches("%[rank1%]: err 1\n", err)
      local _
      _, err, code = mprun("-n 2 -- sh -c '[ $RANK = 1 ] && exit 9; exit 0'")
      assert.are.equal(9, code)
      assert.matches("Root cause", err)
      assert.matches("exit code  : 9", err, 1, true)
      _, err, code = mprun("-- /nonexistent/program")   -- checked before any rank starts
      assert.are.equal(127, code)
      assert.are.equal("mprun: /nonexistent/program: No such file or directory (nothing was started)\n", err)
    end)
  end)

  describe("output", function()
    it("prefixes lines when N > 1, not with --no-prefix or N = 1", function()
      local out = mprun("-n 2 -e 'print(\"x\")'")
      assert.are.same({ "[rank0]: x", "[rank1]: x" }, sorted_lines(out))
      out = mprun("-n 2 --no-prefix -e 'print(\"x\")'")
      assert.are.equal("x\nx\n", out)
      out = mprun("-e 'print(\"x\")'")
      assert.are.equal("x\n", out)
    end)

    it("shows only the ranks of --ranks", function()
      local out, err, code = mprun("-n 4 --ranks 0,2-3 -e 'print(os.getenv(\"RANK\"))'")
      assert.are.equal(0, code, err)
      assert.are.same({ "[rank0]: 0", "[rank2]: 2", "[rank3]: 3" }, sorted_lines(out))
    end)

    it("flushes a partial last line with a newline on the console", function()
      local out, err = mprun("-n 2 --quiet -e 'io.write(\"no newline\") io.stderr:write(\"e\")'")
      assert.are.same({ "[rank0]: no newline", "[rank1]: no newline" }, sorted_lines(out))
      assert.are.same({ "[rank0]: e", "[rank1]: e" }, sorted_lines(err))
    end)

    it("loses nothing of 500,000 lines from 4 ranks, never mixes two in a line", function()
      local out, err, code = mprun("-n 4 --quiet -e " .. q[[
        local r = os.getenv("RANK")
        for i = 1, 125000 do io.write(r, " ", i, "\n") end]])
      assert.are.equal(0, code, err)
      local next_of, n = { [0] = 1, 1, 1, 1 }, 0
      for line in out:gmatch("([^\n]*)\n") do
        local p, r, i = line:match("^%[rank(%d)%]: (%d) (%d+)$")
        assert.is_truthy(p, "bad line: " .. line)
        assert.are.equal(p, r)
        assert.are.equal(next_of[tonumber(r)], tonumber(i))
        next_of[tonumber(r)] = tonumber(i) + 1
        n = n + 1
      end
      assert.are.equal(500000, n)
      assert.are.same({ [0] = 125001, 125001, 125001, 125001 }, next_of)
    end)
  end)

  describe("--log-dir", function()
    local dir
    before_each(function() dir = tmpdir() end)
    after_each(function() os.execute("rm -rf " .. q(dir)) end)

    it("keeps each rank's exact bytes per attempt, console silent", function()
      local out, err, code = mprun(("-n 2 --log-dir %s --run-id L -e %s"):format(q(dir), q[[
        io.write("a\n\nno newline"); io.stderr:write("err ", os.getenv("RANK"))]]))
      assert.are.equal(0, code, err)
      assert.are.equal("", out)
      for r = 0, 1 do
        local base = ("%s/L/attempt_0/%d/"):format(dir, r)
        assert.are.equal("a\n\nno newline", H.read(base .. "stdout.log"))
        assert.are.equal("err " .. r, H.read(base .. "stderr.log"))
      end
    end)

    it("--tee writes the console too", function()
      local out, err, code = mprun(("-n 2 --tee --log-dir %s --run-id T -e %s")
                                   :format(q(dir), q[[print("hi")]]))
      assert.are.equal(0, code, err)
      assert.are.same({ "[rank0]: hi", "[rank1]: hi" }, sorted_lines(out))
      assert.are.equal("hi\n", H.read(dir .. "/T/attempt_0/1/stdout.log"))
    end)

    it("keeps the attempts of group restarts apart", function()
      -- rank 1 fails once rank 0's line is in its log, so that the
      -- teardown cannot come first
      local _, err, code = mprun(("-n 2 --max-restarts 2 --log-dir %s --run-id G -e %s")
        :format(q(dir), q(([[
          local k = os.getenv("MP_RESTART_COUNT")
          print("count " .. k)
          io.stdout:flush()
          if os.getenv("RANK") == "1" then
            local log = "%s/G/attempt_" .. k .. "/0/stdout.log"
            repeat
              local f = io.open(log)
              local s = f and f:read("a")
              if f then f:close() end
              if not s or s == "" then os.execute("sleep 0.01") end
            until s and s ~= ""
            os.exit(3)
          end]]):format(dir))))
      assert.are.equal(3, code)
      for k = 0, 2 do
        for r = 0, 1 do
          assert.are.equal("count " .. k .. "\n",
            H.read(("%s/G/attempt_%d/%d/stdout.log"):format(dir, k, r)))
        end
      end
      assert.is_nil(H.read(dir .. "/G/attempt_3/1/stdout.log"))
      assert.matches("attempt 2", err)
      assert.matches("exit code  : 3", err, 1, true)
    end)

    it("never follows a link planted in a shared log dir (the victim stays)", function()
      local victim = dir .. "/victim"
      H.write(victim, "original\n")
      os.execute(("mkdir -p %s/logs/job42/attempt_0/0 && ln -s %s %s/logs/job42/attempt_0/0/stdout.log")
                 :format(q(dir), q(victim), q(dir)))
      local out, err, code = mprun(("-n 1 --log-dir %s/logs --run-id job42 -e %s")
                                   :format(q(dir), q[[print("overwritten")]]))
      assert.are.equal("original\n", H.read(victim))
      assert.are.equal(2, code)
      assert.are.equal("", out)
      assert.matches("mprun: --log-dir: " .. dir .. "/logs/job42/attempt_0 exists already", err, 1, true)
    end)

    it("refuses a run dir that is a link, or that others can write to", function()
      local elsewhere = dir .. "/elsewhere"
      os.execute(("mkdir -p %s %s/logs && ln -s %s %s/logs/L1 && mkdir -m 777 %s/logs/L2")
                 :format(q(elsewhere), q(dir), q(elsewhere), q(dir), q(dir)))
      for _, id in ipairs { "L1", "L2" } do
        local out, err, code = mprun(("-n 1 --log-dir %s/logs --run-id %s -e %s")
                                     :format(q(dir), id, q[[print("x")]]))
        assert.are.equal(2, code)
        assert.are.equal("", out)
        assert.matches("mprun: --log-dir: refusing " .. dir .. "/logs/" .. id, err, 1, true)
      end
      assert.are.equal("", H.sh("ls -A " .. q(elsewhere)))
      assert.are.equal("", H.sh("ls -A " .. q(dir .. "/logs/L2")))
    end)

    for _, id in ipairs { "../x", "..", ".hidden", "a/b", "", "-x", "/tmp/abs" } do
      it("refuses --run-id '" .. id .. "' (one safe path component only)", function()
        local out, err, code = mprun(("-n 1 --log-dir %s/logs --run-id %s -e %s")
                                     :format(q(dir), q(id), q[[print("x")]]))
        assert.are.equal(2, code)
        assert.are.equal("", out)
        assert.matches("--run-id must be one path component", err, 1, true)
        assert.is_nil(H.read(dir .. "/x"))
        assert.are.equal("", H.sh("ls -A " .. q(dir .. "/logs") .. " 2>/dev/null"))
      end)
    end

    it("says each failure and restart, keeps error.json and events.jsonl, names the log dir", function()
      local script = dir .. "/train.lua"
      H.write(script, [[
local function step()
  if os.getenv("RANK") == "2" and os.getenv("MP_RESTART_COUNT") ~= "2" then
    error("loss is NaN")
  end
end
print("rank " .. os.getenv("RANK"))
step()
]])
      local out, err, code = mprun(("-n 4 --max-restarts 2 --log-dir %s --tee --run-id R %s")
                                   :format(q(dir), q(script)))
      assert.are.equal(0, code, err)
      assert.is_true(#sorted_lines(out) >= 4)
      local lines = {}
      for l in err:gmatch("[^\n]+") do lines[#lines + 1] = l end
      local where = script .. ":3: loss is NaN"
      assert.are.same({
        "mprun: rank 2 failed (exit 1: " .. where .. "); restart 1 of 2 (group)",
        "mprun: rank 2 failed (exit 1: " .. where .. "); restart 2 of 2 (group)",
      }, { lines[1], lines[2] })
      assert.matches("^mprun: 4 ranks finished %(run id R, 2 restarts", lines[3])
      assert.are.equal("mprun: logs in " .. dir .. "/R/", lines[4])
      for k = 0, 1 do
        local rec = H.read(("%s/R/attempt_%d/2/error.json"):format(dir, k))
        assert.is_truthy(rec, "error.json of attempt " .. k)
        assert.matches('"exit_code":1', rec, 1, true)
        assert.matches('"attempt":' .. k, rec, 1, true)
        assert.matches('"message":"' .. where .. '"', rec, 1, true)
        assert.matches("in function 'step'", rec, 1, true)   -- the traceback
        assert.matches('"started":"%d+%-%d+%-%d+T', rec)
        assert.matches('"ended":"%d+%-%d+%-%d+T', rec)
      end
      assert.is_nil(H.read(dir .. "/R/attempt_2/2/error.json"))
      assert.is_nil(H.read(dir .. "/R/attempt_0/1/error.json"))
      local events = H.read(dir .. "/R/events.jsonl")
      assert.matches('^{"event":"run"', events)
      assert.are.equal(2, select(2, events:gsub('"event":"failed"', "")))
      assert.are.equal(2, select(2, events:gsub('"event":"restart"', "")))
      assert.matches('{"event":"end","restarts":2,"status":0,', events, 1, true)
    end)

    it("says a rank restart as such, and the last failure without one", function()
      local _, err, code = mprun(("-n 2 --restart rank --max-restarts 1 --log-dir %s --run-id Q -e %s")
        :format(q(dir), q[[if os.getenv("RANK") == "1" then os.exit(5) end]]))
      assert.are.equal(5, code)
      assert.matches("mprun: rank 1 failed (exit 5); restart 1 of 1 (rank)\n", err, 1, true)
      assert.matches("mprun: rank 1 failed (exit 5)\n", err, 1, true)
      assert.matches("mprun: logs in " .. dir .. "/Q/\n", err, 1, true)
      assert.is_truthy(H.read(dir .. "/Q/attempt_1/1/error.json"))
    end)

    it("restarts only the failed rank with --restart rank", function()
      local _, err, code = mprun(("-n 3 --restart rank --max-restarts 2 --log-dir %s "
        .. "--run-id P -e %s"):format(q(dir), q[[
          print(os.getenv("MP_RESTART_COUNT"))
          if os.getenv("RANK") == "1" and os.getenv("MP_RESTART_COUNT") ~= "2" then
            os.exit(4)
          end]]))
      assert.are.equal(0, code, err)
      assert.are.equal("0\n", H.read(dir .. "/P/attempt_0/0/stdout.log"))
      assert.are.equal("0\n", H.read(dir .. "/P/attempt_0/2/stdout.log"))
      assert.is_nil(H.read(dir .. "/P/attempt_1/0/stdout.log"))
      assert.is_nil(H.read(dir .. "/P/attempt_1/2/stdout.log"))
      for k = 0, 2 do
        assert.are.equal(k .. "\n", H.read(("%s/P/attempt_%d/1/stdout.log"):format(dir, k)))
      end
    end)
  end)

  describe("failures", function()
    it("summarises a Lua error with its traceback; exit status 1", function()
      local _, err, code = mprun("-n 3 --run-id E1 -e " .. q[[
        local function deep() error("disk full") end
        if os.getenv("RANK") == "2" then deep() end]])
      assert.are.equal(1, code)
      assert.matches("Root cause", err)
      assert.matches("run id E1", err, 1, true)
      assert.matches("attempt 0", err, 1, true)
      assert.matches("rank       : 2", err, 1, true)
      assert.matches("pid        : %d+", err)
      assert.matches("exit code  : 1", err, 1, true)
      assert.matches("time       : %d+%-%d+%-%d+", err)
      assert.matches("stack traceback:", err, 1, true)
      assert.matches("in function 'deep'", err, 1, true)
      assert.matches("disk full", err, 1, true)
    end)

    it("exits with the root cause's exit code", function()
      local _, err, code = mprun("-n 2 -e 'if os.getenv(\"RANK\") == \"1\" then os.exit(7) end'")
      assert.are.equal(7, code)
      assert.matches("exit code  : 7", err, 1, true)
    end)

    it("exits 128 + signal for a rank killed by SIGSEGV", function()
      -- (env -u: under make check-asan, ASan's handler would catch it in sh)
      local _, err, code = mprun("-n 2 -- env -u LD_PRELOAD sh -c '[ $RANK = 0 ] && kill -SEGV $$; exit 0'")
      assert.are.equal(139, code)
      assert.matches("SIGSEGV", err, 1, true)
    end)

    it("fails an attempt that runs over --timeout: 124, nothing left", function()
      local _, err, code = mprun("-n 2 --timeout 0.3 -e 'os.execute(\"sleep 5.62\")'")
      assert.are.equal(124, code)
      assert.matches("timeout", err, 1, true)
      assert.is_true(gone("^sleep 5%.62"))
    end)
  end)

  describe("signals", function()
    -- mprun in the background (where the shell ignores SIGINT for it:
    -- mprun takes it over), in a session of its own: a spec stops it, and
    -- a stopped process must not share the test runner's process group (an
    -- orphaned group with a stopped member is sent SIGHUP).  Returns its pid
    -- and a function that waits for its exit status and stderr.
    local RUNNER = [[
pidf=$1 statusf=$2; shift 2
setsid sh -c 'echo $$ > "$0"; exec "$@"' "$pidf" ./scripts/mprun "$@"
echo $? > "$statusf"
]]
    local function background(args)
      local runner, pidf, statusf = H.script(RUNNER, ""), os.tmpname(), os.tmpname()
      local errf = os.tmpname()
      os.execute(("sh %s %s %s %s >/dev/null 2>%s </dev/null &")
                 :format(runner, pidf, statusf, args, errf))
      local pid = H.wait_pids(pidf)[1]
      local function err_now() return H.read(errf) or "" end
      return pid, function()
        local st = H.eventually(function()
          local t = H.read(statusf)
          return t and t:match("^(%d+)\n") and t
        end, 60)
        local err = H.read(errf)
        for _, f in ipairs { runner, pidf, statusf, errf } do os.remove(f) end
        return tonumber(st), err
      end, err_now
    end

    -- Waits for n lines in 'marker' (each rank adds one); returns them.
    local function until_started(marker, n)
      return H.eventually(function()
        local lines = {}
        for l in (H.read(marker) or ""):gmatch("([^\n]*)\n") do lines[#lines + 1] = l end
        return #lines >= n and lines
      end, 20)
    end

    for _, case in ipairs { { "INT", 130 }, { "TERM", 143 }, { "HUP", 129 } } do
      it("SIG" .. case[1] .. " terminates every rank and exits " .. case[2], function()
        local marker = os.tmpname()
        local pid, status = background(("-n 2 -- sh -c %s"):format(
          q(("echo up >> %s; sleep 5.63"):format(marker))))
        assert.is_truthy(until_started(marker, 2))
        os.execute("kill -" .. case[1] .. " " .. pid)
        assert.are.equal(case[2], status())
        assert.is_true(gone("^sleep 5%.63"))
        os.remove(marker)
      end)
    end

    it("a second SIGINT kills at once, without the grace period", function()
      -- the ranks outlive SIGTERM (they note it and sleep on): only the
      -- second SIGINT, sent once both noted the first, can end them
      local marker = os.tmpname()
      local pid, status, err_now = background(("--grace-period 600 -n 2 -- sh -c %s"):format(
        q(("trap 'echo term >> %s' TERM; echo up >> %s; while :; do sleep 30.64; done")
          :format(marker, marker))))
      assert.is_truthy(until_started(marker, 2))
      os.execute("kill -INT " .. pid)
      assert.is_truthy(until_started(marker, 4))
      -- said at once, while the ranks still run
      local said = "mprun: SIGINT: sent SIGTERM to 2 ranks; SIGKILL in 600 s; Ctrl-C again to kill now\n"
      assert.is_truthy(H.eventually(function() return err_now():find(said, 1, true) end, 20),
                       err_now())
      os.execute("kill -INT " .. pid)
      local code, err = status()
      assert.are.equal(130, code)
      assert.are.equal(1, select(2, err:gsub("SIGKILL in 600 s", "")), err)
      assert.is_true(gone("^sleep 30%.64"))
      os.remove(marker)
    end)

    it("SIGKILLed, it leaves no rank and no rank's child", function()
      local marker = os.tmpname()
      local pid, status = background(("-n 3 -- sh -c %s"):format(
        q(("sleep 5.65 & echo $$ >> %s; wait"):format(marker))))
      local shells = until_started(marker, 3)
      assert.is_truthy(shells)
      os.execute("kill -KILL " .. pid)
      assert.are.equal(137, status())
      assert.is_true(gone("^sleep 5%.65"))
      for _, sh_pid in ipairs(shells) do
        assert.is_truthy(H.eventually(function() return not H.alive(sh_pid) end, 10))
      end
      assert.are.same({}, H.shm())
      os.remove(marker)
    end)

    it("lists the other failures below the root cause", function()
      -- mprun is stopped while both ranks fail, so it sees both at once
      local marker, go = os.tmpname(), os.tmpname()
      os.remove(go)
      local pid, status = background(("-n 2 -- sh -c %s"):format(q(
        ("echo $PPID >> %s; while [ ! -e %s ]; do sleep 0.05; done; exit $((RANK + 5))")
        :format(marker, go))))
      local workers = until_started(marker, 2)
      assert.is_truthy(workers)
      os.execute("kill -STOP " .. pid)
      assert.is_truthy(io.open(go, "w")):close()
      for _, w in ipairs(workers) do
        assert.is_truthy(H.eventually(function() return H.state(w) == "Z" end, 20))
      end
      os.execute("kill -CONT " .. pid)
      local code, err = status()
      assert.are.equal(5, code)
      assert.matches("Root cause.*rank       : 0.*exit code  : 5.*Other failures.*"
                     .. "rank       : 1.*exit code  : 6", err)
      os.remove(marker)
      os.remove(go)
    end)
  end)

  describe("usage", function()
    local marker
    before_each(function() marker = os.tmpname(); os.remove(marker) end)

    local bad = {
      { "an unknown option", "--frobnicate 1 -e 'X'" , "unknown option" },
      { "N < 1", "-n 0 -e 'X'", "-n/--nprocs" },
      { "N not a number", "-n many -e 'X'", "-n/--nprocs" },
      { "a missing script", "-n 2", "no script" },
      { "an unreadable script", "/nonexistent/script.lua", "cannot read the script" },
      { "--ranks out of range", "-n 2 --ranks 0,2 -e 'X'", "out of range" },
      { "a bad --restart", "--restart node -e 'X'", "--restart" },
      { "a bad --start-method", "--start-method thread -e 'X'", "--start-method" },
      { "a missing value", "-e", "needs a value" },
    }
    for _, case in ipairs(bad) do
      it("exits 2 and starts nothing on " .. case[1], function()
        local args = case[2]:gsub("X", ("io.open(%q, \"w\")"):format(marker))
        local out, err, code = mprun(args)
        assert.are.equal(2, code)
        assert.are.equal("", out)
        assert.matches(case[3], err, 1, true)
        assert.matches("mprun --help", err, 1, true)
        assert.is_nil(H.read(marker))
      end)
    end

    local before = {
      { "a shell script without --", "./prog.sh", 2, "to run a program, put it after '--': mprun -n 2 -- ./prog.sh" },
      { "a command without --", "echo hi", 2, "to run a program, put it after '--': mprun -n 2 -- echo hi" },
      { "a script that does not load", "bad.lua", 2, "the script does not load: bad.lua:1:" },
      { "a directory as the script", "adir", 2, "the script does not load: cannot read adir" },
      { "-e code that does not load", "-e 'x = = 1'", 2, "-e: the code does not load:" },
      { "a program not found", "-- no-such-program-4711", 127, "no-such-program-4711: command not found" },
      { "a program that is not executable", "-- ./bad.lua", 126, "./bad.lua: Permission denied" },
      { "--tee without --log-dir", "--tee -e 'x = 1'", 2, "--tee needs --log-dir" },
    }
    for _, case in ipairs(before) do
      it("checks before starting: " .. case[1] .. " -> one message, status " .. case[3], function()
        local dir = tmpdir()
        H.write(dir .. "/prog.sh", "#!/bin/sh\necho ran >> " .. marker .. "\n")
        os.execute("chmod +x " .. q(dir .. "/prog.sh") .. " && mkdir " .. q(dir .. "/adir"))
        H.write(dir .. "/bad.lua", "x = = 1\n")
        local out, err, code = sh(("cd %s && %s/scripts/mprun -n 2 %s"):format(
          q(dir), q(H.sh("pwd"):gsub("%s+$", "")), case[2]))
        os.execute("rm -rf " .. q(dir))
        assert.are.equal(case[3], code, err)
        assert.are.equal("", out)
        assert.matches(case[4], err, 1, true)
        local said = select(2, ("\n" .. err):gsub("\nmprun: ", ""))
        assert.is_true(said == 1 or (said == 2 and err:find("put it after", 1, true) ~= nil), err)
        assert.is_nil(H.read(marker))
      end)
    end

    it("--help documents every option", function()
      local out, _, code = mprun("--help")
      assert.are.equal(0, code)
      for _, opt in ipairs { "-n, --nprocs", "--start-method", "--max-restarts", "--restart",
                             "--grace-period", "--timeout", "--log-dir", "--tee", "--ranks",
                             "--no-prefix", "--quiet", "--run-id", "-e", "--" } do
        assert.matches(opt, out, 1, true)
      end
    end)
  end)

  describe("status line", function()
    local function pty(args)
      return sh("timeout -s KILL 120 script -q -e -c " .. q(MPRUN .. " " .. args) .. " /dev/null")
    end
    local SLOW = q[[for i = 1, 3 do print("line " .. i); os.execute("sleep 0.3") end]]

    it("is drawn on a terminal and erased before each output line", function()
      local out, _, code = pty("-n 2 -e " .. SLOW)
      assert.are.equal(0, code)
      assert.matches("\r[^\r\n]*%d running[^\r\n]*\27%[K", out)
      -- every output line starts on a clean line: after an erase or a newline
      for before in out:gmatch("(....)%[rank%d%]: line") do
        assert.is_truthy(before == "\r\27[K" or before:sub(-1) == "\n", before)
      end
      assert.is_falsy(out:find("running[^\r\n]*%[rank"), "a rank's line joined the status")
    end)

    it("counts down to SIGKILL after a Ctrl-C", function()
      local marker, out = os.tmpname(), os.tmpname()
      local cmd = MPRUN .. " --grace-period 601 -n 2 -- sh -c " .. q(
        ("trap '' TERM; echo up >> %s; while :; do sleep 30.65; done"):format(marker))
      os.execute(("timeout -s KILL 120 script -q -e -c %s %s >/dev/null 2>&1 </dev/null &"):format(q(cmd), q(out)))
      assert.is_truthy(H.eventually(function()
        return select(2, (H.read(marker) or ""):gsub("up", "")) >= 2
      end, 20))
      local mprun_pid = H.eventually(function()
        return matching("^lua5%.4 %./scripts/mprun %-%-grace%-period 601")[1]
      end, 20)
      assert.is_truthy(mprun_pid)
      os.execute("kill -INT " .. mprun_pid)
      local shown = H.eventually(function()
        local t = H.read(out) or ""
        return t:find("SIGINT: 2 running, SIGKILL in 60%d s") and t
      end, 20)
      os.execute("kill -INT " .. mprun_pid)
      assert.is_true(gone("^sleep 30%.65"))
      assert.is_truthy(H.eventually(function() return #matching("scripts/mprun %-%-grace%-period 601") == 0 end, 20))
      assert.is_truthy(shown, H.read(out))
      assert.matches("mprun: SIGINT: sent SIGTERM to 2 ranks; SIGKILL in 601 s; Ctrl-C again to kill now",
                     shown, 1, true)
      os.remove(marker)
      os.remove(out)
    end)

    it("is not drawn with --quiet or when stderr is not a terminal", function()
      local out = pty("-n 2 --quiet -e " .. SLOW)
      assert.is_falsy(out:find("running", 1, true))
      local _, err = mprun("-n 2 -e " .. SLOW)
      assert.is_falsy(err:find("running", 1, true))
      assert.is_falsy(err:find("\27[K", 1, true))
    end)
  end)

  it("has its C in multiprocessing.launcher, apart from the core", function()
    local core = require "multiprocessing.core"
    for _, name in ipairs { "_relay", "_rank_stdio", "_signalfd", "_ctx_signal", "_run_program",
                            "_pipe", "_makedirs", "_cpus", "_nofile", "_setenv" } do
      assert.is_nil(core[name], name)
    end
    local launcher = require "multiprocessing.launcher"
    for _, name in ipairs { "_relay", "_rank_stdio", "_signalfd", "_run_program", "_pipe",
                            "_subdir", "_create" } do
      assert.is_function(launcher[name], name)
    end
    assert.is_function(core.cpu_count)
  end)

  it("is installed by make install into $(PREFIX)/bin", function()
    local root = tmpdir()
    local out, err, code = sh(("make -s install PREFIX=%s"):format(q(root)))
    assert.are.equal(0, code, out .. err)
    out, err, code = sh(("cd / && %s/bin/mprun -n 2 -e %s"):format(q(root), q(
      [[print(package.searchpath("multiprocessing.mprun", package.path))]])))
    assert.are.equal(0, code, err)
    local want = ("%s/share/lua/5.4/multiprocessing/mprun.lua"):format(root)
    assert.are.same({ "[rank0]: " .. want, "[rank1]: " .. want }, sorted_lines(out))
    assert.is_truthy(H.read(root .. "/lib/lua/5.4/multiprocessing/launcher.so"))
    os.execute("rm -rf " .. q(root))
  end)
end)
