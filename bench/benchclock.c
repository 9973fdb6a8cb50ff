/*
** benchclock.c -- a tiny Lua module for the Lua side of the benchmarks
** (build/bench/benchclock.so; not part of the library):
**   benchclock.now()      CLOCK_MONOTONIC seconds (a float)
**   benchclock.sleep(s)   blocks in nanosleep for s seconds, without CPU and
**                         without forking (the failure-latency sleepers)
**   benchclock.memcpy(s)  seconds one memcpy of s's bytes into a buffer takes
**                         (the buffer touched first: the codec rows' floor)
**   benchclock.fork_floor(n, fn)
**                         the least a fork worker of a Lua process with our
**                         guarantees does: n forks of this process, each
**                         child keeping the guarantees (guarantees.h), then
**                         calling fn(i) (i = 0..n-1) with lua_pcall,
**                         flushing stdio and leaving with _exit(0); the
**                         parent reaps each as floor_fork --safe does
*/
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "lua.h"
#include "lauxlib.h"
#include "guarantees.h"

#define MAXN 1024

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

/* fork_floor(n, fn).  Its lifeline is its upvalue, made on the first call
** and held for the life of the process (its write end is what the
** children's lifelines wait on).  A fork that fails raises once the
** children already started are reaped. */
static int l_fork_floor(lua_State *L) {
  int n = (int)luaL_checkinteger(L, 1), i, err = 0;
  Lifeline *l = lua_touserdata(L, lua_upvalueindex(1));
  pid_t pids[MAXN];
  int pidfds[MAXN];
  luaL_checktype(L, 2, LUA_TFUNCTION);
  luaL_argcheck(L, n >= 1 && n <= MAXN, 1, "1..1024 workers");
  if (l->fd[0] < 0 && lifeline_make(l) != 0)
    return luaL_error(L, "pipe2: %s", strerror(errno));
  fflush(NULL);   /* as our start does: buffers are not the children's */
  for (i = 0; i < n; i++) {
    pid_t p = fork();
    if (p == 0) {
      guarantees_child(l);
      lua_pushvalue(L, 2);
      lua_pushinteger(L, i);
      lua_pcall(L, 1, 0, 0);
      fflush(NULL);
      _exit(0);
    }
    if (p < 0) {
      err = errno;
      break;
    }
    pids[i] = p;
    pidfds[i] = guarantees_pidfd(p);
  }
  n = i;
  for (i = 0; i < n; i++) guarantees_reap(pids[i], pidfds[i]);
  if (err != 0) return luaL_error(L, "fork: %s", strerror(err));
  return 0;
}

int luaopen_benchclock(lua_State *L);
__attribute__((visibility("default")))
int luaopen_benchclock(lua_State *L) {
  static const luaL_Reg f[] = { {"now", l_now}, {"sleep", l_sleep},
                                  {"memcpy", l_memcpy}, {NULL, NULL} };
  Lifeline *l;
  luaL_newlib(L, f);                               /* M */
  l = lua_newuserdatauv(L, sizeof *l, 0);          /* M lifeline */
  l->fd[0] = l->fd[1] = -1;
  lua_pushcclosure(L, l_fork_floor, 1);            /* M fork_floor */
  lua_setfield(L, -2, "fork_floor");               /* M */
  return 1;
}
