/*
** channel.c -- Queue, SimpleQueue and Pipe connections.
**
** A channel is a sealed memfd holding one ring per direction (a Queue has
** one, a duplex Pipe two) plus the peer slots, and beside each ring a unix
** stream socketpair that carries the descriptors of the shared objects
** inside messages (SCM_RIGHTS, at most 253 per record, MSG_CMSG_CLOEXEC,
** MSG_CTRUNC -> error).
**
** Ring: head/tail byte counters, futex words bumped on publish and on
** consume, and two robust mutexes: "wlock" held by the one writer of the
** current message, "rlock" by the one reader, so the ring itself is
** single-producer single-consumer.  A message is a 24-byte header (length,
** descriptor count, sequence number, flags) and the encoded bytes; one that
** fits is published at once, a bigger one in chunks.  The descriptor records
** go out before the message and carry its sequence number, so a reader
** discards records left behind by a writer that died.  A writer or reader
** that dies or is interrupted in the middle of a message leaves a "pending"
** count: the next writer pads the message and marks it aborted, the next
** reader skips the rest, so nobody deadlocks and no garbage is decoded.
**
** Liveness: every process using a channel holds a slot (a robust mutex)
** while attached.  A wait that cannot progress checks, every MP_SLICE
** seconds, whether another process that could unblock it is still alive; if
** none is, it raises an error naming the pid of the last one gone.
**
** Timeouts: q:get([timeout]) returns the value (exactly one result) or
** nil, "timeout"; get_nowait() returns nil, "empty".  q:put(v [, timeout])
** returns true or nil, "timeout" ("full" for put_nowait).  A received nil is
** a single nil, so `local v, err = q:get(t)` tells them apart.
*/
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "mp.h"
#include "codec.h"
#include "sharing.h"

#define QUEUE_T "multiprocessing.Queue"
#define CONN_T  "multiprocessing.Connection"
#define INBOX_T "multiprocessing.Inbox"

#define CHAN_MAGIC 0x6d706368u  /* "mpch" */
#define DEFAULT_CAP ((uint64_t)4 << 20)
#define MIN_CAP ((uint64_t)4096)
#define MAX_CAP ((uint64_t)1 << 32)
#define MSG_HDR ((uint64_t)sizeof(MsgHdr))
#define F_RAW 1u          /* send_bytes: raw bytes */
#define F_STR 2u          /* a single Lua string, not encoded */
#define SPINS 2000
#define INLINE_BUF 256

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
  uint32_t aborted;       /* a message whose writer gave up mid-way */
  uint32_t naborted;
  uint32_t pad;
  uint64_t wpending;      /* bytes the current writer still owes */
  uint64_t rpending;      /* bytes the current reader still has to take */
  pthread_mutex_t wlock, rlock;
} Ring;

typedef struct ChanHdr {
  uint32_t magic;
  uint32_t nrings;
  uint64_t cap;
  int64_t maxsize;        /* Queue: 0 = unbounded (in messages) */
  uint64_t data_off;
  mp_Peers peers;
  Ring ring[2];
} ChanHdr;

enum { K_QUEUE, K_CONN };

