/*
** proc.c -- facts about child processes, at the bottom of the process
** layer: waiting for one (waitid by pidfd or pid), how it ended (an exit
** code, or minus the signal, as Process.exitcode counts), the status the
** kernel keeps on a pidfd after somebody else reaped it, and signalling a
** worker with its process group.  It knows no context and no Lua: join.c,
** launch.c, forkserver.c, shm.c's tracker and the launcher's program
** runner all read a status the same way.
*/
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/pidfd.h>
#include <sys/utsname.h>
#include <sys/wait.h>

#include "proc.h"
#include "sys.h"

#ifndef P_PIDFD
#define P_PIDFD 3   /* waitid by pidfd: Linux 5.4, glibc 2.36 */
#endif

int mp_wait_child(pid_t pid, int pidfd, siginfo_t *si, int options) {
  int r;
  memset(si, 0, sizeof *si);
  do {
    if (pidfd >= 0)
      r = waitid((idtype_t)P_PIDFD, (id_t)pidfd, si,
                 options | WEXITED | __WALL);
    else
      r = waitid(P_PID, (id_t)pid, si, options | WEXITED | __WALL);
  } while (r < 0 && errno == EINTR);
  return r < 0 ? -errno : 0;
}

int mp_exit_code(const siginfo_t *si) {
  return si->si_code == CLD_EXITED ? si->si_status : -si->si_status;
}

int mp_status_code(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return -WTERMSIG(wstatus);
  return MP_EXIT_UNKNOWN;
}

/* Linux >= 6.15 keeps a child's exit status on its pidfd after somebody
** else reaped it (a host that ignores SIGCHLD, or whose handler calls
** waitpid(-1)).  Older kernels (Debian 12's 6.1) do not: then join reads
** the status the worker wrote itself as it left (mp_reports_exit_get).
** LUA_MP_NO_PIDFD_EXIT_INFO=1 skips the pidfd here, which is how the specs
** stand in for such a kernel.  (Layout from linux/pidfd.h.) */
struct pidfd_exit_info {
  uint64_t mask, cgroupid;
  uint32_t pid, tgid, ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid;
  int32_t exit_code;
};
#define PIDFD_INFO_EXIT_BIT (1UL << 3)
#define PIDFD_GET_INFO_REQ _IOWR(0xFF, 11, struct pidfd_exit_info)
#define NO_EXIT_INFO_ENV "LUA_MP_NO_PIDFD_EXIT_INFO"

static int pidfd_exit_info_disabled(void) {
  const char *v = getenv(NO_EXIT_INFO_ENV);
  return v != NULL && *v != '\0' && strcmp(v, "0") != 0;
}

/* The release is read without sscanf, whose code a fresh worker would
** fault in for this alone (sys.h). */
int mp_pidfd_keeps_status(void) {
  struct utsname u;
  unsigned long long major, minor;
  const char *p = u.release;
  if (pidfd_exit_info_disabled() || uname(&u) != 0 ||
      !mp_read_uint(&p, &major) || *p++ != '.' || !mp_read_uint(&p, &minor))
    return 0;
  return major > 6 || (major == 6 && minor >= 15);
}

int mp_pidfd_exit_code(int pidfd) {
  struct pidfd_exit_info info;
  memset(&info, 0, sizeof info);
  info.mask = PIDFD_INFO_EXIT_BIT;
  if (pidfd >= 0 && !pidfd_exit_info_disabled()
      && ioctl(pidfd, PIDFD_GET_INFO_REQ, &info) == 0
      && (info.mask & PIDFD_INFO_EXIT_BIT))
    return mp_status_code(info.exit_code);
  return MP_EXIT_UNKNOWN;
}

/* 'sig' to the process, then to its group. */
static int send_both(pid_t pid, int pidfd, int sig) {
  int r;
  /* By pid only when there is no pidfd: after ESRCH the pid may be
  ** somebody else's already. */
  if (pidfd < 0)
    r = kill(pid, sig) == 0 ? 0 : -errno;
  else
    r = pidfd_send_signal(pidfd, sig, NULL, 0) == 0 ? 0 : -errno;
  killpg(pid, sig);  /* its group id is ours until we reap it */
  return r;
}

int mp_signal_group(pid_t pid, int pidfd, int sig) {
  int r = send_both(pid, pidfd, sig);
  /* A SIGTERM to a stopped process stays pending until it runs again (a
  ** worker catches SIGTERM to record its exit, so the kernel does not end
  ** it from the stop): SIGCONT follows, as in tini and systemd. */
  if (sig == SIGTERM) send_both(pid, pidfd, SIGCONT);
  return r;
}

int mp_kill_wait(pid_t pid, int pidfd, siginfo_t *si) {
  send_both(pid, pidfd, SIGKILL);
  return mp_wait_child(pid, pidfd, si, 0);
}
