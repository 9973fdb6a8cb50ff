/*
** cpus.c -- how many CPUs this process may use: the one count behind
** mp.cpu_count(), Pool()'s default and `mprun -n auto`.  As CPython's
** os.process_cpu_count() and more: the CPUs of the affinity mask, lowered
** by a cgroup v2 CPU quota (cpu.max "quota period" of this process's
** cgroup, rounded up), at least 1.
*/
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "mp.h"

/* The CPUs the affinity mask allows (large masks too), else those online. */
static long affinity_cpus(void) {
  int size;
  for (size = CPU_SETSIZE; size <= 1 << 16; size *= 2) {
    cpu_set_t *set = CPU_ALLOC(size);
    size_t bytes = CPU_ALLOC_SIZE(size);
    long n = -1;
    if (set == NULL) break;
    if (sched_getaffinity(0, bytes, set) == 0) n = CPU_COUNT_S(bytes, set);
    CPU_FREE(set);
    if (n > 0) return n;
  }
  return sysconf(_SC_NPROCESSORS_ONLN);
}

/* This process's cgroup v2 path ("0::/path" in /proc/self/cgroup) into
** 'buf', or 0. */
static int cgroup_path(char *buf, size_t size) {
  char line[4096];
  int found = 0;
  FILE *f = fopen("/proc/self/cgroup", "re");
  if (f == NULL) return 0;
  while (!found && fgets(line, sizeof line, f) != NULL) {
    if (strncmp(line, "0::", 3) != 0) continue;
    line[strcspn(line, "\n")] = '\0';
    found = snprintf(buf, size, "/sys/fs/cgroup%s", line + 3) < (int)size;
  }
  fclose(f);
  return found;
}

/* The quota of cpu.max in 'dir' and its parents, in CPUs (the smallest,
** rounded up), or 0 when none limits. */
static long quota_cpus(char *dir) {
  long best = 0;
  for (;;) {
    char path[4200], max[64];
    long long quota, period;
    FILE *f;
    char *slash;
    snprintf(path, sizeof path, "%s/cpu.max", dir);
    if ((f = fopen(path, "re")) != NULL) {
      if (fscanf(f, "%63s %lld", max, &period) == 2 && strcmp(max, "max") != 0 &&
          sscanf(max, "%lld", &quota) == 1 && quota > 0 && period > 0) {
        long n = (long)ceil((double)quota / (double)period);
        if (best == 0 || n < best) best = n;
      }
      fclose(f);
    }
    slash = strrchr(dir, '/');
    if (slash == NULL || strcmp(dir, "/sys/fs/cgroup") == 0) break;
    *slash = '\0';
  }
  return best;
}

int mp_cpu_count(void) {
  char dir[4100];
  long n = affinity_cpus(), q;
  if (cgroup_path(dir, sizeof dir) && (q = quota_cpus(dir)) > 0 && q < n)
    n = q;
  return n > 0 ? (int)n : 1;
}

/* cpu_count() -> the CPUs this process may use (at least 1). */
static int l_cpu_count(lua_State *L) {
  lua_pushinteger(L, mp_cpu_count());
  return 1;
}

void mp_open_cpus(lua_State *L) {
  lua_pushcfunction(L, l_cpu_count);
  lua_setfield(L, -2, "cpu_count");
}
