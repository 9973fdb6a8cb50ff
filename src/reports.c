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
*/
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "mp.h"

#define SLOT_SIZE ((off_t)1 << 32)   /* a report may take up to 4 GiB */

typedef struct Header {
  uint32_t kind;     /* 0: no report, else MP_REPORT_ERROR or _RESULT */
  uint32_t pad;
  uint64_t size;
} Header;

int mp_reports_create(mp_Reports *r) {
  r->fd = memfd_create("lua-multiprocessing-reports", MFD_CLOEXEC);
  return r->fd < 0 ? errno : 0;
}

void mp_reports_close(mp_Reports *r) {
  if (r->fd >= 0) close(r->fd);
  r->fd = -1;
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

int mp_reports_put(int fd, int rank, int kind, const char *data, size_t size) {
  off_t slot = (off_t)rank * SLOT_SIZE;
  Header h;
  int err;
  if (size > (size_t)(SLOT_SIZE - (off_t)sizeof h)) return EFBIG;
  err = write_at(fd, data, size, slot + (off_t)sizeof h);
  if (err != 0) return err;
  memset(&h, 0, sizeof h);
  h.kind = (uint32_t)kind;
  h.size = size;
  return write_at(fd, &h, sizeof h, slot);
}

char *mp_reports_take(mp_Reports *r, int rank, int kind, size_t *size) {
  off_t slot = (off_t)rank * SLOT_SIZE;
  Header h;
  char *data;
  if (read_at(r->fd, &h, sizeof h, slot) != 0 || h.kind != (uint32_t)kind
      || h.size > (uint64_t)(SLOT_SIZE - (off_t)sizeof h))
    return NULL;
  data = malloc((size_t)h.size + 1);
  if (data == NULL) return NULL;
  if (read_at(r->fd, data, (size_t)h.size, slot + (off_t)sizeof h) != 0) {
    free(data);
    return NULL;
  }
  /* Read once: the slot's memory goes back to the system. */
  fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, slot,
            (off_t)sizeof h + (off_t)h.size);
  data[h.size] = '\0';
  *size = (size_t)h.size;
  return data;
}
