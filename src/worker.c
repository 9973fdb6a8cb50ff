/*
** worker.c -- the child's side, the same for every start method: detach
** from the parent's terminal job, run fn(i, ...), leave a report in the
** context's report file (its descriptors through the context's socket), and
** leave with _exit.
*/
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <stdint.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "codec.h"
#include "mp.h"
#include "sharing.h"

/* A report longer than this keeps its head and its tail (where the error
** message is) around a visible marker. */
#define ERROR_TEXT_MAX  (1024 * 1024)

/* How a worker dies with its parent process, with everything in its
** process group (the programs it started):
**
** The lifeline: a pipe per context whose write end only the parent
** process holds (close-on-exec; a forked worker closes its copy).  When the
** parent dies, the kernel closes it, and every reader that asked for
** O_ASYNC gets the signal its open file chose with F_SETSIG, sent to the
** owner chosen with F_SETOWN.  Each worker opens the pipe anew through
** /proc (its own open file, so its own owner) and asks for SIGKILL to its
** own process group: no handler runs, so none can be blocked, ignored or
** replaced by user code, and the group goes with the worker.  The copy is
** kept at a high descriptor, out of the way of code that closes or dup2s
** over descriptors 3..30, as daemon-style code does: mp_lifeline_create
** places both ends of the pipe there; a forked worker's copy takes the
** place of its copy of the write end (one dup3 closes that end), a fresh
** worker moves its copy there.
**
** PR_SET_PDEATHSIG(SIGKILL) only where the lifeline could not be held,
** and only from the process's main thread (it follows the *thread* that
** created the worker: a short-lived thread of a host would take its
** workers with it).  Never beside a held lifeline: a forked worker holds
** copies of the write ends of the contexts started before its own, so
** their lifelines fire one after another as those workers die; a worker
** that PDEATHSIG killed first would take its own O_ASYNC reader with it,
** and its group would never be signalled.
**
** Either one arms after the parent may already have died: getppid, read
** after both, tells (as systemd's safe_fork does).  A fork that holds the
** lifeline needs no getppid: it held a copy of the write end until its own
** reader was armed, so the last write end closes (the parent's death
** fires) only once it listens. */
#define LIFELINE_LOW 31     /* the lowest descriptor the lifeline takes */
#define LIFELINE_HIGH 1024  /* ... and the highest it aims at, plus one */

/* Where the lifeline goes: at most LIFELINE_HIGH - 1, below the limit. */
static int lifeline_floor(void) {
  struct rlimit rl;
  long hi = LIFELINE_HIGH;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < (rlim_t)hi)
    hi = (long)rl.rlim_cur;
  return hi - 64 > LIFELINE_LOW ? (int)(hi - 64) : LIFELINE_LOW;
}

int mp_lifeline_create(int lifeline[2]) {
  int end;
  if (pipe2(lifeline, O_CLOEXEC) != 0) return errno;
  for (end = 0; end < 2; end++) {
    int high = fcntl(lifeline[end], F_DUPFD_CLOEXEC, lifeline_floor());
    if (high >= 0) {   /* else it stays where it is: still a lifeline */
      close(lifeline[end]);
      lifeline[end] = high;
    }
  }
  return 0;
}

