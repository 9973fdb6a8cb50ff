/*
** exception.c -- ProcessException and its two kinds, as torch has them.
**
** An exception is a userdata whose uservalue holds its fields (msg,
** error_index, error_pid, pid, exit_code, signal_name, value, failures).
** Each type is a metatable; the metatable is also the type object that
** scripts compare against (mp.ProcessRaisedException), and its __parent field
** links a kind to ProcessException, which is what isinstance follows.
**
** Interrupted is a type of its own (not a kind of ProcessException): what
** every blocking call raises on Ctrl-C, naming the call and what the
** library did about it (mp_raise_interrupt, core._interrupt).
*/
#include <string.h>

#include "mp.h"

/* __index: fields first, then the type's own entries (such as __name). */
static int exception_index(lua_State *L) {
  lua_getiuservalue(L, 1, 1);                     /* e key fields */
  lua_pushvalue(L, 2);                            /* e key fields key */
  if (lua_rawget(L, -2) != LUA_TNIL) return 1;    /* e key fields v */
  lua_getmetatable(L, 1);                         /* e key fields nil mt */
  lua_pushvalue(L, 2);                            /* ... mt key */
  lua_rawget(L, -2);                              /* ... mt v */
  return 1;
}

/* tostring(e): its type, then e.msg, as Python prints an exception
** ("ProcessExitedException: process 3 terminated with exit code 123"), so
** an uncaught one says what it is and its full text.  An Interrupted's
** msg starts with what it is already ("interrupted: SIGINT during ..."). */
static int exception_tostring(lua_State *L) {
  const char *name, *dot;
  lua_getiuservalue(L, 1, 1);                         /* e fields */
  if (lua_getfield(L, -1, "msg") != LUA_TSTRING)      /* e fields msg */
    lua_pushstring(L, "(process exception without a message)");
  if (luaL_getmetafield(L, 1, "__name") != LUA_TSTRING)   /* ... msg name */
    return 1;
  name = lua_tostring(L, -1);
  if (strcmp(name, MP_EXC_INTERRUPTED) == 0) {
    lua_pop(L, 1);
    return 1;
  }
  dot = strrchr(name, '.');
  lua_pushfstring(L, "%s: %s", dot ? dot + 1 : name, lua_tostring(L, -2));
  return 1;
}

/* Pushes the type (metatable) 'tname', a kind of 'parent' (or none). */
static void new_type(lua_State *L, const char *tname, const char *parent) {
  luaL_newmetatable(L, tname);                        /* T */
  lua_pushcfunction(L, exception_index);              /* T f */
  lua_setfield(L, -2, "__index");                     /* T */
  lua_pushcfunction(L, exception_tostring);           /* T f */
  lua_setfield(L, -2, "__tostring");                  /* T */
  if (parent != NULL) {
    luaL_getmetatable(L, parent);                     /* T P */
    lua_setfield(L, -2, "__parent");                  /* T */
  }
}

void mp_exception_new(lua_State *L, const char *tname, int fields) {
  int top = mp_stack_top(L);
  fields = lua_absindex(L, fields);
  lua_newuserdatauv(L, 0, 1);                         /* e */
  lua_pushvalue(L, fields);                           /* e fields */
  lua_setiuservalue(L, -2, 1);                        /* e */
  luaL_setmetatable(L, tname);
  mp_stack_check(L, top, 1);
}

