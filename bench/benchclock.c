/*
** benchclock.c -- a tiny Lua module for the Lua side of the benchmarks
** (build/bench/benchclock.so; not part of the library):
**   benchclock.now()      CLOCK_MONOTONIC seconds (a float)
**   benchclock.sleep(s)   blocks in nanosleep for s seconds, without CPU and
**                         without forking (the failure-latency sleepers)
**   benchclock.memcpy(s)  seconds one memcpy of s's bytes into a buffer takes
**                         (the buffer touched first: the codec rows' floor)
*/
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
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

static int l_memcpy(lua_State *L) {
  size_t n;
  const char *s = luaL_checklstring(L, 1, &n);
  char *buf = malloc(n ? n : 1);
  struct timespec a, b;
  if (buf == NULL) return luaL_error(L, "out of memory");
  memset(buf, 1, n);   /* its pages are faulted in before the clock runs */
  clock_gettime(CLOCK_MONOTONIC, &a);
  memcpy(buf, s, n);
  clock_gettime(CLOCK_MONOTONIC, &b);
  __asm__ __volatile__("" : : "r"(buf) : "memory");  /* the copy is used */
  free(buf);
  lua_pushnumber(L, (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) * 1e-9);
  return 1;
}

int luaopen_benchclock(lua_State *L);
__attribute__((visibility("default")))
int luaopen_benchclock(lua_State *L) {
  static const luaL_Reg f[] = { {"now", l_now}, {"sleep", l_sleep},
                                  {"memcpy", l_memcpy}, {NULL, NULL} };
  luaL_newlib(L, f);
  return 1;
}
