/*
** start_fork.c -- the "fork" start method: each worker is a fork of the
** calling process and runs the function in its copy of the Lua state.
** Fast, but only safe in a single-threaded host; see "spawn".
*/
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/pidfd.h>
#include <unistd.h>

#include "mp.h"
#include "sharing.h"

/* When the host ignores SIGCHLD (or handles it, and may reap), a child that
** exits at once could be reaped before we hold its pidfd, and its status
** would be lost.  Then the children wait at a gate (a pipe) that opens when
** the parent has every pidfd. */
static int host_may_reap(void) {
  struct sigaction sa;
  if (sigaction(SIGCHLD, NULL, &sa) != 0) return 1;
  return sa.sa_handler != SIG_DFL || (sa.sa_flags & SA_NOCLDWAIT);
}

static void wait_at_gate(int gate) {
  char c;
  while (read(gate, &c, 1) < 0 && errno == EINTR) {}
  close(gate);
}

/* fork copies only the calling thread: a lock another thread held (in
** malloc, stdio, the host's own) stays locked in the child forever.  Said
** once per Lua state, through the library's warning channel. */
#define WARNED_KEY "multiprocessing.warned_fork_threads"
static void warn_if_threaded(lua_State *L, int n) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, WARNED_KEY) != LUA_TNIL || n <= 1) {
    lua_pop(L, 1);
    return;
  }
  lua_pop(L, 1);
  lua_pushboolean(L, 1);
  lua_setfield(L, LUA_REGISTRYINDEX, WARNED_KEY);
  lua_pushfstring(L, "start method \"fork\" in a process with %d threads: "
                     "the workers are forks of this one thread only, and a "
                     "lock another thread holds (malloc, stdio, the host's) "
                     "stays locked in them; use start method \"spawn\" or "
                     "\"forkserver\", which are safe in threaded hosts", n);
  mp_warning(L, lua_tostring(L, -1));
  lua_pop(L, 1);
}

/* A child that allocates past the collector's debt runs a step, which
** writes to every object it marks or sweeps: in a fork each such page of
** the parent's heap is a page fault (a trivial worker took ~47 more, in
** every other round of starts).  So the children get at least CREDIT KB
** to start in: a step due within that is taken here, once, in the parent
** (the first call adds CREDIT KB to the debt and steps if that makes it
** due), else the debt is put back as it was (the second call).  Never
** when the host stopped the collector, which a step would override. */
#define CREDIT 8
static void collect_credit(lua_State *L) {
  if (!lua_gc(L, LUA_GCISRUNNING)) return;
  lua_gc(L, LUA_GCSTEP, CREDIT);
  lua_gc(L, LUA_GCSTEP, -CREDIT);
}

/* What each child finds in its registry, made once here: its identity
** and its ledger (a child that made its own, or entered one, would write
** to pages of the heap it shares with us, each a page fault).  At 'at':
** the values to leave there; on return, the values they replaced. */
static void swap_in_place(lua_State *L, int at) {
  mp_swap_registry(L, MP_WORKER_KEY, at);
  mp_swap_registry(L, MP_LEDGER_KEY, at + 1);
}

static int fork_start(lua_State *L, mp_Context *ctx, int ctxidx, int fn,
                      int args) {
  mp_Detach d;
  int gate[2] = {-1, -1};
  int i, id, err = 0;
  (void)ctxidx;  /* a fork keeps nothing: the child has it all */
  /* once for all the children: handlers, mask, threads, the kernel */
  mp_detach_learn(&d, ctx->lifeline[0]);
  warn_if_threaded(L, d.threads);
  mp_title_prepare(L);  /* the children set their titles without /proc */
  if (host_may_reap() && pipe2(gate, O_CLOEXEC) != 0)
    return mp_push_errno(L, "pipe", errno);
  mp_worker_identity_new(L, ctx->daemon);             /* id */
  id = lua_gettop(L);
  mp_ledger_new(L, ctx->reports.fd);                  /* id ledger */
  collect_credit(L);
  mp_settle_heap();  /* after the step, which frees */
  swap_in_place(L, id);                               /* old_id old_ledger */
  /* Anything still buffered would otherwise be printed by every child. */
  fflush(NULL);
  for (i = ctx->first; i < ctx->last && err == 0; i++) {
    mp_Worker *w = &ctx->workers[i];
    pid_t pid = fork();
    if (pid < 0) {
      err = mp_push_errno(L, "fork", errno);
      break;
    }
    if (pid == 0) {
      mp_ReportTo to;
      /* Only the parent may hold the write end: our lifeline takes its
      ** place (one dup3, no close), once it listens. */
      int slot = ctx->lifeline[1];
      ctx->lifeline[0] = ctx->lifeline[1] = -1;
      mp_worker_detach(&d, slot);
      if (gate[0] >= 0) {
        close(gate[1]);
        wait_at_gate(gate[0]);
      }
      to.fd = ctx->reports.fd;
      to.sock = ctx->reports.peer;
      to.table = ctx->reports.table;  /* inherited: marks are stores */
      mp_worker_run(L, fn, args, ctx->chans, i, ctx->nprocs, &to, &d);
    }
    /* No setpgid(pid, pid) here: until the child has made its group, the
    ** group holds nobody (its id is the child's pid, which nobody else can
    ** hold), and what we signal reaches the child through its pidfd. */
    w->pid = pid;
    mp_started(ctx, i);
    w->pidfd = pidfd_open(pid, 0);
    if (w->pidfd < 0) {
      err = mp_push_errno(L, "pidfd_open", errno);
      mp_discard(w);
    }
  }
  if (gate[0] >= 0) {
    close(gate[0]);
    close(gate[1]);
  }
  swap_in_place(L, id);                               /* id ledger [error] */
  lua_remove(L, id);
  lua_remove(L, id);                                  /* [error] */
  return err;
}

const mp_StartMethod mp_start_fork = {"fork", fork_start};
