-- luarocks --lua-version=5.4 make [--tree DIR]: builds with the Makefile and
-- installs the module (multiprocessing), its C core (multiprocessing.core),
-- the worker program next to the core and mprun; the C header and the man
-- pages go to the rock's own directory (include/, doc/).
--
-- The source is the git checkout this file sits in: `luarocks make` builds
-- from it and fetches nothing.  (The project has no public repository yet;
-- when it has one, its git URL goes here, with the version's tag.)
rockspec_format = "3.0"
package = "lua-multiprocessing"
version = "0.2.0-1"
source = {
  url = "git+file://.",
}
description = {
  summary = "Worker processes for Lua 5.4: start, join, exceptions, sharing",
  detailed = [[
Start N Lua worker processes that run fn(i, ...), join them with timeouts,
get a worker's error and traceback back as an exception object, and take the
whole group down cleanly when one fails -- torch.multiprocessing for Lua,
with fork, spawn and forkserver start methods, shared arrays, queues, pipes
and locks, and an embedding API for C hosts (multiprocessing.h).  Linux.
]],
  license = "MIT",
  labels = { "process", "multiprocessing", "parallel", "ipc" },
}
supported_platforms = { "linux" }
dependencies = {
  "lua >= 5.4, < 5.5",
}
build = {
  type = "make",
  build_variables = {
    CFLAGS = "$(CFLAGS)",
    LUA = "$(LUA)",
  },
  install_variables = {
    INSTALL_CMOD = "$(LIBDIR)",
    INSTALL_LMOD = "$(LUADIR)",
    INSTALL_BIN = "$(BINDIR)",
    INSTALL_INC = "$(PREFIX)/include",
    INSTALL_MAN = "$(PREFIX)/doc",
  },
  copy_directories = { "doc", "examples" },
}
