/*
** worker_main.c -- the worker program: the Lua of lua5.4 without its REPL
** (no readline to load), so a fresh worker starts sooner.  It is what a
** fresh worker runs by default, in place of a stock lua5.4 of the same
** release (executable.c), and in embedding hosts whose own executable does
** not run workers.
**
** A minimal lua.c: `worker -e chunk [-e chunk ...]` runs each chunk in a
** fresh state as `lua5.4 -e chunk` would: the standard libraries, the
** global 'arg', the collector in generational mode, LUA_INIT_5_4 (or
** LUA_INIT) first; exit status 0, or 1 after printing the error and its
** traceback.  The worker protocol's command line is one such call
** (multiprocessing.h); the core itself is loaded by the chunk (the program
** links only liblua).
*/
#include <stdio.h>
#include <stdlib.h>

#include "multiprocessing.h"

/* As lua.c's handle_luainit: "@file" runs the file, else the text. */
static int run_luainit(lua_State *L) {
  const char *name = "=LUA_INIT_5_4";
  const char *init = getenv(name + 1);
  int status;
  if (init == NULL) {
    name = "=LUA_INIT";
    init = getenv(name + 1);
  }
  if (init == NULL) return LUA_OK;
  lua_pushcfunction(L, lmp_traceback_);                 /* h */
  if (init[0] == '@')
    status = luaL_loadfile(L, init + 1);                /* h chunk */
  else
    status = luaL_loadbuffer(L, init, strlen(init), name);
  if (status == LUA_OK) status = lua_pcall(L, 0, 0, -2);  /* h [msg] */
  return status;
}

/* lua.c's pmain, protected: the state it gives its chunks (libraries,
** 'arg' -- no script: arg[0] is the program, the options follow --, the
** collector in generational mode, LUA_INIT), then the chunks.  Pushes
** whether all ran (an error is printed where it happens). */
static int pmain(lua_State *L) {
  int argc = (int)lua_tointeger(L, 1);
  char **argv = (char **)lua_touserdata(L, 2);
  int i;
  luaL_checkversion(L);
  luaL_openlibs(L);
  lua_createtable(L, argc, 1);                          /* argc argv arg */
  for (i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i);
  }
  lua_setglobal(L, "arg");                              /* argc argv */
  lua_gc(L, LUA_GCGEN, 0, 0);
  if (run_luainit(L) != LUA_OK) {                       /* ... h msg */
    fprintf(stderr, "%s: %s\n", argv[0], lua_tostring(L, -1));
    fflush(stderr);
    lua_pushboolean(L, 0);
    return 1;
  }
  lua_pushboolean(L, lmp_do_chunks(L, argc, argv));     /* ok */
  return 1;
}

int main(int argc, char **argv) {
  lua_State *L;
  int status, ok;
  if (argc < 3) {
    fprintf(stderr, "usage: %s -e chunk [-e chunk ...]\n",
            argc > 0 ? argv[0] : "worker");
    return 1;
  }
  L = luaL_newstate();
  if (L == NULL) {
    fprintf(stderr, "%s: cannot create state: not enough memory\n", argv[0]);
    return 1;
  }
  lua_pushcfunction(L, pmain);                          /* pmain */
  lua_pushinteger(L, argc);                             /* pmain argc */
  lua_pushlightuserdata(L, argv);                       /* pmain argc argv */
  status = lua_pcall(L, 2, 1, 0);                       /* ok|msg */
  ok = status == LUA_OK && lua_toboolean(L, -1);
  if (status != LUA_OK) {
    fprintf(stderr, "%s: %s\n", argv[0], lua_tostring(L, -1));
    fflush(stderr);
  }
  lua_close(L);
  return ok ? 0 : 1;
}
