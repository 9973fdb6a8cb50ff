/*
** sharing.h -- what the data-sharing files of multiprocessing.core share
** (shm.c, ledger.c, wait.c, sync.c, nested.c, array.c, channel.c; what
** each is for: the map in mp.h).
*/
#ifndef mp_sharing_h
#define mp_sharing_h

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "lua.h"
#include "lauxlib.h"

/* --- shm.c: segments --- */
#define MP_SEG_PRIVATE 0   /* not shared (no mapping) */
#define MP_SEG_FD      1   /* memfd, passed as a descriptor */
#define MP_SEG_NAME    2   /* shm_open name, passed as bytes */

#define MP_SHM_NAMELEN 40

typedef struct mp_Seg {
  unsigned char *base;     /* the mapping, NULL when none */
  size_t size;             /* its size */
  int fd;                  /* memfd (MP_SEG_FD), else -1 */
  int kind;                /* MP_SEG_* */
  char name[MP_SHM_NAMELEN]; /* MP_SEG_NAME: "/lmp_<32 hex>" */
  uint64_t trkid;          /* MP_SEG_NAME: the tracker table it is in ... */
  uint32_t trkslot;        /* ... and where */
} mp_Seg;

/* The strategy of this lua_State: MP_SEG_FD or MP_SEG_NAME. */
int  mp_sharing_strategy(lua_State *L);
void mp_set_sharing_strategy(lua_State *L, int kind);
/* Creates and maps a zeroed segment; raises a Lua error on failure.
** MP_SEG_NAME registers the name with the tracker first. */
void mp_seg_create(lua_State *L, mp_Seg *s, size_t size, int kind);
/* Maps a received memfd (takes ownership of fd, even on error); checks its
** size with fstat and, when 'sealed', that it cannot shrink.  Returns 0 or
** pushes a message and returns an errno. */
int  mp_seg_from_fd(lua_State *L, mp_Seg *s, int fd, size_t size, int sealed);
/* Opens and maps a file_system segment by name (the fd is closed again). */
int  mp_seg_from_name(lua_State *L, mp_Seg *s, const char *name, size_t size);
/* The same for only the first 'size' bytes of one at least that big. */
int  mp_seg_head_from_name(lua_State *L, mp_Seg *s, const char *name,
                           size_t size);
/* Unmaps and closes (idempotent). */
void mp_seg_close(mp_Seg *s);
/* Removes the name of a MP_SEG_NAME segment and tells the tracker. */
void mp_seg_unlink(lua_State *L, mp_Seg *s);
/* A segment mapped once per lua_State and shared by all the Arrays on it:
** receiving memory that is already mapped here (the same memfd by st_dev
** and st_ino, the same file_system name) reuses the mapping instead of
** mapping it again, which costs more than the whole rest of a message.
** A userdata; each Array keeps its own as its uservalue, so the mapping
** outlives every Array on it, and 'users' counts the open ones: the last
** one's close unmaps it at once.  A per-lua_State cache (registry, weak
** values) finds the live mappings. */
typedef struct mp_Map {
  mp_Seg seg;
  int users;               /* open Arrays on it; unmapped when it drops to 0 */
} mp_Map;

/* Each pushes the mapping and returns it, or raises a Lua error. */
/* Creates and maps a zeroed segment (mp_seg_create) and caches it. */
mp_Map *mp_map_create(lua_State *L, size_t size, int kind);
/* A received memfd (owned: closed at once when its memory is already
** mapped here, and on error); checks its size and its seals. */
mp_Map *mp_map_from_fd(lua_State *L, int fd, size_t size);
/* A file_system segment by name; checks its size. */
mp_Map *mp_map_from_name(lua_State *L, const char *name, size_t size);
/* An Array starts or stops using the mapping (the last one unmaps it). */
void mp_map_use(mp_Map *m);
void mp_map_release(mp_Map *m);
/* Before a worker's _exit: gives back the file_system references its
** arrays hold (array.c), as their __gc would have. */
void mp_array_exit(lua_State *L);
/* Gives back 'n' references a dead worker held on the file_system array
** 'name'; the last one unlinks it (array.c). */
void mp_array_give_back(lua_State *L, const char *name, int64_t n);

/* --- ledger.c: the file_system references a worker holds --- */
/* Room for a worker's ledger at the end of its report slot (reports.c). */
#define MP_LEDGER_BYTES ((off_t)3 << 20)
/* Where a worker's ledger is found: the registry, under this key. */
#define MP_LEDGER_KEY "multiprocessing.ledger"
/* Pushes a ledger on the report memfd 'fd' that no worker holds yet: a
** parent makes one for all the workers it is about to fork (or clone), and
** leaves it under MP_LEDGER_KEY for them. */
void mp_ledger_new(lua_State *L, int fd);
/* In worker 'self': its ledger is at 'at' in the report memfd 'fd'; 'mark'
** is set before the first entry is written.  The one its parent left for
** it is taken (a few stores: a fork allocates nothing, enters nothing in
** its registry), else a new one is made. */
void mp_ledger_open(lua_State *L, int fd, off_t at, pid_t self,
                    const struct mp_Mark *mark);
