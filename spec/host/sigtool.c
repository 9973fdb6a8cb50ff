/*
** sigtool.c -- a tiny Lua module for the pool specs: a worker that ignores
** SIGTERM, as some programs do, so that only SIGKILL ends it.
**   sigtool.ignore_term()   signal(SIGTERM, SIG_IGN)
*/
#include <signal.h>

#include "lauxlib.h"
#include "lua.h"

static int l_ignore_term(lua_State *L) {
  lua_pushboolean(L, signal(SIGTERM, SIG_IGN) != SIG_ERR);
  return 1;
}

LUAMOD_API int luaopen_sigtool(lua_State *L);

int luaopen_sigtool(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"ignore_term", l_ignore_term}, {NULL, NULL}
  };
  luaL_newlib(L, funcs);
  return 1;
}