/* 1 when the lifeline will SIGKILL our group ('self' is its id).  Our
** own open file of the pipe, opened through the inherited read end
** 'lifeline', is armed, then placed: at 'slot' when it is a fork's copy of
** the write end (high: the parent put it there), which dup3 closes in the
** same call (the fork's copy of the read end stays, harmless: a reader);
** else (slot -1, a fresh worker) moved high, the inherited one closed. */
static int hold_lifeline(int lifeline, int slot, pid_t self) {
  char path[64];
  const char *end;
  int fd, ok;
  if (lifeline < 0) {
    if (slot >= 0) close(slot);  /* only the parent may hold the write end */
    return 0;
  }
  end = path + sizeof path - 1;
  *mp_add_int(mp_add_text(path, end, "/proc/self/fd/"), end, lifeline) = '\0';
  fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  ok = fd >= 0 && fcntl(fd, F_SETSIG, SIGKILL) == 0 &&
       fcntl(fd, F_SETOWN, -self) == 0 &&
       fcntl(fd, F_SETFL, O_RDONLY | O_NONBLOCK | O_ASYNC) == 0;
  if (!ok) {
    if (fd >= 0) close(fd);
    if (slot >= 0) close(slot);
    close(lifeline);
    return 0;
  }
  if (slot >= 0) {
    ok = dup3(fd, slot, O_CLOEXEC) >= 0;
    if (!ok) close(slot);  /* the low one is the lifeline */
  } else {
    ok = fcntl(fd, F_DUPFD_CLOEXEC, lifeline_floor()) >= 0;
    close(lifeline);
  }
  if (ok) close(fd);  /* else the low one stays: still a lifeline */
  return 1;
}

/* --- the worker's own exit record ---------------------------------------- */

/* Where this worker writes how it left (reports.c): a host that reaps our
** workers with waitpid(-1), or ignores SIGCHLD, takes their status from
** the parent, and kernels before 6.15 do not keep it on the pidfd.  A
** process of its own has one such record, so it lives in statics (set in
** the worker only, never in the host). */
static struct { mp_ReportTo to; int rank; pid_t pid; } exit_record = {
  {-1, -1, NULL}, 0, 0};

static void record_exit(int code) {
  if (exit_record.to.fd >= 0 && (pid_t)syscall(SYS_getpid) == exit_record.pid)
    mp_reports_exit_put(&exit_record.to, exit_record.rank, code);
}

/* exit() or os.exit(): glibc passes the status. */
static void on_exit_record(int status, void *arg) {
  (void)arg;
  record_exit(status & 0xff);
}

/* A fatal signal we can catch: recorded, then taken as it would have been.
** (The check of the pid keeps a child between fork and exec, which has our
** handlers for a moment, from writing our record.) */
static void on_fatal_signal(int sig) {
  record_exit(-sig);
  signal(sig, SIG_DFL);
  raise(sig);
}

/* Only where the kernel keeps no status on the pidfd (d->records): else
** join never reads the record, and the registration and the stores it
** would cost are page faults in a fork (libc's list of exit functions,
** our statics, the report's page). */
static void watch_exit(const mp_ReportTo *to, int rank, pid_t self) {
  static const int fatal[] = {
    SIGHUP, SIGINT, SIGQUIT, SIGILL, SIGTRAP, SIGABRT, SIGBUS, SIGFPE,
    SIGUSR1, SIGSEGV, SIGUSR2, SIGPIPE, SIGALRM, SIGTERM, SIGXCPU, SIGXFSZ,
    SIGVTALRM, SIGPROF, SIGSYS
  };
  size_t i;
  exit_record.to = *to;
  exit_record.rank = rank;
  exit_record.pid = self;
  on_exit(on_exit_record, NULL);
  for (i = 0; i < sizeof fatal / sizeof fatal[0]; i++) {
    struct sigaction sa;
    if (sigaction(fatal[i], NULL, &sa) != 0 || sa.sa_handler != SIG_DFL)
      continue;  /* ignored: left so */
    sa.sa_handler = on_fatal_signal;
    sa.sa_flags = 0;
    sigemptyset(&sa.sa_mask);
    sigaction(fatal[i], &sa, NULL);
  }
}

/* --- what the parent knows of itself ------------------------------------ */

/* "Name:\t<hex or decimal>" in /proc/thread-self/status. */
static int status_field(const char *text, const char *name, int hex,
                        uint64_t *v) {
  const char *p = strstr(text, name);
  char *end;
  if (p == NULL) return 0;
  *v = strtoull(p + strlen(name), &end, hex ? 16 : 10);
  return end != p + strlen(name);
}

