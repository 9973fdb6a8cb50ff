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
-- The rule.  A ratio is compared with the baseline's at a tolerance: the
-- larger of TOLERANCE (15 %) and the ratio's spread in the baseline
-- (below).  A ratio worse than that is measured again: the driver runs
-- once more each command of the run that yielded the row, its floor or its
-- Python peer (only those, in the run's order, one round of a command the
-- run repeated in rounds, into fresh results), up to REMEASURES (2) times,
-- each time only for the rows still worse.  A ratio is REGRESSED when it
-- is worse than its tolerance in the run and in every re-measure; one that
-- comes back within it is listed as "noisy, recovered on re-measure", with
-- each measurement, so nothing is hidden.  A baseline row the run did not
-- produce (skipped, failed, removed) is REGRESSED at once.  The closing
-- block says which commands each re-measure ran and how long it took,
-- which ratios are held to a tolerance wider than 15 % and which were more
-- than 15 % worse but within it.  The re-measures have a BUDGET (120 s,
-- counted as what their commands took in the run): rows are taken cheapest
-- first while they fit, a row left out keeps the verdict of the
-- measurements it had, and the block says so.
--
-- The baseline is the median of up to REFRESH_RUNS (3) full runs of one
-- commit (every full run is kept in build/bench/runs/), with each ratio's
-- spread: how much worse the worst of those runs was than the best. Why
-- both, and the re-measure: on the 2-core VM runs of the same code put
-- some ratios far apart (lua_pipe_mib vs Python 20.5x-68.5x in four runs,
-- while its own p25..p75 was as little as 2 % of its median; the x_floor
-- of the 1 MiB rows 0.17x in a run and 0.56x in its re-measures a minute
-- later), so one run neither makes a baseline (lua_start/forkserver/16
-- x_floor was 1.78x in the one-run baseline, 2.00-2.14x in four runs of
-- the same code since, three of them flagged) nor gives a verdict, and a
-- ratio that the same code has been seen to move by 50 % cannot be held to
-- 15 %. The price: a row is guarded only against regressions larger than
-- its own noise (the closing block lists the wide ones), and a shift that
-- lasts the whole run (a machine loaded throughout) is no noise a
-- re-measure clears: it stays REGRESSED, and the closing block prints the
-- baseline's and this run's load averages and this run's CPU pressure
-- (/proc/pressure/cpu) to judge it by.
--
-- A BENCH_QUICK=1 run is a smoke run: too few repetitions for a 15 % verdict.
-- It calls REGRESSED only what a smoke run can show: a row that is missing
-- (its measurement failed or vanished) and a ratio more than QUICK_FACTOR
-- times worse, in the run and in one re-measure; smaller drifts are listed
-- as "worse (quick run: no verdict)".  A quick run is not kept for a
-- refresh.
--
-- Environment: BENCH_TOLERANCE=0.3 (the margin), BENCH_REMEASURE=0..n (how
-- many re-measures; 0: none, the run's ratio is the verdict),
-- BENCH_REMEASURE_BUDGET=seconds.
--
-- Refreshing the baseline (in the commit that improves a row):
--   make bench; make bench; make bench; make bench-baseline
-- (lua5.4 bench/guard.lua refresh [RUN.json ...]): the medians of the ratios
-- of build/bench/last.json and the earlier full runs of the same commit in
-- build/bench/runs/ (up to 3 in all; or of the runs named) are written to
-- bench/baseline.json with their spreads and the runs they came from (the
-- runs' own ratios, not the re-measures'); a quick run is refused.
package.path = "./bench/?.lua;" .. package.path
local json = require "json"

local M = {}

M.LAST = "build/bench/last.json"
M.BASELINE = "bench/baseline.json"
M.TOLERANCE = tonumber(os.getenv("BENCH_TOLERANCE") or "") or 0.15
M.QUICK_FACTOR = 2
M.REMEASURES = tonumber(os.getenv("BENCH_REMEASURE") or "") or 2
M.BUDGET = tonumber(os.getenv("BENCH_REMEASURE_BUDGET") or "") or 120
M.RUNS = "build/bench/runs"     -- every full run's last.json, kept for a refresh
M.REFRESH_RUNS = 3

local rows, order, skipped, specs_of = {}, {}, {}, {}
local current_table

-- The title of the table the next rows belong to (the driver's section).
function M.table(title) current_table = title end

local function guarded(spec)
  if spec.is_floor then return false end
  local k = spec.key
  return not (k:match("^py_") or k:match("^floor_") or k:match("^torch") or k:match("^parallel_"))
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
-- (the same as factors, huge: no result), open (still worse), bar (the
-- factor it must stay within: 1 + its tolerance, or QUICK_FACTOR) }.  A
-- ratio's tolerance: the larger of TOLERANCE and its spread in the baseline.
local function first_pass(brows, quick)
  local flagged, missing, worse, within, wide = {}, {}, {}, {}, {}
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
          local tol = math.max(M.TOLERANCE, b.spread and b.spread[field] or 0)
          if tol > M.TOLERANCE then wide[#wide + 1] = string.format("%s %s %.0f %%", id, field, tol * 100) end
          if not quick and w > 1 + M.TOLERANCE and w <= 1 + tol then
            within[#within + 1] = string.format("%s %s %.0f %% worse (spread %.0f %%)", id, field, (w - 1) * 100,
                                                tol * 100)
          end
          if w > 1 + tol then
            if not quick or w > M.QUICK_FACTOR then
              flagged[#flagged + 1] = { id = id, field = field, base = bv, values = { rv }, worse = { w },
                                        open = true, bar = quick and M.QUICK_FACTOR or 1 + tol }
            else
              worse[#worse + 1] = string.format("  worse (quick run: no verdict)  %-40s %-9s %s, baseline %s: "
                .. "%.0f %% worse", id, field, fmt(rv), fmt(bv), (w - 1) * 100)
            end
          end
        end
      end
    end
  end
  if #wide > 0 and not quick then
    worse[#worse + 1] = string.format("  %d ratios held to the spread of the baseline's runs, wider than %d %%: %s",
                                      #wide, math.floor(M.TOLERANCE * 100 + 0.5), table.concat(wide, ", "))
  end
  if #within > 0 then
    worse[#worse + 1] = "  more than 15 % worse, within their spread: " .. table.concat(within, ", ")
  end
  return flagged, missing, worse
end

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
        if w <= f.bar then f.open = false end
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
      local tol = (not quick and f.bar - 1 > M.TOLERANCE + 1e-9)
        and string.format(" (tolerance %.0f %%: the baseline's spread)", (f.bar - 1) * 100) or ""
      out[#out + 1] = string.format("  REGRESSED  %-40s %-9s %s; baseline %s: %s worse%s%s", f.id, f.field, v,
                                    fmt(f.base), w, tol, f.left_out and " (a re-measure left out: budget)" or "")
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

-- The baseline made from one or more full runs (newest first): per guarded
-- ratio, the median over the runs that have it and, from two runs on, its
-- spread: how much worse the worst run was than the best (0.22 = 22 %) --
-- or the spread it had in 'previous' (the baseline being replaced), when
-- that is wider: a row's noise is this machine's, not a commit's, and three
-- runs that happened to agree do not make a noisy row steady.
local function median_of(t)
  local s = {}
  for i, x in ipairs(t) do s[i] = x end
  table.sort(s)
  local n = #s
  if n % 2 == 1 then return s[(n + 1) // 2] end
  return (s[n // 2] + s[n // 2 + 1]) / 2
end

function M.baseline_of(runs, previous)
  local b = { about = "ratios of `make bench` rows (x_floor: cost / the floor's, lower is better; "
                .. "vs_python: times faster than Python's peer, higher is better), the median over the "
                .. "runs in 'runs'; 'spread': how much worse the worst of them was than the best (0.2: "
                .. "20 %), or the spread in the baseline they replaced where that was wider; a ratio's "
                .. "tolerance where wider than 15 %; bench/guard.lua compares each run with them",
              from = runs[1].from, runs = {}, rows = {} }
  local seen = {}
  for _, run in ipairs(runs) do
    b.runs[#b.runs + 1] = run.from and run.from.run or "?"
    for id, r in pairs(run.rows) do
      if r.guarded and (r.x_floor or r.vs_python) then seen[id] = r.name end
    end
  end
  for id, name in pairs(seen) do
    local row = { name = name }
    for _, field in ipairs { "x_floor", "vs_python" } do
      local vals = {}
      for _, run in ipairs(runs) do
        local r = run.rows[id]
        if r and r[field] and r[field] > 0 then vals[#vals + 1] = r[field] end
      end
      if #vals > 0 then
        row[field] = median_of(vals)
        if #vals > 1 then
          table.sort(vals)
          local worst, best = vals[1], vals[#vals]     -- vs_python: higher is better
          if field == "x_floor" then worst, best = best, worst end
          row.spread = row.spread or {}
          row.spread[field] = WORSE[field](worst, best) - 1
        end
        local old = previous and previous.rows and previous.rows[id]
        old = old and old.spread and old.spread[field]
        if old and old > (row.spread and row.spread[field] or 0) then
          row.spread = row.spread or {}
          row.spread[field] = old
        end
      end
    end
    b.rows[id] = row
  end
  return b
end

-- The full runs a refresh takes when none are named: last.json and the
-- earlier full runs of the same commit kept in RUNS (newest first, up to
-- REFRESH_RUNS in all).
local function runs_to_refresh()
  local last, err = read_json(M.LAST)
  if not last then return nil, err .. " (run make bench first)" end
  if last.from and last.from.quick then return nil, M.LAST .. " is from a BENCH_QUICK run; refusing" end
  local runs = { last }
  local commit = last.from and last.from.commit
  local p = io.popen("ls -1r " .. M.RUNS .. " 2>/dev/null")
  for name in p:lines() do
    if #runs >= M.REFRESH_RUNS then break end
    local r = read_json(M.RUNS .. "/" .. name)
    if r and r.from and r.from.commit == commit and r.from.date ~= last.from.date and not r.from.quick then
      runs[#runs + 1] = r
    end
  end
  p:close()
  return runs
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
    .. (quick and string.format("%gx", M.QUICK_FACTOR)
        or string.format("%d %% (or its baseline spread)", math.floor(M.TOLERANCE * 100 + 0.5)))
    .. " worse" .. (n == 0 and "" or n == 1 and " in the run and in a re-measure"
                    or string.format(" in the run and in each of up to %d re-measures", n)) .. ")"
  print(title)
  print(string.rep("=", #title))
  local base, why = read_json(M.BASELINE)
  if not base then
    print("  no baseline to compare with (" .. why .. ")")
  else
    print("  baseline from: " .. tostring(base.from and base.from.run or "?"))
    print(string.format("  this run: load %s -> %s%s", tostring(meta.load_before), tostring(meta.load_after),
      meta.cpu_pressure and string.format(", CPU pressure %.0f %% (the share of the time some task waited "
        .. "for a CPU, /proc/pressure/cpu)", meta.cpu_pressure * 100) or ""))
    if quick then
      print(string.format("  BENCH_QUICK run: only missing rows and ratios more than %gx worse are verdicts",
                          M.QUICK_FACTOR))
    end
    local lines, bad, record = M.compare(base, quick, remeasure)
    run.remeasure = record
    for _, l in ipairs(lines) do print(l) end
    print(string.format("  %d REGRESSED%s", bad, bad == 0 and " (every baseline row within tolerance)" or ""))
  end
  local text = json.encode(run)
  local ok, err = write_file(M.LAST, text)
  print(ok and ("  this run's rows: " .. M.LAST) or ("  could not write " .. M.LAST .. ": " .. tostring(err)))
  if ok and not quick then     -- kept for a refresh from several runs
    os.execute("mkdir -p " .. M.RUNS)
    write_file(string.format("%s/%s-%s.json", M.RUNS, (tostring(meta.date):gsub("[^%w]", "")),
                             (tostring(meta.commit):gsub("[^%w]", ""))), text)
  end
end

-- lua5.4 bench/guard.lua refresh [RUN.json ...]: bench/baseline.json from
-- the runs named, else from runs_to_refresh()
if arg and arg[0] and arg[0]:match("guard%.lua$") then
  if arg[1] ~= "refresh" then
    io.stderr:write("usage: lua5.4 bench/guard.lua refresh [RUN.json ...]   (from the top of the tree)\n")
    os.exit(2)
  end
  local runs, err = {}, nil
  if arg[2] then
    for i = 2, #arg do
      local r, e = read_json(arg[i])
      if not r then runs, err = nil, e break end
      if r.from and r.from.quick then runs, err = nil, arg[i] .. " is from a BENCH_QUICK run; refusing" break end
      runs[#runs + 1] = r
    end
  else
    runs, err = runs_to_refresh()
  end
  if not runs then
    io.stderr:write("bench-baseline: ", err, "\n")
    os.exit(1)
  end
  local b = M.baseline_of(runs, read_json(M.BASELINE))
  local n = 0
  for _ in pairs(b.rows) do n = n + 1 end
  assert(write_file(M.BASELINE, json.encode(b)))
  print(string.format("bench-baseline: %d rows from %d run%s written to %s:", n, #runs, #runs == 1 and "" or "s",
                      M.BASELINE))
  for _, r in ipairs(b.runs) do print("  " .. r) end
  if #runs == 1 then
    print("  one run: its ratios are the baseline as they are; a median of 3 runs is steadier (make bench x3)")
  end
end

return M
