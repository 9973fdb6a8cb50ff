-- Lock, RLock, Semaphore, Event, Barrier, Condition across processes; a
-- lock whose holder is SIGKILLed is recovered, not deadlocked.
local mp = require "multiprocessing"
local H = require "helpers"

local function suicide()
  os.execute("kill -9 " .. io.open("/proc/self/stat"):read("a"):match("^(%d+)"))
end

describe("synchronisation in one process", function()
  H.leak_check(before_each, after_each)

  it("Lock: acquire, timeout, release, locked, no recursion", function()
    local l <close> = mp.Lock()
    assert.is_false(l:locked())
    assert.are.same({ true }, { l:acquire() })
    assert.is_false(l.recovered)
    assert.is_true(l:locked())
    assert.matches("already held", select(2, pcall(l.acquire, l)))
    l:release()
    assert.matches("not held", select(2, pcall(l.release, l)))
    assert.is_true(l:acquire(0))
    l:release()
  end)

  it("RLock nests", function()
    local r <close> = mp.RLock()
    assert.is_true(r:acquire())
    assert.is_true(r:acquire())
    r:release(); r:release()
    assert.has_error(function() r:release() end)
  end)

  it("Semaphore, Event, Barrier(1), Condition", function()
    local s <close> = mp.Semaphore(1)
    assert.is_true(s:acquire())
    assert.is_false(s:acquire(0.02))
    s:release()
    assert.are.equal(1, s:get_value())
    local e <close> = mp.Event()
    assert.is_false(e:wait(0.02))
    e:set()
    assert.is_true(e:is_set() and e:wait())
    e:clear()
    assert.is_false(e:is_set())
    local b <close> = mp.Barrier(1)
    assert.are.equal(0, b:wait())
    assert.are.equal(1, b.parties)
    local c <close> = mp.Condition()
    c:acquire()
    assert.is_false(c:wait(0.02))
    c:release()
    assert.matches("not held", select(2, pcall(c.wait, c, 0)))
  end)

  it("a closed lock is released and refuses use", function()
    local l = mp.Lock()
    l:acquire()
    l:close()
    assert.matches("closed", select(2, pcall(l.acquire, l)))
  end)
end)

for _, method in ipairs(H.methods) do
  describe("synchronisation across processes, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("Lock makes increments atomic", function()
      local l <close> = mp.Lock()
      local v <close> = mp.Value("int64", 0)
      mp.start_processes(function(_, lk, val)
        for _ = 1, 2000 do
          lk:acquire()
          val.value = val.value + 1
          lk:release()
        end
      end, { l, v }, 2, true, false, method)
      assert.are.equal(4000, v.value)
    end)

    it("recovers a Lock whose holder was SIGKILLed", function()
      local l <close> = mp.Lock()
      local ctx = mp.start_processes(function(_, lk, die)
        lk:acquire()
        die()
      end, { l, suicide }, 1, false, false, method)
      assert.has_error(function() ctx:join(10) end)
      local ok, why = l:acquire(5)
      assert.is_true(ok)
      assert.are.equal("previous owner died", why)
      assert.is_true(l.recovered)
      l:release()
      assert.are.same({ true }, { l:acquire(1) })
      assert.is_false(l.recovered)
      l:release()
    end)

    it("Event, Semaphore and Barrier coordinate workers", function()
      local e <close> = mp.Event()
      local s <close> = mp.Semaphore(0)
      local b <close> = mp.Barrier(3)
      local ctx = mp.start_processes(function(_, ev, sem, bar)
        assert(ev:wait(10))
        sem:release()
        bar:wait(10)
      end, { e, s, b }, 2, false, false, method)
      e:set()
      assert.is_true(s:acquire(10))
      assert.is_true(s:acquire(10))
      b:wait(10)
      assert.is_true(ctx:join(10))
    end)

    it("Condition wakes a waiter", function()
      local c <close> = mp.Condition()
      local v <close> = mp.Value("int32", 0)
      local ctx = mp.start_processes(function(_, cv, val)
        cv:acquire()
        while val.value == 0 do cv:wait(10) end
        cv:release()
      end, { c, v }, 1, false, false, method)
      os.execute("sleep 0.1")
      c:acquire()
      v.value = 1
      c:notify_all()
      c:release()
      assert.is_true(ctx:join(10))
    end)
  end)
end

-- ---------------------------------------------------------------------
-- Issue 8: the defects first (each failed before), then the features, then
-- CPython's _TestLock, _TestSemaphore, _TestCondition, _TestEvent,
-- _TestBarrier, _TestValue and _TestArray translated to this API.

--- One more under the value's own lock (a synchronised Value's RLock).
local function inc(v)
  local g <close> = v:get_lock():guard()
  v.value = v.value + 1
end

