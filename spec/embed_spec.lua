-- Embedding: a C host with two lua_States and a SIGCHLD handler that reaps
-- everything (stealing exit statuses), as careless engines do.
local H = require "helpers"


local host
setup(function()
  host = os.tmpname()
  local out = H.sh(("cc -std=c99 -D_GNU_SOURCE -o %s spec/host/embed_host.c " ..
                    "$(pkg-config --cflags --libs lua5.4) 2>&1"):format(host))
  assert(out == "", out)
end)
teardown(function() os.remove(host) end)

local function run_host(start, join)
  return H.sh(("%s %q %q 2>&1; echo rc=$?"):format(host, H.PATHS .. start, join))
end

for _, method in ipairs(H.methods) do
  describe("a host with two states and its own SIGCHLD reaper, " .. method .. ":", function()
    it("joins each state's workers with their own results", function()
      local out = run_host(([[
        mp = require "multiprocessing"
        ctx = mp.start_processes(function(i, s) return s * 10 + i end, { STATE }, 3, false, false, %q)
      ]]):format(method), [[
        assert(ctx:join(), "join")
        local r = ctx:results()
        print(("state %d: %d %d %d"):format(STATE, r[1], r[2], r[3]))
      ]])
      assert.are.equal("state 0: 0 1 2\nstate 1: 10 11 12\nrc=0\n", out)
    end)

    it("still reports the exit code the host's handler would steal", function()
      local out = run_host(([[
        mp = require "multiprocessing"
        local state = STATE
        ctx = mp.start_processes(function(i) if i == 1 then os.exit(40 + state) end end, {}, 2, false, false, %q)
      ]]):format(method), [[
        local ok, e = pcall(ctx.join, ctx)
        print(ok, e)
      ]])
      assert.are.equal("false\tprocess 1 terminated with exit code 40\n" ..
                       "false\tprocess 1 terminated with exit code 41\nrc=0\n", out)
    end)

    it("terminates workers still running when the state closes", function()
      local pidfile = os.tmpname()
      local out = run_host(([[
        mp = require "multiprocessing"
        ctx = mp.start_processes(function() os.execute("sleep 30") end, {}, 2, false, false, %q)
      ]]):format(method), ([[
        local f = io.open(%q, "a") f:write(table.concat(ctx:pids(), " "), " ") f:close()
      ]]):format(pidfile))
      assert.are.equal("rc=0\n", out)
      local n = 0
      for pid in H.read(pidfile):gmatch("%d+") do
        n = n + 1
        assert.is_false(H.alive(tonumber(pid)))
      end
      os.remove(pidfile)
      assert.are.equal(4, n)
    end)
  end)
end
