-- The API reference (doc/api.md) and the man page cover every public name:
-- the module's, and the methods of every object it makes.
local H = require "helpers"
local mp = require "multiprocessing"

local doc = assert(H.read("doc/api.md"))
local man = assert(H.read("doc/multiprocessing.3"))

local function documented(pattern)
  return doc:find(pattern, 1, true) ~= nil
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
      if not documented("mp." .. name) then missing[#missing + 1] = name end
    end
    table.sort(missing)
    assert.are.same({}, missing)
  end)

  it("names every method of every object", function()
    local a, b = mp.Pipe()
    local ctx = mp.start_processes(function() end, {}, 1, false, false, "fork")
    local pool = mp.Pool(1, { start_method = "fork" })
    local async = pool:apply_async(function() return 1 end)
    assert.are.equal(1, async:get(30))
    local objects = {
      Queue = mp.Queue(), SimpleQueue = mp.SimpleQueue(), JoinableQueue = mp.JoinableQueue(),
      Array = mp.Array("int", 2),
      Value = mp.Value("int", 0), Lock = mp.Lock(), RLock = mp.RLock(), Semaphore = mp.Semaphore(1),
      Event = mp.Event(), Barrier = mp.Barrier(1), Condition = mp.Condition(), Connection = a,
      ProcessContext = ctx, Process = ctx.processes[1], Pool = pool, AsyncResult = async,
    }
    local missing = {}
    for kind, obj in pairs(objects) do
      for _, name in ipairs(methods(obj)) do
        if not documented(":" .. name .. "(") then missing[#missing + 1] = kind .. ":" .. name end
      end
    end
    assert.is_true(ctx:join())
    objects.Pool, objects.AsyncResult = nil, nil
    pool:close()
    pool:join()
    for _, obj in pairs(objects) do if obj.close then obj:close() end end
    b:close()
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
