-- bench/guard.lua -- the bench that guards itself (bench/run.lua uses it).
--
-- Every row the driver prints is recorded here; at the end of the run the
-- rows go to build/bench/last.json (medians, spreads, ratios) and their
-- ratios are compared with the committed bench/baseline.json.  A ratio more
-- than TOLERANCE worse than the baseline's is printed as REGRESSED in a
-- closing block, and so is a baseline row this run did not produce.
--
-- Ratios, not times: a row's "x_floor" (its cost / the floor's cost of the
-- same run, lower is better) and "vs_python" (times faster than Python's
-- peer in the same run, higher is better).  Rows of Python, of the floors
-- and rows with absolute targets only (ms) are written to last.json but not
-- guarded.
--
-- A BENCH_QUICK=1 run is a smoke run: too few repetitions for a 15 % verdict.
-- It calls REGRESSED only what a smoke run can show: a row that is missing
-- (its measurement failed or vanished) and a ratio more than QUICK_FACTOR
-- times worse; smaller drifts are listed as "worse (quick run: no verdict)".
--
-- Refreshing the baseline (in the commit that improves a row):
--   make bench && make bench-baseline      (lua5.4 bench/guard.lua refresh)
-- which writes the ratios of build/bench/last.json to bench/baseline.json;
-- a quick run is refused.
package.path = "./bench/?.lua;" .. package.path
local json = require "json"

local M = {}

M.LAST = "build/bench/last.json"
M.BASELINE = "bench/baseline.json"
M.TOLERANCE = tonumber(os.getenv("BENCH_TOLERANCE") or "") or 0.15
M.QUICK_FACTOR = 2

local rows, order, skipped = {}, {}, {}
local current_table

