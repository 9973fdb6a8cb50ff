/*
** embed_host.c -- a host program of the kind that embeds Lua: two
** lua_States in one process, and a SIGCHLD handler of its own that reaps
** every child it can (as a careless engine would).  Runs the chunk given
** as argv[1] in each state, then the chunk argv[2] in each state.
*/
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

static volatile sig_atomic_t reaped;

static void reap_everything(int sig) {
  int saved = errno;
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) reaped++;
  errno = saved;
}

static int run(lua_State *L, const char *chunk, const char *name) {
  if (luaL_loadbuffer(L, chunk, strlen(chunk), name) != LUA_OK
      || lua_pcall(L, 0, 0, 0) != LUA_OK) {
    printf("%s: error: %s\n", name, luaL_tolstring(L, -1, NULL));
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  struct sigaction sa;
  lua_State *states[2];
  int i, failed = 0;
  if (argc != 3) return 2;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = reap_everything;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGCHLD, &sa, NULL);
  for (i = 0; i < 2; i++) {
    states[i] = luaL_newstate();
    luaL_openlibs(states[i]);
    lua_pushinteger(states[i], i);
    lua_setglobal(states[i], "STATE");
  }
  for (i = 0; i < 2; i++) failed |= run(states[i], argv[1], i ? "B.start" : "A.start");
  for (i = 0; i < 2; i++) failed |= run(states[i], argv[2], i ? "B.join" : "A.join");
  for (i = 0; i < 2; i++) lua_close(states[i]);
  fflush(stdout);
  return failed;
}
