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
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "codec.h"
#include "mp.h"
#include "sharing.h"

/* A report longer than this keeps its head and its tail (where the error
** message is) around a visible marker. */
#define ERROR_TEXT_MAX  (1024 * 1024)

/* The parent's death reaches a worker as this signal, whose handler takes
** the worker's whole process group down: the programs the worker started
** die with it instead of living on as orphans.  Not SIGKILL, which runs no
** handler; a real-time signal, which user code hardly ever uses, and whose
** default action (before the handler is set, or after an exec) still
** terminates. */
#define PARENT_DIED (SIGRTMAX - 2)

/* How the parent's death is noticed: not PR_SET_PDEATHSIG, which follows
** the *thread* that created the worker (a short-lived thread of the host
** would take its workers with it), but the context's lifeline pipe.  Only
** the parent process holds its write end (close-on-exec; a forked worker
** closes its copy); when the process dies, the kernel closes it, and every
** reader that asked for O_ASYNC gets the signal chosen with F_SETSIG.  The
** owner of that signal belongs to an open file, so each worker opens the
** pipe anew through /proc (its own open file, its own owner). */
int mp_lifeline_create(int lifeline[2]) {
  return pipe2(lifeline, O_CLOEXEC) == 0 ? 0 : errno;
}

static void on_parent_death(int sig) {
  (void)sig;
  kill(0, SIGKILL);                /* the group, the worker included */
}

/* 1 when the lifeline will signal PARENT_DIED to us; closes 'lifeline'. */
static int hold_lifeline(int lifeline) {
  char path[64];
  int fd;
  snprintf(path, sizeof path, "/proc/self/fd/%d", lifeline);
  fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  close(lifeline);
  if (fd < 0) return 0;
  if (fcntl(fd, F_SETSIG, PARENT_DIED) != 0 ||
      fcntl(fd, F_SETOWN, getpid()) != 0 ||
      fcntl(fd, F_SETFL, O_RDONLY | O_NONBLOCK | O_ASYNC) != 0) {
    close(fd);
    return 0;
  }
  return 1;  /* fd stays open for the worker's life */
}

/* --- the worker's own exit record ---------------------------------------- */

/* Where this worker writes how it left (reports.c): a host that reaps our
** workers with waitpid(-1), or ignores SIGCHLD, takes their status from
** the parent, and kernels before 6.15 do not keep it on the pidfd.  A
** process of its own has one such record, so it lives in statics (set in
** the worker only, never in the host). */
static struct { int fd, rank; pid_t pid; } exit_record = {-1, 0, 0};

