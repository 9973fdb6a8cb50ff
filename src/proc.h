/*
** proc.h -- facts about child processes (proc.c): the bottom of the
** process layer, under everything that starts or waits for one.  It needs
** no Lua and no context: the core (join.c, launch.c, forkserver.c, shm.c)
** and the launcher module (launcher/rank.c, which compiles proc.c in) read
** a status the same way.  Errors: 0 or -errno.
*/
#ifndef mp_proc_h
#define mp_proc_h

#include <signal.h>
#include <sys/types.h>

/* A status nobody can know (another waiter took it). */
#define MP_EXIT_UNKNOWN  (-1000)

/* waitid(2) for the child 'pidfd' (by 'pid' when pidfd < 0), retried on
** EINTR, WEXITED and __WALL added to 'options'; 0 or -errno. */
int  mp_wait_child(pid_t pid, int pidfd, siginfo_t *si, int options);
/* How a child that waitid reported ended: its exit status, or minus the
** signal that killed it (as Process.exitcode counts). */
int  mp_exit_code(const siginfo_t *si);
/* The same from a wait status (waitpid, the pidfd's exit info), or
** MP_EXIT_UNKNOWN. */
int  mp_status_code(int wstatus);
/* The status the kernel kept on the pidfd of a child somebody else reaped
** (Linux >= 6.15), or MP_EXIT_UNKNOWN. */
int  mp_pidfd_exit_code(int pidfd);
/* 1 when mp_pidfd_exit_code can know: a kernel that keeps the status, and
** not LUA_MP_NO_PIDFD_EXIT_INFO (the specs' stand-in for an older one).
** Else a worker records its own exit (worker.c, reports.c). */
int  mp_pidfd_keeps_status(void);
/* 'sig' to the child (by pidfd; by pid when pidfd < 0) and to its process
** group, and SIGCONT after a SIGTERM, so that a stopped child dies of it
** at once; 0 or -errno (of the child's own signal). */
int  mp_signal_group(pid_t pid, int pidfd, int sig);
/* SIGKILL to the child and its group, then waits for it; 0 or -errno. */
int  mp_kill_wait(pid_t pid, int pidfd, siginfo_t *si);

#endif
