/*
** launcher.h -- multiprocessing.launcher: what a launcher built on the
** library (mprun) needs from C, apart from the core.  It uses only the
** core's public faces: descriptors are the core's Fd objects (core._fd,
** fd:fileno(), fd:detach()), processes are watched through ctx:fileno().
**
**   fd.c         the bottom: descriptors as the core's Fd objects
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

#include "../sys.h"   /* mp_now, mp_write_all: sys.c is compiled in */

/* The launcher's descriptors (fd.c): the core's Fd type, and core._fd,
** which the module keeps in the registry under FD_NEW to make them. */
#define FD_T     "multiprocessing.Fd"
#define FD_NEW   "multiprocessing.launcher.fd"
/* Pushes a core Fd that owns 'fd', or the error (then 'fd' is closed);
** the pcall status. */
int lnc_wrap_fd(lua_State *L, int fd);
/* Pushes a core Fd that owns 'fd' (closed if that fails, and raised). */
void lnc_push_fd(lua_State *L, int fd);
/* The descriptor of the Fd at 'arg', borrowed. */
int lnc_fileno(lua_State *L, int arg);
/* Takes the descriptor out of the Fd at 'arg' (fd:detach()); nil: -1. */
int lnc_take(lua_State *L, int arg);

void lnc_open_relay(lua_State *L);   /* relay.c: _relay */
void lnc_open_rank(lua_State *L);    /* rank.c: _rank_stdio, _setenv, _run_program */

#endif
