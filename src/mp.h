/*
** mp.h -- what the files of multiprocessing.core share, and the map of
** every source file: open the one named for what you are after.
**
** The module
**   core.c         the module table: opens every part from one list;
**                  mp_new_class and the small helpers every part uses (the
**                  state's mp_self page among them)
**   args.c         argument errors that name "Type.method"; timeouts
**   sys.c, sys.h   the clock, whole writes and marks, which process we are
**                  (a page a fork's child gets zeroed), malloc settled before
**                  a fork, with no Lua (also compiled into the launcher module)
**   mp.h           this map; what the process files share
**   sharing.h      what the data-sharing files share: segments, waits,
**                  locks, peer slots
**   codec.h        the codec's contract, and how a userdata type crosses
**   multiprocessing.h  the C API for hosts that embed Lua: a host binary
**                  as its own worker (lmp_worker_main); installed
**
** Processes
**   context.c      start_processes, spawn, ProcessContext, Process handles,
**                  active_children, current_process
**   join.c         the supervision engine: waiting for workers (pidfds),
**                  the one ending (SIGTERM, grace, SIGKILL) behind join,
**                  close and terminate, never blocking; poll's events; the
**                  exception of the first failure, the results, fileno()
**   proc.c, proc.h process facts: waitid, exit statuses (the pidfd's exit
**                  info too), signalling a worker and its process group
**                  (also compiled into the launcher module)
**   exception.c    ProcessException and its kinds, isinstance; Interrupted
**                  (Ctrl-C in any blocking call: mp_raise_interrupt)
**   reports.c      the memfd where workers leave errors, results and their
**                  exit records, and the socket their descriptors come
**                  through
**   ledger.c       the file_system references a worker holds, for its parent
**   worker.c       the child's side of every method: run fn(i, ...), report,
**                  die with the parent (the lifeline), leave with _exit
**   signames.c     signal numbers <-> names (mp.signals)
**   select.c       mp.wait's one poll(2) over the descriptors of many
**                  objects (lua/multiprocessing/process.lua: the rest)
**   title.c        what ps and top show for a process: its command line and
**                  thread name (core._set_title, a worker's default title)
**
** Start methods
**   start_fork.c   "fork"
**   start_spawn.c  "spawn": a fresh interpreter per worker
**   forkserver.c   "forkserver": a server process that forks fresh workers
**   launch.c       what spawn and forkserver share: the worker's
**                  descriptors, the start sequence, clone+exec
**   executable.c   which program runs fresh workers (set_executable,
**                  get_executable), the line of Lua it starts with, and
**                  its hello
**   payload.c      fn, args and the environment, encoded once for the fresh
**                  workers of a context
**   worker_main.c  the worker program for embedding hosts (not in core.so;
**                  its entry, lmp_worker_main, is multiprocessing.h's)
**
** Data between processes
**   codec.c        Lua values <-> bytes (codec.h); core.encode, core.decode
**   nested.c       a Lua value inside a userdata's encoding (a Barrier's
**                  action, a synchronised Array's lock)
**   fdpass.c       descriptors over unix sockets (SCM_RIGHTS)
**   shm.c          shared memory segments, the sharing strategies, the
**                  file_system tracker
**   array.c        Array and Value
**   channel.c      Queue, SimpleQueue, JoinableQueue, Pipe (Connection)
**   sync.c         Lock, RLock, Semaphore, BoundedSemaphore, Event,
**                  Condition, Barrier; the peer slots of the channels
**   wait.c         every blocking wait: deadlines, futex, Ctrl-C, robust
**                  mutexes, the statuses a wait ends with
**
**   fd.c           Fd: an owned descriptor that crosses to a worker (what
**                  a launcher gives a rank as its stdout)
**   cpus.c         cpu_count: the affinity mask and the cgroup CPU quota
**
** Tools built on the library
**   pool.c         for mp.Pool (pool.lua): the board where workers mark
**                  their task, TimeoutError
**   launcher/      not in core.so: multiprocessing.launcher, mprun's C
**                  (relay, rank stdio, log files, signalfd), built from
**                  this tree beside the core and using its public faces
**                  only (launcher/launcher.h is its map)
**
** The Lua layer is lua/multiprocessing/: init.lua lists the public names,
** grouped by the file that implements them; mprun.lua and world.lua are
** the launcher, cluster.lua what it learns from a cluster's engine.
** README "Layout" maps features to files and to specs.
*/
/*
** Errors: one convention in the C.
**   - A helper that makes system calls and has no Lua state returns 0, or
**     -errno (as libuv does): proc.c, mp_wait_child, mp_signal_worker,
**     mp_watch, mp_sendfds.  Its caller tests r < 0 and reads strerror(-r).
**   - A helper that has a Lua state returns 0, or an errno with a message
**     pushed (mp_push_errno) that names what failed: the start methods,
**     mp_launch, mp_start_fresh, mp_payload_make.  It never raises: its
**     caller decides (a context it started is its own to close).
**   - A function Lua calls raises for misuse, naming the method (args.c:
**     "ProcessContext.restart"), raises the exception objects for worker
**     failures, and returns expected outcomes: nil, "timeout" / "closed",
**     or nil, message for a start that failed (ctx:restart).
** Older helpers that still return a positive errno with no message
** (mp_reports_create, mp_lifeline_create, mp_write_all) say so where they
** are declared.
*/
#ifndef mp_h
#define mp_h