static void record_exit(int code) {
  if (exit_record.fd >= 0 && (pid_t)syscall(SYS_getpid) == exit_record.pid)
    mp_reports_exit_put(exit_record.fd, exit_record.rank, code);
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

static void watch_exit(int fd, int rank) {
  static const int fatal[] = {
    SIGHUP, SIGINT, SIGQUIT, SIGILL, SIGTRAP, SIGABRT, SIGBUS, SIGFPE,
    SIGUSR1, SIGSEGV, SIGUSR2, SIGPIPE, SIGALRM, SIGTERM, SIGXCPU, SIGXFSZ,
    SIGVTALRM, SIGPROF, SIGSYS
  };
  size_t i;
  exit_record.fd = fd;
  exit_record.rank = rank;
  exit_record.pid = getpid();
  on_exit(on_exit_record, NULL);
  for (i = 0; i < sizeof fatal / sizeof fatal[0]; i++) {
    struct sigaction sa;
    if (sigaction(fatal[i], NULL, &sa) != 0 || sa.sa_handler != SIG_DFL)
      continue;  /* ignored, or the host's (a fork): left alone */
    sa.sa_handler = on_fatal_signal;
    sa.sa_flags = 0;
    sigemptyset(&sa.sa_mask);
    sigaction(fatal[i], &sa, NULL);
  }
}

void mp_worker_detach(pid_t parent, int lifeline) {
  static const int resets[] = {SIGINT, SIGTERM};
  struct sigaction died;
  sigset_t set;
  size_t i;
  /* Our own process group: Ctrl-C at the terminal reaches the parent only,
  ** and terminating the worker's group takes its children too. */
  setpgid(0, 0);
  /* Die with the parent process; if it died before we listened, nobody
  ** will signal us: getppid tells.  Without /proc, the parent-death signal
  ** of the thread that started us is the fallback. */
  memset(&died, 0, sizeof died);
  died.sa_handler = on_parent_death;
  sigemptyset(&died.sa_mask);
  sigaction(PARENT_DIED, &died, NULL);
  if (!hold_lifeline(lifeline)) prctl(PR_SET_PDEATHSIG, PARENT_DIED);
  if (getppid() != parent) _exit(1);
  /* As exec would: a handler the parent installed for these is dropped, so
  ** SIGTERM and SIGINT terminate the worker; an ignored signal stays so. */
  for (i = 0; i < sizeof resets / sizeof resets[0]; i++) {
    struct sigaction sa;
    if (sigaction(resets[i], NULL, &sa) == 0 && sa.sa_handler != SIG_IGN) {
      sa.sa_handler = SIG_DFL;
      sa.sa_flags = 0;
      sigaction(resets[i], &sa, NULL);
    }
  }
  /* Nothing the parent blocked stays blocked (a join blocks SIGINT, a
  ** host may block anything), as in a fresh program. */
  sigemptyset(&set);
  sigprocmask(SIG_SETMASK, &set, NULL);
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

/* Message handler: {text = traceback .. "\n" .. message, value = error}.
** The traceback comes first so that the report ends with the message, as a
** Python traceback does. */
static int make_report(lua_State *L) {
  lua_createtable(L, 0, 3);
  lua_pushvalue(L, 1);
  lua_setfield(L, -2, "value");
  luaL_traceback(L, L, NULL, 1);
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

/* Protected, on the worker's thread: fn at 1, args at 2, rank at 3.
** Objects the worker inherited are its own from now on (a decoded one
** already is); leaves fn, rank and the unpacked args, ready to call. */
static int prepare_call(lua_State *L) {
  lua_Integer n, i;
  mp_sharing_attach(L, 1);
  mp_sharing_attach(L, 2);
  n = count_args(L, 2);
  luaL_checkstack(L, (int)n + 2, "too many arguments");
  lua_pushvalue(L, 1);
  lua_pushvalue(L, 3);
  for (i = 1; i <= n; i++) lua_geti(L, 2, i);
  return (int)n + 2;
}

/* Protected: fn at 1, args at 2, rank at 3, the report channel at 4.
** Runs fn on a fresh thread, so the traceback shows the worker's frames
** only, reports, and returns the exit code. */
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
  lua_xmove(L, co, 3);
  status = lua_pcall(co, 3, LUA_MULTRET, 1);
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

/* Pushes this worker's identity table (MP_WORKER_KEY), a new one when
** 'fresh' (a fork keeps its parent's, which may be a worker too). */
static void push_identity(lua_State *L, int fresh) {
  if (!fresh && lua_getfield(L, LUA_REGISTRYINDEX, MP_WORKER_KEY) == LUA_TTABLE)
    return;                                         /* id */
  if (!fresh) lua_pop(L, 1);
  lua_createtable(L, 0, 2);                         /* id */
  lua_pushvalue(L, -1);                             /* id id */
  lua_setfield(L, LUA_REGISTRYINDEX, MP_WORKER_KEY);  /* id */
}

void mp_worker_daemon(lua_State *L, int daemon) {
  push_identity(L, 1);
  lua_pushboolean(L, daemon);
  lua_setfield(L, -2, "daemon");
  lua_pop(L, 1);
}

/* The script a plain worker's title names: the parent's arg[0] (the
** script lua5.4 ran), else the chunk fn was defined in. */
static void push_script(lua_State *L, int fn) {
  int top = lua_gettop(L);
  lua_Debug ar;
  if (lua_getglobal(L, "arg") == LUA_TTABLE &&        /* arg */
      lua_rawgeti(L, -1, 0) == LUA_TSTRING) {         /* arg script */
    lua_remove(L, -2);                                /* script */
    return;
  }
  lua_settop(L, top);                                 /* */
  lua_pushvalue(L, fn);                               /* fn */
  if (lua_getinfo(L, ">S", &ar))                      /* */
    lua_pushstring(L, ar.short_src);                  /* script */
  else
    lua_pushliteral(L, "?");
}

/* "lua worker <rank>/<n> (<script>)", until the worker sets its own. */
static void set_default_title(lua_State *L, int fn, int rank, int nprocs) {
  size_t len;
  const char *title;
  push_script(L, fn);                                 /* script */
  title = lua_pushfstring(L, "lua worker %d/%d (%s)", rank, nprocs,
                          lua_tostring(L, -1));       /* script title */
  len = lua_rawlen(L, -1);
  mp_title_set(L, title, len);
  lua_pop(L, 2);                                      /* */
}

void mp_worker_run(lua_State *L, int fn, int args, int rank, int nprocs,
                   const mp_ReportTo *to) {
  int code = 1;
  fn = lua_absindex(L, fn);
  args = lua_absindex(L, args);
  set_default_title(L, fn, rank, nprocs);
  push_identity(L, 0);
  lua_pushinteger(L, rank);
  lua_setfield(L, -2, "rank");
  lua_pop(L, 1);
  watch_exit(to->fd, rank);
  mp_sharing_worker(L, getppid());
  mp_ledger_open(L, to->fd, mp_reports_ledger_at(rank));
  /* Nothing may unwind past here: in a fork, what lies below is a copy
  ** of the parent's stack. */
  lua_pushcfunction(L, run_worker);
  lua_pushvalue(L, fn);
  lua_pushvalue(L, args);
  lua_pushinteger(L, rank);
  lua_pushlightuserdata(L, (void *)(size_t)to);
  if (lua_pcall(L, 4, 1, 0) == LUA_OK)
    code = (int)lua_tointeger(L, -1);
  else
    fprintf(stderr, "multiprocessing: process %d failed before it could "
                    "report: %s\n", rank, lua_tostring(L, -1));
  /* Our own output only: the parent flushed its buffers before forking. */
  fflush(NULL);
  /* No __gc runs before _exit: the file_system references our arrays hold
  ** are given back here (the report holds its receiver's own). */
  mp_array_exit(L);
  record_exit(code);
  _exit(code);
}
