-- bench/guard.lua -- the bench that guards itself (bench/run.lua uses it).
--
-- Every row the driver prints is recorded here; at the end of the run the
-- rows' ratios are compared with the committed bench/baseline.json, and the
-- rows go to build/bench/last.json (medians, spreads, ratios, and what the
-- comparison measured again).
--
-- Ratios, not times: a row's "x_floor" (its cost / the floor's cost of the
-- same run, lower is better) and "vs_python" (times faster than Python's
-- peer in the same run, higher is better).  Rows of Python, of the floors
-- and rows with absolute targets only (ms) are written to last.json but not
-- guarded.
--
-- The rule.  A ratio more than TOLERANCE (15 %) worse than the baseline's
-- is measured again: the driver runs once more each command of the run
-- that yielded the row, its floor or its Python peer (only those, in the
-- run's order, one round of a command the run repeated in rounds, into
-- fresh results), up to REMEASURES (2) times, each time only for the rows
-- still worse.  A ratio is REGRESSED when it is more than
-- TOLERANCE worse in the run and in every re-measure; one that comes back
-- within it is listed as "noisy, recovered on re-measure", with each
-- measurement, so nothing is hidden.  A baseline row the run did not
-- produce (skipped, failed, removed) is REGRESSED at once.  The closing
-- block says which commands each re-measure ran and how long it took.  The
-- re-measures have a BUDGET (120 s, counted as what their commands took in
-- the run): rows are taken cheapest first while they fit, a row left out
-- keeps the verdict of the measurements it had, and the block says so.
--   Why not a wider tolerance per row from its own p25..p75: on the 2-core
-- VM the ratios move between runs far more than within one (lua_pipe_mib:
-- p25..p75 2 % of its median, its ratio to Python 22 % apart in two runs
-- of the same code), so the spread of one run does not tell noise from a
-- regression; a second and third measurement does.  The price: a real
-- regression is found only when it is larger than the row's noise, and a
-- row a re-measure can clear is a row too noisy to guard at 15 %.  And a
-- shift that lasts the whole run (a machine loaded throughout, where the
-- baseline's was quiet) is no noise a re-measure clears: it stays
-- REGRESSED, and the closing block prints both runs' load averages to
-- judge it by.
--
-- A BENCH_QUICK=1 run is a smoke run: too few repetitions for a 15 % verdict.
-- It calls REGRESSED only what a smoke run can show: a row that is missing
-- (its measurement failed or vanished) and a ratio more than QUICK_FACTOR
-- times worse, in the run and in one re-measure; smaller drifts are listed
-- as "worse (quick run: no verdict)".
--
-- Environment: BENCH_TOLERANCE=0.3 (the margin), BENCH_REMEASURE=0..n (how
-- many re-measures; 0: none, the run's ratio is the verdict),
-- BENCH_REMEASURE_BUDGET=seconds.
--
-- Refreshing the baseline (in the commit that improves a row):
--   make bench && make bench-baseline      (lua5.4 bench/guard.lua refresh)
-- which writes the ratios of build/bench/last.json to bench/baseline.json
-- (the run's own ratios, not the re-measures'); a quick run is refused.
package.path = "./bench/?.lua;" .. package.path
local json = require "json"

local M = {}

M.LAST = "build/bench/last.json"
M.BASELINE = "bench/baseline.json"
M.TOLERANCE = tonumber(os.getenv("BENCH_TOLERANCE") or "") or 0.15
M.QUICK_FACTOR = 2
M.REMEASURES = tonumber(os.getenv("BENCH_REMEASURE") or "") or 2
M.BUDGET = tonumber(os.getenv("BENCH_REMEASURE_BUDGET") or "") or 120

local rows, order, skipped, specs_of = {}, {}, {}, {}
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
  specs_of[id] = spec
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

-- The ratios of this run more than the tolerance worse than the baseline's
-- (more than QUICK_FACTOR in a quick run), lines for the missing rows, and
-- the quick run's drifts without a verdict.  A flagged ratio: { id, field,
-- base, values (the run's, then each re-measure's; false: no result), worse
-- (the same as factors, huge: no result), open (still worse) }.
local function first_pass(brows, quick)
  local flagged, missing, worse = {}, {}, {}
  local ids = {}
  for id in pairs(brows) do ids[#ids + 1] = id end
  table.sort(ids)
  for _, id in ipairs(ids) do
    local b, r = brows[id], rows[id]
    if not r then
      local why = skipped[id] and ("skipped: " .. skipped[id].why) or "no such row in this run"
      missing[#missing + 1] = string.format("  REGRESSED  %-40s MISSING (%s)", id, why)
    else
      for _, field in ipairs { "x_floor", "vs_python" } do
        local bv, rv = b[field], r[field]
        if bv and not rv then
          missing[#missing + 1] = string.format("  REGRESSED  %-40s %s MISSING (baseline %s)", id, field, fmt(bv))
        elseif bv and rv and bv > 0 and rv > 0 then
          local w = WORSE[field](rv, bv)
          if w > 1 + M.TOLERANCE then
            if not quick or w > M.QUICK_FACTOR then
              flagged[#flagged + 1] = { id = id, field = field, base = bv, values = { rv }, worse = { w },
                                        open = true }
            else
              worse[#worse + 1] = string.format("  worse (quick run: no verdict)  %-40s %-9s %s, baseline %s: "
                .. "%.0f %% worse", id, field, fmt(rv), fmt(bv), (w - 1) * 100)
            end
          end
        end
      end
    end
  end
  return flagged, missing, worse
end

-- A flagged ratio is still worse than the bar after a measurement.
local function bar(quick) return quick and M.QUICK_FACTOR or 1 + M.TOLERANCE end

-- Measures the flagged rows again, up to 'rounds' times, each time only
-- those still worse (remeasure: see bench/run.lua); returns the lines that
-- say what ran, and its record for last.json.
local function remeasure_rounds(flagged, quick, remeasure)
  local lines, record = {}, { rounds = 0, seconds = 0 }
  local rounds = quick and math.min(1, M.REMEASURES) or M.REMEASURES
  if not remeasure then rounds = 0 end
  local left = M.BUDGET
  for round = 1, rounds do
    local specs, n = {}, 0
    for _, f in ipairs(flagged) do
      if f.open and not specs[f.id] then specs[f.id], n = specs_of[f.id], n + 1 end
    end
    if n == 0 then break end
    local fresh, secs, labels, left_out = remeasure(specs, left)
    if #left_out > 0 then
      lines[#lines + 1] = string.format("  re-measure %d left out %s: its commands took more than the %d s left "
        .. "of BENCH_REMEASURE_BUDGET=%d in the run", round, table.concat(left_out, ", "), left, M.BUDGET)
      record.left_out = record.left_out or {}
      record.left_out[round] = left_out
      local out = {}
      for _, id in ipairs(left_out) do out[id] = true end
      for _, f in ipairs(flagged) do
        if f.open and out[f.id] then f.left_out = true end
      end
    end
    if #labels == 0 then break end
    n = n - #left_out
    left = left - secs
    record.rounds, record.seconds = round, record.seconds + secs
    lines[#lines + 1] = string.format("  re-measure %d: %d row%s, %d command%s again, %d s (%s)", round, n,
                                      n == 1 and "" or "s", #labels, #labels == 1 and "" or "s", secs,
                                      table.concat(labels, "; "))
    for _, f in ipairs(flagged) do
      if f.open and fresh[f.id] then
        local v = fresh[f.id][f.field]
        local w = (v and v > 0) and WORSE[f.field](v, f.base) or math.huge
        f.values[#f.values + 1], f.worse[#f.worse + 1] = v or false, w
        if w <= bar(quick) then f.open = false end
      end
    end
  end
  return lines, record
end

local function values_of(f)
  local v, w = {}, {}
  for i, x in ipairs(f.values) do
    v[i] = x and fmt(x) or "-"
    w[i] = f.worse[i] == math.huge and "no result" or string.format("%.0f %%", (f.worse[i] - 1) * 100)
  end
  return table.concat(v, ", "), table.concat(w, ", ")
end

-- Compares the rows of this run with the baseline, measuring again the
-- rows that compare worse (remeasure, when given); returns the lines of
-- the closing block, the number of REGRESSED verdicts and the re-measure's
-- record.
function M.compare(base, quick, remeasure)
  local brows = base.rows or {}
  local flagged, out, worse = first_pass(brows, quick)
  local bad = #out
  local lines, record = remeasure_rounds(flagged, quick, remeasure)
  local recovered = {}
  record.rows = {}
  for _, f in ipairs(flagged) do
    local v, w = values_of(f)
    record.rows[f.id .. " " .. f.field] = { values = f.values, baseline = f.base,
                                            verdict = f.open and "REGRESSED" or "recovered" }
    if f.open then
      out[#out + 1] = string.format("  REGRESSED  %-40s %-9s %s; baseline %s: %s worse%s", f.id, f.field, v,
                                    fmt(f.base), w, f.left_out and " (a re-measure left out: budget)" or "")
      bad = bad + 1
    else
      recovered[#recovered + 1] = string.format("%s %s (%s; baseline %s)", f.id, f.field, v, fmt(f.base))
    end
  end
  if #recovered > 0 then
    out[#out + 1] = "  noisy, recovered on re-measure: " .. table.concat(recovered, ", ")
  end
  for _, l in ipairs(worse) do out[#out + 1] = l end
  local new = {}
  for _, id in ipairs(order) do
    local r = rows[id]
    if r.guarded and (r.x_floor or r.vs_python) and not brows[id] then new[#new + 1] = id end
  end
  if #new > 0 then
    out[#out + 1] = "  not in the baseline (not compared): " .. table.concat(new, ", ")
  end
  for _, l in ipairs(lines) do out[#out + 1] = l end
  out[#out + 1] = string.format("  re-measures run: %d (%d s)%s", record.rounds, record.seconds,
                                #flagged == 0 and ", none needed" or "")
  return out, bad, record
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

-- The end of a run: the closing block, then last.json.  'meta' describes
-- the run (date, commit, quick, load averages); 'remeasure' measures rows
-- again (bench/run.lua).
function M.finish(meta, quick, remeasure)
  local run = { from = meta, rows = {}, skipped = skipped }
  for id, r in pairs(rows) do run.rows[id] = r end
  print("")
  local n = quick and math.min(1, M.REMEASURES) or M.REMEASURES
  local title = "Regressions against " .. M.BASELINE .. " (REGRESSED: a ratio more than "
    .. (quick and string.format("%gx", M.QUICK_FACTOR) or string.format("%d %%", math.floor(M.TOLERANCE * 100 + 0.5)))
    .. " worse" .. (n == 0 and "" or n == 1 and " in the run and in a re-measure"
                    or string.format(" in the run and in each of up to %d re-measures", n)) .. ")"
  print(title)
  print(string.rep("=", #title))
  local base, why = read_json(M.BASELINE)
  if not base then
    print("  no baseline to compare with (" .. why .. ")")
  else
    print("  baseline from: " .. tostring(base.from and base.from.run or "?"))
    print(string.format("  this run: load %s -> %s", tostring(meta.load_before), tostring(meta.load_after)))
    if quick then
      print(string.format("  BENCH_QUICK run: only missing rows and ratios more than %gx worse are verdicts",
                          M.QUICK_FACTOR))
    end
    local lines, bad, record = M.compare(base, quick, remeasure)
    run.remeasure = record
    for _, l in ipairs(lines) do print(l) end
    print(string.format("  %d REGRESSED%s", bad, bad == 0 and " (every baseline row within tolerance)" or ""))
  end
  local ok, err = write_file(M.LAST, json.encode(run))
  print(ok and ("  this run's rows: " .. M.LAST) or ("  could not write " .. M.LAST .. ": " .. tostring(err)))
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
