/*
** channel.c -- Queue, SimpleQueue, JoinableQueue and Pipe connections.
**
** A channel is a sealed memfd holding one ring per direction (a Queue has
** one, a duplex Pipe two) plus the peer slots (sharing.h), and beside each
** ring a unix stream socketpair that carries the descriptors of the shared
** objects inside messages (SCM_RIGHTS, at most 253 per record,
** MSG_CMSG_CLOEXEC, MSG_CTRUNC -> error) and an eventfd for fileno().
**
** Ring: head/tail byte counters, futex words bumped on publish and on
** consume, and two robust mutexes: "wlock" held by the one writer of the
** current message, "rlock" by the one reader, so the ring itself is
** single-producer single-consumer.  A message is a 24-byte header (length,
** descriptor count, sequence number, flags), the encoded bytes and an 8-byte
** trailer (its sequence number and a magic).  One that fits is copied and
** published at once; one bigger than the free room streams through in
** pieces, the header first and alone.  The descriptor records go out before
** the message and carry its sequence number, so a reader discards records
** of messages it never sees.
**
** Giving up in the middle: a writer whose timeout passes (or who is
** interrupted, or dies) mid-message leaves "wpending", the bytes it still
** owed.  The next writer pads them with zeros; a reader waiting for them
** finds the writer's lock free (or its owner dead) and skips them without
** bytes (head and tail both jump).  Either way the trailer does not match
** and the reader drops the message: no garbage is decoded, nobody waits.
** A reader that gives up mid-message leaves "rpending"; the next one skips.
**
** Liveness (mp_Peers, sync.c): every process using a channel holds a slot
** while attached; workers handed it hold proxies until they attach; copies
** inside messages count as in flight.  A get that cannot progress learns
** that no other process can ever write again returns nil, "closed" as soon
** as it is known (a look about every MP_SLICE while it sleeps), timed or
** not: a consumer's recv(30) does not wait out its 30 s at the end of a
** stream.  Never before a process that was handed the channel has attached
** or died.  A put to a ring nobody else can read is told the same way.
**
** Counting: a writer counts its message (qsize, a bounded Queue's slots)
** under wlock before it publishes it, and records where it starts
** (counted_at).  One killed between the two leaves the count one too high:
** the next writer, or qsize/empty/full, finds the lock's owner dead and
** nothing published since counted_at, and takes the count back.
**
** The last process to close a channel (or the last reader of a pipe's
** direction) decodes and closes what is left in it, so the shared objects
** inside (file_system names above all) are given back instead of living
** until the end of the program; a put that fails does the same with its
** own encoding.
**
** Timeouts: q:get([timeout]) returns the value (exactly one result) or
** nil, "timeout" | "closed"; get_nowait() returns nil, "empty".
** q:put(v [, timeout]) returns true or nil, "timeout" | "closed" ("full"
** for put_nowait).  A received nil is a single nil, so
** `local v, err = q:get(t)` tells them apart.
*/
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "mp.h"
#include "codec.h"
#include "sharing.h"

#define QUEUE_T  "multiprocessing.Queue"
#define JQUEUE_T "multiprocessing.JoinableQueue"
#define CONN_T   "multiprocessing.Connection"
#define INBOX_T  "multiprocessing.Inbox"

#define CHAN_MAGIC 0x6d706368u  /* "mpch" */
#define TRAILER_MAGIC ((uint64_t)0x6d70656eu << 32)  /* "mpen" */
#define DEFAULT_CAP ((uint64_t)4 << 20)
#define MIN_CAP ((uint64_t)4096)
#define MAX_CAP ((uint64_t)1 << 32)
#define MSG_HDR ((uint64_t)sizeof(MsgHdr))
#define MSG_END ((uint64_t)sizeof(uint64_t))
#define F_RAW 1u          /* send_bytes: raw bytes */
#define F_STR 2u          /* a single Lua string, not encoded */
#define INLINE_BUF 256
#define MP_SKIPPED (-20)  /* a message whose writer gave up: drop it */

typedef struct MsgHdr {
  uint64_t len;
  uint32_t nfds;
  uint32_t seq;
  uint32_t flags;
  uint32_t pad;
} MsgHdr;

typedef struct FdRec {
  uint32_t seq;
  uint32_t count;
} FdRec;

typedef struct Ring {
  uint64_t head;          /* bytes consumed */
  uint64_t tail;          /* bytes published */
  uint32_t dataseq;       /* futex: bumped on publish */
  uint32_t spaceseq;      /* futex: bumped on consume */
  uint32_t rwait, wwait;  /* sleepers on those */
  int64_t count;          /* messages put and not yet taken */
  uint32_t wseq;          /* sequence number of the last message begun */
  uint32_t watched;       /* someone polls the eventfd: writers signal it */
  uint64_t wpending;      /* bytes the current writer still owes */
  uint64_t rpending;      /* bytes the current reader still has to take */
  uint64_t counted_at;    /* under wlock: the writer counted a message that
                             starts at tail counted_at - 1; 0: none */
  pthread_mutex_t wlock, rlock;
} Ring;

typedef struct ChanHdr {
  uint32_t magic;
  uint32_t nrings;
  uint64_t cap;
  int64_t maxsize;        /* Queue: 0 = unbounded (in messages) */
  uint64_t data_off;
  uint32_t joinable;      /* a JoinableQueue */
  uint32_t doneseq;       /* futex: bumped when unfinished drops to 0 */
  uint32_t donewait;
  uint32_t pad;
  int64_t unfinished;     /* JoinableQueue: put and not yet task_done */
  mp_Peers peers;
  /* on lines of their own: the header above is read on every operation,
  ** the rings are written on every one */
  Ring ring[2] __attribute__((aligned(64)));
} ChanHdr;

enum { K_QUEUE, K_CONN };

typedef struct Chan {
  mp_Seg seg;
  int kind;
  int end;                /* -1 for a queue, 0 or 1 for a connection */
  int rring, wring;       /* -1 when this end cannot read / write */
  int rsock, wsock;       /* descriptor sockets of rring / wring */
  int revfd, wevfd;       /* eventfds of rring / wring (a queue: one) */
  int slot;               /* our peer slot ... */
  pid_t slotpid;          /* ... in this process */
  mp_Self *self;          /* which process this is (mp_self) */
  char *rbuf;             /* reused for received messages: fresh memory */
  size_t rbufcap;         /* for every big message means page faults */
  mp_Spare wbuf;          /* ... and for the encodings of sent ones */
  int codec;              /* MP_CODEC_DATA; a pool's own task queue sets
                             MP_CODEC_FUNCTIONS on its two handles */
  int hook;               /* a test hook (LUA_MP_TEST_HOOK) */
} Chan;

typedef struct Inbox {
  char *buf;              /* in->small, the channel's rbuf, or malloc'd */
  int owned;
  size_t len;
  int *fds;
  size_t nfds;
  uint32_t flags;
  char small[INLINE_BUF];
} Inbox;

static inline ChanHdr *chan_hdr(Chan *c) {
  return (ChanHdr *)(void *)c->seg.base;
}
static inline Ring *chan_ring(Chan *c, int r) {
  return &chan_hdr(c)->ring[r];
}
static inline unsigned char *ring_data(Chan *c, int r) {
  return c->seg.base + chan_hdr(c)->data_off + (size_t)r * chan_hdr(c)->cap;
}

