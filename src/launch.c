/*
** launch.c -- what the fresh-interpreter start methods ("spawn",
** "forkserver") share: the worker's descriptors, the one start sequence
** (mp_start_fresh) around each method's own launch, and starting an executable the way an embedded library must: safe
** in a threaded host, holding its pidfd from the first instant.
**
** clone(CLONE_VM | CLONE_VFORK) then execve, as posix_spawn does: no page
** tables are copied and the parent waits only until the exec.  Unlike
** posix_spawn we also get CLONE_PIDFD: the pidfd is created with the
** process, so there is no window in which the pid could be reaped and
** reused before we hold it.  The clone asks for exit signal 0, but execve
** resets a process's exit signal to SIGCHLD: a spawned worker (and the
** forkserver, and its CLONE_PARENT workers) does raise SIGCHLD in the host,
** and a host that reaps with waitpid(-1) or ignores SIGCHLD may take its
** status.  That is why every worker records its own exit status in its
** report slot (worker.c, reports.c), which join reads when the kernel kept
** none on the pidfd.
**
** The child shares our memory until it execs, so it may only make raw
** system calls: no malloc, no locks, no glibc wrappers that keep state
** (and none that a sanitizer intercepts).  It writes errno into the
** parent's TLS, which the parent restores.
*/
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mp.h"

/* --- what spawn and forkserver share ------------------------------------- */

int mp_worker_fds(const mp_Context *ctx, const mp_Payload *p, int *fds) {
  size_t i;
  fds[MP_WFD_PAYLOAD] = p->fd;
  fds[MP_WFD_REPORTS] = ctx->reports.fd;
  fds[MP_WFD_RSOCK] = ctx->reports.peer;
  fds[MP_WFD_LIFELINE] = ctx->lifeline[0];
  for (i = 0; i < p->nfds; i++) fds[MP_WFD_NFIXED + i] = p->fds[i];
  return MP_WFD_NFIXED + (int)p->nfds;
}

int mp_start_fresh(lua_State *L, mp_Context *ctx, int ctxidx, int fn,
                   int args, mp_FreshLaunch launch) {
  int top = lua_gettop(L), nfds, err;
  mp_Payload *p = mp_payload_get(L, ctxidx);             /* payload */
  int *fds;
  (void)fn;  /* in the payload */
  (void)args;
  if (p == NULL) {
    lua_pushliteral(L, "the context has no payload for its workers");
    lua_replace(L, top + 1);                             /* msg */
    return EINVAL;
  }
  fds = lua_newuserdatauv(L, sizeof(int) * (MP_WFD_NFIXED + p->nfds),
                          0);                            /* payload fds */
  nfds = mp_worker_fds(ctx, p, fds);
  mp_push_program(L);                                    /* payload fds exe */
  fflush(NULL);  /* our buffered output first, as it would be without us */
  err = launch(L, ctx, top + 3, fds, nfds);              /* ... [msg] */
  if (err != 0) lua_replace(L, top + 1);                 /* msg ... */
  lua_settop(L, top + (err != 0));                       /* [msg] */
  return err;
}

/* --- clone and exec ------------------------------------------------------ */

#define STACK_SIZE (64 * 1024)   /* the child only makes system calls */

/* The kernel's struct sigaction.  Only the handler is read, and it comes
** first in every layout; the rest is room enough for any of them.  All
** zeros is SIG_DFL with no flags and an empty mask. */
typedef struct KSigaction {
  void *handler;
  unsigned long rest[8];
} KSigaction;

#define KSIGSET_SIZE 8   /* _NSIG / 8: what the kernel's rt_sig* expect */

typedef struct Child {
  const char *exe;
  char *const *argv, *const *envp;
  const int *fds;         /* become 3, 4, ... in the new program */
  int nfds;
  uint64_t handled;       /* bit sig-1: the parent catches sig */
  int tmp[MP_LAUNCH_MAXFDS];
  volatile int err;       /* set by the child when it cannot exec */
} Child;

/* A handler of ours must not run in the child while it shares our memory,
** and the child unblocks signals just before its exec: the handlers the
** parent had when it learnt them are reset (ignored signals stay ignored,
** as across exec).  A handler installed since, by another thread, could
** still run only for a signal pending in the child (nobody else knows its
** pid yet, and its group is its own): then every caught signal is reset,
** each read first, as posix_spawn does for all of them. */
__attribute__((no_sanitize("address", "undefined")))
static void reset_handlers(uint64_t handled) {
  static const KSigaction dfl;  /* zeros: SIG_DFL; read-only */
  uint64_t pending = 0;
  int sig;
  for (sig = 1; handled != 0 && sig <= 64; sig++, handled >>= 1)
    if (handled & 1)
      syscall(SYS_rt_sigaction, sig, &dfl, NULL, KSIGSET_SIZE);
  if (syscall(SYS_rt_sigpending, &pending, KSIGSET_SIZE) == 0 &&
      pending == 0)
    return;
  for (sig = 1; sig < NSIG; sig++) {
    KSigaction old;
    old.handler = SIG_DFL;
    if (syscall(SYS_rt_sigaction, sig, NULL, &old, KSIGSET_SIZE) == 0 &&
        old.handler != (void *)SIG_DFL && old.handler != (void *)SIG_IGN)
      syscall(SYS_rt_sigaction, sig, &dfl, NULL, KSIGSET_SIZE);
  }
}

