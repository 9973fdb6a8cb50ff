/*
** join.c -- waiting for workers, taking them down, and turning the first
** failure into an exception.
**
** Waiting is poll(2) on the workers' pidfds: no SIGCHLD handler, no sleeps.
** While a join blocks, SIGINT is read from a signalfd (when the host has not
** ignored or blocked it), so Ctrl-C terminates the workers before the error
** reaches Lua; the signal mask is restored before join returns or raises.
*/
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/pidfd.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "codec.h"
#include "mp.h"

#ifndef P_PIDFD
#define P_PIDFD 3
#endif

/* --- exit status --------------------------------------------------------- */

/* Linux >= 6.15 keeps a child's exit status on its pidfd after somebody
** else reaped it: a host that ignores SIGCHLD, or whose handler calls
** waitpid(-1), does not lose us the status.  (Layout from linux/pidfd.h.) */
struct pidfd_exit_info {
  uint64_t mask, cgroupid;
  uint32_t pid, tgid, ppid, ruid, rgid, euid, egid, suid, sgid, fsuid, fsgid;
  int32_t exit_code;
};
#define PIDFD_INFO_EXIT_BIT (1UL << 3)
#define PIDFD_GET_INFO_REQ _IOWR(0xFF, 11, struct pidfd_exit_info)

static int status_from_wait(int wstatus) {
  if (WIFEXITED(wstatus)) return WEXITSTATUS(wstatus);
  if (WIFSIGNALED(wstatus)) return -WTERMSIG(wstatus);
  return MP_EXIT_UNKNOWN;
}

static int lost_status(const mp_Worker *w) {
  struct pidfd_exit_info info;
  memset(&info, 0, sizeof info);
  info.mask = PIDFD_INFO_EXIT_BIT;
  if (w->pidfd >= 0 && ioctl(w->pidfd, PIDFD_GET_INFO_REQ, &info) == 0
      && (info.mask & PIDFD_INFO_EXIT_BIT))
    return status_from_wait(info.exit_code);
  return MP_EXIT_UNKNOWN;
}

static int wait_worker(const mp_Worker *w, siginfo_t *si, int options) {
  int r;
  memset(si, 0, sizeof *si);
  do {
    if (w->pidfd >= 0)
      r = waitid(P_PIDFD, (id_t)w->pidfd, si, options | WEXITED | __WALL);
    else
      r = waitid(P_PID, (id_t)w->pid, si, options | WEXITED | __WALL);
  } while (r < 0 && errno == EINTR);
  return r;
}

/* Reaps the worker if it has exited.  Whatever is left in its process group
** is killed first, while the exited leader still holds the group's id (so
** the id cannot have been reused): a worker's children never outlive it. */
int mp_reap(mp_Worker *w) {
  siginfo_t si;
  if (w->state == MP_EXITED) return 1;
  if (wait_worker(w, &si, WNOHANG | WNOWAIT) == 0) {
    if (si.si_pid == 0) return 0;
    killpg(w->pid, SIGKILL);
    wait_worker(w, &si, 0);
    w->exitcode = si.si_code == CLD_EXITED ? si.si_status : -si.si_status;
  } else if (errno == ECHILD) {
    killpg(w->pid, SIGKILL);
    w->exitcode = lost_status(w);
  } else {
    return 0;
  }
  if (w->pidfd >= 0) close(w->pidfd);
  w->pidfd = -1;
  w->state = MP_EXITED;
  return 1;
}

void mp_discard(mp_Worker *w) {
  siginfo_t si;
  kill(w->pid, SIGKILL);
  killpg(w->pid, SIGKILL);
  wait_worker(w, &si, 0);
  w->exitcode = -SIGKILL;
  w->terminated = 1;
  w->state = MP_EXITED;
}

static void signal_worker(mp_Worker *w, int sig) {
  if (w->state != MP_RUNNING) return;
  /* By pid only when there is no pidfd: after ESRCH the pid may be
  ** somebody else's already. */
  if (w->pidfd < 0)
    kill(w->pid, sig);
  else
    pidfd_send_signal(w->pidfd, sig, NULL, 0);
  killpg(w->pid, sig);
}

