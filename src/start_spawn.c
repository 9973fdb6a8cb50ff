/*
** start_spawn.c -- the "spawn" start method: each worker is a fresh
** interpreter (see executable.c) that loads the core and nothing else, maps
** the context's payload (payload.c) and runs fn.  Safe in a threaded host:
** the parent only clone+execs (launch.c).
**
** A worker's descriptors: 3 the payload, 4 the reports, 5 its end of the
** reports' socket, 6 the context's lifeline (worker.c), 7 the hello pipe
** (closed at once when the executable is known), 8... the codec's (shared
** memory the args carry).  Its command line (multiprocessing.h):
**   <exe> -e '<mark> <load the core>._spawn_main(3, 4, 5, rank, parent
**            pid, nfds, 6, 7)'
** The first start with an executable chosen by set_executable waits for
** the hello of worker 0 (executable.c; the others close the pipe unused):
** a program that does not run the protocol fails the start, named, at
** once.
*/
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "mp.h"

#define FD_PAYLOAD 3
#define FD_REPORTS 4
#define FD_RSOCK   5
#define FD_LIFELINE 6
#define FD_HELLO   7
#define FD_CODEC   8
#define NFIXED     5

static int spawn_start(lua_State *L, mp_Context *ctx, int ctxidx, int fn,
                       int args) {
  mp_Payload *p = mp_payload_push(L, ctx, ctxidx, fn, args);
  int payload = lua_gettop(L), exe, nfds = NFIXED + (int)p->nfds, i, err = 0;
  pid_t parent = getpid();
  int *fds, hello[2] = {-1, -1};
  mp_push_executable(L);
  exe = lua_gettop(L);
  if (!mp_executable_verified(L, lua_tostring(L, exe)) &&
      pipe2(hello, O_CLOEXEC) != 0) {
    mp_payload_close(p);
    return mp_push_errno(L, "pipe", errno);
  }
  fds = lua_newuserdatauv(L, sizeof(int) * (size_t)nfds, 0);
  fds[0] = p->fd;
  fds[1] = ctx->reports.fd;
  fds[2] = ctx->reports.peer;
  fds[3] = ctx->lifeline[0];
  fds[4] = hello[1] >= 0 ? hello[1] : ctx->lifeline[0];  /* a placeholder */
  for (i = NFIXED; i < nfds; i++) fds[i] = p->fds[i - NFIXED];
  /* Our buffered output goes first, as it would have without workers. */
  fflush(NULL);
  for (i = 0; i < ctx->nprocs && err == 0; i++) {
    mp_Worker *w = &ctx->workers[i];
    char *argv[4];
    char call[96];
    snprintf(call, sizeof call, "_spawn_main(%d,%d,%d,%d,%ld,%d,%d,%d)",
             FD_PAYLOAD, FD_REPORTS, FD_RSOCK, i, (long)parent, (int)p->nfds,
             FD_LIFELINE, i == 0 && hello[1] >= 0 ? FD_HELLO : -1);
    mp_push_bootstrap(L, call);
    argv[0] = (char *)(size_t)lua_tostring(L, exe);
    argv[1] = (char *)(size_t)"-e";
    argv[2] = (char *)(size_t)lua_tostring(L, -1);
    argv[3] = NULL;
    err = mp_launch(L, argv[0], argv, fds, nfds, &w->pid, &w->pidfd);
    if (err == 0) {
      ctx->started = i + 1;
      lua_pop(L, 1);
    }
  }
  mp_payload_close(p);
  if (hello[1] >= 0) {
    close(hello[1]);  /* EOF once every worker closed (or never had) it */
    if (err == 0) err = mp_await_hello(L, hello[0], lua_tostring(L, exe));
    close(hello[0]);
  }
  if (err != 0) {
    lua_replace(L, payload);
    lua_settop(L, payload);
  }
  return err;
}

const mp_StartMethod mp_start_spawn = {"spawn", spawn_start};

/* Sets close-on-exec on what we inherited, so that the worker's own
** children (os.execute) do not. */
static void keep_private(int fd) {
  int flags = fcntl(fd, F_GETFD);
  if (flags >= 0) fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

/* _spawn_main(payload_fd, reports_fd, reports_sock, rank, parent_pid, nfds,
** lifeline_fd, hello_fd): in the fresh interpreter; never returns. */
static int l_spawn_main(lua_State *L) {
  int payload = (int)luaL_checkinteger(L, 1);
  mp_ReportTo to;
  int rank = (int)luaL_checkinteger(L, 4);
  pid_t parent = (pid_t)luaL_checkinteger(L, 5);
  int nfds = (int)luaL_checkinteger(L, 6), i;
  int lifeline = (int)luaL_checkinteger(L, 7);
  int hello = (int)luaL_checkinteger(L, 8);
  int *fds;
  to.fd = (int)luaL_checkinteger(L, 2);
  to.sock = (int)luaL_checkinteger(L, 3);
  mp_worker_detach(parent, lifeline);
  /* hello: this program runs the protocol (then FD_HELLO goes: ours, or
  ** the placeholder's copy) */
  if (hello >= 0) (void)!write(hello, "", 1);
  close(FD_HELLO);
  luaL_argcheck(L, nfds >= 0 && nfds <= MP_LAUNCH_MAXFDS, 6, "bad count");
  fds = lua_newuserdatauv(L, sizeof(int) * (size_t)(nfds + 1), 0);
  keep_private(payload);
  keep_private(to.fd);
  keep_private(to.sock);
  for (i = 0; i < nfds; i++) {
    fds[i] = FD_CODEC + i;
    keep_private(fds[i]);
  }
  mp_payload_load(L, payload, fds, (size_t)nfds);
  close(payload);
  mp_worker_run(L, lua_gettop(L) - 1, lua_gettop(L), rank, &to);
}

void mp_open_spawn(lua_State *L) {
  mp_open_executable(L);
  mp_open_forkserver(L);
  lua_pushcfunction(L, l_spawn_main);
  lua_setfield(L, -2, "_spawn_main");
}