describe("issue 8 defects, in one process:", function()
  H.leak_check(before_each, after_each)

  it("5: acquire(false) or with a timeout on a lock this process holds returns false", function()
    do
      local l <close> = mp.Lock()
      assert.is_true(l:acquire())
      assert.are.same({ false }, { l:acquire(false) })
      assert.are.same({ false }, { l:acquire(0) })
      assert.are.same({ false }, { l:acquire(0.01) })
      assert.are.same({ false }, { l:acquire(true, 0.01) })
      assert.are.same({ nil, "timeout" }, { l:guard(0.01) })
      -- an untimed acquire could never return: that still raises
      assert.matches("already held by this process", select(2, pcall(l.acquire, l)))
      l:release()
      assert.is_false(l:locked())
    end
  end)

  it("7: a negative timeout is 0 in every wait of sync.c", function()
    local l <close> = mp.Lock()
    l:acquire()
    assert.is_false(l:acquire(-1))
    assert.are.same({ nil, "timeout" }, { l:guard(-0.5) })
    l:release()
    local s <close> = mp.Semaphore(0)
    assert.is_false(s:acquire(-1))
    assert.is_false(s:acquire(true, -1))
    local e <close> = mp.Event()
    assert.is_false(e:wait(-1))
    local c <close> = mp.Condition()
    c:acquire()
    assert.is_false(c:wait(-1))
    assert.is_false(c:wait_for(function() return false end, -1))
    c:release()
    local b <close> = mp.Barrier(2)
    assert.are.same({ nil, "timeout" }, { b:wait(-1) })
    assert.is_true(b.broken)
    assert.matches("NaN", select(2, pcall(e.wait, e, 0 / 0)))
    assert.matches("number of seconds expected, got string",
                   select(2, pcall(e.wait, e, "1")))
  end)

  it("13: argument errors name Type.method and count as written", function()
    local l <close> = mp.Lock()
    local s <close> = mp.Semaphore(1)
    local e <close> = mp.Event()
    local b <close> = mp.Barrier(1)
    local c <close> = mp.Condition()
    local a <close> = mp.Array("int32", 3)
    local v <close> = mp.Value("int32", 0)
    local function err(f, ...) return select(2, pcall(f, ...)) end
    assert.matches("bad argument #1 to 'Lock.acquire' %(number of seconds expected, got string%)",
                   err(l.acquire, l, "x"))
    assert.matches("bad argument #2 to 'Lock.acquire'", err(l.acquire, l, true, "x"))
    assert.matches("calling 'Lock.acquire' on bad self", err(l.acquire, 5))
    assert.matches("bad argument #1 to 'Semaphore.release' %(number expected, got string%)",
                   err(s.release, s, "x"))
    assert.matches("bad argument #1 to 'Semaphore.release' %(must be a positive count%)",
                   err(s.release, s, 0))
    assert.matches("bad argument #1 to 'Event.wait'", err(e.wait, e, {}))
    assert.matches("bad argument #1 to 'Barrier.wait'", err(b.wait, b, "x"))
    assert.matches("bad argument #1 to 'Lock.guard'", err(l.guard, l, "x"))
    c:acquire()
    assert.matches("bad argument #1 to 'Condition.notify'", err(c.notify, c, "x"))
    assert.matches("bad argument #1 to 'Condition.wait_for' %(function expected",
                   err(c.wait_for, c, 5))
    c:release()
    assert.matches("bad argument #1 to 'Array.fill' %(expected an integer for int32, got string%)",
                   err(a.fill, a, "x"))
    assert.matches("bad argument #1 to 'Value.fill'", err(v.fill, v, {}))
    assert.matches("bad argument #1 to 'Array.copy' %(Array, string or table expected",
                   err(a.copy, a, true))
    assert.matches("bad argument #2 to 'Array.copy' %(destination index",
                   err(a.copy, a, {}, 9))
    assert.matches("bad argument #1", err(mp.Semaphore, -1))
    assert.matches("bad argument #1", err(mp.Barrier, 0))
    assert.matches("bad argument #2", err(mp.Barrier, 2, 5))
  end)
end)

