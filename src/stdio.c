/*
** stdio.c -- descriptors for supervisors: what a launcher built on the
** library (mprun) needs from C to give each worker its own stdout and
** stderr and to relay them, line by line, to one console.
**
**   Fd       an owned descriptor (pipe end, log file, signalfd) that crosses
**            to a worker through the codec, so a spawned worker can take it
**            as its stdout;
**   Relay    reads the workers' pipes, copies the raw bytes to log files,
**            and writes whole, prefixed lines to the console, one rank's
**            line never split by another's; it also draws and erases a
**            status line, and waits on the contexts' pidfds and a signalfd
**            in the same poll(2);
**   worker side: _rank_stdio (dup2 onto 0, 1, 2), _setenv, _run_program (a
**            program started and waited for by the worker, so the worker's
**            parent-death handling still covers it and its children);
**   parent side: _pipe, _open, _makedirs, _signalfd (mprun blocks the
**            signals it handles and reads them: no handler), _ctx_signal
**            (a context's workers and their process groups), _nofile,
**            _cpus (and core.c's _isatty, _now).
** Everything here is internal (names start with "_"): the public face is
** lua/multiprocessing/mprun.lua.
*/
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/pidfd.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "codec.h"
#include "mp.h"

#define FD_T    "multiprocessing.Fd"
#define RELAY_T "multiprocessing.Relay"

#define READ_SIZE   (256 * 1024)   /* one read from a worker's pipe */
#define PIPE_SIZE   (1024 * 1024)  /* asked for each pipe (best effort) */
#define OUT_FLUSH   (256 * 1024)   /* console bytes buffered before a write */
#define LINE_MAX_   (1024 * 1024)  /* a longer partial line is cut */

/* --- Fd: an owned descriptor --------------------------------------------- */

typedef struct Fd { int fd; } Fd;

static Fd *push_fd(lua_State *L, int fd) {
  Fd *f = lua_newuserdatauv(L, sizeof *f, 0);
  f->fd = fd;
  luaL_setmetatable(L, FD_T);
  return f;
}

static Fd *check_fd(lua_State *L, int arg) {
  Fd *f = mp_checkudata(L, arg, FD_T);
  if (f->fd < 0) luaL_error(L, "the descriptor is closed");
  return f;
}

/* Takes the descriptor out of the Fd at 'arg' (nil: -1). */
static int take_fd(lua_State *L, int arg) {
  Fd *f;
  int fd;
  if (lua_isnoneornil(L, arg)) return -1;
  f = check_fd(L, arg);
  fd = f->fd;
  f->fd = -1;
  return fd;
}

static int fd_close(lua_State *L) {
  Fd *f = mp_checkudata(L, 1, FD_T);
  if (f->fd >= 0) close(f->fd);
  f->fd = -1;
  return 0;
}

static int fd_fileno(lua_State *L) {
  lua_pushinteger(L, check_fd(L, 1)->fd);
  return 1;
}

static int fd_tostring(lua_State *L) {
  Fd *f = mp_checkudata(L, 1, FD_T);
  if (f->fd < 0)
    lua_pushliteral(L, "Fd (closed)");
  else
    lua_pushfstring(L, "Fd (%d)", f->fd);
  return 1;
}

/* The codec sends the descriptor itself; the receiver owns its copy. */
static void fd_encode(lua_State *L, int idx, mp_Writer *w) {
  Fd *f = lua_touserdata(L, idx);
  if (f->fd < 0) luaL_error(L, "cannot send a closed descriptor");
  mp_write_fd(L, w, f->fd);
}

static void fd_decode(lua_State *L, mp_Reader *r) {
  int fd = mp_read_fd(L, r);
  push_fd(L, fd);
}

static const mp_CodecType fd_codec = {FD_T, fd_encode, fd_decode};

