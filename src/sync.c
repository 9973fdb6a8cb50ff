/*
** sync.c -- peer slots, and the synchronisation objects Lock, RLock,
** Semaphore, Event, Barrier, Condition.
**
** Each object lives in a sealed memfd page and crosses to spawned workers as
** that descriptor (forked workers simply inherit it).  Every blocking wait
** is wait.c's: deadlines, EINTR and Ctrl-C are handled there.
**
** Robust mutexes: a lock whose owner died is taken over by the next
** acquirer (EOWNERDEAD -> pthread_mutex_consistent); acquire returns true,
** "previous owner died" and lock.recovered is true until the next acquire.
** glibc registers robust mutexes on the calling thread's robust list, using
** its cached thread id: processes created with a raw clone3 must have that
** fixed by their creator (forkserver.c does).
*/
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mp.h"
#include "codec.h"
#include "sharing.h"

/* ------------------------------------------------------------------ */
/* peer slots                                                          */

int mp_peers_attach(mp_Peers *p, int end) {
  int i;
  for (i = 0; i < MP_NSLOTS; i++) {
    mp_Slot *s = &p->slot[i];
    uint32_t zero = 0;
    if (__atomic_compare_exchange_n(&s->state, &zero, 1, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED)) {
      if (mp_mutex_init(&s->m, 0) != 0 || pthread_mutex_lock(&s->m) != 0) {
        __atomic_store_n(&s->state, 0, __ATOMIC_RELEASE);
        return -1;
      }
      s->pid = (int32_t)getpid();
      s->end = end;
      __atomic_add_fetch(&p->attaches, 1, __ATOMIC_ACQ_REL);
      __atomic_store_n(&s->state, 2, __ATOMIC_RELEASE);
      return i;
    }
  }
  return -1;
}

void mp_peers_detach(mp_Peers *p, int slot) {
  mp_Slot *s;
  if (slot < 0 || slot >= MP_NSLOTS) return;
  s = &p->slot[slot];
  __atomic_store_n(&s->state, 1, __ATOMIC_RELEASE);
  __atomic_store_n(&p->lastgone, s->pid, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&s->m);
  __atomic_store_n(&s->state, 0, __ATOMIC_RELEASE);
}

int mp_peers_alive(mp_Peers *p, int self, int notend) {
  int i, others = 0;
  for (i = 0; i < MP_NSLOTS; i++) {
    mp_Slot *s = &p->slot[i];
    int e;
    uint32_t two = 2;
    if (i == self) continue;
    if (__atomic_load_n(&s->state, __ATOMIC_ACQUIRE) != 2) continue;
    if (notend >= 0 && s->end == notend) continue;
    e = pthread_mutex_trylock(&s->m);
    if (e == EBUSY || e == EDEADLK) return 1;   /* EDEADLK: ours */
    if (e == EOWNERDEAD || e == 0) {
      /* the owner died holding its slot: take the slot back */
      if (e == EOWNERDEAD) pthread_mutex_consistent(&s->m);
      if (__atomic_compare_exchange_n(&s->state, &two, 1, 0, __ATOMIC_ACQ_REL,
                                      __ATOMIC_RELAXED)) {
        __atomic_store_n(&p->lastgone, s->pid, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&s->m);
        __atomic_store_n(&s->state, 0, __ATOMIC_RELEASE);
      } else {
        pthread_mutex_unlock(&s->m);
      }
    }
  }
  /* "ever attached" counts this process too */
  others = __atomic_load_n(&p->attaches, __ATOMIC_ACQUIRE) > 1;
  if (notend >= 0) {
    /* a pipe: the creator attached both ends, so an other end existed */
    others = 1;
  }
  return others ? -1 : 0;
}

/* ------------------------------------------------------------------ */
/* the synchronisation objects                                         */

#define SYNC_MAGIC 0x6d707379u   /* "mpsy" */
enum { K_LOCK, K_RLOCK, K_SEM, K_EVENT, K_BARRIER, K_COND, K_NKINDS };

static const char *const kind_tname[K_NKINDS] = {
  "multiprocessing.Lock", "multiprocessing.RLock",
  "multiprocessing.Semaphore", "multiprocessing.Event",
  "multiprocessing.Barrier", "multiprocessing.Condition"
};
static const char *const kind_short[K_NKINDS] = {
  "Lock", "RLock", "Semaphore", "Event", "Barrier", "Condition"
};

