/*
** ledger.c -- the file_system references a worker holds, written where its
** parent can read them after the worker is gone.
**
** A worker that exits normally gives its references back (mp_array_exit);
** a killed one cannot, and its names would stay in /dev/shm until the
** tracker removes them at the end of the whole job.  So each worker keeps a
** ledger in its slot of the context's report memfd (reports.c): the names
** it holds references on, and how many.  An entry is written with one
** pwrite, so a kill never leaves half of one.  The order of updates never
** overcounts: a reference is taken before it is entered, and leaves the
** ledger before it is given back.  When the context settles, its parent
** gives back what each ledger still lists (mp_ledger_settle); the last
** reference unlinks the name.  What a kill between the two steps leaves,
** or what does not fit in a full ledger, the tracker still removes.
**
** The worker's side lives in its registry: a Ledger userdata whose
** uservalues map each name to its entry's index, each index to its count
** (so that an update is one 8-byte pwrite), and list the spare entries.
*/
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include "mp.h"
#include "sharing.h"

#define LEDGER_T   "multiprocessing.Ledger"

enum { UV_NAMES = 1, UV_COUNTS, UV_SPARE, UV_N = UV_SPARE };

typedef struct Entry {
  char name[MP_SHM_NAMELEN];
  int64_t held;                 /* references; 0: a free entry */
} Entry;

/* At 'at': the number of entries ever used, then the entries. */
#define LEDGER_HEAD    ((off_t)sizeof(uint64_t))
#define LEDGER_ENTRIES ((uint64_t)((MP_LEDGER_BYTES - LEDGER_HEAD) / \
                                   (off_t)sizeof(Entry)))

typedef struct Ledger {
  int fd;                       /* the context's report memfd */
  mp_Mark mark;                 /* set before the first entry is written */
  off_t at;                     /* where this worker's ledger starts */
  pid_t owner;                  /* a fork of the worker writes no ledger */
  uint64_t used;                /* entries ever used */
} Ledger;

static off_t entry_at(const Ledger *g, lua_Integer k) {
  return g->at + LEDGER_HEAD + (off_t)k * (off_t)sizeof(Entry);
}

static int put(int fd, const void *p, size_t n, off_t at) {
  ssize_t k;
  do k = pwrite(fd, p, n, at); while (k < 0 && errno == EINTR);
  return k == (ssize_t)n;
}

/* Its tables come with the first reference: most workers never take one.
** Owned by nobody (0) until a worker takes it. */
void mp_ledger_new(lua_State *L, int fd) {
  Ledger *g = (Ledger *)lua_newuserdatauv(L, sizeof(Ledger), UV_N); /* g */
  memset(g, 0, sizeof *g);
  g->fd = fd;
  luaL_newmetatable(L, LEDGER_T);   /* g mt: a name for luaL_testudata */
  lua_setmetatable(L, -2);                            /* g */
}

/* 'self' is the worker's pid, which it learnt as it detached. */
void mp_ledger_open(lua_State *L, int fd, off_t at, pid_t self,
                    const mp_Mark *mark) {
  Ledger *g;
  lua_getfield(L, LUA_REGISTRYINDEX, MP_LEDGER_KEY);  /* g|x */
  g = (Ledger *)luaL_testudata(L, -1, LEDGER_T);
  lua_pop(L, 1);                                      /* */
  if (g == NULL || g->owner != 0 || g->fd != fd) {
    mp_ledger_new(L, fd);                             /* g */
    g = (Ledger *)lua_touserdata(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, MP_LEDGER_KEY);  /* */
  }
  g->mark = *mark;
  g->at = at;
  g->owner = self;
}

/* Pushes this process's ledger and returns it, or returns NULL and pushes
** nothing (not a worker, or a fork of one). */
static Ledger *own_ledger(lua_State *L) {
  Ledger *g;
  int uv;
  lua_getfield(L, LUA_REGISTRYINDEX, MP_LEDGER_KEY);  /* g */
  g = (Ledger *)luaL_testudata(L, -1, LEDGER_T);
  if (g == NULL || g->owner != getpid()) {
    lua_pop(L, 1);                                    /* */
    return NULL;
  }
  if (lua_getiuservalue(L, -1, UV_NAMES) == LUA_TNIL) /* g names|nil */
    for (uv = 1; uv <= UV_N; uv++) {
      lua_newtable(L);                                /* g nil t */
      lua_setiuservalue(L, -3, uv);                   /* g nil */
    }
  lua_pop(L, 1);                                      /* g */
  return g;
}

