--- multiprocessing.fifo: a first-in first-out list with explicit ends
-- (mp.Pool's job queue and its list of tasks to run again).  Items leave
-- from the head, so '#' and ipairs, which need a sequence without holes,
-- cannot count it.
local M = {}

function M.new() return { head = 1, tail = 0 } end

function M.push(f, v)
  local t = f.tail + 1
  f.tail, f[t] = t, v
end

function M.peek(f) return f[f.head] end

function M.pop(f)
  local h = f.head
  local v = f[h]
  if h < f.tail then f[h], f.head = nil, h + 1
  elseif h == f.tail then f[h], f.head, f.tail = nil, 1, 0 end  -- empty
  return v
end

function M.is_empty(f) return f.head > f.tail end

return M