typedef struct SyncHdr {
  uint32_t magic;
  uint32_t kind;
  pthread_mutex_t m;     /* Lock, RLock */
  uint32_t value;        /* Semaphore count, Event flag, Barrier arrivals */
  uint32_t seq;          /* futex: Barrier generation, Condition notify */
  uint32_t waiters;
  uint32_t parties;      /* Barrier */
  uint32_t broken;       /* Barrier */
  uint32_t died;         /* Lock: owner death seen by a probe, not yet told */
} SyncHdr;

typedef struct Sync {
  mp_Seg seg;
  int kind;
  int recovered;         /* Lock/RLock: the last acquire took over */
  pid_t holder;          /* this process holds the mutex ... */
  int depth;             /* ... this many times */
} Sync;

#define SYNC_SIZE 4096

static SyncHdr *hdr_of(Sync *s) { return (SyncHdr *)(void *)s->seg.base; }

static Sync *tosync(lua_State *L, int idx, int kind) {
  Sync *s = (Sync *)luaL_checkudata(L, idx, kind_tname[kind]);
  if (!s->seg.base)
    luaL_error(L, "attempt to use a closed %s", kind_short[kind]);
  return s;
}

/* Lock, RLock and Condition all answer to the lock methods. */
static Sync *tolocklike(lua_State *L, int idx) {
  Sync *s = (Sync *)luaL_testudata(L, idx, kind_tname[K_LOCK]);
  if (!s) s = (Sync *)luaL_testudata(L, idx, kind_tname[K_RLOCK]);
  if (!s) s = (Sync *)luaL_testudata(L, idx, kind_tname[K_COND]);
  if (!s) luaL_typeerror(L, idx, "Lock, RLock or Condition");
  if (!s->seg.base) luaL_error(L, "attempt to use a closed lock");
  return s;
}

static Sync *newsync(lua_State *L, int kind) {
  Sync *s = (Sync *)lua_newuserdatauv(L, sizeof(Sync), 1);
  memset(s, 0, sizeof *s);
  s->seg.fd = -1;
  s->kind = kind;
  luaL_setmetatable(L, kind_tname[kind]);
  return s;
}

static Sync *createsync(lua_State *L, int kind) {
  Sync *s = newsync(L, kind);
  SyncHdr *h;
  int e;
  mp_seg_create(L, &s->seg, SYNC_SIZE, MP_SEG_FD);
  h = hdr_of(s);
  h->magic = SYNC_MAGIC;
  h->kind = (uint32_t)kind;
  if ((e = mp_mutex_init(&h->m, kind == K_RLOCK)) != 0) {
    mp_push_errno(L, "pthread_mutex_init", e);
    lua_error(L);
  }
  return s;
}

static void sync_release_all(Sync *s) {
  if (s->seg.base && s->depth > 0 && s->holder == getpid())
    while (s->depth-- > 0) pthread_mutex_unlock(&hdr_of(s)->m);
  s->depth = 0;
}

static int sync_gc(lua_State *L) {
  Sync *s = (Sync *)lua_touserdata(L, 1);
  /* an unmapped robust mutex must not stay on this thread's robust list */
  sync_release_all(s);
  mp_seg_close(&s->seg);
  return 0;
}

static int sync_tostring(lua_State *L) {
  Sync *s = (Sync *)lua_touserdata(L, 1);
  if (!s->seg.base)
    lua_pushfstring(L, "multiprocessing.%s (closed)", kind_short[s->kind]);
  else
    lua_pushfstring(L, "multiprocessing.%s (%p)", kind_short[s->kind],
                    (void *)s->seg.base);
  return 1;
}

static void wait_error(lua_State *L, int r, const char *what) {
  if (r == MP_INTERRUPT) luaL_error(L, "%s: interrupted", what);
  mp_push_errno(L, what, r);
  lua_error(L);
}