#include <signal.h>
#include <stdint.h>
#include <sys/types.h>
#include "lua.h"
#include "lauxlib.h"
#include "proc.h"
#include "sys.h"

#define MP_CONTEXT_T   "multiprocessing.ProcessContext"
#define MP_PROCESS_T   "multiprocessing.Process"

/* --- one worker of a context --- */
typedef enum { MP_RUNNING, MP_EXITED } mp_WorkerState;

struct mp_Context;

typedef struct mp_Worker {
  struct mp_Context *ctx;  /* the context it belongs to */
  pid_t pid;          /* 0 when never started */
  int pidfd;          /* -1 once reaped (or never opened) */
  mp_WorkerState state;
  int exitcode;       /* exit status, minus the signal number, or
                         MP_EXIT_UNKNOWN when another waiter took it */
  int terminated;     /* we signalled it: its death is not a failure */
  int polled;         /* its end was reported by ctx:poll() */
  double ended_at;    /* mp_now() when it was reaped */
  double kill_at;     /* its own ending (mp_terminate_rank): SIGKILL then;
                         0 when none */
} mp_Worker;

/* --- the workers' reports: errors and results (reports.c) --- */
typedef struct mp_Stashed { int rank, fd; } mp_Stashed;

typedef struct mp_Reports {
  int fd;                 /* a memfd, -1 once closed */
  int sock;               /* our end of the descriptors' socket, or -1 */
  int peer;               /* the workers' end (kept for restarts when there
                             are several workers), or -1 */
  int eof;                /* every worker's end is closed: stop polling */
  mp_Stashed *stash;      /* descriptors that came, until their report is
                             taken (fd -1: some were truncated) */
  size_t nstash, capstash;
  void *table;            /* the memfd's table of marks, mapped (reports.c),
                             or NULL: read the slots to know */
} mp_Reports;

/* Where a worker reports to: the memfd and its end of the socket, and the
** table of marks when it is mapped here (a fork inherits the parent's
** mapping; NULL: marks are written with pwrite). */
typedef struct mp_ReportTo { int fd, sock; void *table; } mp_ReportTo;
/* One word of that table a worker sets is an mp_Mark (sys.h). */

/* A report's kind, in its header in the memfd: explicit values. */
typedef enum mp_ReportKind {
  MP_REPORT_NONE = 0, MP_REPORT_ERROR = 1, MP_REPORT_RESULT = 2
} mp_ReportKind;

/* A report taken by the parent: the bytes (malloc'd) and the descriptors
** that came with them (malloc'd; a decoder sets the ones it takes to -1). */
typedef struct mp_Report {
  char *data;
  size_t size;
  int *fds;
  size_t nfds;
} mp_Report;

