/*
** launcher.c -- multiprocessing.launcher: the module, and the descriptors
** a launcher makes for its ranks (pipes, log files, directories, the
** signalfd) and its descriptor limit.  Everything here is internal (names
** start with "_"): the public face is lua/multiprocessing/mprun.lua.
** Descriptors are returned as the core's Fd objects, so that they cross to
** workers through the core's codec.
*/
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "launcher.h"

#define PIPE_SIZE (1024 * 1024)                  /* asked for each pipe */

/* --- pipes and plain files ----------------------------------------------- */

/* _pipe() -> read end (non-blocking), write end; both close-on-exec. */
static int l_pipe(lua_State *L) {
  int p[2];
  if (pipe2(p, O_CLOEXEC) != 0) {  /* no position: a condition, not a bug */
    lua_pushfstring(L, "cannot make a pipe: %s", strerror(errno));
    return lua_error(L);
  }
  fcntl(p[0], F_SETFL, O_NONBLOCK);  /* a new read end has no other flag */
  fcntl(p[0], F_SETPIPE_SZ, PIPE_SIZE);  /* fewer wake-ups; may be refused */
  if (lnc_wrap_fd(L, p[1]) != LUA_OK) {    /* the write end first: no leak */
    close(p[0]);
    return lua_error(L);
  }
  lnc_push_fd(L, p[0]);                    /* w r */
  lua_insert(L, -2);                       /* r w */
  return 2;
}

/* _open(path, "r"|"w") -> Fd, or nil, message: /dev/null and the like
** ("w" does not create). */
static int l_open(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  const char *mode = luaL_checkstring(L, 2);
  int fd = open(path, O_CLOEXEC | (mode[0] == 'w' ? O_WRONLY : O_RDONLY));
  if (fd < 0) {
    lua_pushnil(L);
    lua_pushfstring(L, "%s: %s", path, strerror(errno));
    return 2;
  }
  lnc_push_fd(L, fd);
  return 1;
}

/* _makedirs(path) -> true, or nil, message: mkdir -p of the user's own
** log dir. */
static int l_makedirs(lua_State *L) {
  size_t len, i;
  const char *path = luaL_checklstring(L, 1, &len);
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
  const char *name = luaL_checkstring(L, arg);
  luaL_argcheck(L, name[0] != '\0' && strchr(name, '/') == NULL &&
                   strcmp(name, ".") != 0 && strcmp(name, "..") != 0, arg,
                "a single path component expected");
  return name;
}

/* _opendir(path) -> Fd of the directory 'path' (the user's own log dir,
** links followed as the user wrote them), or nil, why, reason. */
static int l_opendir(lua_State *L) {
  const char *path = luaL_checkstring(L, 1);
  int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return fail_at(L, errno);
  lnc_push_fd(L, fd);
  return 1;
}

/* _subdir(dir, name, fresh) -> Fd of dir/name, or nil, why, reason
** ("exists", "foreign" or "error").  Made with mode 0755 when missing; an
** existing one is taken only when 'fresh' is false, it is a directory and
** not a link, owned by this user and writable by nobody else. */
static int l_subdir(lua_State *L) {
  int dir = lnc_fileno(L, 1), fd;
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
  lnc_push_fd(L, fd);
  return 1;
}

/* _create(dir, name [, mode]) -> Fd (write only) of the new file dir/name,
** or nil, why, reason: never an existing file, never through a link. */
static int l_create(lua_State *L) {
  int dir = lnc_fileno(L, 1);
  const char *name = check_component(L, 2);
  mode_t mode = (mode_t)luaL_optinteger(L, 3, 0644);
  int fd = openat(dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW |
                  O_CLOEXEC, mode);
  if (fd < 0) return fail_at(L, errno);
  lnc_push_fd(L, fd);
  return 1;
}

/* _write(fd, s) -> true, or nil, message: all of 's' to the Fd (a log
** file of mprun's own: error.json, events.jsonl). */
static int l_write(lua_State *L) {
  size_t len;
  int fd = lnc_fileno(L, 1), err;
  const char *s = luaL_checklstring(L, 2, &len);
  if ((err = mp_write_all(fd, s, len)) != 0) {
    lua_pushnil(L);
    lua_pushstring(L, strerror(err));
    return 2;
  }
  lua_pushboolean(L, 1);
  return 1;
}

/* --- signals and limits -------------------------------------------------- */

