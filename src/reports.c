/*
** reports.c -- where workers leave their error reports and results.
**
** One anonymous memfd per context, one slot per worker at offset
** TABLE_BYTES + rank * SLOT_SIZE (the file is sparse: untouched slots cost
** nothing).  A
** worker writes its report, then the slot's header; the parent reads a slot
** only after the worker has exited.  Unlike a pipe, the file cannot fill up
** and block a dying worker, however long its traceback.  Unlike files in a
** directory (torch's error files), a memfd has no name: nobody can plant
** one, and nothing is left behind even when the parent is SIGKILLed.
**
** A report may carry descriptors (a shared array under file_descriptor, a
** queue), which a file cannot hold.  They go first, through a SOCK_SEQPACKET
** socketpair of the context: messages of a FdHeader (the worker's rank) and
** up to MP_MAXFDS descriptors.  The parent moves them into a stash as they
** come (join polls the socket, so a sender never waits long for room) and
** hands a rank's last ones to the decoder of its report, whose header says
** how many there are.  The parent holds the workers' end until the context
** ends: a restarted worker (ctx:restart) gets it too.
**
** A slot starts with the worker's ledger of file_system references
** (ledger.c, MP_LEDGER_BYTES, read when the context settles), then its
** report.  Rank 0's report and ledger are near the start of the file, so a
** single worker writes nowhere near an RLIMIT_FSIZE.
**
** Before the slots, a table of marks, one Marks per rank: the worker's exit
** record (its own word on how it left, for when the host reaped it behind
** our back), and whether it wrote a report or a ledger at all.  The parent
** maps the table (a fork inherits the mapping and sets its marks with plain
** stores; a fresh worker writes them with pwrite), so that a worker that
** wrote nothing costs its parent no read: most trivial workers write
** nothing.  A mark is set before what it announces is written, so a worker
** killed in between leaves a mark over an empty slot (read as empty), never
** a written slot without its mark.
*/
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <sys/socket.h>

#include "codec.h"
#include "mp.h"
#include "sharing.h"

#define SLOT_SIZE ((off_t)1 << 32)   /* a report may take up to 4 GiB */
#define TABLE_RANKS 65536            /* context.c's MAX_PROCS */
#define TABLE_BYTES ((off_t)TABLE_RANKS * (off_t)sizeof(Marks))
#define REPORT_AT  MP_LEDGER_BYTES   /* in a slot: the report's header */
#define REPORT_SIZE_MAX (SLOT_SIZE - REPORT_AT - (off_t)sizeof(ReportHeader))
#define REPORT_FDS_MAX (1u << 20)    /* more than any process may hold */

typedef struct ReportHeader {
  uint32_t kind;     /* an mp_ReportKind; MP_REPORT_NONE: no report */
  uint32_t nfds;     /* descriptors sent through the socket before it */
  uint64_t size;
} ReportHeader;

/* A rank's marks: each word is written alone (a fresh worker pwrites it). */
typedef struct Marks {
  uint32_t report;   /* a report header may be in the slot */
  uint32_t ledger;   /* the ledger may hold entries */
  uint32_t magic;    /* EXIT_MAGIC once the exit record is written ... */
  int32_t code;      /* ... as mp_Worker.exitcode: status, or -signal */
} Marks;
#define EXIT_MAGIC 0x45584954u

typedef struct FdHeader {
  int32_t rank;
  uint32_t n;
} FdHeader;

static void close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

static off_t slot_at(int rank) {
  return TABLE_BYTES + (off_t)rank * SLOT_SIZE;
}

static off_t marks_at(int rank) {
  return (off_t)rank * (off_t)sizeof(Marks);
}

/* The parent maps the table (the file grows to hold it; it stays sparse);
** NULL when it cannot, and every slot is then read to know. */
static void *map_table(int fd) {
  void *t;
  if (ftruncate(fd, TABLE_BYTES) != 0) return NULL;
  t = mmap(NULL, (size_t)TABLE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd,
           0);
  return t == MAP_FAILED ? NULL : t;
}

static Marks *marks_of(void *table, int rank) {
  return table != NULL && rank >= 0 && rank < TABLE_RANKS
         ? (Marks *)table + rank : NULL;
}

