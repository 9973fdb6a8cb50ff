/*
** forkserver.c -- the "forkserver" start method.
**
** A small server process per lua_State, started on first use (and again
** when it has died), runs the worker executable with nothing but the core
** loaded.  For each context the parent sends ONE request over a
** SOCK_SEQPACKET socketpair: a header and, as SCM_RIGHTS, the payload
** memfd (payload.c), the reports memfd, the workers' end of the reports'
** socket and the codec's descriptors.  The
** server decodes the payload once, in a fresh lua_State that it closes
** afterwards (so the server stays clean however many modules a request
** loads), then creates each worker with clone3(CLONE_PARENT | CLONE_PIDFD):
**   - CLONE_PARENT makes the worker a child of the USER process: join.c
**     waits for and reaps it like any other worker, and the context's
**     lifeline (worker.c) ties it to the user process;
**   - with CLONE_PARENT the kernel gives the worker the server's own exit
**     signal, SIGCHLD (an exec resets it): a host's waitpid(-1) may reap
**     it, and the worker's own exit record (reports.c) tells join how it
**     ended;
**   - without CLONE_VM it is a fork of a single-threaded server: safe.
** The server answers with the pid and the pidfd of each worker.
**
** A new server first says hello (one byte): an executable that does not
** run the protocol fails the start naming itself (executable.c).  When the
** server runs in a host binary (lmp_worker_main, multiprocessing.h), each
** request's state is opened with the host's openlibs, so the workers have
** the host's modules.
**
** The server exits on EOF of its socket, which the parent process holds
** (not PDEATHSIG: that follows the thread that started the server).  The
** parent holds the socket and the server's pidfd in a userdata in the
** registry, whose __gc kills and reaps the server: closing the state
** leaves neither a zombie nor a running server.
*/
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "lualib.h"
#include "mp.h"
#include "sharing.h"
#include "multiprocessing.h"

#define SERVER_KEY "multiprocessing.forkserver"
#define SERVER_T   "multiprocessing.ForkServer"
#define REQ_MAGIC  0x4c4d5046u

LUAMOD_API int luaopen_multiprocessing_core(lua_State *L);

typedef struct Request {
  uint32_t magic;
  int32_t nprocs;      /* how many workers: ranks first..first+nprocs-1 */
  int32_t first;
  int32_t parent;      /* the user process: the workers' parent */
  uint32_t nfds;       /* mp_worker_fds: MP_WFD_NFIXED, then the codec's */
  uint32_t main_thread;  /* the server was started by the parent's main
                            thread, the workers' parent (CLONE_PARENT) for
                            PR_SET_PDEATHSIG */
  uint32_t pad;
} Request;

typedef struct Reply {
  int32_t rank;
  int32_t pid;
  int32_t err;         /* errno of clone3, or 0 with the pidfd attached */
  int32_t pad;
} Reply;

/* --- descriptors over the socket ----------------------------------------- */

/* One whole message with its descriptors (fdpass.c); 0 or an errno. */
static int send_msg(int sock, const void *buf, size_t len, const int *fds,
                    size_t nfds) {
  ssize_t r = mp_sendfds(sock, buf, len, fds, nfds, 0);
  if (r < 0) return (int)-r;
  return (size_t)r == len ? 0 : EMSGSIZE;
}

/* Receives one message; up to *nfds descriptors go to fds, and *nfds says
** how many came.  The byte count, 0 at EOF, or -errno: -EPROTO when the
** descriptors were dropped (the data still came). */
static ssize_t recv_msg(int sock, void *buf, size_t len, int *fds,
                        size_t *nfds) {
  return mp_recvfds(sock, buf, len, fds, *nfds, nfds, 0);
}

static void close_all(int *fds, size_t n) {
  size_t i;
  for (i = 0; i < n; i++)
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
}

/* --- the server ---------------------------------------------------------- */

/* glibc keeps the thread id in struct pthread and registers the robust
** mutex list with the kernel per thread.  A raw clone3 child has neither:
** the kernel clears its robust list, and glibc's cached tid is the
** server's.  Robust mutexes (the sharing layer's Lock) need both for a
** worker that dies holding one to be recovered.  So the child empties and
** registers the list again (same address in its copy), as glibc's fork
** does, and CLONE_CHILD_SETTID has the kernel write the child's tid into
** glibc's field.  In glibc 2.36 (and
** since 2.25), struct pthread has
**     pid_t tid; pid_t pid_ununsed; void *robust_prev;
**     struct robust_list_head robust_head;   <- what the kernel holds
** so the tid lies 2 * sizeof(pid_t) + sizeof(void *) before the head.  That
** is checked against gettid() at start; when the check fails, workers are
** still created, but a robust lock held by a worker that dies may not be
** recovered in forkserver workers. */
typedef struct Robust {
  void *head;
  size_t len;
  pid_t *tid;          /* glibc's tid field, or NULL when not found */
} Robust;

