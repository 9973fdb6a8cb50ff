-- The interactive interpreter: Ctrl-C during a join, then the prompt again.
local H = require "helpers"


for _, method in ipairs(H.methods) do
  describe("lua5.4 -i with start method " .. method .. ":", function()
    it("Ctrl-C in join terminates the workers and returns to the prompt", function()
      local pidfile = os.tmpname()
      local input = os.tmpname()
      local f = assert(io.open(input, "w"))
      f:write(H.PATHS,
        "mp = require 'multiprocessing'\n",
        ("ctx = mp.start_processes(function() os.execute('sleep 30') end, {}, 2, false, false, %q)\n"):format(method),
        ("f = io.open(%q, 'w') f:write(io.open('/proc/self/stat'):read('a'):match('^%%d+'), ' ', table.concat(ctx:pids(), ' ')) f:close()\n"):format(pidfile),
        "ctx:join()\n",
        "print('back at the prompt', ctx.processes[1].exitcode, ctx.processes[2].exitcode)\n")
      f:close()
      local repl = io.popen("lua5.4 -i < " .. input .. " 2>&1")
      local list = H.wait_pids(pidfile)
      -- the join has started once the workers exist; give it a moment to block
      os.execute("sleep 0.2; kill -INT " .. list[1])
      local out = repl:read("a")
      repl:close()
      os.remove(pidfile)
      os.remove(input)
      assert.truthy(out:find("interrupted", 1, true), out)
      assert.truthy(out:find("back at the prompt\t-15\t-15", 1, true), out)
      assert.is_false(H.alive(list[2]))
      assert.is_false(H.alive(list[3]))
    end)
  end)
end
