/*
** floor_fork.c -- the floor for starting N trivial fork workers:
** fork N children that _exit(0) at once, then waitpid all N (start all,
** then wait all, as start_processes does).
**
**   floor_fork REPS N [N...]
** prints per N: {"bench":"floor_fork","n":N,"samples":[ms,...]}
**
**   floor_fork --safe REPS N [N...]
** the same, with what every worker of ours must still do in C and nothing
** of Lua (guarantees.h).  Prints {"bench":"floor_fork_safe",...}.
*/
#define _GNU_SOURCE
#include <signal.h>
#include <string.h>
#include "common.h"
#include "guarantees.h"

static Lifeline lifeline;

static void on_sigint(int sig) { (void)sig; }

/* A SIGINT handler, as lua.c has while a chunk runs, and the lifeline. */
static void safe_setup(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;
  sigaction(SIGINT, &sa, NULL);
  if (lifeline_make(&lifeline) != 0) { perror("pipe2"); exit(1); }
}

static double once(int n, pid_t *pids, int *pidfds, int safe) {
  double t0 = now_s();
  int i;
  for (i = 0; i < n; i++) {
    pid_t p = fork();
    if (p == 0) {
      if (safe) guarantees_child(&lifeline);
      _exit(0);
    }
    if (p < 0) { perror("fork"); exit(1); }
    pids[i] = p;
    if (safe) pidfds[i] = guarantees_pidfd(p);
  }
  for (i = 0; i < n; i++) {
    int st;
    if (safe) guarantees_reap(pids[i], pidfds[i]);
    else while (waitpid(pids[i], &st, 0) < 0) {}
  }
  return (now_s() - t0) * 1e3;
}

int main(int argc, char **argv) {
  int safe = argc > 1 && strcmp(argv[1], "--safe") == 0;
  int reps = arg_int(argc, argv, 1 + safe, 30);
  int a;
  if (safe) safe_setup();
  for (a = 2 + safe; a < argc; a++) {
    int n = atoi(argv[a]), r;
    pid_t *pids = malloc(sizeof(pid_t) * (size_t)n);
    int *pidfds = malloc(sizeof(int) * (size_t)n);
    double *s = malloc(sizeof(double) * (size_t)reps);
    once(n, pids, pidfds, safe);                       /* warm-up */
    for (r = 0; r < reps; r++) s[r] = once(n, pids, pidfds, safe);
    printf("{\"bench\":\"%s\",\"n\":%d,", safe ? "floor_fork_safe" : "floor_fork", n);
    print_samples(s, reps);
    free(pids); free(pidfds); free(s);
  }
  return 0;
}
