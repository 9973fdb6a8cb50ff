-- busted output: the usual terminal report, then one machine-readable line
-- "SUMMARY <passed> <failed>" that scripts/check.sh adds up across runs.
-- Errors (a spec file that fails to load, a failing hook) count as failures.
return function(options)
  local busted = require "busted"
  local handler = require "busted.outputHandlers.utfTerminal"(options)
  busted.subscribe({ "suite", "end" }, function()
    io.write(string.format("SUMMARY %d %d\n", handler.successesCount,
                           handler.failuresCount + handler.errorsCount))
    io.flush()
    return nil, true
  end)
  return handler
end