/* --- waiting ------------------------------------------------------------- */

typedef struct Interrupt {
  int fd;        /* signalfd for SIGINT, or -1 when not watched */
  sigset_t old;
} Interrupt;

static void watch_interrupt(Interrupt *in) {
  struct sigaction sa;
  sigset_t set;
  in->fd = -1;
  if (sigaction(SIGINT, NULL, &sa) != 0 || sa.sa_handler == SIG_IGN) return;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  if (pthread_sigmask(SIG_BLOCK, &set, &in->old) != 0) return;
  if (sigismember(&in->old, SIGINT)) return;  /* the host blocks it: its own */
  in->fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
  if (in->fd < 0) pthread_sigmask(SIG_SETMASK, &in->old, NULL);
}

static void unwatch_interrupt(Interrupt *in) {
  if (in->fd < 0) return;
  close(in->fd);
  in->fd = -1;
  pthread_sigmask(SIG_SETMASK, &in->old, NULL);
}

static int took_interrupt(Interrupt *in) {
  struct signalfd_siginfo ssi;
  return in->fd >= 0 && read(in->fd, &ssi, sizeof ssi) == (ssize_t)sizeof ssi;
}

typedef enum { WOKE_EXIT, WOKE_TIMEOUT, WOKE_INTERRUPT } Wake;

/* Sleeps until a running worker exits, 'deadline' passes or SIGINT comes
** ('in' may be NULL: not interruptible), and reaps the workers whose pidfd
** became readable: only those, so a wake-up costs a syscall per exit, not
** one per worker.  Descriptors that workers send with their reports are
** taken in meanwhile, so that a worker never waits for room in the socket
** while we wait for it. */
static Wake wait_any(mp_Context *ctx, double deadline, Interrupt *in) {
  struct pollfd *fds = malloc(sizeof *fds * ((size_t)ctx->nprocs + 2));
  mp_Worker **who = malloc(sizeof *who * ((size_t)ctx->nprocs + 2));
  nfds_t sockat = (nfds_t)-1;
  nfds_t n = 0, k;
  int i, r;
  Wake wake = WOKE_EXIT;
  if (fds == NULL || who == NULL) {
    free(fds);
    free(who);
    return WOKE_TIMEOUT;  /* the caller's loop tries again */
  }
  for (i = 0; i < ctx->started; i++) {
    if (ctx->workers[i].state != MP_RUNNING) continue;
    who[n] = &ctx->workers[i];
    fds[n].fd = ctx->workers[i].pidfd;
    fds[n++].events = POLLIN;
  }
  if (in != NULL && in->fd >= 0) {
    who[n] = NULL;
    fds[n].fd = in->fd;
    fds[n++].events = POLLIN;
  }
  if (ctx->reports.sock >= 0 && !ctx->reports.eof) {
    who[n] = NULL;
    sockat = n;
    fds[n].fd = ctx->reports.sock;
    fds[n++].events = POLLIN;
  }
  for (;;) {
    double left = deadline - mp_now();
    int ms = isinf(deadline) ? -1
           : left <= 0 ? 0
           : left > INT_MAX / 1000 ? INT_MAX : (int)ceil(left * 1000);
    r = poll(fds, n, ms);
    if (r > 0 && sockat != (nfds_t)-1 && fds[sockat].revents != 0) {
      mp_reports_drain(&ctx->reports);
      if (ctx->reports.eof || (fds[sockat].revents & (POLLERR | POLLNVAL)))
        fds[sockat].fd = -1;  /* poll skips it from now on */
      if (--r == 0) continue;
    }
    if (r > 0 || (r < 0 && errno != EINTR)) break;
    if (r == 0) {
      wake = WOKE_TIMEOUT;
      break;
    }
  }
  for (k = 0; r > 0 && k < n; k++)
    if (fds[k].revents != 0 && who[k] != NULL) mp_reap(who[k]);
  if (in != NULL && took_interrupt(in)) wake = WOKE_INTERRUPT;
  free(fds);
  free(who);
  return wake;
}

