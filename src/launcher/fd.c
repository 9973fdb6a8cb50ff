/*
** fd.c -- the launcher's descriptors as the core's Fd objects: made,
** borrowed and taken (launcher.h).  The bottom of the launcher: launcher.c,
** relay.c and rank.c call down to it.
*/
#include <unistd.h>

#include "launcher.h"

static int wrap_fd(lua_State *L) {
  lua_getfield(L, LUA_REGISTRYINDEX, FD_NEW);     /* n _fd */
  lua_insert(L, 1);                               /* _fd n */
  lua_call(L, 1, 1);                              /* Fd */
  return 1;
}

int lnc_wrap_fd(lua_State *L, int fd) {
  int status;
  lua_pushcfunction(L, wrap_fd);                  /* wrap */
  lua_pushinteger(L, fd);                         /* wrap n */
  status = lua_pcall(L, 1, 1, 0);                 /* Fd | err */
  if (status != LUA_OK) close(fd);
  return status;
}

void lnc_push_fd(lua_State *L, int fd) {
  if (lnc_wrap_fd(L, fd) != LUA_OK) lua_error(L);  /* Fd */
}

/* Calls fd:<method>() on the Fd at 'arg'; the integer it returns. */
static int fd_call(lua_State *L, int arg, const char *method) {
  int fd;
  luaL_checkudata(L, arg, FD_T);
  lua_getfield(L, arg, method);                   /* f */
  lua_pushvalue(L, arg);                          /* f Fd */
  lua_call(L, 1, 1);                              /* n */
  fd = (int)lua_tointeger(L, -1);
  lua_pop(L, 1);
  return fd;
}

int lnc_fileno(lua_State *L, int arg) { return fd_call(L, arg, "fileno"); }

int lnc_take(lua_State *L, int arg) {
  if (lua_isnoneornil(L, arg)) return -1;
  return fd_call(L, arg, "detach");
}
