/*
** sys.c -- the clock, whole writes and marks (sys.h).
*/
#include <errno.h>
#include <time.h>
#include <unistd.h>

#include "sys.h"

double mp_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Writes all of p[0..n), retrying after EINTR and short writes. */
int mp_write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t k = write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) return errno;
    p += k;
    n -= (size_t)k;
  }
  return 0;
}

void mp_mark_set(const mp_Mark *m) {
  static const uint32_t one = 1;
  if (m->word != NULL)
    __atomic_store_n(m->word, one, __ATOMIC_RELEASE);
  else if (m->fd >= 0)
    (void)!pwrite(m->fd, &one, sizeof one, m->at);
}
