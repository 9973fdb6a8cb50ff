/*
** nested.c -- a Lua value inside a userdata's encoding: a Barrier's action,
** the lock of a synchronised Value or Array.
**
** The value is encoded on its own (mp_encode, with the outer encoding's
** flags) and written into the outer encoding as
**   u32 size, u32 nfds, the bytes; its descriptors beside the outer ones.
** The inner box is held by the outer one, which so keeps alive what it
** borrowed descriptors from.  Reading it back decodes those bytes with the
** outer decoding's flags; descriptors the value does not take are closed,
** also when decoding raises (they wait in a userdata until collected).
**
** An inner encoding has no memory of the outer one, so a value that leads
** back to its owner (a Barrier whose action has the Barrier as an upvalue)
** would be encoded for ever: while an owner's value is being written, the
** owner met again writes nil instead (registry NESTING_KEY: owner -> true).
** Decoding is bounded the same way: at most MAX_DEPTH values inside each
** other (registry DEPTH_KEY), whatever a hostile message claims.
*/
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "mp.h"
#include "codec.h"
#include "sharing.h"

#define FDSET_T "multiprocessing.codec.FdSet"
#define NESTING_KEY "multiprocessing.nested.writing"
#define DEPTH_KEY "multiprocessing.nested.depth"
#define MAX_NESTED_FDS 4096
#define MAX_DEPTH 16

typedef struct FdSet {
  size_t n;
  int fd[1];             /* n of them, -1 once taken or closed */
} FdSet;

static void fdset_close(FdSet *s) {
  size_t i;
  for (i = 0; i < s->n; i++)
    if (s->fd[i] >= 0) { close(s->fd[i]); s->fd[i] = -1; }
}

static int fdset_gc(lua_State *L) {
  fdset_close((FdSet *)lua_touserdata(L, 1));
  return 0;
}

/* Pushes the owners whose values are being written (registry; entries
** live only while their value is written, so strong keys do). */
static void push_writing(lua_State *L) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, NESTING_KEY) == LUA_TTABLE) return;
  lua_pop(L, 1);
  lua_newtable(L);
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, NESTING_KEY);
}

/* Protected: encodes value 1 with flags 2 named 3 into the mp_Encoded
** (light userdata 4); returns the box that owns the encoding. */
static int encode_inner(lua_State *L) {
  const char *names[1];
  names[0] = lua_tostring(L, 3);
  mp_encode(L, 1, 1, (int)lua_tointeger(L, 2), names, "to another process",
            (mp_Encoded *)lua_touserdata(L, 4));
  return 1;
}

void mp_write_value(lua_State *L, mp_Writer *w, int owner, const char *what) {
  mp_Encoded e;
  uint32_t head[2];
  size_t i;
  int t, mine, st;
  owner = lua_absindex(L, owner);
  push_writing(L);                                      /* v writing */
  lua_insert(L, -2);                                    /* writing v */
  t = lua_gettop(L) - 1;
  lua_pushvalue(L, owner);
  mine = lua_rawget(L, t) == LUA_TNIL;
  lua_pop(L, 1);
  if (mine) {                                           /* mark the owner */
    lua_pushvalue(L, owner);
    lua_pushboolean(L, 1);
    lua_rawset(L, t);
  } else {                      /* its value is being written further up */
    lua_pop(L, 1);
    lua_pushnil(L);                                     /* writing nil */
  }
  lua_pushcfunction(L, encode_inner);
  lua_insert(L, -2);                                    /* writing f v */
  lua_pushinteger(L, mp_write_flags(w));
  lua_pushstring(L, what);
  lua_pushlightuserdata(L, &e);
  st = lua_pcall(L, 4, 1, 0);                           /* writing box|err */
  if (mine) {
    lua_pushvalue(L, owner);
    lua_pushnil(L);
    lua_rawset(L, t);
  }
  lua_remove(L, t);                                     /* box|err */
  if (st != LUA_OK) lua_error(L);
  if (e.size > UINT32_MAX || e.nfds > MAX_NESTED_FDS)
    luaL_error(L, "cannot send %s: too big", what);
  head[0] = (uint32_t)e.size;
  head[1] = (uint32_t)e.nfds;
  mp_write_bytes(L, w, head, sizeof head);
  mp_write_bytes(L, w, e.data, e.size);
  for (i = 0; i < e.nfds; i++) mp_write_fd(L, w, e.fds[i]);
  mp_write_hold(L, w);                                  /* (box held) */
}

typedef struct Nested {
  const char *data;
  size_t size;
  int flags;
  FdSet *set;
} Nested;

/* Protected: decodes the Nested (light userdata 1); returns the value. */
static int decode_inner(lua_State *L) {
  Nested *n = (Nested *)lua_touserdata(L, 1);
  if (mp_decode(L, n->data, n->size, n->flags, n->set->fd, n->set->n) != 1)
    luaL_error(L, "bad nested value encoding");
  return 1;
}

static int depth_add(lua_State *L, int delta) {
  int d;
  lua_getfield(L, LUA_REGISTRYINDEX, DEPTH_KEY);
  d = (int)lua_tointeger(L, -1) + delta;
  lua_pop(L, 1);
  lua_pushinteger(L, d);
  lua_setfield(L, LUA_REGISTRYINDEX, DEPTH_KEY);
  return d;
}

void mp_read_value(lua_State *L, mp_Reader *r) {
  uint32_t head[2];
  Nested n;
  size_t i;
  int st;
  memcpy(head, mp_read_bytes(L, r, sizeof head), sizeof head);
  n.data = mp_read_bytes(L, r, head[0]);
  n.size = head[0];
  n.flags = mp_read_flags(r);
  if (head[1] > MAX_NESTED_FDS) luaL_error(L, "bad nested value encoding");
  n.set = (FdSet *)lua_newuserdatauv(L, sizeof(FdSet) + head[1] * sizeof(int),
                                     0);                /* set */
  n.set->n = 0;
  if (luaL_newmetatable(L, FDSET_T)) {
    lua_pushcfunction(L, fdset_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  for (i = 0; i < head[1]; i++) {
    n.set->fd[i] = -1;
    n.set->n = i + 1;
    n.set->fd[i] = mp_read_fd(L, r);
  }
  if (depth_add(L, 1) > MAX_DEPTH) {
    depth_add(L, -1);
    luaL_error(L, "bad nested value encoding (nested too deep)");
  }
  lua_pushcfunction(L, decode_inner);
  lua_pushlightuserdata(L, &n);
  st = lua_pcall(L, 1, 1, 0);                           /* set v|err */
  depth_add(L, -1);
  fdset_close(n.set);
  if (st != LUA_OK) lua_error(L);
  lua_remove(L, -2);                                    /* v */
}