int  mp_reports_create(mp_Reports *r);           /* 0 or errno */
void mp_reports_close(mp_Reports *r);            /* idempotent */
/* Moves the descriptors waiting in the socket to the stash, without
** blocking; a worker sending many waits for this (join polls the socket). */
void mp_reports_drain(mp_Reports *r);
/* Reads a worker's report of 'kind' and releases its slot: 1 when there is
** one, 0 when not, or -errno (its descriptors are missing or truncated:
** EPROTO, or out of memory). */
int  mp_reports_take(mp_Reports *r, int rank, int kind, mp_Report *out);
void mp_report_free(mp_Report *rep);   /* closes the descriptors left */
/* A worker's exit status, written by the worker itself as it leaves (an
** exit, os.exit, a fatal signal it can catch), so that a parent whose host
** reaped the worker behind its back still knows how it ended.  put is
** async-signal-safe; get gives MP_EXIT_UNKNOWN when nothing was written. */
void mp_reports_exit_put(const mp_ReportTo *to, int rank, int code);
int  mp_reports_exit_get(const mp_Reports *r, int rank);
/* Where in the memfd the ledger of worker 'rank' is (ledger.c), and the
** mark its first entry sets, so that the parent reads only ledgers that
** were written. */
off_t mp_reports_ledger_at(int rank);
mp_Mark mp_reports_ledger_mark(const mp_ReportTo *to, int rank);
/* Every worker gone: the reports of ranks 0..n-1 nobody took (the results
** of a context that failed or was closed) give back the shared memory and
** descriptors they carry (MP_CODEC_DISCARD). */
void mp_reports_discard(lua_State *L, mp_Reports *r, int n);
/* Every worker gone: gives back what the ledgers of ranks 0..n-1 list. */
void mp_reports_settle(lua_State *L, mp_Reports *r, int n);
/* A context of one worker has started it: the workers' end goes (no other
** worker could need it while this one runs). */
void mp_reports_shed(mp_Reports *r);
/* No worker runs and one starts again: a new socket if the workers' end
** went (the old one's descriptors stay in the stash); 0 or errno. */
int  mp_reports_renew(mp_Reports *r);
/* Worker 'rank' is gone and another starts in its slot: what its reports
** and its ledger held is given back, the descriptors it sent are closed,
** and the slot reads as new. */
void mp_reports_clear(lua_State *L, mp_Reports *r, int rank);
/* Worker side: sends the report's descriptors, then writes it; 0 or errno. */
int  mp_reports_put(const mp_ReportTo *to, int rank, int kind,
                    const char *data, size_t size, const int *fds,
                    size_t nfds);

/* --- a context: the workers of one start_processes call --- */
typedef struct mp_StartMethod mp_StartMethod;

/* How far the termination of a context has gone (join.c): a failure or an
** interrupt starts it, successive polls move it on, never waiting. */
typedef enum {
  MP_END_NONE,      /* no failure seen */
  MP_END_WAIT,      /* a failure: the others get grace_period on their own */
  MP_END_TERM,      /* SIGTERM sent; SIGKILL at 'next_at' */
  MP_END_KILL       /* SIGKILL sent: reaping */
} mp_Ending;

typedef struct mp_Context {
  int nprocs;
  int started;            /* workers 0..started-1 have a pid */
  int first, last;        /* the ranks the start in progress starts:
                             first..last-1 (all, or the one restarted) */
  int chans;              /* ... and the stack index of the channels its
                             fn and args hold (mp_sharing_collect) */
  int daemon;
  int closed;             /* workers reaped and reports closed */
  int shut;               /* close() or collection: fileno() refuses */
  pid_t owner;            /* the process that started the workers */
  const mp_StartMethod *method;
  mp_Reports reports;
  mp_Ending ending;
  int interrupted;        /* SIGINT during a join started the ending */
  double grace;           /* of the ending */
  double next_at;         /* when the ending moves on (INFINITY: never) */
  int watch;              /* fileno(): an epoll of the pidfds, or -1 */
  int timer;              /* a timerfd in 'watch' for next_at, or -1 */
  int watch_sock;         /* reports.sock is in 'watch' */
  int lifeline[2];        /* a pipe: workers die when the write end, held by
                             this process only, closes (worker.c) */
  mp_Worker workers[1];   /* nprocs of them */
} mp_Context;

