/*
** join.c -- waiting for workers, taking them down, and turning the first
** failure into an exception.
**
** Waiting is poll(2) on the workers' pidfds: no SIGCHLD handler, no sleeps.
** While a join blocks, SIGINT is read from a signalfd (when the host has not
** ignored or blocked it), so Ctrl-C terminates the workers before the error
** reaches Lua; the signal mask is restored before join returns or raises.
**
** Termination never blocks a poll: after a failure, ctx->ending moves on
** (grace for the others, SIGTERM, SIGKILL at ctx->next_at) at whichever
** join reaches its next step, so join(0) in a frame loop returns false at
** once until everything is reaped, then raises.  A blocking join is the
** same steps with sleeps between them.  ctx:fileno() is an epoll of what a
** join waits for -- the running workers' pidfds, the reports' socket, and a
** timerfd for ctx->next_at -- so an event loop wakes exactly when join(0)
** has something to do.
*/
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include "codec.h"
#include "mp.h"

/* --- exit status ----------------------------------------------------------- */

/* How a worker somebody else reaped ended: what the kernel kept on its
** pidfd (proc.c), else what the worker wrote itself as it left. */
static int lost_status(const mp_Worker *w) {
  int code = mp_pidfd_exit_code(w->pidfd);
  if (code != MP_EXIT_UNKNOWN) return code;
  return mp_reports_exit_get(&w->ctx->reports, (int)(w - w->ctx->workers));
}

/* The 'watch' of fileno() (made lazily, see mp_watch) wakes an event loop
** when join has something to do.  Arms its timer to fire at 'at' (seconds
** of mp_now; INFINITY disarms, 0 fires at once): setting it also clears a
** timer that fired before. */
static void arm_timer(mp_Context *ctx, double at) {
  struct itimerspec its;
  if (ctx->timer < 0) return;
  memset(&its, 0, sizeof its);
  if (!isinf(at)) {
    double left = at - mp_now();
    if (left < 1e-9) left = 1e-9;  /* 0 would disarm */
    its.it_value.tv_sec = (time_t)left;
    its.it_value.tv_nsec = (long)((left - (double)(time_t)left) * 1e9);
    if (its.it_value.tv_sec == 0 && its.it_value.tv_nsec == 0)
      its.it_value.tv_nsec = 1;
  }
  timerfd_settime(ctx->timer, 0, &its, NULL);
}

static void unwatch(mp_Context *ctx, int fd) {
  if (ctx->watch >= 0 && fd >= 0) epoll_ctl(ctx->watch, EPOLL_CTL_DEL, fd, NULL);
}

/* Reaps the worker if it has exited ('exited': its pidfd said so, and no
** WNOWAIT probe needs to ask again).  Whatever is left in its process group
** is killed first, while the exited leader still holds the group's id (so
** the id cannot have been reused): a worker's children never outlive it. */
static int reap(mp_Worker *w, int exited) {
  siginfo_t si;
  int r;
  if (w->state == MP_EXITED) return 1;
  if (!exited) {
    r = mp_wait_child(w->pid, w->pidfd, &si, WNOHANG | WNOWAIT);
    if (r == 0 ? si.si_pid == 0 : r != -ECHILD) return 0;  /* running */
  }
  killpg(w->pid, SIGKILL);
  r = mp_wait_child(w->pid, w->pidfd, &si, 0);
  w->exitcode = r == 0 ? mp_exit_code(&si) : lost_status(w);  /* ECHILD */
  /* A forked worker of another context may hold a copy of the pidfd: the
  ** epoll would go on seeing it after our close. */
  unwatch(w->ctx, w->pidfd);
  if (w->pidfd >= 0) close(w->pidfd);
  w->pidfd = -1;
  w->state = MP_EXITED;
  w->ended_at = mp_now();
  /* Reaped outside a join (is_alive, exitcode): the join that takes the
  ** news must still be woken. */
  arm_timer(w->ctx, 0);
  return 1;
}

int mp_reap(mp_Worker *w) {
  return reap(w, 0);
}

void mp_discard(mp_Worker *w) {
  siginfo_t si;
  mp_kill_wait(w->pid, w->pidfd, &si);
  w->exitcode = -SIGKILL;
  w->terminated = 1;
  w->state = MP_EXITED;
  w->ended_at = mp_now();
}

