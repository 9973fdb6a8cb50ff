-- A real orchestration: index a source tree in parallel.
--
--   lua5.4 examples/pipeline.lua [directory] [workers] [start_method]
--
-- Stage 1 shards the files over N workers; each worker reads its shard and
-- returns, per file, its line count and its 10 most frequent identifiers.
-- Stage 2 merges the results in the parent.  Stage 3 shows failure handling:
-- one worker hits a file it cannot read, the group is taken down, and the
-- parent gets the worker's error and traceback as an exception object.

local mp = require "multiprocessing"

local root = arg[1] or "."
local nprocs = tonumber(arg[2]) or 4
local method = arg[3] or "spawn"

local function list_files(dir)
  local files = {}
  local find = io.popen("find " .. ("%q"):format(dir) ..
    " -type f \\( -name '*.lua' -o -name '*.c' -o -name '*.h' \\) -not -path '*/.git/*' | sort")
  for path in find:lines() do files[#files + 1] = path end
  find:close()
  return files
end

-- Runs in the workers: the files whose index is rank + 1 modulo nprocs.
local function index_shard(rank, files, n)
  local shard = {}
  for k = rank + 1, #files, n do
    local path = files[k]
    local f = assert(io.open(path, "rb"))
    local text = f:read("a")
    f:close()
    local words, lines = {}, 0
    for _ in text:gmatch("\n") do lines = lines + 1 end
    for word in text:gmatch("[%a_][%w_]*") do
      if #word > 3 then words[word] = (words[word] or 0) + 1 end
    end
    shard[path] = { lines = lines, bytes = #text, words = words }
  end
  return shard
end

local function merge(results)
  local total = { files = 0, lines = 0, bytes = 0, words = {} }
  for rank = 1, results.n do
    for _, info in pairs(results[rank]) do
      total.files = total.files + 1
      total.lines = total.lines + info.lines
      total.bytes = total.bytes + info.bytes
      for word, count in pairs(info.words) do
        total.words[word] = (total.words[word] or 0) + count
      end
    end
  end
  return total
end

local function top(words, n)
  local list = {}
  for word, count in pairs(words) do list[#list + 1] = { word, count } end
  table.sort(list, function(a, b) return a[2] > b[2] or (a[2] == b[2] and a[1] < b[1]) end)
  local out = {}
  for i = 1, math.min(n, #list) do out[i] = list[i][1] .. "=" .. list[i][2] end
  return table.concat(out, " ")
end

local files = list_files(root)
print(("indexing %d files under %s with %d %q workers"):format(#files, root, nprocs, method))

-- Stage 1 + 2: a parallel map, then a merge in the parent.
local t0 = os.clock()
local results = mp.start_processes(index_shard, { files, nprocs }, nprocs, true, false, method)
local total = merge(results)
print(("  %d files, %d lines, %d bytes"):format(total.files, total.lines, total.bytes))
print("  most frequent identifiers: " .. top(total.words, 8))
print(("  parent CPU time %.3f s"):format(os.clock() - t0))

-- Stage 3: a worker fails; the others are terminated and reaped, the parent
-- holds the failure as a ProcessRaisedException.
local broken = { table.unpack(files) }
broken[2] = root .. "/does-not-exist.lua"
local ok, e = pcall(mp.start_processes, index_shard, { broken, nprocs }, nprocs, true, false, method)
assert(not ok and mp.isinstance(e, mp.ProcessRaisedException), "stage 3 should fail")
print(("stage 3 failed as planned: worker %d (pid %d) raised:"):format(e.error_index, e.pid))
print("  " .. e.msg:match("[^\n]*$"))
print(("  %d other worker(s) failed on their own"):format(#e.failures))

-- join=false: a context we poll while the workers run, closed by <close>.
do
  local ctx <close> = mp.start_processes(function(rank)
    os.execute("sleep 0.2")
    return rank * rank
  end, {}, nprocs, false, false, method)
  local polls = 0
  while not ctx:join(0.05) do polls = polls + 1 end
  local squares = ctx:results()
  print(("join=false: %d polls before all %d workers finished; squares %s"):format(
    polls, squares.n, table.concat(squares, ",")))
end
-- Nothing is left: no child process of ours, zombie or alive.
local me = io.open("/proc/self/stat"):read("a"):match("^%d+")
local children = io.open(("/proc/%s/task/%s/children"):format(me, me)):read("a")
assert(children == "", "children left: " .. children)
print("done: every worker was reaped")