static void find_robust(Robust *rb) {
  rb->head = NULL;
  rb->len = 0;
  rb->tid = NULL;
  if (syscall(SYS_get_robust_list, 0, &rb->head, &rb->len) != 0 ||
      rb->head == NULL) {
    rb->head = NULL;
    return;
  }
  {
    pid_t *tid = (pid_t *)(void *)((char *)rb->head - 2 * sizeof(pid_t) -
                                   sizeof(void *));
    if (*tid == (pid_t)syscall(SYS_gettid)) rb->tid = tid;
  }
}

/* struct clone_args of linux/sched.h (CLONE_ARGS_SIZE_VER0) */
typedef struct CloneArgs {
  uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack,
           stack_size, tls;
} CloneArgs;

static pid_t clone_worker(int *pidfd, const Robust *rb) {
  CloneArgs ca;
  memset(&ca, 0, sizeof ca);
  ca.flags = CLONE_PARENT | CLONE_PIDFD |
             (rb->tid != NULL ? CLONE_CHILD_SETTID : 0);
  ca.pidfd = (uint64_t)(uintptr_t)pidfd;
  ca.child_tid = (uint64_t)(uintptr_t)rb->tid;
  ca.exit_signal = 0;  /* CLONE_PARENT: the kernel uses the server's */
  return (pid_t)syscall(SYS_clone3, &ca, sizeof ca);
}

typedef struct Job {
  int sock;
  const Request *rq;
  int *fds;            /* mp_worker_fds (mp_WorkerFd) */
  size_t nfds;
  const Robust *rb;
  lmp_Openlibs openlibs;  /* the host's (lmp_worker_main), or NULL */
} Job;

/* In the new worker: leave the server's descriptors, then run fn. */
static void worker_child(lua_State *sub, const Job *job, int rank)
    __attribute__((noreturn));
static void worker_child(lua_State *sub, const Job *job, int rank) {
  const Robust *rb = job->rb;
  mp_ReportTo to;
  mp_Detach d;
  if (rb->head != NULL) {
    /* As glibc's fork does: the child owns none of the server's mutexes
    ** (the server holds, e.g., its peer slots of the channels it decoded),
    ** so its list starts empty.  Inheriting the server's list would let the
    ** child's first lock rewrite, in shared memory, the links of a mutex
    ** the server holds, and corrupt the server's own list. */
    *(void **)rb->head = rb->head;          /* robust_head.list = &head */
    if (rb->tid != NULL)                    /* the layout was verified */
      ((void **)rb->head)[-1] = rb->head;   /* robust_prev */
    syscall(SYS_set_robust_list, rb->head, rb->len);
  }
  close(job->sock);
  close(job->fds[MP_WFD_PAYLOAD]);
  /* our parent is the user's */
  mp_detach_fresh(&d, (pid_t)job->rq->parent, job->fds[MP_WFD_LIFELINE],
                  (int)job->rq->main_thread);
  d.handled = 0;   /* the server has no handler (SIGINT: see main) */
  mp_worker_detach(&d, -1);
  job->fds[MP_WFD_LIFELINE] = -1;
  to.fd = job->fds[MP_WFD_REPORTS];
  to.sock = job->fds[MP_WFD_RSOCK];
  to.table = NULL;  /* marks are written with pwrite */
  mp_worker_run(sub, 1, 2, 3, rank, job->rq->nprocs, &to, &d);
}

/* Protected, in the request's own state: the payload -> fn, args, and the
** set of the channels they hold, collected once for all the workers, who
** also find their identity (the payload's) and their ledger in place. */
static int prepare(lua_State *L) {
  Job *job = lua_touserdata(L, 1);
  lua_pop(L, 1);
  if (job->openlibs != NULL)
    job->openlibs(L);
  else
    luaL_openlibs(L);
  luaL_requiref(L, "multiprocessing.core", luaopen_multiprocessing_core, 0);
  lua_pop(L, 1);
  mp_payload_load(L, job->fds[MP_WFD_PAYLOAD], job->fds + MP_WFD_NFIXED,
                  job->nfds - MP_WFD_NFIXED);                 /* fn args */
  mp_sharing_collect(L, 1, 2);                                /* fn args chans */
  mp_ledger_new(L, job->fds[MP_WFD_REPORTS]);           /* fn args chans ledger */
  lua_setfield(L, LUA_REGISTRYINDEX, MP_LEDGER_KEY);          /* fn args chans */
  return 3;
}