static mp_Mark mark_of(const mp_ReportTo *to, int rank, size_t field) {
  mp_Mark m;
  Marks *t = marks_of(to->table, rank);
  m.word = t != NULL ? (uint32_t *)((char *)t + field) : NULL;
  m.fd = to->fd;
  m.at = marks_at(rank) + (off_t)field;
  return m;
}

/* 0 only when the table says that the worker never set the mark. */
static int marked(const mp_Reports *r, int rank, size_t field) {
  Marks *t = marks_of(r->table, rank);
  return t == NULL ||
         __atomic_load_n((uint32_t *)((char *)t + field), __ATOMIC_ACQUIRE);
}

static void unmark(const mp_Reports *r, int rank, size_t field) {
  Marks *t = marks_of(r->table, rank);
  if (t != NULL) *(uint32_t *)((char *)t + field) = 0;
}

int mp_reports_create(mp_Reports *r) {
  int sv[2];
  r->sock = r->peer = -1;
  r->eof = 0;
  r->stash = NULL;
  r->nstash = r->capstash = 0;
  r->table = NULL;
  r->fd = memfd_create("lua-multiprocessing-reports", MFD_CLOEXEC);
  if (r->fd < 0) return errno;
  r->table = map_table(r->fd);
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    int err = errno;
    mp_reports_close(r);
    return err;
  }
  r->sock = sv[0];
  r->peer = sv[1];
  return 0;
}

void mp_reports_close(mp_Reports *r) {
  size_t i;
  if (r->table != NULL) munmap(r->table, (size_t)TABLE_BYTES);
  r->table = NULL;
  close_fd(&r->fd);
  close_fd(&r->sock);
  close_fd(&r->peer);
  for (i = 0; i < r->nstash; i++) close_fd(&r->stash[i].fd);
  free(r->stash);
  r->stash = NULL;
  r->nstash = r->capstash = 0;
}

/* --- descriptors --------------------------------------------------------- */

static int stash_push(mp_Reports *r, int rank, int fd) {
  if (r->nstash == r->capstash) {
    size_t cap = r->capstash ? 2 * r->capstash : 16;
    mp_Stashed *s = realloc(r->stash, cap * sizeof *s);
    if (s == NULL) return ENOMEM;
    r->stash = s;
    r->capstash = cap;
  }
  r->stash[r->nstash].rank = rank;
  r->stash[r->nstash++].fd = fd;
  return 0;
}

void mp_reports_drain(mp_Reports *r) {
  for (;;) {
    FdHeader h;
    int fds[MP_MAXFDS];
    size_t n = 0, i;
    ssize_t k;
    if (r->sock < 0 || r->eof) return;
    memset(&h, 0, sizeof h);
    k = mp_recvfds(r->sock, &h, sizeof h, fds, MP_MAXFDS, &n, MSG_DONTWAIT);
    if (k == 0) r->eof = 1;
    if (k == -EPROTO) {      /* truncated: the report that needs them fails */
      if (stash_push(r, h.rank, -1) != 0) return;
      continue;
    }
    if (k <= 0) return;      /* EAGAIN: that was all */
    for (i = 0; i < n; i++)
      if (stash_push(r, h.rank, fds[i]) != 0) {
        for (; i < n; i++) close(fds[i]);
        return;
      }
  }
}

/* Moves the last 'n' descriptors of 'rank' from the stash into 'out', in
** the order they came: a worker whose first report could not be written
** sent its descriptors again with the next.  The worker has exited, so all
** it sent is in the socket already. */
static int stash_take(mp_Reports *r, int rank, size_t n, int *out) {
  size_t i, j, first = r->nstash, got = 0;
  mp_reports_drain(r);
  for (i = r->nstash; i-- > 0 && got < n;)
    if (r->stash[i].rank == rank) {
      if (r->stash[i].fd < 0) return EPROTO;
      first = i;
      got++;
    }
  if (got < n) return EPROTO;
  for (i = first, got = 0; i < r->nstash && got < n; i++)
    if (r->stash[i].rank == rank) {
      out[got++] = r->stash[i].fd;
      r->stash[i].fd = -2;
    }
  for (i = j = 0; i < r->nstash; i++)
    if (r->stash[i].fd != -2) r->stash[j++] = r->stash[i];
  r->nstash = j;
  return 0;
}

