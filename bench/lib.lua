-- bench/lib.lua -- shared by the Lua section scripts (lua_*.lua): paths, the
-- clock, JSON-line output, and turning an error into a one-line reason.
-- Run from the top of the tree (bench.sh does).
package.path = "./lua/?.lua;./lua/?/init.lua;./bench/?.lua;" .. package.path
package.cpath = "./build/?.so;./build/bench/?.so;" .. package.cpath

local M = {}

local bc = require "benchclock"   -- build/bench/benchclock.so (bench/benchclock.c)
M.now = bc.now
M.sleep = bc.sleep
M.fork_floor = bc.fork_floor

-- One line of an error value: a string, an exception object with .msg, or
-- anything tostring() can show.
function M.reason(e)
  if type(e) == "table" and e.msg ~= nil then e = e.msg end
  local s = tostring(e)
  s = s:match("^[^\n]*")
  if #s > 160 then s = s:sub(1, 157) .. "..." end
  return s
end

local function q(s)
  return '"' .. tostring(s):gsub('[%c"\\]', function(c)
    return string.format("\\u%04x", c:byte())
  end) .. '"'
end

local function num(x)
  if math.type(x) == "integer" then return tostring(x) end
  if x ~= x or x == math.huge or x == -math.huge then return "null" end
  return string.format("%.6f", x)
end

-- emit{bench=..., key=value..., samples={...}}: one JSON line on stdout.
-- Scalars only, plus arrays of numbers.
function M.emit(t)
  local keys = {}
  for k in pairs(t) do if k ~= "bench" then keys[#keys + 1] = k end end
  table.sort(keys)
  local parts = { '"bench":' .. q(t.bench) }
  for _, k in ipairs(keys) do
    local v, s = t[k], nil
    if type(v) == "table" then
      local a = {}
      for i, x in ipairs(v) do a[i] = num(x) end
      s = "[" .. table.concat(a, ",") .. "]"
    elseif type(v) == "number" then s = num(v)
    elseif type(v) == "boolean" then s = tostring(v)
    else s = q(v) end
    parts[#parts + 1] = q(k) .. ":" .. s
  end
  io.stdout:write("{", table.concat(parts, ","), "}\n")
  io.stdout:flush()
end

function M.skip(bench, why, extra)
  local t = { bench = bench, skip = M.reason(why) }
  for k, v in pairs(extra or {}) do t[k] = v end
  M.emit(t)
end

-- The library, or nil and why not.
function M.load_mp()
  local ok, mp = pcall(require, "multiprocessing")
  if not ok then return nil, "require multiprocessing: " .. M.reason(mp) end
  if type(mp.start_processes) ~= "function" then
    return nil, "multiprocessing.start_processes missing"
  end
  return mp
end

-- Live children of this process (zombies included), or nil when the kernel
-- does not show them; to check that a failed start_processes reaped all.
function M.children()
  local f = io.open("/proc/self/stat")
  if not f then return nil end
  local pid = f:read("l"):match("^(%d+)")
  f:close()
  local c = io.open("/proc/" .. pid .. "/task/" .. pid .. "/children")
  if not c then return nil end
  local s = c:read("a")
  c:close()
  local n = 0
  for _ in s:gmatch("%d+") do n = n + 1 end
  return n
end

return M
