/*
** multiprocessing.h -- lua-multiprocessing for C and C++ programs that
** embed Lua.  Installed next to lua.h; needs nothing but Lua's headers.
**
** Under the "spawn" and "forkserver" start methods a worker is a fresh
** process running a program that speaks the worker protocol.  By default
** that is the stock lua5.4, or the small worker program installed next to
** multiprocessing/core.so; either has only Lua's standard libraries.  A
** host whose C modules are registered by the host itself (luaL_requiref,
** package.preload) makes its own binary the worker, so that workers have
** the same modules: one call at the very top of main(),
**
**     static void host_openlibs(lua_State *L) {
**       luaL_openlibs(L);
**       luaL_requiref(L, "engine", luaopen_engine, 0);   (the host's own)
**       lua_pop(L, 1);
**     }
**
**     int main(int argc, char **argv) {
**       if (lmp_worker_main(argc, argv, host_openlibs))
**         return lmp_worker_status();
**       ... the host as usual ...
**     }
**
** and, in the host's Lua, mp.set_executable(path of this binary) -- for
** instance from /proc/self/exe.  The forkserver is then this binary in
** worker mode too, and its workers get host_openlibs as well.
**
** lmp_worker_main returns 0 at once (touching nothing) unless argv is the
** worker protocol's command line; then it runs the worker, which normally
** leaves with _exit and never returns, and returns 1 only when the worker
** could not start (lmp_worker_status() is then its exit status, with the
** reason printed on stderr).  Call it before the host starts threads,
** opens windows or installs signal handlers.  openlibs may be NULL
** (luaL_openlibs).
**
** The binary must export Lua's C API to the modules it loads, as any host
** that loads C modules does: link liblua5.4 as a shared library, or link
** it statically with -Wl,-E.  Include this header in one file (the one
** with main): its functions are static.
*/
#ifndef multiprocessing_h
#define multiprocessing_h

#include <stdio.h>
#include <string.h>

#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"

/* The library's version: the one place it is written (mp._VERSION, the
** rockspec's name and the CHANGELOG follow it). */
#define LMP_VERSION "0.2.0"

/* The worker protocol's command line is `<exe> -e <chunk>`, with chunk
** starting with this empty statement and comment: a stock lua5.4 runs it
** as is (it refuses an -e argument that starts with '-'). */
#define LMP_WORKER_MARK ";--[[lua-multiprocessing worker]]"

/* Where the worker keeps the host's openlibs (a full userdata holding the
** function pointer) in its registry: the forkserver opens each request's
** state with it. */
#define LMP_OPENLIBS_KEY "multiprocessing.openlibs"

typedef void (*lmp_Openlibs)(lua_State *L);

static inline int *lmp_status_(void) {
  static int status;
  return &status;
}

/* Is argv the worker protocol's command line? */
static inline int lmp_is_worker(int argc, char **argv) {
  return argc == 3 && strcmp(argv[1], "-e") == 0 &&
         strncmp(argv[2], LMP_WORKER_MARK, sizeof LMP_WORKER_MARK - 1) == 0;
}

static inline int lmp_traceback_(lua_State *L) {
  const char *msg = lua_tostring(L, 1);
  if (msg == NULL) {
    if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
      return 1;
    msg = lua_pushfstring(L, "(error object is a %s value)",
                          luaL_typename(L, 1));
  }
  luaL_traceback(L, L, msg, 1);
  return 1;
}

/* Runs the `-e chunk [-e chunk ...]` of argv in L, as lua5.4 would: 1, or
** 0 after printing the first error (with its traceback) on stderr. */
static inline int lmp_do_chunks(lua_State *L, int argc, char **argv) {
  const char *progname = argc > 0 ? argv[0] : "worker";
  int i;
  for (i = 1; i < argc; i += 2) {
    const char *chunk = i + 1 < argc ? argv[i + 1] : NULL;
    int status;
    if (strcmp(argv[i], "-e") != 0 || chunk == NULL) {
      fprintf(stderr, "%s: unexpected argument '%s' (expected -e chunk)\n",
              progname, argv[i]);
      return 0;
    }
    lua_settop(L, 0);
    lua_pushcfunction(L, lmp_traceback_);
    status = luaL_loadbuffer(L, chunk, strlen(chunk), "=(command line)");
    if (status == LUA_OK) status = lua_pcall(L, 0, 0, 1);
    if (status != LUA_OK) {
      fprintf(stderr, "%s: %s\n", progname, lua_tostring(L, -1));
      fflush(stderr);
      return 0;
    }
  }
  return 1;
}

/* Runs `-e chunk [-e chunk ...]` (as lua5.4 would) in a fresh state opened
** with 'openlibs'; the exit status: 0, or 1 after printing the error. */
static inline int lmp_run_chunks(int argc, char **argv,
                                 lmp_Openlibs openlibs) {
  lua_State *L = luaL_newstate();
  int ok;
  if (L == NULL) {
    fprintf(stderr, "%s: cannot create state: not enough memory\n",
            argc > 0 ? argv[0] : "worker");
    return 1;
  }
  if (openlibs == NULL) {
    luaL_openlibs(L);
  } else {
    lmp_Openlibs *p = (lmp_Openlibs *)lua_newuserdatauv(L, sizeof *p, 0);
    *p = openlibs;
    lua_setfield(L, LUA_REGISTRYINDEX, LMP_OPENLIBS_KEY);
    openlibs(L);
  }
  ok = lmp_do_chunks(L, argc, argv);
  lua_close(L);
  return ok ? 0 : 1;
}

/* The entry a host calls first thing in main(): 1 when this process was a
** worker (then return lmp_worker_status() from main), 0 otherwise. */
static inline int lmp_worker_main(int argc, char **argv,
                                  lmp_Openlibs openlibs) {
  if (!lmp_is_worker(argc, argv)) return 0;
  *lmp_status_() = lmp_run_chunks(argc, argv, openlibs);
  return 1;
}

/* The exit status for main() after lmp_worker_main returned 1. */
static inline int lmp_worker_status(void) {
  return *lmp_status_();
}

#endif
