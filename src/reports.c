/*
** reports.c -- where workers leave their error reports and results.
**
** One anonymous memfd per context, one slot per worker at offset
** rank * SLOT_SIZE (the file is sparse: untouched slots cost nothing).  A
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
** (ledger.c, MP_LEDGER_BYTES, read when the context settles), then its exit
** record (the worker's own word on how it left, for when the host reaped
** it behind our back), then its report.  Rank 0's report and ledger are at the start of the file, so a
** single worker writes nowhere near an RLIMIT_FSIZE.
*/
#include <errno.h>
#include <fcntl.h>
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
#define EXIT_AT    MP_LEDGER_BYTES   /* in a slot: the ExitRecord */
#define REPORT_AT  (EXIT_AT + (off_t)sizeof(ExitRecord))
#define REPORT_SIZE_MAX (SLOT_SIZE - REPORT_AT - (off_t)sizeof(ReportHeader))
#define REPORT_FDS_MAX (1u << 20)    /* more than any process may hold */

typedef struct ReportHeader {
  uint32_t kind;     /* an mp_ReportKind; MP_REPORT_NONE: no report */
  uint32_t nfds;     /* descriptors sent through the socket before it */
  uint64_t size;
} ReportHeader;

typedef struct ExitRecord {
  uint32_t magic;    /* EXIT_MAGIC once written */
  int32_t code;      /* as mp_Worker.exitcode: status, or -signal */
} ExitRecord;
#define EXIT_MAGIC 0x45584954u

typedef struct FdHeader {
  int32_t rank;
  uint32_t n;
} FdHeader;

static void close_fd(int *fd) {
  if (*fd >= 0) close(*fd);
  *fd = -1;
}

int mp_reports_create(mp_Reports *r) {
  int sv[2];
  r->sock = r->peer = -1;
  r->eof = 0;
  r->stash = NULL;
  r->nstash = r->capstash = 0;
  r->fd = memfd_create("lua-multiprocessing-reports", MFD_CLOEXEC);
  if (r->fd < 0) return errno;
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) {
    int err = errno;
    close_fd(&r->fd);
    return err;
  }
  r->sock = sv[0];
  r->peer = sv[1];
  return 0;
}

void mp_reports_close(mp_Reports *r) {
  size_t i;
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
  return (off_t)rank * SLOT_SIZE + REPORT_AT;
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
  int err;
  if (size > (size_t)REPORT_SIZE_MAX || nfds > UINT32_MAX)
    return EFBIG;
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
  if (r->fd < 0 || read_at(r->fd, &h, sizeof h, slot) != 0 ||
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

/* One pwrite of 8 bytes: a reader sees all of it or none. */
void mp_reports_exit_put(int fd, int rank, int code) {
  ExitRecord e;
  e.magic = EXIT_MAGIC;
  e.code = code;
  (void)!pwrite(fd, &e, sizeof e, (off_t)rank * SLOT_SIZE + EXIT_AT);
}

int mp_reports_exit_get(const mp_Reports *r, int rank) {
  ExitRecord e;
  if (r->fd < 0 ||
      pread(r->fd, &e, sizeof e, (off_t)rank * SLOT_SIZE + EXIT_AT) !=
          (ssize_t)sizeof e ||
      e.magic != EXIT_MAGIC)
    return MP_EXIT_UNKNOWN;
  return e.code;
}

/* --- ledgers ------------------------------------------------------------- */

off_t mp_reports_ledger_at(int rank) {
  return (off_t)rank * SLOT_SIZE;
}

void mp_reports_settle(lua_State *L, mp_Reports *r, int n) {
  int rank;
  if (r->fd < 0) return;
  for (rank = 0; rank < n; rank++)
    mp_ledger_settle(L, r->fd, mp_reports_ledger_at(rank),
                     mp_array_give_back);
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
  off_t slot = (off_t)rank * SLOT_SIZE;
  size_t i, j;
  if (r->fd < 0) return;
  discard_rank(L, r, rank);
  mp_ledger_settle(L, r->fd, mp_reports_ledger_at(rank), mp_array_give_back);
  mp_reports_drain(r);  /* it has exited: all it sent is in the socket */
  for (i = j = 0; i < r->nstash; i++)
    if (r->stash[i].rank == rank)
      close_fd(&r->stash[i].fd);  /* sent for a report it never wrote */
    else
      r->stash[j++] = r->stash[i];
  r->nstash = j;
  /* The ledger, the exit record and the report's header read as empty. */
  fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, slot,
            REPORT_AT + (off_t)sizeof(ReportHeader));
}
