-- Processes with different jobs: a producer, three transformers and a
-- writer, joined by queues; the parent reports each one as it ends.
--
--   lua5.4 examples/processes.lua [output file] [start_method]
--
-- The producer puts the numbers 1..N on the work queue, then one stop mark
-- per transformer; each transformer squares what it takes and passes it
-- on to the writer, which writes "n n^2" lines until every transformer has
-- said it is done.  The parent takes the processes in the order they end
-- (mp.as_completed, built on mp.wait) and checks the counts.
local mp = require "multiprocessing"

local out_path = arg[1] or os.tmpname()
local method = arg[2] or "spawn"
local N, TRANSFORMERS = 1000, 3

local function produce(work, n, stops)
  for i = 1, n do work:put(i) end
  for _ = 1, stops do work:put(false) end
  return n
end

local function transform(work, results)
  local taken = 0
  while true do
    local item = work:get()
    if item == false then break end
    results:put({ item, item * item })
    taken = taken + 1
  end
  results:put(false)            -- this transformer is done
  return taken
end

local function write(results, path, transformers)
  local f = assert(io.open(path, "w"))
  local done, lines = 0, 0
  while done < transformers do
    local r = results:get()
    if r == false then
      done = done + 1
    else
      f:write(r[1], " ", r[2], "\n")
      lines = lines + 1
    end
  end
  f:close()
  return lines
end

local work, results = mp.Queue(), mp.Queue()
local function job(fn, args, name)
  local p = mp.Process(fn, args, { name = name, start_method = method })
  p:start()
  return p
end

local all = { job(write, { results, out_path, TRANSFORMERS }, "writer") }
for i = 1, TRANSFORMERS do
  all[#all + 1] = job(transform, { work, results }, "transformer-" .. i)
end
all[#all + 1] = job(produce, { work, N, TRANSFORMERS }, "producer")

local taken, written = 0, nil
for p in mp.as_completed(all) do
  p:join()
  local e = p:error()
  if e then
    io.stderr:write(p.name, " failed: ", tostring(e), "\n")
    for _, q in ipairs(all) do q:kill() end
    os.exit(1)
  end
  print(("%-14s ended, exit code %d"):format(p.name, p.exitcode))
  if p.name:match("^transformer") then taken = taken + p:result() end
  if p == all[1] then written = p:result() end
end

print(("the transformers took %d items; the writer wrote %d lines to %s")
      :format(taken, written, out_path))
for _, p in ipairs(all) do p:close() end
work:close()
results:close()
assert(taken == N and written == N, "items were lost")