-- The title of the table the next rows belong to (the driver's section).
function M.table(title) current_table = title end

local function guarded(spec)
  if spec.is_floor then return false end
  local k = spec.key
  return not (k:match("^py_") or k:match("^floor_") or k:match("^torchrun"))
end

local function id_of(spec)
  return spec.key .. (spec.field and ("." .. spec.field) or "")
end

-- One row as the driver computed it: spec (the row's spec), m, p25, p75,
-- xf (x floor, or nil), vp (vs Python, or nil).  The first row of an id
-- wins: a row shown in two tables is the same measurement.
function M.record(spec, m, p25, p75, xf, vp)
  local id = id_of(spec)
  if rows[id] then return end
  rows[id] = { name = spec.name, table = current_table, unit = spec.unit,
               median = m, p25 = p25, p75 = p75,
               x_floor = (xf and not spec.is_floor) and xf or nil,
               vs_python = vp, guarded = guarded(spec) }
  order[#order + 1] = id
end

function M.skip(spec, why)
  local id = id_of(spec)
  if not rows[id] then skipped[id] = { name = spec.name, why = why } end
end

local function read_json(path)
  local f = io.open(path)
  if not f then return nil, path .. ": not found" end
  local s = f:read("a")
  f:close()
  local v, err = json.decode(s)
  if not v then return nil, path .. ": " .. err end
  return v
end

local function write_file(path, s)
  local f, err = io.open(path, "w")
  if not f then return nil, err end
  f:write(s)
  f:close()
  return true
end

-- How much worse 'run' is than 'base' (1.0 = the same, 1.2 = 20 % worse).
local WORSE = {
  x_floor = function(run, base) return run / base end,
  vs_python = function(run, base) return base / run end,
}

local function fmt(x)
  if x >= 100 then return string.format("%.0fx", x) end
  if x >= 10 then return string.format("%.1fx", x) end
  return string.format("%.2fx", x)
end

-- Compares the rows of this run with the baseline; returns the lines of
-- the closing block and the number of REGRESSED verdicts.
function M.compare(base, quick)
  local out, bad, worse, new = {}, 0, {}, {}
  local brows = base.rows or {}
  local ids = {}
  for id in pairs(brows) do ids[#ids + 1] = id end
  table.sort(ids)
  for _, id in ipairs(ids) do
    local b, r = brows[id], rows[id]
    if not r then
      local why = skipped[id] and ("skipped: " .. skipped[id].why) or "no such row in this run"
      out[#out + 1] = string.format("  REGRESSED  %-40s MISSING (%s)", id, why)
      bad = bad + 1
    else
      for _, field in ipairs { "x_floor", "vs_python" } do
        local bv, rv = b[field], r[field]
        if bv and not rv then
          out[#out + 1] = string.format("  REGRESSED  %-40s %s MISSING (baseline %s)", id, field, fmt(bv))
          bad = bad + 1
        elseif bv and rv and bv > 0 and rv > 0 then
          local w = WORSE[field](rv, bv)
          local line = string.format("%-40s %-9s %s, baseline %s: %.0f %% worse", id, field, fmt(rv),
                                     fmt(bv), (w - 1) * 100)
          if w > 1 + M.TOLERANCE then
            if not quick or w > M.QUICK_FACTOR then
              out[#out + 1] = "  REGRESSED  " .. line
              bad = bad + 1
            else
              worse[#worse + 1] = "  worse (quick run: no verdict)  " .. line
            end
          end
        end
      end
    end
  end
  for _, id in ipairs(order) do
    local r = rows[id]
    if r.guarded and (r.x_floor or r.vs_python) and not brows[id] then new[#new + 1] = id end
  end
  for _, l in ipairs(worse) do out[#out + 1] = l end
  if #new > 0 then
    out[#out + 1] = "  not in the baseline (not compared): " .. table.concat(new, ", ")
  end
  return out, bad
end

-- The baseline made from a run: the guarded rows' ratios.
function M.baseline_of(run)
  local b = { about = "ratios of `make bench` rows (x_floor: cost / the floor's, lower is better; "
                .. "vs_python: times faster than Python's peer, higher is better); bench/guard.lua "
                .. "compares each run with them",
              from = run.from, rows = {} }
  for id, r in pairs(run.rows) do
    if r.guarded and (r.x_floor or r.vs_python) then
      b.rows[id] = { name = r.name, x_floor = r.x_floor, vs_python = r.vs_python }
    end
  end
  return b
end

-- The end of a run: last.json, then the closing block.  'meta' describes
-- the run (date, commit, quick, load averages).
function M.finish(meta, quick)
  local run = { from = meta, rows = {}, skipped = skipped }
  for id, r in pairs(rows) do run.rows[id] = r end
  local ok, err = write_file(M.LAST, json.encode(run))
  print("")
  local title = "Regressions against " .. M.BASELINE
    .. string.format(" (a ratio more than %d %% worse is REGRESSED)", math.floor(M.TOLERANCE * 100 + 0.5))
  print(title)
  print(string.rep("=", #title))
  print(ok and ("  this run's rows: " .. M.LAST) or ("  could not write " .. M.LAST .. ": " .. tostring(err)))
  local base, why = read_json(M.BASELINE)
  if not base then
    print("  no baseline to compare with (" .. why .. ")")
    return
  end
  print("  baseline from: " .. tostring(base.from and base.from.run or "?"))
  if quick then
    print(string.format("  BENCH_QUICK run: only missing rows and ratios more than %gx worse are verdicts",
                        M.QUICK_FACTOR))
  end
  local lines, bad = M.compare(base, quick)
  for _, l in ipairs(lines) do print(l) end
  print(string.format("  %d REGRESSED%s", bad, bad == 0 and " (every baseline row within tolerance)" or ""))
end

-- lua5.4 bench/guard.lua refresh: bench/baseline.json from last.json
if arg and arg[0] and arg[0]:match("guard%.lua$") then
  if arg[1] ~= "refresh" then
    io.stderr:write("usage: lua5.4 bench/guard.lua refresh   (from the top of the tree)\n")
    os.exit(2)
  end
  local run, err = read_json(M.LAST)
  if not run then
    io.stderr:write("bench-baseline: ", err, " (run make bench first)\n")
    os.exit(1)
  end
  if run.from and run.from.quick then
    io.stderr:write("bench-baseline: ", M.LAST, " is from a BENCH_QUICK run; refusing\n")
    os.exit(1)
  end
  local b = M.baseline_of(run)
  local n = 0
  for _ in pairs(b.rows) do n = n + 1 end
  assert(write_file(M.BASELINE, json.encode(b)))
  print(string.format("bench-baseline: %d rows from %s written to %s", n,
                      tostring(run.from and run.from.run), M.BASELINE))
end

return M