void mp_detach_learn(mp_Detach *d, int lifeline) {
  char text[4096];
  uint64_t pid = 0, tgid = 0, threads = 0, blocked = 1, caught = 0;
  int fd = open("/proc/thread-self/status", O_RDONLY | O_CLOEXEC);
  ssize_t n = fd >= 0 ? read(fd, text, sizeof text - 1) : -1;
  if (fd >= 0) close(fd);
  memset(d, 0, sizeof *d);
  d->parent = getpid();
  d->lifeline = lifeline;
  if (n > 0) {
    text[n] = '\0';
    status_field(text, "\nTgid:", 0, &tgid);
    status_field(text, "\nPid:", 0, &pid);
    status_field(text, "\nThreads:", 0, &threads);
    status_field(text, "\nSigBlk:", 1, &blocked);
    status_field(text, "\nSigCgt:", 1, &caught);
  } else {   /* no /proc: ask the system */
    int sig;
    sigset_t mask;
    tgid = (uint64_t)d->parent;
    pid = (uint64_t)syscall(SYS_gettid);
    blocked = sigprocmask(SIG_BLOCK, NULL, &mask) == 0 && sigisemptyset(&mask)
              ? 0 : 1;
    for (sig = 1; sig <= 64 && sig < NSIG; sig++) {
      struct sigaction sa;
      if (sigaction(sig, NULL, &sa) == 0 && sa.sa_handler != SIG_DFL &&
          sa.sa_handler != SIG_IGN)
        caught |= 1ull << (sig - 1);
    }
  }
  d->main_thread = pid != 0 && pid == tgid;
  d->threads = (int)threads;
  d->blocked = blocked != 0;
  d->handled = caught;
  d->records = !mp_pidfd_keeps_status();
}

void mp_detach_fresh(mp_Detach *d, pid_t parent, int lifeline,
                     int main_thread) {
  memset(d, 0, sizeof *d);
  d->parent = parent;
  d->lifeline = lifeline;
  d->main_thread = main_thread;
  /* exec dropped every handler but lua.c's, which catches SIGINT while a
  ** chunk runs; exec kept the mask, which the launcher emptied */
  d->handled = 1ull << (SIGINT - 1);
  d->records = !mp_pidfd_keeps_status();
}

/* --- the worker ---------------------------------------------------------- */

/* As exec would: a handler the parent installed is dropped, so the
** signal does what it does by default; an ignored one stays ignored. */
static void drop_handlers(uint64_t handled) {
  struct sigaction dfl;
  int sig;
  memset(&dfl, 0, sizeof dfl);
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  for (sig = 1; handled != 0 && sig <= 64; sig++, handled >>= 1) {
    struct sigaction old;
    if (!(handled & 1)) continue;
    if (sigaction(sig, &dfl, &old) == 0 && old.sa_handler == SIG_IGN)
      sigaction(sig, &old, NULL);
  }
}

void mp_worker_detach(mp_Detach *d, int slot) {
  pid_t self;
  int held;
  /* Our own process group: Ctrl-C at the terminal reaches the parent only,
  ** and terminating the worker's group takes its children too. */
  setpgid(0, 0);
  self = getpid();
  drop_handlers(d->handled);
  held = hold_lifeline(d->lifeline, slot, self);
  if (!held && d->main_thread) prctl(PR_SET_PDEATHSIG, SIGKILL);
  if ((!held || slot < 0) && getppid() != d->parent)
    _exit(1);  /* it died before we listened */
  /* Nothing the parent blocked stays blocked (a join blocks SIGINT, a
  ** host may block anything), as in a fresh program. */
  if (d->blocked) {
    sigset_t set;
    sigemptyset(&set);
    sigprocmask(SIG_SETMASK, &set, NULL);
  }
  d->self = self;
}

/* Pushes a readable text for the error value at 'idx', as lua.c would:
** a string or number as is, else its __tostring (which may fail itself
** without losing the failure), else the type. */
static int call_tostring(lua_State *L) {
  luaL_tolstring(L, 1, NULL);
  return 1;
}