static inline uint64_t ld64(const uint64_t *p) {
  return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static inline uint32_t ld32(const uint32_t *p) {
  return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}
static int64_t count_of(Chan *c, int r) {
  return __atomic_load_n(&chan_ring(c, r)->count, __ATOMIC_SEQ_CST);
}

static const char *chan_what(Chan *c) {
  if (c->kind == K_CONN) return "Connection";
  return c->seg.base && chan_hdr(c)->joinable ? "JoinableQueue" : "Queue";
}

static void closefd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

/* --- the eventfd of a ring, for fileno() --------------------------------- */

static void ev_signal(int fd) {
  uint64_t one = 1;
  if (fd >= 0 && write(fd, &one, sizeof one) < 0) { /* full: readable */ }
}

/* A reader took a message: when none is left, the descriptor stops being
** readable (and is made readable again if one came meanwhile). */
static void ev_taken(Chan *c, int r) {
  uint64_t v;
  if (!ld32(&chan_ring(c, r)->watched) || count_of(c, r) > 0) return;
  if (read(c->revfd, &v, sizeof v) < 0) { /* already clear */ }
  if (count_of(c, r) > 0) ev_signal(c->revfd);
}

/* --- attach / detach ----------------------------------------------------- */

/* 1 when this process attached c (a fork's copy must attach anew) */
static int attached_here(Chan *c) {
  return c->slotpid == mp_self_pid(c->self);
}

static void chan_attach(lua_State *L, Chan *c) {
  if (attached_here(c)) return;
  c->slot = mp_peers_attach(&chan_hdr(c)->peers, c->end);
  if (c->slot < 0)
    luaL_error(L, "%s: more than %d processes attached", chan_what(c),
               MP_NSLOTS);
  c->slotpid = mp_self_pid(c->self);
}

static void chan_drain(lua_State *L, Chan *c, int only);

/* Closes this handle; the last user of the channel (or of a pipe's
** reading end) empties what nobody can read any more first. */
static void chan_release(lua_State *L, Chan *c) {
  if (c->seg.base && attached_here(c) && c->slot >= 0) {
    mp_Peers *p = &chan_hdr(c)->peers;
    mp_peers_detach(p, c->slot);
    c->slot = -1;
    if (mp_peers_alive(p, -1, -1) != 1)
      chan_drain(L, c, -1);                /* nobody else: every ring */
    else if (c->kind == K_CONN && c->rring >= 0 &&
             mp_peers_alive(p, -1, 1 - c->end) != 1)
      chan_drain(L, c, c->rring);          /* nobody else reads this one */
  }
  c->slot = -1;
  c->slotpid = 0;
  mp_seg_close(&c->seg);
  if (c->wsock != c->rsock) closefd(&c->wsock);
  closefd(&c->rsock);
  c->wsock = -1;
  if (c->wevfd != c->revfd) closefd(&c->wevfd);
  closefd(&c->revfd);
  c->wevfd = -1;
  free(c->rbuf);
  c->rbuf = NULL;
  c->rbufcap = 0;
  free(c->wbuf.data);
  c->wbuf.data = NULL;
  c->wbuf.cap = 0;
}

static Chan *testchan(lua_State *L, int idx) {
  Chan *c = (Chan *)luaL_testudata(L, idx, QUEUE_T);
  if (!c) c = (Chan *)luaL_testudata(L, idx, JQUEUE_T);
  if (!c) c = (Chan *)luaL_testudata(L, idx, CONN_T);
  return c;
}

static Chan *tochan(lua_State *L, int idx) {
  Chan *c = testchan(L, idx);
  if (!c) mp_typeerror(L, idx, "Queue or Connection");
  return c;
}

static Chan *checkchan(lua_State *L, int idx) {
  Chan *c = tochan(L, idx);
  if (!c->seg.base) luaL_error(L, "attempt to use a closed %s", chan_what(c));
  chan_attach(L, c);
  return c;
}

/* --- walking values for the channels (and other objects) inside ---------- */

static int plain_type(int type) {
  return type != LUA_TTABLE && type != LUA_TFUNCTION && type != LUA_TUSERDATA;
}

/* Called on every value met; returns 1 when it handled the value (the walk
** does not look inside it). */
typedef int (*Visit)(lua_State *L, int idx, void *ud);

/* Visits tables and Lua functions' upvalues once each (the table at 'seen'
** records them), down to a depth that no real argument reaches.  The
** globals table is not walked: a queue is attached when first used anyway;
** walking finds only the ones a worker might never touch. */
static void walk(lua_State *L, int idx, int seen, int depth, Visit visit,
                 void *ud) {
  int type = lua_type(L, idx), i;
  idx = lua_absindex(L, idx);
  if (visit(L, idx, ud) || depth > 200) return;
  if (type != LUA_TTABLE && type != LUA_TFUNCTION) return;
  lua_pushvalue(L, idx);
  if (lua_rawget(L, seen) != LUA_TNIL) {
    lua_pop(L, 1);
    return;
  }
  lua_pop(L, 1);
  lua_pushvalue(L, idx);
  lua_pushboolean(L, 1);
  lua_rawset(L, seen);
  luaL_checkstack(L, 4, "walking shared objects");
  if (type == LUA_TTABLE) {
    lua_pushnil(L);
    while (lua_next(L, idx)) {                /* ... key value */
      walk(L, -2, seen, depth + 1, visit, ud);
      walk(L, -1, seen, depth + 1, visit, ud);
      lua_pop(L, 1);
    }
  } else {
    for (i = 1; lua_getupvalue(L, idx, i) != NULL; i++) {  /* ... upvalue */
      walk(L, -1, seen, depth + 1, visit, ud);
      lua_pop(L, 1);
    }
  }
}

/* Whether the value at 'idx' holds nothing a walk would visit: a table
** whose keys and values, or a function whose upvalues, are neither
** tables, functions nor userdata (the globals excepted: never walked).
** Such a value, the common fn or args, is visited alone: no table is made
** to walk it. */
static int walks_nothing(lua_State *L, int idx) {
  int i, deep = 0;
  if (lua_type(L, idx) == LUA_TTABLE) {
    lua_pushnil(L);                           /* ... nil */
    while (!deep && lua_next(L, idx)) {       /* ... k v */
      deep = !plain_type(lua_type(L, -1)) || !plain_type(lua_type(L, -2));
      lua_pop(L, 1);                          /* ... k */
    }
    if (deep) lua_pop(L, 1);                  /* ... */
    return !deep;
  }
  if (lua_type(L, idx) != LUA_TFUNCTION) return 1;
  lua_pushglobaltable(L);                     /* ... G */
  for (i = 1; !deep && lua_getupvalue(L, idx, i) != NULL; i++) {
    deep = !plain_type(lua_type(L, -1)) && !lua_rawequal(L, -1, -2);
    lua_pop(L, 1);                            /* ... G */
  }
  lua_pop(L, 1);                              /* ... */
  return !deep;
}

static void walk_value(lua_State *L, int idx, Visit visit, void *ud) {
  idx = lua_absindex(L, idx);
  if (walks_nothing(L, idx)) {
    visit(L, idx, ud);
    return;
  }
  lua_newtable(L);                            /* ... seen */
  lua_pushglobaltable(L);
  lua_pushboolean(L, 1);
  lua_rawset(L, -3);
  walk(L, idx, lua_gettop(L), 0, visit, ud);
  lua_pop(L, 1);
}

/* Adds an open channel to the set at *ud. */
static int visit_collect(lua_State *L, int idx, void *ud) {
  Chan *c = testchan(L, idx);
  if (!c) return 0;
  if (c->seg.base) {
    lua_pushvalue(L, idx);                    /* ... c */
    lua_pushboolean(L, 1);                    /* ... c true */
    lua_rawset(L, *(int *)ud);                /* ... */
  }
  return 1;
}

void mp_sharing_collect(lua_State *L, int fn, int args) {
  int set;
  fn = lua_absindex(L, fn);
  args = lua_absindex(L, args);
  lua_newtable(L);                            /* set */
  set = lua_gettop(L);
  walk_value(L, fn, visit_collect, &set);
  walk_value(L, args, visit_collect, &set);
}

/* The open channel of the key below the top, or NULL (a set's lua_next). */
static Chan *set_chan(lua_State *L) {
  Chan *c = testchan(L, -2);
  return c != NULL && c->seg.base != NULL ? c : NULL;
}

void mp_sharing_attach(lua_State *L, int set) {
  set = lua_absindex(L, set);
  lua_pushnil(L);                             /* nil */
  while (lua_next(L, set)) {                  /* c true */
    Chan *c = set_chan(L);
    lua_pop(L, 1);                            /* c */
    if (c) chan_attach(L, c);
  }
}

void mp_sharing_handed(lua_State *L, int set, const mp_Worker *w, int n) {
  set = lua_absindex(L, set);
  lua_pushnil(L);                             /* nil */
  while (lua_next(L, set)) {                  /* c true */
    Chan *c = set_chan(L);
    int i;
    lua_pop(L, 1);                            /* c */
    for (i = 0; c && i < n; i++)
      if (w[i].pid > 0)
        mp_peers_handed(&chan_hdr(c)->peers, c->end, w[i].pid);
  }
}

/* --- waiting ------------------------------------------------------------- */

enum { W_DATA, W_SPACE, W_SLOT, W_REST, W_DONE };

typedef struct Waiter {
  Chan *c;
  int r;
  int what;
  uint64_t need;          /* W_DATA: bytes available; W_SPACE: free bytes */
  int peers;              /* ask whether the peers are gone: while asleep,
                             and at the deadline */
} Waiter;

static uint64_t avail(Chan *c, int r) {
  Ring *g = chan_ring(c, r);
  return ld64(&g->tail) - ld64(&g->head);
}

static int abandoned(Chan *c, int r);

static int ready(const Waiter *x) {
  Chan *c = x->c;
  switch (x->what) {
    case W_DATA: return avail(c, x->r) >= x->need;
    case W_SPACE: return chan_hdr(c)->cap - avail(c, x->r) >= x->need;
    case W_SLOT: {
      int64_t m = chan_hdr(c)->maxsize;
      return m <= 0 || count_of(c, x->r) < m;
    }
    case W_REST: return avail(c, x->r) > 0;
    default:
      return __atomic_load_n(&chan_hdr(c)->unfinished, __ATOMIC_SEQ_CST) <= 0;
  }
}

static int peers_gone(Chan *c) {
  return mp_peers_alive(&chan_hdr(c)->peers, c->slot, c->kind == K_CONN ? c->end : -1)
         < 0;
}

static uint32_t *wait_word(const Waiter *x, uint32_t **waiters) {
  ChanHdr *h = chan_hdr(x->c);
  Ring *g = &h->ring[x->r];
  switch (x->what) {
    case W_DATA: case W_REST: *waiters = &g->rwait; return &g->dataseq;
    case W_DONE: *waiters = &h->donewait; return &h->doneseq;
    default: *waiters = &g->wwait; return &g->spaceseq;
  }
}

static int waiter_ready(void *arg) { return ready((const Waiter *)arg); }

/* Peers gone, unless what they did before they went is there: whatever a
** process wrote is visible once it is seen gone, so ready() is asked
** after. */
static int gone(const Waiter *x) {
  return peers_gone(x->c) && !ready(x);
}

/* About every MP_SLICE while asleep (the wake-up that ended the sleep may
** have been the last item of a writer that is gone since). */
static int waiter_check(void *arg) {
  Waiter *x = (Waiter *)arg;
  if (x->what == W_REST && abandoned(x->c, x->r)) return MP_SKIPPED;
  if (x->peers && gone(x)) return MP_PEERGONE;
  return MP_OK;
}

/* Returns MP_OK, MP_TIMEOUT, MP_INTERRUPT, MP_PEERGONE, or MP_SKIPPED
** (W_REST: the writer gave up on the message). */
static int wait_for(Waiter *x, mp_Wait *w) {
  mp_Waitable on;
  int st;
  on.word = wait_word(x, &on.waiters);
  on.ready = waiter_ready;
  on.check = waiter_check;
  on.arg = x;
  st = mp_wait_for(w, &on);
  /* a timed wait learns at its deadline whether it could ever end */
  if (st == MP_TIMEOUT && x->peers && w->deadline > w->started)
    st = !peers_gone(x->c) ? MP_TIMEOUT : ready(x) ? MP_OK : MP_PEERGONE;
  return st;
}

static void waiter_init(Waiter *x, Chan *c, int r, int what, uint64_t need) {
  x->c = c;
  x->r = r;
  x->what = what;
  x->need = need;
  x->peers = what != W_DONE;
}

static void wake(uint32_t *word, uint32_t *waiters) {
  mp_wake(word, waiters, INT_MAX);
}

/* Waits for x with the deadline of w suspended: the rest of a message. */
static int wait_untimed(Waiter *x, mp_Wait *w) {
  double dl = w->deadline;
  int st;
  w->deadline = -1;
  st = wait_for(x, w);
  w->deadline = dl;
  return st;
}

/* Sleeps until ring r of c has one byte of room (W_SPACE) or of the rest
** of a message (W_REST): within the wait's deadline when 'timed', else
** without it. */
static int wait_byte(Chan *c, int r, int what, int timed, mp_Wait *w) {
  Waiter x;
  waiter_init(&x, c, r, what, 1);
  return timed ? wait_for(&x, w) : wait_untimed(&x, w);
}

/* --- ring copies --------------------------------------------------------- */

/* A position in a ring's data: copies that follow each other go on from
** it without dividing again. */
typedef struct Cursor {
  unsigned char *d;
  uint64_t cap, off;
} Cursor;

static Cursor cursor(Chan *c, int r, uint64_t at) {
  Cursor k;
  k.d = ring_data(c, r);
  k.cap = chan_hdr(c)->cap;
  k.off = at % k.cap;
  return k;
}

static size_t cursor_step(Cursor *k, size_t n) {
  size_t first = (size_t)(k->cap - k->off) < n ? (size_t)(k->cap - k->off) : n;
  k->off += n;
  if (k->off >= k->cap) k->off -= k->cap;
  return first;
}

/* Copies n bytes (src NULL: zeros) into the ring (not published). */
static void put_at(Cursor *k, const void *src, size_t n) {
  unsigned char *at = k->d + k->off;
  size_t first = cursor_step(k, n);
  if (src) {
    memcpy(at, src, first);
    if (n > first) memcpy(k->d, (const char *)src + first, n - first);
  } else {
    memset(at, 0, first);
    if (n > first) memset(k->d, 0, n - first);
  }
}

/* Copies n bytes out of the ring (not consumed). */
static void get_at(Cursor *k, void *dst, size_t n) {
  const unsigned char *at = k->d + k->off;
  size_t first = cursor_step(k, n);
  memcpy(dst, at, first);
  if (n > first) memcpy((char *)dst + first, k->d, n - first);
}

static void publish(Chan *c, int r, uint64_t tail) {
  Ring *g = chan_ring(c, r);
  __atomic_store_n(&g->tail, tail, __ATOMIC_SEQ_CST);
  wake(&g->dataseq, &g->rwait);
}

static void consume(Chan *c, int r, size_t n) {
  Ring *g = chan_ring(c, r);
  __atomic_store_n(&g->head, g->head + n, __ATOMIC_SEQ_CST);
  wake(&g->spaceseq, &g->wwait);
}

/* Takes n bytes from the ring; dst may be NULL: skip. */
static void ring_get(Chan *c, int r, void *dst, size_t n) {
  if (dst) {
    Cursor k = cursor(c, r, chan_ring(c, r)->head);
    get_at(&k, dst, n);
  }
  consume(c, r, n);
}

/* --- writing ------------------------------------------------------------- */

/* Writes n bytes (src NULL: zeros) as room comes, within the deadline of
** w; keeps wpending up to date, so that giving up leaves the ring in a
** state the next writer and the reader both understand. */
static int write_chunks(Chan *c, int r, const void *src, size_t n,
                        mp_Wait *w) {
  Ring *g = chan_ring(c, r);
  const char *p = (const char *)src;
  while (n > 0) {
    uint64_t room = chan_hdr(c)->cap - avail(c, r), t = g->tail;
    size_t k = room < n ? (size_t)room : n;
    Cursor at;
    if (k == 0) {  /* full: wait for room, then look again */
      int st = wait_byte(c, r, W_SPACE, 1, w);
      if (st != MP_OK) return st;
      continue;
    }
    at = cursor(c, r, t);
    put_at(&at, p, k);
    if (p) p += k;
    n -= k;
    g->wpending -= k;
    publish(c, r, t + k);
    if (w->patience > 0) w->deadline = mp_now() + w->patience;
  }
  return MP_OK;
}

/* With wlock held: pads what a writer that gave up still owed. */
static int writer_recover(Chan *c, int r, mp_Wait *w) {
  Ring *g = chan_ring(c, r);
  if (g->wpending == 0) return MP_OK;
  return write_chunks(c, r, NULL, (size_t)g->wpending, w);
}

/* A JoinableQueue's count of messages put and not yet task_done (or
** dropped); join() wakes when it drops to 0. */
static void unfinished_add(Chan *c, int64_t n) {
  ChanHdr *h = chan_hdr(c);
  if (__atomic_add_fetch(&h->unfinished, n, __ATOMIC_SEQ_CST) <= 0)
    wake(&h->doneseq, &h->donewait);
}

/* With wlock held, giving up on the message begun at 'start': when no
** reader has taken any of it, it is taken back whole and uncounted (1). */
static int retract(Chan *c, int r, uint64_t start) {
  Ring *g = chan_ring(c, r);
  int e = pthread_mutex_trylock(&g->rlock), done = 0;
  if (e == EOWNERDEAD) pthread_mutex_consistent(&g->rlock);
  else if (e != 0) return 0;
  if (ld64(&g->head) == start && g->rpending == 0) {
    __atomic_store_n(&g->tail, start, __ATOMIC_SEQ_CST);
    __atomic_sub_fetch(&g->count, 1, __ATOMIC_SEQ_CST);
    if (chan_hdr(c)->joinable) unfinished_add(c, -1);
    g->counted_at = 0;
    g->wpending = 0;
    wake(&g->spaceseq, &g->wwait);
    done = 1;
  }
  pthread_mutex_unlock(&g->rlock);
  return done;
}

/* With rlock held, mid-message and nothing to read: when the writer of
** this message gave up (its lock is free, or its owner died), skips what it
** still owed -- head and tail jump together, no bytes needed.  1 when it
** did. */
static int abandoned(Chan *c, int r) {
  Ring *g = chan_ring(c, r);
  int e = pthread_mutex_trylock(&g->wlock), done = 0;
  if (e == EOWNERDEAD) pthread_mutex_consistent(&g->wlock);
  else if (e != 0) return 0;
  if (g->wpending > 0 && g->wpending == g->rpending && avail(c, r) == 0) {
    uint64_t k = g->wpending;
    g->wpending = 0;
    g->rpending = 0;
    __atomic_store_n(&g->head, g->head + k, __ATOMIC_SEQ_CST);
    publish(c, r, g->tail + k);
    wake(&g->spaceseq, &g->wwait);
    done = 1;
  }
  pthread_mutex_unlock(&g->wlock);
  return done;
}

/* Waits until the socket is ready for 'events', a slice at most. */
static int sock_wait(Chan *c, int fd, short events, mp_Wait *w, int timed) {
  struct pollfd pf;
  double sl = mp_wait_slice(w);
  if (timed && sl <= 0) return MP_TIMEOUT;
  pf.fd = fd;
  pf.events = events;
  poll(&pf, 1, (int)(sl * 1000) + 1);
  if (peers_gone(c)) return MP_PEERGONE;
  if (mp_wait_interrupted(w)) return MP_INTERRUPT;
  return MP_OK;
}

static int send_fds(Chan *c, uint32_t seq, const int *fds, size_t nfds,
                    mp_Wait *w) {
  while (nfds > 0) {
    size_t k = nfds > MP_MAXFDS ? MP_MAXFDS : nfds;
    FdRec rec;
    ssize_t s;
    int st;
    rec.seq = seq;
    rec.count = (uint32_t)k;
    s = mp_sendfds(c->wsock, &rec, sizeof rec, fds, k, MSG_DONTWAIT);
    if (s == -EAGAIN) {
      if ((st = sock_wait(c, c->wsock, POLLOUT, w, w->deadline >= 0)) != MP_OK)
        return st;
      continue;
    }
    if (s == -EPIPE || s == -ECONNRESET) return MP_PEERGONE;
    if (s < 0) return (int)-s;
    fds += k;
    nfds -= k;
  }
  return MP_OK;
}

/* The test hooks: LUA_MP_TEST_HOOK=put_counted SIGKILLs a writer between
** counting its message and publishing any of it.  Read once per handle. */
enum { HOOK_NONE, HOOK_PUT_COUNTED };

static int test_hook(void) {
  const char *v = getenv("LUA_MP_TEST_HOOK");
  return v != NULL && strcmp(v, "put_counted") == 0 ? HOOK_PUT_COUNTED
                                                    : HOOK_NONE;
}

/* With wlock held: the message about to start at the tail is counted (and,
** in a JoinableQueue, unfinished); counted_at first, so that a writer
** killed in between is taken back (uncount). */
static void count_message(Chan *c, int r) {
  Ring *g = chan_ring(c, r);
  g->counted_at = g->tail + 1;
  __atomic_add_fetch(&g->count, 1, __ATOMIC_SEQ_CST);
  if (chan_hdr(c)->joinable) unfinished_add(c, 1);
  if (c->hook == HOOK_PUT_COUNTED) kill(getpid(), SIGKILL);
}

/* With wlock held: a message counted and never published (its writer died
** before its first byte) is uncounted; a slot of a bounded Queue comes
** back. */
static void uncount(Chan *c, int r) {
  Ring *g = chan_ring(c, r);
  if (g->counted_at == 0) return;
  if (g->counted_at == ld64(&g->tail) + 1) {
    __atomic_sub_fetch(&g->count, 1, __ATOMIC_SEQ_CST);
    if (chan_hdr(c)->joinable) unfinished_add(c, -1);
    g->wpending = 0;
    wake(&g->spaceseq, &g->wwait);
  }
  g->counted_at = 0;
}

/* For the counts read without wlock (qsize, empty, full, drain): a count
** left by a dead writer is taken back first.  Free unless one was left. */
static void settle_count(Chan *c, int r) {
  Ring *g = chan_ring(c, r);
  int e;
  if (__atomic_load_n(&g->counted_at, __ATOMIC_SEQ_CST) == 0) return;
  e = pthread_mutex_trylock(&g->wlock);
  if (e == EOWNERDEAD) pthread_mutex_consistent(&g->wlock);
  else if (e != 0) return;        /* a writer at work: its count is right */
  uncount(c, r);
  pthread_mutex_unlock(&g->wlock);
}

/* Writes one message.  Returns MP_OK, MP_TIMEOUT, MP_INTERRUPT,
** MP_PEERGONE or an errno.  A JoinableQueue's message is unfinished from
** its count on, and no longer once it failed: taken back whole by its
** writer (uncount, retract), else skipped by its reader (read_locked),
** each of which finishes it once. */
static int chan_write(Chan *c, const void *data, size_t n, const int *fds,
                      size_t nfds, uint32_t flags, mp_Wait *w) {
  int r = c->wring, st;
  Ring *g = chan_ring(c, r);
  uint64_t cap = chan_hdr(c)->cap, total = MSG_HDR + n + MSG_END, end;
  MsgHdr mh;
  Waiter x;
  st = mp_mutex_lock(&g->wlock, w);
  if (st == MP_OWNERDEAD) st = MP_OK;
  if (st != MP_OK) return st;
  uncount(c, r);
  if ((st = writer_recover(c, r, w)) != MP_OK) goto done;
  waiter_init(&x, c, r, W_SLOT, 0);
  if ((st = wait_for(&x, w)) != MP_OK) goto done;
  /* a put that may not wait writes all of it or nothing */
  if (total > cap - avail(c, r) && mp_wait_slice(w) <= 0) {
    st = MP_TIMEOUT;
    goto done;
  }
  /* all at once when it fits, else once the ring is empty, in pieces */
  waiter_init(&x, c, r, W_SPACE, total < cap ? total : cap);
  if ((st = wait_for(&x, w)) != MP_OK) goto done;
  mh.len = n;
  mh.nfds = (uint32_t)nfds;
  mh.seq = ++g->wseq;
  mh.flags = flags;
  mh.pad = 0;
  end = TRAILER_MAGIC | mh.seq;
  if (nfds && (st = send_fds(c, mh.seq, fds, nfds, w)) != MP_OK) goto done;
  count_message(c, r);
  if (total <= cap - avail(c, r)) {
    /* the common case: one copy, one publication */
    uint64_t t = g->tail;
    Cursor k = cursor(c, r, t);
    put_at(&k, &mh, MSG_HDR);
    put_at(&k, data, n);
    put_at(&k, &end, MSG_END);
    publish(c, r, t + total);
  } else {
    uint64_t start = g->tail;
    g->wpending = total;
    if ((st = write_chunks(c, r, &mh, MSG_HDR, w)) == MP_OK &&
        (st = write_chunks(c, r, data, n, w)) == MP_OK)
      st = write_chunks(c, r, &end, MSG_END, w);
    if (st != MP_OK && !retract(c, r, start))
      wake(&g->dataseq, &g->rwait);  /* the reader in it skips the rest */
  }
  if (st == MP_OK && ld32(&g->watched)) ev_signal(c->wevfd);
done:
  g->counted_at = 0;
  pthread_mutex_unlock(&g->wlock);
  return st;
}

/* --- reading ------------------------------------------------------------- */

static void inbox_clear(Inbox *in) {
  size_t i;
  if (in->buf && in->owned) free(in->buf);
  in->buf = NULL;
  for (i = 0; i < in->nfds; i++)
    if (in->fds[i] >= 0) close(in->fds[i]);
  free(in->fds);
  in->fds = NULL;
  in->nfds = 0;
}

static int inbox_gc(lua_State *L) {
  inbox_clear((Inbox *)lua_touserdata(L, 1));
  return 0;
}

/* Takes n bytes of the current message (dst NULL: skips them), waiting for
** them without the deadline: the rest of a message comes or is given up. */
static int read_rest(Chan *c, int r, size_t n, char *dst, mp_Wait *w) {
  Ring *g = chan_ring(c, r);
  while (n > 0) {
    uint64_t a = avail(c, r);
    size_t k = a < n ? (size_t)a : n;
    int st = k > 0 ? MP_OK : wait_byte(c, r, W_REST, 0, w);
    if (st != MP_OK) return st;
    if (k == 0) continue;  /* the rest came: look again */
    ring_get(c, r, dst, k);
    if (dst) dst += k;
    n -= k;
    g->rpending -= k;
  }
  return MP_OK;
}

static int recv_fds(Chan *c, uint32_t seq, Inbox *in, size_t want,
                    mp_Wait *w) {
  while (in->nfds < want) {
    FdRec rec;
    int got[MP_MAXFDS], st;
    size_t ngot = 0, i;
    ssize_t k = mp_recvfds(c->rsock, &rec, sizeof rec, got, MP_MAXFDS, &ngot,
                           MSG_DONTWAIT);
    if (k == -EAGAIN) {
      if ((st = sock_wait(c, c->rsock, POLLIN, w, 0)) != MP_OK) return st;
      continue;
    }
    if (k == -EPROTO) return EPROTO;
    if (k < 0) return (int)-k;
    if (k != (ssize_t)sizeof rec || ngot != rec.count) {
      for (i = 0; i < ngot; i++) close(got[i]);
      return EBADMSG;
    }
    if (rec.seq != seq) {
      /* left behind by a writer that gave up on its message */
      for (i = 0; i < ngot; i++) close(got[i]);
      if ((int32_t)(rec.seq - seq) > 0) return EBADMSG;
      continue;
    }
    if (in->nfds + ngot > want) {
      for (i = 0; i < ngot; i++) close(got[i]);
      return EBADMSG;
    }
    memcpy(in->fds + in->nfds, got, ngot * sizeof(int));
    in->nfds += ngot;
  }
  return MP_OK;
}

#define RBUF_KEEP ((size_t)64 << 20)

static char *rbuf_for(Chan *c, Inbox *in, size_t len) {
  in->owned = 0;
  if (len <= INLINE_BUF) return in->small;
  if (len > RBUF_KEEP) {
    in->owned = 1;
    return (char *)malloc(len);
  }
  if (len > c->rbufcap) {
    char *nb = (char *)realloc(c->rbuf, len);
    if (!nb) return NULL;
    c->rbuf = nb;
    c->rbufcap = len;
  }
  return c->rbuf;
}

/* A message dropped on its way (its writer gave up or died in it, or a
** reader before us failed in it) is finished: nobody will take it, and a
** JoinableQueue's join must not wait for its task_done. */
static void finish_skipped(Chan *c) {
  if (chan_hdr(c)->joinable) unfinished_add(c, -1);
}

/* Reads one message of ring r into 'in', with rlock held.  Its
** descriptors come from this end's socket; a ring this end does not read
** has none for it (chan_drain), and a message with descriptors is then
** dropped.  Returns MP_OK, MP_TIMEOUT, MP_INTERRUPT, MP_PEERGONE, or an
** errno. */
static int read_locked(Chan *c, int r, Inbox *in, mp_Wait *w) {
  Ring *g = chan_ring(c, r);
  for (;;) {
    MsgHdr mh;
    Waiter x;
    Cursor k;
    uint64_t end = 0;
    int st;
    if (g->rpending) {   /* what a reader before us left of its message */
      st = read_rest(c, r, (size_t)g->rpending, NULL, w);
      if (st != MP_OK && st != MP_SKIPPED) return st;
      finish_skipped(c);
    }
    waiter_init(&x, c, r, W_DATA, MSG_HDR);
    if ((st = wait_for(&x, w)) != MP_OK) return st;
    __atomic_sub_fetch(&g->count, 1, __ATOMIC_SEQ_CST);
    k = cursor(c, r, g->head);
    get_at(&k, &mh, MSG_HDR);
    in->flags = mh.flags;
    in->len = (size_t)mh.len;
    in->buf = rbuf_for(c, in, in->len);
    if (mh.nfds) in->fds = (int *)malloc(sizeof(int) * mh.nfds);
    if (!in->buf || (mh.nfds && !in->fds)) {
      g->rpending = mh.len + MSG_END;        /* the next reader skips it */
      consume(c, r, MSG_HDR);
      return ENOMEM;
    }
    if (avail(c, r) >= MSG_HDR + mh.len + MSG_END) {
      /* the common case: all of it is there, taken in one go (this also
      ** wakes a writer waiting on maxsize) */
      get_at(&k, in->buf, in->len);
      get_at(&k, &end, MSG_END);
      consume(c, r, MSG_HDR + mh.len + MSG_END);
    } else {
      g->rpending = mh.len + MSG_END;
      consume(c, r, MSG_HDR);
      if ((st = read_rest(c, r, in->len, in->buf, w)) == MP_OK)
        st = read_rest(c, r, MSG_END, (char *)&end, w);
    }
    if (st == MP_OK && end == (TRAILER_MAGIC | mh.seq)) {
      if (mh.nfds && (r != c->rring || c->rsock < 0)) st = MP_SKIPPED;
      else if (mh.nfds) st = recv_fds(c, mh.seq, in, mh.nfds, w);
      if (st == MP_OK) return MP_OK;
    } else if (st == MP_OK) {
      st = MP_SKIPPED;       /* padding of a message its writer gave up */
    }
    if (st != MP_SKIPPED) return st;
    finish_skipped(c);
    inbox_clear(in);
  }
}

static int chan_read(Chan *c, Inbox *in, mp_Wait *w) {
  Ring *g = chan_ring(c, c->rring);
  int st = mp_mutex_lock(&g->rlock, w);
  if (st == MP_OWNERDEAD) st = MP_OK;
  if (st != MP_OK) return st;
  st = read_locked(c, c->rring, in, w);
  if (st == MP_OK) ev_taken(c, c->rring);
  pthread_mutex_unlock(&g->rlock);
  return st;
}

/* --- what the last user leaves in a channel ------------------------------ */

/* Closes every object a dropped message held (tables are walked; functions
** are module references: not theirs to close). */
static int visit_close(lua_State *L, int idx, void *ud) {
  (void)ud;
  if (lua_type(L, idx) == LUA_TFUNCTION) return 1;
  if (lua_type(L, idx) != LUA_TUSERDATA) return 0;
  if (luaL_getmetafield(L, idx, "__close") != LUA_TNIL) {  /* ... close */
    lua_pushvalue(L, idx);
    lua_pushnil(L);
    if (lua_pcall(L, 2, 0, 0) != LUA_OK) lua_pop(L, 1);
  }
  return 1;
}

/* The routes of q:_get_into(t, timeout, routes), which the Pool's parent
** takes its results with: a message {m, k, ...} whose route routes[m] = r
** is a table with r.dest, with k == r.upto + 1 and no more items after its
** 3rd than r.n - r.upto, has those items decoded straight into r.dest,
** from index r.first + r.upto on (what was the Pool's table.move of them,
** and the emptying of t after it).  A message that is no such
** continuation (k is not r.upto + 1: a worker gone since, its items run
** again) keeps its items in t, as does one with too many, which never
** writes past its record.  'ud' points to the stack index of routes
** (mp_decode_spill's 'where'). */
#define ROUTED_AFTER 3

/* The integer fields first, upto and n of the table on top, or 0. */
static int record_fields(lua_State *L, lua_Integer f[3]) {
  static const char *const names[3] = {"first", "upto", "n"};
  int i, isnum = 1;
  for (i = 0; i < 3 && isnum; i++) {
    lua_getfield(L, -1, names[i]);                    /* r v */
    f[i] = lua_tointegerx(L, -1, &isnum);
    lua_pop(L, 1);                                    /* r */
  }
  return isnum;
}

static int route(lua_State *L, int t, void *ud, lua_Integer count,
                 lua_Integer *shift) {
  int routes = *(const int *)ud, top = lua_gettop(L), isnum;
  lua_Integer f[3], k;                                /* first, upto, n */
  lua_rawgeti(L, t, 1);                               /* m */
  if (lua_rawget(L, routes) != LUA_TTABLE ||          /* r */
      !record_fields(L, f) ||
      lua_getfield(L, -1, "dest") != LUA_TTABLE) {    /* r dest */
    lua_settop(L, top);
    return 0;
  }
  lua_rawgeti(L, t, 2);                               /* r dest k */
  k = lua_tointegerx(L, -1, &isnum);
  if (!isnum || k != f[1] + 1 || count > f[2] - f[1]) {
    lua_settop(L, top);
    return 0;
  }
  lua_pop(L, 1);                                      /* r dest */
  lua_remove(L, -2);                                  /* dest */
  lua_pushliteral(L, "routed");                       /* dest "routed" */
  lua_pushboolean(L, 1);                              /* dest "routed" true */
  lua_rawset(L, t);                                   /* dest */
  *shift = f[0] + f[1] - (ROUTED_AFTER + 1);
  return 1;
}

/* Protected: the Inbox at 1, the codec flags at 2, nil or the table to
** decode into at 3, nil or its routes at 4 (route) -> the values. */
static int decode_k(lua_State *L) {
  Inbox *in = (Inbox *)lua_touserdata(L, 1);
  int routes = 4;
  mp_Spill spill;
  spill.after = ROUTED_AFTER;
  spill.where = route;
  spill.ud = &routes;
  return mp_decode_spill(L, lua_istable(L, 3) ? 3 : 0,
                         lua_istable(L, 4) ? &spill : NULL, in->buf,
                         in->len, (int)lua_tointeger(L, 2), in->fds,
                         in->nfds);
}

/* Protected: the Inbox at 1, the codec flags at 2 -> decodes it and closes
** what it held. */
static int drop_k(lua_State *L) {
  int n = decode_k(L), i, top = lua_gettop(L);
  for (i = top - n + 1; i <= top; i++) walk_value(L, i, visit_close, NULL);
  return 0;
}

/* Pushes a new, empty Inbox. */
static Inbox *push_inbox(lua_State *L) {
  Inbox *in = (Inbox *)lua_newuserdatauv(L, sizeof(Inbox), 0);  /* in */
  memset(in, 0, sizeof(Inbox) - INLINE_BUF);
  luaL_setmetatable(L, INBOX_T);
  return in;
}

/* The message in the Inbox on top will never be received: decodes it only
** to close what it carries (drop_k).  A message that does not decode was
** not ours to give back. */
static void drop_inbox(lua_State *L, const Chan *c) { /* in */
  lua_pushcfunction(L, drop_k);                       /* in drop */
  lua_pushvalue(L, -2);                               /* in drop in */
  lua_pushinteger(L, c->codec);                       /* in drop in codec */
  if (lua_pcall(L, 2, 0, 0) != LUA_OK) lua_pop(L, 1); /* in */
}

/* A put that failed: its encoding took references for its receiver
** (file_system names, channels in flight); decoding it here and closing
** what comes out gives them back.  The descriptors are the objects' own:
** the decoder gets copies. */
static void unsend(lua_State *L, const Chan *c, const mp_Encoded *enc) {
  Inbox *in = push_inbox(L);                          /* ... in */
  size_t i;
  in->buf = (char *)(uintptr_t)enc->data;   /* not owned: not freed */
  in->len = enc->size;
  if (enc->nfds && (in->fds = (int *)malloc(enc->nfds * sizeof(int)))) {
    for (; in->nfds < enc->nfds; in->nfds++)
      in->fds[in->nfds] = fcntl(enc->fds[in->nfds], F_DUPFD_CLOEXEC, 3);
  }
  for (i = 0; i < in->nfds && in->fds[i] >= 0; i++) {}
  if (i == enc->nfds) drop_inbox(L, c);
  inbox_clear(in);
  lua_pop(L, 1);
}

/* Nobody else will read ring 'only' (-1: any ring) of the channel: decodes
** what is left in it (file_system arrays give their names back, channels
** inside leave flight) and closes it.  A message with descriptors needs
** the ring's socket, which only its reading end has; what stays in a
** socket nobody else holds goes with it. */
static void chan_drain(lua_State *L, Chan *c, int only) {
  int r, top = lua_gettop(L);
  for (r = 0; r < (int)chan_hdr(c)->nrings; r++) {
    Ring *g = chan_ring(c, r);
    int e;
    if (only >= 0 && r != only) continue;
    settle_count(c, r);
    e = pthread_mutex_trylock(&g->rlock);
    if (e == EOWNERDEAD) pthread_mutex_consistent(&g->rlock);
    else if (e != 0) continue;
    while (count_of(c, r) > 0) {
      Inbox *in = push_inbox(L);                      /* ... in */
      mp_Wait w;
      mp_wait_init(&w, L, 0);
      if (read_locked(c, r, in, &w) != MP_OK) break;
      if (!(in->flags & (F_RAW | F_STR))) drop_inbox(L, c);
      inbox_clear(in);
      lua_pop(L, 1);
    }
    pthread_mutex_unlock(&g->rlock);
  }
  lua_settop(L, top);
}

/* --- Lua side ------------------------------------------------------------ */

/* What an interrupted op leaves: a message begun is lost (its readers
** skip the rest); otherwise nothing happened. */
static const char *interrupt_done(const char *op, int begun) {
  if (begun) return "the message being received was lost";
  if (strncmp(op, "put", 3) == 0) return "nothing was put";
  if (strncmp(op, "send", 4) == 0) return "nothing was sent";
  if (strcmp(op, "join") == 0) return "the queue was left as it was";
  if (strncmp(op, "recv", 4) == 0 || strcmp(op, "poll") == 0)
    return "nothing was received";
  return "nothing was taken";
}

static int raise_status(lua_State *L, Chan *c, int st, const char *op) {
  switch (st) {
    case MP_INTERRUPT:
      lua_pushfstring(L, "%s.%s", chan_what(c), op);
      return mp_raise_interrupt(L, lua_tostring(L, -1),
                                interrupt_done(op, 0));
    case EPROTO:
      return luaL_error(L, "%s.%s: descriptors were dropped in transit "
                        "(MSG_CTRUNC: too many open files?)", chan_what(c), op);
    case EBADMSG:
      return luaL_error(L, "%s.%s: a message came without the descriptors it "
                        "needs (SCM_RIGHTS missing or mismatched)",
                        chan_what(c), op);
    default:
      mp_push_errno(L, lua_pushfstring(L, "%s.%s", chan_what(c), op), st);
      return lua_error(L);
  }
}

/* nil, why for the expected outcomes; raises for the others. */
static int push_outcome(lua_State *L, Chan *c, int st, const char *op,
                        const char *timeout_why) {
  const char *why = st == MP_TIMEOUT ? timeout_why
                  : st == MP_PEERGONE ? "closed" : NULL;
  if (why == NULL) return raise_status(L, c, st, op);
  lua_pushnil(L);
  lua_pushstring(L, why);
  return 2;
}


/* Why a value cannot go: the end of the codec's "cannot send item.cb
** (function) ..." */
#define CROSS_WHY \
  " carries data and shared objects; a function crosses to another process" \
  " only as the function or an argument of start_processes, spawn or a" \
  " Pool task, or as a module's entry (string.format)"
#define QUEUE_WHY "through a Queue: a Queue" CROSS_WHY
#define PIPE_WHY "through a Pipe: a Pipe" CROSS_WHY

/* 'patient': a message too big to go at once is given up only after
** 'timeout' seconds in which its reader took none of it (mp_Wait). */
static int put_impl(lua_State *L, Chan *c, int vidx, double timeout,
                    const char *op, int raw, int patient) {
  static const char *const names[] = {"item"};
  mp_Encoded enc;
  mp_Wait w;
  int st;
  uint32_t flags = raw ? F_RAW : 0;
  if (c->wring < 0)
    return luaL_error(L, "%s.%s: this end of the pipe is read-only",
                      chan_what(c), op);
  if (lua_isnone(L, vidx)) return mp_argerror(L, vidx, "value expected");
  if (raw || lua_type(L, vidx) == LUA_TSTRING) {
    /* strings skip the codec: one copy into the ring */
    if (!raw) flags = F_STR;
    enc.data = mp_checklstring(L, vidx, &enc.size);
    enc.fds = NULL;
    enc.nfds = 0;
  } else {
    mp_encode_spare(L, vidx, 1, c->codec, names,
                    c->kind == K_QUEUE ? QUEUE_WHY : PIPE_WHY, &c->wbuf,
                    &enc);                            /* ... box */
  }
  mp_wait_init(&w, L, timeout);
  if (patient && timeout > 0) w.patience = timeout;
  st = chan_write(c, enc.data, enc.size, enc.fds, enc.nfds, flags, &w);
  if (flags == 0) {   /* the encoding is copied (or given up): reused */
    if (st != MP_OK) unsend(L, c, &enc);
    mp_encoded_spare(L, -1, &c->wbuf, RBUF_KEEP);
  }
  if (st != MP_OK)
    return push_outcome(L, c, st, op, timeout == 0 ? "full" : "timeout");
  lua_pushboolean(L, 1);
  return 1;
}

/* 'into': 0, or the stack index of an empty table that a message's table
** is decoded into (mp_decode_into); 'routes': 0, or the stack index of the
** routes of its items (route). */
static int get_impl(lua_State *L, Chan *c, double timeout, const char *op,
                    int raw, int into, int routes) {
  Inbox *in;
  mp_Wait w;
  int st, base;
  if (c->rring < 0)
    return luaL_error(L, "%s.%s: this end of the pipe is write-only",
                      chan_what(c), op);
  in = push_inbox(L);
  mp_wait_init(&w, L, timeout);
  st = chan_read(c, in, &w);
  if (st == MP_INTERRUPT && in->buf != NULL) {   /* the header was taken */
    inbox_clear(in);
    lua_pushfstring(L, "%s.%s", chan_what(c), op);
    return mp_raise_interrupt(L, lua_tostring(L, -1), interrupt_done(op, 1));
  }
  if (st != MP_OK) {
    inbox_clear(in);
    return push_outcome(L, c, st, op, timeout == 0 ? "empty" : "timeout");
  }
  if (in->flags & F_STR) {
    lua_pushlstring(L, in->buf, in->len);
  } else if ((in->flags & F_RAW) || raw) {
    if (!(in->flags & F_RAW)) {
      inbox_clear(in);
      return luaL_error(L, "%s.%s: the message is not raw bytes (use recv)",
                        chan_what(c), op);
    }
    lua_pushlstring(L, in->buf, in->len);
  } else {
    base = lua_gettop(L);
    lua_pushcfunction(L, decode_k);
    lua_pushvalue(L, base);
    lua_pushinteger(L, c->codec);
    if (into) lua_pushvalue(L, into);
    else lua_pushnil(L);
    if (routes) lua_pushvalue(L, routes);
    else lua_pushnil(L);
    st = lua_pcall(L, 4, LUA_MULTRET, 0);
    if (st != LUA_OK) {
      inbox_clear(in);
      return lua_error(L);
    }
    if (lua_gettop(L) != base + 1) {
      inbox_clear(in);
      return luaL_error(L, "%s.%s: a message must hold exactly one value",
                        chan_what(c), op);
    }
  }
  inbox_clear(in);
  return 1;
}

/* q:put(v [, timeout]) -> true | nil, "timeout" | "closed" */
static int queue_put(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return put_impl(L, c, 2, mp_opttimeout(L, 3), "put", 0, 0);
}

static int queue_put_nowait(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return put_impl(L, c, 2, 0, "put_nowait", 0, 0);
}

/* q:get([timeout]) -> v | nil, "timeout" | "closed" */
static int queue_get(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return get_impl(L, c, mp_opttimeout(L, 2), "get", 0, 0, 0);
}

/* q:_put_patient(v, timeout) -> as q:put, but a message too big for the
** ring, which goes in pieces as its reader takes them, is given up only
** when its reader takes nothing for 'timeout' seconds, not once
** 'timeout' has passed.  Internal: the Pool's parent waits a short while
** for room, so that it goes back to reading results (a worker blocked on
** posting its own reads no task), yet a message of any size gets across
** while a worker reads it. */
static int queue_put_patient(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return put_impl(L, c, 2, mp_opttimeout(L, 3), "put", 0, 1);
}

/* q:_get_into(t [, timeout [, routes]]) -> as q:get, but a message that
** is a table is decoded into t, over what it held (mp_decode_into), and
** t is what comes back; with 'routes', its items may go elsewhere (route),
** and then t.routed is true.  t false: a new table, made as big as the
** message says (a table given grows as it is filled).  Internal: the
** pool's loops take many big messages of one shape, and one table reused
** spares a table made and collected each. */
static int queue_get_into(lua_State *L) {
  Chan *c = checkchan(L, 1);
  luaL_argexpected(L, lua_istable(L, 2) || (lua_isboolean(L, 2) &&
                   !lua_toboolean(L, 2)), 2, "table or false");
  if (!lua_isnoneornil(L, 4)) luaL_checktype(L, 4, LUA_TTABLE);
  return get_impl(L, c, mp_opttimeout(L, 3), "get", 0,
                  lua_istable(L, 2) ? 2 : 0, lua_istable(L, 4) ? 4 : 0);
}

static int queue_get_nowait(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return get_impl(L, c, 0, "get_nowait", 0, 0, 0);
}

static int queue_qsize(lua_State *L) {
  Chan *c = checkchan(L, 1);
  int64_t n;
  settle_count(c, 0);
  n = count_of(c, 0);
  lua_pushinteger(L, n < 0 ? 0 : n);
  return 1;
}

static int queue_empty(lua_State *L) {
  Chan *c = checkchan(L, 1);
  settle_count(c, 0);
  lua_pushboolean(L, count_of(c, 0) <= 0);
  return 1;
}

static int queue_full(lua_State *L) {
  Chan *c = checkchan(L, 1);
  int64_t m = chan_hdr(c)->maxsize;
  settle_count(c, 0);
  lua_pushboolean(L, m > 0 && count_of(c, 0) >= m);
  return 1;
}

/* jq:task_done(): one item taken by get is finished. */
static int queue_task_done(lua_State *L) {
  Chan *c = checkchan(L, 1);
  ChanHdr *h = chan_hdr(c);
  int64_t n = __atomic_load_n(&h->unfinished, __ATOMIC_SEQ_CST);
  do {
    if (n <= 0)
      return luaL_error(L, "JoinableQueue.task_done: called more times than "
                        "there were items put");
  } while (!__atomic_compare_exchange_n(&h->unfinished, &n, n - 1, 0,
                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
  if (n == 1) wake(&h->doneseq, &h->donewait);
  return 0;
}

/* jq:join([timeout]) -> true when every item put is done, false on
** timeout. */
static int queue_join(lua_State *L) {
  Chan *c = checkchan(L, 1);
  mp_Wait w;
  Waiter x;
  int st;
  mp_wait_init(&w, L, mp_opttimeout(L, 2));
  waiter_init(&x, c, 0, W_DONE, 0);
  st = wait_for(&x, &w);
  if (st == MP_INTERRUPT) return raise_status(L, c, st, "join");
  lua_pushboolean(L, st == MP_OK);
  return 1;
}

static int chan_close(lua_State *L) {
  chan_release(L, tochan(L, 1));
  return 0;
}

/* q:_functions(): this handle sends and receives Lua functions as bytecode
** (MP_CODEC_FUNCTIONS).  Internal: only for a queue private to a parent and
** the workers it started (the pool's task queues), never a user's. */
static int queue_functions(lua_State *L) {
  checkchan(L, 1)->codec = MP_CODEC_FUNCTIONS;
  return 0;
}

static int chan_closed(lua_State *L) {
  lua_pushboolean(L, tochan(L, 1)->seg.base == NULL);
  return 1;
}

/* q:fileno() / conn:fileno() -> a descriptor that is readable when a
** message may be there: for poll(2), epoll, luv's uv.new_poll, cqueues;
** then get_nowait / recv(0).  Writers signal it only once someone asked
** for it, so the put/get path of everyone else pays one load. */
static int chan_fileno(lua_State *L) {
  Chan *c = checkchan(L, 1);
  Ring *g;
  if (c->rring < 0 || c->revfd < 0)
    return luaL_error(L, "%s.fileno: this end of the pipe is write-only",
                      chan_what(c));
  g = chan_ring(c, c->rring);
  if (!ld32(&g->watched)) __atomic_store_n(&g->watched, 1, __ATOMIC_SEQ_CST);
  if (count_of(c, c->rring) > 0) ev_signal(c->revfd);
  lua_pushinteger(L, c->revfd);
  return 1;
}

/* conn:send(v) -> true | nil, "closed" */
static int conn_send(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return put_impl(L, c, 2, -1, "send", 0, 0);
}

static int conn_send_bytes(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return put_impl(L, c, 2, -1, "send_bytes", 1, 0);
}

/* conn:recv([timeout]) -> v | nil, "timeout" | "closed" */
static int conn_recv(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return get_impl(L, c, mp_opttimeout(L, 2), "recv", 0, 0, 0);
}

static int conn_recv_bytes(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return get_impl(L, c, mp_opttimeout(L, 2), "recv_bytes", 1, 0, 0);
}

/* conn:poll([timeout = 0]) -> true when recv would not block (a message, or
** the other end gone so that recv returns nil, "closed"), false on
** timeout. */
static int conn_poll(lua_State *L) {
  Chan *c = checkchan(L, 1);
  double t = lua_isnoneornil(L, 2) ? 0 : mp_opttimeout(L, 2);
  mp_Wait w;
  Waiter x;
  int st;
  if (c->rring < 0)
    return luaL_error(L, "%s.poll: this end of the pipe is write-only",
                      chan_what(c));
  mp_wait_init(&w, L, t);
  waiter_init(&x, c, c->rring, W_DATA, 1);
  st = wait_for(&x, &w);
  if (st == MP_TIMEOUT && t == 0 && peers_gone(c)) st = MP_PEERGONE;
  if (st == MP_INTERRUPT) return raise_status(L, c, st, "poll");
  lua_pushboolean(L, st == MP_OK || st == MP_PEERGONE);
  return 1;
}

/* conn.readable, conn.writable: which ways this end goes. */
static int conn_index(lua_State *L) {
  Chan *c = tochan(L, 1);
  const char *k = lua_tostring(L, 2);
  if (k && strcmp(k, "readable") == 0)
    lua_pushboolean(L, c->rring >= 0);
  else if (k && strcmp(k, "writable") == 0)
    lua_pushboolean(L, c->wring >= 0);
  else
    mp_push_method(L);
  return 1;
}

static int chan_gc(lua_State *L) {
  chan_release(L, tochan(L, 1));
  return 0;
}

/* What tostring says of the other users: "" while some are there (or none
** ever was), else that they are gone. */
static const char *others(Chan *c) {
  int alive = mp_peers_alive(&chan_hdr(c)->peers,
                             attached_here(c) ? c->slot : -1,
                             c->kind == K_CONN ? c->end : -1);
  if (c->kind == K_CONN) return alive < 0 ? ", the other end closed" : "";
  return alive < 0 ? ", every other process gone" : "";
}

/* Pushes "1 <what>" or "<n> <what>s": the messages in ring r now. */
static const char *push_count(lua_State *L, Chan *c, int r, const char *what) {
  int64_t n = count_of(c, r);
  if (n < 0) n = 0;
  return lua_pushfstring(L, "%I %s%s", (lua_Integer)n, what, n == 1 ? "" : "s");
}

/* As of now: multiprocessing.Queue (3 items, maxsize 10): 0x...,
** multiprocessing.Connection (duplex, 1 to read, the other end closed) */
static int chan_tostring(lua_State *L) {
  Chan *c = tochan(L, 1);
  if (!c->seg.base) {
    lua_pushfstring(L, "multiprocessing.%s (closed)", chan_what(c));
  } else if (c->kind == K_QUEUE) {
    ChanHdr *h = chan_hdr(c);
    lua_pushfstring(L, "multiprocessing.%s (%s", chan_what(c),
                    push_count(L, c, 0, "item"));
    lua_remove(L, -2);
    if (h->maxsize > 0)
      lua_pushfstring(L, ", maxsize %I", (lua_Integer)h->maxsize);
    else
      lua_pushliteral(L, "");
    if (h->joinable)
      lua_pushfstring(L, ", %I unfinished", (lua_Integer)__atomic_load_n(
                      &h->unfinished, __ATOMIC_SEQ_CST));
    else
      lua_pushliteral(L, "");
    lua_pushfstring(L, "%s): %p", others(c), (void *)c->seg.base);
    lua_concat(L, 4);
  } else {
    if (c->rring >= 0) {
      lua_pushfstring(L, ", %s to read", push_count(L, c, c->rring, "message"));
      lua_remove(L, -2);
    } else
      lua_pushliteral(L, "");
    lua_pushfstring(L, "multiprocessing.Connection (%s%s%s): %p",
                    c->rring >= 0 && c->wring >= 0 ? "duplex"
                    : c->rring >= 0 ? "read-only" : "write-only",
                    lua_tostring(L, -1), others(c), (void *)c->seg.base);
  }
  return 1;
}

/* --- creation ------------------------------------------------------------ */

static Chan *newchan(lua_State *L, int kind, int joinable) {
  mp_Self *self = mp_self(L);   /* first: its page outlives every channel */
  Chan *c = (Chan *)lua_newuserdatauv(L, sizeof(Chan), 0);
  memset(c, 0, sizeof *c);
  c->self = self;
  c->seg.fd = -1;
  c->rsock = c->wsock = c->revfd = c->wevfd = -1;
  c->slot = -1;
  c->rring = c->wring = -1;
  c->kind = kind;
  c->end = -1;
  c->hook = test_hook();
  luaL_setmetatable(L, kind == K_CONN ? CONN_T : joinable ? JQUEUE_T : QUEUE_T);
  return c;
}

static size_t chan_size(uint64_t cap, int nrings, uint64_t *data_off) {
  *data_off = (sizeof(ChanHdr) + 4095) & ~(uint64_t)4095;
  return (size_t)(*data_off + cap * (uint64_t)nrings);
}

static void init_header(lua_State *L, Chan *c, uint64_t cap, int nrings,
                        int64_t maxsize) {
  uint64_t off;
  size_t size = chan_size(cap, nrings, &off);
  ChanHdr *h;
  int i, e;
  mp_seg_create(L, &c->seg, size, MP_SEG_FD);
  h = chan_hdr(c);
  h->magic = CHAN_MAGIC;
  h->nrings = (uint32_t)nrings;
  h->cap = cap;
  h->maxsize = maxsize;
  h->data_off = off;
  for (i = 0; i < nrings; i++) {
    if ((e = mp_mutex_init(&h->ring[i].wlock, 0)) != 0 ||
        (e = mp_mutex_init(&h->ring[i].rlock, 0)) != 0) {
      mp_push_errno(L, "pthread_mutex_init", e);
      lua_error(L);
    }
  }
}

static void make_socks(lua_State *L, int sv[2]) {
  int big = 4 << 20;
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0) {
    mp_push_errno(L, "socketpair", errno);
    lua_error(L);
  }
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
  shutdown(sv[0], SHUT_RD);
  shutdown(sv[1], SHUT_WR);
}

static int make_eventfd(lua_State *L) {
  int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (fd < 0) {
    mp_push_errno(L, "eventfd", errno);
    lua_error(L);
  }
  return fd;
}

static uint64_t opt_capacity(lua_State *L, int idx) {
  uint64_t cap = DEFAULT_CAP;
  if (lua_isnoneornil(L, idx)) return cap;
  mp_checktype(L, idx, LUA_TTABLE);
  if (lua_getfield(L, idx, "capacity") != LUA_TNIL) {
    lua_Integer k = lua_tointeger(L, -1);
    if (!lua_isinteger(L, -1) || k < (lua_Integer)MIN_CAP ||
        (uint64_t)k > MAX_CAP)
      mp_argerror(L, idx, "capacity must be an integer number of bytes "
                  "from 4096 to 2^32");
    cap = (uint64_t)k;
  }
  lua_pop(L, 1);
  return cap;
}

/* fn(maxsize [, {capacity = bytes}]) for Queue and JoinableQueue */
static int make_queue(lua_State *L, int joinable) {
  lua_Integer maxsize = mp_optinteger(L, 1, 0);
  uint64_t cap = opt_capacity(L, 2);
  Chan *c;
  int sv[2];
  c = newchan(L, K_QUEUE, joinable);
  init_header(L, c, cap, 1, maxsize > 0 ? maxsize : 0);
  chan_hdr(c)->joinable = (uint32_t)joinable;
  make_socks(L, sv);
  c->wsock = sv[0];
  c->rsock = sv[1];
  c->revfd = c->wevfd = make_eventfd(L);
  c->rring = c->wring = 0;
  chan_attach(L, c);
  return 1;
}

/* mp.Queue([maxsize [, {capacity = bytes}]]) */
static int new_queue(lua_State *L) { return make_queue(L, 0); }

/* mp.JoinableQueue([maxsize [, {capacity = bytes}]]) */
static int new_joinable_queue(lua_State *L) { return make_queue(L, 1); }

static int new_simple_queue(lua_State *L) {
  mp_checknoargs(L, 1);
  return make_queue(L, 0);
}

static int dupfd(lua_State *L, int fd) {
  int d = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (d < 0) {
    mp_push_errno(L, "dup", errno);
    lua_error(L);
  }
  return d;
}

/* Ring 'ring' of a pipe carries from end 'wr' to end 'rd': a socket pair
** for its descriptors, an eventfd (and its copy) for fileno(). */
static void connect_ring(lua_State *L, int ring, Chan *wr, Chan *rd) {
  int sv[2];
  make_socks(L, sv);
  wr->wring = rd->rring = ring;
  wr->wsock = sv[0];
  rd->rsock = sv[1];
  rd->revfd = make_eventfd(L);
  wr->wevfd = dupfd(L, rd->revfd);
}

/* mp.Pipe([duplex = true [, {capacity = bytes}]]) -> conn1, conn2
** duplex: both send and receive; otherwise conn1 receives, conn2 sends. */
static int new_pipe(lua_State *L) {
  int duplex = 1, nr;
  uint64_t cap;
  Chan *a, *b;
  if (!lua_isnoneornil(L, 1)) {
    mp_checktype(L, 1, LUA_TBOOLEAN);
    duplex = lua_toboolean(L, 1);
  }
  cap = opt_capacity(L, 2);
  nr = duplex ? 2 : 1;
  a = newchan(L, K_CONN, 0);
  init_header(L, a, cap, nr, 0);
  b = newchan(L, K_CONN, 0);
  if (mp_seg_from_fd(L, &b->seg, dupfd(L, a->seg.fd), a->seg.size, 1) != 0)
    lua_error(L);
  a->end = 0;
  b->end = 1;
  connect_ring(L, 0, b, a);
  if (duplex) connect_ring(L, 1, a, b);
  chan_attach(L, a);
  chan_attach(L, b);
  return 2;
}

/* --- codec --------------------------------------------------------------- */

typedef struct ChanWire {
  unsigned char kind, end, rring, wring;   /* 255 = -1 */
  uint32_t sent;          /* 1: in flight until decoded (not a broadcast) */
  uint64_t size;
} ChanWire;

/* A copy sent to another process is in flight until it is decoded; a
** broadcast (a fresh worker's fn and args) is covered by the proxies the
** parent registers instead (mp_sharing_handed). */
static void chan_encode(lua_State *L, int idx, mp_Writer *wr) {
  Chan *c = tochan(L, idx);
  ChanWire wi;
  if (!c->seg.base) luaL_error(L, "cannot send a closed %s", chan_what(c));
  memset(&wi, 0, sizeof wi);
  wi.kind = (unsigned char)c->kind;
  wi.end = (unsigned char)c->end;
  wi.rring = (unsigned char)c->rring;
  wi.wring = (unsigned char)c->wring;
  wi.sent = (mp_write_flags(wr) & MP_CODEC_BROADCAST) ? 0 : 1;
  wi.size = c->seg.size;
  mp_write_bytes(L, wr, &wi, sizeof wi);
  mp_write_fd(L, wr, c->seg.fd);
  if (c->rring >= 0) {
    mp_write_fd(L, wr, c->rsock);
    mp_write_fd(L, wr, c->revfd);
  }
  if (c->wring >= 0) {
    mp_write_fd(L, wr, c->wsock);
    if (c->kind == K_CONN) mp_write_fd(L, wr, c->wevfd);
  }
  if (wi.sent) mp_peers_inflight(&chan_hdr(c)->peers, c->end, 1);
}

static int sign(unsigned char v) { return v == 255 ? -1 : (int)v; }

static void chan_decode(lua_State *L, mp_Reader *rd) {
  ChanWire wi;
  Chan *c;
  int fd, joinable;
  uint64_t off;
  memcpy(&wi, mp_read_bytes(L, rd, sizeof wi), sizeof wi);
  if (wi.kind > K_CONN || sign(wi.rring) > 1 || sign(wi.wring) > 1 ||
      sign(wi.end) > 1 || wi.sent > 1 || wi.size > ((uint64_t)1 << 34))
    luaL_error(L, "bad Queue/Connection encoding");
  fd = mp_read_fd(L, rd);
  c = newchan(L, wi.kind, 0);
  if (mp_seg_from_fd(L, &c->seg, fd, (size_t)wi.size, 1) != 0) lua_error(L);
  if (chan_hdr(c)->magic != CHAN_MAGIC || chan_hdr(c)->nrings < 1 || chan_hdr(c)->nrings > 2 ||
      chan_size(chan_hdr(c)->cap, (int)chan_hdr(c)->nrings, &off) != wi.size ||
      off != chan_hdr(c)->data_off || sign(wi.rring) >= (int)chan_hdr(c)->nrings ||
      sign(wi.wring) >= (int)chan_hdr(c)->nrings ||
      (wi.kind == K_CONN) != (sign(wi.end) >= 0))
    luaL_error(L, "received shared memory is not a Queue/Connection");
  joinable = wi.kind == K_QUEUE && chan_hdr(c)->joinable;
  if (joinable) luaL_setmetatable(L, JQUEUE_T);
  c->end = sign(wi.end);
  c->rring = sign(wi.rring);
  c->wring = sign(wi.wring);
  if (c->rring >= 0) {
    c->rsock = mp_read_fd(L, rd);
    c->revfd = mp_read_fd(L, rd);
  }
  if (c->wring >= 0) {
    c->wsock = mp_read_fd(L, rd);
    c->wevfd = c->kind == K_CONN ? mp_read_fd(L, rd) : c->revfd;
  }
  /* a broadcast is decoded by the forkserver for the workers it forks, and
  ** by a spawned worker: each worker attaches what its fn and args hold
  ** before it runs (mp_sharing_attach), covered until then by its proxy;
  ** the server itself never uses them */
  if (!(mp_read_flags(rd) & MP_CODEC_BROADCAST)) chan_attach(L, c);
  if (wi.sent) mp_peers_inflight(&chan_hdr(c)->peers, c->end, -1);
}

static const mp_CodecType queue_codec = {QUEUE_T, chan_encode, chan_decode};
static const mp_CodecType jqueue_codec = {JQUEUE_T, chan_encode, chan_decode};
static const mp_CodecType conn_codec = {CONN_T, chan_encode, chan_decode};

/* --- registration -------------------------------------------------------- */

#define QUEUE_METHODS \
  {"put", queue_put}, {"get", queue_get}, \
  {"put_nowait", queue_put_nowait}, {"get_nowait", queue_get_nowait}, \
  {"qsize", queue_qsize}, {"empty", queue_empty}, {"full", queue_full}, \
  {"fileno", chan_fileno}, {"close", chan_close}, {"closed", chan_closed}

static const luaL_Reg queue_methods[] = {
  QUEUE_METHODS, {"_functions", queue_functions},
  {"_get_into", queue_get_into}, {"_put_patient", queue_put_patient},
  {NULL, NULL}
};

static const luaL_Reg jqueue_methods[] = {
  QUEUE_METHODS, {"task_done", queue_task_done}, {"join", queue_join},
  {NULL, NULL}
};

static const luaL_Reg conn_methods[] = {
  {"send", conn_send}, {"recv", conn_recv}, {"send_bytes", conn_send_bytes},
  {"recv_bytes", conn_recv_bytes}, {"poll", conn_poll},
  {"fileno", chan_fileno}, {"close", chan_close}, {"closed", chan_closed},
  {NULL, NULL}
};

static const luaL_Reg channel_meta[] = {
  {"__gc", chan_gc}, {"__close", chan_gc}, {"__tostring", chan_tostring},
  {NULL, NULL}
};

static const luaL_Reg conn_meta[] = {
  {"__gc", chan_gc}, {"__close", chan_gc}, {"__tostring", chan_tostring},
  {"__index", conn_index}, {NULL, NULL}
};

void mp_open_channel(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"Queue", new_queue}, {"SimpleQueue", new_simple_queue},
    {"JoinableQueue", new_joinable_queue}, {"Pipe", new_pipe}, {NULL, NULL}
  };
  static const luaL_Reg inbox_meta[] = {{"__gc", inbox_gc}, {NULL, NULL}};
  mp_new_class(L, QUEUE_T, channel_meta, queue_methods);
  mp_new_class(L, JQUEUE_T, channel_meta, jqueue_methods);
  mp_new_class(L, CONN_T, conn_meta, conn_methods);
  mp_new_class(L, INBOX_T, inbox_meta, NULL);
  lua_pop(L, 4);
  mp_codec_register(L, &queue_codec);
  mp_codec_register(L, &jqueue_codec);
  mp_codec_register(L, &conn_codec);
  luaL_setfuncs(L, funcs, 0);
}
