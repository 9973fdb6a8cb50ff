-- bench/lua_frames.lua -- the embedding row: the example host's 60 Hz frame
-- loop (examples/frame_host.c, built by bench.sh into build/bench/) runs its
-- script -- workers started, polled with join(0), one failing among
-- TERM-ignoring others, close, GC, lua_close -- under each start method.
-- Per run: the worst frame, and the worst join(0), close and GC steps (ms).
--   lua5.4 bench/lua_frames.lua REPS
local B = dofile("bench/lib.lua")

local reps = tonumber(arg[1]) or 3
local host = "build/bench/frame_host"

for _, method in ipairs { "fork", "spawn", "forkserver" } do
  local worst, join0, close, gc = {}, {}, {}, {}
  local why
  for _ = 1, reps do
    local f = io.popen(("LUA_PATH='./lua/?.lua;./lua/?/init.lua;;' LUA_CPATH='./build/?.so;;' " ..
                        "%s examples/frame_host.lua %s 2>/dev/null"):format(host, method))
    local out = f:read("a")
    f:close()
    local w = tonumber(out:match("frames %d+ worst ([%d.]+) ms"))
    if not w then why = "the host failed: " .. (out:match("[^\n]*$") or "?") break end
    worst[#worst + 1] = w
    join0[#join0 + 1] = tonumber(out:match("step join0 [^\n]* max ([%d.]+) ms"))
    close[#close + 1] = tonumber(out:match("step close [^\n]* max ([%d.]+) ms"))
    gc[#gc + 1] = tonumber(out:match("step gc [^\n]* max ([%d.]+) ms"))
  end
  if why then
    B.emit { bench = "lua_frames", method = method, skip = why }
  else
    B.emit { bench = "lua_frames", method = method, samples = worst, join0 = join0,
             close = close, gc = gc }
  end
end