/* A start method starts workers ctx->first..ctx->last-1 of 'ctx' (at stack
** index 'ctxidx'), each running the function at stack index 'fn' with the
** argument table at 'args'.  It records each worker in ctx->workers[i] and
** marks it with mp_started as it goes; on failure it returns an
** errno-style code with a message pushed, and the caller terminates and
** reaps the ones already started.  A spawn or forkserver start finds the
** payload (payload.c) in the context's uservalue. */
struct mp_StartMethod {
  const char *name;
  int (*start)(lua_State *L, mp_Context *ctx, int ctxidx, int fn, int args);
};

/* Worker 'rank' has a pid now. */
static inline void mp_started(mp_Context *ctx, int rank) {
  if (rank + 1 > ctx->started) ctx->started = rank + 1;
}

extern const mp_StartMethod mp_start_fork;
extern const mp_StartMethod mp_start_spawn;
extern const mp_StartMethod mp_start_forkserver;

/* join.c */
#define MP_DEFAULT_GRACE 30.0
/* Waits up to 'timeout' seconds (< 0: forever).  Returns 1 when every worker
** exited 0, 0 on timeout; on a failure it waits 'grace' for the others when
** 'grace_given', terminates the rest and raises the exception. */
int  mp_join(lua_State *L, mp_Context *ctx, int ctxidx, double timeout,
             double grace, int grace_given);
/* ctx:terminate(grace), never waiting: SIGTERM (and SIGCONT) to every live
** worker and its process group now, SIGKILL to those still alive 'grace'
** seconds later (0: now); later joins, polls and fileno() move it on.
** Again with a shorter grace brings the SIGKILL forward.  The workers it
** ends are not failures. */
void mp_terminate(mp_Context *ctx, double grace);
/* ctx:poll(): reaps what has exited and moves an ending on, never waiting
** and never raising; pushes the events of the workers that ended since
** the last poll and the seconds until the next step (or nil): 2 values. */
int  mp_poll(lua_State *L, mp_Context *ctx);
/* mp_terminate, then waits until every worker is reaped: grace > 0 is
** SIGTERM, up to 'grace' seconds, SIGKILL; grace 0 is SIGKILL at once,
** and then waits only for the kernel to take the workers down. */
void mp_terminate_all(mp_Context *ctx, double grace);
/* The same ending for worker 'rank' alone (a pool ends one worker): SIGTERM
** (+SIGCONT) now, SIGKILL 'grace' seconds later from poll() or a join,
** at once when 'grace' is 0.  A worker that has ended is left as it is. */
void mp_terminate_rank(mp_Context *ctx, int rank, double grace);
/* ctx:fileno(): the context's epoll, made on first use; -errno. */
int  mp_watch(mp_Context *ctx);
/* A restarted worker: its pidfd (and a renewed reports' socket) join the
** watch, if there is one; -errno. */
int  mp_watch_worker(mp_Worker *w);
/* Before the reports' socket is renewed: it leaves the watch. */
void mp_watch_unsock(mp_Context *ctx);
/* The context settled: fileno() stays readable (join answers at once). */
void mp_watch_finish(mp_Context *ctx);
/* Closes what mp_watch made (the context is being closed). */
void mp_watch_close(mp_Context *ctx);
/* Reaps the worker if it has exited (never blocks); 1 when it is exited. */
int  mp_reap(mp_Worker *w);
/* Kills and reaps, by pid, a worker whose pidfd could not be had. */
void mp_discard(mp_Worker *w);
/* Ctrl-C while a wait blocks in poll(2) (join, mp.wait): watch blocks
** SIGINT and opens a signalfd for it, to be polled with the rest (fd -1:
** not watched -- the host ignores or blocks SIGINT itself); took reads it
** (1: Ctrl-C came); unwatch closes it and restores the signal mask, before
** the wait returns or raises. */
typedef struct mp_Interrupt { int fd; sigset_t old; } mp_Interrupt;
void mp_interrupt_watch(mp_Interrupt *in);
int  mp_interrupt_took(mp_Interrupt *in);
void mp_interrupt_unwatch(mp_Interrupt *in);
/* 'sig' to a running worker and its process group (mp_signal_group); 0 or
** -errno. */
int  mp_signal_worker(mp_Worker *w, int sig);