/* _pipe() -> read end (non-blocking), write end; both close-on-exec. */
static int l_pipe(lua_State *L) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0)
    return luaL_error(L, "cannot make a pipe: %s", strerror(errno));
  fcntl(p[0], F_SETFL, fcntl(p[0], F_GETFL) | O_NONBLOCK);
  fcntl(p[0], F_SETPIPE_SZ, PIPE_SIZE);  /* fewer wake-ups; may be refused */
  push_fd(L, p[0]);
  push_fd(L, p[1]);
  return 2;
}

/* _open(path, "r"|"w") -> Fd, or nil, message.  "w" creates or truncates. */
static int l_open(lua_State *L) {
  const char *path = mp_checklstring(L, 1, NULL);
  const char *mode = mp_checklstring(L, 2, NULL);
  int flags = O_CLOEXEC | (mode[0] == 'w' ? O_WRONLY | O_CREAT | O_TRUNC
                                          : O_RDONLY);
  int fd = open(path, flags, 0644);
  if (fd < 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s", path, strerror(errno));
    return 2;
  }
  push_fd(L, fd);
  return 1;
}

/* _makedirs(path) -> true, or nil, message: mkdir -p. */
static int l_makedirs(lua_State *L) {
  size_t len, i;
  const char *path = mp_checklstring(L, 1, &len);
  char *buf = lua_newuserdatauv(L, len + 1, 0);
  memcpy(buf, path, len + 1);
  for (i = 1; i <= len; i++) {
    if (buf[i] != '/' && buf[i] != '\0') continue;
    buf[i] = '\0';
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) {
      lua_pushnil(L);
      lua_pushfstring(L, "cannot create %s: %s", buf, strerror(errno));
      return 2;
    }
    if (i < len) buf[i] = '/';
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* --- log directories that cannot be turned against their owner ----------
** Everything under the log dir is made from a descriptor of its parent
** (openat, mkdirat), never by path: a symlink planted by whoever else can
** write to a shared log dir is refused (O_NOFOLLOW), never followed, and
** files are created fresh (O_EXCL), never truncated. */

/* nil, why, reason: the caller names the path. */
static int fail_at(lua_State *L, int err) {
  lua_pushnil(L);
  if (err == EPERM)
    lua_pushliteral(L, "not a directory of this user's that only it can write");
  else
    lua_pushstring(L, strerror(err));
  lua_pushstring(L, err == EEXIST ? "exists" : err == EPERM ? "foreign" : "error");
  return 3;
}

/* A single path component: not empty, no '/', not "." or "..". */
static const char *check_component(lua_State *L, int arg) {
  const char *name = mp_checklstring(L, arg, NULL);
  luaL_argcheck(L, name[0] != '\0' && strchr(name, '/') == NULL &&
                   strcmp(name, ".") != 0 && strcmp(name, ".."), arg,
                "a single path component expected");
  return name;
}

/* _opendir(path) -> Fd of the directory 'path' (the user's own log dir,
** links followed as the user wrote them), or nil, why, reason. */
static int l_opendir(lua_State *L) {
  const char *path = mp_checklstring(L, 1, NULL);
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return fail_at(L, errno);
  push_fd(L, fd);
  return 1;
}

/* _subdir(dir, name, fresh) -> Fd of dir/name, or nil, message, reason
** ("exists", "foreign" or "error").  Made with mode 0755 when missing; an
** existing one is taken only when 'fresh' is false, it is a directory and
** not a link, owned by this user and writable by nobody else. */
static int l_subdir(lua_State *L) {
  int dir = check_fd(L, 1)->fd, fd;
  const char *name = check_component(L, 2);
  int fresh = lua_toboolean(L, 3);
  struct stat st;
  if (mkdirat(dir, name, 0755) != 0 && (errno != EEXIST || fresh))
    return fail_at(L, errno);
  fd = openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) return fail_at(L, errno);
  if (fstat(fd, &st) != 0 || st.st_uid != geteuid() ||
      (st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    close(fd);
    return fail_at(L, EPERM);
  }
  push_fd(L, fd);
  return 1;
}

/* _create(dir, name [, mode]) -> Fd (write only) of the new file dir/name,
** or nil, message, reason: never an existing file, never through a link. */
static int l_create(lua_State *L) {
  int dir = check_fd(L, 1)->fd;
  const char *name = check_component(L, 2);
  mode_t mode = (mode_t)luaL_optinteger(L, 3, 0644);
  int fd = openat(dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
                  O_CLOEXEC, mode);
  if (fd < 0) return fail_at(L, errno);
  push_fd(L, fd);
  return 1;
}

static int signal_arg(lua_State *L, int arg) {
  const char *name = mp_checklstring(L, arg, NULL);
  int sig = mp_signal_number(name);
  if (sig == 0)
    mp_argerror(L, arg, lua_pushfstring(L, "unknown signal '%s'", name));
  return sig;
}

/* _signalfd(name, ...) -> Fd: blocks these signals in this process and
** gives the descriptor they are read from.  For a program's own main (the
** launcher), never for a library user's process.  A signal inherited as
** ignored is taken over (a shell starts background jobs with SIGINT
** ignored, and `kill -INT` must still stop the job), except SIGHUP: nohup
** ignores it on purpose. */
static int l_signalfd(lua_State *L) {
  sigset_t set;
  int i, fd, n = lua_gettop(L);
  sigemptyset(&set);
  for (i = 1; i <= n; i++) {
    int sig = signal_arg(L, i);
    struct sigaction sa;
    if (sigaction(sig, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN) {
      if (sig == SIGHUP) continue;
      signal(sig, SIG_DFL);  /* blocked below: it is only queued */
    }
    sigaddset(&set, sig);
  }
  if (sigprocmask(SIG_BLOCK, &set, NULL) != 0 ||
      (fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK)) < 0)
    return luaL_error(L, "cannot watch signals: %s", strerror(errno));
  push_fd(L, fd);
  return 1;
}

/* _ctx_signal(ctx, name): the context's running workers and their process
** groups get the signal (their children too). */
static int l_ctx_signal(lua_State *L) {
  mp_Context *ctx = mp_checkcontext(L, 1);
  int sig = signal_arg(L, 2), i;
  if (getpid() != ctx->owner || ctx->closed) return 0;
  for (i = 0; i < ctx->started; i++) {
    mp_Worker *w = &ctx->workers[i];
    if (w->pidfd >= 0) mp_signal_worker(w, sig);
  }
  return 0;
}

/* _cpus() -> the CPUs this process may run on. */
static int l_cpus(lua_State *L) {
  cpu_set_t set;
  long n = 0;
  if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
  if (n < 1) n = sysconf(_SC_NPROCESSORS_ONLN);
  lua_pushinteger(L, n < 1 ? 1 : n);
  return 1;
}

/* _nofile([n]) -> the soft limit on open descriptors it replaced: sets
** it to n, or to the hard limit (a launcher holds several descriptors per
** rank; its ranks get the old limit back). */
static int l_nofile(lua_State *L) {
  struct rlimit rl;
  lua_Integer old;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
    return luaL_error(L, "getrlimit: %s", strerror(errno));
  old = rl.rlim_cur == RLIM_INFINITY ? -1 : (lua_Integer)rl.rlim_cur;
  if (lua_isnoneornil(L, 1))
    rl.rlim_cur = rl.rlim_max;
  else {
    lua_Integer n = mp_checkinteger(L, 1);
    rl.rlim_cur = n < 0 ? RLIM_INFINITY : (rlim_t)n;
  }
  setrlimit(RLIMIT_NOFILE, &rl);  /* best effort: a refusal keeps the old */
  lua_pushinteger(L, old);
  return 1;
}

/* --- the worker's side --------------------------------------------------- */

/* _rank_stdio(stdin|nil, stdout, stderr, linebuf): the Fds become
** descriptors 0, 1 and 2 (closed under their old numbers); with 'linebuf'
** stdout is line buffered, as on the terminal the launcher's output goes
** to.  The signal mask is emptied (a forked worker inherits the
** launcher's). */
static int l_rank_stdio(lua_State *L) {
  int i;
  sigset_t none;
  fflush(NULL);
  for (i = 0; i < 3; i++) {
    int fd = take_fd(L, i + 1);
    if (fd < 0) continue;
    if (fd != i) {
      while (dup2(fd, i) < 0 && errno == EINTR) {}
      close(fd);
    } else {
      fcntl(fd, F_SETFD, 0);
    }
  }
  if (lua_toboolean(L, 4)) setvbuf(stdout, NULL, _IOLBF, BUFSIZ);
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  return 0;
}

static int l_setenv(lua_State *L) {
  const char *name = mp_checklstring(L, 1, NULL);
  const char *value = mp_checklstring(L, 2, NULL);
  if (setenv(name, value, 1) != 0)
    return luaL_error(L, "cannot set %s: %s", name, strerror(errno));
  return 0;
}

static pid_t wait_child(pid_t pid, int *status) {
  pid_t r;
  while ((r = waitpid(pid, status, 0)) < 0 && errno == EINTR) {}
  return r;
}

/* _run_program({prog, args...}): runs the program as the worker's child in
** the worker's process group, and leaves as it did: with its exit code,
** or killed by its signal.  The worker stays, ignoring SIGINT, SIGTERM and
** SIGHUP (they reach the program through the group), so that its
** parent-death handling still takes the program and whatever the program
** started.  Raises when the program cannot be run; else never returns. */
static int l_run_program(lua_State *L) {
  static const int passed[] = {SIGINT, SIGTERM, SIGHUP};
  int n, i, status, err = 0, errpipe[2];
  char **argv;
  sigset_t all, old;
  pid_t pid;
  mp_checktype(L, 1, LUA_TTABLE);
  n = (int)luaL_len(L, 1);
  luaL_argcheck(L, n >= 1, 1, "no program");
  argv = lua_newuserdatauv(L, sizeof(char *) * ((size_t)n + 1), 0);
  for (i = 0; i < n; i++) {
    lua_geti(L, 1, i + 1);
    argv[i] = (char *)(size_t)luaL_checkstring(L, -1);
    lua_pop(L, 1);  /* the table keeps the string */
  }
  argv[n] = NULL;
  if (pipe2(errpipe, O_CLOEXEC) != 0)
    return luaL_error(L, "cannot run %s: %s", argv[0], strerror(errno));
  fflush(NULL);
  sigfillset(&all);
  sigprocmask(SIG_BLOCK, &all, &old);
  pid = fork();
  if (pid == 0) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execvp(argv[0], argv);
    err = errno;
    while (write(errpipe[1], &err, sizeof err) < 0 && errno == EINTR) {}
    _exit(127);
  }
  err = pid < 0 ? errno : 0;
  close(errpipe[1]);
  for (i = 0; pid > 0 && i < (int)(sizeof passed / sizeof passed[0]); i++)
    signal(passed[i], SIG_IGN);
  sigprocmask(SIG_SETMASK, &old, NULL);
  if (pid > 0 && read(errpipe[0], &err, sizeof err) == (ssize_t)sizeof err)
    wait_child(pid, &status);
  else if (pid > 0)
    err = 0;
  close(errpipe[0]);
  if (err != 0) {  /* the worker's error: no position of ours in it */
    lua_pushfstring(L, "cannot run %s: %s", argv[0], strerror(err));
    return lua_error(L);
  }
  if (wait_child(pid, &status) < 0) _exit(127);
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    sigset_t one;
    signal(sig, SIG_DFL);
    sigemptyset(&one);
    sigaddset(&one, sig);
    sigprocmask(SIG_UNBLOCK, &one, NULL);
    raise(sig);
    _exit(128 + sig);
  }
  _exit(WIFEXITED(status) ? WEXITSTATUS(status) : 127);
}

