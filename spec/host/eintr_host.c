/*
** eintr_host.c -- a host for queue_spec.lua: runs the Lua file argv[1] with
** a SIGUSR1 handler installed without SA_RESTART, so that every signal
** interrupts a blocking call with EINTR.  The chunk sees PID (the host's)
** and HITS() (how many signals came).  The same handler serves STORMSIG, a
** real-time signal: those queue instead of merging, so every one sent
** arrives however late the host runs (a loaded machine).
*/
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"
static volatile sig_atomic_t hits;
static void on_usr1(int s) { (void)s; hits++; }
static int l_hits(lua_State *L) { lua_pushinteger(L, hits); return 1; }
int main(int argc, char **argv) {
  struct sigaction sa;
  lua_State *L = luaL_newstate();
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_usr1;          /* no SA_RESTART: EINTR everywhere */
  sigaction(SIGUSR1, &sa, NULL);
  sigaction(SIGRTMIN + 4, &sa, NULL);
  luaL_openlibs(L);
  lua_pushinteger(L, getpid()); lua_setglobal(L, "PID");
  lua_pushinteger(L, SIGRTMIN + 4); lua_setglobal(L, "STORMSIG");
  lua_pushcfunction(L, l_hits); lua_setglobal(L, "HITS");
  if (argc < 2 || luaL_dofile(L, argv[1])) {
    fprintf(stderr, "%s\n", lua_tostring(L, -1)); lua_close(L); return 1;
  }
  lua_close(L);
  return 0;
}