static int reply(const Job *job, int rank, pid_t pid, int err, int pidfd) {
  Reply r;
  memset(&r, 0, sizeof r);
  r.rank = rank;
  r.pid = pid;
  r.err = err;
  return send_msg(job->sock, &r, sizeof r, &pidfd, err == 0 ? 1 : 0);
}

static void serve(const Job *job) {
  lua_State *sub = luaL_newstate();
  int i;
  if (sub == NULL) {
    reply(job, 0, 0, ENOMEM, -1);
    return;
  }
  lua_pushcfunction(sub, prepare);
  lua_pushlightuserdata(sub, (void *)(size_t)job);
  if (lua_pcall(sub, 1, 3, 0) != LUA_OK) {
    reply(job, 0, 0, ENOMEM, -1);
    lua_close(sub);
    return;
  }
  fflush(NULL);  /* whatever loading printed must not be printed n times */
  mp_title_prepare(sub);  /* the workers set their titles without /proc */
  for (i = job->rq->first; i < job->rq->first + job->rq->nprocs; i++) {
    int pidfd = -1, err;
    pid_t pid = clone_worker(&pidfd, job->rb);
    if (pid == 0) worker_child(sub, job, i);
    err = pid < 0 ? errno : 0;
    if (reply(job, i, pid, err, pidfd) != 0) err = -1;
    if (pid > 0) close(pidfd);
    if (err != 0) break;
  }
  lua_close(sub);
}

static int valid_request(const Request *rq, ssize_t r, size_t nfds) {
  return r == (ssize_t)sizeof *rq && rq->magic == REQ_MAGIC &&
         rq->nprocs > 0 && rq->first >= 0 &&
         rq->first <= INT32_MAX - rq->nprocs &&
         rq->nfds >= MP_WFD_NFIXED && rq->nfds == nfds;
}

/* _forkserver_main(sock, parent_pid): the server's loop; never returns. */
static int l_forkserver_main(lua_State *L) {
  int sock = (int)luaL_checkinteger(L, 1);
  pid_t parent = (pid_t)luaL_checkinteger(L, 2);
  Robust rb;
  lmp_Openlibs openlibs = NULL;
  mp_boot_done();
  if (getppid() != parent) _exit(1);
  lua_pushfstring(L, "lua forkserver for %d", (int)parent);
  mp_title_set(L, lua_tostring(L, -1), lua_rawlen(L, -1));
  lua_pop(L, 1);
  if (lua_getfield(L, LUA_REGISTRYINDEX, LMP_OPENLIBS_KEY) == LUA_TUSERDATA)
    openlibs = *(lmp_Openlibs *)lua_touserdata(L, -1);
  lua_pop(L, 1);
  /* lua.c catches SIGINT while a chunk runs; the server has no use for it
  ** (it is in its own process group) and workers reset it anyway. */
  signal(SIGINT, SIG_DFL);
  fcntl(sock, F_SETFD, FD_CLOEXEC);
  find_robust(&rb);
  if (write(sock, "", 1) != 1) _exit(1);  /* hello */
  for (;;) {
    Request rq;
    int fds[MP_MAXFDS];
    size_t nfds = MP_MAXFDS;
    ssize_t r = recv_msg(sock, &rq, sizeof rq, fds, &nfds);
    Job job;
    if (r == 0) _exit(0);  /* the parent closed its end */
    if (r < 0 && r != -EPROTO) _exit(1);
    job.sock = sock;
    job.rq = &rq;
    job.fds = fds;
    job.nfds = nfds;
    job.rb = &rb;
    job.openlibs = openlibs;
    if (r > 0 && valid_request(&rq, r, nfds))
      serve(&job);
    else if (reply(&job, 0, 0, EPROTO, -1) != 0)
      _exit(1);
    close_all(fds, nfds);
  }
}

/* --- the parent ---------------------------------------------------------- */

typedef struct Server {
  int sock;            /* -1 when not running */
  int pidfd;
  pid_t pid;
  pid_t owner;         /* the process that started it (fork copies this) */
  int main_thread;     /* started by the owner's main thread */
} Server;

