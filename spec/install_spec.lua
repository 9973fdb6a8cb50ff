-- make install: the files land where lua5.4 looks for them, and the
-- installed module spawns workers with the worker program installed beside
-- core.so.
local H = require "helpers"

describe("make install", function()
  local root
  before_each(function()
    root = H.sh("mktemp -d"):gsub("%s+$", "")
  end)
  after_each(function() H.sh("rm -rf '" .. root .. "'") end)

  it("puts the modules in lua5.4's own search dirs for the prefix", function()
    local out = H.sh(("make -s install DESTDIR='%s' PREFIX=/usr/local 2>&1; echo rc=$?")
                     :format(root))
    assert.matches("rc=0\n$", out)
    for _, f in ipairs { "/usr/local/lib/lua/5.4/multiprocessing/core.so",
                         "/usr/local/lib/lua/5.4/multiprocessing/worker",
                         "/usr/local/share/lua/5.4/multiprocessing/init.lua",
                         "/usr/local/include/multiprocessing.h",
                         "/usr/local/share/man/man3/multiprocessing.3" } do
      assert.is_truthy(io.open(root .. f), f)
    end
    -- lua5.4's default paths for /usr/local, rooted in DESTDIR
    local lmod, cmod = root .. "/usr/local/share/lua/5.4/", root .. "/usr/local/lib/lua/5.4/"
    local prelude = ("package.path = %q; package.cpath = %q\n"):format(
      lmod .. "?.lua;" .. lmod .. "?/init.lua", cmod .. "?.so")
    out = H.sh(("cd / && lua5.4 -e %q 2>&1"):format(prelude .. [[
      local mp = require "multiprocessing"
      for _, m in ipairs { "fork", "spawn", "forkserver" } do
        local r = mp.start_processes(function(i) return i * 2 end, {}, 2, true, false, m)
        io.write(m, " ", r[2], "\n")
      end]]))
    assert.are.equal("fork 2\nspawn 2\nforkserver 2\n", out)
  end)

  -- what a user of a non-default PREFIX does (README): LUA_PATH and LUA_CPATH
  local function run_installed(lmod, cmod)
    return H.sh(("cd / && LUA_PATH=%q LUA_CPATH=%q lua5.4 -e %q 2>&1"):format(
      lmod .. "/?.lua;" .. lmod .. "/?/init.lua;;", cmod .. "/?.so;;", [[
      local mp = require "multiprocessing"
      io.write(mp._VERSION, "\n")
      for _, m in ipairs { "fork", "spawn", "forkserver" } do
        local r = mp.start_processes(function(i) return i * 2 end, {}, 2, true, false, m)
        io.write(m, " ", r[2], "\n")
      end
      io.write(package.searchpath("multiprocessing.core", package.cpath), "\n")]]))
  end

  it("luarocks make installs the rock into a tree, usable under every start method", function()
    local mp = require "multiprocessing"
    local rockspec = ("lua-multiprocessing-%s-1.rockspec"):format(mp._VERSION)
    -- a copy of the tree, so that the rock's build does not touch ours
    local src = root .. "/src"
    H.sh(("mkdir -p '%s' && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t '%s'"):format(src, src))
    local out = H.sh(("cd '%s' && luarocks --lua-version=5.4 make --tree '%s/tree' %s 2>&1; echo rc=$?")
                     :format(src, root, rockspec))
    assert.matches("rc=0\n$", out)
    local tree = root .. "/tree"
    for _, f in ipairs { "/lib/lua/5.4/multiprocessing/core.so", "/lib/lua/5.4/multiprocessing/worker",
                         "/share/lua/5.4/multiprocessing/init.lua" } do
      assert.is_truthy(io.open(tree .. f), f)
    end
    out = run_installed(tree .. "/share/lua/5.4", tree .. "/lib/lua/5.4")
    assert.are.equal(mp._VERSION .. "\nfork 2\nspawn 2\nforkserver 2\n" ..
                     tree .. "/lib/lua/5.4/multiprocessing/core.so\n", out)
    -- and luarocks knows it
    assert.matches("lua%-multiprocessing", H.sh(("luarocks --lua-version=5.4 --tree '%s' list 2>&1"):format(tree)))
  end)
end)
