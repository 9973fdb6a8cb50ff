/*
** executable.c -- which program a fresh worker runs, and the one line of
** Lua that turns it into a worker.
**
** The default executable is the stock interpreter (lua5.4, lua, lua54...)
** that runs us, which can run a worker; a fresh worker runs the small
** worker program the project builds next to core.so (worker_main.c) in
** its place when that is the same Lua (below).  An embedding host's own
** executable cannot run a worker (it would start the host), so there the
** worker program is the default itself.  mp.set_executable(path) chooses
** another; the choice is kept per lua_State in the registry.  Such a
** program (a host binary that calls lmp_worker_main, multiprocessing.h) is
** checked on its first start in a state: it must answer the worker
** protocol's hello (mp_await_hello), or the start fails naming it, instead
** of "succeeding" with a program that does something else.
*/
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mp.h"
#include "multiprocessing.h"

#define EXE_KEY "multiprocessing.executable"
#define VERIFIED_KEY "multiprocessing.verified_executables"
#define HELLO_TIMEOUT_MS 60000
#define WORKER_NAME "worker"

/* basename matches ^lua%d*%.?%d*$ */
static int is_stock_interpreter(const char *path) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  if (strncmp(base, "lua", 3) != 0) return 0;
  base += 3;
  while (*base >= '0' && *base <= '9') base++;
  if (*base == '.') base++;
  while (*base >= '0' && *base <= '9') base++;
  return *base == '\0';
}

/* Both paths below are the same for the whole life of the process: each
** is found once per state and kept in the registry, not found again (a
** realpath is a readlink per component) for every worker started. */
#define CORE_PATH_KEY "multiprocessing.core_path"
#define DEFAULT_EXE_KEY "multiprocessing.default_executable"

/* Pushes the absolute path of the file that holds this code (core.so). */
static void push_core_path(lua_State *L) {
  const char *name;
  char *real;
  if (lua_getfield(L, LUA_REGISTRYINDEX, CORE_PATH_KEY) == LUA_TSTRING)
    return;                                           /* core */
  lua_pop(L, 1);                                      /* */
  real = mp_file_of((const void *)(size_t)push_core_path, &name);
  if (name == NULL) {
    lua_pushliteral(L, "");
    return;
  }
  lua_pushstring(L, real ? real : name);              /* core */
  free(real);
  lua_pushvalue(L, -1);                               /* core core */
  lua_setfield(L, LUA_REGISTRYINDEX, CORE_PATH_KEY);  /* core */
}

/* Pushes the path of the worker program: beside core.so. */
static void push_worker_program(lua_State *L) {
  const char *core, *slash;
  push_core_path(L);                                  /* core */
  core = lua_tostring(L, -1);
  slash = strrchr(core, '/');
  lua_pushlstring(L, core, slash ? (size_t)(slash - core + 1) : 0);
  lua_pushliteral(L, WORKER_NAME);                    /* core dir name */
  lua_concat(L, 2);                                   /* core program */
  lua_remove(L, -2);                                  /* program */
}

static void push_default_executable(lua_State *L) {
  char self[PATH_MAX];
  ssize_t n;
  if (lua_getfield(L, LUA_REGISTRYINDEX, DEFAULT_EXE_KEY) == LUA_TSTRING)
    return;                                           /* exe */
  lua_pop(L, 1);                                      /* */
  n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) self[n] = '\0';
  if (n > 0 && is_stock_interpreter(self))
    lua_pushstring(L, self);                          /* exe */
  else
    push_worker_program(L);                           /* exe */
  lua_pushvalue(L, -1);                               /* exe exe */
  lua_setfield(L, LUA_REGISTRYINDEX, DEFAULT_EXE_KEY); /* exe */
}

/* Pushes what get_executable() says: the executable set_executable chose,
** else the default. */
static const char *push_executable(lua_State *L) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, EXE_KEY) != LUA_TSTRING) { /* exe */
    lua_pop(L, 1);                                    /* */
    push_default_executable(L);                       /* exe */
  }
  return lua_tostring(L, -1);
}

/* --- the worker program in place of the stock interpreter ---------------- */

/* A stock lua5.4 spends a fifth of a fresh start loading readline, for a
** REPL no worker has; the worker program (worker_main.c) is the same Lua
** without it.  So when the executable is the default, the interpreter
** running us, a fresh worker runs the worker program in its place, if it
** stands in for it exactly: built beside this core.so from the same Lua
** headers, and the running Lua is that very release (lua_ident, which
** every Lua exports, says which; the functions a worker is sent are
** bytecode).  get_executable() still names the interpreter: the same Lua
** runs.  An executable set with set_executable runs as it is. */
#define PROGRAM_KEY "multiprocessing.default_program"