/* --- Relay --------------------------------------------------------------- */

typedef struct Out {
  int fd;
  int broken;        /* the console went away (EPIPE): output is dropped */
  char *buf;
  size_t len, cap;
} Out;

typedef struct Source {
  int fd;            /* the read end, -1 once closed */
  int console;       /* 1 or 2: that Out; 0: not shown */
  int file;          /* the raw bytes go here too, or -1 */
  char *prefix;
  size_t plen;
  char *line;        /* the partial line so far */
  size_t len, cap;
} Source;

typedef struct Relay {
  Out out[2];        /* the console's stdout and stderr */
  int status_fd;     /* where the status line is drawn */
  int status_shown;
  int file_err;      /* the first error writing a log file, or 0 */
  Source *src;
  size_t nsrc, capsrc;
  char *chunk;       /* READ_SIZE bytes */
  struct pollfd *pfd;    /* relay:wait's poll set */
  int *who;              /* for each entry: the index of its context, or 0 */
  size_t cappfd;
} Relay;

static Relay *check_relay(lua_State *L, int arg) {
  Relay *R = mp_checkudata(L, arg, RELAY_T);
  if (R->chunk == NULL) luaL_error(L, "the relay is closed");
  return R;
}

static int grow(char **buf, size_t *cap, size_t need) {
  size_t n = *cap ? *cap : 256;
  char *p;
  if (need <= *cap) return 1;
  while (n < need) n *= 2;
  p = realloc(*buf, n);
  if (p == NULL) return 0;
  *buf = p;
  *cap = n;
  return 1;
}

