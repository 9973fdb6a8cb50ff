/*
** exception.c -- ProcessException and its two kinds, as torch has them.
**
** An exception is a userdata whose uservalue holds its fields (msg,
** error_index, error_pid, pid, exit_code, signal_name, value, failures).
** Each type is a metatable; the metatable is also the type object that
** scripts compare against (mp.ProcessRaisedException), and its __parent field
** links a kind to ProcessException, which is what isinstance follows.
*/
#include "mp.h"

/* __index: fields first, then the type's own entries (such as __name). */
static int exception_index(lua_State *L) {
  lua_getiuservalue(L, 1, 1);
  lua_pushvalue(L, 2);
  if (lua_rawget(L, -2) != LUA_TNIL) return 1;
  lua_getmetatable(L, 1);
  lua_pushvalue(L, 2);
  lua_rawget(L, -2);
  return 1;
}

/* tostring(e) == e.msg, so an uncaught exception prints its full text. */
static int exception_tostring(lua_State *L) {
  lua_getiuservalue(L, 1, 1);
  if (lua_getfield(L, -1, "msg") != LUA_TSTRING)
    lua_pushstring(L, "(process exception without a message)");
  return 1;
}

static void new_type(lua_State *L, const char *tname, const char *parent) {
  luaL_newmetatable(L, tname);
  lua_pushcfunction(L, exception_index);
  lua_setfield(L, -2, "__index");
  lua_pushcfunction(L, exception_tostring);
  lua_setfield(L, -2, "__tostring");
  if (parent != NULL) {
    luaL_getmetatable(L, parent);
    lua_setfield(L, -2, "__parent");
  }
}

void mp_exception_new(lua_State *L, const char *tname, int fields) {
  fields = lua_absindex(L, fields);
  lua_newuserdatauv(L, 0, 1);
  lua_pushvalue(L, fields);
  lua_setiuservalue(L, -2, 1);
  luaL_setmetatable(L, tname);
}

/* isinstance(value, T): true when value's type is T or a kind of T.  Any
** value may be asked about; the metatable is read raw, so a __metatable
** field cannot make a string pass for an exception. */
static int l_isinstance(lua_State *L) {
  luaL_checkany(L, 1);
  luaL_checktype(L, 2, LUA_TTABLE);
  if (!lua_getmetatable(L, 1)) {
    lua_pushboolean(L, 0);
    return 1;
  }
  for (;;) {
    if (lua_rawequal(L, -1, 2)) {
      lua_pushboolean(L, 1);
      return 1;
    }
    lua_pushliteral(L, "__parent");
    if (lua_rawget(L, -2) != LUA_TTABLE) {
      lua_pushboolean(L, 0);
      return 1;
    }
    lua_remove(L, -2);
  }
}

void mp_open_exception(lua_State *L) {
  new_type(L, MP_EXC_BASE, NULL);
  lua_setfield(L, -2, "ProcessException");
  new_type(L, MP_EXC_RAISED, MP_EXC_BASE);
  lua_setfield(L, -2, "ProcessRaisedException");
  new_type(L, MP_EXC_EXITED, MP_EXC_BASE);
  lua_setfield(L, -2, "ProcessExitedException");
  lua_pushcfunction(L, l_isinstance);
  lua_setfield(L, -2, "isinstance");
}