/* lock:acquire([timeout]) -> true [, "previous owner died"] | false
** A timeout of 0 (or false) does not block. */
static int lock_acquire(lua_State *L) {
  Sync *s = tolocklike(L, 1);
  SyncHdr *h = hdr_of(s);
  mp_Wait w;
  int r;
  double t = lua_isboolean(L, 2) ? (lua_toboolean(L, 2) ? -1 : 0)
                                 : mp_opttimeout(L, 2);
  mp_wait_init(&w, L, t);
  r = mp_mutex_lock(&h->m, &w);
  if (r == MP_TIMEOUT) {
    lua_pushboolean(L, 0);
    return 1;
  }
  if (r == EDEADLK)
    return luaL_error(L, "%s.acquire: already held by this process "
                      "(use an RLock to acquire it again)",
                      kind_short[s->kind]);
  if (r != MP_OK && r != MP_OWNERDEAD) wait_error(L, r, "lock.acquire");
  if (s->holder != getpid()) { s->holder = getpid(); s->depth = 0; }
  s->depth++;
  s->recovered = r == MP_OWNERDEAD || __atomic_exchange_n(&h->died, 0, __ATOMIC_ACQ_REL);
  lua_pushboolean(L, 1);
  if (s->recovered) {
    lua_pushliteral(L, "previous owner died");
    return 2;
  }
  return 1;
}

static int lock_release(lua_State *L) {
  Sync *s = tolocklike(L, 1);
  int e = pthread_mutex_unlock(&hdr_of(s)->m);
  if (e == EPERM)
    return luaL_error(L, "%s.release: not held by this process",
                      kind_short[s->kind]);
  if (e != 0) {
    mp_push_errno(L, "lock.release", e);
    return lua_error(L);
  }
  if (s->holder == getpid() && s->depth > 0) s->depth--;
  return 0;
}