describe("issue 8 features, in one process:", function()
  H.leak_check(before_each, after_each)

  it("guard: scoped locking for Lock, RLock, Semaphore, BoundedSemaphore, Condition", function()
    local function held(x)
      if x.locked then return x:locked() end
      return x:get_value() == 0
    end
    for _, make in ipairs { mp.Lock, mp.RLock, mp.Condition,
                            function() return mp.Semaphore(1) end,
                            function() return mp.BoundedSemaphore(1) end } do
      local x <close> = make()
      do
        local g <close> = x:guard()
        assert.is_true(held(x))
        assert.matches("multiprocessing.Guard", tostring(g))
      end
      assert.is_false(held(x))
      -- an error leaving the scope releases too
      assert.is_false(pcall(function()
        local g <close> = x:guard(5)
        error("boom")
      end))
      assert.is_false(held(x))
      -- release() early; closing again does nothing
      local g = x:guard()
      g:release()
      assert.is_false(held(x))
      g:release()
    end
  end)

  it("guard: a timed-out guard is nil, \"timeout\" and closing nil is fine", function()
    local s <close> = mp.Semaphore(0)
    local ran = false
    do
      local g <close>, why = s:guard(0.01)
      assert.is_nil(g)
      assert.are.equal("timeout", why)
      ran = true
    end
    assert.is_true(ran)
    assert.are.equal(0, s:get_value())
  end)

  it("guard: an RLock's guards nest", function()
    local r <close> = mp.RLock()
    local g1 <close> = r:guard()
    do
      local g2 <close> = r:guard(0)
      assert.is_truthy(g2)
    end
    assert.is_true(r:locked())
  end)

  it("local l <close> = lock closes the lock itself", function()
    local keep
    do
      local l <close> = mp.Lock()
      l:acquire()
      keep = l
    end
    assert.matches("closed", tostring(keep))
    assert.matches("closed", select(2, pcall(keep.acquire, keep)))
  end)

  it("BoundedSemaphore: release above the initial value raises; Semaphore's does not", function()
    local b <close> = mp.BoundedSemaphore(2)
    assert.is_true(b:acquire())
    b:release()
    assert.matches("BoundedSemaphore.release: released too many times",
                   select(2, pcall(b.release, b)))
    assert.are.equal(2, b:get_value())
    assert.is_true(b:acquire(0) and b:acquire(0))
    assert.is_false(b:acquire(0))
    assert.matches("released too many", select(2, pcall(b.release, b, 3)))
    b:release(2)
    local s <close> = mp.Semaphore(2)
    s:release()
    assert.are.equal(3, s:get_value())
  end)

  it("Condition: its lock nests, as Python's default RLock; wait releases every level", function()
    local c <close> = mp.Condition()
    assert.is_true(c:acquire())
    assert.is_true(c:acquire(false))
    assert.is_false(c:wait(0.01))
    assert.is_true(c:locked())
    c:release()
    assert.is_false(c:wait(0))
    c:release()
    assert.is_false(c:locked())
  end)

  it("Condition: notify and notify_all without the lock raise", function()
    local c <close> = mp.Condition()
    assert.matches("Condition.notify: the lock is not held", select(2, pcall(c.notify, c)))
    assert.matches("Condition.notify_all: the lock is not held", select(2, pcall(c.notify_all, c)))
    assert.matches("Condition.wait: the lock is not held", select(2, pcall(c.wait, c, 0)))
    c:acquire()
    c:notify()
    c:notify(3)
    c:notify_all()
    c:release()
  end)

  it("Condition:wait_for returns the predicate's result", function()
    local c <close> = mp.Condition()
    c:acquire()
    local calls = 0
    assert.are.equal(42, c:wait_for(function() calls = calls + 1; return 42 end))
    assert.are.equal(1, calls)
    assert.is_false(c:wait_for(function() return false end, 0.05))
    assert.is_nil(c:wait_for(function() return nil end, 0))
    assert.matches("boom", select(2, pcall(c.wait_for, c, function() error("boom") end)))
    assert.is_true(c:locked())
    c:release()
  end)

  it("Barrier(parties, action, timeout): action, default timeout, abort, reset", function()
    local runs = 0
    local b <close> = mp.Barrier(1, function() runs = runs + 1 end)
    assert.are.equal(0, b:wait())
    assert.are.equal(0, b:wait())
    assert.are.equal(2, runs)
    local t <close> = mp.Barrier(2, nil, 0.05)
    assert.are.equal(0.05, t.timeout)
    assert.are.same({ nil, "timeout" }, { t:wait() })
    assert.is_true(t.broken)
    assert.are.same({ nil, "broken" }, { t:wait(1) })
    t:reset()
    assert.is_false(t.broken)
    assert.are.equal(0, t.n_waiting)
    t:abort()
    assert.is_true(t.broken)
    assert.are.same({ nil, "broken" }, { t:wait(0) })
    -- an action that fails breaks the barrier and raises in its runner
    local f <close> = mp.Barrier(1, function() error("boom") end)
    assert.matches("boom", select(2, pcall(f.wait, f)))
    assert.is_true(f.broken)
  end)

  it("synchronised Value and Array: get_lock, get_obj, lock = false, a given lock", function()
    local v <close> = mp.Value("int32", 5)
    assert.matches("^multiprocessing.RLock", tostring(v:get_lock()))
    local o <close> = v:get_obj()
    o.value = 7
    assert.are.equal(7, v.value)
    assert.is_nil(o.get_lock)
    local raw <close> = mp.Value("int32", 5, { lock = false })
    assert.is_nil(raw.get_lock)
    assert.is_nil(raw.get_obj)
    assert.matches("attempt to call a nil value %(method 'get_lock'%)",
                   select(2, pcall(function() return raw:get_lock() end)))
    local l <close> = mp.Lock()
    local a <close> = mp.Array("int32", { 1, 2, 3 }, { lock = l })
    assert.are.equal(l, a:get_lock())
    -- the lock is held around each access: a Lock this process holds is
    -- not taken again (no self-deadlock)
    l:acquire()
    a[1] = 9
    assert.are.same({ 9, 2, 3 }, a:totable())
    l:release()
    assert.are.same({ 9, 2, 3 }, a:get_obj():totable())
    for _, bad in ipairs { "yes", 1, {}, mp.Semaphore } do
      assert.matches("lock must be true, false, a Lock or an RLock",
                     select(2, pcall(mp.Value, "int32", 0, { lock = bad })))
      assert.matches("lock must be true, false, a Lock or an RLock",
                     select(2, pcall(mp.Array, "int32", 2, { lock = bad })))
    end
    assert.matches("private", select(2, pcall(mp.Array, "int8", 2, { shared = false, lock = true })))
    local p <close> = mp.Array("int8", 2, { shared = false })
    assert.is_nil(p.get_lock)
    local r <close> = mp.RLock()
    local w <close> = mp.Value("double", 1.5, { lock = r })
    local g <close> = r:guard()
    w.value = w.value * 2           -- an RLock nests
    assert.are.equal(3.0, w.value)
  end)
end)

