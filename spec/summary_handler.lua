-- busted output: the usual terminal report, then one machine-readable line
-- "SUMMARY <passed> <failed>" that scripts/check.sh adds up across runs.
-- Errors (a spec file that fails to load, a failing hook) count as failures.
-- With MP_SPEC_NOW set (the Makefile sets it), the name of the running spec
-- is kept in that file, which is removed when the suite ends: a run killed
-- by its time bound, or by a signal, leaves the name of the spec it was in.
return function(options)
  local busted = require "busted"
  local handler = require "busted.outputHandlers.utfTerminal"(options)
  local now = os.getenv("MP_SPEC_NOW")
  if now then
    busted.subscribe({ "test", "start" }, function(element)
      local f = io.open(now, "w")
      if f then
        f:write(handler.getFullName(element), " (", element.trace and element.trace.short_src or "?",
                ":", element.trace and element.trace.currentline or "?", ")\n")
        f:close()
      end
      return nil, true
    end)
  end
  busted.subscribe({ "suite", "end" }, function()
    io.write(string.format("SUMMARY %d %d\n", handler.successesCount,
                           handler.failuresCount + handler.errorsCount))
    io.flush()
    if now then os.remove(now) end
    return nil, true
  end)
  return handler
end
