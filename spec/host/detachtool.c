/*
** detachtool.c -- what daemon-style code does to a process, for the specs of
** spawn_spec.lua ("a worker cannot outlive its SIGKILLed parent"): close or
** dup2 over its descriptors, block or ignore a signal.  Built by the spec
** as spec_detachtool.so.
*/
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include "lua.h"
#include "lauxlib.h"

/* close_range(a, b): closes descriptors a..b */
static int l_close_range(lua_State *L) {
  int a = (int)luaL_checkinteger(L, 1), b = (int)luaL_checkinteger(L, 2);
  for (; a <= b; a++) close(a);
  return 0;
}

/* dup2_over(a, b): /dev/null on every descriptor a..b */
static int l_dup2_over(lua_State *L) {
  int a = (int)luaL_checkinteger(L, 1), b = (int)luaL_checkinteger(L, 2);
  int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
  if (null < 0) return luaL_error(L, "cannot open /dev/null");
  null = fcntl(null, F_DUPFD_CLOEXEC, b + 1);
  for (; a <= b; a++) dup2(null, a);
  close(null);
  return 0;
}

/* block(sig) / ignore(sig): sig counted from SIGRTMAX down (0 = SIGRTMAX) */
static int l_block(lua_State *L) {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGRTMAX - (int)luaL_checkinteger(L, 1));
  sigprocmask(SIG_BLOCK, &set, NULL);
  return 0;
}

static int l_ignore(lua_State *L) {
  signal(SIGRTMAX - (int)luaL_checkinteger(L, 1), SIG_IGN);
  return 0;
}

int luaopen_spec_detachtool(lua_State *L);
int luaopen_spec_detachtool(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"close_range", l_close_range}, {"dup2_over", l_dup2_over},
    {"block", l_block}, {"ignore", l_ignore}, {NULL, NULL}
  };
  luaL_newlib(L, funcs);
  return 1;
}
