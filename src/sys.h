/*
** sys.h -- system helpers that need no Lua and no context (sys.c): the
** clock and whole writes.  Compiled into the core and into the launcher
** module alike, so neither keeps a copy of its own.
*/
#ifndef mp_sys_h
#define mp_sys_h

#include <stddef.h>

double mp_now(void);                               /* CLOCK_MONOTONIC seconds */
int    mp_write_all(int fd, const char *p, size_t n);  /* 0 or errno */

#endif
