/*
** guarantees.h -- what every fork worker of ours must do in C, for the
** floors that keep it (floor_fork --safe; benchclock.fork_floor, which
** also calls a Lua function in each child).
**
** The child makes its own process group, drops the handler its parent has
** for SIGINT (lua.c's, while a chunk runs), arms the lifeline (its own
** open file of a pipe whose write end only the parent holds: SIGKILL to
** its group when the parent dies) and sets its name.  The parent holds a
** pidfd per child (statuses that survive a host reaping children), waits
** on it, sweeps the child's group and reaps the child through it.  What a
** program gives up to go below these floors is one of the guarantees.
*/
#ifndef bench_guarantees_h
#define bench_guarantees_h

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* The lifeline's pipe, high as ours is: fd[0] reads, fd[1] writes. */
typedef struct Lifeline {
  int fd[2];
  char path[64];   /* /proc/self/fd/<fd[0]>: a child opens its own file */
} Lifeline;

/* 0, or -1 when the pipe could not be made.  An end that cannot move high
** (a low descriptor limit) stays where it is, as the library's does. */
static int lifeline_make(Lifeline *l) {
  int p[2], end;
  if (pipe2(p, O_CLOEXEC) != 0) return -1;
  for (end = 0; end < 2; end++) {
    int high = fcntl(p[end], F_DUPFD_CLOEXEC, 960);
    if (high >= 0) close(p[end]);
    l->fd[end] = high >= 0 ? high : p[end];
  }
  snprintf(l->path, sizeof l->path, "/proc/self/fd/%d", l->fd[0]);
  return 0;
}

/* The child's share: group, handler, lifeline, name. */
static void guarantees_child(const Lifeline *l) {
  pid_t self;
  int fd;
  setpgid(0, 0);
  self = getpid();
  signal(SIGINT, SIG_DFL);
  fd = open(l->path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  fcntl(fd, F_SETSIG, SIGKILL);
  fcntl(fd, F_SETOWN, -self);
  fcntl(fd, F_SETFL, O_RDONLY | O_NONBLOCK | O_ASYNC);
  dup3(fd, l->fd[1], O_CLOEXEC);   /* closes our copy of the write end */
  close(fd);
  prctl(PR_SET_NAME, "floor worker");
}

static int guarantees_pidfd(pid_t pid) {
  return (int)syscall(SYS_pidfd_open, pid, 0);
}

/* The parent's share, once the child was started: wait on its pidfd,
** sweep its group, reap it through the pidfd (with no pidfd: waitpid). */
static void guarantees_reap(pid_t pid, int pidfd) {
  struct pollfd pfd;
  siginfo_t si;
  int st;
  if (pidfd < 0) {
    while (waitpid(pid, &st, 0) < 0) {}
    return;
  }
  pfd.fd = pidfd;
  pfd.events = POLLIN;
  while (poll(&pfd, 1, -1) < 0) {}   /* exited: readable */
  kill(-pid, SIGKILL);               /* the group sweep, as ours at reap */
  while (waitid(P_PIDFD, (id_t)pidfd, &si, WEXITED) < 0) {}
  close(pidfd);
}

#endif