static void erase_status(Relay *R) {
  if (!R->status_shown) return;
  R->status_shown = 0;
  mp_write_all(R->status_fd, "\r\033[K", 4);
}

static void flush_out(Relay *R, Out *o) {
  if (o->len == 0) return;
  erase_status(R);
  if (!o->broken && mp_write_all(o->fd, o->buf, o->len) == EPIPE) o->broken = 1;
  o->len = 0;
}

static void flush_all(Relay *R) {
  flush_out(R, &R->out[0]);
  flush_out(R, &R->out[1]);
}

/* One console line: prefix, the partial line kept so far, then 'p' ('n'
** bytes); a newline is added when 'p' does not end one. */
static void emit(Relay *R, Source *s, const char *p, size_t n) {
  Out *o = &R->out[s->console - 1];
  size_t need = o->len + s->plen + s->len + n + 1;
  int nl = n > 0 && p[n - 1] == '\n';
  if (!o->broken && grow(&o->buf, &o->cap, need)) {
    memcpy(o->buf + o->len, s->prefix, s->plen);
    o->len += s->plen;
    if (s->len > 0) memcpy(o->buf + o->len, s->line, s->len);  /* line may be NULL */
    o->len += s->len;
    memcpy(o->buf + o->len, p, n);
    o->len += n;
    if (!nl) o->buf[o->len++] = '\n';
  }
  s->len = 0;
  if (o->len >= OUT_FLUSH) flush_out(R, o);
}