static int running_our_release(void) {
  static const char ours[] = "$LuaVersion: " LUA_COPYRIGHT " $";
  const char *running = (const char *)dlsym(RTLD_DEFAULT, "lua_ident");
  return running != NULL && strncmp(running, ours, sizeof ours - 1) == 0;
}

const char *mp_push_program(lua_State *L) {
  int exe;
  if (lua_getfield(L, LUA_REGISTRYINDEX, EXE_KEY) == LUA_TSTRING)
    return lua_tostring(L, -1);                       /* exe */
  lua_pop(L, 1);                                      /* */
  if (lua_getfield(L, LUA_REGISTRYINDEX, PROGRAM_KEY) == LUA_TSTRING)
    return lua_tostring(L, -1);                       /* program */
  lua_pop(L, 1);                                      /* */
  push_default_executable(L);                         /* exe */
  exe = lua_gettop(L);
  push_worker_program(L);                             /* exe program */
  if (lua_rawequal(L, exe, -1) || !running_our_release() ||
      access(lua_tostring(L, -1), X_OK) != 0)
    lua_pop(L, 1);                                    /* exe */
  else
    lua_remove(L, exe);                               /* program */
  lua_pushvalue(L, -1);
  lua_setfield(L, LUA_REGISTRYINDEX, PROGRAM_KEY);
  return lua_tostring(L, -1);
}

/* Pushes s as a Lua string literal (what string.format("%q") makes; the
** host may have no string library). */
static void push_quoted(lua_State *L, const char *s) {
  luaL_Buffer b;
  luaL_buffinit(L, &b);
  luaL_addchar(&b, '"');
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      luaL_addchar(&b, '\\');
      luaL_addchar(&b, (char)c);
    } else if (c < 32 || c == 127) {
      char esc[8];
      esc[0] = '\\';
      esc[1] = (char)('0' + c / 100);
      esc[2] = (char)('0' + c / 10 % 10);
      esc[3] = (char)('0' + c % 10);
      luaL_addlstring(&b, esc, 4);
    } else {
      luaL_addchar(&b, (char)c);
    }
  }
  luaL_addchar(&b, '"');
  luaL_pushresult(&b);
}

/* Pushes the -e chunk that loads the core and calls core.<call>.  The
** worker loads this very core.so (by path: it need not be on cpath) and
** registers it, so that a later require finds it; only if that fails does
** require search the parent's cpath. */
static void push_bootstrap(lua_State *L, const char *call) {
  int top = lua_gettop(L), base;
  lua_getglobal(L, "package");                        /* package */
  if (lua_istable(L, -1)) lua_getfield(L, -1, "cpath"); /* package cpath */
  else lua_pushnil(L);
  push_core_path(L);                                  /* package cpath core */
  base = lua_gettop(L);
  lua_pushliteral(L, LMP_WORKER_MARK " ");            /* ... core pieces... */
  if (lua_type(L, base - 1) == LUA_TSTRING) {
    lua_pushliteral(L, "package.cpath=");
    push_quoted(L, lua_tostring(L, base - 1));
    lua_pushliteral(L, " ");
  }
  lua_pushliteral(L, "package.preload[\"multiprocessing.core\"]="
                     "package.loadlib(");
  push_quoted(L, lua_tostring(L, base));
  lua_pushfstring(L, ",\"luaopen_multiprocessing_core\") "
                     "require\"multiprocessing.core\".%s", call);
  lua_concat(L, lua_gettop(L) - base);           /* package cpath core chunk */
  lua_replace(L, top + 1);                            /* chunk cpath core */
  lua_settop(L, top + 1);                             /* chunk */
}

/* The line a fresh worker's command line holds: short, so that ps shows
** something readable until the worker sets its title (title.c), which
** may use its room.  What it runs, the bootstrap, comes in BOOT_ENV: the
** worker removes it from its environment as soon as the core is loaded
** (mp_boot_done), so its own children never see it. */
#define BOOT_LINE LMP_WORKER_MARK " load(os.getenv\"" MP_BOOT_ENV "\")()"

