/*
** storm_host.c -- a host that embeds Lua and is hit by a signal storm:
** handlers without SA_RESTART (so every blocking call sees EINTR) for
** SIGUSR1, SIGCHLD and SIGALRM, a 1 kHz SIGALRM timer, and a thread that
** sends SIGUSR1 and SIGCHLD to the process every millisecond.  Runs the
** script argv[1]; HITS() gives the signals handled so far.
*/
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

static volatile sig_atomic_t hits;
static volatile sig_atomic_t stop;

static void on_signal(int sig) {
  (void)sig;
  hits++;
}

static int l_hits(lua_State *L) {
  lua_pushinteger(L, hits);
  return 1;
}

static void *storm(void *arg) {
  struct timespec ms = {0, 1000000};
  sigset_t all;
  (void)arg;
  sigfillset(&all);
  pthread_sigmask(SIG_BLOCK, &all, NULL);   /* the main thread takes them */
  while (!stop) {
    kill(getpid(), SIGUSR1);
    kill(getpid(), SIGCHLD);
    nanosleep(&ms, NULL);
  }
  return NULL;
}

int main(int argc, char **argv) {
  static const int sigs[] = {SIGUSR1, SIGCHLD, SIGALRM};
  struct sigaction sa;
  struct itimerval every_ms = {{0, 1000}, {0, 1000}}, off;
  pthread_t thread;
  lua_State *L;
  int i, status = 0;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;                /* no SA_RESTART */
  for (i = 0; i < 3; i++) sigaction(sigs[i], &sa, NULL);
  L = luaL_newstate();
  luaL_openlibs(L);
  lua_pushcfunction(L, l_hits);
  lua_setglobal(L, "HITS");
  setitimer(ITIMER_REAL, &every_ms, NULL);
  pthread_create(&thread, NULL, storm, NULL);
  if (argc < 2 || luaL_dofile(L, argv[1]) != LUA_OK) {
    fprintf(stderr, "%s\n", lua_tostring(L, -1));
    status = 1;
  }
  stop = 1;
  pthread_join(thread, NULL);
  memset(&off, 0, sizeof off);
  setitimer(ITIMER_REAL, &off, NULL);
  lua_close(L);
  return status;
}
