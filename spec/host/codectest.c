/*
** codectest.c -- a userdata type registered with the codec, for
** codec_spec's "userdata types": the extension interface of codec.h seen
** from a type of its own, as array.c and channel.c use it.
**
** Built by the spec with its own copy of src/codec.c (the core keeps its
** symbols hidden); the registration lives in the Lua state's registry, so
** the core's encoder and decoder find the type and call it, and the type
** writes and reads through the same layout.
**
**   blob(data [, path]) -> a blob: a string, and a descriptor open on path
**   blobinfo(b) -> data, fd (nil: none), the path the descriptor is open on
**   fakeblob() -> a userdata whose metatable only copies the blob's __name
*/
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "lua.h"
#include "lauxlib.h"

#include "codec.h"

#define BLOB_T "codectest.blob"

typedef struct Blob {
  int fd;   /* -1: none; else owned */
} Blob;

static int blob_gc(lua_State *L) {
  Blob *b = (Blob *)luaL_checkudata(L, 1, BLOB_T);
  if (b->fd >= 0) close(b->fd);
  b->fd = -1;
  return 0;
}

/* Pushes a blob of 'data' (at stack index 'data') owning 'fd'. */
static void push_blob(lua_State *L, int data, int fd) {
  Blob *b;
  data = lua_absindex(L, data);
  b = (Blob *)lua_newuserdatauv(L, sizeof(Blob), 1);  /* b */
  b->fd = fd;
  luaL_setmetatable(L, BLOB_T);
  lua_pushvalue(L, data);                             /* b data */
  lua_setiuservalue(L, -2, 1);                        /* b */
}

static int l_blob(lua_State *L) {
  const char *path = luaL_optstring(L, 2, NULL);
  int fd = -1;
  luaL_checkstring(L, 1);
  if (path != NULL && (fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
    return luaL_error(L, "blob: cannot open %s", path);
  push_blob(L, 1, fd);
  return 1;
}

static int l_blobinfo(lua_State *L) {
  Blob *b = (Blob *)luaL_checkudata(L, 1, BLOB_T);
  char link[64], target[PATH_MAX];
  ssize_t n;
  lua_getiuservalue(L, 1, 1);                         /* data */
  if (b->fd < 0) return 1;
  lua_pushinteger(L, b->fd);                          /* data fd */
  snprintf(link, sizeof link, "/proc/self/fd/%d", b->fd);
  n = readlink(link, target, sizeof target);
  if (n < 0) return 2;
  lua_pushlstring(L, target, (size_t)n);              /* data fd target */
  return 3;
}

static int l_fakeblob(lua_State *L) {
  lua_newuserdatauv(L, sizeof(Blob), 0);              /* u */
  lua_newtable(L);                                    /* u mt */
  lua_pushliteral(L, BLOB_T);                         /* u mt name */
  lua_setfield(L, -2, "__name");                      /* u mt */
  lua_setmetatable(L, -2);                            /* u */
  return 1;
}

/* The payload: the data's length (4 bytes), the data, and whether a
** descriptor follows (1 byte); the descriptor goes beside the bytes. */
static void blob_encode(lua_State *L, int idx, mp_Writer *w) {
  Blob *b = (Blob *)lua_touserdata(L, idx);
  size_t len;
  const char *data;
  uint32_t n;
  unsigned char hasfd = b->fd >= 0;
  lua_getiuservalue(L, idx, 1);                       /* data */
  data = lua_tolstring(L, -1, &len);
  n = (uint32_t)len;
  mp_write_bytes(L, w, &n, sizeof n);
  mp_write_bytes(L, w, data, len);
  mp_write_bytes(L, w, &hasfd, 1);
  if (hasfd) mp_write_fd(L, w, b->fd);
  lua_pop(L, 1);                                      /* */
}

static void blob_decode(lua_State *L, mp_Reader *r) {
  uint32_t n;
  unsigned char hasfd;
  int fd = -1;
  memcpy(&n, mp_read_bytes(L, r, sizeof n), sizeof n);
  lua_pushlstring(L, mp_read_bytes(L, r, n), n);      /* data */
  hasfd = *(const unsigned char *)mp_read_bytes(L, r, 1);
  if (hasfd) fd = mp_read_fd(L, r);
  push_blob(L, -1, fd);                               /* data b */
  lua_remove(L, -2);                                  /* b */
}

static const mp_CodecType blob_codec = {BLOB_T, blob_encode, blob_decode};

int luaopen_codectest(lua_State *L);

int luaopen_codectest(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"blob", l_blob}, {"blobinfo", l_blobinfo}, {"fakeblob", l_fakeblob},
    {NULL, NULL}
  };
  if (luaL_newmetatable(L, BLOB_T)) {
    lua_pushcfunction(L, blob_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_pop(L, 1);
  mp_codec_register(L, &blob_codec);
  luaL_newlib(L, funcs);
  return 1;
}