/* This process took (+1) or gave back (-1) a reference on 'name'. */
void mp_ledger_note(lua_State *L, const char *name, int delta);
/* In the parent, the worker gone: hands each name its ledger lists, with
** the references held, to 'give_back' (mp_array_give_back: the ledger
** itself knows no kind of object). */
typedef void (*mp_GiveBack)(lua_State *L, const char *name, int64_t n);
void mp_ledger_settle(lua_State *L, int fd, off_t at, mp_GiveBack give_back);


/* --- wait.c: waiting for another process (see the comment there) --- */

/* How every wait ends: MP_OK, one of these, or a positive errno. */
typedef enum mp_Status {
  MP_OK        =  0,
  MP_TIMEOUT   = -1,   /* the deadline passed */
  MP_INTERRUPT = -2,   /* Ctrl-C (a hook appeared); already taken back */
  MP_PEERGONE  = -3,   /* every other user of a channel is gone */
  MP_OWNERDEAD = -4,   /* a robust mutex is held now; its owner had died */
  MP_BROKEN    = -5    /* a barrier is broken (reset, abort, timeout) */
} mp_Status;

/* A short message for a status ("timed out", strerror for an errno). */
const char *mp_status_string(int st);
/* Raises "what: <mp_status_string(st)>"; MP_INTERRUPT as an Interrupted
** that says "nothing was done" (mp_raise_interrupt says more). */
int mp_status_error(lua_State *L, const char *what, int st);

#define MP_SLICE 0.05   /* seconds between checks for Ctrl-C and peers */
#define MP_SPINS 2000   /* polls before the first futex sleep */

typedef struct mp_Hooks {  /* a thread's hook as a wait found it */
  lua_State *L;            /* NULL: not watched */
  lua_Hook hook;
  int mask, count;
} mp_Hooks;

typedef struct mp_Wait {
  mp_Hooks self, main;     /* the running thread's and the main thread's */
  double deadline;         /* < 0: none */
  double started;
  double lastcheck;        /* when mp_Waitable.check last ran */
  int spins;               /* polls before sleeping (mp_wait_for) */
  double patience;         /* > 0: a message written in pieces is given up
                              only after this long with no piece taken
                              (channel.c's write_chunks); 0: at the
                              deadline */
} mp_Wait;

/* Starts a wait of 'timeout' seconds (< 0: for ever).  L == NULL: Ctrl-C
** is not watched (a Condition taking its lock back). */
void   mp_wait_init(mp_Wait *w, lua_State *L, double timeout);
/* Seconds to sleep in the next slice (<= MP_SLICE); 0 once the deadline
** has passed. */
double mp_wait_slice(mp_Wait *w);
/* 1 when Ctrl-C came since mp_wait_init.  It is taken: the hooks are put
** back, so the caller must end its wait and raise MP_INTERRUPT. */
int    mp_wait_interrupted(mp_Wait *w);

/* What mp_wait_for waits on.  Whoever changes what 'ready' tests calls
** mp_wake(word, waiters, n) after the change. */
typedef struct mp_Waitable {
  uint32_t *word;          /* shared futex word, bumped by mp_wake */
  uint32_t *waiters;       /* shared count of sleepers, or NULL */
  int (*ready)(void *arg); /* 1: done; may take what it waited for (a
                              semaphore's unit), then returns 1 */
  int (*check)(void *arg); /* or NULL: about every MP_SLICE while asleep;
                              a status other than MP_OK ends the wait */
  void *arg;
} mp_Waitable;

/* Polls ready() (w->spins times), then sleeps on the word until ready()
** returns 1 (MP_OK), the deadline passes (MP_TIMEOUT; ready() was tested
** after it), Ctrl-C (MP_INTERRUPT) or check() says otherwise.  ready() is
** never skipped: a wait of 0 tests it once. */
int    mp_wait_for(mp_Wait *w, const mp_Waitable *on);
/* After changing shared state: bumps 'word' and wakes up to n sleepers
** (INT_MAX: all) -- no system call when 'waiters' counts none. */
void   mp_wake(uint32_t *word, uint32_t *waiters, int n);

/* The raw futex: 0 (woken, or the value differs), ETIMEDOUT, EINTR. */
int    mp_futex_wait(uint32_t *addr, uint32_t val, double secs);
void   mp_futex_wake(uint32_t *addr, int n);

/* Robust, process-shared mutexes (error-checking, or recursive). */
int  mp_mutex_init(pthread_mutex_t *m, int recursive);
/* Locks within the wait's deadline.  Returns MP_OK, MP_OWNERDEAD (held;
** the previous owner died and the mutex was made consistent), MP_TIMEOUT,
** MP_INTERRUPT, or an errno (EDEADLK: an error-checking one is already
** held by this thread). */
int  mp_mutex_lock(pthread_mutex_t *m, mp_Wait *w);