/* The lowest rank that failed on its own (not by our hand), or -1. */
static int first_failure(const mp_Context *ctx) {
  int i;
  for (i = 0; i < ctx->started; i++) {
    const mp_Worker *w = &ctx->workers[i];
    if (w->state == MP_EXITED && w->exitcode != 0 && !w->terminated) return i;
  }
  return -1;
}

static int running(const mp_Context *ctx) {
  int i, n = 0;
  for (i = 0; i < ctx->started; i++)
    n += ctx->workers[i].state == MP_RUNNING;
  return n;
}

/* Waits until every worker exited or 'deadline'; 0 when interrupted. */
static int wait_all(mp_Context *ctx, double deadline, Interrupt *in) {
  while (running(ctx) > 0) {
    Wake wake = wait_any(ctx, deadline, in);
    if (wake == WOKE_INTERRUPT) return 0;
    if (wake == WOKE_TIMEOUT && mp_now() >= deadline) break;
  }
  return 1;
}

/* SIGTERM, up to 'grace' seconds, then SIGKILL; a second Ctrl-C skips the
** grace.  Returns with every worker reaped. */
static void terminate_watched(mp_Context *ctx, double grace, Interrupt *in) {
  int i;
  for (i = 0; i < ctx->started; i++) {
    mp_Worker *w = &ctx->workers[i];
    /* One that already exited failed (or not) on its own: reap it first,
    ** so that only the ones we signal count as terminated by us. */
    if (mp_reap(w)) continue;
    w->terminated = 1;
    signal_worker(w, SIGTERM);
  }
  wait_all(ctx, mp_now() + grace, in);
  for (i = 0; i < ctx->started; i++)
    signal_worker(&ctx->workers[i], SIGKILL);
  wait_all(ctx, INFINITY, NULL);
}

void mp_terminate_all(mp_Context *ctx, double grace) {
  Interrupt in;
  watch_interrupt(&in);
  terminate_watched(ctx, grace, &in);
  unwatch_interrupt(&in);
}

/* --- the exception ------------------------------------------------------- */

/* "attempt to call a nil value (global 'x')" in a fresh interpreter often
** means the function used a global of the parent's: pushes a hint saying
** so, or nothing. */
static void push_global_hint(lua_State *L, const mp_Context *ctx,
                             const char *text) {
  static const char marker[] = "(global '";
  const char *name = strstr(text, marker);
  size_t len = 0;
  int found;
  if (ctx->method == &mp_start_fork || name == NULL) return;
  name += sizeof marker - 1;
  while (name[len] != '\0' && name[len] != '\'') len++;
  if (name[len] != '\'') return;
  lua_pushglobaltable(L);
  lua_pushlstring(L, name, len);
  found = lua_rawget(L, -2) != LUA_TNIL;
  lua_pop(L, 2);
  if (!found) return;
  lua_pushlstring(L, name, len);
  lua_pushfstring(L, "\n(hint: the parent has a global '%s', but globals are "
                     "not copied to a worker started by \"%s\": pass it in "
                     "args or keep it in a local the function uses)",
                  lua_tostring(L, -1), ctx->method->name);
  lua_remove(L, -2);
}

/* Protected: decodes the mp_Report (light userdata at 1), whose
** descriptors go to the objects that carry them. */
static int decode_report(lua_State *L) {
  mp_Report *rep = lua_touserdata(L, 1);
  mp_decode(L, rep->data, rep->size, MP_CODEC_DATA, rep->fds, rep->nfds);
  return 1;
}

static void raised_fields(lua_State *L, const mp_Context *ctx, int rank,
                          mp_Report *rep) {
  int fields = lua_gettop(L);
  lua_pushfstring(L, "\n\n-- Process %d terminated with the following "
                     "error:\n", rank);
  lua_pushcfunction(L, decode_report);
  lua_pushlightuserdata(L, rep);
  if (lua_pcall(L, 1, 1, 0) == LUA_OK && lua_istable(L, -1)) {
    lua_getfield(L, -1, "value");
    lua_setfield(L, fields, "value");
    if (lua_getfield(L, -1, "text") != LUA_TSTRING) {
      lua_pop(L, 1);
      lua_pushliteral(L, "(the error report has no text)");
    }
    lua_remove(L, -2);
  } else {
    lua_pushfstring(L, "(the error report could not be read: %s)",
                    lua_tostring(L, -1));
    lua_remove(L, -2);
  }
  push_global_hint(L, ctx, lua_tostring(L, -1));
  lua_concat(L, lua_gettop(L) - fields);
  lua_setfield(L, fields, "msg");
}