-- which process holds a lock is known without a getpid per call: from a
-- page the kernel zeroes in a fork's child (sys.h, mp_self_pid)
describe("a fork's copies of held locks", function()
  H.leak_check(before_each, after_each)

  it("hold nothing in the child, and the parent's hold is kept", function()
    local r <close> = mp.RLock()
    local q <close> = mp.Queue()
    local g = r:guard()
    local out = mp.start_processes(function()
      local held = r:locked()             -- by the parent
      local got = r:acquire(false)        -- not this process's to nest
      local ok, err = pcall(g.release, g) -- the copy gives nothing back
      q:put("from the child")
      return { held, got, ok, err }
    end, {}, 1, true, false, "fork")
    assert.are.same({ true, false, true }, out[1])
    assert.are.equal("from the child", q:get(5))
    assert.is_true(r:acquire(false))      -- ours: it nests
    r:release()
    g:release()
    assert.is_false(r:locked())
  end)
end)

describe("issue 8, through a queue:", function()
  H.leak_check(before_each, after_each)

  it("a synchronised Value keeps its lock; a Barrier's action needs a spawn", function()
    local q <close> = mp.Queue()
    local v <close> = mp.Value("int32", 3)
    q:put(v)
    q:put(v)
    local v2 <close> = q:get()
    local v3 <close> = q:get()
    assert.matches("^multiprocessing.RLock", tostring(v2:get_lock()))
    v2.value = 4
    assert.are.equal(4, v.value)
    do
      local g <close> = v2:get_lock():guard()
      assert.is_true(v3:get_lock():acquire(0))   -- the same RLock: it nests
      v3:get_lock():release()
    end
    local raw <close> = mp.Value("int32", 3, { lock = false })
    q:put(raw)
    local raw2 <close> = q:get()
    assert.is_nil(raw2.get_lock)
    local b <close> = mp.Barrier(2)
    q:put(b)
    local b2 <close> = q:get()
    assert.are.equal(2, b2.parties)
    local a <close> = mp.Barrier(2, function() end)
    assert.matches("cannot send Barrier action", select(2, pcall(q.put, q, a)))
  end)
end)

for _, method in ipairs(H.methods) do
  describe("issue 8 across processes, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    it("1: Condition:notify(n) wakes n waiters, not all", function()
      local c <close> = mp.Condition()
      local sleeping <close> = mp.Semaphore(0)
      local woken <close> = mp.Semaphore(0)
      local ctx = mp.start_processes(function(_, cv, sl, wk)
        cv:acquire()
        sl:release()
        assert(cv:wait(60), "not notified")
        wk:release()
        cv:release()
      end, { c, sleeping, woken }, 4, false, false, method)
      for _ = 1, 4 do assert.is_true(sleeping:acquire(60)) end
      -- holding the lock means every waiter is inside wait()
      c:acquire()
      assert.are.equal(0, woken:get_value())
      c:notify(1)
      c:release()
      assert.is_true(woken:acquire(60))
      os.execute("sleep 0.2")         -- room for a wrong wake-up to show
      assert.are.equal(0, woken:get_value())
      c:acquire(); c:notify(2); c:release()
      assert.is_true(woken:acquire(60) and woken:acquire(60))
      os.execute("sleep 0.2")
      assert.are.equal(0, woken:get_value())
      c:acquire(); c:notify(5); c:release()     -- only one is left
      assert.is_true(woken:acquire(60))
      c:acquire(); c:notify_all(); c:release()  -- nobody waits: nothing
      assert.is_true(ctx:join(60))
      assert.are.equal(0, woken:get_value())
    end)

    it("2: Barrier:reset() with parties waiting breaks each of them, then it works again", function()
      local b <close> = mp.Barrier(3)
      local q <close> = mp.Queue()
      local ctx = mp.start_processes(function(_, bar, qq)
        for _ = 1, 3 do
          qq:put({ bar:wait(60) })   -- broken by the parent's reset
          qq:put({ bar:wait(60) })   -- passes, with the parent
        end
      end, { b, q }, 2, false, false, method)
      for _ = 1, 3 do
        assert.is_truthy(H.eventually(function() return b.n_waiting == 2 end, 60))
        b:reset()
        assert.are.same({ nil, "broken" }, q:get(60))
        assert.are.same({ nil, "broken" }, q:get(60))
        assert.is_false(b.broken)
        local got = { b:wait(60), q:get(60)[1], q:get(60)[1] }
        table.sort(got)
        assert.are.same({ 0, 1, 2 }, got)
      end
      assert.is_true(ctx:join(60))
    end)

    it("Barrier action runs in exactly one process per trip", function()
      local runs <close> = mp.Value("int32", 0)
      local b
      -- an action that refers to its own barrier crosses too
      b = mp.Barrier(3, function() assert(b.parties == 3); inc(runs) end)
      mp.start_processes(function(_, bar)
        for _ = 1, 5 do assert(bar:wait(60)) end
      end, { b }, 3, true, false, method)
      assert.are.equal(5, runs.value)
      b:close()
    end)

    it("Barrier default timeout: the one party that came gets nil, \"timeout\"", function()
      local b <close> = mp.Barrier(2, nil, 0.1)
      local q <close> = mp.Queue()
      mp.start_processes(function(_, bar, qq) qq:put({ bar:wait() }) end,
                         { b, q }, 1, true, false, method)
      assert.are.same({ nil, "timeout" }, q:get(10))
      assert.is_true(b.broken)
    end)

    it("guard, synchronised Value and Array cross processes with their lock", function()
      local l <close> = mp.Lock()
      local v <close> = mp.Value("int64", 0)
      local a <close> = mp.Array("int64", 2, { lock = l })
      mp.start_processes(function(_, lk, val, arr)
        assert(arr:get_lock() == lk or tostring(arr:get_lock()):match("Lock"))
        for _ = 1, 500 do
          do
            local g <close> = lk:guard()
            arr[1] = arr[1] + 1
          end
          local g <close> = val:get_lock():guard()
          val.value = val.value + 1
        end
      end, { l, v, a }, 3, true, false, method)
      assert.are.equal(1500, v.value)
      assert.are.equal(1500, a[1])
    end)

    it("256 workers share one Lock and one Barrier", function()
      local n = 256
      local l <close> = mp.Lock()
      local b <close> = mp.Barrier(n)
      local v <close> = mp.Value("int64", 0, { lock = false })
      mp.start_processes(function(_, lk, bar, val)
        assert(bar:wait(300))
        for _ = 1, 4 do
          local g <close> = lk:guard()
          val.value = val.value + 1
        end
        assert(bar:wait(300))
      end, { l, b, v }, n, true, false, method)
      assert.are.equal(4 * n, v.value)
    end)
  end)