/* Every worker reaped: gives back the file_system references the dead ones
** still held (their ledgers) and what the reports nobody took carry, and
** closes the reports and the lifeline. */
void mp_context_finish(lua_State *L, mp_Context *ctx);

/* context.c */
mp_Context *mp_checkcontext(lua_State *L, int idx);
/* Terminates and reaps what still runs, then finishes the context. */
void mp_context_close(lua_State *L, mp_Context *ctx, double grace);

/* exception.c: types are metatables named below; each kind has __parent. */
#define MP_EXC_BASE    "multiprocessing.ProcessException"
#define MP_EXC_RAISED  "multiprocessing.ProcessRaisedException"
#define MP_EXC_EXITED  "multiprocessing.ProcessExitedException"
#define MP_EXC_INTERRUPTED "multiprocessing.Interrupted"   /* no __parent */
/* Pushes a new exception of type 'tname' whose fields are taken from the
** table at 'fields' (msg, error_index, error_pid, ...). */
void mp_exception_new(lua_State *L, const char *tname, int fields);
/* Ctrl-C ended the blocking call 'call' (its public name, "Queue.get"):
** raises an mp.Interrupted with kind = "interrupt", signal = "SIGINT",
** call, msg = "interrupted: SIGINT during <call>; <done>" (what the
** library did: "nothing was taken"), and the user's call site (the first
** frame outside the library) as where and traceback.  Never returns. */
int  mp_raise_interrupt(lua_State *L, const char *call, const char *done);

/* The most values fn(i, ...) may be given after i. */
#define MP_MAX_ARGS 100000

/* worker.c: what a worker's start needs to know of its parent, learnt
** by the parent once per context (mp_detach_learn, before it forks, or
** before a batch of launches: their children reset its 'handled') or
** given to a fresh worker (mp_detach_fresh). */
typedef struct mp_Detach {
  pid_t parent;       /* the parent process: getppid must say so */
  pid_t self;         /* the worker, once mp_worker_detach has run */
  int lifeline;       /* the worker's copy of the lifeline's read end */
  int main_thread;    /* started by the parent's main thread: its
                         PR_SET_PDEATHSIG follows the process */
  int threads;        /* the parent's threads (0: unknown) */
  int blocked;        /* the starting thread blocks some signal */
  int records;        /* the kernel keeps no status on pidfds (or the
                         specs say so): the worker records its exit */
  unsigned long long handled;  /* bit sig-1: a handler the worker drops */
} mp_Detach;
void mp_detach_learn(mp_Detach *d, int lifeline);
void mp_detach_fresh(mp_Detach *d, pid_t parent, int lifeline,
                     int main_thread);
/* In the child: joins its own process group, drops the parent's handlers
** and mask, dies with the parent process and its whole group (exits at
** once if the parent is already gone); 'slot': a fork's copy of the
** lifeline's write end, at the high descriptor the parent chose, where the
** worker's own lifeline goes (-1: a fresh worker).  Sets d->self. */
void mp_worker_detach(mp_Detach *d, int slot);
/* The parent: the lifeline pipe of a new context, both ends at high
** descriptors; 0 or errno. */
int  mp_lifeline_create(int lifeline[2]);
/* What a worker knows of itself (mp.current_process): a registry table
** {rank=, daemon=, job=} (job: the pid of the process that started it);
** none in a process that is not a worker. */
#define MP_WORKER_KEY "multiprocessing.worker"
/* Before mp_worker_run (which sets the rank and the job in it): the
** worker's identity table, its context daemonic or not. */
void mp_worker_daemon(lua_State *L, int daemon);
/* The same for forks: the parent pushes the identity table before it
** forks and leaves it under MP_WORKER_KEY for the children
** (mp_swap_registry): a fork allocates nothing for it. */
void mp_worker_identity_new(lua_State *L, int daemon);
/* Runs fn(rank, table.unpack(args)), reports, and never returns; the
** worker's title is "lua worker <rank>/<nprocs> (<script>)" until fn sets
** another.  'chans': the stack index of the set of channels fn and args
** hold, collected before a fork (mp_sharing_collect), or 0: the worker
** collects it. */
void mp_worker_run(lua_State *L, int fn, int args, int chans, int rank,
                   int nprocs, const mp_ReportTo *to, const mp_Detach *d)
    __attribute__((noreturn));