/* Bytes from a source: all of them to its file, whole lines to the
** console, the rest kept for the next read. */
static void feed(Relay *R, Source *s, const char *p, size_t n) {
  const char *end = p + n, *nl;
  int err;
  if (s->file >= 0 && (err = mp_write_all(s->file, p, n)) != 0) {
    close(s->file);  /* a full disk loses the log, not the console */
    s->file = -1;
    if (R->file_err == 0) R->file_err = err;  /* relay:close says so */
  }
  if (s->console == 0) return;
  while ((nl = memchr(p, '\n', (size_t)(end - p))) != NULL) {
    emit(R, s, p, (size_t)(nl - p) + 1);
    p = nl + 1;
  }
  if (p == end) return;
  if (!grow(&s->line, &s->cap, s->len + (size_t)(end - p))) {
    emit(R, s, p, (size_t)(end - p));  /* no memory: cut the line here */
    return;
  }
  memcpy(s->line + s->len, p, (size_t)(end - p));
  s->len += (size_t)(end - p);
  if (s->len >= LINE_MAX_) emit(R, s, "", 0);
}

/* The partial last line is shown with a newline; the log keeps it as is. */
static void close_source(Relay *R, Source *s) {
  if (s->console != 0 && s->len > 0) emit(R, s, "", 0);
  if (s->fd >= 0) close(s->fd);
  if (s->file >= 0) close(s->file);
  s->fd = s->file = -1;
  free(s->line);
  free(s->prefix);
  s->line = s->prefix = NULL;
  s->len = s->cap = 0;
}