/* fds[i] -> 3 + i, without close-on-exec.  A source may sit on another's
** target, so everything is first copied above all of them (close-on-exec:
** the copies vanish at exec), then moved down. */
__attribute__((no_sanitize("address", "undefined")))
static int place_fds(Child *c) {
  long top = 3 + c->nfds;
  int i;
  for (i = 0; i < c->nfds; i++)
    if (c->fds[i] >= top) top = c->fds[i] + 1;
  for (i = 0; i < c->nfds; i++) {
    long fd = syscall(SYS_fcntl, c->fds[i], F_DUPFD_CLOEXEC, top);
    if (fd < 0) return -1;
    c->tmp[i] = (int)fd;
  }
  for (i = 0; i < c->nfds; i++)
    if (syscall(SYS_dup3, c->tmp[i], 3 + i, 0) < 0) return -1;
  return 0;
}

__attribute__((no_sanitize("address", "undefined")))
static int child_main(void *arg) {
  Child *c = arg;
  static const uint64_t none = 0;
  /* Our own process group: Ctrl-C at the terminal reaches the parent only,
  ** and killpg(pid) takes the worker's own children too. */
  syscall(SYS_setpgid, 0, 0);
  reset_handlers(c->handled);
  if (place_fds(c) == 0) {
    /* Only what the protocol passes crosses: the parent's other
    ** descriptors (Lua's io.open files, a host's sockets) close at exec, as
    ** in Python's spawn.  (Linux >= 5.11; before, they are inherited.) */
    syscall(SYS_close_range, 3 + c->nfds, ~0U, CLOSE_RANGE_CLOEXEC);
    /* The parent blocked everything around clone; the new program starts
    ** with an empty mask (a join may have been blocking SIGINT). */
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, KSIGSET_SIZE);
    syscall(SYS_execve, c->exe, c->argv, c->envp);
  }
  c->err = errno ? errno : ENOEXEC;
  syscall(SYS_exit_group, 127);
  return 127;
}

/* The child's stack, one per Lua state (kept in its registry) and reused
** by every launch: the child runs on it only until its exec, while the
** launching thread waits (CLONE_VFORK), so one launch at a time uses it.
** A stack mapped afresh for each launch cost every worker a first-touch
** page fault, an mmap and an munmap (whose TLB flush must also reach the
** CPU the child ran on, with our memory). */
#define STACK_KEY "multiprocessing.launch_stack"

static int stack_gc(lua_State *L) {
  void **stack = lua_touserdata(L, 1);
  if (*stack != NULL) munmap(*stack, STACK_SIZE);
  *stack = NULL;
  return 0;
}

/* Maps the stack and registers it; through lua_pcall, so that a memory
** error is a failed launch, not an error raised in the middle of one. */
static int new_stack(lua_State *L) {
  void **stack = lua_newuserdatauv(L, sizeof *stack, 0);  /* holder */
  *stack = NULL;
  lua_createtable(L, 0, 1);                               /* holder mt */
  lua_pushcfunction(L, stack_gc);
  lua_setfield(L, -2, "__gc");
  lua_setmetatable(L, -2);                                /* holder */
  *stack = mmap(NULL, STACK_SIZE, PROT_READ | PROT_WRITE,
                MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
  if (*stack == MAP_FAILED) {
    lua_pushinteger(L, errno);
    *stack = NULL;
    return lua_error(L);
  }
  lua_setfield(L, LUA_REGISTRYINDEX, STACK_KEY);          /* */
  return 0;
}

/* The state's stack for a child, or NULL (errno set). */
static void *launch_stack(lua_State *L) {
  void *stack = NULL;
  int err = ENOMEM;
  if (lua_getfield(L, LUA_REGISTRYINDEX, STACK_KEY) != LUA_TUSERDATA) {
    lua_pop(L, 1);                                        /* */
    lua_pushcfunction(L, new_stack);
    if (lua_pcall(L, 0, 0, 0) != LUA_OK) {                /* errno|msg */
      if (lua_isinteger(L, -1)) err = (int)lua_tointeger(L, -1);
      lua_pop(L, 1);
      errno = err;
      return NULL;
    }
    lua_getfield(L, LUA_REGISTRYINDEX, STACK_KEY);        /* holder */
  }
  stack = *(void **)lua_touserdata(L, -1);
  lua_pop(L, 1);                                          /* */
  return stack;
}

/* Waits for a child that failed before exec (it exits at once). */
static void reap_failed(pid_t pid, int pidfd) {
  siginfo_t si;
  mp_wait_child(pid, pidfd, &si, 0);
  close(pidfd);
}

int mp_launch(lua_State *L, const char *exe, char *const argv[],
              char *const envp[], const int *fds, int nfds,
              uint64_t handled, pid_t *pid, int *pidfd) {
  int saved_errno = errno, err;
  sigset_t all, old;
  Child c;
  void *stack;
  *pid = 0;
  *pidfd = -1;
  if (nfds > MP_LAUNCH_MAXFDS)
    return mp_push_errno(L, "cannot start a process with so many descriptors",
                         EMFILE);
  c.exe = exe;
  c.argv = argv;
  c.envp = envp;
  c.fds = fds;
  c.nfds = nfds;
  c.handled = handled;
  c.err = 0;
  stack = launch_stack(L);
  if (stack == NULL) return mp_push_errno(L, "mmap", errno);
  /* No handler of ours may run in the child before it resets them. */
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  *pid = clone(child_main, (char *)stack + STACK_SIZE,
               CLONE_VM | CLONE_VFORK | CLONE_PIDFD /* | exit signal 0 */,
               &c, pidfd);
  err = *pid < 0 ? errno : 0;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  errno = saved_errno;  /* the child wrote it */
  if (err != 0) {
    *pid = 0;
    *pidfd = -1;
    return mp_push_errno(L, "clone", err);
  }
  if (c.err != 0) {
    err = c.err;
    reap_failed(*pid, *pidfd);
    *pid = 0;
    *pidfd = -1;
    lua_pushfstring(L, "cannot start %s: %s", exe, strerror(err));
    return err;
  }
  return 0;
}
