/*
** fdtool.c -- a tiny Lua module for the audit specs: a worker that
** tampers with the descriptors it inherited.
**   fdtool.close(fd)        close(2), returns its result
**   fdtool.dup2(from, to)   dup2(2), returns its result
**   fdtool.fds()            the open descriptors, a sequence
**   fdtool.exit(code)       _exit(2) with no cleanup at all
**   fdtool.quiet()          stderr to /dev/null
*/
#include <dirent.h>
#include <fcntl.h>
#include <stdlib.h>
#include <unistd.h>

#include "lauxlib.h"
#include "lua.h"

static int l_close(lua_State *L) {
  lua_pushinteger(L, close((int)luaL_checkinteger(L, 1)));
  return 1;
}

static int l_dup2(lua_State *L) {
  lua_pushinteger(L, dup2((int)luaL_checkinteger(L, 1),
                          (int)luaL_checkinteger(L, 2)));
  return 1;
}

static int l_fds(lua_State *L) {
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  lua_Integer n = 0;
  lua_newtable(L);                                   /* t */
  if (d == NULL) return 1;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.' || atoi(e->d_name) == dirfd(d)) continue;
    lua_pushinteger(L, atoi(e->d_name));
    lua_rawseti(L, -2, ++n);
  }
  closedir(d);
  return 1;
}

static int l_exit(lua_State *L) {
  _exit((int)luaL_checkinteger(L, 1));
}

static int l_quiet(lua_State *L) {
  int fd = open("/dev/null", O_WRONLY | O_CLOEXEC);
  lua_pushboolean(L, fd >= 0 && dup2(fd, 2) == 2);
  if (fd >= 0) close(fd);
  return 1;
}

int luaopen_fdtool(lua_State *L);
int luaopen_fdtool(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"close", l_close}, {"dup2", l_dup2}, {"fds", l_fds}, {"exit", l_exit},
    {"quiet", l_quiet}, {NULL, NULL}
  };
  luaL_newlib(L, funcs);
  return 1;
}
