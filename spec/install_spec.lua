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
                         "/usr/local/share/lua/5.4/multiprocessing/init.lua" } do
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
end)