char **mp_push_argv(lua_State *L, int exe, const char *call, char *argv[4]) {
  size_t nenv = 0, i, len;
  const char *chunk;
  char **envp, *boot;
  while (environ != NULL && environ[nenv] != NULL) nenv++;
  push_bootstrap(L, call);                            /* chunk */
  chunk = lua_tolstring(L, -1, &len);
  envp = lua_newuserdatauv(L, (nenv + 2) * sizeof(char *) +
                              sizeof MP_BOOT_ENV + 1 + len, 0);
                                                      /* chunk envp */
  boot = (char *)(envp + nenv + 2);
  memcpy(boot, MP_BOOT_ENV "=", sizeof MP_BOOT_ENV);
  memcpy(boot + sizeof MP_BOOT_ENV, chunk, len + 1);
  /* ours first: getenv finds it even if the host has one (it should not) */
  envp[0] = boot;
  for (i = 0; i < nenv; i++) envp[i + 1] = environ[i];
  envp[nenv + 1] = NULL;
  lua_remove(L, -2);                                  /* envp */
  argv[0] = (char *)(size_t)lua_tostring(L, exe);
  argv[1] = (char *)(size_t)"-e";
  argv[2] = (char *)(size_t)BOOT_LINE;
  argv[3] = NULL;
  return envp;
}

void mp_boot_done(void) {
  unsetenv(MP_BOOT_ENV);
}

/* --- the hello of a chosen executable ------------------------------------ */

/* Pushes the registry's set of executables that answered: a table. */
static void push_verified(lua_State *L) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, VERIFIED_KEY) == LUA_TTABLE)
    return;                                           /* set */
  lua_pop(L, 1);                                      /* */
  lua_newtable(L);                                    /* set */
  lua_pushvalue(L, -1);                               /* set set */
  lua_setfield(L, LUA_REGISTRYINDEX, VERIFIED_KEY);   /* set */
}

int mp_executable_verified(lua_State *L, const char *exe) {
  int known;
  if (lua_getfield(L, LUA_REGISTRYINDEX, EXE_KEY) != LUA_TSTRING) {
    lua_pop(L, 1);
    return 1;  /* the default: the interpreter running us, or our worker */
  }
  lua_pop(L, 1);                                      /* */
  push_verified(L);                                   /* set */
  known = lua_getfield(L, -1, exe) != LUA_TNIL;       /* set mark */
  lua_pop(L, 2);                                      /* */
  return known;
}

int mp_await_hello(lua_State *L, int fd, const char *exe) {
  struct pollfd p;
  char c;
  ssize_t n;
  int r;
  double deadline = mp_now() + HELLO_TIMEOUT_MS / 1000.0;
  p.fd = fd;
  p.events = POLLIN;
  do {
    int ms = (int)((deadline - mp_now()) * 1000);
    r = poll(&p, 1, ms < 0 ? 0 : ms);
  } while (r < 0 && errno == EINTR);
  if (r == 0) {
    lua_pushfstring(L, "%s did not answer the worker protocol within %d s: is "
                       "it a worker executable? (a host binary must call "
                       "lmp_worker_main at the top of main(), see "
                       "multiprocessing.h)", exe, HELLO_TIMEOUT_MS / 1000);
    return ETIMEDOUT;
  }
  do n = read(fd, &c, 1);
  while (n < 0 && errno == EINTR);
  if (n <= 0) {
    lua_pushfstring(L, "%s is not a worker executable: it ended without "
                       "running the worker protocol (a host binary must call "
                       "lmp_worker_main at the top of main(), see "
                       "multiprocessing.h)", exe);
    return ENOEXEC;
  }
  push_verified(L);                                   /* set */
  lua_pushboolean(L, 1);                              /* set true */
  lua_setfield(L, -2, exe);                           /* set */
  lua_pop(L, 1);                                      /* */
  return 0;
}

/* set_executable(path): path must be a regular file we may execute; nil
** goes back to the default. */
static int l_set_executable(lua_State *L) {
  struct stat st;
  const char *path;
  if (lua_isnoneornil(L, 1)) {
    lua_pushnil(L);
    lua_setfield(L, LUA_REGISTRYINDEX, EXE_KEY);
    return 0;
  }
  path = luaL_checkstring(L, 1);
  if (stat(path, &st) != 0)
    return luaL_argerror(L, 1, lua_pushfstring(L, "cannot use '%s' as the "
                         "executable: %s", path, strerror(errno)));
  if (!S_ISREG(st.st_mode) || access(path, X_OK) != 0)
    return luaL_argerror(L, 1, lua_pushfstring(L, "cannot use '%s' as the "
                         "executable: %s", path,
                         S_ISREG(st.st_mode) ? strerror(errno)
                                             : "not a regular file"));
  lua_settop(L, 1);
  lua_setfield(L, LUA_REGISTRYINDEX, EXE_KEY);
  return 0;
}

static int l_get_executable(lua_State *L) {
  mp_checknoargs(L, 1);
  push_executable(L);
  return 1;
}

void mp_open_executable(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"set_executable", l_set_executable}, {"get_executable", l_get_executable},
    {NULL, NULL}
  };
  luaL_setfuncs(L, funcs, 0);
}
