/*
** args.c -- checking the arguments of Lua-facing functions.
**
** lauxlib's checks name the function from the call site, which for our
** methods gives '?' or a bare 'put' (the methods are found through __index
** functions, or called through pcall).  Methods made by mp_new_class carry
** their public name ("Queue.put") as upvalue 1; the checks here use it and
** count arguments as the user wrote them, self not counted:
**   q:put(1, "x")  ->  bad argument #2 to 'Queue.put' (number expected,
**                      got string)
** In a function without that upvalue they behave as lauxlib's.
**
** Timeouts follow one rule everywhere (join, get, put, acquire, wait,
** poll): nil or none waits for ever, a negative number is 0 (loops that
** compute "time left" reach small negative values), NaN and anything but
** a number raise.
*/
#include <string.h>

#include "mp.h"

/* The longest timeout taken as given; more is "for ever" in practice and
** keeps deadline arithmetic finite. */
#define MAX_TIMEOUT 1e9

const char *mp_method_name(lua_State *L) {
  return lua_type(L, lua_upvalueindex(1)) == LUA_TSTRING
             ? lua_tostring(L, lua_upvalueindex(1)) : NULL;
}

int mp_argerror(lua_State *L, int arg, const char *extramsg) {
  const char *name = mp_method_name(L);
  if (name == NULL) return luaL_argerror(L, arg, extramsg);
  if (arg == 1)
    return luaL_error(L, "calling '%s' on bad self (%s)", name, extramsg);
  return luaL_error(L, "bad argument #%d to '%s' (%s)", arg - 1, name,
                    extramsg);
}

void mp_checknoargs(lua_State *L, int first) {
  if (lua_gettop(L) >= first)
    mp_argerror(L, first, lua_pushfstring(L, "no argument expected, got %s",
                                          luaL_typename(L, first)));
}

int mp_typeerror(lua_State *L, int arg, const char *tname) {
  const char *got;
  if (luaL_getmetafield(L, arg, "__name") == LUA_TSTRING)
    got = lua_tostring(L, -1);                  /* ... name */
  else if (lua_type(L, arg) == LUA_TLIGHTUSERDATA)
    got = "light userdata";
  else
    got = luaL_typename(L, arg);
  return mp_argerror(L, arg, lua_pushfstring(L, "%s expected, got %s",
                                             tname, got));
}

void mp_checktype(lua_State *L, int arg, int t) {
  if (lua_type(L, arg) != t) mp_typeerror(L, arg, lua_typename(L, t));
}

void *mp_checkudata(lua_State *L, int arg, const char *tname) {
  void *p = luaL_testudata(L, arg, tname);
  if (p == NULL) {
    const char *dot = strrchr(tname, '.');
    mp_typeerror(L, arg, dot ? dot + 1 : tname);
  }
  return p;
}

lua_Number mp_checknumber(lua_State *L, int arg) {
  int isnum;
  lua_Number n = lua_tonumberx(L, arg, &isnum);
  if (!isnum) mp_typeerror(L, arg, "number");
  return n;
}

lua_Integer mp_checkinteger(lua_State *L, int arg) {
  int isint;
  lua_Integer n = lua_tointegerx(L, arg, &isint);
  if (!isint) {
    if (lua_isnumber(L, arg))
      mp_argerror(L, arg, "number has no integer representation");
    else
      mp_typeerror(L, arg, "number");
  }
  return n;
}

lua_Integer mp_optinteger(lua_State *L, int arg, lua_Integer def) {
  return lua_isnoneornil(L, arg) ? def : mp_checkinteger(L, arg);
}

const char *mp_checklstring(lua_State *L, int arg, size_t *len) {
  const char *s = lua_tolstring(L, arg, len);
  if (s == NULL) mp_typeerror(L, arg, "string");
  return s;
}

double mp_opttimeout(lua_State *L, int arg) {
  double t;
  if (lua_isnoneornil(L, arg)) return -1;
  if (lua_type(L, arg) != LUA_TNUMBER)
    mp_typeerror(L, arg, "number of seconds");
  t = lua_tonumber(L, arg);
  if (t != t) mp_argerror(L, arg, "timeout is NaN");
  if (t < 0) return 0;
  return t > MAX_TIMEOUT ? MAX_TIMEOUT : t;
}
