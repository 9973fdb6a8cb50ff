-- Queue, SimpleQueue and Pipe: contracts, crossing processes, dead peers,
-- EINTR storms, descriptors that do not come.
local mp = require "multiprocessing"
local H = require "helpers"


-- A C helper compiled for the specs: a host with a SIGUSR1 handler (without
-- SA_RESTART, so every signal interrupts a blocking call with EINTR), and a
-- tiny module that writes raw bytes to an fd.
local host, rawmod
setup(function()
  local dir = os.tmpname()
  os.remove(dir)
  os.execute("mkdir -p " .. dir)
  local f = assert(io.open(dir .. "/host.c", "w"))
  f:write([[
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"
static volatile sig_atomic_t hits;
static void on_usr1(int s) { (void)s; hits++; }
static int l_hits(lua_State *L) { lua_pushinteger(L, hits); return 1; }
int main(int argc, char **argv) {
  struct sigaction sa;
  lua_State *L = luaL_newstate();
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_usr1;          /* no SA_RESTART: EINTR everywhere */
  sigaction(SIGUSR1, &sa, NULL);
  luaL_openlibs(L);
  lua_pushinteger(L, getpid()); lua_setglobal(L, "PID");
  lua_pushcfunction(L, l_hits); lua_setglobal(L, "HITS");
  if (argc < 2 || luaL_dofile(L, argv[1])) {
    fprintf(stderr, "%s\n", lua_tostring(L, -1)); lua_close(L); return 1;
  }
  lua_close(L);
  return 0;
}
]])
  f:close()
  f = assert(io.open(dir .. "/raw.c", "w"))
  f:write([[
#include <sys/socket.h>
#include "lua.h"
#include "lauxlib.h"
static int l_send(lua_State *L) {
  size_t n; const char *s = luaL_checklstring(L, 2, &n);
  lua_pushinteger(L, send((int)luaL_checkinteger(L, 1), s, n, MSG_NOSIGNAL));
  return 1;
}
int luaopen_raw(lua_State *L);
int luaopen_raw(lua_State *L) { lua_pushcfunction(L, l_send); return 1; }
]])
  f:close()
  host = dir .. "/host"
  rawmod = dir .. "/raw.so"
  local out = H.sh(("cc -std=c99 -D_GNU_SOURCE -o %s %s/host.c $(pkg-config --cflags --libs lua5.4) 2>&1 && " ..
                    "cc -std=c99 -shared -fPIC -o %s %s/raw.c $(pkg-config --cflags lua5.4) 2>&1")
                   :format(host, dir, rawmod, dir))
  assert(out == "", out)
end)
teardown(function()
  os.execute("rm -rf " .. host:match("^(.*)/host$"))
end)