static void push_error_text(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (lua_type(L, idx) == LUA_TSTRING || lua_type(L, idx) == LUA_TNUMBER) {
    lua_pushstring(L, lua_tostring(L, idx));
    return;
  }
  if (luaL_getmetafield(L, idx, "__tostring") != LUA_TNIL) {
    lua_pop(L, 1);
    lua_pushcfunction(L, call_tostring);
    lua_pushvalue(L, idx);
    if (lua_pcall(L, 1, 1, 0) == LUA_OK && lua_type(L, -1) == LUA_TSTRING)
      return;
    lua_pushfstring(L, "(error object is a %s value; its __tostring failed: %s)",
                    luaL_typename(L, idx), luaL_tolstring(L, -1, NULL));
    lua_remove(L, -2);
    lua_remove(L, -2);
    return;
  }
  lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, idx));
}

/* --- the traceback ------------------------------------------------------- */

/* A frame of the library's own Lua files (.../multiprocessing/<name>.lua):
** the pool's loop, mprun's rank, not the user's code. */
static int is_library(const lua_Debug *ar) {
  const char *slash = strrchr(ar->source, '/');
  size_t n = strlen(ar->source);
  return ar->source[0] == '@' && slash != NULL && n > 4 &&
         strcmp(ar->source + n - 4, ".lua") == 0 &&
         slash - ar->source >= 15 && memcmp(slash - 15, "multiprocessing", 15) == 0;
}

/* One frame's line: "<where>: in <what>", named as the user knows it: a
** function by its name ("function 'step'", whether a local, an upvalue or
** a global held it), unless the name is the library's own local that
** called it ('task', 'chunk'): then by where it is defined. */
static void add_frame(luaL_Buffer *b, lua_State *L, const lua_Debug *ar,
                      int library_caller) {
  if (ar->currentline > 0)
    lua_pushfstring(L, "\n\t%s:%d: in ", ar->short_src, ar->currentline);
  else
    lua_pushfstring(L, "\n\t%s: in ", ar->short_src);
  luaL_addvalue(b);
  if (*ar->what == 'm')
    luaL_addstring(b, "main chunk");
  else if (*ar->namewhat != '\0' && !library_caller)
    lua_pushfstring(L, "function '%s'", ar->name), luaL_addvalue(b);
  else if (*ar->what == 'C')
    luaL_addstring(b, "?");
  else
    lua_pushfstring(L, "function <%s:%d>", ar->short_src, ar->linedefined),
    luaL_addvalue(b);
  if (ar->istailcall) luaL_addstring(b, "\n\t(...tail calls...)");
}

#define TRACEBACK_FRAMES 200   /* more are summed up in one line */

/* Pushes the traceback of L from 'level' on, without the library's
** frames (its Lua files, and the C functions they call or are called
** from). */
static void push_traceback(lua_State *L, int level) {
  luaL_Buffer b;
  lua_Debug ar, caller;
  int shown = 0, skipped = 0;
  luaL_buffinit(L, &b);
  luaL_addstring(&b, "stack traceback:");
  for (; lua_getstack(L, level, &ar); level++) {
    int has_caller = lua_getstack(L, level + 1, &caller);
    int library_caller;
    lua_getinfo(L, "Slnt", &ar);
    if (has_caller) lua_getinfo(L, "S", &caller);
    library_caller = has_caller && is_library(&caller);
    if (is_library(&ar) || (*ar.what == 'C' && (!has_caller || library_caller)))
      continue;
    if (shown++ < TRACEBACK_FRAMES)
      add_frame(&b, L, &ar, library_caller);
    else
      skipped++;
  }
  if (skipped > 0) {
    lua_pushfstring(L, "\n\t...\t(%d more levels)", skipped);
    luaL_addvalue(&b);
  }
  luaL_pushresult(&b);
}