static void exited_message(lua_State *L, int rank, int code) {
  const char *name;
  if (code == MP_EXIT_UNKNOWN) {
    lua_pushfstring(L, "process %d terminated and another waiter took its exit "
                       "status (does the host ignore or reap SIGCHLD?)", rank);
    return;
  }
  if (code >= 0) {
    lua_pushfstring(L, "process %d terminated with exit code %d", rank, code);
    return;
  }
  name = mp_signal_name(-code);
  if (name != NULL)
    lua_pushstring(L, name);
  else
    lua_pushfstring(L, "<Unknown signal %d>", -code);
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, "signal_name");
  lua_pushfstring(L, "process %d terminated with signal %s", rank,
                  lua_tostring(L, -1));
  lua_remove(L, -2);
}

/* Pushes the fields every exception about worker 'rank' has. */
static void push_fields(lua_State *L, const mp_Context *ctx, int rank) {
  lua_createtable(L, 0, 8);
  lua_pushinteger(L, rank);
  lua_setfield(L, -2, "error_index");
  lua_pushinteger(L, ctx->workers[rank].pid);
  lua_setfield(L, -2, "error_pid");
  lua_pushinteger(L, ctx->workers[rank].pid);
  lua_setfield(L, -2, "pid");
}

/* Pushes the exception for worker 'rank' (which failed). */
static void push_exception(lua_State *L, mp_Context *ctx, int rank) {
  const mp_Worker *w = &ctx->workers[rank];
  mp_Report rep;
  int got = mp_reports_take(&ctx->reports, rank, MP_REPORT_ERROR, &rep);
  push_fields(L, ctx, rank);
  if (w->exitcode != MP_EXIT_UNKNOWN) {
    lua_pushinteger(L, w->exitcode);
    lua_setfield(L, -2, "exit_code");
  }
  if (got < 0) {
    lua_pushfstring(L, "process %d failed, and its error report could not be "
                       "read: %s", rank, strerror(-got));
    lua_setfield(L, -2, "msg");
    mp_exception_new(L, MP_EXC_RAISED, -1);
  } else if (got > 0) {
    raised_fields(L, ctx, rank, &rep);
    mp_report_free(&rep);
    mp_exception_new(L, MP_EXC_RAISED, -1);
  } else {
    exited_message(L, rank, w->exitcode);
    lua_setfield(L, -2, "msg");
    mp_exception_new(L, MP_EXC_EXITED, -1);
  }
  lua_remove(L, -2);
}

/* The first failure, with every other worker that failed on its own in
** e.failures (torch keeps only the first). */
static void push_failure(lua_State *L, mp_Context *ctx, int first) {
  int i, n = 0;
  lua_newtable(L);
  for (i = 0; i < ctx->started; i++) {
    const mp_Worker *w = &ctx->workers[i];
    if (i == first || w->exitcode == 0 || w->terminated) continue;
    push_exception(L, ctx, i);
    lua_rawseti(L, -2, ++n);
  }
  push_exception(L, ctx, first);
  lua_getiuservalue(L, -1, 1);
  lua_pushvalue(L, -3);
  lua_setfield(L, -2, "failures");
  lua_pop(L, 1);
  lua_remove(L, -2);
}

/* --- results ------------------------------------------------------------- */

/* A result the parent cannot read or decode (a function of a module only
** the worker has): the worker's own exit was clean, so the exception says
** it was its result.  The message (why) is on top; it is replaced. */
static void push_result_failure(lua_State *L, const mp_Context *ctx,
                                int rank) {
  push_fields(L, ctx, rank);
  lua_pushfstring(L, "process %d (pid %d) exited cleanly, but its result "
                     "cannot be received: %s", rank,
                  (int)ctx->workers[rank].pid, lua_tostring(L, -2));
  lua_setfield(L, -2, "msg");
  mp_exception_new(L, MP_EXC_BASE, -1);
  lua_replace(L, -3);
  lua_pop(L, 1);
}