describe("Queue in one process", function()
  H.leak_check(before_each, after_each)

  it("keeps order and values, nil included", function()
    local q <close> = mp.Queue()
    assert.is_true(q:empty())
    q:put(1); q:put("two"); q:put({ a = { 3 } }); q:put(nil); q:put(false)
    assert.are.equal(5, q:qsize())
    assert.are.equal(1, q:get())
    assert.are.equal("two", q:get())
    assert.are.equal(3, q:get().a[1])
    assert.are.equal(1, select("#", q:get()))   -- a received nil: one result
    assert.are.equal(false, q:get())
    assert.is_true(q:empty())
  end)

  it("tells a timeout from a received nil", function()
    local q <close> = mp.Queue()
    local t0 = mp.now and mp.now() or os.clock()
    local v, err = q:get(0.1)
    assert.is_nil(v)
    assert.are.equal("timeout", err)
    assert.are.same({ nil, "empty" }, { q:get_nowait() })
    q:put(nil)
    assert.are.same({ n = 1 }, table.pack(q:get(0.1)))
    assert.is_truthy(t0)
  end)

  it("bounds with maxsize: full, put timeout, put_nowait", function()
    local q <close> = mp.Queue(2)
    assert.is_true(q:put(1))
    assert.is_true(q:put(2))
    assert.is_true(q:full())
    assert.are.same({ nil, "full" }, { q:put_nowait(3) })
    assert.are.same({ nil, "timeout" }, { q:put(3, 0.05) })
    assert.are.equal(1, q:get())
    assert.is_true(q:put_nowait(3))
  end)

  it("rejects a bad timeout and use after close", function()
    local q = mp.Queue()
    local v, why = q:get(-1)        -- a negative timeout is 0
    assert.is_nil(v)
    assert.is_string(why)
    assert.matches("bad argument #1 to 'Queue.get' %(number of seconds expected, got string%)",
                   select(2, pcall(q.get, q, "soon")))
    q:close()
    assert.matches("closed Queue", select(2, pcall(q.put, q, 1)))
  end)

  it("SimpleQueue works the same", function()
    local q <close> = mp.SimpleQueue()
    q:put("x")
    assert.is_false(q:empty())
    assert.are.equal("x", q:get())
  end)

  it("refuses functions other than by module reference", function()
    local q <close> = mp.Queue()
    local up = {}
    assert.has_error(function() q:put(function() return up end) end)
  end)

  it("reports a message whose descriptors never came", function()
    local raw = assert(package.loadlib(rawmod, "luaopen_raw"))()
    local fds0 = H.fds()
    local q <close> = mp.Queue()
    local new = {}
    for _, fd in ipairs(H.fds()) do
      local old = false
      for _, o in ipairs(fds0) do old = old or o == fd end
      if not old then new[#new + 1] = fd end
    end
    -- memfd, the socket pair and the listing's own pipe: only the sending
    -- end of the socket pair takes the bytes
    local sent = 0
    for _, fd in ipairs(new) do
      if raw(fd, string.pack("<I4I4", 1, 1)) == 8 then sent = sent + 1 end  -- no SCM_RIGHTS
    end
    assert.are.equal(1, sent)
    local a <close> = mp.Array("int8", 1)
    q:put(a)
    local ok, err = pcall(q.get, q)
    assert.is_false(ok)
    assert.matches("without the descriptors", err)
    -- the queue goes on working
    q:put(a)
    local b <close> = q:get()
    assert.is_true(b:is_shared())
  end)
end)

for _, method in ipairs(H.methods) do
  describe("Queue and Pipe across processes, " .. method .. ":", function()
    H.leak_check(before_each, after_each)

    local function start(fn, args, n)
      return mp.start_processes(fn, args, n or 1, false, false, method)
    end

    it("carries values both ways", function()
      local q <close> = mp.Queue()
      local r <close> = mp.Queue()
      local ctx = start(function(_, qq, rr)
        while true do
          local v = qq:get()
          if v == "stop" then break end
          rr:put(v * 2)
        end
      end, { q, r })
      for k = 1, 100 do q:put(k) end
      q:put("stop")
      for k = 1, 100 do assert.are.equal(2 * k, r:get(10)) end
      assert.is_true(ctx:join(10))
    end)

    it("carries messages bigger than the ring, in chunks", function()
      local q <close> = mp.Queue(0, { capacity = 4096 })
      local big = string.rep("abcdefgh", 100000)
      local ctx = start(function(_, qq, s) qq:put(s); qq:put({ s = s }) end, { q, big })
      assert.are.equal(big, q:get(10))
      assert.are.equal(big, q:get(10).s)
      assert.is_true(ctx:join(10))
    end)

    it("does not deadlock when a worker exits with items queued", function()
      local q <close> = mp.Queue()
      local ctx = start(function(i, qq) for k = 1, 1000 do qq:put({ i, k }) end end, { q }, 2)
      assert.is_true(ctx:join(10))           -- joined before anything is read
      assert.are.equal(2000, q:qsize())
      for _ = 1, 2000 do q:get() end
    end)

    it("raises, naming the pid, for a reader whose writer died", function()
      local q <close> = mp.Queue()
      local ctx = start(function(_, qq)
        qq:put("one")
        os.execute("kill -9 " .. io.open("/proc/self/stat"):read("a"):match("^(%d+)"))
      end, { q })
      local pid = ctx:pids()[1]
      assert.are.equal("one", q:get(10))
      local ok, err = pcall(q.get, q)        -- no timeout: must not hang
      assert.is_false(ok)
      assert.matches("pid " .. pid, err)
      pcall(ctx.join, ctx)
    end)

    it("raises for a worker that dies without using the queue", function()
      local q <close> = mp.Queue()
      local ctx = start(function() os.exit(1) end, { q })
      local pid = ctx:pids()[1]
      -- needs the fork start method to attach inherited queues in the child
      -- (mp_sharing_attach on the arguments); spawn/forkserver decode them
      local ok, err = pcall(q.get, q, 5)
      assert.is_false(ok, "the worker's death went unnoticed")
      assert.matches("pid " .. pid, err)
      pcall(ctx.join, ctx)
    end)

    it("Pipe: send, recv, poll, close; EOF when the other end is gone", function()
      local a, b = mp.Pipe()
      local ctx = start(function(_, conn)
        conn:send(conn:recv() + 1)
        conn:send_bytes("raw")
      end, { b })
      b:close()                             -- as in Python: close the end given away
      assert.is_false(a:poll(0))
      a:send(41)
      assert.is_true(a:poll(10))
      assert.are.equal(42, a:recv())
      assert.are.equal("raw", a:recv_bytes())
      assert.is_true(ctx:join(10))
      local ok, err = pcall(a.recv, a)
      assert.is_false(ok)
      assert.matches("other end of the pipe is closed", err)
      a:close()
    end)

    it("Pipe(false): one end reads, the other writes", function()
      local r, w = mp.Pipe(false)
      local ctx = start(function(_, conn) conn:send("hi") end, { w })
      assert.are.equal("hi", r:recv(10))
      assert.matches("write%-only", select(2, pcall(w.recv, w)))
      assert.matches("read%-only", select(2, pcall(r.send, r, 1)))
      assert.is_true(ctx:join(10))
      r:close(); w:close()
    end)
  end)
end

describe("blocking calls under an EINTR storm (SIGUSR1 every ms)", function()
  it("get, recv, lock, event and semaphore waits are unaffected", function()
    local script = H.PATHS .. [[
      local mp = require "multiprocessing"
      local pidfile = os.tmpname()
      os.execute(("sh -c 'while kill -USR1 %d 2>/dev/null; do sleep 0.001; done' " ..
                  ">/dev/null 2>&1 & echo $! > %s"):format(PID, pidfile))
      local stormer = io.open(pidfile):read("n")
      os.remove(pidfile)
      local q, l, e, s = mp.Queue(), mp.Lock(), mp.Event(), mp.Semaphore(0)
      local a, b = mp.Pipe()
      l:acquire()
      local ctx = mp.start_processes(function(_, qq, lk, ev, sem, conn)
        os.execute("sleep 0.3"); qq:put("late")
        os.execute("sleep 0.3"); conn:send("later")
        os.execute("sleep 0.3"); ev:set()
        os.execute("sleep 0.3"); sem:release()
        lk:acquire(); lk:release()
      end, { q, l, e, s, b }, 1, false, false, "fork")
      assert(q:get() == "late")
      assert(a:recv() == "later")
      assert(e:wait() == true)
      assert(s:acquire() == true)
      local v, err = q:get(0.3)
      assert(v == nil and err == "timeout", "timeout honoured")
      l:release()
      assert(ctx:join(10))
      os.execute("kill " .. stormer)
      print("OK", HITS())
    ]]
    local file = os.tmpname()
    local f = assert(io.open(file, "w"))
    f:write(script)
    f:close()
    local out = H.sh(("%s %s 2>&1"):format(host, file))
    os.remove(file)
    local hits = tonumber(out:match("OK%s+(%d+)"))
    assert.is_truthy(hits, out)
    -- a shell forks a sleep per signal: slow machines (ASan) send fewer,
    -- but dozens of interrupted waits are a storm all the same
    assert.is_true(hits > 30, out)
  end)
end)
