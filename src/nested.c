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
*/
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "mp.h"
#include "codec.h"
#include "sharing.h"

#define FDSET_T "multiprocessing.codec.FdSet"
#define MAX_NESTED_FDS 4096

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

void mp_write_value(lua_State *L, mp_Writer *w, const char *what) {
  const char *names[1];
  mp_Encoded e;
  uint32_t head[2];
  size_t i;
  names[0] = what;
  mp_encode(L, -1, 1, mp_write_flags(w), names, "to another process", &e);
                                                     /* v box */
  if (e.size > UINT32_MAX || e.nfds > MAX_NESTED_FDS)
    luaL_error(L, "cannot send %s: too big", what);
  head[0] = (uint32_t)e.size;
  head[1] = (uint32_t)e.nfds;
  mp_write_bytes(L, w, head, sizeof head);
  mp_write_bytes(L, w, e.data, e.size);
  for (i = 0; i < e.nfds; i++) mp_write_fd(L, w, e.fds[i]);
  mp_write_hold(L, w);                               /* v */
  lua_pop(L, 1);
}

void mp_read_value(lua_State *L, mp_Reader *r) {
  uint32_t head[2];
  const char *data;
  FdSet *set;
  size_t i;
  int n;
  memcpy(head, mp_read_bytes(L, r, sizeof head), sizeof head);
  data = mp_read_bytes(L, r, head[0]);
  if (head[1] > MAX_NESTED_FDS) luaL_error(L, "bad nested value encoding");
  set = (FdSet *)lua_newuserdatauv(L, sizeof(FdSet) + head[1] * sizeof(int),
                                   0);                  /* set */
  set->n = 0;
  if (luaL_newmetatable(L, FDSET_T)) {
    lua_pushcfunction(L, fdset_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  for (i = 0; i < head[1]; i++) {
    set->fd[i] = -1;
    set->n = i + 1;
    set->fd[i] = mp_read_fd(L, r);
  }
  n = mp_decode(L, data, head[0], mp_read_flags(r), set->fd, set->n);
                                                        /* set v... */
  fdset_close(set);
  if (n != 1) luaL_error(L, "bad nested value encoding");
  lua_remove(L, -2);                                    /* v */
}
