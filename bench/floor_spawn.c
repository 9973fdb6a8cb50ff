/*
** floor_spawn.c -- the floor for starting N fresh interpreters:
** posix_spawnp of `lua5.4 -e ''` N times, then waitpid all N.
**
**   floor_spawn REPS LUA N [N...]
** prints per N: {"bench":"floor_spawn","n":N,"samples":[ms,...]}
*/
#define _GNU_SOURCE
#include <spawn.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

extern char **environ;

static double once(int n, pid_t *pids, char **av) {
  double t0 = now_s();
  int i;
  for (i = 0; i < n; i++) {
    int e = posix_spawnp(&pids[i], av[0], NULL, NULL, av, environ);
    if (e != 0) { fprintf(stderr, "posix_spawnp %s: error %d\n", av[0], e); exit(1); }
  }
  for (i = 0; i < n; i++) {
    int st;
    while (waitpid(pids[i], &st, 0) < 0) {}
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) { fprintf(stderr, "child failed\n"); exit(1); }
  }
  return (now_s() - t0) * 1e3;
}

int main(int argc, char **argv) {
  int reps = arg_int(argc, argv, 1, 30);
  char *av[4];
  int a;
  av[0] = argc > 2 ? argv[2] : (char *)"lua5.4";
  av[1] = (char *)"-e"; av[2] = (char *)""; av[3] = NULL;
  for (a = 3; a < argc; a++) {
    int n = atoi(argv[a]), r;
    pid_t *pids = malloc(sizeof(pid_t) * (size_t)n);
    double *s = malloc(sizeof(double) * (size_t)reps);
    once(n, pids, av);                   /* warm-up (page cache) */
    for (r = 0; r < reps; r++) s[r] = once(n, pids, av);
    printf("{\"bench\":\"floor_spawn\",\"n\":%d,", n);
    print_samples(s, reps);
    free(pids); free(s);
  }
  return 0;
}
