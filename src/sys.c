/*
** sys.c -- the clock, whole writes, marks, text without printf, a booted
** worker's heap populated ahead and the file a module was loaded from
** (sys.h).
*/
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <stdlib.h>
#include <sys/mman.h>
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

char *mp_add_text(char *p, const char *end, const char *s) {
  while (*s != '\0' && p < end) *p++ = *s++;
  return p;
}

char *mp_add_int(char *p, const char *end, long v) {
  char digits[24];
  int n = 0;
  unsigned long u = v < 0 ? 0UL - (unsigned long)v : (unsigned long)v;
  do digits[n++] = (char)('0' + u % 10); while ((u /= 10) != 0);
  if (v < 0 && p < end) *p++ = '-';
  while (n > 0 && p < end) *p++ = digits[--n];
  return p;
}

int mp_read_uint(const char **p, unsigned long long *v) {
  const char *q = *p;
  unsigned long long u = 0;
  if (*q < '0' || *q > '9') return 0;
  while (*q >= '0' && *q <= '9') u = u * 10 + (unsigned long long)(*q++ - '0');
  *p = q;
  *v = u;
  return 1;
}

void mp_prefault_heap(void) {
#ifdef MADV_POPULATE_WRITE
  struct mallinfo2 mi = mallinfo2();
  uintptr_t end = (uintptr_t)sbrk(0), page = (uintptr_t)getpagesize();
  uintptr_t start = (end - (uintptr_t)mi.arena) & ~(page - 1);
  if (mi.arena == 0 || mi.arena > HEAP_PREFAULT_MAX || start >= end) return;
  (void)madvise((void *)start, end - start, MADV_POPULATE_WRITE);
#endif
}

void mp_settle_heap(void) {
  void *volatile p = malloc(HEAP_SETTLE_BYTES);  /* volatile: kept */
  free(p);
}

mp_Self *mp_self_new(void) {
#ifdef MADV_WIPEONFORK
  size_t page = (size_t)getpagesize();
  void *p = mmap(NULL, page, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  if (madvise(p, page, MADV_WIPEONFORK) != 0) {
    munmap(p, page);
    return NULL;
  }
  return (mp_Self *)p;
#else
  return NULL;
#endif
}

void mp_self_free(mp_Self *s) {
  if (s != NULL) munmap(s, (size_t)getpagesize());
}

/* The first access is a write (an atomic or of 0): in a fork's child that
** is one page fault for a zeroed page, where a read first would be two
** (the zero page mapped, then copied at the store). */
pid_t mp_self_pid(mp_Self *s) {
  pid_t pid;
  if (s == NULL) return getpid();
  pid = __atomic_fetch_or(&s->pid, 0, __ATOMIC_RELAXED);
  if (pid == 0) {
    pid = getpid();
    __atomic_store_n(&s->pid, pid, __ATOMIC_RELAXED);
  }
  return pid;
}

char *mp_file_of(const void *code, const char **name) {
  Dl_info info;
  *name = NULL;
  if (dladdr(code, &info) == 0 || info.dli_fname == NULL) return NULL;
  *name = info.dli_fname;
  return realpath(info.dli_fname, NULL);
}
