/*
** sync.c -- peer slots, and the synchronisation objects Lock, RLock,
** Semaphore, BoundedSemaphore, Event, Barrier, Condition, and the guards
** of scoped locking.
**
** Each object lives in a sealed memfd page and crosses to spawned workers as
** that descriptor (forked workers simply inherit it); a Barrier's action
** crosses beside it (nested.c).  Every blocking wait is wait.c's:
** deadlines, EINTR and Ctrl-C are handled there, and each ends with an
** mp_Status; Ctrl-C is raised as mp.Interrupted (mp_raise_interrupt),
** saying what became of the object.
**
** Locks are owned, unlike Python's: only the process that acquired a Lock
** may release it, and a lock whose owner died is taken over by the next
** acquirer (EOWNERDEAD -> pthread_mutex_consistent); acquire returns true,
** "previous owner died" and lock.recovered is true until the next acquire.
** glibc registers robust mutexes on the calling thread's robust list, using
** its cached thread id: processes created with a raw clone3 must have that
** fixed by their creator (forkserver.c does).
**
** Condition and Barrier keep their state in the page under the object's
** own robust mutex and sleep on its 'seq' word with the mutex released:
**   Condition: a slot per waiter, with its ticket (order of arrival) and
**     its own futex word.  notify(n) marks the n oldest waiting slots
**     notified and wakes each: exactly n waiters that were waiting then
**     (or all there are), never one that came later or the same one twice.
**   Barrier: Python's threading.Barrier, by generations: 'count' parties
**     arrived in the current one; the party that fills it runs the action
**     and starts the next.  A generation ends tripped or broken (abort,
**     reset, a timeout, a failed action), and its waiters learn which from
**     'gen' and 'broken_gens' -- never by counting each other out, so a
**     party killed inside wait cannot keep the barrier for ever.
*/
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "mp.h"
#include "codec.h"
#include "sharing.h"

/* --- peer slots ---------------------------------------------------------- */