/* Reads every result into uv.results; on a bad report, pushes the
** exception and returns 0 (the results decoded so far are closed when
** collected, the others when the context finishes). */
static int read_results(lua_State *L, mp_Context *ctx, int uv) {
  int i;
  lua_createtable(L, ctx->nprocs, 1);
  lua_pushinteger(L, ctx->nprocs);
  lua_setfield(L, -2, "n");
  for (i = 0; i < ctx->nprocs; i++) {
    mp_Report rep;
    int got = mp_reports_take(&ctx->reports, i, MP_REPORT_RESULT, &rep), status;
    if (got == 0) continue;
    if (got < 0) {
      lua_pushfstring(L, "it could not be read (%s)", strerror(-got));
      status = LUA_ERRRUN;
    } else {
      lua_pushcfunction(L, decode_report);
      lua_pushlightuserdata(L, &rep);
      status = lua_pcall(L, 1, 1, 0);
      mp_report_free(&rep);
    }
    if (status != LUA_OK) {
      push_result_failure(L, ctx, i);
      lua_remove(L, -2);
      return 0;
    }
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, uv, "results");
  return 1;
}

/* --- join ---------------------------------------------------------------- */

/* Called once every worker is reaped: stores the outcome in the context's
** uservalue and closes the reports.  An outcome is raised again by every
** later join. */
static void settle(lua_State *L, mp_Context *ctx, int ctxidx) {
  lua_getiuservalue(L, ctxidx, 1);
  lua_insert(L, -2);
  lua_setfield(L, -2, "failure");
  lua_pop(L, 1);
  mp_context_finish(L, ctx);
  mp_payload_release(L, ctxidx);
}

static int raise_failure(lua_State *L, int ctxidx) {
  lua_getiuservalue(L, ctxidx, 1);
  lua_getfield(L, -1, "failure");
  return lua_error(L);
}

int mp_join(lua_State *L, int ctxidx, double timeout, double grace,
            int grace_given) {
  mp_Context *ctx = mp_checkcontext(L, ctxidx);
  double deadline = timeout < 0 ? INFINITY : mp_now() + timeout;
  Interrupt in;
  int failed, interrupted = 0;
  ctxidx = lua_absindex(L, ctxidx);
  if (ctx->closed) {
    lua_getiuservalue(L, ctxidx, 1);
    if (lua_getfield(L, -1, "failure") != LUA_TNIL) return lua_error(L);
    lua_pop(L, 2);
    return 1;
  }
  watch_interrupt(&in);
  for (;;) {
    Wake wake;
    failed = first_failure(ctx);
    if (failed >= 0 || running(ctx) == 0) break;
    wake = wait_any(ctx, deadline, &in);
    if (wake == WOKE_INTERRUPT) {
      interrupted = 1;
      break;
    }
    if (wake == WOKE_TIMEOUT && mp_now() >= deadline) {
      unwatch_interrupt(&in);
      return 0;
    }
  }
  if (failed < 0 && !interrupted) {
    unwatch_interrupt(&in);
    lua_getiuservalue(L, ctxidx, 1);
    if (!read_results(L, ctx, lua_gettop(L))) {
      lua_remove(L, -2);
      settle(L, ctx, ctxidx);
      return raise_failure(L, ctxidx);
    }
    lua_pop(L, 1);
    lua_pushnil(L);
    settle(L, ctx, ctxidx);
    return 1;
  }
  if (!interrupted && grace_given)
    interrupted = !wait_all(ctx, mp_now() + grace, &in);
  terminate_watched(ctx, grace, &in);
  unwatch_interrupt(&in);
  if (interrupted)
    lua_pushliteral(L, "interrupted! (SIGINT during join: every worker was "
                       "terminated and reaped)");
  else
    push_failure(L, ctx, failed);
  settle(L, ctx, ctxidx);
  return raise_failure(L, ctxidx);
}
