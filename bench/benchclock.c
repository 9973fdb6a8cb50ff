/*
** benchclock.c -- a tiny Lua module for the Lua side of the benchmarks
** (build/bench/benchclock.so; not part of the library):
**   benchclock.now()      CLOCK_MONOTONIC seconds (a float)
**   benchclock.sleep(s)   blocks in nanosleep for s seconds, without CPU and
**                         without forking (the failure-latency sleepers)
*/
#define _GNU_SOURCE
#include <errno.h>
#include <time.h>
#include "lua.h"
#include "lauxlib.h"

static int l_now(lua_State *L) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  lua_pushnumber(L, (lua_Number)ts.tv_sec + (lua_Number)ts.tv_nsec * 1e-9);
  return 1;
}

static int l_sleep(lua_State *L) {
  double s = luaL_checknumber(L, 1);
  struct timespec ts;
  ts.tv_sec = (time_t)s;
  ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
  return 0;
}

int luaopen_benchclock(lua_State *L);
__attribute__((visibility("default")))
int luaopen_benchclock(lua_State *L) {
  static const luaL_Reg f[] = { {"now", l_now}, {"sleep", l_sleep}, {NULL, NULL} };
  luaL_newlib(L, f);
  return 1;
}