/* title.c: sets what ps -o args, pgrep -f and top show for this process,
** and its thread name (the first 15 bytes).  mp_title_prepare learns where
** the argv area is (once per state), so that a forked child sets its title
** without reading /proc. */
void mp_title_prepare(lua_State *L);
void mp_title_set(lua_State *L, const char *text, size_t len);

/* signames.c */
const char *mp_signal_name(int signum);   /* NULL when unknown */
int mp_signal_number(const char *name);   /* 0 when unknown */

/* Each part registers its functions and types into the module table at
** the top of the stack; core.c's list calls them (the data-sharing parts'
** are in sharing.h). */
void mp_open_exception(lua_State *L);
void mp_open_context(lua_State *L);
void mp_open_codec(lua_State *L);
void mp_open_signames(lua_State *L);
void mp_open_pool(lua_State *L);
void mp_open_executable(lua_State *L);
void mp_open_forkserver(lua_State *L);
void mp_open_spawn(lua_State *L);         /* start_spawn.c */
void mp_open_fd(lua_State *L);
void mp_open_cpus(lua_State *L);
int mp_cpu_count(void);   /* cpus.c: at least 1 */
void mp_open_select(lua_State *L);
void mp_open_title(lua_State *L);

/* fdpass.c: descriptors over unix sockets.  At most MP_MAXFDS per message. */
#define MP_MAXFDS 253
/* Returns bytes sent or -errno.  MSG_NOSIGNAL is always added. */
ssize_t mp_sendfds(int sock, const void *buf, size_t len,
                   const int *fds, size_t nfds, int flags);
/* Returns bytes received (0 at EOF) or -errno; -EPROTO when the descriptors
** were truncated (MSG_CTRUNC; the ones that came are closed).  *nfds is set
** to the number received (closed-on-exec). */
ssize_t mp_recvfds(int sock, void *buf, size_t len,
                   int *fds, size_t maxfds, size_t *nfds, int flags);

/* args.c: argument checks.  In a method made by mp_new_class they name it
** as the user knows it ("Queue.put") and do not count self; elsewhere they
** are lauxlib's.  Each raises; the checks return the value. */
/* The public name of the running method ("Queue.put"), or NULL in a plain
** function. */
const char *mp_method_name(lua_State *L);
int         mp_argerror(lua_State *L, int arg, const char *extramsg);
int         mp_typeerror(lua_State *L, int arg, const char *tname);
/* A function that takes no arguments (from 'first' on) raises when given
** some: mp.Lock(true) is a mistake, not a recursive lock. */
void        mp_checknoargs(lua_State *L, int first);
void        mp_checktype(lua_State *L, int arg, int t);
void       *mp_checkudata(lua_State *L, int arg, const char *tname);
lua_Number  mp_checknumber(lua_State *L, int arg);
lua_Integer mp_checkinteger(lua_State *L, int arg);
lua_Integer mp_optinteger(lua_State *L, int arg, lua_Integer def);
const char *mp_checklstring(lua_State *L, int arg, size_t *len);
/* A timeout in seconds: nil/none -> -1 (for ever); a negative number -> 0;
** NaN and non-numbers raise. */
double      mp_opttimeout(lua_State *L, int arg);