/* The start time of 'pid' (field 22 of /proc/PID/stat), or 0 when it is
** gone or a zombie: a proxy is alive while its process runs, and a pid
** reused by another process has another start time. */
static uint64_t proc_born(pid_t pid) {
  char path[32] = "", buf[512], *p, *q;
  const char *end, *digits;
  unsigned long long born = 0;
  int fd, i;
  ssize_t n;
  /* no printf nor scanf: a fork that attaches a channel comes here, and
  ** their machinery would be pages it faults in (sys.h) */
  end = path + sizeof path - 1;
  q = mp_add_text(path, end, "/proc/");
  q = mp_add_int(q, end, (long)pid);
  *mp_add_text(q, end, "/stat") = '\0';
  if ((fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) return 0;
  n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return 0;
  buf[n] = '\0';
  if ((p = strrchr(buf, ')')) == NULL || p[1] != ' ') return 0;
  p += 2;                                   /* field 3, the state */
  if (*p == 'Z' || *p == 'X' || *p == 'x') return 0;
  for (i = 3; i < 22 && p; i++) {           /* on to field 22 */
    p = strchr(p, ' ');
    if (p) p++;
  }
  if (p == NULL) return 0;
  digits = p;
  if (!mp_read_uint(&digits, &born)) return 0;
  return born ? (uint64_t)born : 1;
}

static uint32_t used_slots(mp_Peers *p) {
  uint32_t n = __atomic_load_n(&p->used, __ATOMIC_ACQUIRE);
  return n > MP_NSLOTS ? MP_NSLOTS : n;
}

/* Moves slot s from state 'from' to BUSY; 1 when it did. */
static int claim(mp_Slot *s, uint32_t from) {
  return __atomic_compare_exchange_n(&s->state, &from, MP_SLOT_BUSY, 0,
                                     __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
}

/* Takes a free slot (BUSY on return), or -1.  When none is free, the marks
** of processes that have died since they left are freed first. */
static int take_slot(mp_Peers *p) {
  int i, pass;
  for (pass = 0; pass < 2; pass++) {
    for (i = 0; i < MP_NSLOTS; i++) {
      mp_Slot *s = &p->slot[i];
      uint32_t used;
      if (pass == 1 && __atomic_load_n(&s->state, __ATOMIC_ACQUIRE) ==
                           MP_SLOT_LEFT && proc_born(s->pid) != s->born &&
          claim(s, MP_SLOT_LEFT))
        __atomic_store_n(&s->state, MP_SLOT_FREE, __ATOMIC_RELEASE);
      if (!claim(s, MP_SLOT_FREE)) continue;
      used = __atomic_load_n(&p->used, __ATOMIC_ACQUIRE);
      while (used < (uint32_t)i + 1 &&
             !__atomic_compare_exchange_n(&p->used, &used, (uint32_t)i + 1, 0,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        ;
      return i;
    }
  }
  return -1;
}

/* A slot of process (pid, born) for 'end' in one of the states in 'mask'
** (1 << state), or -1. */
static int find_slot(mp_Peers *p, int end, pid_t pid, uint64_t born,
                     unsigned mask) {
  uint32_t i, n = used_slots(p);
  for (i = 0; i < n; i++) {
    mp_Slot *s = &p->slot[i];
    uint32_t state = __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
    if ((mask & (1u << state)) && s->pid == (int32_t)pid && s->end == end &&
        s->born == born)
      return (int)i;
  }
  return -1;
}

int mp_peers_attach(mp_Peers *p, int end) {
  pid_t self = getpid();
  uint64_t born = proc_born(self);
  int i = find_slot(p, end, self, born, 1u << MP_SLOT_PROXY);
  mp_Slot *s;
  if (i < 0 || !claim(&p->slot[i], MP_SLOT_PROXY)) {   /* our proxy, or */
    if ((i = take_slot(p)) < 0) return -1;              /* a new slot */
    __atomic_add_fetch(&p->attaches, 1, __ATOMIC_ACQ_REL);
  }
  s = &p->slot[i];
  if (mp_mutex_init(&s->m, 0) != 0 || pthread_mutex_lock(&s->m) != 0) {
    __atomic_store_n(&s->state, MP_SLOT_FREE, __ATOMIC_RELEASE);
    return -1;
  }
  s->pid = (int32_t)self;
  s->end = end;
  s->born = born;
  __atomic_store_n(&s->state, MP_SLOT_ATTACHED, __ATOMIC_RELEASE);
  return i;
}

/* The slot stays as a mark that this process has left (one per process
** and end): a proxy registered for it afterwards would count it as a user
** until it exits.  A proxy registered before it attached goes now. */
void mp_peers_detach(mp_Peers *p, int slot) {
  mp_Slot *s;
  int i;
  uint32_t after = MP_SLOT_LEFT;
  if (slot < 0 || slot >= MP_NSLOTS) return;
  s = &p->slot[slot];
  __atomic_store_n(&s->state, MP_SLOT_BUSY, __ATOMIC_RELEASE);
  __atomic_store_n(&p->lastgone, s->pid, __ATOMIC_RELAXED);
  pthread_mutex_unlock(&s->m);
  while ((i = find_slot(p, s->end, s->pid, s->born,
                        1u << MP_SLOT_PROXY)) >= 0)
    if (claim(&p->slot[i], MP_SLOT_PROXY))
      __atomic_store_n(&p->slot[i].state, MP_SLOT_FREE, __ATOMIC_RELEASE);
  if (find_slot(p, s->end, s->pid, s->born, 1u << MP_SLOT_LEFT) >= 0)
    after = MP_SLOT_FREE;
  __atomic_store_n(&s->state, after, __ATOMIC_RELEASE);
}

int mp_peers_handed(mp_Peers *p, int end, pid_t pid) {
  uint64_t born = proc_born(pid);
  int i;
  if (born == 0) return 0;              /* already gone: nothing to wait for */
  if (find_slot(p, end, pid, born, (1u << MP_SLOT_ATTACHED) |
                (1u << MP_SLOT_PROXY) | (1u << MP_SLOT_LEFT)) >= 0)
    return 0;                           /* it attached (and left) already */
  if ((i = take_slot(p)) < 0) {
    mp_peers_inflight(p, end, 1);       /* never taken for gone */
    return -1;
  }
  p->slot[i].pid = (int32_t)pid;
  p->slot[i].end = end;
  p->slot[i].born = born;
  __atomic_add_fetch(&p->attaches, 1, __ATOMIC_ACQ_REL);
  __atomic_store_n(&p->slot[i].state, MP_SLOT_PROXY, __ATOMIC_RELEASE);
  return 0;
}

void mp_peers_inflight(mp_Peers *p, int end, int delta) {
  int k = end < 0 ? 0 : end > 1 ? 2 : end + 1;
  if (delta > 0) __atomic_add_fetch(&p->attaches, 1, __ATOMIC_ACQ_REL);
  __atomic_add_fetch(&p->inflight[k], delta, __ATOMIC_ACQ_REL);
}

/* Frees slot s, found gone, from state 'from'. */
static void reclaim(mp_Peers *p, mp_Slot *s, uint32_t from, int unlock) {
  if (claim(s, from)) {
    __atomic_store_n(&p->lastgone, s->pid, __ATOMIC_RELAXED);
    if (unlock) pthread_mutex_unlock(&s->m);
    __atomic_store_n(&s->state, MP_SLOT_FREE, __ATOMIC_RELEASE);
  } else if (unlock) {
    pthread_mutex_unlock(&s->m);
  }
}

/* 1 when the slot's process is alive (reclaiming it when it is not). */
static int slot_alive(mp_Peers *p, mp_Slot *s, uint32_t state) {
  int e;
  if (state == MP_SLOT_PROXY) {
    if (proc_born(s->pid) == s->born) return 1;
    reclaim(p, s, MP_SLOT_PROXY, 0);
    return 0;
  }
  e = pthread_mutex_trylock(&s->m);
  if (e == EBUSY || e == EDEADLK) return 1;   /* EDEADLK: ours */
  if (e == EOWNERDEAD || e == 0) {
    /* the owner died holding its slot: take the slot back */
    if (e == EOWNERDEAD) pthread_mutex_consistent(&s->m);
    reclaim(p, s, MP_SLOT_ATTACHED, 1);
  }
  return 0;
}

int mp_peers_alive(mp_Peers *p, int self, int notend) {
  uint32_t i, n = used_slots(p);
  int k;
  for (k = 0; k < 3; k++)
    if ((notend < 0 || k != notend + 1) &&
        __atomic_load_n(&p->inflight[k], __ATOMIC_ACQUIRE) > 0)
      return 1;
  for (i = 0; i < n; i++) {
    mp_Slot *s = &p->slot[i];
    uint32_t state = __atomic_load_n(&s->state, __ATOMIC_ACQUIRE);
    if ((int)i == self) continue;
    /* a slot changing hands (a proxy becoming its process's slot, say)
    ** is not taken for gone: the next look settles it */
    if (state == MP_SLOT_BUSY) return 1;
    if (state != MP_SLOT_ATTACHED && state != MP_SLOT_PROXY) continue;
    if (notend >= 0 && s->end == notend) continue;
    if (slot_alive(p, s, state)) return 1;
  }
  /* "ever" counts this process too; a pipe's creator attached both ends,
  ** so the other end always existed */
  if (notend >= 0) return -1;
  return __atomic_load_n(&p->attaches, __ATOMIC_ACQUIRE) > 1 ? -1 : 0;
}

/* --- the synchronisation objects ----------------------------------------- */

#define SYNC_MAGIC 0x6d707379u   /* "mpsy" */
enum { K_LOCK, K_RLOCK, K_SEM, K_BSEM, K_EVENT, K_BARRIER, K_COND,
       K_NKINDS };

static const char *const kind_tname[K_NKINDS] = {
  "multiprocessing.Lock", "multiprocessing.RLock",
  "multiprocessing.Semaphore", "multiprocessing.BoundedSemaphore",
  "multiprocessing.Event", "multiprocessing.Barrier",
  "multiprocessing.Condition"
};
static const char *const kind_short[K_NKINDS] = {
  "Lock", "RLock", "Semaphore", "BoundedSemaphore", "Event", "Barrier",
  "Condition"
};

#define GUARD_T "multiprocessing.Guard"

/* Barrier states: filling, or broken until reset */
enum { B_FILLING = 0, B_BROKEN = -2 };

typedef struct SyncHdr {
  uint32_t magic;
  uint32_t kind;
  pthread_mutex_t m;     /* Lock, RLock, Condition; guards Barrier state */
  uint32_t value;        /* Semaphore count, Event flag */
  uint32_t limit;        /* BoundedSemaphore: the initial count */
  uint32_t seq;          /* futex word: bumped by every change (mp_wake) */
  uint32_t waiters;      /* sleepers on seq */
  uint32_t died;         /* Lock: owner death seen by a probe, not yet told */
  uint32_t arrivals;     /* Condition, under m: the next waiter's ticket */
  uint32_t hi;           /* Condition, under m: slots in use are below */
  uint32_t parties;      /* Barrier */
  uint32_t count;        /* Barrier, under m: parties of 'gen' arrived */
  int32_t state;         /* Barrier, under m: B_* */
  double timeout;        /* Barrier: default for wait, < 0 none */
  uint32_t gen;          /* Barrier, under m: the generation filling */
  uint64_t broken_gens;  /* Barrier, under m: bit gen % 64 set: it broke */
} SyncHdr;

/* A Condition's waiter, in the slots that follow the header. */
enum { SLOT_FREE, SLOT_WAITING, SLOT_NOTIFIED };
typedef struct CondSlot {
  uint32_t state;        /* SLOT_*: the waiter's futex word */
  uint32_t ticket;       /* order of arrival */
  int32_t pid;
  uint32_t pad;
} CondSlot;

/* Uservalues: 1 the mapping (mp_Map, shared by the objects of a process
** on the same page, so a lock received again costs no descriptor and no
** mmap), 2 a Barrier's action. */
typedef struct Sync {
  mp_Map *map;           /* NULL once closed */
  uint32_t off;          /* where in it the object is */
  int kind;
  int recovered;         /* Lock/RLock: the last acquire took over */
  pid_t holder;          /* this process holds the mutex ... */
  int depth;             /* ... this many times */
  mp_Self *self;         /* which process this is (mp_self) */
} Sync;

/* Segments: a Condition has one of its own (its waiters' slots follow the
** header); the other objects take the next SYNC_SLOT of the pool segment
** of the process that creates them, so that a thousand locks (a thousand
** synchronised Values) cost one descriptor and one mapping, not a
** thousand.  A slot is never reused: another process may still use it. */
#define SEG_SIZE 65536          /* pages never touched cost nothing */
#define SYNC_SLOT 256
#define COND_SLOTS_AT SYNC_SLOT
#define COND_NSLOTS ((int)((SEG_SIZE - COND_SLOTS_AT) / sizeof(CondSlot)))
#define POOL_KEY "multiprocessing.sync.pool"

/* an object fits in its slot */
typedef char sync_header_fits[sizeof(SyncHdr) <= SYNC_SLOT ? 1 : -1];

/* The registry's pool: the segment slots are taken from, by this pid. */
typedef struct Pool {
  mp_Map *map;           /* also uservalue 1 */
  pid_t pid;             /* a forked child starts a pool of its own */
  uint32_t next;         /* the next free slot */
} Pool;

static SyncHdr *sync_hdr(Sync *s) {
  return (SyncHdr *)(void *)(s->map->seg.base + s->off);
}

static int islocklike(int kind) {
  return kind == K_LOCK || kind == K_RLOCK || kind == K_COND;
}

/* The synchronisation object at idx, of one of the kinds in 'mask' (bits
** 1 << K_*); 'expected' names them in the error. */
static Sync *checksync(lua_State *L, int idx, unsigned mask,
                       const char *expected) {
  Sync *s = NULL;
  int k;
  for (k = 0; k < K_NKINDS && s == NULL; k++)
    if (mask & (1u << k)) s = (Sync *)luaL_testudata(L, idx, kind_tname[k]);
  if (s == NULL) mp_typeerror(L, idx, expected);
  if (!s->map)
    luaL_error(L, "attempt to use a closed %s", kind_short[s->kind]);
  return s;
}

static Sync *tosync(lua_State *L, int idx, int kind) {
  return checksync(L, idx, 1u << kind, kind_short[kind]);
}

#define LOCKLIKE ((1u << K_LOCK) | (1u << K_RLOCK) | (1u << K_COND))
#define SEMLIKE  ((1u << K_SEM) | (1u << K_BSEM))

/* Pushes a new object of 'kind' at 'off' in the mapping at the top
** (popped). */
static Sync *newsync(lua_State *L, int kind, uint32_t off) {
  mp_Map *m = (mp_Map *)lua_touserdata(L, -1);
  mp_Self *self;
  Sync *s;
  /* used before anything allocates: a collection could otherwise close
  ** the last object on it and unmap it under us */
  mp_map_use(m);
  self = mp_self(L);   /* before s: its page outlives every object */
  s = (Sync *)lua_newuserdatauv(L, sizeof(Sync), 2);         /* map s */
  memset(s, 0, sizeof *s);
  s->self = self;
  s->kind = kind;
  s->off = off;
  s->map = m;
  luaL_setmetatable(L, kind_tname[kind]);
  lua_insert(L, -2);                                         /* s map */
  lua_setiuservalue(L, -2, 1);                               /* s */
  return s;
}

/* Pushes the mapping for a new object of 'kind' and returns its offset
** there: a new segment for a Condition, else the pool's next slot. */
static uint32_t place(lua_State *L, int kind) {
  Pool *p;
  mp_Map *m;
  if (kind != K_COND) {
    lua_getfield(L, LUA_REGISTRYINDEX, POOL_KEY);            /* pool|nil */
    p = (Pool *)lua_touserdata(L, -1);
    if (p != NULL && p->pid == getpid() && p->next < SEG_SIZE &&
        p->map->seg.base != NULL) {          /* (unmapped: all closed) */
      uint32_t off = p->next;
      p->next += SYNC_SLOT;
      lua_getiuservalue(L, -1, 1);                           /* pool map */
      lua_remove(L, -2);                                     /* map */
      return off;
    }
    lua_pop(L, 1);
  }
  m = mp_map_create(L, SEG_SIZE, MP_SEG_FD);                 /* map */
  if (kind != K_COND) {
    p = (Pool *)lua_newuserdatauv(L, sizeof(Pool), 1);       /* map pool */
    p->map = m;
    p->pid = getpid();
    p->next = SYNC_SLOT;
    lua_pushvalue(L, -2);
    lua_setiuservalue(L, -2, 1);
    lua_setfield(L, LUA_REGISTRYINDEX, POOL_KEY);            /* map */
  }
  return 0;
}

static Sync *createsync(lua_State *L, int kind) {
  Sync *s;
  SyncHdr *h;
  int e;
  uint32_t off = place(L, kind);                             /* map */
  s = newsync(L, kind, off);                                 /* s */
  h = sync_hdr(s);
  h->magic = SYNC_MAGIC;
  h->kind = (uint32_t)kind;
  h->timeout = -1;
  if ((e = mp_mutex_init(&h->m, kind == K_RLOCK || kind == K_COND)) != 0) {
    mp_push_errno(L, "pthread_mutex_init", e);
    lua_error(L);
  }
  return s;
}

/* 1 when this process holds s (a fork's copy of a held lock holds nothing) */
static int held_here(Sync *s) {
  return s->depth > 0 && s->holder == mp_self_pid(s->self);
}

static void sync_release_all(Sync *s) {
  if (s->map && held_here(s))
    while (s->depth-- > 0) pthread_mutex_unlock(&sync_hdr(s)->m);
  s->depth = 0;
}

static void sync_close(Sync *s) {
  /* an unmapped robust mutex must not stay on this thread's robust list */
  sync_release_all(s);
  if (s->map) {
    mp_map_release(s->map);
    s->map = NULL;
  }
}

static int sync_gc(lua_State *L) {
  sync_close((Sync *)lua_touserdata(L, 1));
  return 0;
}

static int sync_tostring(lua_State *L) {
  Sync *s = (Sync *)lua_touserdata(L, 1);
  if (!s->map)
    lua_pushfstring(L, "multiprocessing.%s (closed)", kind_short[s->kind]);
  else
    lua_pushfstring(L, "multiprocessing.%s (%p)", kind_short[s->kind],
                    (void *)sync_hdr(s));
  return 1;
}

/* "Type.method" of the running method, for messages. */
static const char *sync_method(lua_State *L) {
  const char *name = mp_method_name(L);
  return name ? name : "?";
}

/* The timeout of acquire([blocking [, timeout]] | [timeout]) at arg:
** true or none blocks (for the timeout when one follows), false does not. */
static double acquire_timeout(lua_State *L, int arg) {
  if (lua_isboolean(L, arg))
    return lua_toboolean(L, arg) ? mp_opttimeout(L, arg + 1) : 0;
  if (lua_isnil(L, arg) && !lua_isnone(L, arg + 1))   /* (nil, timeout) */
    return mp_opttimeout(L, arg + 1);
  return mp_opttimeout(L, arg);
}

/* --- acquiring: a mutex or a count --------------------------------------- */

/* The two ways: a mutex (Lock, RLock, Condition) and a count (Semaphore,
** BoundedSemaphore). */

static int never(void *arg) { (void)arg; return 0; }

static int sem_ready(void *arg) {
  SyncHdr *h = (SyncHdr *)arg;
  uint32_t v = __atomic_load_n(&h->value, __ATOMIC_ACQUIRE);
  while (v > 0)
    if (__atomic_compare_exchange_n(&h->value, &v, v - 1, 0,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      return 1;
  return 0;
}

/* Acquires s within 't' seconds (< 0: for ever).  Returns MP_OK,
** MP_OWNERDEAD (acquired; its owner had died) or MP_TIMEOUT; raises on
** Ctrl-C and errors.  A lock this process holds already cannot be had
** within a timeout (nobody else may release it): that times out; without
** one it would never return, so that raises. */
static int sync_acquire(lua_State *L, Sync *s, double t) {
  SyncHdr *h = sync_hdr(s);
  mp_Wait w;
  int st;
  mp_wait_init(&w, L, t);
  if (!islocklike(s->kind)) {
    mp_Waitable on = {&h->seq, &h->waiters, sem_ready, NULL, h};
    st = mp_wait_for(&w, &on);
  } else {
    st = mp_mutex_lock(&h->m, &w);
    if (st == EDEADLK) {
      mp_Waitable on = {&h->seq, &h->waiters, never, NULL, NULL};
      if (t < 0)
        luaL_error(L, "%s: already held by this process (use an RLock to "
                   "acquire it again)", sync_method(L));
      st = mp_wait_for(&w, &on);
    }
    if (st == MP_OK || st == MP_OWNERDEAD) {
      pid_t self = mp_self_pid(s->self);
      if (s->holder != self) { s->holder = self; s->depth = 0; }
      s->depth++;
      s->recovered = st == MP_OWNERDEAD ||
                     __atomic_exchange_n(&h->died, 0, __ATOMIC_ACQ_REL);
      if (s->recovered) st = MP_OWNERDEAD;
    }
  }
  if (st == MP_INTERRUPT)
    mp_raise_interrupt(L, sync_method(L), islocklike(s->kind)
                       ? "the lock was not acquired" : "no unit was taken");
  if (st != MP_OK && st != MP_OWNERDEAD && st != MP_TIMEOUT)
    mp_status_error(L, sync_method(L), st);
  return st;
}

/* Gives back one acquisition of s (n units of a semaphore); raises, named
** 'what', when it cannot. */
static void sync_release(lua_State *L, Sync *s, lua_Integer n,
                         const char *what) {
  SyncHdr *h = sync_hdr(s);
  if (islocklike(s->kind)) {
    int e = pthread_mutex_unlock(&h->m);
    if (e == EPERM)
      luaL_error(L, "%s: not held by this process", what);
    if (e != 0) mp_status_error(L, what, e);
    if (held_here(s)) s->depth--;
  } else {
    uint32_t v = __atomic_load_n(&h->value, __ATOMIC_ACQUIRE), nv;
    do {
      nv = v + (uint32_t)n;
      if (nv < v || (s->kind == K_BSEM && nv > h->limit))
        luaL_error(L, "%s: released too many times (above its initial "
                   "value %d)", what, (int)h->limit);
    } while (!__atomic_compare_exchange_n(&h->value, &v, nv, 0,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
    mp_wake(&h->seq, &h->waiters, (int)n);
  }
}

/* lock:acquire([blocking [, timeout]] | [timeout]) -> true [, "previous
** owner died"] | false.  The same for a Semaphore (true or false). */
static int lock_acquire(lua_State *L) {
  Sync *s = checksync(L, 1, LOCKLIKE | SEMLIKE,
                      "Lock, RLock, Condition or Semaphore");
  int st = sync_acquire(L, s, acquire_timeout(L, 2));
  lua_pushboolean(L, st != MP_TIMEOUT);
  if (st != MP_OWNERDEAD) return 1;
  lua_pushstring(L, mp_status_string(st));
  return 2;
}

/* lock:release(); semaphore:release([n]) */
static int lock_release(lua_State *L) {
  Sync *s = checksync(L, 1, LOCKLIKE | SEMLIKE,
                      "Lock, RLock, Condition or Semaphore");
  lua_Integer n = 1;
  if (!islocklike(s->kind)) {
    n = mp_optinteger(L, 2, 1);
    if (n < 1 || n > INT_MAX) mp_argerror(L, 2, "must be a positive count");
  }
  sync_release(L, s, n, sync_method(L));
  return 0;
}

/* lock:locked() -> boolean: held by some process */
static int lock_locked(lua_State *L) {
  Sync *s = checksync(L, 1, LOCKLIKE, "Lock, RLock or Condition");
  SyncHdr *h = sync_hdr(s);
  int e;
  if (held_here(s)) {
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

static int semaphore_get_value(lua_State *L) {
  Sync *s = checksync(L, 1, SEMLIKE, "Semaphore");
  lua_pushinteger(L, __atomic_load_n(&sync_hdr(s)->value, __ATOMIC_ACQUIRE));
  return 1;
}

/* --- guards: local g <close> = lock:guard([timeout]) --------------------- */

typedef struct Guard {
  int held;
  pid_t pid;             /* the holder (a forked child's copy holds nothing) */
} Guard;

/* x:guard([timeout]) -> guard | nil, "timeout".  The guard holds one
** acquisition of x (its uservalue) and gives it back when it is closed:
** at the end of its <close> scope, by g:release(), or when collected. */
static int lock_guard(lua_State *L) {
  Sync *s = checksync(L, 1, LOCKLIKE | SEMLIKE,
                      "Lock, RLock, Condition or Semaphore");
  Guard *g;
  if (sync_acquire(L, s, mp_opttimeout(L, 2)) == MP_TIMEOUT) {
    lua_pushnil(L);
    lua_pushstring(L, "timeout");
    return 2;
  }
  g = (Guard *)lua_newuserdatauv(L, sizeof(Guard), 1);    /* s g */
  g->held = 1;
  g->pid = mp_self_pid(s->self);
  lua_pushvalue(L, 1);
  lua_setiuservalue(L, -2, 1);
  luaL_setmetatable(L, GUARD_T);
  return 1;
}

static int guard_release(lua_State *L) {
  Guard *g = (Guard *)luaL_checkudata(L, 1, GUARD_T);
  Sync *s;
  if (!g->held) return 0;
  lua_getiuservalue(L, 1, 1);                               /* g s */
  s = (Sync *)lua_touserdata(L, -1);
  if (g->pid == mp_self_pid(s->self)) {
    g->held = 0;
    if (s->map) sync_release(L, s, 1, "Guard.release");
  }
  return 0;
}

static int guard_tostring(lua_State *L) {
  Guard *g = (Guard *)lua_touserdata(L, 1);
  lua_getiuservalue(L, 1, 1);
  lua_pushfstring(L, "multiprocessing.Guard of %s%s", luaL_tolstring(L, -1,
                  NULL), g->held ? "" : " (released)");
  return 1;
}

/* --- Event --------------------------------------------------------------- */

static int ev_ready(void *arg) {
  return __atomic_load_n(&((SyncHdr *)arg)->value, __ATOMIC_ACQUIRE) != 0;
}

static int event_set(lua_State *L) {
  SyncHdr *h = sync_hdr(tosync(L, 1, K_EVENT));
  __atomic_store_n(&h->value, 1, __ATOMIC_RELEASE);
  mp_wake(&h->seq, &h->waiters, INT_MAX);
  return 0;
}

static int event_clear(lua_State *L) {
  SyncHdr *h = sync_hdr(tosync(L, 1, K_EVENT));
  __atomic_store_n(&h->value, 0, __ATOMIC_RELEASE);
  return 0;
}

static int event_is_set(lua_State *L) {
  lua_pushboolean(L, ev_ready(sync_hdr(tosync(L, 1, K_EVENT))));
  return 1;
}

/* event:wait([timeout]) -> true when set, false on timeout */
static int event_wait(lua_State *L) {
  SyncHdr *h = sync_hdr(tosync(L, 1, K_EVENT));
  mp_Waitable on = {&h->seq, &h->waiters, ev_ready, NULL, h};
  mp_Wait w;
  int st;
  mp_wait_init(&w, L, mp_opttimeout(L, 2));
  st = mp_wait_for(&w, &on);
  if (st == MP_INTERRUPT)
    mp_raise_interrupt(L, "Event.wait", "the event was left as it was");
  if (st != MP_OK && st != MP_TIMEOUT) mp_status_error(L, "Event.wait", st);
  lua_pushboolean(L, st == MP_OK);
  return 1;
}

/* --- sleeping with the mutex released (Condition, Barrier) --------------- */

/* Called holding h->m: releases it, waits for 'on' (mp_wait_for), and
** takes it back whatever happened -- not interruptibly, as Python's
** Condition.wait.  Returns mp_wait_for's status; *died is set when the
** relock found the previous owner dead. */
static int sleep_unlocked(SyncHdr *h, mp_Wait *w, const mp_Waitable *on,
                          int *died) {
  mp_Wait relock;
  int st;
  pthread_mutex_unlock(&h->m);
  st = mp_wait_for(w, on);
  mp_wait_init(&relock, NULL, -1);
  if (mp_mutex_lock(&h->m, &relock) == MP_OWNERDEAD) *died = 1;
  return st;
}

/* --- Condition: one slot per waiter, notified oldest first --------------- */

static CondSlot *cond_slots(SyncHdr *h) {
  return (CondSlot *)(void *)((unsigned char *)h + COND_SLOTS_AT);
}

static int slot_notified(void *arg) {
  return __atomic_load_n(&((CondSlot *)arg)->state, __ATOMIC_ACQUIRE) ==
         SLOT_NOTIFIED;
}

static Sync *held_cond(lua_State *L) {
  Sync *s = tosync(L, 1, K_COND);
  if (!held_here(s))
    luaL_error(L, "%s: the lock is not held by this process",
               sync_method(L));
  return s;
}

/* Under the mutex: notifies up to n waiters, oldest first, and returns
** how many.  A waiter whose process is gone gets no notification: its
** slot is freed instead. */
static uint32_t cond_notify_slots(SyncHdr *h, uint32_t n) {
  CondSlot *slot = cond_slots(h);
  uint32_t done = 0, i;
  if (n >= h->hi) {              /* all of them (no more wait than slots) */
    for (i = 0; i < h->hi; i++)
      if (slot[i].state == SLOT_WAITING) {
        __atomic_store_n(&slot[i].state, SLOT_NOTIFIED, __ATOMIC_RELEASE);
        mp_futex_wake(&slot[i].state, 1);
        done++;
      }
    return done;
  }
  while (done < n) {
    CondSlot *oldest = NULL;
    for (i = 0; i < h->hi; i++)
      if (slot[i].state == SLOT_WAITING &&
          (oldest == NULL || (int32_t)(slot[i].ticket - oldest->ticket) < 0))
        oldest = &slot[i];
    if (oldest == NULL) break;
    if (kill(oldest->pid, 0) != 0 && errno == ESRCH) {
      __atomic_store_n(&oldest->state, SLOT_FREE, __ATOMIC_RELEASE);
      continue;
    }
    __atomic_store_n(&oldest->state, SLOT_NOTIFIED, __ATOMIC_RELEASE);
    mp_futex_wake(&oldest->state, 1);
    done++;
  }
  return done;
}

/* Waits on the held condition s up to t seconds: 1 notified, 0 not.  Its
** lock is recursive (an RLock, as Python's default): every level this
** process holds is released while waiting and taken again after. */
static int cond_wait_for(lua_State *L, Sync *s, double t) {
  SyncHdr *h = sync_hdr(s);
  CondSlot *slot = cond_slots(h), *mine = NULL;
  mp_Waitable on;
  mp_Wait w;
  uint32_t i;
  int st, died = 0, notified;
  for (i = 0; i < COND_NSLOTS && mine == NULL; i++)
    if (slot[i].state == SLOT_FREE) mine = &slot[i];
  if (mine == NULL)
    return luaL_error(L, "%s: more than %d processes waiting",
                      sync_method(L), COND_NSLOTS);
  if ((uint32_t)(mine - slot) >= h->hi) h->hi = (uint32_t)(mine - slot) + 1;
  mine->ticket = h->arrivals++;
  mine->pid = (int32_t)mp_self_pid(s->self);
  __atomic_store_n(&mine->state, SLOT_WAITING, __ATOMIC_RELEASE);
  on.word = &mine->state;
  on.waiters = NULL;
  on.ready = slot_notified;
  on.check = NULL;
  on.arg = mine;
  mp_wait_init(&w, L, t);
  w.spins = 0;
  for (i = 1; i < (uint32_t)s->depth; i++) pthread_mutex_unlock(&h->m);
  st = sleep_unlocked(h, &w, &on, &died);
  for (i = 1; i < (uint32_t)s->depth; i++) pthread_mutex_lock(&h->m);
  notified = mine->state == SLOT_NOTIFIED;
  __atomic_store_n(&mine->state, SLOT_FREE, __ATOMIC_RELEASE);
  if (st == MP_INTERRUPT) {
    if (notified) cond_notify_slots(h, 1);   /* not ours to use: pass it on */
    mp_raise_interrupt(L, sync_method(L), notified
                       ? "the lock is held again, the notification passed on"
                       : "the lock is held again");
  }
  return notified;
}

/* cond:wait([timeout]) -> true when notified, false on timeout.  The lock
** must be held; it is released while waiting and held again on return. */
static int condition_wait(lua_State *L) {
  Sync *s = held_cond(L);
  lua_pushboolean(L, cond_wait_for(L, s, mp_opttimeout(L, 2)));
  return 1;
}

/* cond:wait_for(predicate [, timeout]) -> the predicate's last result.
** Waits until predicate() is true, holding the lock whenever it runs. */
static int condition_wait_for(lua_State *L) {
  Sync *s = held_cond(L);
  double t = mp_opttimeout(L, 3), deadline = t < 0 ? -1 : mp_now() + t;
  mp_checktype(L, 2, LUA_TFUNCTION);
  for (;;) {
    double left = 0;
    lua_settop(L, 3);
    lua_pushvalue(L, 2);
    lua_call(L, 0, 1);                          /* s pred t result */
    if (lua_toboolean(L, -1)) return 1;
    if (deadline >= 0 && (left = deadline - mp_now()) <= 0) return 1;
    cond_wait_for(L, s, deadline < 0 ? -1 : left);
  }
}

/* Wakes up to n waiters; the lock must be held. */
static int cond_notify_n(lua_State *L, lua_Integer n) {
  SyncHdr *h = sync_hdr(held_cond(L));
  cond_notify_slots(h, n > UINT32_MAX ? UINT32_MAX : (uint32_t)n);
  return 0;
}

static int condition_notify(lua_State *L) {
  lua_Integer n = mp_optinteger(L, 2, 1);
  if (n < 1) mp_argerror(L, 2, "must be a positive count");
  return cond_notify_n(L, n);
}

static int condition_notify_all(lua_State *L) {
  return cond_notify_n(L, INT_MAX);
}

/* --- Barrier ------------------------------------------------------------- */

/* Under h->m: sets the state and wakes every sleeper. */
static void bar_set(SyncHdr *h, int32_t state) {
  __atomic_store_n(&h->state, state, __ATOMIC_RELEASE);
  mp_wake(&h->seq, &h->waiters, INT_MAX);
}

typedef struct SeqWatch {
  uint32_t *seq;
  uint32_t was;
} SeqWatch;

static int seq_moved(void *arg) {
  SeqWatch *x = (SeqWatch *)arg;
  return __atomic_load_n(x->seq, __ATOMIC_ACQUIRE) != x->was;
}

/* Under the mutex: sleeps without it until the state changes (bar_set). */
static int bar_sleep(SyncHdr *h, mp_Wait *w, int *died) {
  SeqWatch x;
  mp_Waitable on;
  x.seq = &h->seq;
  x.was = __atomic_load_n(&h->seq, __ATOMIC_ACQUIRE);
  on.word = &h->seq;
  on.waiters = &h->waiters;
  on.ready = seq_moved;
  on.check = NULL;
  on.arg = &x;
  return sleep_unlocked(h, w, &on, died);
}

/* Under h->m: ends the filling generation, tripped or broken, and
** starts the next, filling or broken; wakes the waiters. */
static void bar_end(SyncHdr *h, int broken, int32_t state) {
  uint64_t bit = (uint64_t)1 << (h->gen % 64);
  if (broken) h->broken_gens |= bit;
  else h->broken_gens &= ~bit;
  h->gen++;
  h->count = 0;
  bar_set(h, state);
}

/* Under h->m: the current generation breaks, and the barrier with it. */
static void bar_break(SyncHdr *h) {
  if (h->state == B_FILLING) bar_end(h, 1, B_BROKEN);
}

/* Takes the barrier's mutex; a holder that died leaves it broken. */
static int bar_lock(SyncHdr *h, mp_Wait *w) {
  int st = mp_mutex_lock(&h->m, w);
  if (st == MP_OWNERDEAD) {
    bar_break(h);
    st = MP_OK;
  }
  return st;
}

/* Runs the action (uservalue 1 of the barrier at 1) holding the mutex;
** an error in it breaks the barrier and is raised after the mutex and the
** party are given back. */
static int barrier_action(lua_State *L) {
  if (lua_getiuservalue(L, 1, 2) == LUA_TNIL) {
    lua_pop(L, 1);
    return 0;
  }
  return lua_pcall(L, 0, 0, 0);
}

/* barrier:wait([timeout]) -> the arrival index 0..parties-1, or nil,
** "broken" when the barrier is or becomes broken (abort, reset, another
** party's timeout, an action that failed), or nil, "timeout" when this
** party's own timeout broke it.  The default timeout is the barrier's. */
static int barrier_wait(lua_State *L) {
  SyncHdr *h = sync_hdr(tosync(L, 1, K_BARRIER));
  double t = lua_isnoneornil(L, 2) ? h->timeout : mp_opttimeout(L, 2);
  mp_Wait w;
  int st, died = 0, failed = 0;
  uint32_t index = 0, gen;
  lua_settop(L, 2);
  mp_wait_init(&w, L, t);
  if ((st = bar_lock(h, &w)) != MP_OK) {
    if (st == MP_INTERRUPT)
      return mp_raise_interrupt(L, "Barrier.wait", "the barrier was not "
                                "entered");
    goto out;
  }
  gen = h->gen;
  if (h->state == B_BROKEN)
    st = MP_BROKEN;
  else if ((index = h->count++) + 1 == h->parties) {
    failed = barrier_action(L);
    bar_end(h, failed, failed ? B_BROKEN : B_FILLING);
  } else {
    while (st == MP_OK && h->gen == gen)
      st = bar_sleep(h, &w, &died);
    if (h->gen != gen)    /* ended, even just as the time ran out */
      st = (h->broken_gens >> (gen % 64)) & 1 ? MP_BROKEN : MP_OK;
    else                  /* our timeout (or interrupt) breaks it */
      bar_break(h);
  }
  if (died) {
    bar_break(h);
    if (st == MP_OK) st = MP_BROKEN;
  }
  pthread_mutex_unlock(&h->m);
out:
  if (failed) return lua_error(L);
  switch (st) {
    case MP_OK:
      lua_pushinteger(L, index);
      return 1;
    case MP_TIMEOUT: case MP_BROKEN:
      lua_pushnil(L);
      lua_pushstring(L, st == MP_TIMEOUT ? "timeout" : "broken");
      return 2;
    case MP_INTERRUPT:    /* our party left: the others see it broken */
      return mp_raise_interrupt(L, "Barrier.wait", "the barrier is broken");
    default:
      return mp_status_error(L, "Barrier.wait", st);
  }
}

/* Changes the state under the mutex: abort breaks, reset refills. */
static int barrier_change(lua_State *L, int reset) {
  SyncHdr *h = sync_hdr(tosync(L, 1, K_BARRIER));
  mp_Wait w;
  int st;
  mp_wait_init(&w, L, -1);
  if (st = bar_lock(h, &w), st == MP_INTERRUPT)
    return mp_raise_interrupt(L, sync_method(L), "the barrier was left as "
                              "it was");
  if (st != MP_OK) return mp_status_error(L, sync_method(L), st);
  if (!reset) bar_break(h);
  else if (h->state == B_BROKEN) bar_set(h, B_FILLING);
  /* parties waiting (or killed while waiting): they leave broken */
  else if (h->count > 0) bar_end(h, 1, B_FILLING);
  pthread_mutex_unlock(&h->m);
  return 0;
}

static int barrier_abort(lua_State *L) { return barrier_change(L, 0); }
static int barrier_reset(lua_State *L) { return barrier_change(L, 1); }

/* The fields need the header; the methods (close among them) are found
** on a closed Barrier too, as on the other kinds. */
static int barrier_index(lua_State *L) {
  SyncHdr *h;
  const char *k = lua_tostring(L, 2);
  int32_t state;
  mp_push_method(L);
  if (!lua_isnil(L, -1)) return 1;
  h = sync_hdr(tosync(L, 1, K_BARRIER));
  state = __atomic_load_n(&h->state, __ATOMIC_ACQUIRE);
  if (k && strcmp(k, "parties") == 0)
    lua_pushinteger(L, h->parties);
  else if (k && strcmp(k, "n_waiting") == 0)
    lua_pushinteger(L, state == B_FILLING
                       ? __atomic_load_n(&h->count, __ATOMIC_ACQUIRE) : 0);
  else if (k && strcmp(k, "broken") == 0)
    lua_pushboolean(L, state == B_BROKEN);
  else if (k && strcmp(k, "timeout") == 0 && h->timeout >= 0)
    lua_pushnumber(L, h->timeout);
  else
    lua_pushnil(L);
  return 1;
}

/* --- constructors -------------------------------------------------------- */

static int new_plain(lua_State *L, int kind) {
  mp_checknoargs(L, 1);
  createsync(L, kind);
  return 1;
}

static int new_lock(lua_State *L) { return new_plain(L, K_LOCK); }
static int new_rlock(lua_State *L) { return new_plain(L, K_RLOCK); }
static int new_event(lua_State *L) { return new_plain(L, K_EVENT); }

static int new_condition(lua_State *L) {
  if (!lua_isnoneornil(L, 1))
    return luaL_argerror(L, 1, "a Condition brings its own lock "
                         "(passing one is not supported)");
  createsync(L, K_COND);
  return 1;
}

static int make_semaphore(lua_State *L, int kind) {
  lua_Integer n = mp_optinteger(L, 1, 1);
  Sync *s;
  if (n < 0 || n > INT_MAX) mp_argerror(L, 1, "must be a non-negative count");
  s = createsync(L, kind);
  sync_hdr(s)->value = sync_hdr(s)->limit = (uint32_t)n;
  return 1;
}

static int new_semaphore(lua_State *L) { return make_semaphore(L, K_SEM); }
static int new_bounded_semaphore(lua_State *L) { return make_semaphore(L, K_BSEM); }

/* mp.Barrier(parties [, action [, timeout]]) */
static int new_barrier(lua_State *L) {
  lua_Integer n = mp_checkinteger(L, 1);
  double t = mp_opttimeout(L, 3);
  Sync *s;
  if (n < 1 || n > INT_MAX) mp_argerror(L, 1, "must be a positive count");
  if (!lua_isnoneornil(L, 2)) mp_checktype(L, 2, LUA_TFUNCTION);
  lua_settop(L, 2);                             /* n action */
  s = createsync(L, K_BARRIER);                 /* n action b */
  sync_hdr(s)->parties = (uint32_t)n;
  sync_hdr(s)->timeout = t;
  lua_pushvalue(L, 2);
  lua_setiuservalue(L, -2, 2);
  return 1;
}

/* --- codec --------------------------------------------------------------- */

static void sync_encode(lua_State *L, int idx, mp_Writer *w) {
  Sync *s = (Sync *)lua_touserdata(L, idx);
  unsigned char k = (unsigned char)s->kind;
  if (!s->map) luaL_error(L, "cannot send a closed %s", kind_short[s->kind]);
  mp_write_bytes(L, w, &k, 1);
  mp_write_bytes(L, w, &s->off, sizeof s->off);
  mp_write_fd(L, w, s->map->seg.fd);
  if (s->kind == K_BARRIER) {
    lua_getiuservalue(L, idx, 2);
    mp_write_value(L, w, idx, "Barrier action");
  }
}

static void sync_decode(lua_State *L, mp_Reader *r) {
  const unsigned char *k = (const unsigned char *)mp_read_bytes(L, r, 1);
  int kind = k[0], fd;
  uint32_t off;
  Sync *s;
  memcpy(&off, mp_read_bytes(L, r, sizeof off), sizeof off);
  if (kind >= K_NKINDS || off % SYNC_SLOT != 0 || off >= SEG_SIZE ||
      (kind == K_COND && off != 0))
    luaL_error(L, "bad synchronisation object (kind %d at %d)", kind,
               (int)off);
  fd = mp_read_fd(L, r);
  mp_map_from_fd(L, fd, SEG_SIZE);                           /* map */
  s = newsync(L, kind, off);                                 /* s */
  if (sync_hdr(s)->magic != SYNC_MAGIC || sync_hdr(s)->kind != (uint32_t)kind) {
    sync_close(s);
    luaL_error(L, "received %s is not one", kind_short[kind]);
  }
  if (kind == K_BARRIER) {
    mp_read_value(L, r);                        /* s action */
    if (!lua_isnil(L, -1) && !lua_isfunction(L, -1))
      luaL_error(L, "received Barrier has a bad action");
    lua_setiuservalue(L, -2, 2);                /* s */
  }
}

static const mp_CodecType sync_codec[K_NKINDS] = {
  {"multiprocessing.Lock", sync_encode, sync_decode},
  {"multiprocessing.RLock", sync_encode, sync_decode},
  {"multiprocessing.Semaphore", sync_encode, sync_decode},
  {"multiprocessing.BoundedSemaphore", sync_encode, sync_decode},
  {"multiprocessing.Event", sync_encode, sync_decode},
  {"multiprocessing.Barrier", sync_encode, sync_decode},
  {"multiprocessing.Condition", sync_encode, sync_decode},
};

/* --- registration -------------------------------------------------------- */

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
  {"acquire", lock_acquire}, {"release", lock_release}, {"guard", lock_guard},
  {"locked", lock_locked}, {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg condition_methods[] = {
  {"acquire", lock_acquire}, {"release", lock_release}, {"guard", lock_guard},
  {"locked", lock_locked}, {"wait", condition_wait}, {"wait_for", condition_wait_for},
  {"notify", condition_notify}, {"notify_all", condition_notify_all},
  {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg semaphore_methods[] = {
  {"acquire", lock_acquire}, {"release", lock_release}, {"guard", lock_guard},
  {"get_value", semaphore_get_value}, {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg event_methods[] = {
  {"set", event_set}, {"clear", event_clear}, {"is_set", event_is_set},
  {"wait", event_wait}, {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg barrier_methods[] = {
  {"wait", barrier_wait}, {"abort", barrier_abort}, {"reset", barrier_reset},
  {"close", sync_gc}, {NULL, NULL}
};
static const luaL_Reg guard_methods[] = {
  {"release", guard_release}, {NULL, NULL}
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
    {"Lock", new_lock}, {"RLock", new_rlock}, {"Semaphore", new_semaphore},
    {"BoundedSemaphore", new_bounded_semaphore}, {"Event", new_event},
    {"Barrier", new_barrier}, {"Condition", new_condition}, {NULL, NULL}
  };
  static const luaL_Reg guard_meta[] = {
    {"__gc", guard_release}, {"__close", guard_release},
    {"__tostring", guard_tostring}, {NULL, NULL}
  };
  newtype(L, K_LOCK, lock_methods, lock_index);
  newtype(L, K_RLOCK, lock_methods, lock_index);
  newtype(L, K_SEM, semaphore_methods, NULL);
  newtype(L, K_BSEM, semaphore_methods, NULL);
  newtype(L, K_EVENT, event_methods, NULL);
  newtype(L, K_BARRIER, barrier_methods, barrier_index);
  newtype(L, K_COND, condition_methods, lock_index);
  mp_new_class(L, GUARD_T, guard_meta, guard_methods);
  lua_pop(L, 1);
  luaL_setfuncs(L, funcs, 0);
}

/* --- the lock of a synchronised Value or Array (array.c) ----------------- */

int mp_islock(lua_State *L, int idx) {
  Sync *s = (Sync *)luaL_testudata(L, idx, kind_tname[K_LOCK]);
  if (s == NULL) s = (Sync *)luaL_testudata(L, idx, kind_tname[K_RLOCK]);
  return s != NULL && s->map != NULL;
}

void mp_new_rlock(lua_State *L) { createsync(L, K_RLOCK); }

int mp_lock_enter(lua_State *L, int idx, const char *what) {
  Sync *s = (Sync *)lua_touserdata(L, idx);
  mp_Wait w;
  int st;
  if (s == NULL || s->map == NULL)
    return luaL_error(L, "%s: its lock is closed", what);
  mp_wait_init(&w, L, -1);
  st = mp_mutex_lock(&sync_hdr(s)->m, &w);
  if (st == EDEADLK) return 0;          /* ours already (a Lock) */
  if (st == MP_INTERRUPT)
    mp_raise_interrupt(L, what, "it was not read or written");
  if (st != MP_OK && st != MP_OWNERDEAD) mp_status_error(L, what, st);
  return 1;
}

void mp_lock_write(lua_State *L, int idx, mp_Writer *w) {
  sync_encode(L, idx, w);
}

void mp_lock_read(lua_State *L, mp_Reader *r) {
  Sync *s;
  sync_decode(L, r);
  s = (Sync *)lua_touserdata(L, -1);
  if (s->kind != K_LOCK && s->kind != K_RLOCK)
    luaL_error(L, "bad lock encoding (a %s)", kind_short[s->kind]);
  /* the codec closes what it decodes for nobody; it does not see this */
  if (mp_read_flags(r) & MP_CODEC_DISCARD) sync_close(s);
}

void mp_lock_leave(lua_State *L, int idx) {
  Sync *s = (Sync *)lua_touserdata(L, idx);
  pthread_mutex_unlock(&sync_hdr(s)->m);
}
