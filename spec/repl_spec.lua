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
