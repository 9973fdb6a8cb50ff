--- multiprocessing.poolcheck: the argument checks of mp.Pool (pool.lua),
-- made before anything is queued.  Every check names the public function
-- and the argument, and blames the caller's line through error()'s level.
local core = require "multiprocessing.core"

local M = {}

local pcall, type = pcall, type

-- 'level' is error()'s level as seen from the function that calls a check:
-- 2 (the default) blames its caller.
local function argerror(fname, i, msg, level)
  error(("bad argument #%d to '%s' (%s)"):format(i, fname, msg),
        (level or 2) + 1)
end

local function describe(v)
  return type(v) == "number" and tostring(v) or type(v)
end

local function check_type(fname, i, v, t, level)
  if type(v) ~= t then
    argerror(fname, i, ("%s expected, got %s"):format(t, type(v)),
             (level or 2) + 1)
  end
  return v
end

local function check_count(fname, i, v, what, level)
  if math.type(v) ~= "integer" or v < 1 then
    argerror(fname, i, ("%s must be a positive integer, got %s")
                       :format(what, describe(v)), (level or 2) + 1)
  end
  return v
end

local function check_seconds(fname, i, v, what, level)
  if v ~= nil and (type(v) ~= "number" or v ~= v or v < 0) then
    argerror(fname, i, ("%s must be a non-negative number of seconds, got %s")
                       :format(what, describe(v)), (level or 2) + 1)
  end
  return v
end

-- A wait's timeout, as everywhere in the library: nil for ever, a negative
-- number 0; NaN and non-numbers raise.
local function check_wait(fname, v)
  if v == nil then return nil end
  if type(v) ~= "number" or v ~= v then
    argerror(fname, 1, ("timeout must be a number of seconds, got %s")
                       :format(describe(v)), 3)
  end
  return v < 0 and 0 or v
end

local NO_OPTIONS = {}

local function check_options(fname, i, opts, known, level)
  level = (level or 2) + 1
  if opts == nil then return NO_OPTIONS end
  check_type(fname, i, opts, "table", level)
  for k in pairs(opts) do
    if not known[k] then
      argerror(fname, i, ("unknown option '%s'"):format(tostring(k)), level)
    end
  end
  return opts
end

-- Raises the codec's error, naming the path, when 'v' cannot be sent.
local function check_sendable(fname, name, v, level)
  local ok, err = pcall(core._check_sendable, v, name)
  if not ok then error(fname .. ": " .. tostring(err), (level or 2) + 1) end
end

M.argerror, M.describe, M.check_type = argerror, describe, check_type
M.check_count, M.check_seconds, M.check_wait = check_count, check_seconds,
                                               check_wait
M.check_options, M.check_sendable, M.NO_OPTIONS = check_options,
                                                  check_sendable, NO_OPTIONS

return M
