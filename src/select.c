/*
** select.c -- mp.wait's sleep: one poll(2) over the descriptors of many
** objects, and Ctrl-C.
**
** The Lua layer (lua/multiprocessing/process.lua) turns the objects given
** to mp.wait into descriptors (their fileno()) and decides which of them
** are ready (their ready()); this file only sleeps until one of the
** descriptors is readable.  While it blocks, SIGINT is read from a
** signalfd polled with the rest (mp_interrupt_watch, join.c), so Ctrl-C
** ends the sleep at once: no slices, no busy loop.
*/
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <string.h>

#include "mp.h"

/* More descriptors than a process can have open is a mistake. */
#define MAX_FDS (1 << 20)

/* Milliseconds for poll(2) until 'deadline' (INFINITY: -1, for ever). */
static int ms_until(double deadline) {
  double left;
  if (isinf(deadline)) return -1;
  left = deadline - mp_now();
  if (left <= 0) return 0;
  return left > INT_MAX / 1000 ? INT_MAX : (int)ceil(left * 1000);
}

/* poll(2) up to 'timeout' seconds (< 0: for ever); a signal other than
** the one watched only shortens a round. */
static int poll_for(struct pollfd *fds, nfds_t n, double timeout) {
  double deadline = timeout < 0 ? INFINITY : mp_now() + timeout;
  for (;;) {
    int r = poll(fds, n, ms_until(deadline));
    if (r >= 0 || errno != EINTR) return r;
  }
}

/* Pushes {[i] = true} for the readable entries of the pollfds (an end of
** file or an error counts: a read answers at once), "invalid" for a
** descriptor that is not open. */
static void push_ready(lua_State *L, const struct pollfd *fds, nfds_t n) {
  nfds_t i;
  lua_newtable(L);                                  /* ready */
  for (i = 0; i < n; i++) {
    if (fds[i].revents & POLLNVAL)
      lua_pushliteral(L, "invalid");
    else if (fds[i].revents != 0)
      lua_pushboolean(L, 1);
    else
      continue;
    lua_rawseti(L, -2, (lua_Integer)i + 1);         /* ready */
  }
}

/* _poll(fds [, timeout [, call]]) -> {[i] = true | "invalid"}: waits up
** to 'timeout' seconds (nil: for ever; 0: not at all) until one of the
** descriptors of the list 'fds' is readable, and tells which are.  Ctrl-C
** during the wait raises, naming 'call' (default "multiprocessing.wait"). */
static int l_poll(lua_State *L) {
  double timeout = lua_isnoneornil(L, 2) ? -1 : luaL_checknumber(L, 2);
  const char *call = luaL_optstring(L, 3, "multiprocessing.wait");
  lua_Integer n, i;
  struct pollfd *fds;
  mp_Interrupt in;
  int r, interrupted, err;
  luaL_checktype(L, 1, LUA_TTABLE);
  n = luaL_len(L, 1);
  luaL_argcheck(L, n >= 0 && n <= MAX_FDS, 1, "too many descriptors");
  /* a userdata, not malloc: an error below leaves nothing to free */
  fds = lua_newuserdatauv(L, sizeof *fds * ((size_t)n + 1), 0);
  for (i = 0; i < n; i++) {
    lua_rawgeti(L, 1, i + 1);                       /* ... fd */
    fds[i].fd = (int)luaL_checkinteger(L, -1);
    fds[i].events = POLLIN;
    lua_pop(L, 1);                                  /* ... */
  }
  in.fd = -1;
  if (timeout != 0) mp_interrupt_watch(&in);
  fds[n].fd = in.fd;        /* -1 when not watched: poll(2) skips it */
  fds[n].events = POLLIN;
  r = poll_for(fds, (nfds_t)n + 1, timeout);
  err = errno;
  interrupted = r > 0 && fds[n].revents != 0 && mp_interrupt_took(&in);
  mp_interrupt_unwatch(&in);
  if (r < 0)
    return luaL_error(L, "%s: poll: %s", call, strerror(err));
  if (interrupted) return mp_raise_interrupt(L, call, "nothing was waited for");
  push_ready(L, fds, (nfds_t)n);
  return 1;
}

void mp_open_select(lua_State *L) {
  lua_pushcfunction(L, l_poll);
  lua_setfield(L, -2, "_poll");
}
