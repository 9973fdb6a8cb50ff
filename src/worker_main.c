/*
** worker_main.c -- the worker executable, for embedding hosts whose own
** executable cannot run a worker (mp.set_executable, executable.c).
**
** A minimal lua.c: `worker -e chunk [-e chunk ...]` runs each chunk in a
** fresh state with the standard libraries, as `lua5.4 -e chunk` would;
** exit status 0, or 1 after printing the error and its traceback.  The
** core itself is loaded by the chunk (the program links only liblua).
*/
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"

static int traceback(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
      return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)",
                          luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

static int run_chunk(lua_State *L, const char *progname, const char *chunk) {
  int status;
  lua_pushcfunction(L, traceback);
  status = luaL_loadbuffer(L, chunk, strlen(chunk), "=(command line)");
  if (status == LUA_OK) status = lua_pcall(L, 0, 0, -2);
  if (status != LUA_OK) {
    fprintf(stderr, "%s: %s\n", progname, lua_tostring(L, -1));
    fflush(stderr);
  }
  lua_settop(L, 0);
  return status == LUA_OK;
}

int main(int argc, char **argv) {
  const char *progname = argc > 0 ? argv[0] : "worker";
  lua_State *L;
  int i, ok = 1;
  if (argc < 3) {
    fprintf(stderr, "usage: %s -e chunk [-e chunk ...]\n", progname);
    return EXIT_FAILURE;
  }
  L = luaL_newstate();
  if (L == NULL) {
    fprintf(stderr, "%s: cannot create state: not enough memory\n", progname);
    return EXIT_FAILURE;
  }
  luaL_openlibs(L);
  for (i = 1; ok && i < argc; i += 2) {
    if (strcmp(argv[i], "-e") != 0 || i + 1 >= argc) {
      fprintf(stderr, "%s: unexpected argument '%s' (expected -e chunk)\n",
              progname, argv[i]);
      ok = 0;
      break;
    }
    ok = run_chunk(L, progname, argv[i + 1]);
  }
  lua_close(L);
  return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
