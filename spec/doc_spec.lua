-- The API reference (doc/api.md) and the man page cover every public name:
-- the module's, and the methods of every object it makes.
local H = require "helpers"
local mp = require "multiprocessing"

local doc = assert(H.read("doc/api.md"))
local man = assert(H.read("doc/multiprocessing.3"))

local function documented(pattern)
  return doc:find(pattern, 1, true) ~= nil
end

--- Is mp.<name> written in the reference as a whole name (not the start of
-- a longer one: mp.Process is not documented by mp.ProcessContext)?
local function documented_field(name)
  return doc:find("%f[%w_./]mp%." .. name:gsub("%p", "%%%0") .. "%f[^%w_]") ~= nil
end

--- The names written as mp.<name> in a text (a path such as src/mp.h or a
-- longer name such as torch.mp.spawn is not one).
local function fields_named(text)
  local names = {}
  for name in text:gmatch("%f[%w_./]mp%.([%a_][%w_]*)") do names[name] = true end
  return names
end

-- The receivers the docs use for the objects the module makes (ctx, pool,
-- q, ...), and the methods written on them: obj:name(
local RECEIVERS = { ctx = true, p = true, pool = true, ar = true, a = true, v = true, q = true, c = true,
                    l = true, s = true, e = true, b = true, lock = true, g = true }
local function methods_named(text)
  local names = {}
  for recv, name in text:gmatch("%f[%w_]([%a_][%w_]*):([%a_][%w_]*)%(") do
    if RECEIVERS[recv] then names[name] = recv .. ":" .. name end
  end
  return names
end

--- The public methods of an object: its metatable's method table.
local function methods(obj)
  local mt = getmetatable(obj)
  local t = type(mt.__methods) == "table" and mt.__methods or mt.__index
  local names = {}
  for name in pairs(type(t) == "table" and t or {}) do
    -- "_" starts metamethods and internal entries: not public names
    if name:sub(1, 1) ~= "_" then names[#names + 1] = name end
  end
  table.sort(names)
  return names
end

describe("the API reference", function()
  H.leak_check(before_each, after_each)

  it("names every public field of the module", function()
    local missing = {}
    for name in pairs(mp) do
      if not documented_field(name) then missing[#missing + 1] = name end
    end
    table.sort(missing)
    assert.are.same({}, missing)
  end)

  it("names only fields the module has (the reference, the README, the man page)", function()
    local quiet = {}
    mp.set_warning_handler(function(msg) quiet[#quiet + 1] = msg end)  -- mp.SpawnContext warns
    local missing = {}
    for _, file in ipairs { "doc/api.md", "README.md", "doc/multiprocessing.3" } do
      for name in pairs(fields_named(H.read(file))) do
        if mp[name] == nil then missing[#missing + 1] = file .. ": mp." .. name end
      end
    end
    mp.set_warning_handler(nil)
    table.sort(missing)
    assert.are.same({}, missing)
  end)

  --- One object of every kind the module makes; a function that closes them.
  local function objects()
    local a, b = mp.Pipe()
    local ctx = mp.start_processes(function() end, {}, 1, false, false, "fork")
    local proc = mp.Process(function() end, {}, { start_method = "fork" })
    local pool = mp.Pool(1, { start_method = "fork" })
    local async = pool:apply_async(function() return 1 end)
    assert.are.equal(1, async:get(30))
    local lock = mp.Lock()
    local all = {
      Queue = mp.Queue(), SimpleQueue = mp.SimpleQueue(), JoinableQueue = mp.JoinableQueue(),
      Array = mp.Array("int", 2),
      Value = mp.Value("int", 0), Lock = lock, RLock = mp.RLock(), Semaphore = mp.Semaphore(1),
      Event = mp.Event(), Barrier = mp.Barrier(1), Condition = mp.Condition(), Connection = a,
      ProcessContext = ctx, ["ProcessContext.processes[i]"] = ctx.processes[1], Process = proc,
      Pool = pool, AsyncResult = async, Guard = lock:guard(),
    }
    return all, function()
      all.Guard:release()
      assert.is_true(ctx:join())
      all.Pool, all.AsyncResult, all.Guard = nil, nil, nil
      pool:close()
      pool:join()
      proc:close()
      all.Process = nil
      for _, obj in pairs(all) do if obj.close then obj:close() end end
      b:close()
    end
  end

  it("names every method of every object", function()
    local all, close = objects()
    local missing = {}
    for kind, obj in pairs(all) do
      for _, name in ipairs(methods(obj)) do
        if not documented(":" .. name .. "(") then missing[#missing + 1] = kind .. ":" .. name end
      end
    end
    close()
    table.sort(missing)
    assert.are.same({}, missing)
  end)

  it("names only methods some object has (the reference, the README)", function()
    local all, close = objects()
    local have = {}
    for _, obj in pairs(all) do
      for _, name in ipairs(methods(obj)) do have[name] = true end
    end
    close()
    local missing = {}
    for _, file in ipairs { "doc/api.md", "README.md" } do
      for name, written in pairs(methods_named(H.read(file))) do
        if not have[name] then missing[#missing + 1] = file .. ": " .. written end
      end
    end
    table.sort(missing)
    assert.are.same({}, missing)
  end)

  it("documents the C entry, and the man page points to it all", function()
    for _, name in ipairs { "lmp_worker_main", "lmp_worker_status", "LMP_VERSION" } do
      assert.is_true(documented(name), name)
      assert.truthy(H.read("src/multiprocessing.h"):find(name, 1, true), name)
    end
    for _, name in ipairs { "lmp_worker_main", "start_processes", "fileno", "set_executable" } do
      assert.truthy(man:find(name, 1, true), name)
    end
  end)

  it("has the version in one place, which the rockspec and CHANGELOG follow", function()
    local v = mp._VERSION
    assert.matches("^%d+%.%d+%.%d+$", v)
    assert.truthy(H.read("src/multiprocessing.h"):find('#define LMP_VERSION "' .. v .. '"', 1, true))
    assert.is_truthy(H.read("lua-multiprocessing-" .. v .. "-1.rockspec"), "rockspec for " .. v)
    assert.truthy(H.read("CHANGELOG.md"):find("## " .. v, 1, true), "CHANGELOG entry for " .. v)
    assert.truthy(H.read("LICENSE"):find("MIT License", 1, true))
  end)
end)

-- README: how to run from a checkout comes first, and every ```lua block is a
-- program that runs as pasted (except the ones marked <!-- fragment -->).
local ROOT = H.sh("pwd"):gsub("%s+$", "")
local BUILD = os.getenv("LUA_MP_BUILD") or "build"
if BUILD:sub(1, 1) ~= "/" then BUILD = ROOT .. "/" .. BUILD end

--- The fenced blocks of 'lang' in a Markdown text, in order: {line =, code =,
-- fragment =, heading =}; a block indented in a list loses its indent.
local function blocks(text, lang)
  local lines, out, heading = {}, {}, nil
  for line in (text .. "\n"):gmatch("([^\n]*)\n") do lines[#lines + 1] = line end
  local i = 1
  while i <= #lines do
    heading = lines[i]:match("^#+%s+(.*)$") or heading
    local indent = lines[i]:match("^(%s*)```" .. lang .. "%s*$")
    if indent then
      local prev = i - 1
      while prev > 0 and lines[prev]:match("^%s*$") do prev = prev - 1 end
      local body, j = {}, i + 1
      while j <= #lines and not lines[j]:match("^%s*```%s*$") do
        local l = lines[j]
        body[#body + 1] = l:sub(1, #indent) == indent and l:sub(#indent + 1) or l
        j = j + 1
      end
      out[#out + 1] = {
        line = i, heading = heading, code = table.concat(body, "\n") .. "\n",
        fragment = prev > 0 and lines[prev]:match("^%s*<!%-%-%s*fragment%s*%-%->%s*$") ~= nil,
      }
      i = j + 1
    else
      i = i + 1
    end
  end
  return out
end

--- Processes whose environment holds 'token' (a variable only what a run
-- started has, its descendants included), with their command lines.
local function carrying(token)
  local found = {}
  for pid in H.sh("ls /proc"):gmatch("(%d+)\n") do
    local env = H.read("/proc/" .. pid .. "/environ")
    if env and ("\0" .. env):find("\0" .. token .. "\0", 1, true) and H.alive(pid) then
      found[#found + 1] = pid .. " " .. (H.read("/proc/" .. pid .. "/cmdline") or ""):gsub("%z", " ")
    end
  end
  return found
end

--- Runs a shell command with a token in its environment, in 'dir'; returns
-- its exit status and output, after checking that nothing it started
-- outlives it (asynchronous exits, such as a tracker's, get a few seconds).
local function run_marked(dir, command, scratch, nosan)
  local token = "MP_DOC_RUN=" .. scratch
  H.write(scratch .. "/run.sh", command)
  local status = H.sh(("cd '%s' && env %s-u MAKEFLAGS -u MAKELEVEL -u MFLAGS %s sh -e '%s/run.sh' "
                       .. "</dev/null >'%s/out' 2>&1; echo $?"):format(dir, nosan and "-u LD_PRELOAD -u LUA_MP_BUILD " or "",
                                                                      token, scratch, scratch))
  local out = H.read(scratch .. "/out") or ""
  local left = H.eventually(function() return #carrying(token) == 0 end, 10) or carrying(token)
  assert.is_true(left == true, "processes left behind:\n" .. table.concat(left == true and {} or left, "\n"))
  return tonumber(status), out
end

describe("README", function()
  H.leak_check(before_each, after_each)
  local readme = assert(H.read("README.md"))
  local dir
  before_each(function() dir = H.sh("mktemp -d /tmp/mpdoc.XXXXXX"):gsub("%s+$", "") end)
  after_each(function() H.sh("rm -rf '" .. dir .. "'") end)

  it("starts with how to run from this checkout, and those commands work", function()
    local first = readme:find("\n## ", 1, true)
    assert.are.equal(first, readme:find("\n## Run it from this checkout\n", 1, true),
                     "the first section is how to run from a checkout")
    local run
    for _, b in ipairs(blocks(readme, "sh")) do
      if b.heading == "Run it from this checkout" then run = b break end
    end
    assert.truthy(run, "a sh block under Run it from this checkout")
    assert.matches('export LUA_PATH="$PWD/lua/?.lua;$PWD/lua/?/init.lua;;"', run.code, 1, true)
    -- the plain build, as a new user runs it: without the sanitizer's preload
    -- of make check-asan (the compiler, a C++ program, aborts under it)
    local status, out = run_marked(ROOT, run.code, dir, true)
    assert.are.equal(0, status, out)
    assert.truthy(out:find("\n" .. mp._VERSION .. "\n", 1, true) or out:find("^" .. mp._VERSION .. "\n"), out)
    assert.truthy(out:find("[rank0]: 0\n", 1, true), out)
    assert.truthy(out:find("[rank1]: 1\n", 1, true), out)
    -- the two commands of the project stay as they are
    assert.truthy(readme:find("sh scripts/install-deps.sh && make example\n", 1, true))
    assert.truthy(readme:find("sh scripts/install-deps.sh && make check\n", 1, true))
  end)

  local examples = blocks(readme, "lua")
  it("has Lua examples, a few of them fragments at most", function()
    local runnable = 0
    for _, b in ipairs(examples) do if not b.fragment then runnable = runnable + 1 end end
    assert.is_true(runnable >= 4 and runnable > #examples - runnable, #examples .. " blocks")
  end)

  for _, b in ipairs(examples) do
    if not b.fragment then
      it(("example at README.md:%d (%s) runs as pasted, in an empty directory"):format(b.line, b.heading),
         function()
        H.sh("mkdir '" .. dir .. "/cwd'")
        H.write(dir .. "/cwd/example.lua", b.code)
        local status, out = run_marked(dir .. "/cwd", ("LUA_PATH='%s' LUA_CPATH='%s' lua5.4 example.lua\n"):format(
          ROOT .. "/lua/?.lua;" .. ROOT .. "/lua/?/init.lua;;", BUILD .. "/?.so;;"), dir)
        assert.are.equal(0, status, "README.md:" .. b.line .. ":\n" .. out)
      end)
    end
  end
end)

-- The man pages render cleanly (groff warns about nothing) and say what the
-- commands and the module have.
describe("the man pages", function()
  -- groff and man run without the sanitizer's preload (make check-asan), under
  -- which troff, a C++ program, aborts on its own allocations.
  local NOSAN = "env -u LD_PRELOAD "
  --- The page as text: no hyphenation, long lines, no overstrikes.
  local function render(page)
    return H.sh((NOSAN .. "groff -man -Tutf8 -P-cbou -rHY=0 -rLL=300n %s 2>&1"):format(page))
  end
  local function warnings(page)
    return H.sh((NOSAN .. "groff -man -Tutf8 -ww -z %s 2>&1; MANWIDTH=80 " .. NOSAN .. "man -l %s 2>&1 >/dev/null")
                :format(page, page))
  end

  it("mprun(1): every option of mprun --help, the environment, the exit statuses, examples", function()
    assert.are.equal("", warnings("doc/mprun.1"))
    local text = render("doc/mprun.1")
    local help = H.sh("./scripts/mprun --help 2>&1")
    local names = {}
    for option in help:gmatch("%f[%w-](%-%-?[%a][%w-]*)") do names[option] = true end
    for var in help:match("Each rank gets(.-)in its environment"):gmatch("[%u_]+") do names[var] = true end
    assert.is_true(names["--max-restarts"] and names["-n"] and names.RANK and names.MP_RUN_ID or false)
    -- an option is an item of OPTIONS (a tag line), a variable is in ENVIRONMENT
    local options = assert(text:match("\nOPTIONS\n(.-)\n%u[%u ]+\n"))
    local tags = {}
    for tag in ("\n" .. options):gmatch("\n       (%-[^\n]*)") do tags[#tags + 1] = tag end
    tags = "\n" .. table.concat(tags, "\n") .. "\n"
    local env = assert(text:match("\nENVIRONMENT\n(.-)\n%u[%u ]+\n"))
    local missing = {}
    for name in pairs(names) do
      local where = name:sub(1, 1) == "-" and tags or env
      if not where:find("%f[%w-]" .. name:gsub("%-", "%%-") .. "%f[^%w-]") then missing[#missing + 1] = name end
    end
    table.sort(missing)
    assert.are.same({}, missing)
    for _, section in ipairs { "SYNOPSIS", "OPTIONS", "ENVIRONMENT", "EXIT STATUS", "EXAMPLES", "SEE ALSO" } do
      assert.truthy(text:find("\n" .. section .. "\n", 1, true), section)
    end
    for _, status in ipairs { "124", "130", "143", "128 + its signal number" } do
      assert.truthy(text:find(status, 1, true), status)
    end
    assert.truthy(text:find([[mprun -n auto -e 'print(require("multiprocessing").world().rank)']], 1, true))
  end)

  it("multiprocessing(3): processes, Pool, mprun, world, and SYNOPSIS quotes that survive groff", function()
    assert.are.equal("", warnings("doc/multiprocessing.3"))
    local text = render("doc/multiprocessing.3")
    assert.truthy(text:find('local mp = require "multiprocessing"\n', 1, true), "the require line, quoted")
    assert.truthy(text:find('mp.start_processes(fn, args, nprocs, true, false, "fork")', 1, true))
    for _, name in ipairs { "start_processes", "ctx:join", "ctx:fileno", "mp.Pool", "pool:map", "imap_unordered",
                            "apply_async", "mp.TimeoutError", "mprun(1)", "mp.world()", "mp.Queue", "mp.Array",
                            "lmp_worker_main", "set_executable", "LUA_MP_NO_PIDFD_EXIT_INFO",
                            "mp.Process", "mp.wait", "mp.as_completed", "mp.Interrupted", "pool:submit",
                            "ar:cancel", "interrupted: SIGINT during Pool.map", "ctx:terminate", "ctx:poll()",
                            "ctx:restart", "e.kind" } do
      assert.truthy(text:find(name, 1, true), name)
    end
  end)
end)