/* Kills and reaps the server; returns how it ended, as join.c counts exit
** codes (-signal), or MP_EXIT_UNKNOWN. */
static int server_stop(Server *s) {
  int code = MP_EXIT_UNKNOWN;
  /* A forked copy of this state must not touch its parent's server. */
  if (s->pid > 0 && s->owner == getpid()) {
    siginfo_t si;
    /* By pid when pidfds cannot signal (valgrind): the server is our
    ** unreaped child, so its pid is still its own. */
    if (pidfd_send_signal(s->pidfd, SIGKILL, NULL, 0) != 0)
      kill(s->pid, SIGKILL);
    if (mp_wait_child(s->pid, s->pidfd, &si, 0) == 0)
      code = mp_exit_code(&si);
  }
  if (s->sock >= 0) close(s->sock);
  if (s->pidfd >= 0) close(s->pidfd);
  s->sock = s->pidfd = -1;
  s->pid = 0;
  return code;
}

static int server_gc(lua_State *L) {
  server_stop(luaL_checkudata(L, 1, SERVER_T));
  return 0;
}

/* Pushes this state's server handle (not necessarily running). */
static Server *push_server(lua_State *L) {
  Server *s;
  if (lua_getfield(L, LUA_REGISTRYINDEX, SERVER_KEY) == LUA_TUSERDATA)
    return luaL_checkudata(L, -1, SERVER_T);
  lua_pop(L, 1);
  s = lua_newuserdatauv(L, sizeof *s, 1);
  s->sock = s->pidfd = -1;
  s->pid = s->owner = 0;
  if (luaL_newmetatable(L, SERVER_T)) {
    lua_pushcfunction(L, server_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, SERVER_KEY);
  return s;
}

static int server_dead(const Server *s) {
  struct pollfd p;
  p.fd = s->pidfd;
  p.events = POLLIN;
  p.revents = 0;
  return poll(&p, 1, 0) != 0;  /* readable: it exited */
}

/* Starts the server of the handle at 'si' with the executable at 'ei'. */
static int server_start(lua_State *L, Server *s, int si, int ei) {
  char call[64], *argv[4], **envp;
  int sv[2], err;
  pid_t pid;
  int pidfd;
  mp_Detach d;  /* our handlers, which its launch resets */
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
    return mp_push_errno(L, "socketpair", errno);
  mp_detach_learn(&d, -1);
  snprintf(call, sizeof call, "_forkserver_main(3,%ld)", (long)d.parent);
  envp = mp_push_argv(L, ei, call, argv);                 /* envp */
  err = mp_launch(L, argv[0], argv, envp, &sv[1], 1, d.handled, &pid,
                  &pidfd);
  close(sv[1]);
  if (err != 0) {
    close(sv[0]);
    lua_remove(L, -2);
    lua_pushfstring(L, "cannot start the forkserver: %s", lua_tostring(L, -1));
    lua_remove(L, -2);
    return err;
  }
  lua_pop(L, 1);
  s->sock = sv[0];
  s->pidfd = pidfd;
  s->pid = pid;
  s->owner = d.parent;
  s->main_thread = d.main_thread;
  if ((err = mp_await_hello(L, s->sock, lua_tostring(L, ei))) != 0) {
    server_stop(s);
    return err;
  }
  lua_pushvalue(L, ei);
  lua_setiuservalue(L, si, 1);
  return 0;
}

/* The server runs, with the executable at 'ei', and is ours. */
static int server_ensure(lua_State *L, Server *s, int si, int ei) {
  if (s->pid > 0) {
    int same_exe;
    lua_getiuservalue(L, si, 1);
    same_exe = lua_rawequal(L, -1, ei);
    lua_pop(L, 1);
    if (s->owner != getpid() || !same_exe || server_dead(s))
      server_stop(s);
  }
  return s->pid > 0 ? 0 : server_start(L, s, si, ei);
}

static int send_request(Server *s, mp_Context *ctx, const int *fds,
                        int nfds) {
  Request rq;
  rq.magic = REQ_MAGIC;
  rq.nprocs = ctx->last - ctx->first;
  rq.first = ctx->first;
  rq.parent = (int32_t)getpid();
  rq.nfds = (uint32_t)nfds;
  rq.main_thread = (uint32_t)s->main_thread;
  rq.pad = 0;
  return send_msg(s->sock, &rq, sizeof rq, fds, (size_t)nfds);
}

/* The pidfd of worker 'rank' did not fit (we are out of descriptors): it
** and every worker the server starts after it are killed and reaped by pid
** (they are our children), so that none is left behind. */
static int lost_pidfd(lua_State *L, mp_Context *ctx, Server *s, int rank,
                      pid_t pid) {
  int i = rank;
  for (;;) {
    mp_Worker *w = &ctx->workers[i];
    Reply r;
    int fd = -1;
    size_t nfds = 1;
    ssize_t n;
    w->pid = pid;
    w->pidfd = -1;
    mp_started(ctx, i);
    mp_discard(w);
    if (++i == ctx->last) break;
    memset(&r, 0, sizeof r);
    n = recv_msg(s->sock, &r, sizeof r, &fd, &nfds);
    if (nfds == 1) close(fd);
    if ((n != (ssize_t)sizeof r && n != -EPROTO) || r.rank != i ||
        r.pid <= 0)
      break;
    pid = (pid_t)r.pid;
  }
  return mp_push_errno(L, lua_pushfstring(L, "cannot receive the pidfd of "
                       "process %d from the forkserver", rank), EMFILE);
}

/* Records each worker as its reply comes.  A server that stops answering
** or answers nonsense is stopped: the next start gets a fresh one. */
static int read_replies(lua_State *L, mp_Context *ctx, Server *s) {
  int i;
  for (i = ctx->first; i < ctx->last; i++) {
    mp_Worker *w = &ctx->workers[i];
    Reply r;
    int fd = -1;
    size_t nfds = 1;
    ssize_t n;
    memset(&r, 0, sizeof r);
    n = recv_msg(s->sock, &r, sizeof r, &fd, &nfds);
    if (n == -EPROTO && r.rank == i && r.pid > 0 && r.err == 0)
      return lost_pidfd(L, ctx, s, i, (pid_t)r.pid);
    if (n == (ssize_t)sizeof r && r.rank == i && r.err != 0 && nfds == 0) {
      lua_pushfstring(L, "the forkserver cannot start process %d: %s", i,
                      strerror(r.err));
      return r.err;
    }
    if (n != (ssize_t)sizeof r || r.rank != i || r.pid <= 0 || nfds != 1) {
      int code;
      if (nfds == 1) close(fd);
      code = server_stop(s);
      if (n == 0 && code < 0 && code != MP_EXIT_UNKNOWN)
        lua_pushfstring(L, "the forkserver died of signal %d while starting "
                           "process %d", -code, i);
      else if (n == 0)
        lua_pushfstring(L, "the forkserver exited (code %d) while starting "
                           "process %d", code, i);
      else
        lua_pushfstring(L, "bad answer from the forkserver for process %d", i);
      return n < 0 ? (int)-n : EPROTO;
    }
    w->pid = (pid_t)r.pid;
    w->pidfd = fd;
    mp_started(ctx, i);
    /* It is our child: its own group already, or now, before anybody
    ** signals the group (as fork does). */
    setpgid(w->pid, w->pid);
  }
  return 0;
}

/* Has the server (started or restarted as needed) fork every worker. */
static int forkserver_launch(lua_State *L, mp_Context *ctx, int ei,
                             const int *fds, int nfds) {
  int si, err, attempt;
  Server *s = push_server(L);                             /* ... server */
  si = lua_gettop(L);
  if (nfds > MP_MAXFDS)
    return mp_push_errno(L, "the args carry too many descriptors for one "
                            "message to the forkserver", E2BIG);
  for (attempt = 0; ; attempt++) {
    err = server_ensure(L, s, si, ei);
    if (err != 0) return err;
    err = send_request(s, ctx, fds, nfds);
    if (err == 0) return read_replies(L, ctx, s);
    /* A server that died since we looked: one more try with a new one. */
    server_stop(s);
    if (attempt > 0 || (err != EPIPE && err != ECONNRESET))
      return mp_push_errno(L, "cannot send the request to the forkserver",
                           err);
  }
}

static int forkserver_start(lua_State *L, mp_Context *ctx, int ctxidx,
                            int fn, int args) {
  return mp_start_fresh(L, ctx, ctxidx, fn, args, forkserver_launch);
}

const mp_StartMethod mp_start_forkserver = {"forkserver", forkserver_start};

/* _forkserver_info() -> {pid=, fds={sock, pidfd}} of this state's running
** server, or nil: for tests that account for every process and fd. */
static int l_forkserver_info(lua_State *L) {
  Server *s = push_server(L);
  if (s->pid <= 0 || s->owner != getpid()) return 0;
  lua_createtable(L, 0, 2);
  lua_pushinteger(L, s->pid);
  lua_setfield(L, -2, "pid");
  lua_createtable(L, 2, 0);
  lua_pushinteger(L, s->sock);
  lua_rawseti(L, -2, 1);
  lua_pushinteger(L, s->pidfd);
  lua_rawseti(L, -2, 2);
  lua_setfield(L, -2, "fds");
  return 1;
}

void mp_open_forkserver(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"_forkserver_main", l_forkserver_main},
    {"_forkserver_info", l_forkserver_info}, {NULL, NULL}
  };
  luaL_setfuncs(L, funcs, 0);
}
