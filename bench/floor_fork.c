/*
** floor_fork.c -- the floor for starting N trivial fork workers:
** fork N children that _exit(0) at once, then waitpid all N (start all,
** then wait all, as start_processes does).
**
**   floor_fork REPS N [N...]
** prints per N: {"bench":"floor_fork","n":N,"samples":[ms,...]}
*/
#define _GNU_SOURCE
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

static double once(int n, pid_t *pids) {
  double t0 = now_s();
  int i;
  for (i = 0; i < n; i++) {
    pid_t p = fork();
    if (p == 0) _exit(0);
    if (p < 0) { perror("fork"); exit(1); }
    pids[i] = p;
  }
  for (i = 0; i < n; i++) {
    int st;
    while (waitpid(pids[i], &st, 0) < 0) {}
  }
  return (now_s() - t0) * 1e3;
}

int main(int argc, char **argv) {
  int reps = arg_int(argc, argv, 1, 30);
  int a;
  for (a = 2; a < argc; a++) {
    int n = atoi(argv[a]), r;
    pid_t *pids = malloc(sizeof(pid_t) * (size_t)n);
    double *s = malloc(sizeof(double) * (size_t)reps);
    once(n, pids);                       /* warm-up */
    for (r = 0; r < reps; r++) s[r] = once(n, pids);
    printf("{\"bench\":\"floor_fork\",\"n\":%d,", n);
    print_samples(s, reps);
    free(pids); free(s);
  }
  return 0;
}
