/*
** start_spawn.c -- the "spawn" start method: each worker is a fresh
** interpreter (see executable.c) that loads the core and nothing else, maps
** the context's payload (payload.c) and runs fn.  Safe in a threaded host:
** the parent only clone+execs (launch.c).
**
** A worker's descriptors are mp_worker_fds as 3, 4, ... (mp_WorkerFd):
** 3 the payload, 4 the reports, 5 its end of the reports' socket, 6 the
** context's lifeline (worker.c), then the codec's (shared memory the args
** carry), and, for worker 0 of an executable not yet verified, the hello
** pipe last.  Its command line (multiprocessing.h):
**   <exe> -e '<mark> <load the core>._spawn_main(rank, parent pid, nfds,
**            hello fd or -1)'
** The first start with an executable chosen by set_executable waits for
** the hello of worker 0 (executable.c): a program that does not run the
** protocol fails the start, named, at once.
*/
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "mp.h"

#define FD_FIRST 3   /* slot k of mp_worker_fds is descriptor FD_FIRST + k */

/* Launches every worker, each its own clone+exec. */
static int spawn_launch(lua_State *L, mp_Context *ctx, int exe,
                        const int *fixed, int nfds) {
  const char *path = lua_tostring(L, exe);
  mp_Detach d;  /* who we are, our handlers: once for all the workers */
  int i, err = 0, hello[2] = {-1, -1};
  int *fds = lua_newuserdatauv(L, sizeof(int) * (size_t)(nfds + 1), 0);
  for (i = 0; i < nfds; i++) fds[i] = fixed[i];
  mp_detach_learn(&d, -1);
  if (!mp_executable_verified(L, path)) {
    if (pipe2(hello, O_CLOEXEC) != 0)
      return mp_push_errno(L, "pipe", errno);
    fds[nfds] = hello[1];          /* worker 0's, after the others */
  }
  for (i = ctx->first; i < ctx->last && err == 0; i++) {
    mp_Worker *w = &ctx->workers[i];
    int says_hello = i == ctx->first && hello[1] >= 0;
    char *argv[4], **envp, call[112];
    snprintf(call, sizeof call, "_spawn_main(%d,%ld,%d,%d,%d,%d)", i,
             (long)d.parent, nfds - MP_WFD_NFIXED,
             says_hello ? FD_FIRST + nfds : -1, ctx->nprocs, d.main_thread);
    envp = mp_push_argv(L, exe, call, argv);              /* ... envp */
    err = mp_launch(L, path, argv, envp, fds, nfds + says_hello, d.handled,
                    &w->pid, &w->pidfd);                  /* ... envp [msg] */
    if (err == 0) {
      mp_started(ctx, i);
      lua_pop(L, 1);                                      /* ... */
    }
  }
  if (hello[1] >= 0) {
    close(hello[1]);  /* EOF once worker 0 closed it (or never ran) */
    if (err == 0) err = mp_await_hello(L, hello[0], path);
    close(hello[0]);
  }
  return err;
}

static int spawn_start(lua_State *L, mp_Context *ctx, int ctxidx, int fn,
                       int args) {
  return mp_start_fresh(L, ctx, ctxidx, fn, args, spawn_launch);
}

const mp_StartMethod mp_start_spawn = {"spawn", spawn_start};

/* Sets close-on-exec on what we inherited, so that the worker's own
** children (os.execute) do not (the only descriptor flag there is). */
static void keep_private(int fd) {
  fcntl(fd, F_SETFD, FD_CLOEXEC);
}

/* _spawn_main(rank, parent_pid, nfds, hello_fd, nprocs, main_thread): in
** the fresh interpreter ('main_thread': the parent's main thread started
** it), with the descriptors of mp_worker_fds from FD_FIRST on
** ('nfds' of them the codec's); never returns. */
static int l_spawn_main(lua_State *L) {
  int rank = (int)luaL_checkinteger(L, 1);
  pid_t parent = (pid_t)luaL_checkinteger(L, 2);
  int nfds = (int)luaL_checkinteger(L, 3), i;
  int hello = (int)luaL_checkinteger(L, 4);
  int nprocs = (int)luaL_checkinteger(L, 5);
  int main_thread = (int)luaL_checkinteger(L, 6);
  int *fds;
  mp_ReportTo to;
  mp_Detach d;
  mp_boot_done();
  luaL_argcheck(L, nfds >= 0 && nfds <= MP_LAUNCH_MAXFDS, 3, "bad count");
  mp_detach_fresh(&d, parent, FD_FIRST + MP_WFD_LIFELINE, main_thread);
  mp_worker_detach(&d, -1);
  /* hello: this program runs the protocol */
  if (hello >= 0) {
    (void)!write(hello, "", 1);
    close(hello);
  }
  to.fd = FD_FIRST + MP_WFD_REPORTS;
  to.sock = FD_FIRST + MP_WFD_RSOCK;
  to.table = NULL;  /* marks are written with pwrite */
  keep_private(FD_FIRST + MP_WFD_PAYLOAD);
  keep_private(to.fd);
  keep_private(to.sock);
  fds = lua_newuserdatauv(L, sizeof(int) * (size_t)(nfds + 1), 0);
  for (i = 0; i < nfds; i++) {
    fds[i] = FD_FIRST + MP_WFD_NFIXED + i;
    keep_private(fds[i]);
  }
  mp_payload_load(L, FD_FIRST + MP_WFD_PAYLOAD, fds, (size_t)nfds);
  close(FD_FIRST + MP_WFD_PAYLOAD);
  mp_worker_run(L, lua_gettop(L) - 1, lua_gettop(L), 0, rank, nprocs, &to,
                &d);
}

void mp_open_spawn(lua_State *L) {
  lua_pushcfunction(L, l_spawn_main);
  lua_setfield(L, -2, "_spawn_main");
}