/* Message handler: {text = traceback .. "\n" .. message, value = error}.
** The traceback comes first so that the report ends with the message, as a
** Python traceback does. */
static int make_report(lua_State *L) {
  lua_createtable(L, 0, 3);
  lua_pushvalue(L, 1);
  lua_setfield(L, -2, "value");
  push_traceback(L, 1);
  /* where the traceback ends: the parent gives e.traceback and e.message
  ** apart without reading the text */
  lua_pushinteger(L, (lua_Integer)lua_rawlen(L, -1));
  lua_setfield(L, -3, "tb");
  lua_pushliteral(L, "\n");
  push_error_text(L, 1);
  lua_concat(L, 3);
  lua_setfield(L, -2, "text");
  return 1;
}

static void cap_text(lua_State *L, int report) {
  size_t len;
  const char *text;
  lua_getfield(L, report, "text");
  text = lua_tolstring(L, -1, &len);
  if (text != NULL && len > ERROR_TEXT_MAX) {
    size_t keep = ERROR_TEXT_MAX / 2;
    lua_getfield(L, report, "tb");
    if (lua_tointeger(L, -1) >= (lua_Integer)keep) {  /* cut: no traceback */
      lua_pushnil(L);
      lua_setfield(L, report, "tb");
    }
    lua_pop(L, 1);
    lua_pushlstring(L, text, keep);
    lua_pushfstring(L, "\n\n[... %I bytes of this error report omitted ...]\n\n",
                    (lua_Integer)(len - 2 * keep));
    lua_pushlstring(L, text + len - keep, keep);
    lua_concat(L, 3);
    lua_setfield(L, report, "text");
  }
  lua_pop(L, 1);
}

/* Protected: encodes the value at 1 and reports it as 'kind' (at 4) of
** rank (at 2) to the mp_ReportTo (light userdata at 3); the descriptors the
** encoding carries (shared memory, queues) go through the socket. */
static int put_report(lua_State *L) {
  int kind = (int)lua_tointeger(L, 4);
  const char *names[1];
  mp_Encoded enc;
  int err, flags;
  names[0] = kind == MP_REPORT_RESULT ? "result" : "error report";
  /* an error value keeps what can cross, and describes the rest */
  flags = kind == MP_REPORT_RESULT ? MP_CODEC_DATA
                                   : MP_CODEC_DATA | MP_CODEC_DESCRIBE;
  mp_encode(L, 1, 1, flags, names, "back to the parent", &enc);
  err = mp_reports_put((const mp_ReportTo *)lua_touserdata(L, 3),
                       (int)lua_tointeger(L, 2), kind, enc.data, enc.size,
                       enc.fds, enc.nfds);
  if (err != 0)
    return luaL_error(L, "cannot write the report: %s", strerror(err));
  return 0;
}

static int try_put(lua_State *L, int value, int rank, const mp_ReportTo *to,
                   int kind) {
  int status;
  value = lua_absindex(L, value);
  lua_pushcfunction(L, put_report);
  lua_pushvalue(L, value);
  lua_pushinteger(L, rank);
  lua_pushlightuserdata(L, (void *)(size_t)to);
  lua_pushinteger(L, kind);
  status = lua_pcall(L, 4, 0, 0);
  return status;  /* the error message, if any, is on the stack */
}

/* The report at 'report' is a table from make_report, or a bare message when
** the handler could not run (out of memory).  Its value goes described
** (MP_CODEC_DESCRIBE); one that still cannot be sent (nested too deep, an
** object that refuses) is dropped, its text kept; failing all else, stderr
** gets the text. */
static void report_error(lua_State *L, int report, int rank,
                         const mp_ReportTo *to) {
  report = lua_absindex(L, report);
  if (!lua_istable(L, report)) {
    lua_createtable(L, 0, 1);
    push_error_text(L, report);
    lua_setfield(L, -2, "text");
    lua_replace(L, report);
  }
  cap_text(L, report);
  if (try_put(L, report, rank, to, MP_REPORT_ERROR) == LUA_OK) return;
  lua_pop(L, 1);
  lua_pushnil(L);
  lua_setfield(L, report, "value");
  if (try_put(L, report, rank, to, MP_REPORT_ERROR) == LUA_OK) return;
  lua_getfield(L, report, "text");
  fprintf(stderr, "multiprocessing: process %d failed and could not report: "
                  "%s\n%s\n", rank, lua_tostring(L, -2), lua_tostring(L, -1));
}