/* Stack contracts.  A function whose comment promises a stack effect may
** check it; the sanitizer build (-DMP_CHECK_STACK) aborts on a mismatch:
**   int top = mp_stack_top(L);  ...  mp_stack_check(L, top, 1);  (pushed 1) */
#ifdef MP_CHECK_STACK
#include <stdio.h>
#include <stdlib.h>
static inline int mp_stack_top(lua_State *L) { return lua_gettop(L); }
static inline void mp_stack_check_at(lua_State *L, int top, int effect,
                                     const char *file, int line) {
  if (lua_gettop(L) != top + effect) {
    fprintf(stderr, "%s:%d: stack effect %d, promised %d\n", file, line,
            lua_gettop(L) - top, effect);
    abort();
  }
}
#define mp_stack_check(L, top, effect) \
  mp_stack_check_at(L, top, effect, __FILE__, __LINE__)
#else
static inline int mp_stack_top(lua_State *L) { (void)L; return 0; }
static inline void mp_stack_check(lua_State *L, int top, int effect) {
  (void)L; (void)top; (void)effect;
}
#endif

/* Names.  A C function that Lua calls is named for what Lua calls it:
**   <type>_<name>  a method or metamethod: queue_put, ctx_join,
**                  lock_acquire, array_fill, tracker_gc
**   new_<type>     a constructor: new_queue, new_array
**   l_<name>       any other function of the module: l_isinstance
** (a metamethod whose name a method has too keeps its underscores:
** array__tostring is __tostring, array_tostring the method tostring).
** mp_<name> is shared between files (declared here, in sharing.h or in
** codec.h); every other function is static and named for what it does. */

/* small helpers shared by the parts (core.c) */
/* Warns through the library's channel: the handler of
** mp.set_warning_handler, else one line on stderr. */
void   mp_warning(lua_State *L, const char *msg);
int    mp_push_errno(lua_State *L, const char *what, int err); /* pushes msg */
/* Exchanges registry[key] and the value at stack index 'idx': a start puts
** in place what its forks find there before it forks, and the old value
** back after, one call each. */
void   mp_swap_registry(lua_State *L, const char *key, int idx);
/* This Lua state's page that knows our pid (sys.h), made on first use and
** unmapped when the state closes: a userdata in the registry, made before
** the caller's own (so finalized after it), or NULL. */
mp_Self *mp_self(lua_State *L);
void   mp_push_method(lua_State *L);         /* for __index, see core.c */
/* Creates (and leaves on the stack) the metatable 'tname' of a type, with
** the metamethods 'meta' and the 'methods' (or NULL): they are its __index,
** or, when 'meta' has an __index function, its __methods, where that
** function finds them with mp_push_method.  Each method is a closure with
** its public name ("Queue.put", from the part of 'tname' after its last
** dot) as upvalue 1, for the checks of args.c. */
void   mp_new_class(lua_State *L, const char *tname, const luaL_Reg *meta,
                    const luaL_Reg *methods);

/* --- fresh interpreters: "spawn" and "forkserver" ---------------------- */

/* executable.c: pushes the program that runs fresh workers: the one
** set_executable chose, else the worker program next to core.so (in place
** of the running stock interpreter when it is the same Lua; else that
** interpreter).  mp_push_argv fills argv = {exe, "-e", a short line, NULL}
** for the executable at stack index 'exe', and pushes and returns the
** environment to start it with: ours, plus MP_BOOT_ENV, the chunk that
** loads the core and calls core.<call> (argv borrows the exe string, the
** environment is the pushed userdata).  The worker calls mp_boot_done once
** the core is loaded: its children must not inherit the chunk. */
#define MP_BOOT_ENV "LUA_MP_BOOT"
const char *mp_push_program(lua_State *L);
char **mp_push_argv(lua_State *L, int exe, const char *call, char *argv[4]);
void mp_boot_done(void);
/* An executable chosen with set_executable has answered once in this
** state (the defaults always have): no need to wait for its hello. */
int  mp_executable_verified(lua_State *L, const char *exe);
/* Waits for the hello byte a worker or forkserver writes to 'fd' when it
** runs the protocol; EOF or a long silence: an errno with a message
** naming 'exe' pushed.  0 marks it verified. */
int  mp_await_hello(lua_State *L, int fd, const char *exe);