/* _signalfd(signum, ...) -> Fd: blocks these signals in this process and
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
    int sig = (int)luaL_checkinteger(L, i);
    struct sigaction sa;
    luaL_argcheck(L, sig > 0 && sig < NSIG, i, "a signal number expected");
    if (sigaction(sig, NULL, &sa) == 0 && sa.sa_handler == SIG_IGN) {
      if (sig == SIGHUP) continue;
      signal(sig, SIG_DFL);  /* blocked below: it is only queued */
    }
    sigaddset(&set, sig);
  }
  if (sigprocmask(SIG_BLOCK, &set, NULL) != 0 ||
      (fd = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK)) < 0)
    return luaL_error(L, "cannot watch signals: %s", strerror(errno));
  lnc_push_fd(L, fd);
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
    lua_Integer n = luaL_checkinteger(L, 1);
    rl.rlim_cur = n < 0 ? RLIM_INFINITY : (rlim_t)n;
  }
  setrlimit(RLIMIT_NOFILE, &rl);  /* best effort: a refusal keeps the old */
  lua_pushinteger(L, old);
  return 1;
}

/* _executable(path) -> true, or nil, message, status: whether execvp would
** find and run 'path' (a name without '/' is looked up in PATH); status
** 127 (not found) or 126 (found, not runnable), as a shell says. */
static int l_executable(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  const char *path = getenv("PATH");
  int err = ENOENT;
  if (strchr(name, '/') != NULL) {
    struct stat st;
    if (stat(name, &st) != 0) err = errno;
    else if (S_ISDIR(st.st_mode)) err = EISDIR;
    else err = access(name, X_OK) == 0 ? 0 : errno;
  } else {
    luaL_Buffer b;
    const char *p = path ? path : "/usr/local/bin:/usr/bin:/bin";
    while (err != 0 && *p != '\0') {
      size_t n = strcspn(p, ":");
      struct stat st;
      const char *full;
      luaL_buffinit(L, &b);
      if (n == 0) luaL_addchar(&b, '.');
      else luaL_addlstring(&b, p, n);
      luaL_addchar(&b, '/');
      luaL_addstring(&b, name);
      luaL_pushresult(&b);
      full = lua_tostring(L, -1);
      if (stat(full, &st) == 0 && !S_ISDIR(st.st_mode))
        err = access(full, X_OK) == 0 ? 0 : (err == ENOENT ? EACCES : err);
      lua_pop(L, 1);
      p += n + (p[n] == ':');
    }
  }
  if (err == 0) {
    lua_pushboolean(L, 1);
    return 1;
  }
  lua_pushnil(L);
  lua_pushfstring(L, "%s: %s", name,
                  err == ENOENT && strchr(name, '/') == NULL ? "command not found"
                                                             : strerror(err));
  lua_pushinteger(L, err == ENOENT ? 127 : 126);
  return 3;
}

/* --- the module ---------------------------------------------------------- */

LUAMOD_API int luaopen_multiprocessing_launcher(lua_State *L);

/* _path() -> the absolute path of the file this module was loaded from,
** or nil: mprun hands it to its ranks, which load it by that path
** (package.loadlib) instead of searching package.path and package.cpath
** for it, a dozen failed opens in every rank.  A function, not a field:
** the ranks that load the module need not resolve it. */
static int l_path(lua_State *L) {
  const char *name;
  char *real = mp_file_of((const void *)(size_t)luaopen_multiprocessing_launcher,
                          &name);
  if (real == NULL) lua_pushnil(L);
  else lua_pushstring(L, real);
  free(real);
  return 1;
}

__attribute__((visibility("default")))
int luaopen_multiprocessing_launcher(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"_pipe", l_pipe}, {"_open", l_open}, {"_makedirs", l_makedirs},
    {"_opendir", l_opendir}, {"_subdir", l_subdir}, {"_create", l_create},
    {"_write", l_write}, {"_signalfd", l_signalfd}, {"_nofile", l_nofile},
    {"_executable", l_executable}, {"_path", l_path}, {NULL, NULL}
  };
  lua_getglobal(L, "require");                      /* require */
  lua_pushliteral(L, "multiprocessing.core");
  lua_call(L, 1, 1);                                /* core */
  lua_getfield(L, -1, "_fd");                       /* core _fd */
  luaL_checktype(L, -1, LUA_TFUNCTION);
  lua_setfield(L, LUA_REGISTRYINDEX, FD_NEW);       /* core */
  lua_pop(L, 1);
  luaL_newlib(L, funcs);                            /* M */
  lnc_open_relay(L);
  lnc_open_rank(L);
  return 1;
}