/* lock:locked() -> boolean: held by some process */
static int lock_locked(lua_State *L) {
  Sync *s = tolocklike(L, 1);
  SyncHdr *h = hdr_of(s);
  int e;
  if (s->holder == getpid() && s->depth > 0) {
    lua_pushboolean(L, 1);
    return 1;
  }
  e = pthread_mutex_trylock(&h->m);
  if (e == 0 || e == EOWNERDEAD) {
    if (e == EOWNERDEAD) {
      pthread_mutex_consistent(&h->m);
      __atomic_store_n(&h->died, 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&h->m);
    lua_pushboolean(L, 0);
  } else {
    lua_pushboolean(L, 1);
  }
  return 1;
}

/* --- Semaphore --- */
static int sem_acquire(lua_State *L) {
  Sync *s = tosync(L, 1, K_SEM);
  SyncHdr *h = hdr_of(s);
  mp_Wait w;
  double t = lua_isboolean(L, 2) ? (lua_toboolean(L, 2) ? -1 : 0)
                                 : mp_opttimeout(L, 2);
  mp_wait_init(&w, L, t);
  for (;;) {
    uint32_t v = __atomic_load_n(&h->value, __ATOMIC_ACQUIRE);
    double sl;
    int e;
    if (v > 0) {
      if (__atomic_compare_exchange_n(&h->value, &v, v - 1, 0,
                                      __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
        lua_pushboolean(L, 1);
        return 1;
      }
      continue;
    }
    if ((sl = mp_wait_slice(&w)) <= 0) {
      lua_pushboolean(L, 0);
      return 1;
    }
    __atomic_add_fetch(&h->waiters, 1, __ATOMIC_ACQ_REL);
    e = mp_futex_wait(&h->value, 0, sl);
    __atomic_sub_fetch(&h->waiters, 1, __ATOMIC_ACQ_REL);
    (void)e;
    if (mp_wait_interrupted(&w)) wait_error(L, MP_INTERRUPT, "Semaphore.acquire");
  }
}

static int sem_release(lua_State *L) {
  Sync *s = tosync(L, 1, K_SEM);
  SyncHdr *h = hdr_of(s);
  lua_Integer n = luaL_optinteger(L, 2, 1);
  luaL_argcheck(L, n >= 1 && n <= INT_MAX, 2, "must be a positive count");
  __atomic_add_fetch(&h->value, (uint32_t)n, __ATOMIC_ACQ_REL);
  if (__atomic_load_n(&h->waiters, __ATOMIC_ACQUIRE))
    mp_futex_wake(&h->value, (int)n);
  return 0;
}

static int sem_get_value(lua_State *L) {
  Sync *s = tosync(L, 1, K_SEM);
  lua_pushinteger(L, __atomic_load_n(&hdr_of(s)->value, __ATOMIC_ACQUIRE));
  return 1;
}

/* --- Event --- */
static int ev_set(lua_State *L) {
  SyncHdr *h = hdr_of(tosync(L, 1, K_EVENT));
  __atomic_store_n(&h->value, 1, __ATOMIC_RELEASE);
  if (__atomic_load_n(&h->waiters, __ATOMIC_ACQUIRE))
    mp_futex_wake(&h->value, INT_MAX);
  return 0;
}

static int ev_clear(lua_State *L) {
  SyncHdr *h = hdr_of(tosync(L, 1, K_EVENT));
  __atomic_store_n(&h->value, 0, __ATOMIC_RELEASE);
  return 0;
}

static int ev_is_set(lua_State *L) {
  SyncHdr *h = hdr_of(tosync(L, 1, K_EVENT));
  lua_pushboolean(L, __atomic_load_n(&h->value, __ATOMIC_ACQUIRE) != 0);
  return 1;
}

/* event:wait([timeout]) -> true when set, false on timeout */
static int ev_wait(lua_State *L) {
  SyncHdr *h = hdr_of(tosync(L, 1, K_EVENT));
  mp_Wait w;
  mp_wait_init(&w, L, mp_opttimeout(L, 2));
  for (;;) {
    double sl;
    if (__atomic_load_n(&h->value, __ATOMIC_ACQUIRE)) {
      lua_pushboolean(L, 1);
      return 1;
    }
    if ((sl = mp_wait_slice(&w)) <= 0) {
      lua_pushboolean(L, 0);
      return 1;
    }
    __atomic_add_fetch(&h->waiters, 1, __ATOMIC_ACQ_REL);
    mp_futex_wait(&h->value, 0, sl);
    __atomic_sub_fetch(&h->waiters, 1, __ATOMIC_ACQ_REL);
    if (mp_wait_interrupted(&w)) wait_error(L, MP_INTERRUPT, "Event.wait");
  }
}

/* --- Barrier --- */
static void barrier_break(SyncHdr *h) {
  __atomic_store_n(&h->broken, 1, __ATOMIC_RELEASE);
  __atomic_add_fetch(&h->seq, 1, __ATOMIC_ACQ_REL);
  mp_futex_wake(&h->seq, INT_MAX);
}

/* barrier:wait([timeout]) -> arrival index 0..parties-1; raises when the
** barrier is broken (a timeout breaks it, as in Python). */
static int bar_wait(lua_State *L) {
  SyncHdr *h = hdr_of(tosync(L, 1, K_BARRIER));
  mp_Wait w;
  uint32_t gen, idx;
  mp_wait_init(&w, L, mp_opttimeout(L, 2));
  if (__atomic_load_n(&h->broken, __ATOMIC_ACQUIRE))
    return luaL_error(L, "Barrier.wait: the barrier is broken");
  gen = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE);
  idx = __atomic_add_fetch(&h->value, 1, __ATOMIC_ACQ_REL) - 1;
  if (idx + 1 >= h->parties) {
    __atomic_store_n(&h->value, 0, __ATOMIC_RELEASE);
    __atomic_add_fetch(&h->seq, 1, __ATOMIC_ACQ_REL);
    mp_futex_wake(&h->seq, INT_MAX);
    lua_pushinteger(L, idx);
    return 1;
  }
  for (;;) {
    double sl;
    if (__atomic_load_n(&h->seq, __ATOMIC_ACQUIRE) != gen) break;
    if ((sl = mp_wait_slice(&w)) <= 0) {
      barrier_break(h);
      return luaL_error(L, "Barrier.wait: timed out (the barrier is now "
                        "broken)");
    }
    mp_futex_wait(&h->seq, gen, sl);
    if (mp_wait_interrupted(&w)) {
      barrier_break(h);
      wait_error(L, MP_INTERRUPT, "Barrier.wait");
    }
  }
  if (__atomic_load_n(&h->broken, __ATOMIC_ACQUIRE))
    return luaL_error(L, "Barrier.wait: the barrier is broken");
  lua_pushinteger(L, idx);
  return 1;
}

static int bar_abort(lua_State *L) {
  barrier_break(hdr_of(tosync(L, 1, K_BARRIER)));
  return 0;
}

static int bar_reset(lua_State *L) {
  SyncHdr *h = hdr_of(tosync(L, 1, K_BARRIER));
  barrier_break(h);
  __atomic_store_n(&h->value, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&h->broken, 0, __ATOMIC_RELEASE);
  return 0;
}

static int bar_index(lua_State *L) {
  SyncHdr *h = hdr_of(tosync(L, 1, K_BARRIER));
  const char *k = lua_tostring(L, 2);
  if (k && strcmp(k, "parties") == 0)
    lua_pushinteger(L, h->parties);
  else if (k && strcmp(k, "n_waiting") == 0)
    lua_pushinteger(L, __atomic_load_n(&h->value, __ATOMIC_ACQUIRE));
  else if (k && strcmp(k, "broken") == 0)
    lua_pushboolean(L, __atomic_load_n(&h->broken, __ATOMIC_ACQUIRE) != 0);
  else {
    mp_push_method(L);
  }
  return 1;
}

/* --- Condition: its own error-checking robust mutex plus a sequence --- */

/* cond:wait([timeout]) -> true when notified, false on timeout.  The lock
** must be held; it is released while waiting and held again on return. */
static int cond_wait(lua_State *L) {
  Sync *s = tosync(L, 1, K_COND);
  SyncHdr *h = hdr_of(s);
  mp_Wait w, relock;
  uint32_t seq;
  int notified = 0, e, r;
  mp_wait_init(&w, L, mp_opttimeout(L, 2));
  if (s->holder != getpid() || s->depth != 1)
    return luaL_error(L, "Condition.wait: the lock is not held by this "
                      "process");
  seq = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE);
  __atomic_add_fetch(&h->waiters, 1, __ATOMIC_ACQ_REL);
  if ((e = pthread_mutex_unlock(&h->m)) != 0) {
    __atomic_sub_fetch(&h->waiters, 1, __ATOMIC_ACQ_REL);
    mp_push_errno(L, "Condition.wait", e);
    return lua_error(L);
  }
  s->depth = 0;
  for (;;) {
    double sl;
    if (__atomic_load_n(&h->seq, __ATOMIC_ACQUIRE) != seq) {
      notified = 1;
      break;
    }
    if ((sl = mp_wait_slice(&w)) <= 0) break;
    mp_futex_wait(&h->seq, seq, sl);
    if (mp_wait_interrupted(&w)) break;
  }
  __atomic_sub_fetch(&h->waiters, 1, __ATOMIC_ACQ_REL);
  mp_wait_init(&relock, NULL, -1);    /* relocking is not interruptible */
  do r = mp_mutex_lock(&h->m, &relock);
  while (r == MP_INTERRUPT);
  if (r != MP_OK && r != MP_OWNERDEAD) wait_error(L, r, "Condition.wait");
  s->holder = getpid();
  s->depth = 1;
  if (!notified && mp_wait_interrupted(&w))
    wait_error(L, MP_INTERRUPT, "Condition.wait");
  lua_pushboolean(L, notified);
  return 1;
}