/* --- sync.c: peer slots, and the synchronisation objects --- */
/* peer slots: who may still use a channel.  A process attached to it holds
** a slot's robust mutex, so a dead one reads as dead (EOWNERDEAD) instead of
** busy.  A process that was handed the channel and has not attached yet is
** counted too, so that it is never taken for gone:
**   - a worker started with it in fn or args holds a proxy slot (its pid
**     and start time, registered by the parent right after the start) until
**     it attaches or dies;
**   - a channel inside a message (a queue, a pipe, a result) is "in flight"
**     from its encoding until its decoding.
** A process that detaches leaves a mark (its pid and start time), so that a
** proxy registered late does not count it as a user until it exits.  The
** table is big (MP_NSLOTS) and scanned up to the highest slot used. */
#define MP_NSLOTS 4096
enum { MP_SLOT_FREE, MP_SLOT_BUSY, MP_SLOT_ATTACHED, MP_SLOT_PROXY,
       MP_SLOT_LEFT };
typedef struct mp_Slot {
  uint32_t state;          /* MP_SLOT_* */
  int32_t pid;
  int32_t end;             /* which end of a pipe, -1 for a queue */
  uint32_t pad;
  uint64_t born;           /* the process's start time (pid reuse) */
  pthread_mutex_t m;       /* attached: held by the process */
} mp_Slot;

typedef struct mp_Peers {
  uint32_t attaches;       /* attaches and hand-outs that ever happened */
  int32_t lastgone;        /* pid of the last process found gone */
  uint32_t used;           /* slots 0..used-1 were ever taken */
  uint32_t pad;
  int64_t inflight[3];     /* encoded, not yet decoded: per end + 1 */
  mp_Slot slot[MP_NSLOTS];
} mp_Peers;

/* Returns the slot index, or -1 when all are taken.  Takes over the proxy
** this process was given, if any. */
int  mp_peers_attach(mp_Peers *p, int end);
void mp_peers_detach(mp_Peers *p, int slot);
/* Registers a proxy for the process 'pid' that was handed end 'end' (0, or
** -1 when every slot is taken: it is then counted as in flight for ever). */
int  mp_peers_handed(mp_Peers *p, int end, pid_t pid);
/* An encoding of end 'end' left (+1) or arrived (-1). */
void mp_peers_inflight(mp_Peers *p, int end, int delta);
/* Is any process other than slot 'self' (with end != 'notend' when
** notend >= 0) attached, about to attach, or in flight?  Returns 1 alive,
** 0 when no other ever was, -1 when all others are gone. */
int  mp_peers_alive(mp_Peers *p, int self, int notend);

/* --- sync.c: the lock of a synchronised Value or Array --- */
/* 1 when the value at idx is an open Lock or RLock. */
int  mp_islock(lua_State *L, int idx);
void mp_new_rlock(lua_State *L);            /* pushes a new RLock */
/* Takes the Lock or RLock at idx for one access: blocks, raises (named
** 'what') on Ctrl-C or when the lock is closed.  Returns 1, or 0 when this
** thread holds that Lock already: then nothing is to be given back.  Only
** mp_lock_leave may come between: nothing that raises. */
int  mp_lock_enter(lua_State *L, int idx, const char *what);
void mp_lock_leave(lua_State *L, int idx);
/* The Lock or RLock at idx inside another object's encoding (no nested
** message: its kind, slot and descriptor); mp_lock_read pushes it. */
struct mp_Writer;
struct mp_Reader;
void mp_lock_write(lua_State *L, int idx, struct mp_Writer *w);
void mp_lock_read(lua_State *L, struct mp_Reader *r);

/* --- the channels a worker is started with --- */
/* Pushes the set (a table whose keys they are) of the open queues and
** connections that the values at 'fn' and 'args' hold: one walk of their
** tables and of their functions' upvalues.  A start collects it once,
** before it forks, for the two uses below: a forked child then walks
** nothing (a walk's table, made in a fork, is pages of the parent's heap
** written, each a page fault). */
void mp_sharing_collect(lua_State *L, int fn, int args);
/* In the worker, before it runs fn: attaches every channel of the set at
** 'set' to this process, so that a worker that dies without touching one
** still counts as its user. */
void mp_sharing_attach(lua_State *L, int set);
/* In the parent, once the 'n' workers 'w' have started: each channel of
** the set at 'set' gets a proxy slot per worker (see mp_Peers), so nobody
** takes it for closed before they attach. */
struct mp_Worker;
void mp_sharing_handed(lua_State *L, int set, const struct mp_Worker *w,
                       int n);

/* nested.c: a value inside a userdata's encoding (a Barrier's action).  mp_write_value pops the value at the top and writes
** it as part of the userdata at 'owner' ('what' names it in errors; met
** again inside its own value, the owner's value is written as nil);
** mp_read_value pushes it back. */
void mp_write_value(lua_State *L, struct mp_Writer *w, int owner,
                    const char *what);
void mp_read_value(lua_State *L, struct mp_Reader *r);

/* registration */
void mp_open_shm(lua_State *L);
void mp_open_array(lua_State *L);
void mp_open_channel(lua_State *L);
void mp_open_sync(lua_State *L);

#endif
