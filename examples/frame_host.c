/*
** frame_host.c -- lua-multiprocessing inside an engine-style host.
**
** What an engine has, and what this host has: a 60 Hz frame loop on the
** main thread that must never stall, a second thread (an "audio" thread),
** a C module registered by the host rather than loaded from a .so ("host"
** below), and workers started from Lua.  The binary is its own worker
** (lmp_worker_main, multiprocessing.h): under "spawn" and "forkserver" the
** workers run this program, so they have the host's module too.
**
**   cc -o frame_host examples/frame_host.c $(pkg-config --cflags --libs lua5.4) -lpthread
**   ./frame_host examples/frame_host.lua [start_method]
**
** The script returns a function frame(n), called once a frame until it
** returns false.  At the end the host prints its worst frame time next to
** the frame budget, and how long lua_close took (workers still running are
** killed then, without waiting out a grace period).
*/
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"
#include "multiprocessing.h"

#define FRAME_BUDGET (1.0 / 60)
#define MAX_FRAMES   (60 * 60)   /* a minute at most */

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void sleep_for(double s) {
  struct timespec ts;
  if (s <= 0) return;
  ts.tv_sec = (time_t)s;
  ts.tv_nsec = (long)((s - (double)ts.tv_sec) * 1e9);
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* --- the host's own module: registered, not loaded from a file ---------- */

static int host_now(lua_State *L) {
  lua_pushnumber(L, now());
  return 1;
}

static int host_sleep(lua_State *L) {
  sleep_for(luaL_checknumber(L, 1));
  return 0;
}

/* What a worker stuck in native code looks like: SIGTERM does nothing. */
static int host_ignore_term(lua_State *L) {
  (void)L;
  signal(SIGTERM, SIG_IGN);
  return 0;
}

/* host.poll(fd, ms): is fd readable within ms milliseconds (poll(2))? */
static int host_poll(lua_State *L) {
  struct pollfd p;
  int r;
  p.fd = (int)luaL_checkinteger(L, 1);
  p.events = POLLIN;
  p.revents = 0;
  do r = poll(&p, 1, (int)luaL_optinteger(L, 2, 0));
  while (r < 0 && errno == EINTR);
  lua_pushboolean(L, r > 0);
  return 1;
}

/* host.executable(): this program's path, for mp.set_executable. */
static int host_executable(lua_State *L) {
  char path[4096];
  ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return luaL_error(L, "readlink /proc/self/exe: %s",
                                strerror(errno));
  lua_pushlstring(L, path, (size_t)n);
  return 1;
}

static int luaopen_host(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"now", host_now}, {"sleep", host_sleep},
    {"ignore_term", host_ignore_term}, {"poll", host_poll},
    {"executable", host_executable}, {NULL, NULL}
  };
  luaL_newlib(L, funcs);
  lua_pushboolean(L, 1);
  lua_setfield(L, -2, "registered_by_host");
  return 1;
}

/* Every state of this program, the workers' included, opens these. */
static void host_openlibs(lua_State *L) {
  luaL_openlibs(L);
  luaL_requiref(L, "host", luaopen_host, 0);
  lua_pop(L, 1);
}

/* --- a second thread, as engines have ----------------------------------- */

static volatile int quit;

static void *audio_thread(void *arg) {
  (void)arg;
  while (!quit) sleep_for(0.005);
  return NULL;
}

/* --- the frame loop ------------------------------------------------------ */

static int report(lua_State *L, int status) {
  if (status != LUA_OK) {
    fprintf(stderr, "frame_host: %s\n", luaL_tolstring(L, -1, NULL));
    return 1;
  }
  return 0;
}

int main(int argc, char **argv) {
  pthread_t audio;
  lua_State *L;
  double worst = 0, t_close;
  int n, failed = 0, i;
  if (lmp_worker_main(argc, argv, host_openlibs)) return lmp_worker_status();
  if (argc < 2) {
    fprintf(stderr, "usage: %s script.lua [args...]\n", argv[0]);
    return 2;
  }
  pthread_create(&audio, NULL, audio_thread, NULL);
  L = luaL_newstate();
  host_openlibs(L);
  lua_createtable(L, argc, 0);             /* arg, as lua5.4 makes it */
  for (i = 0; i < argc; i++) {
    lua_pushstring(L, argv[i]);
    lua_rawseti(L, -2, i - 1);
  }
  lua_setglobal(L, "arg");
  if (report(L, luaL_loadfile(L, argv[1])) ||
      report(L, lua_pcall(L, 0, 1, 0)) || !lua_isfunction(L, -1)) {
    fprintf(stderr, "frame_host: %s must return a function frame(n)\n",
            argv[1]);
    failed = 1;
  }
  for (n = 1; !failed && n <= MAX_FRAMES; n++) {
    double start = now(), took;
    int more;
    lua_pushvalue(L, -1);
    lua_pushinteger(L, n);
    if (report(L, lua_pcall(L, 1, 1, 0))) {
      failed = 1;
      break;
    }
    more = lua_toboolean(L, -1);
    lua_pop(L, 1);
    took = now() - start;
    if (took > worst) worst = took;
    if (!more) break;
    sleep_for(start + FRAME_BUDGET - now());
  }
  t_close = now();
  lua_close(L);
  t_close = now() - t_close;
  quit = 1;
  pthread_join(audio, NULL);
  printf("frames %d worst %.2f ms budget %.2f ms lua_close %.2f ms\n",
         n, worst * 1e3, FRAME_BUDGET * 1e3, t_close * 1e3);
  return failed;
}
