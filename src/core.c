/*
** core.c -- multiprocessing.core: the module table and the helpers that
** every part shares.  Each part registers its own functions (mp_open_*).
*/
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mp.h"
#include "multiprocessing.h"
#include "sharing.h"

int mp_push_errno(lua_State *L, const char *what, int err) {
  lua_pushfstring(L, "%s: %s", what, strerror(err));
  return err;
}

void mp_swap_registry(lua_State *L, const char *key, int idx) {
  idx = lua_absindex(L, idx);
  lua_getfield(L, LUA_REGISTRYINDEX, key);          /* old */
  lua_pushvalue(L, idx);                            /* old new */
  lua_setfield(L, LUA_REGISTRYINDEX, key);          /* old */
  lua_replace(L, idx);                              /* */
}

#define SELF_KEY "multiprocessing.self"

static int self_gc(lua_State *L) {
  mp_Self **box = (mp_Self **)lua_touserdata(L, 1);
  mp_self_free(*box);
  *box = NULL;
  return 0;
}

mp_Self *mp_self(lua_State *L) {
  mp_Self **box;
  if (lua_getfield(L, LUA_REGISTRYINDEX, SELF_KEY) == LUA_TUSERDATA) {
    box = (mp_Self **)lua_touserdata(L, -1);                /* box */
  } else {
    lua_pop(L, 1);                                          /* */
    box = (mp_Self **)lua_newuserdatauv(L, sizeof *box, 0); /* box */
    *box = NULL;
    lua_createtable(L, 0, 1);                               /* box mt */
    lua_pushcfunction(L, self_gc);
    lua_setfield(L, -2, "__gc");
    lua_setmetatable(L, -2);                                /* box */
    *box = mp_self_new();
    lua_pushvalue(L, -1);                                   /* box box */
    lua_setfield(L, LUA_REGISTRYINDEX, SELF_KEY);           /* box */
  }
  lua_pop(L, 1);                                            /* */
  return *box;
}

/* Registers 'methods' into the table at the top, each a closure whose
** upvalue 1 is its public name, "Type.method" (args.c reads it). */
static void set_methods(lua_State *L, const char *tname,
                        const luaL_Reg *methods) {
  const char *dot = strrchr(tname, '.');
  const char *type = dot ? dot + 1 : tname;
  for (; methods->name != NULL; methods++) {
    lua_pushfstring(L, "%s.%s", type, methods->name);   /* methods name */
    lua_pushcclosure(L, methods->func, 1);              /* methods f */
    lua_setfield(L, -2, methods->name);                 /* methods */
  }
}

void mp_new_class(lua_State *L, const char *tname, const luaL_Reg *meta,
                  const luaL_Reg *methods) {
  int own_index, top = mp_stack_top(L);
  luaL_newmetatable(L, tname);                              /* mt */
  luaL_setfuncs(L, meta, 0);
  own_index = lua_getfield(L, -1, "__index") != LUA_TNIL;   /* mt index */
  lua_pop(L, 1);                                            /* mt */
  if (methods != NULL) {
    lua_newtable(L);                                        /* mt methods */
    set_methods(L, tname, methods);
    lua_setfield(L, -2, own_index ? "__methods" : "__index"); /* mt */
  }
  mp_stack_check(L, top, 1);
}

/* For __index functions: pushes the entry named by the key at 2 in the
** __methods table of the metatable of the value at 1. */
void mp_push_method(lua_State *L) {
  lua_getmetatable(L, 1);
  lua_getfield(L, -1, "__methods");
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
}

/* --- the warning channel -------------------------------------------------- */

/* lua_warning is off by default in lua5.4 (and in most hosts), and what we
** warn about must not go unseen: by default a warning goes to stderr, one
** line; mp.set_warning_handler(fn) sends it to fn(message) instead (a host's
** log), and set_warning_handler(nil) back to stderr. */
#define WARN_KEY "multiprocessing.warning_handler"

void mp_warning(lua_State *L, const char *msg) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, WARN_KEY) == LUA_TFUNCTION) {
    lua_pushstring(L, msg);
    if (lua_pcall(L, 1, 0, 0) == LUA_OK) return;
    fprintf(stderr, "lua-multiprocessing: the warning handler failed: %s\n",
            lua_tostring(L, -1));
  }
  lua_pop(L, 1);
  fprintf(stderr, "lua-multiprocessing: warning: %s\n", msg);
  fflush(stderr);
}

static int l_set_warning_handler(lua_State *L) {
  if (!lua_isnoneornil(L, 1)) luaL_checktype(L, 1, LUA_TFUNCTION);
  lua_settop(L, 1);
  lua_setfield(L, LUA_REGISTRYINDEX, WARN_KEY);
  return 0;
}

static int l_warn(lua_State *L) {
  mp_warning(L, luaL_checkstring(L, 1));
  return 0;
}

/* _now() -> CLOCK_MONOTONIC seconds, for the Lua layer's deadlines. */
static int l_now(lua_State *L) {
  lua_pushnumber(L, mp_now());
  return 1;
}

/* _isatty(fd) -> whether fd is a terminal (progress and status lines). */
static int l_isatty(lua_State *L) {
  lua_pushboolean(L, isatty((int)mp_checkinteger(L, 1)));
  return 1;
}

/* The parts of the core, each of which registers its functions and types
** in the module table on the top of the stack: the table of contents of
** multiprocessing.core (what each file is for: the map in mp.h).  The
** codec comes before the types that register with it, the exceptions
** before the kinds other parts derive from them. */
static void (*const parts[])(lua_State *L) = {
  mp_open_signames,     /* signames.c   signals */
  mp_open_codec,        /* codec.c      encode, decode */
  mp_open_exception,    /* exception.c  the exception types, isinstance */
  mp_open_context,      /* context.c    start_processes, spawn, contexts */
  mp_open_select,       /* select.c     mp.wait's poll */
  mp_open_cpus,         /* cpus.c       cpu_count */
  mp_open_pool,         /* pool.c       TimeoutError, Pool's C */
  mp_open_spawn,        /* start_spawn.c  a spawned worker's entry */
  mp_open_forkserver,   /* forkserver.c   the server's entry */
  mp_open_executable,   /* executable.c   set_executable, get_executable */
  mp_open_shm,          /* shm.c        the sharing strategies */
  mp_open_array,        /* array.c      Array, Value */
  mp_open_channel,      /* channel.c    Queue, SimpleQueue, Pipe */
  mp_open_sync,         /* sync.c       Lock ... Barrier */
  mp_open_fd,           /* fd.c         Fd: a descriptor that crosses (_fd) */
  mp_open_title,        /* title.c      _set_title: what ps shows */
};

LUAMOD_API int luaopen_multiprocessing_core(lua_State *L);

__attribute__((visibility("default")))
int luaopen_multiprocessing_core(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"set_warning_handler", l_set_warning_handler}, {"_warn", l_warn},
    {"_now", l_now}, {"_isatty", l_isatty}, {NULL, NULL}
  };
  size_t i;
  if (getenv(MP_BOOT_ENV) != NULL)  /* a worker being booted: ours */
    mp_prefault_heap();
  luaL_newlib(L, funcs);                              /* M */
  lua_pushliteral(L, LMP_VERSION);   /* the one place the version is */
  lua_setfield(L, -2, "_VERSION");
  for (i = 0; i < sizeof parts / sizeof parts[0]; i++) {
    int top = mp_stack_top(L);
    parts[i](L);
    mp_stack_check(L, top, 0);
  }
  return 1;
}