/* One read: 1 when bytes came, 0 when there are none now, -1 when the
** source is finished (EOF or an error) and closed. */
static int read_source(Relay *R, Source *s) {
  ssize_t n;
  do n = read(s->fd, R->chunk, READ_SIZE); while (n < 0 && errno == EINTR);
  if (n > 0) {
    feed(R, s, R->chunk, (size_t)n);
    return 1;
  }
  if (n < 0 && errno == EAGAIN) return 0;
  close_source(R, s);
  return -1;
}

/* _relay(stdout_fd, stderr_fd, status_fd): the console descriptors are
** borrowed (1, 2, 2 for a launcher). */
static int l_relay(lua_State *L) {
  Relay *R = lua_newuserdatauv(L, sizeof *R, 0);
  memset(R, 0, sizeof *R);
  R->out[0].fd = (int)mp_checkinteger(L, 1);
  R->out[1].fd = (int)mp_checkinteger(L, 2);
  R->status_fd = (int)mp_checkinteger(L, 3);
  luaL_setmetatable(L, RELAY_T);
  R->chunk = malloc(READ_SIZE);
  if (R->chunk == NULL) return luaL_error(L, "not enough memory");
  return 1;
}

/* relay:add(read_end, console (0|1|2), prefix|nil, file|nil) -> id.
** Takes both descriptors from their Fds. */
static int relay_add(lua_State *L) {
  Relay *R = check_relay(L, 1);
  int console = (int)mp_checkinteger(L, 3);
  size_t plen = 0;
  const char *prefix = lua_isnoneornil(L, 4) ? "" : mp_checklstring(L, 4, &plen);
  Source *s;
  char *copy;
  luaL_argcheck(L, console >= 0 && console <= 2, 3, "0, 1 or 2 expected");
  check_fd(L, 2);
  if (!lua_isnoneornil(L, 5)) check_fd(L, 5);
  if (R->nsrc == R->capsrc) {
    size_t cap = R->capsrc ? 2 * R->capsrc : 16;
    Source *p = realloc(R->src, cap * sizeof *p);
    if (p == NULL) return luaL_error(L, "not enough memory");
    R->src = p;
    R->capsrc = cap;
  }
  copy = malloc(plen + 1);
  if (copy == NULL) return luaL_error(L, "not enough memory");
  memcpy(copy, prefix, plen + 1);
  s = &R->src[R->nsrc];
  memset(s, 0, sizeof *s);
  s->fd = take_fd(L, 2);
  s->file = take_fd(L, 5);
  s->console = console;
  s->prefix = copy;
  s->plen = plen;
  lua_pushinteger(L, (lua_Integer)++R->nsrc);
  return 1;
}

static Source *check_source(lua_State *L, Relay *R, int arg) {
  lua_Integer id = mp_checkinteger(L, arg);
  luaL_argcheck(L, id >= 1 && (size_t)id <= R->nsrc, arg, "no such source");
  return &R->src[id - 1];
}