end

-- issue 19 item 9: a constructor given what it does not take raises
describe("sync constructors check their arguments", function()
  it("Lock, RLock and Event take none; the others say which argument", function()
    for _, name in ipairs({ "Lock", "RLock", "Event" }) do
      local ok, e = pcall(mp[name], true)
      assert.is_false(ok)
      assert.matches("bad argument #1 to '[%w.]*" .. name .. "' %(no argument expected, got boolean%)", e)
    end
    assert.matches("bad argument #1 to '[%w.]*Semaphore' %(number expected", select(2, pcall(mp.Semaphore, "x")))
    assert.matches("bad argument #1 to '[%w.]*Barrier' %(must be a positive count%)", select(2, pcall(mp.Barrier, 0)))
    for _, name in ipairs({ "current_process", "active_children", "get_sharing_strategy",
                            "get_all_sharing_strategies", "get_executable", "get_start_method" }) do
      local ok, e = pcall(mp[name], 1)
      assert.is_false(ok)
      assert.matches("bad argument #1 to '[%w.]*" .. name .. "' %(no argument expected, got number%)", e)
    end
  end)
end)

describe("Ctrl-C in a wait inside a pcall arrives once, as an mp.Interrupted (issues 8.6, 19.7)", function()
  -- Each case runs in a child lua5.4 (whose lua.c turns SIGINT into a hook):
  -- pcall catches the interrupt; the hook must not raise 'interrupted!'
  -- again at the next instruction.  The SIGINT comes from a helper started
  -- inside the pcall, so that one arriving early is caught by it too.
  -- call = { setup, what the message says became of the object }
  local cases = {
    ["Event.wait"] = { [[local e = mp.Event()
      return function() return e:wait(60) end]], "the event was left as it was" },
    ["Condition.wait"] = { [[local c = mp.Condition(); c:acquire()
      return function() return c:wait(60) end, function() c:release() end]],
      "the lock is held again" },
    ["Condition.wait_for"] = { [[local c = mp.Condition(); c:acquire()
      return function() return c:wait_for(function() end, 60) end,
             function() c:release() end]], "the lock is held again" },
    ["Semaphore.acquire"] = { [[local s = mp.Semaphore(0)
      return function() return s:acquire(60) end]], "no unit was taken" },
    ["Barrier.wait"] = { [[local b = mp.Barrier(2)
      return function() return b:wait(60) end,
             function() assert(b.broken) end]], "the barrier is broken" },
    ["Lock.acquire"] = { [[local l, e = mp.Lock(), mp.Event()
      local ctx = mp.start_processes(function(_, lk, ev)
        lk:acquire(); ev:wait(60)
      end, { l, e }, 1, false, false, "fork")
      while not l:locked() do end
      return function() return l:acquire(60) end,
             function() e:set(); assert(ctx:join(60)) end]],
      "the lock was not acquired" },
    -- the channels' waits: the same exception, and what it says is true
    ["Queue.get"] = { [[local q = mp.Queue()
      return function() return q:get(60) end,
             function() q:put(7); assert(q:get(0) == 7) end]], "nothing was taken" },
    ["Queue.put"] = { [[local q = mp.Queue(1); q:put(1)
      return function() return q:put(2, 60) end,
             function() assert(q:qsize() == 1 and q:get(0) == 1 and q:get(0) == nil) end]],
      "nothing was put" },
    ["JoinableQueue.join"] = { [[local q = mp.JoinableQueue(); q:put(1)
      return function() return q:join(60) end,
             function() assert(q:get(0) == 1); q:task_done(); assert(q:join(0)) end]],
      "the queue was left as it was" },
    ["Connection.recv"] = { [[local a, b = mp.Pipe()
      return function() return a:recv(60) end,
             function() b:send(1); assert(a:recv(0) == 1) end]], "nothing was received" },
    -- bigger than the ring: interrupted mid-message, taken back whole
    ["Connection.send"] = { [[local a, b = mp.Pipe(true, { capacity = 4096 })
      return function() return a:send(string.rep("x", 100000)) end,
             function() assert(not b:poll(0)); a:send("next"); assert(b:recv(0) == "next") end]],
      "nothing was sent" },
  }
  for name, case in pairs(cases) do
    local setup, done = case[1], case[2]
    it(name, function()
      local out = os.tmpname()
      local script = H.script(([[
        local mp = require "multiprocessing"
        local pid = io.open("/proc/self/stat"):read("a"):match("^(%%d+)")
        local wait, after = (function() %s end)()
        local ok, err = pcall(function()
          os.execute("(sleep 0.3; kill -INT " .. pid .. ") &")
          return wait()
        end)
        print("caught", ok, err)
        print("object", mp.isinstance(err, mp.Interrupted),
              mp.isinstance(err, mp.ProcessException), err.kind, err.signal,
              err.call, err.where)
        local x = 0
        for i = 1, 100000 do x = x + i end   -- a second interrupt would come here
        if after then after(err) end
        print("survived", x)
      ]]):format(setup))
      local ok = os.execute("lua5.4 " .. script .. " > " .. out .. " 2>&1")
      local text = H.read(out)
      os.remove(out)
      os.remove(script)
      assert.is_true(ok, text)
      -- one shape for every call: the call, then what became of the object
      assert.truthy(text:find("caught\tfalse\tinterrupted: SIGINT during "
                              .. name .. "; " .. done .. "\n", 1, true), text)
      -- an mp.Interrupted (not a ProcessException) whose position is the
      -- user's line that called the wait, not the library's
      assert.truthy(text:find("object\ttrue\tfalse\tinterrupt\tSIGINT\t"
                              .. name .. "\t" .. script .. ":", 1, true), text)
      assert.matches("survived\t5000050000", text)
    end)
  end

  it("in the REPL: the prompt's next line runs", function()
    local input = os.tmpname()
    local f = assert(io.open(input, "w"))
    f:write(H.PATHS,
      "mp = require 'multiprocessing'; e = mp.Event()\n",
      "pid = io.open('/proc/self/stat'):read('a'):match('^%d+')\n",
      "print('got', pcall(function() os.execute('(sleep 0.3; kill -INT ' .. pid .. ') &'); ",
      "return e:wait(60) end)); print('same line runs')\n",
      "print('next line runs')\n")
    f:close()
    local repl = io.popen("lua5.4 -i < " .. input .. " 2>&1")
    local out = repl:read("a")
    repl:close()
    os.remove(input)
    assert.matches("got\tfalse\t[^\n]*interrupted", out)
    assert.truthy(out:find("same line runs", 1, true), out)
    assert.truthy(out:find("next line runs", 1, true), out)
    assert.is_falsy(out:find("interrupted!", 1, true), out)
  end)
end)