static int cond_notify_n(lua_State *L, int n) {
  Sync *s = tosync(L, 1, K_COND);
  SyncHdr *h = hdr_of(s);
  __atomic_add_fetch(&h->seq, 1, __ATOMIC_ACQ_REL);
  if (__atomic_load_n(&h->waiters, __ATOMIC_ACQUIRE))
    mp_futex_wake(&h->seq, n);
  return 0;
}

static int cond_notify(lua_State *L) {
  lua_Integer n = luaL_optinteger(L, 2, 1);
  luaL_argcheck(L, n >= 1, 2, "must be a positive count");
  return cond_notify_n(L, n > INT_MAX ? INT_MAX : (int)n);
}

static int cond_notify_all(lua_State *L) {
  return cond_notify_n(L, INT_MAX);
}

/* ------------------------------------------------------------------ */
/* constructors                                                        */

static int new_lock(lua_State *L) { createsync(L, K_LOCK); return 1; }
static int new_rlock(lua_State *L) { createsync(L, K_RLOCK); return 1; }
static int new_cond(lua_State *L) {
  if (!lua_isnoneornil(L, 1))
    return luaL_argerror(L, 1, "a Condition brings its own lock "
                         "(passing one is not supported)");
  createsync(L, K_COND);
  return 1;
}

static int new_sem(lua_State *L) {
  lua_Integer n = luaL_optinteger(L, 1, 1);
  Sync *s;
  luaL_argcheck(L, n >= 0 && n <= INT_MAX, 1, "must be a non-negative count");
  s = createsync(L, K_SEM);
  hdr_of(s)->value = (uint32_t)n;
  return 1;
}

static int new_event(lua_State *L) { createsync(L, K_EVENT); return 1; }

static int new_barrier(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 1);
  Sync *s;
  luaL_argcheck(L, n >= 1 && n <= INT_MAX, 1, "must be a positive count");
  s = createsync(L, K_BARRIER);
  hdr_of(s)->parties = (uint32_t)n;
  return 1;
}