/* relay:drain(id): reads what the source holds now, then closes it (its
** writer is gone: whatever it wrote is in the pipe). */
static int relay_drain(lua_State *L) {
  Relay *R = check_relay(L, 1);
  Source *s = check_source(L, R, 2);
  while (s->fd >= 0 && read_source(R, s) > 0) {}
  close_source(R, s);
  flush_all(R);
  return 0;
}

/* Room for 'n' entries in the poll set. */
static void pollroom(lua_State *L, Relay *R, size_t n) {
  struct pollfd *p;
  int *w;
  if (n <= R->cappfd) return;
  n *= 2;
  p = realloc(R->pfd, n * sizeof *p);
  if (p != NULL) R->pfd = p;
  w = realloc(R->who, n * sizeof *w);
  if (w != NULL) R->who = w;
  if (p == NULL || w == NULL) luaL_error(L, "not enough memory");
  R->cappfd = n;
}

static void pollset_add(lua_State *L, Relay *R, size_t *n, int fd, int who) {
  pollroom(L, R, *n + 1);
  R->pfd[*n].fd = fd;
  R->pfd[*n].events = POLLIN;
  R->who[(*n)++] = who;
}

/* The poll set: open sources (who 0), the pidfds of the running workers of
** contexts[1..nctx] (who = that index), the signalfd (who -1). */
static size_t pollset(lua_State *L, Relay *R, int nctx, int sigfd) {
  size_t n = 0, k;
  int i, j;
  for (k = 0; k < R->nsrc; k++)
    if (R->src[k].fd >= 0) pollset_add(L, R, &n, R->src[k].fd, 0);
  for (i = 1; i <= nctx; i++) {
    mp_Context *ctx;
    lua_geti(L, 3, i);
    ctx = luaL_testudata(L, -1, MP_CONTEXT_T);
    lua_pop(L, 1);  /* the table keeps it */
    if (ctx == NULL || ctx->closed) continue;
    for (j = 0; j < ctx->started; j++)
      if (ctx->workers[j].state == MP_RUNNING && ctx->workers[j].pidfd >= 0)
        pollset_add(L, R, &n, ctx->workers[j].pidfd, i);
  }
  if (sigfd >= 0) pollset_add(L, R, &n, sigfd, -1);
  return n;
}

static Source *source_of(Relay *R, int fd) {
  size_t k;
  for (k = 0; k < R->nsrc; k++)
    if (R->src[k].fd == fd) return &R->src[k];
  return NULL;
}

/* relay:wait(timeout, contexts, signalfd|nil) -> exited, signal
** Relays output until a worker of contexts[i] (i = 1..contexts.n; other
** values are skipped) exits, a signal comes or 'timeout' seconds pass
** (negative: no limit).  'exited' lists those i; 'signal' is the name of
** the signal read, or nil. */
static int relay_wait(lua_State *L) {
  Relay *R = check_relay(L, 1);
  double timeout = mp_checknumber(L, 2);
  double deadline = timeout < 0 ? INFINITY : mp_now() + timeout;
  int nctx, sigfd = -1, signo = 0, nexited = 0;
  mp_checktype(L, 3, LUA_TTABLE);
  if (!lua_isnoneornil(L, 4)) sigfd = check_fd(L, 4)->fd;
  lua_getfield(L, 3, "n");
  nctx = (int)lua_tointeger(L, -1);
  lua_pop(L, 1);
  lua_newtable(L);  /* exited */
  for (;;) {
    double left = deadline - mp_now();
    int ms = isinf(deadline) ? -1 : left <= 0 ? 0
           : left > INT_MAX / 1000 ? INT_MAX : (int)ceil(left * 1000);
    size_t n = pollset(L, R, nctx, sigfd), k;
    int r;
    flush_all(R);
    r = poll(R->pfd, (nfds_t)n, ms);
    if (r < 0 && errno != EINTR)
      return luaL_error(L, "poll: %s", strerror(errno));
    for (k = 0; r > 0 && k < n; k++) {
      struct signalfd_siginfo ssi;
      Source *s;
      if (R->pfd[k].revents == 0) continue;
      if (R->who[k] > 0) {
        lua_pushinteger(L, R->who[k]);
        lua_rawseti(L, -2, ++nexited);
      } else if (R->who[k] < 0) {
        if (read(sigfd, &ssi, sizeof ssi) == (ssize_t)sizeof ssi)
          signo = (int)ssi.ssi_signo;
      } else if ((s = source_of(R, R->pfd[k].fd)) != NULL) {
        read_source(R, s);
      }
    }
    if (nexited > 0 || signo != 0 || mp_now() >= deadline) break;
  }
  flush_all(R);
  if (signo == 0) return 1;
  lua_pushstring(L, mp_signal_name(signo));
  return 2;
}

