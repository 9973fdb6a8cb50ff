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
** of Lua: each child makes its own process group, drops the handler its
** parent has for SIGINT (lua.c's), arms the lifeline (its own open file of
** a pipe whose write end only the parent holds: SIGKILL to its group when
** the parent dies) and sets its name; the parent holds a pidfd per child
** (statuses that survive a host reaping children), reaps through it and
** sweeps the child's group.  Prints {"bench":"floor_fork_safe",...}: what a
** program gives up to go below it is one of the guarantees.
*/
#define _GNU_SOURCE
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

/* The lifeline's pipe, high as ours is: lifeline[0] reads, [1] writes. */
static int lifeline[2];
static char lifeline_path[64];

static void on_sigint(int sig) { (void)sig; }

static void safe_setup(void) {
  int p[2];
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_sigint;   /* as lua.c has while a chunk runs */
  sigaction(SIGINT, &sa, NULL);
  if (pipe2(p, O_CLOEXEC) != 0) { perror("pipe2"); exit(1); }
  lifeline[0] = fcntl(p[0], F_DUPFD_CLOEXEC, 960);
  lifeline[1] = fcntl(p[1], F_DUPFD_CLOEXEC, 960);
  close(p[0]);
  close(p[1]);
  snprintf(lifeline_path, sizeof lifeline_path, "/proc/self/fd/%d", lifeline[0]);
}

/* The child's share: group, handler, lifeline, name. */
static void safe_child(void) {
  pid_t self;
  int fd;
  setpgid(0, 0);
  self = getpid();
  signal(SIGINT, SIG_DFL);
  fd = open(lifeline_path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  fcntl(fd, F_SETSIG, SIGKILL);
  fcntl(fd, F_SETOWN, -self);
  fcntl(fd, F_SETFL, O_RDONLY | O_NONBLOCK | O_ASYNC);
  dup3(fd, lifeline[1], O_CLOEXEC);   /* closes our copy of the write end */
  close(fd);
  prctl(PR_SET_NAME, "floor worker");
}

static double once(int n, pid_t *pids, int *pidfds, int safe) {
  double t0 = now_s();
  int i;
  for (i = 0; i < n; i++) {
    pid_t p = fork();
    if (p == 0) {
      if (safe) safe_child();
      _exit(0);
    }
    if (p < 0) { perror("fork"); exit(1); }
    pids[i] = p;
    if (safe) pidfds[i] = (int)syscall(SYS_pidfd_open, p, 0);
  }
  for (i = 0; i < n; i++) {
    int st;
    siginfo_t si;
    if (!safe) {
      while (waitpid(pids[i], &st, 0) < 0) {}
      continue;
    }
    struct pollfd pfd;
    pfd.fd = pidfds[i];
    pfd.events = POLLIN;
    while (poll(&pfd, 1, -1) < 0) {}   /* exited: readable */
    kill(-pids[i], SIGKILL);           /* the group sweep, as ours at reap */
    while (waitid(P_PIDFD, (id_t)pidfds[i], &si, WEXITED) < 0) {}
    close(pidfds[i]);
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