/* ------------------------------------------------------------------ */
/* codec                                                               */

static void sync_encode(lua_State *L, int idx, mp_Writer *w) {
  Sync *s = (Sync *)lua_touserdata(L, idx);
  unsigned char k = (unsigned char)s->kind;
  if (!s->seg.base) luaL_error(L, "cannot send a closed %s", kind_short[s->kind]);
  mp_write_bytes(L, w, &k, 1);
  mp_write_fd(L, w, s->seg.fd);
}

static void sync_decode(lua_State *L, mp_Reader *r) {
  const unsigned char *k = (const unsigned char *)mp_read_bytes(L, r, 1);
  int kind = k[0], fd;
  Sync *s;
  if (kind >= K_NKINDS) luaL_error(L, "bad synchronisation object kind %d", kind);
  fd = mp_read_fd(L, r);
  s = newsync(L, kind);
  if (mp_seg_from_fd(L, &s->seg, fd, SYNC_SIZE, 1) != 0) lua_error(L);
  if (hdr_of(s)->magic != SYNC_MAGIC || hdr_of(s)->kind != (uint32_t)kind) {
    mp_seg_close(&s->seg);
    luaL_error(L, "received %s is not one", kind_short[kind]);
  }
}

static const mp_CodecType sync_codec[K_NKINDS] = {
  {"multiprocessing.Lock", sync_encode, sync_decode},
  {"multiprocessing.RLock", sync_encode, sync_decode},
  {"multiprocessing.Semaphore", sync_encode, sync_decode},
  {"multiprocessing.Event", sync_encode, sync_decode},
  {"multiprocessing.Barrier", sync_encode, sync_decode},
  {"multiprocessing.Condition", sync_encode, sync_decode},
};

/* ------------------------------------------------------------------ */

static int lock_index(lua_State *L) {
  Sync *s = (Sync *)lua_touserdata(L, 1);
  const char *k = lua_tostring(L, 2);
  if (k && strcmp(k, "recovered") == 0) {
    lua_pushboolean(L, s->recovered);
    return 1;
  }
  mp_push_method(L);
  return 1;
}

static const luaL_Reg lock_methods[] = {
  {"acquire", lock_acquire}, {"release", lock_release},
  {"locked", lock_locked}, {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg cond_methods[] = {
  {"acquire", lock_acquire}, {"release", lock_release},
  {"wait", cond_wait}, {"notify", cond_notify},
  {"notify_all", cond_notify_all}, {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg sem_methods[] = {
  {"acquire", sem_acquire}, {"release", sem_release},
  {"get_value", sem_get_value}, {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg ev_methods[] = {
  {"set", ev_set}, {"clear", ev_clear}, {"is_set", ev_is_set},
  {"wait", ev_wait}, {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg bar_methods[] = {
  {"wait", bar_wait}, {"abort", bar_abort}, {"reset", bar_reset},
  {"close", sync_gc}, {NULL, NULL}
};

/* 'index' (or NULL: the methods are the __index) serves the fields that
** are not methods, such as a lock's 'recovered'. */
static void newtype(lua_State *L, int kind, const luaL_Reg *methods,
                    lua_CFunction index) {
  const luaL_Reg meta[] = {
    {"__gc", sync_gc}, {"__close", sync_gc}, {"__tostring", sync_tostring},
    {index ? "__index" : NULL, index},   /* no index: the list ends here */
    {NULL, NULL}
  };
  mp_new_class(L, kind_tname[kind], meta, methods);
  lua_pop(L, 1);
  mp_codec_register(L, &sync_codec[kind]);
}

void mp_open_sync(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"Lock", new_lock}, {"RLock", new_rlock}, {"Semaphore", new_sem},
    {"Event", new_event}, {"Barrier", new_barrier}, {"Condition", new_cond},
    {NULL, NULL}
  };
  newtype(L, K_LOCK, lock_methods, lock_index);
  newtype(L, K_RLOCK, lock_methods, lock_index);
  newtype(L, K_SEM, sem_methods, NULL);
  newtype(L, K_EVENT, ev_methods, NULL);
  newtype(L, K_BARRIER, bar_methods, bar_index);
  newtype(L, K_COND, cond_methods, lock_index);
  luaL_setfuncs(L, funcs, 0);
}