/* Sends 'fds' as messages of at most MP_MAXFDS. */
static int send_report_fds(int sock, int rank, const int *fds,
                           size_t nfds) {
  while (nfds > 0) {
    size_t n = nfds < MP_MAXFDS ? nfds : MP_MAXFDS;
    FdHeader h;
    ssize_t k;
    h.rank = rank;
    h.n = (uint32_t)n;
    k = mp_sendfds(sock, &h, sizeof h, fds, n, 0);
    if (k < 0) return (int)-k;
    fds += n;
    nfds -= n;
  }
  return 0;
}

/* --- the file ------------------------------------------------------------ */

static off_t report_at(int rank) {
  return slot_at(rank) + REPORT_AT;
}

static int write_at(int fd, const void *p, size_t n, off_t at) {
  const char *s = p;
  while (n > 0) {
    ssize_t k = pwrite(fd, s, n, at);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    s += k;
    n -= (size_t)k;
    at += k;
  }
  return 0;
}

static int read_at(int fd, void *p, size_t n, off_t at) {
  char *s = p;
  while (n > 0) {
    ssize_t k = pread(fd, s, n, at);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    s += k;
    n -= (size_t)k;
    at += k;
  }
  return 0;
}

int mp_reports_put(const mp_ReportTo *to, int rank, int kind,
                   const char *data, size_t size, const int *fds,
                   size_t nfds) {
  off_t slot = report_at(rank);
  ReportHeader h;
  mp_Mark m = mark_of(to, rank, offsetof(Marks, report));
  int err;
  if (size > (size_t)REPORT_SIZE_MAX || nfds > UINT32_MAX)
    return EFBIG;
  mp_mark_set(&m);
  if (nfds > 0 && (err = send_report_fds(to->sock, rank, fds, nfds)) != 0)
    return err;
  err = write_at(to->fd, data, size, slot + (off_t)sizeof h);
  if (err != 0) return err;
  memset(&h, 0, sizeof h);
  h.kind = (uint32_t)kind;
  h.nfds = (uint32_t)nfds;
  h.size = size;
  return write_at(to->fd, &h, sizeof h, slot);
}

void mp_report_free(mp_Report *rep) {
  size_t i;
  for (i = 0; i < rep->nfds; i++) close_fd(&rep->fds[i]);
  free(rep->fds);
  free(rep->data);
  memset(rep, 0, sizeof *rep);
}

int mp_reports_take(mp_Reports *r, int rank, int kind, mp_Report *out) {
  off_t slot = report_at(rank);
  ReportHeader h;
  int err = 0;
  memset(out, 0, sizeof *out);
  if (r->fd < 0 || !marked(r, rank, offsetof(Marks, report)) ||
      read_at(r->fd, &h, sizeof h, slot) != 0 ||
      h.kind != (uint32_t)kind ||
      h.size > (uint64_t)REPORT_SIZE_MAX)
    return 0;
  out->data = malloc((size_t)h.size + 1);
  out->fds = malloc(sizeof(int) * (h.nfds ? h.nfds : 1));
  if (h.nfds > REPORT_FDS_MAX)
    err = EPROTO;
  else if (out->data == NULL || out->fds == NULL)
    err = ENOMEM;
  else if (read_at(r->fd, out->data, (size_t)h.size,
                   slot + (off_t)sizeof h) != 0)
    err = EIO;
  else if (h.nfds > 0 && (err = stash_take(r, rank, h.nfds, out->fds)) == 0)
    out->nfds = h.nfds;
  /* Read once: the slot's memory goes back to the system. */
  fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, slot,
            (off_t)sizeof h + (off_t)h.size);
  unmark(r, rank, offsetof(Marks, report));
  if (err != 0) {
    mp_report_free(out);
    return -err;
  }
  out->data[h.size] = '\0';
  out->size = (size_t)h.size;
  return 1;
}

/* --- reports nobody takes ----------------------------------------------- */

/* Protected: decodes the mp_Report (light userdata at 1) only to give back
** what it holds. */
static int discard_report(lua_State *L) {
  mp_Report *rep = lua_touserdata(L, 1);
  mp_decode(L, rep->data, rep->size, MP_CODEC_DISCARD, rep->fds, rep->nfds);
  return 0;
}