typedef struct Chan {
  mp_Seg seg;
  int kind;
  int end;                /* -1 for a queue, 0 or 1 for a connection */
  int rring, wring;       /* -1 when this end cannot read / write */
  int rsock, wsock;       /* descriptor sockets of rring / wring */
  int slot;               /* our peer slot ... */
  pid_t slotpid;          /* ... in this process */
  char *rbuf;             /* reused for received messages: fresh memory */
  size_t rbufcap;         /* for every big message means page faults */
  int codec;              /* MP_CODEC_DATA; a pool's own task queue sets
                             MP_CODEC_FUNCTIONS on its two handles */
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

static ChanHdr *H(Chan *c) { return (ChanHdr *)(void *)c->seg.base; }
static Ring *RG(Chan *c, int r) { return &H(c)->ring[r]; }
static unsigned char *DATA(Chan *c, int r) {
  return c->seg.base + H(c)->data_off + (size_t)r * H(c)->cap;
}

static uint64_t ld64(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
static uint32_t ld32(const uint32_t *p) { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ __volatile__("pause");
#endif
}

static const char *chan_what(Chan *c) {
  return c->kind == K_QUEUE ? "Queue" : "Connection";
}

/* ------------------------------------------------------------------ */
/* attach / detach                                                     */

static void chan_attach(lua_State *L, Chan *c) {
  if (c->slotpid == getpid()) return;
  c->slot = mp_peers_attach(&H(c)->peers, c->end);
  if (c->slot < 0)
    luaL_error(L, "%s: more than %d processes attached", chan_what(c),
               MP_NSLOTS);
  c->slotpid = getpid();
}

static void chan_release(Chan *c) {
  if (c->seg.base && c->slotpid == getpid() && c->slot >= 0)
    mp_peers_detach(&H(c)->peers, c->slot);
  c->slot = -1;
  c->slotpid = 0;
  mp_seg_close(&c->seg);
  if (c->rsock >= 0) close(c->rsock);
  if (c->wsock >= 0 && c->wsock != c->rsock) close(c->wsock);
  c->rsock = c->wsock = -1;
  free(c->rbuf);
  c->rbuf = NULL;
  c->rbufcap = 0;
}

static Chan *tochan(lua_State *L, int idx) {
  Chan *c = (Chan *)luaL_testudata(L, idx, QUEUE_T);
  if (!c) c = (Chan *)luaL_testudata(L, idx, CONN_T);
  if (!c) luaL_typeerror(L, idx, "Queue or Connection");
  return c;
}

static Chan *checkchan(lua_State *L, int idx) {
  Chan *c = tochan(L, idx);
  if (!c->seg.base) luaL_error(L, "attempt to use a closed %s", chan_what(c));
  chan_attach(L, c);
  return c;
}

int mp_channel_attach_value(lua_State *L, int idx) {
  Chan *c = (Chan *)luaL_testudata(L, idx, QUEUE_T);
  if (!c) c = (Chan *)luaL_testudata(L, idx, CONN_T);
  if (!c) return 0;
  if (c->seg.base) chan_attach(L, c);
  return 1;
}

/* Visits tables and Lua functions' upvalues once each (the table at 'seen'
** records them), down to a depth that no real argument reaches.  The
** globals table is not walked: a queue is attached when first used anyway;
** walking finds only the ones a worker might never touch. */
static void attach_walk(lua_State *L, int idx, int seen, int depth) {
  int type = lua_type(L, idx), i;
  idx = lua_absindex(L, idx);
  if (mp_channel_attach_value(L, idx) || depth > 200) return;
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
  luaL_checkstack(L, 4, "attaching shared objects");
  if (type == LUA_TTABLE) {
    lua_pushnil(L);
    while (lua_next(L, idx)) {
      attach_walk(L, -2, seen, depth + 1);
      attach_walk(L, -1, seen, depth + 1);
      lua_pop(L, 1);
    }
  } else {
    for (i = 1; lua_getupvalue(L, idx, i) != NULL; i++) {
      attach_walk(L, -1, seen, depth + 1);
      lua_pop(L, 1);
    }
  }
}

void mp_sharing_attach(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  lua_newtable(L);
  lua_pushglobaltable(L);
  lua_pushboolean(L, 1);
  lua_rawset(L, -3);
  attach_walk(L, idx, lua_gettop(L), 0);
  lua_pop(L, 1);
}

/* ------------------------------------------------------------------ */
/* waiting                                                             */

enum { W_DATA, W_SPACE, W_SLOT };

typedef struct Waiter {
  Chan *c;
  int r;
  int what;
  uint64_t need;          /* W_DATA: bytes available; W_SPACE: free bytes */
  int check_peers;
  double lastcheck;
} Waiter;

static int ready(const Waiter *x) {
  Ring *g = RG(x->c, x->r);
  uint64_t used = ld64(&g->tail) - ld64(&g->head);
  switch (x->what) {
    case W_DATA: return used >= x->need;
    case W_SPACE: return H(x->c)->cap - used >= x->need;
    default: {
      int64_t m = H(x->c)->maxsize;
      return m <= 0 || __atomic_load_n(&g->count, __ATOMIC_SEQ_CST) < m;
    }
  }
}

static int peers_gone(Chan *c) {
  return mp_peers_alive(&H(c)->peers, c->slot, c->kind == K_CONN ? c->end : -1)
         < 0;
}

/* Returns MP_OK, MP_TIMEOUT, MP_INTERRUPT or MP_PEERGONE. */
static int wait_for(Waiter *x, mp_Wait *w) {
  Ring *g = RG(x->c, x->r);
  uint32_t *word = x->what == W_DATA ? &g->dataseq : &g->spaceseq;
  uint32_t *waiters = x->what == W_DATA ? &g->rwait : &g->wwait;
  int spins = 0;
  for (;;) {
    uint32_t seq = ld32(word);
    double sl, now;
    if (ready(x)) return MP_OK;
    if (spins < SPINS) {
      spins++;
      cpu_relax();
      continue;
    }
    if ((sl = mp_wait_slice(w)) <= 0) return MP_TIMEOUT;
    __atomic_add_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    if (!ready(x)) mp_futex_wait(word, seq, sl);
    __atomic_sub_fetch(waiters, 1, __ATOMIC_SEQ_CST);
    if (ready(x)) return MP_OK;
    now = mp_now();
    if (x->check_peers && now - x->lastcheck >= MP_SLICE) {
      x->lastcheck = now;
      if (peers_gone(x->c)) return MP_PEERGONE;
    }
    if (mp_wait_interrupted(w)) return MP_INTERRUPT;
  }
}

static void waiter_init(Waiter *x, Chan *c, int r, int what, uint64_t need) {
  x->c = c;
  x->r = r;
  x->what = what;
  x->need = need;
  x->check_peers = 1;
  x->lastcheck = mp_now();
}

static void wake(uint32_t *word, uint32_t *waiters) {
  __atomic_add_fetch(word, 1, __ATOMIC_SEQ_CST);
  if (ld32(waiters)) mp_futex_wake(word, INT_MAX);
}

/* ------------------------------------------------------------------ */
/* ring copies                                                         */

static void ring_put(Chan *c, int r, const void *src, size_t n) {
  Ring *g = RG(c, r);
  uint64_t cap = H(c)->cap, t = g->tail, off = t % cap;
  unsigned char *d = DATA(c, r);
  size_t first = (size_t)(cap - off) < n ? (size_t)(cap - off) : n;
  memcpy(d + off, src, first);
  if (n > first) memcpy(d, (const char *)src + first, n - first);
  __atomic_store_n(&g->tail, t + n, __ATOMIC_SEQ_CST);
  wake(&g->dataseq, &g->rwait);
}

static void ring_zero(Chan *c, int r, size_t n) {
  Ring *g = RG(c, r);
  uint64_t cap = H(c)->cap, t = g->tail, off = t % cap;
  unsigned char *d = DATA(c, r);
  size_t first = (size_t)(cap - off) < n ? (size_t)(cap - off) : n;
  memset(d + off, 0, first);
  if (n > first) memset(d, 0, n - first);
  __atomic_store_n(&g->tail, t + n, __ATOMIC_SEQ_CST);
  wake(&g->dataseq, &g->rwait);
}

/* dst may be NULL: skip */
static void ring_get(Chan *c, int r, void *dst, size_t n) {
  Ring *g = RG(c, r);
  uint64_t cap = H(c)->cap, h = g->head, off = h % cap;
  const unsigned char *d = DATA(c, r);
  size_t first = (size_t)(cap - off) < n ? (size_t)(cap - off) : n;
  if (dst) {
    memcpy(dst, d + off, first);
    if (n > first) memcpy((char *)dst + first, d, n - first);
  }
  __atomic_store_n(&g->head, h + n, __ATOMIC_SEQ_CST);
  wake(&g->spaceseq, &g->wwait);
}

static uint64_t avail(Chan *c, int r) {
  Ring *g = RG(c, r);
  return ld64(&g->tail) - ld64(&g->head);
}

/* ------------------------------------------------------------------ */
/* writing                                                             */

/* Waits for room and writes n bytes (in chunks when needed); no timeout.
** Keeps wpending up to date. */
static int write_chunks(Chan *c, int r, const void *src, size_t n,
                        mp_Wait *w) {
  Ring *g = RG(c, r);
  const char *p = (const char *)src;
  double dl = w->deadline;
  int st = MP_OK;
  while (n > 0) {
    uint64_t room = H(c)->cap - avail(c, r);
    size_t k;
    if (room == 0) {
      Waiter x;
      waiter_init(&x, c, r, W_SPACE, 1);
      w->deadline = -1;
      st = wait_for(&x, w);
      w->deadline = dl;
      if (st != MP_OK) return st;
      continue;
    }
    k = room < n ? (size_t)room : n;
    if (p) { ring_put(c, r, p, k); p += k; }
    else ring_zero(c, r, k);
    n -= k;
    g->wpending -= k;
  }
  return MP_OK;
}

/* Called with wlock held: finish what a dead or interrupted writer left. */
static int writer_recover(Chan *c, int r, mp_Wait *w) {
  Ring *g = RG(c, r);
  if (g->wpending == 0) return MP_OK;
  __atomic_store_n(&g->aborted, g->wseq, __ATOMIC_SEQ_CST);
  __atomic_add_fetch(&g->naborted, 1, __ATOMIC_SEQ_CST);
  return write_chunks(c, r, NULL, (size_t)g->wpending, w);
}

static int send_fds(Chan *c, uint32_t seq, const int *fds, size_t nfds,
                    mp_Wait *w) {
  while (nfds > 0) {
    size_t k = nfds > MP_MAXFDS ? MP_MAXFDS : nfds;
    FdRec rec;
    ssize_t s;
    rec.seq = seq;
    rec.count = (uint32_t)k;
    s = mp_sendfds(c->wsock, &rec, sizeof rec, fds, k, MSG_DONTWAIT);
    if (s == -EAGAIN) {
      struct pollfd pf;
      pf.fd = c->wsock;
      pf.events = POLLOUT;
      poll(&pf, 1, (int)(MP_SLICE * 1000));
      if (peers_gone(c)) return MP_PEERGONE;
      if (mp_wait_interrupted(w)) return MP_INTERRUPT;
      continue;
    }
    if (s == -EPIPE || s == -ECONNRESET) return MP_PEERGONE;
    if (s < 0) return (int)-s;
    fds += k;
    nfds -= k;
  }
  return MP_OK;
}

/* Writes one message.  Returns MP_OK, MP_TIMEOUT, MP_INTERRUPT,
** MP_PEERGONE or an errno. */
static int chan_write(Chan *c, const void *data, size_t n, const int *fds,
                      size_t nfds, uint32_t flags, mp_Wait *w) {
  int r = c->wring, st;
  Ring *g = RG(c, r);
  MsgHdr mh;
  Waiter x;
  uint64_t total = MSG_HDR + n;
  st = mp_mutex_lock(&g->wlock, w);
  if (st == MP_OWNERDEAD) st = MP_OK;
  if (st != MP_OK) return st;
  if ((st = writer_recover(c, r, w)) != MP_OK) goto done;
  waiter_init(&x, c, r, W_SLOT, 0);
  if ((st = wait_for(&x, w)) != MP_OK) goto done;
  waiter_init(&x, c, r, W_SPACE, total < H(c)->cap ? total : H(c)->cap);
  if ((st = wait_for(&x, w)) != MP_OK) goto done;
  mh.len = n;
  mh.nfds = (uint32_t)nfds;
  mh.seq = ++g->wseq;
  mh.flags = flags;
  mh.pad = 0;
  if (nfds && (st = send_fds(c, mh.seq, fds, nfds, w)) != MP_OK) goto done;
  __atomic_add_fetch(&g->count, 1, __ATOMIC_SEQ_CST);
  if (total <= H(c)->cap - avail(c, r)) {
    /* the common case: one copy, one publication */
    Ring *gg = g;
    uint64_t cap = H(c)->cap, t = gg->tail, off = t % cap;
    unsigned char *d = DATA(c, r);
    if (off + total <= cap) {
      memcpy(d + off, &mh, MSG_HDR);
      memcpy(d + off + MSG_HDR, data, n);
      __atomic_store_n(&gg->tail, t + total, __ATOMIC_SEQ_CST);
      wake(&gg->dataseq, &gg->rwait);
    } else {
      gg->wpending = total;
      write_chunks(c, r, &mh, MSG_HDR, w);
      write_chunks(c, r, data, n, w);
    }
  } else {
    g->wpending = total;
    if ((st = write_chunks(c, r, &mh, MSG_HDR, w)) == MP_OK)
      st = write_chunks(c, r, data, n, w);
  }
done:
  pthread_mutex_unlock(&g->wlock);
  return st;
}

/* ------------------------------------------------------------------ */
/* reading                                                             */

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

/* Skips n bytes the reader owes, waiting for them (no timeout). */
static int skip_chunks(Chan *c, int r, size_t n, char *dst, mp_Wait *w) {
  Ring *g = RG(c, r);
  double dl = w->deadline;
  int st;
  while (n > 0) {
    uint64_t a = avail(c, r);
    size_t k;
    if (a == 0) {
      Waiter x;
      waiter_init(&x, c, r, W_DATA, 1);
      w->deadline = -1;
      st = wait_for(&x, w);
      w->deadline = dl;
      if (st != MP_OK) return st;
      continue;
    }
    k = a < n ? (size_t)a : n;
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
    int got[MP_MAXFDS];
    size_t ngot = 0, i;
    ssize_t k = mp_recvfds(c->rsock, &rec, sizeof rec, got, MP_MAXFDS, &ngot,
                           MSG_DONTWAIT);
    if (k == -EAGAIN) {
      struct pollfd pf;
      pf.fd = c->rsock;
      pf.events = POLLIN;
      poll(&pf, 1, (int)(MP_SLICE * 1000));
      if (peers_gone(c)) return MP_PEERGONE;
      if (mp_wait_interrupted(w)) return MP_INTERRUPT;
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

/* Reads one message into 'in'.  Returns MP_OK, MP_TIMEOUT, MP_INTERRUPT,
** MP_PEERGONE, or an errno. */
static int chan_read(Chan *c, Inbox *in, mp_Wait *w) {
  int r = c->rring, st;
  Ring *g = RG(c, r);
  MsgHdr mh;
  Waiter x;
  st = mp_mutex_lock(&g->rlock, w);
  if (st == MP_OWNERDEAD) st = MP_OK;
  if (st != MP_OK) return st;
  for (;;) {
    if (g->rpending &&
        (st = skip_chunks(c, r, (size_t)g->rpending, NULL, w)) != MP_OK)
      break;
    waiter_init(&x, c, r, W_DATA, MSG_HDR);
    if ((st = wait_for(&x, w)) != MP_OK) break;
    __atomic_sub_fetch(&g->count, 1, __ATOMIC_SEQ_CST);
    ring_get(c, r, &mh, MSG_HDR);   /* wakes a writer waiting on maxsize */
    g->rpending = mh.len;
    in->flags = mh.flags;
    in->len = (size_t)mh.len;
    in->buf = rbuf_for(c, in, (size_t)mh.len);
    if (mh.nfds) {
      in->fds = (int *)malloc(sizeof(int) * mh.nfds);
      if (!in->fds) { st = ENOMEM; break; }
    }
    if (!in->buf) { st = ENOMEM; break; }
    /* the rest of a message is not subject to the timeout */
    if ((st = skip_chunks(c, r, in->len, in->buf, w)) != MP_OK) break;
    if (mh.nfds && (st = recv_fds(c, mh.seq, in, mh.nfds, w)) != MP_OK) break;
    if (ld32(&g->naborted) && ld32(&g->aborted) == mh.seq) {
      /* padding of a message whose writer gave up: drop it */
      size_t i;
      for (i = 0; i < in->nfds; i++) close(in->fds[i]);
      in->nfds = 0;
      if (in->owned) free(in->buf);
      in->buf = NULL;
      free(in->fds);
      in->fds = NULL;
      continue;
    }
    break;
  }
  pthread_mutex_unlock(&g->rlock);
  return st;
}

/* ------------------------------------------------------------------ */
/* Lua side                                                            */

static int raise_status(lua_State *L, Chan *c, int st, const char *op) {
  int pid = H(c)->peers.lastgone;
  switch (st) {
    case MP_INTERRUPT:
      return luaL_error(L, "%s.%s: interrupted", chan_what(c), op);
    case MP_PEERGONE:
      if (c->kind == K_QUEUE)
        return luaL_error(L, "%s.%s: no other process is using this queue "
                          "any more (pid %d exited or closed it)",
                          chan_what(c), op, pid);
      return luaL_error(L, "%s.%s: the other end of the pipe is closed "
                        "(pid %d exited or closed it)", chan_what(c), op, pid);
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

static int put_impl(lua_State *L, Chan *c, int vidx, double timeout,
                    const char *op, int raw) {
  static const char *const names[] = {"item"};
  mp_Encoded enc;
  mp_Wait w;
  int st;
  uint32_t flags = raw ? F_RAW : 0;
  if (c->wring < 0)
    return luaL_error(L, "%s.%s: this end of the pipe is read-only",
                      chan_what(c), op);
  if (raw || lua_type(L, vidx) == LUA_TSTRING) {
    /* strings skip the codec: one copy into the ring */
    if (!raw) flags = F_STR;
    enc.data = luaL_checklstring(L, vidx, &enc.size);
    enc.fds = NULL;
    enc.nfds = 0;
  } else {
    mp_encode(L, vidx, 1, c->codec, names,
              c->kind == K_QUEUE ? "through a Queue" : "through a Pipe", &enc);
  }
  mp_wait_init(&w, L, timeout);
  st = chan_write(c, enc.data, enc.size, enc.fds, enc.nfds, flags, &w);
  if (st == MP_TIMEOUT) {
    lua_pushnil(L);
    lua_pushstring(L, timeout == 0 ? "full" : "timeout");
    return 2;
  }
  if (st != MP_OK) return raise_status(L, c, st, op);
  lua_pushboolean(L, 1);
  return 1;
}

static int decode_k(lua_State *L) {
  Inbox *in = (Inbox *)lua_touserdata(L, 1);
  return mp_decode(L, in->buf, in->len, (int)lua_tointeger(L, 2), in->fds,
                   in->nfds);
}

static int get_impl(lua_State *L, Chan *c, double timeout, const char *op,
                    int raw) {
  Inbox *in;
  mp_Wait w;
  int st, base;
  if (c->rring < 0)
    return luaL_error(L, "%s.%s: this end of the pipe is write-only",
                      chan_what(c), op);
  in = (Inbox *)lua_newuserdatauv(L, sizeof(Inbox), 0);
  memset(in, 0, sizeof(Inbox) - INLINE_BUF);
  luaL_setmetatable(L, INBOX_T);
  mp_wait_init(&w, L, timeout);
  st = chan_read(c, in, &w);
  if (st == MP_TIMEOUT) {
    inbox_clear(in);
    lua_pushnil(L);
    lua_pushstring(L, timeout == 0 ? "empty" : "timeout");
    return 2;
  }
  if (st != MP_OK) {
    inbox_clear(in);
    return raise_status(L, c, st, op);
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
    st = lua_pcall(L, 2, LUA_MULTRET, 0);
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

/* q:put(v [, timeout]) -> true | nil, "timeout" */
static int q_put(lua_State *L) {
  Chan *c = checkchan(L, 1);
  luaL_checkany(L, 2);
  return put_impl(L, c, 2, mp_opttimeout(L, 3), "put", 0);
}

static int q_put_nowait(lua_State *L) {
  Chan *c = checkchan(L, 1);
  luaL_checkany(L, 2);
  return put_impl(L, c, 2, 0, "put_nowait", 0);
}

/* q:get([timeout]) -> v | nil, "timeout" */
static int q_get(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return get_impl(L, c, mp_opttimeout(L, 2), "get", 0);
}

static int q_get_nowait(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return get_impl(L, c, 0, "get_nowait", 0);
}

static int q_qsize(lua_State *L) {
  Chan *c = checkchan(L, 1);
  int64_t n = __atomic_load_n(&RG(c, 0)->count, __ATOMIC_SEQ_CST);
  lua_pushinteger(L, n < 0 ? 0 : n);
  return 1;
}

static int q_empty(lua_State *L) {
  Chan *c = checkchan(L, 1);
  lua_pushboolean(L, __atomic_load_n(&RG(c, 0)->count, __ATOMIC_SEQ_CST) <= 0);
  return 1;
}

static int q_full(lua_State *L) {
  Chan *c = checkchan(L, 1);
  int64_t m = H(c)->maxsize;
  lua_pushboolean(L, m > 0 &&
                  __atomic_load_n(&RG(c, 0)->count, __ATOMIC_SEQ_CST) >= m);
  return 1;
}

static int c_close(lua_State *L) {
  chan_release(tochan(L, 1));
  return 0;
}

/* q:_functions(): this handle sends and receives Lua functions as bytecode
** (MP_CODEC_FUNCTIONS).  Internal: only for a queue private to a parent and
** the workers it started (the pool's task queues), never a user's. */
static int q_functions(lua_State *L) {
  checkchan(L, 1)->codec = MP_CODEC_FUNCTIONS;
  return 0;
}

static int c_closed(lua_State *L) {
  lua_pushboolean(L, tochan(L, 1)->seg.base == NULL);
  return 1;
}

/* conn:send(v) -> true */
static int c_send(lua_State *L) {
  Chan *c = checkchan(L, 1);
  luaL_checkany(L, 2);
  return put_impl(L, c, 2, -1, "send", 0);
}

static int c_send_bytes(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return put_impl(L, c, 2, -1, "send_bytes", 1);
}

/* conn:recv([timeout]) -> v | nil, "timeout" */
static int c_recv(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return get_impl(L, c, mp_opttimeout(L, 2), "recv", 0);
}

static int c_recv_bytes(lua_State *L) {
  Chan *c = checkchan(L, 1);
  return get_impl(L, c, mp_opttimeout(L, 2), "recv_bytes", 1);
}

/* conn:poll([timeout = 0]) -> true when recv would not block (a message, or
** the other end gone so that recv raises), false on timeout. */
static int c_poll(lua_State *L) {
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
  if (st == MP_INTERRUPT) return raise_status(L, c, st, "poll");
  lua_pushboolean(L, st == MP_OK || st == MP_PEERGONE);
  return 1;
}

static int c_gc(lua_State *L) {
  chan_release(tochan(L, 1));
  return 0;
}

static int c_tostring(lua_State *L) {
  Chan *c = tochan(L, 1);
  if (!c->seg.base)
    lua_pushfstring(L, "multiprocessing.%s (closed)", chan_what(c));
  else if (c->kind == K_QUEUE)
    lua_pushfstring(L, "multiprocessing.Queue (%p)", (void *)c->seg.base);
  else
    lua_pushfstring(L, "multiprocessing.Connection (%p, %s)",
                    (void *)c->seg.base,
                    c->rring >= 0 && c->wring >= 0 ? "duplex"
                    : c->rring >= 0 ? "read-only" : "write-only");
  return 1;
}

/* ------------------------------------------------------------------ */
/* creation                                                            */

static Chan *newchan(lua_State *L, int kind) {
  Chan *c = (Chan *)lua_newuserdatauv(L, sizeof(Chan), 0);
  memset(c, 0, sizeof *c);
  c->seg.fd = -1;
  c->rsock = c->wsock = -1;
  c->slot = -1;
  c->rring = c->wring = -1;
  c->kind = kind;
  c->end = -1;
  luaL_setmetatable(L, kind == K_QUEUE ? QUEUE_T : CONN_T);
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
  h = H(c);
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

static uint64_t opt_capacity(lua_State *L, int idx) {
  uint64_t cap = DEFAULT_CAP;
  if (lua_isnoneornil(L, idx)) return cap;
  luaL_checktype(L, idx, LUA_TTABLE);
  if (lua_getfield(L, idx, "capacity") != LUA_TNIL) {
    lua_Integer k = luaL_checkinteger(L, -1);
    luaL_argcheck(L, k >= (lua_Integer)MIN_CAP && (uint64_t)k <= MAX_CAP, idx,
                  "capacity out of range (4096 .. 2^32 bytes)");
    cap = (uint64_t)k;
  }
  lua_pop(L, 1);
  return cap;
}

/* mp.Queue([maxsize [, {capacity = bytes}]]) */
static int new_queue(lua_State *L) {
  lua_Integer maxsize = luaL_optinteger(L, 1, 0);
  uint64_t cap = opt_capacity(L, 2);
  Chan *c;
  int sv[2];
  c = newchan(L, K_QUEUE);
  init_header(L, c, cap, 1, maxsize > 0 ? maxsize : 0);
  make_socks(L, sv);
  c->wsock = sv[0];
  c->rsock = sv[1];
  c->rring = c->wring = 0;
  chan_attach(L, c);
  return 1;
}

static int new_simple_queue(lua_State *L) {
  lua_settop(L, 0);
  return new_queue(L);
}

static int dupfd(lua_State *L, int fd) {
  int d = fcntl(fd, F_DUPFD_CLOEXEC, 3);
  if (d < 0) {
    mp_push_errno(L, "dup", errno);
    lua_error(L);
  }
  return d;
}

/* mp.Pipe([duplex = true [, {capacity = bytes}]]) -> conn1, conn2
** duplex: both send and receive; otherwise conn1 receives, conn2 sends. */
static int new_pipe(lua_State *L) {
  int duplex = lua_isnoneornil(L, 1) ? 1 : lua_toboolean(L, 1);
  uint64_t cap = opt_capacity(L, 2);
  int nr = duplex ? 2 : 1, s0[2], s1[2] = {-1, -1};
  Chan *a, *b;
  a = newchan(L, K_CONN);
  init_header(L, a, cap, nr, 0);
  b = newchan(L, K_CONN);
  if (mp_seg_from_fd(L, &b->seg, dupfd(L, a->seg.fd), a->seg.size, 1) != 0)
    lua_error(L);
  make_socks(L, s0);
  a->end = 0;
  b->end = 1;
  a->rring = 0;
  a->rsock = s0[1];
  b->wring = 0;
  b->wsock = s0[0];
  if (duplex) {
    make_socks(L, s1);
    b->rring = 1;
    b->rsock = s1[1];
    a->wring = 1;
    a->wsock = s1[0];
  }
  chan_attach(L, a);
  chan_attach(L, b);
  return 2;
}

/* ------------------------------------------------------------------ */
/* codec                                                               */

typedef struct Wire {
  unsigned char kind, end, rring, wring;   /* 255 = -1 */
  uint32_t pad;
  uint64_t size;
} Wire;

static void chan_encode(lua_State *L, int idx, mp_Writer *wr) {
  Chan *c = tochan(L, idx);
  Wire wi;
  if (!c->seg.base) luaL_error(L, "cannot send a closed %s", chan_what(c));
  memset(&wi, 0, sizeof wi);
  wi.kind = (unsigned char)c->kind;
  wi.end = (unsigned char)c->end;
  wi.rring = (unsigned char)c->rring;
  wi.wring = (unsigned char)c->wring;
  wi.size = c->seg.size;
  mp_write_bytes(L, wr, &wi, sizeof wi);
  mp_write_fd(L, wr, c->seg.fd);
  if (c->rring >= 0) mp_write_fd(L, wr, c->rsock);
  if (c->wring >= 0) mp_write_fd(L, wr, c->wsock);
}

static int sign(unsigned char v) { return v == 255 ? -1 : (int)v; }

static void chan_decode(lua_State *L, mp_Reader *rd) {
  Wire wi;
  Chan *c;
  int fd;
  uint64_t off;
  memcpy(&wi, mp_read_bytes(L, rd, sizeof wi), sizeof wi);
  if (wi.kind > K_CONN || sign(wi.rring) > 1 || sign(wi.wring) > 1 ||
      sign(wi.end) > 1 || wi.size > ((uint64_t)1 << 34))
    luaL_error(L, "bad Queue/Connection encoding");
  fd = mp_read_fd(L, rd);
  c = newchan(L, wi.kind);
  if (mp_seg_from_fd(L, &c->seg, fd, (size_t)wi.size, 1) != 0) lua_error(L);
  if (H(c)->magic != CHAN_MAGIC || H(c)->nrings < 1 || H(c)->nrings > 2 ||
      chan_size(H(c)->cap, (int)H(c)->nrings, &off) != wi.size ||
      off != H(c)->data_off || sign(wi.rring) >= (int)H(c)->nrings ||
      sign(wi.wring) >= (int)H(c)->nrings)
    luaL_error(L, "received shared memory is not a Queue/Connection");
  c->end = sign(wi.end);
  c->rring = sign(wi.rring);
  c->wring = sign(wi.wring);
  if (c->rring >= 0) c->rsock = mp_read_fd(L, rd);
  if (c->wring >= 0) c->wsock = mp_read_fd(L, rd);
  chan_attach(L, c);
}

static const mp_CodecType queue_codec = {QUEUE_T, chan_encode, chan_decode};
static const mp_CodecType conn_codec = {CONN_T, chan_encode, chan_decode};

/* ------------------------------------------------------------------ */

static const luaL_Reg queue_methods[] = {
  {"put", q_put}, {"get", q_get}, {"put_nowait", q_put_nowait},
  {"get_nowait", q_get_nowait}, {"qsize", q_qsize}, {"empty", q_empty},
  {"full", q_full}, {"close", c_close}, {"closed", c_closed},
  {"_functions", q_functions}, {NULL, NULL}
};

static const luaL_Reg conn_methods[] = {
  {"send", c_send}, {"recv", c_recv}, {"send_bytes", c_send_bytes},
  {"recv_bytes", c_recv_bytes}, {"poll", c_poll}, {"close", c_close},
  {"closed", c_closed}, {NULL, NULL}
};

static const luaL_Reg channel_meta[] = {
  {"__gc", c_gc}, {"__close", c_gc}, {"__tostring", c_tostring}, {NULL, NULL}
};

void mp_open_channel(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"Queue", new_queue}, {"SimpleQueue", new_simple_queue},
    {"Pipe", new_pipe}, {NULL, NULL}
  };
  static const luaL_Reg inbox_meta[] = {{"__gc", inbox_gc}, {NULL, NULL}};
  mp_new_class(L, QUEUE_T, channel_meta, queue_methods);
  mp_new_class(L, CONN_T, channel_meta, conn_methods);
  mp_new_class(L, INBOX_T, inbox_meta, NULL);
  lua_pop(L, 3);
  mp_codec_register(L, &queue_codec);
  mp_codec_register(L, &conn_codec);
  luaL_setfuncs(L, funcs, 0);
}
