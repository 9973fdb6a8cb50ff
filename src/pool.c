/*
** pool.c -- what mp.Pool (lua/multiprocessing/pool.lua) needs from C: the
** number of processors, a monotonic clock for task timeouts, whether
** stderr is a terminal (the progress line), and the exceptions of failed
** tasks, including mp.TimeoutError (a kind of ProcessException).  The pool
** itself is Lua: a policy over ProcessContexts and Queues.
*/
#include <string.h>
#include <unistd.h>

#include "mp.h"

#define MP_EXC_TIMEOUT "multiprocessing.TimeoutError"

/* cpu_count() -> the number of online processors (at least 1) */
static int l_cpu_count(lua_State *L) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  lua_pushinteger(L, n > 0 ? n : 1);
  return 1;
}

/* _now() -> CLOCK_MONOTONIC seconds */
static int l_now(lua_State *L) {
  lua_pushnumber(L, mp_now());
  return 1;
}

/* _isatty(fd) -> boolean */
static int l_isatty(lua_State *L) {
  lua_pushboolean(L, isatty((int)luaL_checkinteger(L, 1)));
  return 1;
}

/* _exception(kind, fields) -> a new exception of kind "base", "raised",
** "exited" or "timeout" with the fields of the table 'fields'. */
static int l_exception(lua_State *L) {
  static const char *const kinds[] = {"base", "raised", "exited", "timeout",
                                      NULL};
  static const char *const tnames[] = {MP_EXC_BASE, MP_EXC_RAISED,
                                       MP_EXC_EXITED, MP_EXC_TIMEOUT};
  int kind = luaL_checkoption(L, 1, NULL, kinds);
  luaL_checktype(L, 2, LUA_TTABLE);
  mp_exception_new(L, tnames[kind], 2);
  return 1;
}

/* TimeoutError: a ProcessException, read and printed as the others are. */
static void open_timeout_error(lua_State *L) {
  luaL_newmetatable(L, MP_EXC_TIMEOUT);         /* mod mt */
  luaL_getmetatable(L, MP_EXC_BASE);            /* mod mt base */
  lua_getfield(L, -1, "__index");
  lua_setfield(L, -3, "__index");
  lua_getfield(L, -1, "__tostring");
  lua_setfield(L, -3, "__tostring");
  lua_setfield(L, -2, "__parent");              /* mod mt */
  lua_setfield(L, -2, "TimeoutError");          /* mod */
}

void mp_open_pool(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"cpu_count", l_cpu_count}, {"_now", l_now}, {"_isatty", l_isatty},
    {"_exception", l_exception}, {NULL, NULL}
  };
  open_timeout_error(L);
  luaL_setfuncs(L, funcs, 0);
}