/* payload.c: what a fresh worker needs (fn, args, the environment), encoded
** once per context into a sealed memfd.  mp_payload_make keeps its holder
** (a userdata owning 'fd' and keeping the codec's 'fds' alive) in the
** uservalue of the context at 'ctxidx' (field payload), where every start
** of the context, restarts too, finds it (mp_payload_get): the encoding
** holds the references its receivers need (MP_CODEC_BROADCAST) until the
** context ends, when mp_payload_release drops them.  0, or when fn or args
** cannot be sent EINVAL with the codec's message pushed. */
typedef struct mp_Payload {
  int fd;
  const int *fds;
  size_t nfds;
} mp_Payload;
int  mp_payload_make(lua_State *L, int ctxidx, int fn, int args, int daemon);
/* Pushes the holder (or nil) and returns its payload, NULL when released. */
mp_Payload *mp_payload_get(lua_State *L, int ctxidx);
void mp_payload_close(mp_Payload *p);
/* The context at 'ctxidx' has ended: its payload and the references it
** holds go now, not at the next collection, and so do the fn and args
** (uservalue fields) its restarts would have used.  Idempotent. */
void mp_payload_release(lua_State *L, int ctxidx);
/* Only the payload goes (a restart encodes fn and args again). */
void mp_payload_drop(lua_State *L, int ctxidx);
/* In the worker: applies the environment of the payload at 'fd' and pushes
** fn and args; 'fds' are the codec's descriptors (a decoded object takes
** its own, the others are closed).  A failure becomes a function that
** raises it, so that it reaches the parent as the worker's error. */
void mp_payload_load(lua_State *L, int fd, int *fds, size_t nfds);

/* launch.c: what the two methods share.  They differ only in how workers
** come to be (an mp_FreshLaunch): spawn clone+execs each one, the
** forkserver has its server fork them.
**
** A fresh worker's descriptors, in this order for both: a spawned worker
** has slot k as descriptor 3 + k, a forkserver request carries them as
** its SCM_RIGHTS.  The codec's descriptors follow the fixed ones.  A
** protocol between processes: explicit values. */
typedef enum mp_WorkerFd {
  MP_WFD_PAYLOAD  = 0,   /* the payload memfd */
  MP_WFD_REPORTS  = 1,   /* the reports memfd */
  MP_WFD_RSOCK    = 2,   /* the workers' end of the reports' socket */
  MP_WFD_LIFELINE = 3,   /* the read end of the context's lifeline */
  MP_WFD_NFIXED   = 4    /* the codec's k-th is slot MP_WFD_NFIXED + k */
} mp_WorkerFd;
/* Fills 'fds' (room for MP_WFD_NFIXED + p->nfds) with the descriptors of
** 'ctx' and its payload 'p'; returns how many. */
int  mp_worker_fds(const mp_Context *ctx, const mp_Payload *p, int *fds);
/* Starts the workers of 'ctx' with the executable at stack index 'exe'
** and the descriptors 'fds' (mp_worker_fds), recording each worker and
** ctx->started as it goes; 0, or an errno with a message pushed. */
typedef int (*mp_FreshLaunch)(lua_State *L, mp_Context *ctx, int exe,
                              const int *fds, int nfds);
/* The start of both methods (an mp_StartMethod's start): takes the
** context's payload (mp_payload_get), finds the executable, flushes our
** buffered output (no worker may print it again) and calls 'launch'.
** Leaves the stack as it was, plus the message on failure. */
int  mp_start_fresh(lua_State *L, mp_Context *ctx, int ctxidx, int fn,
                    int args, mp_FreshLaunch launch);
/* Starts 'exe' with 'argv' and 'envp' (NULL-terminated) in its own
** process group, with fds[i] as descriptor 3 + i and no other of ours
** above 2, and a pidfd made with it (the exec makes its exit signal
** SIGCHLD again).  'handled': the signals we catch (mp_Detach's, learnt
** once for a batch of launches).  0, or an errno with a message pushed. */
#define MP_LAUNCH_MAXFDS 256
int  mp_launch(lua_State *L, const char *exe, char *const argv[],
               char *const envp[], const int *fds, int nfds,
               uint64_t handled, pid_t *pid, int *pidfd);

#endif