/* An entry for a new name: a spare one (the list at 'spare'), else one
** never used; -1 when the ledger is full. */
static lua_Integer new_entry(lua_State *L, Ledger *g, int spare) {
  lua_Integer n = (lua_Integer)lua_rawlen(L, spare), k;
  uint64_t used = g->used + 1;
  if (n > 0) {                                        /* pop spare[n] */
    lua_rawgeti(L, spare, n);                         /* k */
    k = lua_tointeger(L, -1);
    lua_pop(L, 1);                                    /* */
    lua_pushnil(L);
    lua_rawseti(L, spare, n);
    return k;
  }
  if (g->used >= LEDGER_ENTRIES) return -1;
  if (g->used == 0) mp_mark_set(&g->mark);  /* the parent reads it now */
  if (!put(g->fd, &used, sizeof used, g->at)) return -1;
  return (lua_Integer)g->used++;
}

void mp_ledger_note(lua_State *L, const char *name, int delta) {
  int top = mp_stack_top(L);
  Ledger *g = own_ledger(L);                          /* g */
  int gi, names, counts, spare;
  lua_Integer k;
  int64_t held;
  if (g == NULL) return;
  gi = lua_gettop(L);
  lua_getiuservalue(L, gi, UV_NAMES);
  lua_getiuservalue(L, gi, UV_COUNTS);
  lua_getiuservalue(L, gi, UV_SPARE);                 /* g names counts spare */
  names = gi + 1, counts = gi + 2, spare = gi + 3;
  if (lua_getfield(L, names, name) == LUA_TNUMBER) {  /* ... spare k */
    k = lua_tointeger(L, -1);
    lua_rawgeti(L, counts, k);                        /* ... spare k held */
    held = (int64_t)lua_tointeger(L, -1) + delta;
    if (held < 0) held = 0;
    put(g->fd, &held, sizeof held, entry_at(g, k) + offsetof(Entry, held));
  } else if (delta > 0 && (k = new_entry(L, g, spare)) >= 0) {
    Entry e;
    memset(&e, 0, sizeof e);
    memcpy(e.name, name, strnlen(name, MP_SHM_NAMELEN - 1));
    e.held = held = delta;
    put(g->fd, &e, sizeof e, entry_at(g, k));
  } else {
    lua_settop(L, gi - 1);      /* full: the tracker has it still */
    mp_stack_check(L, top, 0);
    return;
  }
  if (held > 0) {
    lua_pushinteger(L, k);
    lua_setfield(L, names, name);
    lua_pushinteger(L, (lua_Integer)held);
    lua_rawseti(L, counts, k);
  } else {                      /* the entry is spare again */
    lua_pushnil(L);
    lua_setfield(L, names, name);
    lua_pushnil(L);
    lua_rawseti(L, counts, k);
    lua_pushinteger(L, k);
    lua_rawseti(L, spare, (lua_Integer)lua_rawlen(L, spare) + 1);
  }
  lua_settop(L, gi - 1);                              /* */
  mp_stack_check(L, top, 0);
}

void mp_ledger_settle(lua_State *L, int fd, off_t at,
                      mp_GiveBack give_back) {
  Entry buf[256];
  uint64_t used, k = 0;
  if (pread(fd, &used, sizeof used, at) != (ssize_t)sizeof used) return;
  if (used > (uint64_t)LEDGER_ENTRIES) used = (uint64_t)LEDGER_ENTRIES;
  while (k < used) {
    size_t n = used - k < 256 ? (size_t)(used - k) : 256, i;
    ssize_t got = pread(fd, buf, n * sizeof(Entry),
                        at + LEDGER_HEAD + (off_t)k * (off_t)sizeof(Entry));
    if (got < (ssize_t)sizeof(Entry)) return;
    n = (size_t)got / sizeof(Entry);
    for (i = 0; i < n; i++)
      if (buf[i].held > 0) {
        buf[i].name[MP_SHM_NAMELEN - 1] = '\0';
        give_back(L, buf[i].name, buf[i].held);
      }
    k += n;
  }
}
