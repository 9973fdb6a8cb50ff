-- make install / make uninstall and the rock: the files land where lua5.4
-- (and man, and a C compiler) look for them, the installed module spawns
-- workers with the worker program installed beside core.so, uninstall
-- removes exactly what install put, and luarocks make works as the README
-- writes it on Debian 12 (whose default luarocks is for Lua 5.1).
local H = require "helpers"

local function q(s) return "'" .. s:gsub("'", "'\\''") .. "'" end

--- Every file and symlink under 'dir', relative to it, sorted.
local function files(dir)
  local out = {}
  for f in H.sh("cd " .. q(dir) .. " && find . ! -type d | sort"):gmatch("%./([^\n]+)\n") do
    out[#out + 1] = f
  end
  return out
end

--- The installed module run from outside the tree, under every start method,
-- with the given Lua search directories (what a user of a non-default PREFIX
-- does: LUA_PATH and LUA_CPATH, as the README says).
local function run_installed(lmod, cmod)
  return H.sh(("cd / && LUA_PATH=%s LUA_CPATH=%s lua5.4 -e %s 2>&1"):format(
    q(lmod .. "/?.lua;" .. lmod .. "/?/init.lua;;"), q(cmod .. "/?.so;;"), q([[
    local mp = require "multiprocessing"
    io.write(mp._VERSION, "\n")
    for _, m in ipairs { "fork", "spawn", "forkserver" } do
      local r = mp.start_processes(function(i) return i * 2 end, {}, 2, true, false, m)
      io.write(m, " ", r[2], "\n")
    end
    io.write(package.searchpath("multiprocessing.core", package.cpath), "\n")]])))
end

-- Tools (make, the compiler, man, luarocks) run without the sanitizer's
-- preload of make check-asan: C++ programs such as cc1 and troff abort
-- under it on their own allocations.
local NOSAN = "env -u LD_PRELOAD "

local function make(args)
  return H.sh(NOSAN .. "-u MAKEFLAGS -u MAKELEVEL -u MFLAGS make -s " .. args .. " 2>&1; echo rc=$?")
end

describe("make install", function()
  H.leak_check(before_each, after_each)
  local mp = require "multiprocessing"
  local root
  before_each(function()
    root = H.sh("mktemp -d"):gsub("%s+$", "")
  end)
  after_each(function() H.sh("rm -rf " .. q(root)) end)

  it("puts the modules in lua5.4's own search dirs for the prefix", function()
    assert.matches("rc=0\n$", make(("install DESTDIR=%s PREFIX=/usr/local"):format(q(root))))
    for _, f in ipairs { "/usr/local/lib/lua/5.4/multiprocessing/core.so",
                         "/usr/local/lib/lua/5.4/multiprocessing/launcher.so",
                         "/usr/local/lib/lua/5.4/multiprocessing/worker",
                         "/usr/local/share/lua/5.4/multiprocessing/init.lua",
                         "/usr/local/bin/mprun",
                         "/usr/local/include/multiprocessing.h",
                         "/usr/local/share/man/man1/mprun.1",
                         "/usr/local/share/man/man3/multiprocessing.3" } do
      assert.is_truthy(io.open(root .. f), f)
    end
    -- every Lua module of the tree
    for f in H.sh("ls lua/multiprocessing"):gmatch("([^\n]+%.lua)\n") do
      assert.is_truthy(io.open(root .. "/usr/local/share/lua/5.4/multiprocessing/" .. f), f)
    end
    -- lua5.4's default paths for /usr/local, rooted in DESTDIR
    local lmod, cmod = root .. "/usr/local/share/lua/5.4/", root .. "/usr/local/lib/lua/5.4/"
    local prelude = ("package.path = %q; package.cpath = %q\n"):format(
      lmod .. "?.lua;" .. lmod .. "?/init.lua", cmod .. "?.so")
    local out = H.sh(("cd / && lua5.4 -e %s 2>&1"):format(q(prelude .. [[
      local mp = require "multiprocessing"
      for _, m in ipairs { "fork", "spawn", "forkserver" } do
        local r = mp.start_processes(function(i) return i * 2 end, {}, 2, true, false, m)
        io.write(m, " ", r[2], "\n")
      end]])))
    assert.are.equal("fork 2\nspawn 2\nforkserver 2\n", out)
  end)

  it("under Lua's own prefix (Debian: /usr), puts the header next to lua.h", function()
    local prefix = H.sh("pkg-config --variable=prefix lua5.4"):gsub("%s+$", "")
    local inc = H.sh("pkg-config --variable=includedir lua5.4"):gsub("%s+$", "") .. "/" ..
                H.sh("pkg-config --variable=lib_name_include lua5.4"):gsub("%s+$", "")
    assert.is_truthy(io.open(inc .. "/lua.h"), inc .. "/lua.h")
    local cmod = H.sh("pkg-config --variable=INSTALL_CMOD lua5.4"):gsub("%s+$", "")
    local lmod = H.sh("pkg-config --variable=INSTALL_LMOD lua5.4"):gsub("%s+$", "")
    assert.matches("rc=0\n$", make(("install DESTDIR=%s PREFIX=%s"):format(q(root), q(prefix))))
    for _, f in ipairs { inc .. "/multiprocessing.h", cmod .. "/multiprocessing/core.so",
                         lmod .. "/multiprocessing/init.lua", prefix .. "/share/man/man1/mprun.1" } do
      assert.is_truthy(io.open(root .. f), f)
    end
    -- a host compiles against it with nothing but pkg-config's flags
    local c = root .. "/host.c"
    H.write(c, '#include "multiprocessing.h"\nint main(int c, char **v) { return lmp_is_worker(c, v); }\n')
    assert.matches("rc=0\n$", H.sh((NOSAN .. "cc -fsyntax-only -I%s $(pkg-config --cflags lua5.4) %s 2>&1; echo rc=$?")
                                   :format(q(root .. inc), q(c))))
  end)

  it("make uninstall removes exactly what make install put, nothing else", function()
    local prefix = root .. "/prefix"
    -- someone else's files in the same directories
    local theirs = { "lib/lua/5.4/other.so", "share/lua/5.4/other.lua", "bin/other",
                     "include/other.h", "share/man/man1/other.1", "share/man/man3/other.3" }
    for _, f in ipairs(theirs) do
      H.sh("mkdir -p " .. q(prefix .. "/" .. f:match("^(.*)/")))
      H.write(prefix .. "/" .. f, "not ours\n")
    end
    local before = files(prefix)
    assert.matches("rc=0\n$", make("install PREFIX=" .. q(prefix)))
    local installed = files(prefix)
    assert.is_true(#installed >= #before + 10, table.concat(installed, "\n"))
    -- installed under a real prefix: mprun and the man pages work from there
    local out = H.sh(("cd / && %s/bin/mprun -n 2 -e %s 2>&1; echo rc=$?"):format(
      q(prefix), q('print(package.searchpath("multiprocessing.core", package.cpath))')))
    assert.truthy(out:find("[rank1]: " .. prefix .. "/lib/lua/5.4/multiprocessing/core.so\n", 1, true), out)
    assert.matches("rc=0\n$", out)
    assert.matches("%-%-max%-restarts", H.sh("MANWIDTH=80 " .. NOSAN .. "man -l " .. q(prefix .. "/share/man/man1/mprun.1") ..
                                             " 2>&1 | cat"))
    assert.matches("rc=0\n$", make("uninstall PREFIX=" .. q(prefix)))
    assert.are.same(before, files(prefix))
    -- and the directories it made are gone
    assert.is_nil(io.open(prefix .. "/lib/lua/5.4/multiprocessing"))
    assert.is_nil(io.open(prefix .. "/share/lua/5.4/multiprocessing"))
  end)

  it("the Makefile lists make uninstall, and the README both", function()
    local header = H.read("Makefile"):match("^(.-)\n\n")
    assert.truthy(header:find("make uninstall", 1, true), header)
    assert.truthy(H.read("README.md"):find("make uninstall", 1, true))
  end)

  it("luarocks make, as the README writes it, installs a rock usable under every start method", function()
    local readme = H.read("README.md")
    -- Debian 12's luarocks defaults to Lua 5.1: the README must say which Lua
    assert.is_nil(readme:find("\nluarocks make", 1, true), "a luarocks command without --lua-version")
    local command = readme:match("\n(luarocks %-%-lua%-version=5%.4 make) ")
    assert.are.equal("luarocks --lua-version=5.4 make", command)
    -- the rockspec's source is a git URL luarocks accepts, not a placeholder
    local rockspec = ("lua-multiprocessing-%s-1.rockspec"):format(mp._VERSION)
    local spec = {}
    assert(load(H.read(rockspec), rockspec, "t", spec))()
    assert.matches("^git[+:]", spec.source.url)
    assert.is_nil(H.read(rockspec):find("example.invalid", 1, true))
    assert.matches("rc=0\n$", H.sh((NOSAN .. "luarocks --lua-version=5.4 lint %s 2>&1; echo rc=$?"):format(rockspec)))
    -- a copy of the tree, so that the rock's build does not touch ours
    local src = root .. "/src"
    H.sh(("mkdir -p %s && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t %s")
         :format(q(src), q(src)))
    local tree = root .. "/tree"
    local out = H.sh(("cd %s && " .. NOSAN .. "-u MAKEFLAGS -u MAKELEVEL -u MFLAGS %s --tree %s 2>&1; echo rc=$?")
                     :format(q(src), command, q(tree)))
    assert.matches("rc=0\n$", out)
    for _, f in ipairs { "/lib/lua/5.4/multiprocessing/core.so", "/lib/lua/5.4/multiprocessing/worker",
                         "/lib/lua/5.4/multiprocessing/launcher.so",
                         "/share/lua/5.4/multiprocessing/init.lua", "/bin/mprun" } do
      assert.is_truthy(io.open(tree .. f), f)
    end
    -- the header and the man pages in the rock's own directory, as the README says
    local rockdir = ("%s/lib/luarocks/rocks-5.4/lua-multiprocessing/%s-1"):format(tree, mp._VERSION)
    for _, f in ipairs { "/include/multiprocessing.h", "/doc/man1/mprun.1", "/doc/man3/multiprocessing.3" } do
      assert.is_truthy(io.open(rockdir .. f), rockdir .. f)
    end
    out = run_installed(tree .. "/share/lua/5.4", tree .. "/lib/lua/5.4")
    assert.are.equal(mp._VERSION .. "\nfork 2\nspawn 2\nforkserver 2\n" ..
                     tree .. "/lib/lua/5.4/multiprocessing/core.so\n", out)
    -- its mprun finds the tree by itself
    out = H.sh(("cd / && %s/bin/mprun -n 2 -e 'print(require(\"multiprocessing\")._VERSION)' 2>&1; echo rc=$?")
               :format(q(tree)))
    assert.truthy(out:find("[rank1]: " .. mp._VERSION .. "\n", 1, true), out)
    -- and luarocks knows it, and the README's show command finds the rock's directory
    assert.matches("lua%-multiprocessing", H.sh((NOSAN .. "luarocks --lua-version=5.4 --tree %s list 2>&1"):format(q(tree))))
    assert.truthy(readme:find("luarocks --lua-version=5.4 show --rock-dir lua-multiprocessing", 1, true))
    assert.are.equal(rockdir .. "\n", H.sh((NOSAN .. "luarocks --lua-version=5.4 --tree %s show --rock-dir lua-multiprocessing 2>&1")
                                           :format(q(tree))))
  end)
end)