/* A result that cannot be sent fails the worker: nothing is dropped. */
static int report_result(lua_State *L, int result, int rank,
                         const mp_ReportTo *to) {
  if (lua_isnil(L, result)) return 0;
  if (try_put(L, result, rank, to, MP_REPORT_RESULT) == LUA_OK) return 0;
  report_error(L, -1, rank, to);
  return 1;
}

/* How many values args holds for fn: args.n, or #args. */
static lua_Integer count_args(lua_State *L, int args) {
  lua_Integer n;
  lua_pushliteral(L, "n");
  if (lua_rawget(L, args) == LUA_TNIL)
    n = luaL_len(L, args);
  else
    n = lua_tointeger(L, -1);  /* checked by the parent (mp_check_args) */
  lua_pop(L, 1);
  if (n < 0 || n > MP_MAX_ARGS)
    luaL_error(L, "#args is %I: at most %d arguments", n, MP_MAX_ARGS);
  return n;
}

/* Protected, on the worker's thread: fn at 1, args at 2, rank at 3, the
** set of channels they hold at 4 (nil: collected here).  Objects the
** worker inherited are its own from now on (a decoded one already is);
** leaves fn, rank and the unpacked args, ready to call. */
static int prepare_call(lua_State *L) {
  lua_Integer n, i;
  if (lua_isnil(L, 4)) mp_sharing_collect(L, 1, 2);  /* fn args rank nil set */
  mp_sharing_attach(L, lua_gettop(L));
  n = count_args(L, 2);
  luaL_checkstack(L, (int)n + 2, "too many arguments");
  lua_pushvalue(L, 1);
  lua_pushvalue(L, 3);
  for (i = 1; i <= n; i++) lua_geti(L, 2, i);
  return (int)n + 2;
}

/* Protected: fn at 1, args at 2, rank at 3, the report channel at 4, the
** set of channels at 5 (or nil).  Runs fn on a fresh thread, so the
** traceback shows the worker's frames only, reports, and returns the exit
** code. */
static int run_worker(lua_State *L) {
  int rank = (int)lua_tointeger(L, 3);
  const mp_ReportTo *to = lua_touserdata(L, 4);
  lua_State *co = lua_newthread(L);
  int status, code = 0;
  lua_pushcfunction(co, make_report);
  lua_pushcfunction(co, prepare_call);
  lua_pushvalue(L, 1);
  lua_pushvalue(L, 2);
  lua_pushvalue(L, 3);
  lua_pushvalue(L, 5);
  lua_xmove(L, co, 4);
  status = lua_pcall(co, 4, LUA_MULTRET, 1);
  if (status == LUA_OK)
    status = lua_pcall(co, lua_gettop(co) - 2, 1, 1);
  lua_xmove(co, L, 1);
  if (status == LUA_OK)
    code = report_result(L, -1, rank, to);
  else {
    report_error(L, -1, rank, to);
    code = 1;
  }
  lua_pushinteger(L, code);
  return 1;
}

/* The identity table {rank=, daemon=, job=} is made whole by the parent:
** a fork that made it, or only added a key to it or to the registry, would
** allocate, and each first write to a page of the parent's heap is a page
** fault in it; mp_worker_run only stores the rank and the job in it. */
void mp_worker_identity_new(lua_State *L, int daemon) {
  lua_createtable(L, 0, 3);                         /* id */
  lua_pushboolean(L, daemon);                       /* id daemon */
  lua_setfield(L, -2, "daemon");                    /* id */
  lua_pushinteger(L, 0);                            /* id 0 */
  lua_setfield(L, -2, "rank");                      /* id */
  lua_pushinteger(L, 0);                            /* id 0 */
  lua_setfield(L, -2, "job");                       /* id */
}