static void discard_rank(lua_State *L, mp_Reports *r, int rank) {
  static const mp_ReportKind kinds[] = {MP_REPORT_RESULT, MP_REPORT_ERROR};
  int k;
  for (k = 0; k < 2; k++) {
    mp_Report rep;
    if (mp_reports_take(r, rank, kinds[k], &rep) <= 0) continue;
    lua_pushcfunction(L, discard_report);             /* f */
    lua_pushlightuserdata(L, &rep);                   /* f rep */
    if (lua_pcall(L, 1, 0, 0) != LUA_OK)              /* [err] */
      lua_pop(L, 1);  /* the message was not ours */  /* */
    mp_report_free(&rep);
  }
}

void mp_reports_discard(lua_State *L, mp_Reports *r, int n) {
  int rank;
  for (rank = 0; rank < n; rank++) discard_rank(L, r, rank);
}

/* --- exit records ------------------------------------------------------- */

/* The code, then the magic that says it is there: through the mapping,
** two stores in that order; else one pwrite of both (a reader sees all of
** it or none). */
void mp_reports_exit_put(const mp_ReportTo *to, int rank, int code) {
  Marks *t = marks_of(to->table, rank);
  uint32_t e[2];
  if (t != NULL) {
    t->code = code;
    __atomic_store_n(&t->magic, EXIT_MAGIC, __ATOMIC_RELEASE);
    return;
  }
  e[0] = EXIT_MAGIC;
  memcpy(&e[1], &code, sizeof code);
  (void)!pwrite(to->fd, e, sizeof e,
                marks_at(rank) + (off_t)offsetof(Marks, magic));
}

int mp_reports_exit_get(const mp_Reports *r, int rank) {
  Marks *t = marks_of(r->table, rank);
  Marks m;
  if (t != NULL) {
    m.magic = __atomic_load_n(&t->magic, __ATOMIC_ACQUIRE);
    m.code = t->code;
  } else if (r->fd < 0 || rank < 0 || rank >= TABLE_RANKS ||
             pread(r->fd, &m, sizeof m, marks_at(rank)) != (ssize_t)sizeof m) {
    return MP_EXIT_UNKNOWN;
  }
  return m.magic == EXIT_MAGIC ? m.code : MP_EXIT_UNKNOWN;
}

/* --- ledgers ------------------------------------------------------------- */

off_t mp_reports_ledger_at(int rank) {
  return slot_at(rank);
}

mp_Mark mp_reports_ledger_mark(const mp_ReportTo *to, int rank) {
  return mark_of(to, rank, offsetof(Marks, ledger));
}

static void settle_rank(lua_State *L, mp_Reports *r, int rank) {
  if (marked(r, rank, offsetof(Marks, ledger)))
    mp_ledger_settle(L, r->fd, mp_reports_ledger_at(rank),
                     mp_array_give_back);
}

void mp_reports_settle(lua_State *L, mp_Reports *r, int n) {
  int rank;
  if (r->fd < 0) return;
  for (rank = 0; rank < n; rank++) settle_rank(L, r, rank);
}

/* --- a slot used again --------------------------------------------------- */

void mp_reports_shed(mp_Reports *r) {
  close_fd(&r->peer);
}

int mp_reports_renew(mp_Reports *r) {
  int sv[2];
  if (r->peer >= 0 || r->fd < 0) return 0;
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    return errno;
  mp_reports_drain(r);  /* what the gone workers sent stays in the stash */
  close_fd(&r->sock);
  r->sock = sv[0];
  r->peer = sv[1];
  r->eof = 0;
  return 0;
}

void mp_reports_clear(lua_State *L, mp_Reports *r, int rank) {
  static const Marks none;
  off_t slot = slot_at(rank);
  Marks *t = marks_of(r->table, rank);
  size_t i, j;
  if (r->fd < 0) return;
  discard_rank(L, r, rank);
  settle_rank(L, r, rank);
  mp_reports_drain(r);  /* it has exited: all it sent is in the socket */
  for (i = j = 0; i < r->nstash; i++)
    if (r->stash[i].rank == rank)
      close_fd(&r->stash[i].fd);  /* sent for a report it never wrote */
    else
      r->stash[j++] = r->stash[i];
  r->nstash = j;
  /* The marks, the ledger and the report's header read as empty. */
  if (t != NULL)
    *t = none;
  else if (rank >= 0 && rank < TABLE_RANKS)
    (void)!pwrite(r->fd, &none, sizeof none, marks_at(rank));
  fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, slot,
            REPORT_AT + (off_t)sizeof(ReportHeader));
}
