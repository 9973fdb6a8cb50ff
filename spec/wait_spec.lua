-- mp.wait over any mix of objects, and mp.as_completed, under every start
-- method; Ctrl-C in mp.wait at the REPL.
local mp = require "multiprocessing"
local H = require "helpers"

local function sleeper() os.execute("sleep 30") end

-- An object of the mp.wait protocol, as AsyncResult is: a descriptor, and
-- ready() which decides once it polls readable (and before the first sleep).
local function stub(fd, ready)
  local s = { asked = 0 }
  function s.fileno() return fd end
  function s.ready() s.asked = s.asked + 1 return ready end
  return s
end

for _, method in ipairs(H.methods) do
  describe("mp.wait under " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function proc(fn, args)
      local p = mp.Process(fn, args, { start_method = method })
      p:start()
      return p
    end

    local function context(fn)
      return mp.start_processes(fn, {}, 1, false, false, method)
    end

    it("returns, in the order given, exactly those of 64 mixed objects that are ready", function()
      local objects, expected, owned = {}, {}, {}
      local function add(o, ready)
        objects[#objects + 1] = o
        if ready then expected[#expected + 1] = o end
      end
      for i = 1, 8 do
        local done = i % 2 == 0
        local p = proc(done and function() end or sleeper)
        if done then assert.is_true(p:join()) end
        add(p, done)
        owned[#owned + 1] = p
        local ctx = context(done and function() end or sleeper)
        if done then assert.is_true(ctx:join()) end
        add(ctx, done)
        owned[#owned + 1] = ctx
        local h = context(done and function() end or sleeper)
        if done then assert.is_true(h:join()) end
        add(h.processes[1], done)    -- a worker's handle: its sentinel
        owned[#owned + 1] = h
        for _, make in ipairs { mp.Queue, mp.SimpleQueue, mp.JoinableQueue } do
          local q = make()
          if done then q:put(i) end
          add(q, done)
          owned[#owned + 1] = q
        end
        local r, w = mp.Pipe(false)
        if done then w:send(i) end
        add(r, done)
        owned[#owned + 1], owned[#owned + 2] = r, w
        local raw = mp.Queue()
        if done then raw:put(i) end
        add(raw:fileno(), done)        -- a bare descriptor
        owned[#owned + 1] = raw
      end
      assert.are.equal(64, #objects)
      local got = mp.wait(objects)
      assert.are.equal(#expected, #got)
      for k = 1, #expected do assert.are.equal(expected[k], got[k], "at " .. k) end
      assert.are.same(got, mp.wait(objects, 0), "nothing was taken")
      -- the same objects without the ready ones: nothing, at the timeout
      local idle = {}
      for _, o in ipairs(objects) do
        local ready = false
        for _, e in ipairs(expected) do ready = ready or e == o end
        if not ready then idle[#idle + 1] = o end
      end
      assert.are.same({}, mp.wait(idle, 0))
      assert.are.same({}, mp.wait(idle, 0.05))
      for _, o in ipairs(owned) do
        if o.sentinel and o.is_alive then o:kill() o:join() end  -- a Process
        o:close()
      end
    end)

    it("wakes for whichever comes: an item, a process ending, a message", function()
      local q, r, w = mp.Queue(), mp.Pipe(false)
      local gate, cue = mp.Queue(), mp.Queue()
      local p = proc(function(g) g:get() end, { gate })
      local speaker = proc(function(c, queue, conn)
        c:get()
        queue:put(1)
        c:get()
        conn:send(2)
      end, { cue, q, w })
      local objects = { p, q, r }
      assert.are.same({}, mp.wait(objects, 0))
      cue:put("queue")
      assert.are.same({ q }, mp.wait(objects))
      assert.are.equal(1, q:get())
      gate:put("end")
      assert.are.same({ p }, mp.wait(objects))
      cue:put("conn")
      assert.are.same({ r }, mp.wait({ q, r }))
      assert.are.same({ p, r }, mp.wait(objects))
      assert.are.equal(2, r:recv())
      assert.are.same({ speaker }, mp.wait({ speaker }))
      for _, x in ipairs { p, speaker } do
        assert.is_true(x:join())
        assert.is_nil(x:error())
        x:close()
      end
      for _, x in ipairs { q, r, w, gate, cue } do x:close() end
    end)

    it("asks ready() of an object before sleeping, and after its descriptor polls readable", function()
      local full, empty = mp.Queue(), mp.Queue()
      full:put(1)
      local no = stub(full:fileno(), false)      -- readable, yet not ready
      local yes = stub(empty:fileno(), true)     -- ready, descriptor quiet
      assert.are.same({ yes }, mp.wait({ no, yes }))
      assert.is_true(no.asked >= 1)
      assert.are.same({}, mp.wait({ no }, 0))
      full:close()
      empty:close()
    end)

    it("runs as_completed over results as they finish, and raises TimeoutError", function()
      local gate = mp.Queue()
      local quick = proc(function() return 1 end)
      local slow = proc(function(g) g:get() return 2 end, { gate })
      local seen = {}
      for p in mp.as_completed({ slow, quick, quick }) do
        seen[#seen + 1] = p
        if p == quick then gate:put("go") end
      end
      assert.are.same({ quick, slow }, seen)
      local stuck = proc(sleeper)
      local ok, e = pcall(function()
        for _ in mp.as_completed({ stuck }, 0.05) do error("not finished") end
      end)
      assert.is_false(ok)
      assert.is_true(mp.isinstance(e, mp.TimeoutError))
      assert.are.equal("timeout", e.kind)
      assert.are.equal("multiprocessing.as_completed", e.call)
      assert.truthy(tostring(e):find("1 (of 1) unfinished", 1, true), tostring(e))
      for _, p in ipairs { quick, slow, stuck } do p:kill() p:join() p:close() end
      gate:close()
    end)

    it("runs as_completed over pool:submit futures, one of them killed mid-run", function()
      local pool = mp.Pool(2, { start_method = method })
      local double = function(x) return x * 2 end
      local futures = {
        pool:submit(double, 1),
        pool:submit(function()
          os.execute("kill -KILL " .. require("multiprocessing").current_process().pid)
          os.execute("sleep 30")
        end),
        pool:submit(double, 3),
      }
      local values, failures = {}, {}
      for ar in mp.as_completed(futures, 120) do
        assert.is_true(ar:ready())
        local ok, v = pcall(ar.get, ar)
        if ok then values[#values + 1] = v else failures[#failures + 1] = v end
      end
      table.sort(values)
      assert.are.same({ 2, 6 }, values)
      assert.are.equal(1, #failures)
      assert.is_true(mp.isinstance(failures[1], mp.ProcessExitedException), tostring(failures[1]))
      assert.are.equal("SIGKILL", failures[1].signal_name)
      pool:close()
      pool:join()
    end)

    it("yields a cancelled future at once, the others as they finish", function()
      local pool = mp.Pool(1, { start_method = method })
      local gate = mp.Queue()
      local first = pool:submit(function(g) return g:get() end, gate)
      local later = pool:submit(function() return "later" end)
      local cancelled = pool:submit(function() return "never" end)
      assert.is_true(cancelled:cancel())
      local order = {}
      for ar in mp.as_completed({ first, later, cancelled }) do
        order[#order + 1] = ar
        if ar == cancelled then gate:put("first") end
      end
      assert.are.equal(cancelled, order[1])
      assert.is_true(cancelled:cancelled())
      assert.has_error(function() cancelled:get() end)
      assert.are.equal("first", first:get())
      assert.are.equal("later", later:get())
      pool:close()
      pool:join()
      gate:close()
    end)
  end)
end

describe("mp.wait", function()
  H.leak_check(before_each, after_each)

  it("raises for what it cannot wait on, naming the call and the object", function()
    local w = select(2, mp.Pipe(false))
    assert.has_error(function() mp.wait(3) end,
      "bad argument #1 to 'multiprocessing.wait' (table expected, got number)")
    assert.has_error(function() mp.wait({ "x" }) end,
      "bad argument #1 to 'multiprocessing.wait' (objects[1] is a string: a descriptor or "
      .. "an object with a fileno() method expected)")
    assert.has_error(function() mp.wait({ 1 }, "soon") end)
    local ok, err = pcall(mp.wait, { w })
    assert.is_false(ok)
    assert.truthy(err:find("objects[1]: ", 1, true), err)
    assert.has_error(function() mp.wait({ 999999 }, 0) end,
      "bad argument #1 to 'multiprocessing.wait' (objects[1]'s descriptor 999999 is not open)")
    assert.are.same({}, mp.wait({}, 0))
    w:close()
  end)

  it("sleeps in one poll(2): no busy loop", function()
    if os.execute("command -v strace >/dev/null") ~= true then
      error("strace is needed for this spec")
    end
    local out = os.tmpname()
    local script = H.script([[
      local mp = require "multiprocessing"
      local q = mp.Queue()
      local p = mp.Process(function() os.execute("sleep 30") end, {}, { start_method = "fork" })
      p:start()
      assert(#mp.wait({ q, p, q:fileno() }, 1.5) == 0)
      p:kill() p:join() p:close() q:close()
    ]])
    -- the parent's own calls only (no -f): its sleep is one poll
    os.execute(("strace -qq -e trace=poll,ppoll,epoll_wait,select,pselect6 -o %s lua5.4 %s"):format(out, script))
    local trace = H.read(out)
    os.remove(out)
    os.remove(script)
    local n = 0
    for _ in trace:gmatch("poll%(") do n = n + 1 end
    -- the sweep before sleeping, the sleep, and p:join's own
    assert.truthy(n >= 2 and n <= 4, trace)
  end)
end)

for _, method in ipairs(H.methods) do
  describe("lua5.4 -i with start method " .. method .. ":", function()
    it("Ctrl-C in mp.wait raises and returns to the prompt, the process untouched", function()
      local repl = H.repl({
        "mp = require 'multiprocessing'",
        ("p = mp.Process(function() os.execute('sleep 30') end, {}, {start_method = %q})"):format(method),
        "p:start() q = mp.Queue()",
        "announce({p.pid}) ok, e = pcall(mp.wait, {p, q})",
        "print('caught', ok, mp.isinstance(e, mp.Interrupted), e.kind, e.call)",
        "print('back at the prompt', p:is_alive())",
        "p:kill() p:join() print('killed', p.exitcode)",
      })
      local list = repl:pids()
      -- it blocks in poll(2) once the line has run that far
      local blocked = H.eventually(function()
        return (H.read("/proc/" .. list[1] .. "/wchan") or ""):find("poll") ~= nil
      end, 30)
      repl:kill("INT")
      local out = repl:wait()
      assert.is_true(blocked, out)
      assert.truthy(out:find("caught\tfalse\ttrue\tinterrupt\tmultiprocessing.wait", 1, true), out)
      assert.truthy(out:find("back at the prompt\ttrue", 1, true), out)
      assert.truthy(out:find("killed\t-9", 1, true), out)
      assert.is_false(H.alive(list[2]))
    end)
  end)
end
