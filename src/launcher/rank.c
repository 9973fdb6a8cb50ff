/*
** rank.c -- a launcher's rank, on the worker's side: the descriptors it
** was given become its stdin, stdout and stderr (_rank_stdio), its
** environment is set (_setenv), and a program is run as the worker's child
** and waited for (_run_program), so that the worker's parent-death
** handling still covers the program and whatever it starts.
*/
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launcher.h"
#include "../proc.h"

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
    int fd = lnc_take(L, i + 1);
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
  const char *name = luaL_checklstring(L, 1, NULL);
  const char *value = luaL_checklstring(L, 2, NULL);
  if (setenv(name, value, 1) != 0)
    return luaL_error(L, "cannot set %s: %s", name, strerror(errno));
  return 0;
}

/* _run_program({prog, args...}): runs the program as the worker's child in
** the worker's process group, and leaves as it did: with its exit code,
** or killed by its signal.  The worker stays, ignoring SIGINT, SIGTERM and
** SIGHUP (they reach the program through the group), so that its
** parent-death handling still takes the program and whatever the program
** started.  Raises when the program cannot be run; else never returns. */
static int l_run_program(lua_State *L) {
  static const int passed[] = {SIGINT, SIGTERM, SIGHUP};
  int n, i, code, err = 0, errpipe[2];
  siginfo_t si;
  char **argv;
  sigset_t all, old;
  pid_t pid;
  luaL_checktype(L, 1, LUA_TTABLE);
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
    mp_wait_child(pid, -1, &si, 0);
  else if (pid > 0)
    err = 0;
  close(errpipe[0]);
  if (err != 0) {  /* the worker's error: no position of ours in it */
    lua_pushfstring(L, "cannot run %s: %s", argv[0], strerror(err));
    return lua_error(L);
  }
  if (mp_wait_child(pid, -1, &si, 0) < 0) _exit(127);
  code = mp_exit_code(&si);  /* proc.c, compiled in */
  if (code < 0) {
    int sig = -code;
    sigset_t one;
    signal(sig, SIG_DFL);
    sigemptyset(&one);
    sigaddset(&one, sig);
    sigprocmask(SIG_UNBLOCK, &one, NULL);
    raise(sig);
    _exit(128 + sig);
  }
  _exit(code);
}

void lnc_open_rank(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"_rank_stdio", l_rank_stdio}, {"_setenv", l_setenv},
    {"_run_program", l_run_program}, {NULL, NULL}
  };
  luaL_setfuncs(L, funcs, 0);
}