void mp_worker_daemon(lua_State *L, int daemon) {
  mp_worker_identity_new(L, daemon);                /* id */
  lua_setfield(L, LUA_REGISTRYINDEX, MP_WORKER_KEY);  /* */
}

/* Appends the script a plain worker's title names: the parent's arg[0]
** (the script lua5.4 ran), else the chunk fn was defined in.  Nothing is
** allocated: in a forked worker an allocation may start a collection step,
** and its marks would copy page after page of the parent's heap. */
static char *add_script_name(lua_State *L, int fn, char *p, const char *end) {
  int top = lua_gettop(L);
  lua_Debug ar;
  if (lua_getglobal(L, "arg") == LUA_TTABLE &&        /* arg */
      lua_rawgeti(L, -1, 0) == LUA_TSTRING) {         /* arg script */
    p = mp_add_text(p, end, lua_tostring(L, -1));
  } else {
    lua_settop(L, top);                               /* */
    lua_pushvalue(L, fn);                             /* fn */
    p = mp_add_text(p, end, lua_getinfo(L, ">S", &ar) ? ar.short_src : "?");
  }
  lua_settop(L, top);                                 /* */
  return p;
}

/* "lua worker <rank>/<n> (<script>)", until the worker sets its own. */
static void set_default_title(lua_State *L, int fn, int rank, int nprocs) {
  char title[256];
  const char *end = title + sizeof title;
  char *p = mp_add_text(title, end, "lua worker ");
  p = mp_add_int(p, end, rank);
  p = mp_add_text(p, end, "/");
  p = mp_add_int(p, end, nprocs);
  p = mp_add_text(p, end, " (");
  p = add_script_name(L, fn, p, end);
  p = mp_add_text(p, end, ")");
  mp_title_set(L, title, (size_t)(p - title));
}

void mp_worker_run(lua_State *L, int fn, int args, int chans, int rank,
                   int nprocs, const mp_ReportTo *to, const mp_Detach *d) {
  int code = 1;
  mp_Mark ledger;
  fn = lua_absindex(L, fn);
  args = lua_absindex(L, args);
  if (chans != 0) chans = lua_absindex(L, chans);
  set_default_title(L, fn, rank, nprocs);
  /* the identity table: mp_worker_daemon's, or the one a fork's parent
  ** left in the registry (mp_swap_registry) */
  if (lua_getfield(L, LUA_REGISTRYINDEX, MP_WORKER_KEY) == LUA_TTABLE) {
    lua_pushinteger(L, rank);                         /* id rank */
    lua_setfield(L, -2, "rank");                      /* id */
    lua_pushinteger(L, d->parent);                    /* id job */
    lua_setfield(L, -2, "job");                       /* id */
  }
  lua_pop(L, 1);                                      /* */
  if (d->records) watch_exit(to, rank, d->self);
  ledger = mp_reports_ledger_mark(to, rank);
  mp_ledger_open(L, to->fd, mp_reports_ledger_at(rank), d->self, &ledger);
  /* Nothing may unwind past here: in a fork, what lies below is a copy
  ** of the parent's stack. */
  lua_pushcfunction(L, run_worker);
  lua_pushvalue(L, fn);
  lua_pushvalue(L, args);
  lua_pushinteger(L, rank);
  lua_pushlightuserdata(L, (void *)(size_t)to);
  if (chans != 0) lua_pushvalue(L, chans);
  else lua_pushnil(L);
  if (lua_pcall(L, 5, 1, 0) == LUA_OK)
    code = (int)lua_tointeger(L, -1);
  else
    fprintf(stderr, "multiprocessing: process %d failed before it could "
                    "report: %s\n", rank, lua_tostring(L, -1));
  /* Our own output only: the parent flushed its buffers before forking. */
  fflush(NULL);
  /* No __gc runs before _exit: the file_system references our arrays hold
  ** are given back here (the report holds its receiver's own). */
  mp_array_exit(L);
  if (d->records)
    mp_reports_exit_put(to, rank, code);  /* we are the worker: no check */
  _exit(code);
}
