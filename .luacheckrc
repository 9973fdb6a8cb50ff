-- luacheck settings: `make lint` (part of `make check`) checks lua/ spec/
-- examples/ bench/ with these.
std = "lua54"
max_line_length = 120
-- Worker functions are written inline and often ignore their rank.
unused_args = false

files["spec/"] = {
  std = "+busted",
  max_line_length = 160,   -- test data and expected messages on one line
  -- child scripts and host chunks set these globals on purpose
  globals = { "ctx", "mp", "STATE", "PPID", "spawnspec_global" },
  -- specs drop references (x = nil) and fill sets to let the collector and
  -- the assertions see them: not dead code
  -- (and a name starting with "_" is unused on purpose)
  ignore = { "311", "241", "211/_.*" },
}
-- to-be-closed variables held for their scope (guards, objects)
files["spec/sharing_spec.lua"] = { ignore = { "211/a" } }
files["spec/sync_spec.lua"] = { ignore = { "211/g%d*", "211/h" } }
files["bench/"] = { max_line_length = 140, ignore = { "311" } }
-- an argument-error case passes an undefined global on purpose
files["spec/core_spec.lua"] = { read_globals = { "f" } }
