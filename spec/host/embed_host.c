/*
** embed_host.c -- a host program of the kind that embeds Lua: two
** lua_States in one process, and its own SIGCHLD handling, as careless
** engines have it.  Runs the chunk given as argv[1] in each state, then the
** chunk argv[2] in each state.  argv[3] is the SIGCHLD handling:
**   reap       (default) a handler that reaps every child with waitpid(-1)
**   ignore     SIG_IGN: the kernel reaps every child at once
**   nocldwait  SA_NOCLDWAIT: the same, with the default action
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
  const char *mode = argc > 3 ? argv[3] : "reap";
  if (argc != 3 && argc != 4) return 2;
  memset(&sa, 0, sizeof sa);
  if (strcmp(mode, "reap") == 0) {
    sa.sa_handler = reap_everything;
    sa.sa_flags = SA_RESTART;
  } else if (strcmp(mode, "ignore") == 0) {
    sa.sa_handler = SIG_IGN;
  } else if (strcmp(mode, "nocldwait") == 0) {
    sa.sa_handler = SIG_DFL;
    sa.sa_flags = SA_NOCLDWAIT;
  } else {
    return 2;
  }
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
