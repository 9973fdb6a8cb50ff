/*
** sys.c -- the clock and whole writes (sys.h).
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
