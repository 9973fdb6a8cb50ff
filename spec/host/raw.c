/*
** raw.c -- a tiny Lua module for queue_spec.lua: raw.send(fd, bytes) writes
** to a socket behind the library's back, raw.poll(fd, ms) tells whether
** fd becomes readable, raw.setenv(name, value) sets a variable of this
** process (a worker turning a test hook on for itself), raw.ignore_term()
** makes this process ignore SIGTERM (core_spec.lua's workers that only
** SIGKILL ends).
*/
#define _POSIX_C_SOURCE 200809L
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include "lua.h"
#include "lauxlib.h"
static int l_send(lua_State *L) {
  size_t n; const char *s = luaL_checklstring(L, 2, &n);
  lua_pushinteger(L, send((int)luaL_checkinteger(L, 1), s, n, MSG_NOSIGNAL));
  return 1;
}
/* poll(fd, ms) -> true when fd is readable within ms */
static int l_poll(lua_State *L) {
  struct pollfd pf;
  pf.fd = (int)luaL_checkinteger(L, 1);
  pf.events = POLLIN;
  lua_pushboolean(L, poll(&pf, 1, (int)luaL_checkinteger(L, 2)) == 1 &&
                     (pf.revents & POLLIN));
  return 1;
}
static int l_setenv(lua_State *L) {
  lua_pushboolean(L, setenv(luaL_checkstring(L, 1), luaL_checkstring(L, 2),
                            1) == 0);
  return 1;
}
static int l_ignore_term(lua_State *L) {
  (void)L;
  signal(SIGTERM, SIG_IGN);
  return 0;
}
int luaopen_raw(lua_State *L);
int luaopen_raw(lua_State *L) {
  lua_createtable(L, 0, 3);
  lua_pushcfunction(L, l_send); lua_setfield(L, -2, "send");
  lua_pushcfunction(L, l_poll); lua_setfield(L, -2, "poll");
  lua_pushcfunction(L, l_setenv); lua_setfield(L, -2, "setenv");
  lua_pushcfunction(L, l_ignore_term); lua_setfield(L, -2, "ignore_term");
  return 1;
}
