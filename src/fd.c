/*
** fd.c -- an owned descriptor that crosses to a worker (multiprocessing.Fd):
** what a tool built on the library (the launcher) hands a worker as its
** stdout, a log file or a pipe end.  The codec sends the descriptor itself
** (SCM_RIGHTS for spawned workers); the receiver owns its copy.
**
**   core._fd(n) -> Fd       owns descriptor n from now on
**   fd:fileno() -> n        borrowed
**   fd:detach() -> n        the caller owns it; the Fd is closed
**   fd:close()              also __gc and __close
*/
#include <unistd.h>

#include "codec.h"
#include "mp.h"

#define FD_T "multiprocessing.Fd"

typedef struct Fd { int fd; } Fd;

static Fd *push_fd(lua_State *L, int fd) {
  Fd *f = lua_newuserdatauv(L, sizeof *f, 0);
  f->fd = fd;
  luaL_setmetatable(L, FD_T);
  return f;
}

static Fd *check_fd(lua_State *L, int arg) {
  Fd *f = mp_checkudata(L, arg, FD_T);
  if (f->fd < 0) luaL_error(L, "the descriptor is closed");
  return f;
}

static int fd_close(lua_State *L) {
  Fd *f = mp_checkudata(L, 1, FD_T);
  if (f->fd >= 0) close(f->fd);
  f->fd = -1;
  return 0;
}

static int fd_fileno(lua_State *L) {
  lua_pushinteger(L, check_fd(L, 1)->fd);
  return 1;
}

static int fd_detach(lua_State *L) {
  Fd *f = check_fd(L, 1);
  lua_pushinteger(L, f->fd);
  f->fd = -1;
  return 1;
}

static int fd_tostring(lua_State *L) {
  Fd *f = mp_checkudata(L, 1, FD_T);
  if (f->fd < 0)
    lua_pushliteral(L, "Fd (closed)");
  else
    lua_pushfstring(L, "Fd (%d)", f->fd);
  return 1;
}

static void fd_encode(lua_State *L, int idx, mp_Writer *w) {
  Fd *f = lua_touserdata(L, idx);
  if (f->fd < 0) luaL_error(L, "cannot send a closed descriptor");
  mp_write_fd(L, w, f->fd);
}

static void fd_decode(lua_State *L, mp_Reader *r) {
  int fd = mp_read_fd(L, r);
  push_fd(L, fd);
}

static const mp_CodecType fd_codec = {FD_T, fd_encode, fd_decode};

/* _fd(n) -> Fd owning descriptor n. */
static int l_fd(lua_State *L) {
  lua_Integer n = mp_checkinteger(L, 1);
  luaL_argcheck(L, n >= 0 && n <= 0x7fffffff, 1, "a descriptor expected");
  push_fd(L, (int)n);
  return 1;
}

void mp_open_fd(lua_State *L) {
  static const luaL_Reg meta[] = {
    {"__gc", fd_close}, {"__close", fd_close}, {"__tostring", fd_tostring},
    {NULL, NULL}
  };
  static const luaL_Reg methods[] = {
    {"close", fd_close}, {"fileno", fd_fileno}, {"detach", fd_detach},
    {NULL, NULL}
  };
  mp_new_class(L, FD_T, meta, methods);
  lua_pop(L, 1);
  mp_codec_register(L, &fd_codec);
  lua_pushcfunction(L, l_fd);
  lua_setfield(L, -2, "_fd");
}