/* isinstance(value, T): true when value's type is T or a kind of T.  Any
** value may be asked about; the metatable is read raw, so a __metatable
** field cannot make a string pass for an exception. */
static int l_isinstance(lua_State *L) {
  luaL_checkany(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  if (!lua_getmetatable(L, 1)) {                      /* v T mt */
    lua_pushboolean(L, 0);
    return 1;
  }
  for (;;) {                                          /* v T type */
    if (lua_rawequal(L, -1, 2)) {
      lua_pushboolean(L, 1);
      return 1;
    }
    lua_pushliteral(L, "__parent");                   /* v T type "__parent" */
    if (lua_rawget(L, -2) != LUA_TTABLE) {            /* v T type parent */
      lua_pushboolean(L, 0);
      return 1;
    }
    lua_remove(L, -2);                                /* v T parent */
  }
}

/* --- Interrupted ---------------------------------------------------------- */

/* A frame of the library itself: a C function, or a chunk of
** .../multiprocessing/<file>.lua (the Lua layer). */
static int library_frame(const lua_Debug *ar) {
  const char *s = ar->source, *dir, *last;
  size_t n;
  if (*ar->what == 'C') return 1;
  if (s == NULL || s[0] != '@') return 0;
  n = strlen(s);
  if (n < 4 || strcmp(s + n - 4, ".lua") != 0) return 0;
  last = strrchr(s, '/');
  if (last == NULL) return 0;
  for (dir = last; dir > s + 1 && dir[-1] != '/'; dir--) {}
  return (size_t)(last - dir) == strlen("multiprocessing") &&
         strncmp(dir, "multiprocessing", (size_t)(last - dir)) == 0;
}

/* The level of the user's call site: the first frame above the running
** function that is not the library's (0 when there is none). */
static int user_level(lua_State *L) {
  lua_Debug ar;
  int level;
  for (level = 1; lua_getstack(L, level, &ar); level++) {
    if (lua_getinfo(L, "S", &ar) && !library_frame(&ar)) return level;
  }
  return 0;
}

int mp_raise_interrupt(lua_State *L, const char *call, const char *done) {
  int level;
  luaL_checkstack(L, 8, "raising an interrupt");
  level = user_level(L);
  lua_createtable(L, 0, 7);                           /* fields */
  lua_pushliteral(L, "interrupt");
  lua_setfield(L, -2, "kind");
  lua_pushliteral(L, "SIGINT");
  lua_setfield(L, -2, "signal");
  lua_pushstring(L, call);
  lua_setfield(L, -2, "call");
  lua_pushfstring(L, "interrupted: SIGINT during %s; %s", call, done);
  lua_setfield(L, -2, "msg");
  if (level > 0) {
    lua_Debug ar;
    lua_getstack(L, level, &ar);
    lua_getinfo(L, "Sl", &ar);
    lua_pushfstring(L, "%s:%d", ar.short_src, ar.currentline);
    lua_setfield(L, -2, "where");                     /* "chunk:line" */
    luaL_traceback(L, L, NULL, level);                /* fields tb */
    lua_setfield(L, -2, "traceback");
  }
  mp_exception_new(L, MP_EXC_INTERRUPTED, -1);        /* fields e */
  return lua_error(L);
}

/* core._interrupt(call, done): raises the Interrupted of the Lua layer's
** blocking calls (Pool.map: "the pool was terminated, its workers
** reaped"); its where and traceback are the user's call site's. */
static int l_interrupt(lua_State *L) {
  const char *call = luaL_checkstring(L, 1);
  const char *done = luaL_checkstring(L, 2);
  return mp_raise_interrupt(L, call, done);
}

void mp_open_exception(lua_State *L) {               /* M */
  new_type(L, MP_EXC_BASE, NULL);                     /* M T */
  lua_setfield(L, -2, "ProcessException");            /* M */
  new_type(L, MP_EXC_RAISED, MP_EXC_BASE);
  lua_setfield(L, -2, "ProcessRaisedException");
  new_type(L, MP_EXC_EXITED, MP_EXC_BASE);
  lua_setfield(L, -2, "ProcessExitedException");
  new_type(L, MP_EXC_INTERRUPTED, NULL);
  lua_setfield(L, -2, "Interrupted");
  lua_pushcfunction(L, l_interrupt);
  lua_setfield(L, -2, "_interrupt");
  lua_pushcfunction(L, l_isinstance);                 /* M f */
  lua_setfield(L, -2, "isinstance");                  /* M */
}