-- ---------------------------------------------------------------------
-- CPython's Lib/test/_test_multiprocessing.py, translated: Python's
-- BrokenBarrierError is nil, "broken" (nil, "timeout" for the party whose
-- own timeout broke the barrier); list counters are synchronised Values;
-- time.sleep(...)-then-act becomes waiting for the state to be reached.

describe("CPython _TestLock, _TestSemaphore, _TestEvent, _TestValue, _TestArray (one process):", function()
  H.leak_check(before_each, after_each)

  it("test_lock, test_rlock, test_lock_context", function()
    local lock <close> = mp.Lock()
    assert.is_true(lock:acquire())
    assert.is_false(lock:acquire(false))
    assert.are.same({}, { lock:release() })
    assert.has_error(function() lock:release() end)
    local r <close> = mp.RLock()
    for _ = 1, 3 do assert.is_true(r:acquire()) end
    for _ = 1, 3 do assert.are.same({}, { r:release() }) end
    assert.has_error(function() r:release() end)
    do local g <close> = lock:guard() end
    assert.is_false(lock:locked())
  end)

  local function semaphore_steps(sem)
    assert.are.equal(2, sem:get_value())
    assert.is_true(sem:acquire())
    assert.are.equal(1, sem:get_value())
    assert.is_true(sem:acquire())
    assert.are.equal(0, sem:get_value())
    assert.is_false(sem:acquire(false))
    assert.are.equal(0, sem:get_value())
    assert.are.same({}, { sem:release() })
    assert.are.equal(1, sem:get_value())
    sem:release()
    assert.are.equal(2, sem:get_value())
  end

  it("test_semaphore, test_bounded_semaphore, test_timeout", function()
    local sem <close> = mp.Semaphore(2)
    semaphore_steps(sem)
    sem:release()
    assert.are.equal(3, sem:get_value())
    sem:release()
    assert.are.equal(4, sem:get_value())
    local b <close> = mp.BoundedSemaphore(2)
    semaphore_steps(b)
    assert.has_error(function() b:release() end)
    assert.are.equal(2, b:get_value())
    local z <close> = mp.Semaphore(0)
    assert.is_false(z:acquire(false))
    assert.is_false(z:acquire(false, nil))
    assert.is_false(z:acquire(false, 0.1))
    assert.is_false(z:acquire(true, 0.1))
    assert.is_false(z:acquire(0.1))
  end)

  it("test_getobj_getlock (Value) and test_getobj_getlock_obj (Array)", function()
    for _, make in ipairs {
      function(opts) return mp.Value("int32", 5, opts) end,
      function(opts) return mp.Array("int32", { 0, 1, 2, 3 }, opts) end,
    } do
      local x1 <close> = make()
      assert.is_truthy(x1:get_lock())
      assert.is_truthy(x1:get_obj())
      local x2 <close> = make({ lock = nil })
      assert.is_truthy(x2:get_lock() and x2:get_obj())
      local lock <close> = mp.Lock()
      local x3 <close> = make({ lock = lock })
      assert.are.equal(lock, x3:get_lock())
      assert.is_truthy(x3:get_obj())
      local x4 <close> = make({ lock = false })
      assert.is_nil(x4.get_lock)
      assert.is_nil(x4.get_obj)
      assert.has_error(function() make({ lock = "notalock" }) end)
    end
  end)

  it("test_array_from_size: new arrays are zeroed", function()
    for _ = 1, 3 do
      local arr <close> = mp.Array("i", 10)
      assert.are.equal(10, #arr)
      assert.are.same({ 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }, arr:totable())
      arr:copy({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 })
      assert.are.same({ 0, 1, 2, 3, 4, 5, 6, 7, 8, 9 }, arr:totable())
    end
  end)
end)

for _, method in ipairs(H.methods) do
  describe("CPython _TestCondition, _TestEvent, _TestBarrier, _TestValue, _TestArray, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function run(fn, args, n)
      return mp.start_processes(fn, args, n, false, false, method)
    end

    it("_TestCondition.test_notify: one of two sleepers", function()
      local cond <close> = mp.Condition()
      local sleeping <close> = mp.Semaphore(0)
      local woken <close> = mp.Semaphore(0)
      local ctx = run(function(_, c, s, w)
        local g <close> = c:guard()
        s:release()
        c:wait()
        w:release()
      end, { cond, sleeping, woken }, 2)
      assert.is_true(sleeping:acquire(60) and sleeping:acquire(60))
      do local g <close> = cond:guard(); cond:notify() end
      assert.is_true(woken:acquire(60))
      os.execute("sleep 0.2")
      assert.are.equal(0, woken:get_value())
      do local g <close> = cond:guard(); cond:notify() end
      assert.is_true(woken:acquire(60))
      assert.is_true(ctx:join(60))
    end)

    it("_TestCondition.test_notify_all: timed-out sleepers do not take notifications", function()
      local cond <close> = mp.Condition()
      local sleeping <close> = mp.Semaphore(0)
      local woken <close> = mp.Semaphore(0)
      local timedout <close> = mp.Semaphore(0)
      -- ranks 0-2 wait 0.05 s (and time out: nobody notifies yet), 3-5 wait
      local ctx = run(function(i, c, s, w, t)
        local g <close> = c:guard()
        s:release()
        if i < 3 then
          if not c:wait(0.05) then t:release() end
        else
          c:wait()
          w:release()
        end
      end, { cond, sleeping, woken, timedout }, 6)
      for _ = 1, 6 do assert.is_true(sleeping:acquire(60)) end
      for _ = 1, 3 do assert.is_true(timedout:acquire(60)) end
      assert.are.equal(0, woken:get_value())
      do local g <close> = cond:guard(); cond:notify_all() end
      for _ = 1, 3 do assert.is_true(woken:acquire(60)) end
      assert.is_true(ctx:join(60))
    end)

    it("_TestCondition.test_waitfor", function()
      local cond <close> = mp.Condition()
      local state <close> = mp.Value("i", -1)
      local ctx = run(function(_, c, st)
        local g <close> = c:guard()
        st.value = 0
        c:notify()
        local result = c:wait_for(function() return st.value == 4 end)
        assert(result and st.value == 4)
      end, { cond, state }, 1)
      do
        local g <close> = cond:guard()
        assert.is_true(cond:wait_for(function() return state.value == 0 end, 60))
        assert.are.equal(0, state.value)
      end
      for _ = 1, 4 do
        local g <close> = cond:guard()
        state.value = state.value + 1
        cond:notify()
      end
      assert.is_true(ctx:join(60))
    end)

    it("_TestCondition.test_waitfor_timeout", function()
      local cond <close> = mp.Condition()
      local state <close> = mp.Value("i", 0)
      local success <close> = mp.Value("i", 0)
      local sem <close> = mp.Semaphore(0)
      local ctx = run(function(_, c, st, ok, s)
        s:release()
        local g <close> = c:guard()
        if not c:wait_for(function() return st.value == 4 end, 0.1) then
          ok.value = 1
        end
      end, { cond, state, success, sem }, 1)
      assert.is_true(sem:acquire(60))
      for _ = 1, 4 do            -- notified, but never true in time
        local g <close> = cond:guard()
        cond:notify()
      end
      assert.is_true(ctx:join(60))
      assert.are.equal(1, success.value)
    end)

    it("_TestCondition.test_wait_result", function()
      local c <close> = mp.Condition()
      local g <close> = c:guard()
      assert.is_false(c:wait(0))
      assert.is_false(c:wait(0.1))
      local ctx = run(function(_, cv)
        local h <close> = cv:guard()
        cv:notify()
      end, { c }, 1)
      assert.is_true(c:wait(60))
      assert.is_true(ctx:join(60))
    end)

    it("_TestEvent.test_event", function()
      local event <close> = mp.Event()
      assert.is_false(event:is_set())
      assert.is_false(event:wait(0))
      assert.is_false(event:wait(0.1))
      event:set()
      assert.is_true(event:is_set())
      assert.is_true(event:wait())
      assert.is_true(event:wait(0.1))
      event:clear()
      assert.is_false(event:is_set())
      local ctx = run(function(_, e) e:set() end, { event }, 1)
      assert.is_true(event:wait())
      assert.is_true(ctx:join(60))
    end)

    it("_TestValue.test_value and _TestArray.test_array", function()
      local codes = { { "i", 4343, 24234 }, { "d", 3.625, -4.25 },
                      { "h", -232, 234 }, { "q", 2 ^ 33 // 1, 2 ^ 34 // 1 },
                      { "c", "x", "y" } }
      for _, raw in ipairs { false, true } do
        local values = {}
        for k, c in ipairs(codes) do
          values[k] = mp.Value(c[1], c[2], { lock = not raw })
          assert.are.equal(c[2], values[k].value)
        end
        local seq = { 680, 626, 934, 821, 150, 233, 548, 982, 714, 831 }
        local arr <close> = mp.Array("i", seq, { lock = not raw })
        assert.are.equal(#seq, #arr)
        assert.are.equal(seq[4], arr[4])
        arr:copy({ 1, 2, 3, 4 }, 5)
        seq[5], seq[6], seq[7], seq[8] = 1, 2, 3, 4
        assert.are.same(seq, arr:totable())
        for k = 2, #seq do seq[k] = seq[k] + seq[k - 1] end
        run(function(_, vals, cs, a)
          for k, c in ipairs(cs) do vals[k].value = c[3] end
          for k = 2, #a do a[k] = a[k] + a[k - 1] end
        end, { values, codes, arr }, 1):join(60)
        for k, c in ipairs(codes) do
          assert.are.equal(c[3], values[k].value)
          values[k]:close()
        end
        assert.are.same(seq, arr:totable())
      end
    end)

    local N = 4

    --- Runs f(barrier-args...) in N workers and joins them.
    local function run_parties(fn, args)
      assert.is_true(run(fn, args, N):join(120))
    end

    it("_TestBarrier.test_barrier, test_wait_return, test_single_thread", function()
      local b <close> = mp.Barrier(N)
      local q <close> = mp.Queue()
      run_parties(function(_, bar, qq)
        for pass = 1, 3 do qq:put({ pass, bar:wait(60) }) end
      end, { b, q })
      local zeros, seen = 0, {}
      for _ = 1, 3 * N do
        local r = q:get(10)
        seen[r[1]] = (seen[r[1]] or 0) + 1
        if r[2] == 0 then zeros = zeros + 1 end
      end
      assert.are.same({ N, N, N }, seen)
      assert.are.equal(3, zeros)
      local one <close> = mp.Barrier(1)
      for _ = 1, 3 do assert.are.equal(0, one:wait()) end
    end)

    it("_TestBarrier.test_action", function()
      local results <close> = mp.Value("i", 0)
      local b <close> = mp.Barrier(N, function() inc(results) end)
      run_parties(function(_, bar) bar:wait(60) end, { b })
      assert.are.equal(1, results.value)
    end)

    it("_TestBarrier.test_abort", function()
      local b <close> = mp.Barrier(N)
      local r1 <close> = mp.Value("i", 0)
      local r2 <close> = mp.Value("i", 0)
      run_parties(function(_, bar, res1, res2)
        local i = bar:wait(60)
        if i == N // 2 then
          bar:abort()                   -- the "RuntimeError" party
        elseif bar:wait(60) then
          inc(res1)
        else
          inc(res2)
        end
      end, { b, r1, r2 })
      assert.are.equal(0, r1.value)
      assert.are.equal(N - 1, r2.value)
      assert.is_true(b.broken)
    end)

    it("_TestBarrier.test_reset", function()
      local b <close> = mp.Barrier(N)
      local r1 <close> = mp.Value("i", 0)
      local r2 <close> = mp.Value("i", 0)
      local r3 <close> = mp.Value("i", 0)
      run_parties(function(_, bar, res1, res2, res3)
        local i = bar:wait(60)
        if i == N // 2 then
          while bar.n_waiting < N - 1 do os.execute("sleep 0.001") end
          bar:reset()
        elseif bar:wait(60) then
          inc(res1)
        else
          inc(res2)
        end
        assert(bar:wait(60))            -- and pass it again
        inc(res3)
      end, { b, r1, r2, r3 })
      assert.are.same({ 0, N - 1, N }, { r1.value, r2.value, r3.value })
    end)

    it("_TestBarrier.test_abort_and_reset", function()
      local b <close> = mp.Barrier(N)
      local b2 <close> = mp.Barrier(N)
      local r1 <close> = mp.Value("i", 0)
      local r2 <close> = mp.Value("i", 0)
      local r3 <close> = mp.Value("i", 0)
      run_parties(function(_, bar, bar2, res1, res2, res3)
        local i = bar:wait(60)
        if i == N // 2 then
          bar:abort()
        elseif bar:wait(60) then
          inc(res1)
        else
          inc(res2)
        end
        -- everyone has left it before the reset, nobody enters before
        if bar2:wait(60) == N // 2 then bar:reset() end
        assert(bar2:wait(60))
        assert(bar:wait(60))
        inc(res3)
      end, { b, b2, r1, r2, r3 })
      assert.are.same({ 0, N - 1, N }, { r1.value, r2.value, r3.value })
    end)

    it("_TestBarrier.test_timeout and test_default_timeout", function()
      for _, default in ipairs { false, true } do
        local b <close> = mp.Barrier(N, nil, default and 0.2 or nil)
        local results <close> = mp.Value("i", 0)
        run_parties(function(_, bar, res, dflt)
          local i = bar:wait(60)
          -- one party is late: it comes once the others' timeout broke it
          if i == N // 2 then
            while not bar.broken do os.execute("sleep 0.01") end
          end
          local ok, why
          if dflt then ok, why = bar:wait() else ok, why = bar:wait(0.2) end
          if not ok and (why == "broken" or why == "timeout") then inc(res) end
        end, { b, results, default })
        assert.are.equal(N, results.value)
      end
    end)
  end)
end
