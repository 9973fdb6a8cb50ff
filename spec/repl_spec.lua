-- The interactive interpreter: Ctrl-C during a join, then the prompt again.
local H = require "helpers"

for _, method in ipairs(H.methods) do
  describe("lua5.4 -i with start method " .. method .. ":", function()
    it("Ctrl-C in join terminates the workers and returns to the prompt", function()
      local repl = H.repl({
        "mp = require 'multiprocessing'",
        ("ctx = mp.start_processes(function() os.execute('sleep 30') end, {}, 2, false, false, %q)"):format(method),
        "announce(ctx:pids())",
        "ctx:join()",
        "print('back at the prompt', ctx.processes[1].exitcode, ctx.processes[2].exitcode)",
      })
      local list = repl:pids()
      -- the join has started once the workers exist; give it a moment to block
      os.execute("sleep 0.2")
      repl:kill("INT")
      local out = repl:wait()
      assert.truthy(out:find("interrupted", 1, true), out)
      assert.truthy(out:find("back at the prompt\t-15\t-15", 1, true), out)
      assert.is_false(H.alive(list[2]))
      assert.is_false(H.alive(list[3]))
    end)
  end)
end

describe("lua5.4 -i: Ctrl-C in a channel or lock wait (issue 19 item 7):", function()
  -- The SIGINT is sent once the interpreter sleeps in the futex of the wait,
  -- so that it lands in the wait, not before it.
  local INT_IN_WAIT = "pid = io.open('/proc/self/stat'):read('a'):match('^%d+'); "
    .. "os.execute('(until grep -q futex /proc/' .. pid .. '/wchan; do sleep 0.05; done; "
    .. "kill -INT ' .. pid .. ') &'); "
  for call, line in pairs({
    ["Queue.get"] = "q:get()",
    ["Connection.recv"] = "a:recv()",
    ["Lock.acquire"] = "l:acquire(); l:acquire(60)",
  }) do
    it(call .. " prints the mp.Interrupted, then the next line runs", function()
      local repl = H.repl({
        "mp = require 'multiprocessing'; q = mp.Queue(); a, b = mp.Pipe(); l = mp.Lock()",
        "announce()",
        INT_IN_WAIT .. line,
        "print('back at the prompt', q:qsize(), a:poll(0))",
      })
      repl:pids()
      local out = repl:wait()
      assert.truthy(out:find("interrupted: SIGINT during " .. call .. "; ", 1, true), out)
      assert.truthy(out:find("back at the prompt\t0\tfalse", 1, true), out)
      assert.is_falsy(out:find("interrupted!", 1, true), out)
    end)
  end
end)
