/*
** launcher.h -- multiprocessing.launcher: what a launcher built on the
** library (mprun) needs from C, apart from the core.  It uses only the
** core's public faces: descriptors are the core's Fd objects (core._fd,
** fd:fileno(), fd:detach()), processes are watched through ctx:fileno().
**
**   launcher.c   the module: log files and directories made without
**                following links, pipes, the signalfd, RLIMIT_NOFILE
**   relay.c      the output relay: the ranks' pipes to one console, whole
**                prefixed lines, the status line, the wait on contexts and
**                signals
**   rank.c       the rank's side: its stdio, its environment, a program
**                run and waited for
*/
#ifndef mp_launcher_h
#define mp_launcher_h

#include <stddef.h>
#include "lua.h"
#include "lauxlib.h"

/* The shared helpers (launcher.c). */
double lnc_now(void);                              /* CLOCK_MONOTONIC */
int lnc_write_all(int fd, const char *p, size_t n);  /* 0 or errno */
/* Pushes a core Fd that owns 'fd' (closed if that fails). */
void lnc_push_fd(lua_State *L, int fd);
/* The descriptor of the Fd at 'arg', borrowed. */
int lnc_fileno(lua_State *L, int arg);
/* Takes the descriptor out of the Fd at 'arg' (fd:detach()); nil: -1. */
int lnc_take(lua_State *L, int arg);

void lnc_open_relay(lua_State *L);   /* relay.c: _relay */
void lnc_open_rank(lua_State *L);    /* rank.c: _rank_stdio, _setenv, _run_program */

#endif