int mp_signal_worker(mp_Worker *w, int sig) {
  if (w->state != MP_RUNNING) return 0;
  return mp_signal_group(w->pid, w->pidfd, sig);
}

/* --- waiting ------------------------------------------------------------- */

/* Ctrl-C while a wait blocks in poll(2): see mp_interrupt_watch in mp.h. */
void mp_interrupt_watch(mp_Interrupt *in) {
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

void mp_interrupt_unwatch(mp_Interrupt *in) {
  if (in->fd < 0) return;
  close(in->fd);
  in->fd = -1;
  pthread_sigmask(SIG_SETMASK, &in->old, NULL);
}

int mp_interrupt_took(mp_Interrupt *in) {
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
static Wake wait_any(mp_Context *ctx, double deadline, mp_Interrupt *in) {
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
    if (fds[k].revents != 0 && who[k] != NULL)
      reap(who[k], (fds[k].revents & POLLIN) != 0);  /* readable: exited */
  if (in != NULL && mp_interrupt_took(in)) wake = WOKE_INTERRUPT;
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

/* --- the ending: SIGTERM now, SIGKILL on a later step -------------------- */

static void kill_all(mp_Context *ctx) {
  int i;
  for (i = 0; i < ctx->started; i++)
    mp_signal_worker(&ctx->workers[i], SIGKILL);
  ctx->ending = MP_END_KILL;
  ctx->next_at = INFINITY;
}

/* SIGTERM to what still runs, SIGKILL 'grace' seconds later (at once when
** 'grace' is 0).  One that already exited failed (or not) on its own: it
** is reaped first, so that only the ones we signal count as terminated by
** us. */
static void begin_term(mp_Context *ctx, double grace) {
  int i;
  if (ctx->ending >= MP_END_TERM) return;
  for (i = 0; i < ctx->started; i++) {
    mp_Worker *w = &ctx->workers[i];
    if (mp_reap(w)) continue;
    w->terminated = 1;
    if (grace > 0) mp_signal_worker(w, SIGTERM);
  }
  ctx->ending = MP_END_TERM;
  ctx->grace = grace;
  ctx->next_at = mp_now() + grace;
  if (grace <= 0) kill_all(ctx);
}

/* When the first ending of a single worker (mp_terminate_rank) is due for
** its SIGKILL; INFINITY when none is under way. */
static double rank_due(const mp_Context *ctx) {
  double at = INFINITY;
  int i;
  for (i = 0; i < ctx->started; i++) {
    const mp_Worker *w = &ctx->workers[i];
    if (w->kill_at > 0 && w->state == MP_RUNNING) at = fmin(at, w->kill_at);
  }
  return at;
}

/* When the ending of the whole context or of one worker moves on next. */
static double next_due(const mp_Context *ctx) {
  return fmin(ctx->ending != MP_END_NONE ? ctx->next_at : INFINITY,
              rank_due(ctx));
}

/* SIGKILL to the single workers whose grace is over. */
static void advance_ranks(mp_Context *ctx, double now) {
  int i;
  for (i = 0; i < ctx->started; i++) {
    mp_Worker *w = &ctx->workers[i];
    if (w->kill_at <= 0 || now < w->kill_at) continue;
    w->kill_at = 0;
    if (!mp_reap(w)) mp_signal_worker(w, SIGKILL);
  }
}

/* Moves an ending that has begun on when its time has come, never
** waiting: what poll() does, and every join. */
static void advance(mp_Context *ctx) {
  double now = mp_now();
  advance_ranks(ctx, now);
  if (ctx->ending == MP_END_WAIT && (now >= ctx->next_at || running(ctx) == 0))
    begin_term(ctx, ctx->grace);
  else if (ctx->ending == MP_END_TERM && now >= ctx->next_at)
    kill_all(ctx);
}

/* One step of join: the policy "one fails, all go" starts an ending when a
** worker failed (with 'grace' for the others when 'grace_given'), then
** the ending moves on. */
static void step(mp_Context *ctx, double grace, int grace_given) {
  if (ctx->ending == MP_END_NONE && first_failure(ctx) >= 0) {
    if (!grace_given || grace <= 0) {
      begin_term(ctx, grace);
    } else {
      ctx->ending = MP_END_WAIT;
      ctx->grace = grace;
      ctx->next_at = mp_now() + grace;
    }
  }
  advance(ctx);
}

/* Ctrl-C: terminate without waiting for the others; a second one skips
** the rest of the grace. */
static void on_interrupt(mp_Context *ctx, double grace) {
  ctx->interrupted = 1;
  if (ctx->ending < MP_END_TERM)
    begin_term(ctx, grace);
  else if (ctx->ending == MP_END_TERM)
    kill_all(ctx);
}

/* Every worker reaped, or 'deadline' passed: 1, or 0 on the deadline.
** Each wake-up moves the ending on. */
static int run_ending(mp_Context *ctx, double deadline, double grace,
                      int grace_given, mp_Interrupt *in) {
  for (;;) {
    Wake wake;
    step(ctx, grace, grace_given);
    if (running(ctx) == 0) return 1;
    wake = wait_any(ctx, fmin(deadline, next_due(ctx)), in);
    if (wake == WOKE_INTERRUPT)
      on_interrupt(ctx, grace);
    else if (wake == WOKE_TIMEOUT && mp_now() >= deadline) {
      step(ctx, grace, grace_given);
      return running(ctx) == 0;
    }
  }
}

static void watch_sync(mp_Context *ctx);

void mp_terminate(mp_Context *ctx, double grace) {
  double at = mp_now() + grace;
  if (ctx->closed) return;
  if (ctx->ending < MP_END_TERM)
    begin_term(ctx, grace);
  else if (ctx->ending == MP_END_TERM && grace <= 0)
    kill_all(ctx);
  else if (ctx->ending == MP_END_TERM && at < ctx->next_at)
    ctx->next_at = at;
  watch_sync(ctx);
}

void mp_terminate_rank(mp_Context *ctx, int rank, double grace) {
  mp_Worker *w = &ctx->workers[rank];
  double at = mp_now() + grace;
  if (ctx->closed || rank >= ctx->started || w->pid <= 0 || mp_reap(w))
    return;
  if (!w->terminated) {
    w->terminated = 1;
    if (grace > 0) mp_signal_worker(w, SIGTERM);
  }
  if (grace <= 0) {
    w->kill_at = 0;
    mp_signal_worker(w, SIGKILL);
  } else if (w->kill_at <= 0 || at < w->kill_at) {
    w->kill_at = at;
  }
  watch_sync(ctx);
}

void mp_terminate_all(mp_Context *ctx, double grace) {
  mp_Interrupt in;
  mp_interrupt_watch(&in);
  mp_terminate(ctx, grace);
  run_ending(ctx, INFINITY, grace, 1, &in);
  mp_interrupt_unwatch(&in);
}

/* --- poll: the events of a context that its owner drives ----------------- */

/* Pushes the event of worker 'rank', which has ended. */
static void push_event(lua_State *L, const mp_Worker *w, int rank) {
  const char *name;
  lua_createtable(L, 0, 6);                           /* ev */
  lua_pushinteger(L, rank);
  lua_setfield(L, -2, "rank");
  lua_pushinteger(L, w->pid);
  lua_setfield(L, -2, "pid");
  if (w->exitcode != MP_EXIT_UNKNOWN) {
    lua_pushinteger(L, w->exitcode);
    lua_setfield(L, -2, "exitcode");
  }
  if (w->exitcode < 0 && w->exitcode != MP_EXIT_UNKNOWN &&
      (name = mp_signal_name(-w->exitcode)) != NULL) {
    lua_pushstring(L, name);
    lua_setfield(L, -2, "signal");
  }
  lua_pushboolean(L, w->terminated);
  lua_setfield(L, -2, "terminated");
  lua_pushnumber(L, w->ended_at);
  lua_setfield(L, -2, "at");
}

int mp_poll(lua_State *L, mp_Context *ctx) {
  int i, n = 0, top = mp_stack_top(L);
  if (!ctx->closed) {
    wait_any(ctx, 0, NULL);  /* a deadline passed: it never sleeps */
    advance(ctx);
    watch_sync(ctx);
  }
  lua_newtable(L);                                    /* events */
  for (i = 0; i < ctx->started; i++) {
    mp_Worker *w = &ctx->workers[i];
    if (w->pid <= 0 || w->state != MP_EXITED || w->polled) continue;
    w->polled = 1;
    push_event(L, w, i);                              /* events ev */
    lua_rawseti(L, -2, ++n);                          /* events */
  }
  if (!ctx->closed && running(ctx) > 0 && !isinf(next_due(ctx)) &&
      ctx->ending != MP_END_KILL)
    lua_pushnumber(L, fmax(0, next_due(ctx) - mp_now()));
  else
    lua_pushnil(L);                                   /* events due */
  mp_stack_check(L, top, 2);
  return 2;
}

/* --- fileno -------------------------------------------------------------- */

static int watch_add(mp_Context *ctx, int fd) {
  struct epoll_event ev;
  memset(&ev, 0, sizeof ev);
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  return epoll_ctl(ctx->watch, EPOLL_CTL_ADD, fd, &ev) == 0 ? 0 : errno;
}

/* After each join, and when the watch is made: the reports' socket out
** once it is at its end (it would stay readable), and the timer set for
** what join has to do next -- at once when no worker runs any more (one
** reaped outside a join), at the ending's next step, or nothing. */
static void watch_sync(mp_Context *ctx) {
  if (ctx->watch < 0 || ctx->closed) return;
  if (ctx->watch_sock && ctx->reports.eof) {
    unwatch(ctx, ctx->reports.sock);
    ctx->watch_sock = 0;
  }
  arm_timer(ctx, running(ctx) == 0 ? 0 : next_due(ctx));
}

int mp_watch_worker(mp_Worker *w) {
  mp_Context *ctx = w->ctx;
  int err = ctx->watch >= 0 ? watch_add(ctx, w->pidfd) : 0;
  if (err == 0 && ctx->watch >= 0 && !ctx->watch_sock &&
      ctx->reports.sock >= 0 && !ctx->reports.eof) {
    err = watch_add(ctx, ctx->reports.sock);
    ctx->watch_sock = err == 0;
  }
  watch_sync(ctx);
  return -err;
}

void mp_watch_unsock(mp_Context *ctx) {
  if (ctx->watch_sock) unwatch(ctx, ctx->reports.sock);
  ctx->watch_sock = 0;
}

void mp_watch_finish(mp_Context *ctx) {
  if (ctx->watch < 0) return;
  if (ctx->watch_sock) unwatch(ctx, ctx->reports.sock);
  ctx->watch_sock = 0;
  arm_timer(ctx, 0);
}

int mp_watch(mp_Context *ctx) {
  int i, err = 0;
  if (ctx->watch >= 0) return ctx->watch;
  ctx->watch = epoll_create1(EPOLL_CLOEXEC);
  if (ctx->watch < 0) return -errno;
  ctx->timer = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (ctx->timer < 0) err = errno;
  if (err == 0) err = watch_add(ctx, ctx->timer);
  for (i = 0; i < ctx->started && err == 0; i++)
    if (ctx->workers[i].state == MP_RUNNING)
      err = watch_add(ctx, ctx->workers[i].pidfd);
  if (err == 0 && !ctx->closed && ctx->reports.sock >= 0 && !ctx->reports.eof) {
    err = watch_add(ctx, ctx->reports.sock);
    ctx->watch_sock = err == 0;
  }
  if (err != 0) {
    mp_watch_close(ctx);
    return -err;
  }
  if (ctx->closed)
    arm_timer(ctx, 0);
  else
    watch_sync(ctx);
  return ctx->watch;
}

void mp_watch_close(mp_Context *ctx) {
  if (ctx->timer >= 0) close(ctx->timer);
  if (ctx->watch >= 0) close(ctx->watch);
  ctx->timer = ctx->watch = -1;
  ctx->watch_sock = 0;
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
  lua_pushglobaltable(L);                             /* _G */
  lua_pushlstring(L, name, len);                      /* _G name */
  found = lua_rawget(L, -2) != LUA_TNIL;              /* _G value */
  lua_pop(L, 2);                                      /* */
  if (!found) return;
  lua_pushlstring(L, name, len);                      /* name */
  lua_pushfstring(L, "\n(hint: the parent has a global '%s', but globals are "
                     "not copied to a worker started by \"%s\": pass it in "
                     "args or keep it in a local the function uses)",
                  lua_tostring(L, -1), ctx->method->name); /* name hint */
  lua_remove(L, -2);                                  /* hint */
}

/* Protected: decodes the mp_Report (light userdata at 1), whose
** descriptors go to the objects that carry them. */
static int decode_report(lua_State *L) {
  mp_Report *rep = lua_touserdata(L, 1);
  mp_decode(L, rep->data, rep->size, MP_CODEC_DATA, rep->fds, rep->nfds);
  return 1;
}

/* e.traceback and e.message from the report at 'r' (its text on top):
** the worker said where its traceback ends (tb); without it, the whole
** text is the message. */
static void split_text(lua_State *L, int r, int fields) {
  size_t len;
  const char *text = lua_tolstring(L, -1, &len);
  lua_Integer tb;
  int top = mp_stack_top(L);
  lua_getfield(L, r, "tb");                           /* ... text tb */
  tb = lua_isinteger(L, -1) ? lua_tointeger(L, -1) : -1;
  lua_pop(L, 1);                                      /* ... text */
  if (tb >= 0 && (size_t)tb < len) {
    lua_pushlstring(L, text, (size_t)tb);
    lua_setfield(L, fields, "traceback");
    lua_pushlstring(L, text + tb + 1, len - (size_t)tb - 1);
  } else {
    lua_pushvalue(L, -1);
  }
  lua_setfield(L, fields, "message");
  mp_stack_check(L, top, 0);
}

/* Sets msg and value of the exception fields at 'fields' from the error
** report 'rep' of worker 'rank'. */
static void raised_fields(lua_State *L, const mp_Context *ctx, int rank,
                          mp_Report *rep, int fields) {
  int top = mp_stack_top(L), head;
  lua_pushfstring(L, "\n\n-- Process %d terminated with the following "
                     "error:\n", rank);                 /* head */
  head = lua_gettop(L);
  lua_pushcfunction(L, decode_report);                /* head f */
  lua_pushlightuserdata(L, rep);                      /* head f rep */
  if (lua_pcall(L, 1, 1, 0) == LUA_OK && lua_istable(L, -1)) { /* head r */
    lua_getfield(L, -1, "value");                     /* head r value */
    lua_setfield(L, fields, "value");                 /* head r */
    if (lua_getfield(L, -1, "text") != LUA_TSTRING) { /* head r text */
      lua_pop(L, 1);                                  /* head r */
      lua_pushliteral(L, "(the error report has no text)"); /* head r text */
    }
    split_text(L, lua_gettop(L) - 1, fields);
  } else {                                            /* head err */
    lua_pushfstring(L, "(the error report could not be read: %s)",
                    lua_tostring(L, -1));             /* head err text */
  }
  lua_remove(L, -2);                                  /* head text */
  push_global_hint(L, ctx, lua_tostring(L, -1));      /* head text [hint] */
  lua_concat(L, lua_gettop(L) - head + 1);            /* msg */
  lua_setfield(L, fields, "msg");                     /* */
  mp_stack_check(L, top, 0);
}

/* Sets msg (and signal_name, when a signal killed it) of the exception
** fields at 'fields' for worker 'rank', which ended with 'code'. */
static void exited_fields(lua_State *L, int rank, int code, int fields) {
  int top = mp_stack_top(L);
  const char *name;
  if (code == MP_EXIT_UNKNOWN)
    lua_pushfstring(L, "process %d terminated and another waiter took its exit "
                       "status (does the host ignore or reap SIGCHLD?)", rank);
  else if (code >= 0)
    lua_pushfstring(L, "process %d terminated with exit code %d", rank, code);
  else {
    name = mp_signal_name(-code);
    if (name != NULL)
      lua_pushstring(L, name);                        /* signame */
    else
      lua_pushfstring(L, "<Unknown signal %d>", -code);
    lua_pushvalue(L, -1);                             /* signame signame */
    lua_setfield(L, fields, "signal_name");           /* signame */
    lua_pushfstring(L, "process %d terminated with signal %s", rank,
                    lua_tostring(L, -1));             /* signame msg */
    lua_remove(L, -2);                                /* msg */
  }
  lua_setfield(L, fields, "msg");                     /* */
  mp_stack_check(L, top, 0);
}

/* Pushes the fields every exception about worker 'rank' has. */
static void push_fields(lua_State *L, const mp_Context *ctx, int rank) {
  lua_createtable(L, 0, 8);                           /* fields */
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
  int fields, top = mp_stack_top(L);
  push_fields(L, ctx, rank);                          /* fields */
  fields = lua_gettop(L);
  if (w->exitcode != MP_EXIT_UNKNOWN) {
    lua_pushinteger(L, w->exitcode);
    lua_setfield(L, fields, "exit_code");
  }
  if (got < 0) {
    lua_pushfstring(L, "process %d failed, and its error report could not be "
                       "read: %s", rank, strerror(-got));
    lua_setfield(L, fields, "msg");
  } else if (got > 0) {
    raised_fields(L, ctx, rank, &rep, fields);
    mp_report_free(&rep);
  } else {
    exited_fields(L, rank, w->exitcode, fields);
  }
  lua_pushstring(L, got == 0 ? "exited" : "raised");
  lua_setfield(L, fields, "kind");
  mp_exception_new(L, got == 0 ? MP_EXC_EXITED : MP_EXC_RAISED,
                   fields);                           /* fields e */
  lua_remove(L, fields);                              /* e */
  mp_stack_check(L, top, 1);
}

/* The first failure, with every other worker that failed on its own in
** e.failures (torch keeps only the first). */
static void push_failure(lua_State *L, mp_Context *ctx, int first) {
  int i, n = 0, top = mp_stack_top(L);
  lua_newtable(L);                                    /* others */
  for (i = 0; i < ctx->started; i++) {
    const mp_Worker *w = &ctx->workers[i];
    if (i == first || w->exitcode == 0 || w->terminated) continue;
    push_exception(L, ctx, i);                        /* others e */
    lua_rawseti(L, -2, ++n);                          /* others */
  }
  push_exception(L, ctx, first);                      /* others e */
  lua_getiuservalue(L, -1, 1);                        /* others e fields */
  lua_pushvalue(L, -3);                         /* others e fields others */
  lua_setfield(L, -2, "failures");                    /* others e fields */
  lua_pop(L, 1);                                      /* others e */
  lua_remove(L, -2);                                  /* e */
  mp_stack_check(L, top, 1);
}

/* --- results ------------------------------------------------------------- */

/* A result the parent cannot read or decode (a function of a module only
** the worker has): the worker's own exit was clean, so the exception says
** it was its result.  The message (why) on top is replaced by it. */
static void push_result_failure(lua_State *L, const mp_Context *ctx,
                                int rank) {           /* why */
  push_fields(L, ctx, rank);                          /* why fields */
  lua_pushfstring(L, "process %d (pid %d) exited cleanly, but its result "
                     "cannot be received: %s", rank,
                  (int)ctx->workers[rank].pid, lua_tostring(L, -2));
  lua_setfield(L, -2, "msg");                         /* why fields */
  lua_pushliteral(L, "result");
  lua_setfield(L, -2, "kind");
  mp_exception_new(L, MP_EXC_BASE, -1);               /* why fields e */
  lua_replace(L, -3);                                 /* e fields */
  lua_pop(L, 1);                                      /* e */
}

/* Reads every result into the field results of the table at 'uv' and
** returns 1; on a result it cannot read or decode, pushes the exception
** and returns 0 (the results decoded so far are closed when collected,
** the others when the context finishes). */
static int read_results(lua_State *L, mp_Context *ctx, int uv) {
  int i;
  lua_createtable(L, ctx->nprocs, 1);                 /* results */
  lua_pushinteger(L, ctx->nprocs);
  lua_setfield(L, -2, "n");
  for (i = 0; i < ctx->nprocs; i++) {
    mp_Report rep;
    int status, got = mp_reports_take(&ctx->reports, i, MP_REPORT_RESULT,
                                      &rep);
    if (got == 0) continue;
    if (got < 0) {
      lua_pushfstring(L, "it could not be read (%s)",
                      strerror(-got));                /* results why */
      status = LUA_ERRRUN;
    } else {
      lua_pushcfunction(L, decode_report);            /* results f */
      lua_pushlightuserdata(L, &rep);                 /* results f rep */
      status = lua_pcall(L, 1, 1, 0);                 /* results v|why */
      mp_report_free(&rep);
    }
    if (status != LUA_OK) {
      push_result_failure(L, ctx, i);                 /* results e */
      lua_remove(L, -2);                              /* e */
      return 0;
    }
    lua_rawseti(L, -2, i + 1);                        /* results */
  }
  lua_setfield(L, uv, "results");                     /* */
  return 1;
}

/* --- join ---------------------------------------------------------------- */

static void close_lifeline(mp_Context *ctx, int end) {
  if (ctx->lifeline[end] >= 0) close(ctx->lifeline[end]);
  ctx->lifeline[end] = -1;
}

void mp_context_finish(lua_State *L, mp_Context *ctx) {
  if (getpid() == ctx->owner) {
    mp_reports_discard(L, &ctx->reports, ctx->started);
    mp_reports_settle(L, &ctx->reports, ctx->started);
  }
  mp_watch_finish(ctx);
  mp_reports_close(&ctx->reports);
  close_lifeline(ctx, 0);
  close_lifeline(ctx, 1);
  ctx->closed = 1;
}

/* Called once every worker is reaped: stores the outcome -- the failure
** on top, or nil -- in the context's uservalue and closes the reports.
** An outcome is raised again by every later join. */
static void settle(lua_State *L, mp_Context *ctx, int ctxidx) { /* outcome */
  lua_getiuservalue(L, ctxidx, 1);                    /* outcome uv */
  lua_insert(L, -2);                                  /* uv outcome */
  lua_setfield(L, -2, "failure");                     /* uv */
  lua_pop(L, 1);                                      /* */
  mp_context_finish(L, ctx);
  mp_payload_release(L, ctxidx);
}

/* Protected: raises the join's mp.Interrupted (exception.c), which the
** caller keeps as the outcome that every later join raises again. */
static int raise_interrupted(lua_State *L) {
  return mp_raise_interrupt(L, "ProcessContext.join",
                            "every worker was terminated and reaped");
}

/* Every worker reaped: the outcome is the results (uv.results), a result
** that cannot be received, an interrupt, or the first failure. */
static void finish_join(lua_State *L, mp_Context *ctx, int ctxidx) {
  int top = mp_stack_top(L), failed = first_failure(ctx);
  if (ctx->interrupted) {
    lua_pushcfunction(L, raise_interrupted);
    lua_pcall(L, 0, 0, 0);                            /* e */
  } else if (failed >= 0) {
    push_failure(L, ctx, failed);                     /* e */
  } else {  /* all exited 0, or ctx:terminate() ended them */
    lua_getiuservalue(L, ctxidx, 1);                  /* uv */
    if (read_results(L, ctx, lua_gettop(L)))          /* uv [e] */
      lua_pushnil(L);                                 /* uv nil */
    lua_remove(L, -2);                                /* e|nil */
  }
  settle(L, ctx, ctxidx);                             /* */
  mp_stack_check(L, top, 0);
}

/* The context has ended: raises its failure, if that was the outcome. */
static void raise_failure(lua_State *L, int ctxidx) {
  lua_getiuservalue(L, ctxidx, 1);                    /* uv */
  if (lua_getfield(L, -1, "failure") != LUA_TNIL)     /* uv failure */
    lua_error(L);
  lua_pop(L, 2);                                      /* */
}

int mp_join(lua_State *L, mp_Context *ctx, int ctxidx, double timeout,
            double grace, int grace_given) {
  double deadline = timeout < 0 ? INFINITY : mp_now() + timeout;
  ctxidx = lua_absindex(L, ctxidx);
  if (!ctx->closed) {
    mp_Interrupt in;
    int done;
    mp_interrupt_watch(&in);
    done = run_ending(ctx, deadline, grace, grace_given, &in);
    mp_interrupt_unwatch(&in);
    if (done) finish_join(L, ctx, ctxidx);  /* closes the context */
    watch_sync(ctx);
  }
  if (ctx->closed) raise_failure(L, ctxidx);
  return ctx->closed;
}