/* relay:status(text|nil): draws the status line (no newline), or erases
** it; output lines erase it before they are written. */
static int relay_status(lua_State *L) {
  Relay *R = check_relay(L, 1);
  size_t len;
  const char *text = lua_isnoneornil(L, 2) ? NULL : mp_checklstring(L, 2, &len);
  flush_all(R);
  if (text == NULL) {
    erase_status(R);
    return 0;
  }
  lua_pushfstring(L, "\r%s\033[K", text);
  text = lua_tolstring(L, -1, &len);
  mp_write_all(R->status_fd, text, len);
  R->status_shown = 1;
  return 0;
}

/* relay:close() -> nil, or the error that cut a log file short: every
** source closed (partial lines shown), output flushed, the status line
** erased.  Also __gc and __close. */
static int relay_close(lua_State *L) {
  Relay *R = mp_checkudata(L, 1, RELAY_T);
  size_t k;
  if (R->chunk == NULL) return 0;
  if (R->file_err != 0)
    lua_pushfstring(L, "a log file could not be written: %s",
                    strerror(R->file_err));
  else
    lua_pushnil(L);
  for (k = 0; k < R->nsrc; k++) close_source(R, &R->src[k]);
  flush_all(R);
  erase_status(R);
  free(R->out[0].buf);
  free(R->out[1].buf);
  free(R->src);
  free(R->pfd);
  free(R->who);
  free(R->chunk);
  memset(R, 0, sizeof *R);
  return 1;
}

/* --- registration -------------------------------------------------------- */

void mp_open_stdio(lua_State *L) {
  static const luaL_Reg fd_meta[] = {
    {"__gc", fd_close}, {"__close", fd_close}, {"__tostring", fd_tostring},
    {NULL, NULL}
  };
  static const luaL_Reg fd_methods[] = {
    {"close", fd_close}, {"fileno", fd_fileno}, {NULL, NULL}
  };
  static const luaL_Reg relay_meta[] = {
    {"__gc", relay_close}, {"__close", relay_close}, {NULL, NULL}
  };
  static const luaL_Reg relay_methods[] = {
    {"add", relay_add}, {"drain", relay_drain}, {"wait", relay_wait},
    {"status", relay_status}, {"close", relay_close}, {NULL, NULL}
  };
  static const luaL_Reg funcs[] = {
    {"_pipe", l_pipe}, {"_open", l_open}, {"_makedirs", l_makedirs},
    {"_opendir", l_opendir}, {"_subdir", l_subdir}, {"_create", l_create},
    {"_signalfd", l_signalfd}, {"_ctx_signal", l_ctx_signal},
    {"_cpus", l_cpus}, {"_nofile", l_nofile},
    {"_rank_stdio", l_rank_stdio}, {"_setenv", l_setenv},
    {"_run_program", l_run_program}, {"_relay", l_relay}, {NULL, NULL}
  };
  mp_new_class(L, FD_T, fd_meta, fd_methods);
  lua_pop(L, 1);
  mp_new_class(L, RELAY_T, relay_meta, relay_methods);
  lua_pop(L, 1);
  mp_codec_register(L, &fd_codec);
  luaL_setfuncs(L, funcs, 0);
}
