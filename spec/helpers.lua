-- Shared by the specs: what a test leaves behind, and small process tools.
local assert = require "luassert"

local H = {}

local function read(path)
  local f = io.open(path)
  if not f then return nil end
  local s = f:read("a")
  f:close()
  return s
end
H.read = read

--- This process's pid (the Lua interpreter running busted).
function H.pid()
  return tonumber(read("/proc/self/stat"):match("^(%d+)"))
end

--- The forkserver of start method "forkserver" is started on first use and
-- lives as long as the Lua state: its process and its two fds (the socket
-- and its pidfd) are not leaks, so children() and fds() leave them out.
-- Returns {pid=, fds={...}} while it runs, else nil.
function H.forkserver()
  local ok, core = pcall(require, "multiprocessing.core")
  return ok and core._forkserver_info and core._forkserver_info() or nil
end

--- Pids of our direct children (zombies included), the forkserver left out;
-- busted runs on one thread, whose id is the pid.
function H.children()
  local pid = H.pid()
  local server = H.forkserver()
  local out = {}
  for child in read(("/proc/%d/task/%d/children"):format(pid, pid)):gmatch("%d+") do
    if not (server and tonumber(child) == server.pid) then
      out[#out + 1] = tonumber(child)
    end
  end
  return out
end

--- The process state letter (R, S, Z, ...) of pid, or nil when it is gone.
function H.state(pid)
  local stat = read("/proc/" .. pid .. "/stat")
  return stat and stat:match("%) (%a)")
end

function H.alive(pid)
  local s = H.state(pid)
  return s ~= nil and s ~= "Z"
end

--- The lines a shell command prints (the pipe is closed, the shell reaped).
local function lines(cmd)
  local f = io.popen(cmd)
  local out = {}
  for line in f:lines() do out[#out + 1] = line end
  f:close()
  return out
end

--- The live processes of process group 'pgid' (a worker's group: the
-- worker and what it started).
function H.group(pgid)
  local members = {}
  for _, dir in ipairs(lines("ls /proc")) do
    local stat = dir:match("^%d+$") and read("/proc/" .. dir .. "/stat")
    local state, group
    -- after the command's ")": state, ppid, pgrp
    if stat then state, group = stat:match("%) (%a) %d+ (%d+)") end
    if group and tonumber(group) == tonumber(pgid) and state ~= "Z" then
      members[#members + 1] = tonumber(dir)
    end
  end
  return members
end

--- Our open fds, the forkserver's and the listing's own pipe left out: both
-- ends of that pipe, since popen may not have closed the write end here yet
-- when ls reads the directory.
function H.fds()
  local skip = {}
  for _, fd in ipairs((H.forkserver() or { fds = {} }).fds) do skip[fd] = true end
  local listing = lines(("readlink /proc/$$/fd/1; ls -l /proc/%d/fd"):format(H.pid()))
  local own = listing[1]
  local out = {}
  for i = 2, #listing do
    local fd, target = listing[i]:match("(%d+) %-> (.*)$")
    fd = tonumber(fd)
    if fd and target ~= own and not skip[fd] then out[#out + 1] = fd end
  end
  table.sort(out)
  return out
end

--- Entries in /dev/shm.
function H.shm()
  local out = {}
  for _, name in ipairs(lines("ls -a /dev/shm")) do
    if name ~= "." and name ~= ".." then out[#out + 1] = name end
  end
  table.sort(out)
  return out
end

--- A snapshot of what a spec may not leave behind; compare with H.check.
function H.snapshot()
  collectgarbage()
  collectgarbage()
  return { fds = H.fds(), shm = H.shm() }
end

--- Asserts nothing leaked since 'before': no child (zombie or not), no new
-- fd, no /dev/shm entry.
function H.check(before)
  collectgarbage()
  collectgarbage()
  assert.are.same({}, H.children(), "child processes left")
  assert.are.same(before.fds, H.fds(), "fds left open:\n" ..
                  H.sh("ls -l /proc/" .. H.pid() .. "/fd"))
  assert.are.same(before.shm, H.shm(), "/dev/shm entries left")
end

H.STRATEGIES = { "file_descriptor", "file_system" }

--- Checks every test of the enclosing describe for leaks: a snapshot before
-- it, H.check after.  busted's before_each and after_each are passed in
-- (they are not globals here).  With a strategy, the tests run under it;
-- the default strategy is back after every test either way.
function H.leak_check(before_each, after_each, strategy)
  local mp = require "multiprocessing"
  local before
  before_each(function()
    if strategy then mp.set_sharing_strategy(strategy) end
    before = H.snapshot()
  end)
  after_each(function()
    mp.set_sharing_strategy("file_descriptor")
    H.check(before)
  end)
end

--- Waits until pred() is true or 'seconds' pass; returns pred's last value.
function H.eventually(pred, seconds)
  local deadline = os.time() + (seconds or 5)
  repeat
    local v = pred()
    if v then return v end
    os.execute("sleep 0.02")
  until os.time() > deadline
  return pred()
end

--- The lines of 's', sorted: what parallel ranks print arrives in any order.
function H.sorted_lines(s)
  local t = {}
  for l in s:gmatch("([^\n]*)\n") do t[#t + 1] = l end
  table.sort(t)
  return t
end

--- Runs a shell command, returns its output.
function H.sh(cmd)
  local f = io.popen(cmd)
  local out = f:read("a")
  f:close()
  return out
end

--- A line of Lua that gives a child interpreter our package paths as they
-- are now; H.PATHS: as they were when the specs started.
function H.paths()
  return ("package.path = %q; package.cpath = %q\n"):format(package.path, package.cpath)
end
H.PATHS = H.paths()

--- Writes 'text' to the file 'path'.
function H.write(path, text)
  local f = assert(io.open(path, "w"))
  f:write(text)
  f:close()
end

--- Writes a Lua script for a child interpreter (by default our package
-- paths first) to a temporary file; returns the file's name.
function H.script(body, prelude)
  local name = os.tmpname()
  H.write(name, (prelude or H.PATHS) .. body)
  return name
end

--- Waits until a child script has written its pids to 'pidfile'; returns
-- them as numbers, in the order written.
function H.wait_pids(pidfile, seconds)
  local text = H.eventually(function()
    local s = H.read(pidfile)
    return s and #s > 0 and s
  end, seconds or 10)
  local pids = {}
  for pid in assert(text, "no pids written to " .. pidfile):gmatch("%d+") do
    pids[#pids + 1] = tonumber(pid)
  end
  return pids
end

-- What a child script finds before its body: our package paths, and
-- announce(pids), which makes the child's own pid and then 'pids' (a list,
-- say ctx:pids()) what child:pids() returns.  A global: at the REPL every
-- line is a chunk of its own.
local CHILD_PRELUDE = [[
function announce(pids)
  local f = assert(io.open(%q, "w"))
  f:write(io.open("/proc/self/stat"):read("a"):match("^%%d+"), " ",
          table.concat(pids or {}, " "))
  f:close()
end
]]

local Child = {}
Child.__index = Child

--- Runs 'body' as a Lua script in a child interpreter with our package
-- paths (H.paths()) and announce() (above) in scope.  opts (all optional):
--   command  how to run the script file, "%s" its name: "lua5.4 %s" by
--            default; "lua5.4 -i < %s" is the REPL fed through a pipe
--   stderr   false: dropped; else it comes with stdout
-- Returns a child handle:
--   child:pids()       waits for announce(); {own pid, announced...}
--   child:kill(sig)    signals the script's interpreter ("INT", "KILL")
--   child:wait()       its output and exit code, once it has ended; the
--                      script and pid files are removed
function H.run_child(body, opts)
  opts = opts or {}
  local pidfile = os.tmpname()
  local script = H.script(body, H.paths() .. CHILD_PRELUDE:format(pidfile))
  local redirect = opts.stderr == false and " 2>/dev/null" or " 2>&1"
  local command = (opts.command or "lua5.4 %s"):format(script)
  return setmetatable({
    pidfile = pidfile, script = script,
    pipe = io.popen("{ " .. command .. "; }" .. redirect),
  }, Child)
end

function Child:pids()
  self.announced = self.announced or H.wait_pids(self.pidfile)
  return self.announced
end

function Child:kill(sig)
  os.execute(("kill -%s %d"):format(sig, self:pids()[1]))
end

function Child:wait()
  local out = self.pipe:read("a")
  local _, _, code = self.pipe:close()
  os.remove(self.pidfile)
  os.remove(self.script)
  return out, code
end

--- The interactive interpreter (lua5.4 -i) fed 'typed' (a list of lines)
-- through a pipe, as a user at the prompt would type them, with our
-- package paths set first; a child handle as H.run_child's.
function H.repl(typed)
  return H.run_child(table.concat(typed, "\n") .. "\n",
                     { command = "lua5.4 -i < %s" })
end

--- The descriptors of process 'pid' as `ls -l` shows them ("" once it is
-- gone); listed into a file, not a pipe, which would be among them.
function H.fd_listing(pid)
  local out = os.tmpname()
  os.execute(("ls -l /proc/%d/fd > %s 2>/dev/null"):format(pid, out))
  local text = H.read(out) or ""
  os.remove(out)
  return text
end

--- The start methods every process spec runs under.
H.methods = { "fork", "spawn", "forkserver" }

return H
