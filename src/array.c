/*
** array.c -- Array and Value: typed arrays of numbers or bytes, private or
** in shared memory.
**
** mp.Array(ctype, n | table | string [, {shared = false}]) is shared by
** default (as Python's); {shared = false} makes a private one that
** a:share_memory() moves into shared memory later (torch's share_memory_()).
** Shared arrays use the sharing strategy current when they become shared.
** A shared array crossing a process boundary arrives as the same memory; a
** private one is copied.
**
** A shared segment starts with a 64-byte header (magic, ctype, length, and
** for file_system the count of references to its name); the elements
** follow.  file_system: every mapping process holds one reference, and every
** encoding of the array holds one for the receiver (torch's incref on send,
** decref on receipt); the name is unlinked when the count reaches zero.
** These references belong to Array objects, not to mappings: the Arrays of
** one process on the same memory share one mapping (mp_Map, shm.c), so an
** array received again costs no mmap, but each still holds its own.
**
** Synchronised, as Python's: a shared Array or Value gets a lock, a new
** RLock unless {lock = false} or {lock = a Lock or RLock} says otherwise
** (uservalue 2; it crosses processes inside the array's encoding).  Every element
** access, fill, totable, tostring and copy holds it for its duration;
** get_lock() returns it and get_obj() the same memory without it.  An
** array without a lock (lock = false, or private) has neither method.
*/
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mp.h"
#include "codec.h"
#include "sharing.h"

#define ARRAY_T  "multiprocessing.Array"
#define VALUE_T  "multiprocessing.Value"
#define ARR_MAGIC 0x6d706172u   /* "mpar" */
#define HDR_SIZE 64
#define MAX_BYTES ((size_t)1 << 46)

/* The element types.  The number is in a shared segment's header and in
** an encoded Array (ArrayWire): explicit values, never renumbered. */
typedef enum ElemType {
  E_INT8 = 0, E_INT16 = 1, E_INT32 = 2, E_INT64 = 3,
  E_UINT8 = 4, E_UINT16 = 5, E_UINT32 = 6, E_UINT64 = 7,
  E_FLOAT = 8, E_DOUBLE = 9, E_CHAR = 10
} ElemType;
#define NCTYPES 11

typedef enum ElemKind { K_SIGNED, K_UNSIGNED, K_REAL, K_CHAR } ElemKind;

typedef struct CType {
  const char *name;
  unsigned char size;
  ElemKind kind;
} CType;

static const CType ctypes[NCTYPES] = {
  [E_INT8] = {"int8", 1, K_SIGNED},     [E_INT16] = {"int16", 2, K_SIGNED},
  [E_INT32] = {"int32", 4, K_SIGNED},   [E_INT64] = {"int64", 8, K_SIGNED},
  [E_UINT8] = {"uint8", 1, K_UNSIGNED}, [E_UINT16] = {"uint16", 2, K_UNSIGNED},
  [E_UINT32] = {"uint32", 4, K_UNSIGNED},
  [E_UINT64] = {"uint64", 8, K_UNSIGNED},
  [E_FLOAT] = {"float", 4, K_REAL},     [E_DOUBLE] = {"double", 8, K_REAL},
  [E_CHAR] = {"char", 1, K_CHAR},
};

/* aliases, including Python's array/ctypes typecodes */
static const struct { const char *alias; const char *name; } aliases[] = {
  {"b", "int8"}, {"B", "uint8"}, {"h", "int16"}, {"H", "uint16"},
  {"i", "int32"}, {"I", "uint32"}, {"l", "int64"}, {"L", "uint64"},
  {"q", "int64"}, {"Q", "uint64"}, {"f", "float"}, {"d", "double"},
  {"c", "char"}, {"int", "int32"}, {"long", "int64"}, {"byte", "uint8"},
  {"float32", "float"}, {"float64", "double"}, {"bytes", "char"},
};

typedef struct ArrHdr {
  uint32_t magic;
  uint32_t ctype;
  uint64_t n;
  uint32_t refs;          /* file_system: references to the name */
  uint32_t trkslot;       /* file_system: where the creator's tracker ... */
  uint64_t trkid;         /* ... registered the name */
} ArrHdr;

typedef struct Array {
  unsigned char *data;    /* the elements; NULL once closed */
  size_t n;
  ElemType ct;
  int isvalue;
  int locked;             /* has a lock (uservalue 2) */
  pid_t refpid;           /* the process whose reference this object holds */
  mp_Map *map;            /* when shared: the mapping (also uservalue 1) */
} Array;

/* The element type named 'name' (or an alias), or -1. */
static int find_ctype(const char *name) {
  int i;
  size_t j;
  for (j = 0; j < sizeof aliases / sizeof aliases[0]; j++)
    if (strcmp(aliases[j].alias, name) == 0) { name = aliases[j].name; break; }
  for (i = 0; i < NCTYPES; i++)
    if (strcmp(ctypes[i].name, name) == 0) return i;
  return -1;
}

static ElemType check_ctype(lua_State *L, int idx) {
  const char *name = mp_checklstring(L, idx, NULL);
  int ct = find_ctype(name);
  if (ct < 0)
    mp_argerror(L, idx, lua_pushfstring(L, "unknown ctype '%s' (expected "
        "int8..int64, uint8..uint64, float, double or char)", name));
  return (ElemType)ct;
}

static Array *toarray(lua_State *L, int idx) {
  Array *a = (Array *)luaL_testudata(L, idx, ARRAY_T);
  if (!a) a = (Array *)luaL_testudata(L, idx, VALUE_T);
  if (!a) mp_typeerror(L, idx, "Array or Value");
  return a;
}

static Array *checkarray(lua_State *L, int idx) {
  Array *a = toarray(L, idx);
  if (!a->data) luaL_error(L, "attempt to use a closed %s",
                           a->isvalue ? "Value" : "Array");
  return a;
}

/* Around one access to the array at idx: takes its lock, if it has one.
** Returns what sync_leave needs (whether it took the lock).  Nothing that
** raises may come between the two. */
static int sync_enter(lua_State *L, int idx, Array *a) {
  int taken;
  if (!a->locked) return 0;
  lua_getiuservalue(L, idx, 2);                             /* ... lock */
  taken = mp_lock_enter(L, -1, a->isvalue ? "Value" : "Array");
  lua_pop(L, 1);
  return taken;
}

static void sync_leave(lua_State *L, int idx, int taken) {
  if (!taken) return;
  lua_getiuservalue(L, idx, 2);                             /* ... lock */
  mp_lock_leave(L, -1);
  lua_pop(L, 1);
}

static Array *newarray(lua_State *L, ElemType ct, size_t n, int isvalue) {
  Array *a = (Array *)lua_newuserdatauv(L, sizeof(Array), 2);
  memset(a, 0, sizeof *a);
  a->ct = ct;
  a->n = n;
  a->isvalue = isvalue;
  luaL_setmetatable(L, isvalue ? VALUE_T : ARRAY_T);
  return a;
}

static size_t nbytes(const Array *a) { return a->n * ctypes[a->ct].size; }

static void alloc_private(lua_State *L, Array *a) {
  a->data = (unsigned char *)calloc(nbytes(a) ? nbytes(a) : 1, 1);
  if (!a->data) luaL_error(L, "not enough memory for an Array of %I bytes",
                           (lua_Integer)nbytes(a));
}

static ArrHdr *array_hdr(Array *a) {
  return (ArrHdr *)(void *)a->map->seg.base;
}

/* 'a' (at idx) starts using the mapping at the top of the stack (popped);
** its uservalue keeps the mapping alive while the Array is. */
static void attach_map(lua_State *L, int idx, Array *a, mp_Map *m) {
  idx = lua_absindex(L, idx);
  mp_map_use(m);
  a->map = m;
  a->data = m->seg.base + HDR_SIZE;
  lua_setiuservalue(L, idx, 1);
}

static void own_reference(lua_State *L, int idx);

/* Maps new shared memory for 'a' (at idx; its data, if any, is copied
** over). */
static void make_shared(lua_State *L, int idx, Array *a, int kind) {
  mp_Map *m;
  ArrHdr *h;
  unsigned char *old = a->data;
  idx = lua_absindex(L, idx);
  m = mp_map_create(L, HDR_SIZE + nbytes(a), kind);
  h = (ArrHdr *)(void *)m->seg.base;
  h->magic = ARR_MAGIC;
  h->ctype = (uint32_t)a->ct;
  h->n = a->n;
  h->refs = 1;
  h->trkid = m->seg.trkid;
  h->trkslot = m->seg.trkslot;
  if (old) memcpy(m->seg.base + HDR_SIZE, old, nbytes(a));
  attach_map(L, idx, a, m);
  free(old);
  a->refpid = getpid();
  if (kind == MP_SEG_NAME) own_reference(L, idx);
}

/* The arrays that hold a file_system reference of this process, weakly:
** a worker gives them back before its _exit (mp_array_exit), and lists
** them in its ledger, for a death with no exit. */
#define OWNED_KEY "multiprocessing.array.owned"

static void own_reference(lua_State *L, int idx) {
  idx = lua_absindex(L, idx);
  if (lua_getfield(L, LUA_REGISTRYINDEX, OWNED_KEY) != LUA_TTABLE) {
    lua_pop(L, 1);
    lua_newtable(L);
    lua_createtable(L, 0, 1);
    lua_pushliteral(L, "k");
    lua_setfield(L, -2, "__mode");
    lua_setmetatable(L, -2);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, OWNED_KEY);
  }
  lua_pushvalue(L, idx);
  lua_pushboolean(L, 1);
  lua_rawset(L, -3);
  lua_pop(L, 1);
  mp_ledger_note(L, toarray(L, idx)->map->seg.name, 1);
}

/* 'a' is at idx.  Its reference goes before its use of the mapping: the
** header it decrements must still be mapped. */
static void array_release(lua_State *L, int idx, Array *a) {
  if (!a->data) return;
  idx = lua_absindex(L, idx);
  if (a->map) {
    mp_Seg *s = &a->map->seg;
    if (s->kind == MP_SEG_NAME && a->refpid == getpid()) {
      mp_ledger_note(L, s->name, -1);
      if (__atomic_sub_fetch(&array_hdr(a)->refs, 1, __ATOMIC_ACQ_REL) == 0)
        mp_seg_unlink(L, s);
    }
    mp_map_release(a->map);
    a->map = NULL;
    lua_pushnil(L);            /* a closed Array keeps no mapping alive */
    lua_setiuservalue(L, idx, 1);
  } else {
    free(a->data);
  }
  a->data = NULL;
}

static int array_gc(lua_State *L) {
  array_release(L, 1, toarray(L, 1));
  return 0;
}

void mp_array_give_back(lua_State *L, const char *name, int64_t n) {
  int top = lua_gettop(L);
  mp_Seg s;
  if (mp_seg_head_from_name(L, &s, name, HDR_SIZE) == 0) {
    ArrHdr *h = (ArrHdr *)(void *)s.base;
    uint32_t refs = __atomic_load_n(&h->refs, __ATOMIC_ACQUIRE), left;
    if (h->magic == ARR_MAGIC && refs > 0) {
      do left = (uint64_t)n >= refs ? 0 : refs - (uint32_t)n;
      while (!__atomic_compare_exchange_n(&h->refs, &refs, left, 0,
                                          __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE));
      if (left == 0) {
        s.trkid = h->trkid;
        s.trkslot = h->trkslot;
        mp_seg_unlink(L, &s);
      }
    }
    mp_seg_close(&s);
  }
  lua_settop(L, top);          /* a name already gone leaves no message */
}

void mp_array_exit(lua_State *L) {
  pid_t self;
  if (lua_getfield(L, LUA_REGISTRYINDEX, OWNED_KEY) != LUA_TTABLE) {
    lua_pop(L, 1);
    return;  /* most workers own no array: not even a getpid */
  }
  self = getpid();
  lua_pushnil(L);
  while (lua_next(L, -2)) {
    Array *a = (Array *)lua_touserdata(L, -2);
    if (a->data && a->map && a->refpid == self) array_release(L, -2, a);
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
}

/* --- elements ------------------------------------------------------------ */

static void push_elem(lua_State *L, const Array *a, size_t i) {
  const unsigned char *p = a->data + i * ctypes[a->ct].size;
  union {
    int8_t i8; int16_t i16; int32_t i32; int64_t i64;
    uint16_t u16; uint32_t u32; uint64_t u64; float f; double d;
  } v;
  switch (a->ct) {   /* memcpy of a constant size: a plain load */
    case E_INT8:   memcpy(&v, p, 1); lua_pushinteger(L, v.i8); break;
    case E_INT16:  memcpy(&v, p, 2); lua_pushinteger(L, v.i16); break;
    case E_INT32:  memcpy(&v, p, 4); lua_pushinteger(L, v.i32); break;
    case E_INT64:  memcpy(&v, p, 8); lua_pushinteger(L, v.i64); break;
    case E_UINT8:  lua_pushinteger(L, p[0]); break;
    case E_UINT16: memcpy(&v, p, 2); lua_pushinteger(L, v.u16); break;
    case E_UINT32: memcpy(&v, p, 4); lua_pushinteger(L, v.u32); break;
    case E_UINT64:
      memcpy(&v, p, 8); lua_pushinteger(L, (lua_Integer)v.u64); break;
    case E_FLOAT:  memcpy(&v, p, 4); lua_pushnumber(L, v.f); break;
    case E_DOUBLE: memcpy(&v, p, 8); lua_pushnumber(L, v.d); break;
    case E_CHAR:   lua_pushlstring(L, (const char *)p, 1); break;
  }
}

/* The integers each integer type holds (a char set from a number: 0..255). */
static const struct { lua_Integer lo, hi; } int_range[NCTYPES] = {
  [E_INT8] = {-128, 127}, [E_INT16] = {-32768, 32767},
  [E_INT32] = {-2147483647 - 1, 2147483647},
  [E_INT64] = {LUA_MININTEGER, LUA_MAXINTEGER},
  [E_UINT8] = {0, 255}, [E_UINT16] = {0, 65535},
  [E_UINT32] = {0, 4294967295LL},
  [E_UINT64] = {LUA_MININTEGER, LUA_MAXINTEGER},
  [E_CHAR] = {0, 255},
};

/* Raises msg: as a bad argument 'arg' of the running function (arg > 0),
** else prefixed with 'what'. */
static void elem_error(lua_State *L, int arg, const char *what,
                       const char *msg) {
  if (arg > 0) mp_argerror(L, arg, msg);
  luaL_error(L, "%s: %s", what, msg);
}

/* Converts the Lua value at idx for ctype ct into 'out' (8 bytes); raises
** (elem_error) when it does not fit. */
static void to_elem(lua_State *L, ElemType ct, int idx, unsigned char *out,
                    int arg, const char *what) {
  const CType *t = &ctypes[ct];
  if (t->kind == K_REAL) {
    int ok;
    lua_Number x = lua_tonumberx(L, idx, &ok);
    if (!ok)
      elem_error(L, arg, what, lua_pushfstring(L, "expected a number for "
                 "%s, got %s", t->name, luaL_typename(L, idx)));
    if (ct == E_FLOAT) { float f = (float)x; memcpy(out, &f, 4); }
    else memcpy(out, &x, 8);
    return;
  }
  if (t->kind == K_CHAR && lua_type(L, idx) == LUA_TSTRING) {
    size_t len;
    const char *s = lua_tolstring(L, idx, &len);
    if (len != 1)
      elem_error(L, arg, what, lua_pushfstring(L, "expected a one-byte "
                 "string for char, got %I bytes", (lua_Integer)len));
    out[0] = (unsigned char)s[0];
    return;
  }
  {
    int ok;
    lua_Integer v = lua_tointegerx(L, idx, &ok);
    if (!ok && lua_type(L, idx) == LUA_TNUMBER)
      elem_error(L, arg, what, lua_pushfstring(L, "%s has no integer "
                 "representation for %s", lua_tostring(L, idx), t->name));
    if (!ok)
      elem_error(L, arg, what, lua_pushfstring(L, "expected an integer for "
                 "%s, got %s", t->name, luaL_typename(L, idx)));
    if (v < int_range[ct].lo || v > int_range[ct].hi)
      elem_error(L, arg, what, lua_pushfstring(L, "value %I out of range "
                 "for %s", v, t->name));
    switch (t->size) {
      case 1: { uint8_t x = (uint8_t)v; memcpy(out, &x, 1); break; }
      case 2: { uint16_t x = (uint16_t)v; memcpy(out, &x, 2); break; }
      case 4: { uint32_t x = (uint32_t)v; memcpy(out, &x, 4); break; }
      default: { uint64_t x = (uint64_t)v; memcpy(out, &x, 8); break; }
    }
  }
}

/* Sets element i of the array at 1 (under its lock) to the value at idx. */
static void set_elem(lua_State *L, Array *a, size_t i, int idx,
                     const char *what) {
  unsigned char tmp[8];
  int taken;
  to_elem(L, a->ct, idx, tmp, 0, what);
  taken = sync_enter(L, 1, a);
  memcpy(a->data + i * ctypes[a->ct].size, tmp, ctypes[a->ct].size);
  sync_leave(L, 1, taken);
}

/* Pushes element i of the array a at idx, read under its lock. */
static void get_elem(lua_State *L, Array *a, int idx, size_t i) {
  int taken;
  luaL_checkstack(L, 2, NULL);
  taken = sync_enter(L, idx, a);
  push_elem(L, a, i);
  sync_leave(L, idx, taken);
}

static size_t check_index(lua_State *L, Array *a, int idx) {
  int ok;
  lua_Integer i = lua_tointegerx(L, idx, &ok);
  if (!ok)
    luaL_error(L, "Array index must be an integer, got %s",
               lua_type(L, idx) == LUA_TNUMBER ? "a float" : luaL_typename(L, idx));
  if (i < 1 || (lua_Unsigned)i > a->n)
    luaL_error(L, "Array index %I out of range (1..%I)", i, (lua_Integer)a->n);
  return (size_t)(i - 1);
}

/* an optional 1-based position (negative counts from the end), clamped */
static size_t optpos(lua_State *L, int idx, size_t n, lua_Integer def) {
  lua_Integer i = mp_optinteger(L, idx, def);
  if (i < 0) i = (lua_Integer)n + i + 1;
  if (i < 0) i = 0;
  if ((lua_Unsigned)i > n) i = (lua_Integer)n;
  return (size_t)i;
}

/* --- constructors -------------------------------------------------------- */

/* opts at idx: {shared = boolean, lock = boolean | Lock | RLock}; default
** shared.  Returns whether shared and pushes the lock to attach, or nil. */
static int push_opts(lua_State *L, int idx) {
  int shared = 1;
  if (!lua_isnoneornil(L, idx)) {
    mp_checktype(L, idx, LUA_TTABLE);
    if (lua_getfield(L, idx, "shared") != LUA_TNIL)
      shared = lua_toboolean(L, -1);
    lua_pop(L, 1);
    lua_getfield(L, idx, "lock");                   /* ... lock */
  } else {
    lua_pushnil(L);
  }
  if (lua_isnil(L, -1) && shared) {
    lua_pop(L, 1);
    mp_new_rlock(L);
  } else if (lua_isboolean(L, -1)) {
    int want = lua_toboolean(L, -1);
    lua_pop(L, 1);
    if (want && !shared)
      mp_argerror(L, idx, "a private (shared = false) array has no lock");
    if (want) mp_new_rlock(L);
    else lua_pushnil(L);
  } else if (!lua_isnil(L, -1) && !mp_islock(L, -1)) {
    mp_argerror(L, idx, lua_pushfstring(L, "lock must be true, false, a "
                "Lock or an RLock, got %s", luaL_typename(L, -1)));
  } else if (!lua_isnil(L, -1) && !shared) {
    mp_argerror(L, idx, "a private (shared = false) array has no lock");
  }
  return shared;
}

/* Attaches the lock (or nil) at the top, popped, to the array at idx. */
static void attach_lock(lua_State *L, int idx, Array *a) {
  a->locked = !lua_isnil(L, -1);
  lua_setiuservalue(L, idx, 2);
}

/* mp.Array(ctype, n | table | string [, {shared = true, lock = true}]) */
static int new_array(lua_State *L) {
  int ct = check_ctype(L, 1);
  size_t n, i, esz = ctypes[ct].size;
  int shared;
  Array *a;
  lua_settop(L, 3);
  shared = push_opts(L, 3);                     /* ctype init opts lock */
  switch (lua_type(L, 2)) {
    case LUA_TNUMBER: {
      lua_Integer k = mp_checkinteger(L, 2);
      if (k < 0 || (lua_Unsigned)k > MAX_BYTES / esz)
        mp_argerror(L, 2, "size out of range");
      n = (size_t)k;
      break;
    }
    case LUA_TTABLE: n = (size_t)luaL_len(L, 2); break;
    case LUA_TSTRING: {
      size_t len = lua_rawlen(L, 2);
      if (len % esz)
        return mp_argerror(L, 2, lua_pushfstring(L, "string of %I bytes "
            "is not a whole number of %s", (lua_Integer)len, ctypes[ct].name));
      n = len / esz;
      break;
    }
    default:
      return mp_typeerror(L, 2, "size, table or string");
  }
  a = newarray(L, ct, n, 0);                    /* ctype init opts lock a */
  if (shared) make_shared(L, -1, a, mp_sharing_strategy(L));
  else alloc_private(L, a);
  if (lua_type(L, 2) == LUA_TTABLE) {
    unsigned char tmp[8];
    for (i = 0; i < n; i++) {
      lua_geti(L, 2, (lua_Integer)i + 1);
      to_elem(L, ct, -1, tmp, 0, "Array");
      memcpy(a->data + i * esz, tmp, esz);
      lua_pop(L, 1);
    }
  } else if (lua_type(L, 2) == LUA_TSTRING) {
    memcpy(a->data, lua_tostring(L, 2), n * esz);
  }
  lua_insert(L, -2);                            /* ctype init opts a lock */
  attach_lock(L, -2, a);                        /* ctype init opts a */
  return 1;
}

/* mp.Value(ctype [, v] [, {shared = true, lock = true}]) */
static int new_value(lua_State *L) {
  int ct = check_ctype(L, 1);
  unsigned char tmp[8];
  int shared;
  Array *a;
  lua_settop(L, 3);
  if (!lua_isnil(L, 2)) to_elem(L, ct, 2, tmp, 2, "Value");
  shared = push_opts(L, 3);                     /* ctype v opts lock */
  a = newarray(L, ct, 1, 1);                    /* ctype v opts lock a */
  if (shared) make_shared(L, -1, a, mp_sharing_strategy(L));
  else alloc_private(L, a);
  if (!lua_isnil(L, 2)) memcpy(a->data, tmp, ctypes[ct].size);
  lua_insert(L, -2);                            /* ctype v opts a lock */
  attach_lock(L, -2, a);                        /* ctype v opts a */
  return 1;
}

/* --- methods ------------------------------------------------------------- */

static int array_fill(lua_State *L) {
  Array *a = checkarray(L, 1);
  size_t esz = ctypes[a->ct].size, i;
  unsigned char tmp[8];
  int taken;
  to_elem(L, a->ct, 2, tmp, 2, "Array.fill");
  taken = sync_enter(L, 1, a);
  if (esz == 1) memset(a->data, tmp[0], a->n);
  else for (i = 0; i < a->n; i++) memcpy(a->data + i * esz, tmp, esz);
  sync_leave(L, 1, taken);
  lua_settop(L, 1);
  return 1;
}

/* a:totable([i [, j]]) */
static int array_totable(lua_State *L) {
  Array *a = checkarray(L, 1);
  size_t i = optpos(L, 2, a->n, 1), j = optpos(L, 3, a->n, -1), k;
  int taken;
  if (i < 1) i = 1;
  lua_createtable(L, j >= i ? (int)(j - i + 1) : 0, 0);
  luaL_checkstack(L, 2, NULL);
  taken = sync_enter(L, 1, a);     /* the table is made: nothing raises */
  for (k = i; k <= j; k++) {
    push_elem(L, a, k - 1);
    lua_rawseti(L, -2, (lua_Integer)(k - i + 1));
  }
  sync_leave(L, 1, taken);
  return 1;
}

/* a:tostring([i [, j]]) -> the raw bytes of elements i..j */
static int array_tostring(lua_State *L) {
  Array *a = checkarray(L, 1);
  size_t esz = ctypes[a->ct].size;
  size_t i = optpos(L, 2, a->n, 1), j = optpos(L, 3, a->n, -1);
  if (i < 1) i = 1;
  if (j < i) {
    lua_pushliteral(L, "");
  } else {
    luaL_Buffer b;
    size_t len = (j - i + 1) * esz;
    char *p = luaL_buffinitsize(L, &b, len);
    int taken = sync_enter(L, 1, a);
    memcpy(p, a->data + (i - 1) * esz, len);
    sync_leave(L, 1, taken);
    luaL_pushresultsize(&b, len);
  }
  return 1;
}

/* a:copy(src [, dst = 1 [, first = 1 [, last]]]) -> a
** Copies src[first..last] into a starting at element dst.  src is an Array
** or Value (same ctype: one memmove; another ctype: converted element by
** element), a string (raw bytes; first/last are byte positions and the count
** must be a whole number of elements) or a table of values. */
static int array_copy(lua_State *L) {
  Array *a = checkarray(L, 1);
  size_t esz = ctypes[a->ct].size, dst, first, last, count, srcn = 0, k;
  Array *src = NULL;
  lua_Integer d = mp_optinteger(L, 3, 1);
  const unsigned char *from;
  int st = lua_type(L, 2), taken, srctaken = 0;
  if (st == LUA_TUSERDATA) src = checkarray(L, 2);
  else if (st == LUA_TSTRING) srcn = lua_rawlen(L, 2);
  else if (st != LUA_TTABLE) return mp_typeerror(L, 2, "Array, string or table");
  if (src) srcn = src->n;
  else if (st == LUA_TTABLE) srcn = (size_t)luaL_len(L, 2);
  if (d < 1 || (lua_Unsigned)d > a->n + 1)
    mp_argerror(L, 3, "destination index out of range");
  dst = (size_t)d - 1;
  first = optpos(L, 4, srcn, 1);
  last = optpos(L, 5, srcn, -1);
  if (first < 1) first = 1;
  count = last >= first ? last - first + 1 : 0;
  if (st == LUA_TSTRING) {
    if (count % esz)
      return mp_argerror(L, 2, "byte count is not a whole number of elements");
    if (dst + count / esz > a->n)
      return luaL_error(L, "Array.copy: %I bytes do not fit at index %I of %I "
                        "elements", (lua_Integer)count, d, (lua_Integer)a->n);
    from = (const unsigned char *)lua_tostring(L, 2) + first - 1;
  } else {
    if (dst + count > a->n)
      return luaL_error(L, "Array.copy: %I elements do not fit at index %I of "
                        "%I", (lua_Integer)count, d, (lua_Integer)a->n);
    if (src && src->ct == a->ct) {
      from = src->data + (first - 1) * esz;
      if (src != a) srctaken = sync_enter(L, 2, src);
    } else {
      /* converted first, into a buffer: nothing raises under the lock */
      unsigned char *buf = (unsigned char *)lua_newuserdatauv(L,
                               count * esz + 1, 0);   /* ... buf */
      for (k = 0; k < count; k++) {
        unsigned char tmp[8];
        if (src) get_elem(L, src, 2, first - 1 + k);
        else lua_geti(L, 2, (lua_Integer)(first + k));
        to_elem(L, a->ct, -1, tmp, 0, "Array.copy");
        memcpy(buf + k * esz, tmp, esz);
        lua_pop(L, 1);
      }
      from = buf;
    }
    count *= esz;
  }
  taken = sync_enter(L, 1, a);
  memmove(a->data + dst * esz, from, count);
  sync_leave(L, 1, taken);
  sync_leave(L, 2, srctaken);
  lua_settop(L, 1);
  return 1;
}

static int array_share_memory(lua_State *L) {
  Array *a = checkarray(L, 1);
  if (!a->map) make_shared(L, 1, a, mp_sharing_strategy(L));
  lua_settop(L, 1);
  return 1;
}

static int array_is_shared(lua_State *L) {
  Array *a = checkarray(L, 1);
  lua_pushboolean(L, a->map != NULL);
  return 1;
}

static int array_ctype(lua_State *L) {
  lua_pushstring(L, ctypes[checkarray(L, 1)->ct].name);
  return 1;
}

static int array_itemsize(lua_State *L) {
  lua_pushinteger(L, ctypes[checkarray(L, 1)->ct].size);
  return 1;
}

/* a:get_lock() -> the Lock or RLock of a synchronised array */
static int array_get_lock(lua_State *L) {
  Array *a = checkarray(L, 1);
  if (!a->locked) return luaL_error(L, "%s has no lock", luaL_tolstring(L, 1, NULL));
  lua_getiuservalue(L, 1, 2);
  return 1;
}

/* a:get_obj() -> the same shared memory, without the lock */
static int array_get_obj(lua_State *L) {
  Array *a = checkarray(L, 1), *o;
  if (!a->locked) return luaL_error(L, "%s has no lock", luaL_tolstring(L, 1, NULL));
  o = newarray(L, a->ct, a->n, a->isvalue);                 /* a o */
  lua_getiuservalue(L, 1, 1);                               /* a o map */
  attach_map(L, 2, o, a->map);                              /* a o */
  o->refpid = getpid();
  if (a->map->seg.kind == MP_SEG_NAME) {
    __atomic_add_fetch(&array_hdr(o)->refs, 1, __ATOMIC_ACQ_REL);
    own_reference(L, 2);
  }
  return 1;
}

static int array_close(lua_State *L) {
  array_release(L, 1, toarray(L, 1));
  return 0;
}

/* --- metamethods --------------------------------------------------------- */

static int array_index(lua_State *L) {
  Array *a = toarray(L, 1);
  if (lua_type(L, 2) == LUA_TNUMBER) {
    checkarray(L, 1);
    get_elem(L, a, 1, check_index(L, a, 2));
    return 1;
  }
  if (a->isvalue && lua_type(L, 2) == LUA_TSTRING &&
      strcmp(lua_tostring(L, 2), "value") == 0) {
    checkarray(L, 1);
    get_elem(L, a, 1, 0);
    return 1;
  }
  if (!a->locked && lua_type(L, 2) == LUA_TSTRING &&
      (strcmp(lua_tostring(L, 2), "get_lock") == 0 ||
       strcmp(lua_tostring(L, 2), "get_obj") == 0)) {
    lua_pushnil(L);                   /* a raw array has neither */
    return 1;
  }
  mp_push_method(L);
  return 1;
}

static int array_newindex(lua_State *L) {
  Array *a = checkarray(L, 1);
  if (lua_type(L, 2) == LUA_TNUMBER) {
    set_elem(L, a, check_index(L, a, 2), 3, "Array");
    return 0;
  }
  if (a->isvalue && lua_type(L, 2) == LUA_TSTRING &&
      strcmp(lua_tostring(L, 2), "value") == 0) {
    set_elem(L, a, 0, 3, "Value");
    return 0;
  }
  return luaL_error(L, "cannot set field '%s' of an %s (only %s)",
                    luaL_tolstring(L, 2, NULL), a->isvalue ? "Value" : "Array",
                    a->isvalue ? ".value" : "integer indices");
}

static int array_len(lua_State *L) {
  lua_pushinteger(L, (lua_Integer)toarray(L, 1)->n);
  return 1;
}

#define SHOWN 8      /* elements tostring shows (chars: 8 times more) */

/* Adds the first elements to b, as they are now (read without the lock:
** printing never waits): "{1, 2, 3, ...}", or a char array's bytes as a
** quoted string. */
static void add_elems(luaL_Buffer *b, const Array *a) {
  lua_State *L = b->L;
  size_t i, n = a->ct == E_CHAR ? SHOWN * 8 : SHOWN;
  if (a->ct == E_CHAR) {
    luaL_addchar(b, '"');
    for (i = 0; i < a->n && i < n; i++) {
      unsigned char ch = a->data[i];
      if (ch >= 32 && ch < 127 && ch != '"' && ch != '\\')
        luaL_addchar(b, (char)ch);
      else {
        lua_pushfstring(L, "\\%d", (int)ch);
        luaL_addvalue(b);
      }
    }
    luaL_addstring(b, a->n > n ? "\"..." : "\"");
    return;
  }
  luaL_addchar(b, '{');
  for (i = 0; i < a->n && i < n; i++) {
    if (i > 0) luaL_addstring(b, ", ");
    push_elem(L, a, i);
    luaL_tolstring(L, -1, NULL);
    lua_remove(L, -2);
    luaL_addvalue(b);
  }
  luaL_addstring(b, a->n > n ? ", ...}" : "}");
}

/* multiprocessing.Array(int32, 1000, shared, file_descriptor): {0, 1, ...}
** multiprocessing.Value(double, 2.5, shared, file_descriptor) */
static int array__tostring(lua_State *L) {
  Array *a = toarray(L, 1);
  luaL_Buffer b;
  const char *how = !a->data ? "closed"
                  : !a->map ? "private"
                  : a->map->seg.kind == MP_SEG_NAME ? "shared, file_system"
                  : "shared, file_descriptor";
  luaL_buffinit(L, &b);
  lua_pushfstring(L, "multiprocessing.%s(%s, ", a->isvalue ? "Value" : "Array",
                  ctypes[a->ct].name);
  luaL_addvalue(&b);
  if (a->isvalue && a->data) {
    push_elem(L, a, 0);
    luaL_tolstring(L, -1, NULL);
    lua_remove(L, -2);
  } else {
    lua_pushfstring(L, "%I", (lua_Integer)a->n);
  }
  luaL_addvalue(&b);
  luaL_addstring(&b, ", ");
  luaL_addstring(&b, how);
  luaL_addchar(&b, ')');
  if (!a->isvalue && a->data) {
    luaL_addstring(&b, ": ");
    add_elems(&b, a);
  }
  luaL_pushresult(&b);
  return 1;
}

/* --- codec --------------------------------------------------------------- */

typedef struct ArrayWire {
  char how;               /* 'P' private copy, 'F' memfd, 'N' name */
  unsigned char ct;
  unsigned char isvalue;
  unsigned char locked;   /* its lock follows (nested.c) */
  unsigned char pad[4];
  uint64_t n;
} ArrayWire;

/* A broadcast is decoded by receivers that give nothing back (fresh
** workers that _exit), so its one reference is held by the sender's box:
** an Array of its own on the same mapping as 'a' (at idx), closed when the
** box is (the context settles), so 'a' may be closed by its user
** meanwhile. */
static void hold_name(lua_State *L, int idx, Array *a, mp_Writer *w) {
  Array *pin = newarray(L, a->ct, a->n, a->isvalue);
  lua_getiuservalue(L, idx, 1);
  attach_map(L, -2, pin, a->map);
  pin->refpid = getpid();
  __atomic_add_fetch(&array_hdr(pin)->refs, 1, __ATOMIC_ACQ_REL);
  mp_ledger_note(L, a->map->seg.name, 1);
  mp_write_hold(L, w);
}

static void array_encode(lua_State *L, int idx, mp_Writer *w) {
  Array *a = toarray(L, idx);
  ArrayWire wi;
  if (!a->data) luaL_error(L, "cannot send a closed Array");
  memset(&wi, 0, sizeof wi);
  wi.ct = (unsigned char)a->ct;
  wi.isvalue = (unsigned char)a->isvalue;
  wi.locked = (unsigned char)a->locked;
  wi.n = a->n;
  wi.how = !a->map ? 'P' : a->map->seg.kind == MP_SEG_NAME ? 'N' : 'F';
  mp_write_bytes(L, w, &wi, sizeof wi);
  if (wi.how == 'P') {
    mp_write_bytes(L, w, a->data, nbytes(a));
  } else if (wi.how == 'F') {
    mp_write_fd(L, w, a->map->seg.fd);
  } else {
    mp_write_bytes(L, w, a->map->seg.name, MP_SHM_NAMELEN);
    if (mp_write_flags(w) & MP_CODEC_BROADCAST) {
      hold_name(L, lua_absindex(L, idx), a, w);
    } else {
      /* the receiver's reference, taken now: the name must outlive the
      ** message even if this array is closed before it is received */
      __atomic_add_fetch(&array_hdr(a)->refs, 1, __ATOMIC_ACQ_REL);
    }
  }
  if (a->locked) {
    lua_getiuservalue(L, idx, 2);
    mp_lock_write(L, -1, w);
    lua_pop(L, 1);
  }
}

/* The lock that follows a locked array's encoding, for the array at ai. */
static void decode_lock(lua_State *L, mp_Reader *r, int ai, Array *a) {
  mp_lock_read(L, r);                                       /* a lock */
  attach_lock(L, ai, a);
}

static void array_decode(lua_State *L, mp_Reader *r) {
  ArrayWire wi;
  Array *a;
  mp_Map *m;
  size_t size;
  int ai;
  memcpy(&wi, mp_read_bytes(L, r, sizeof wi), sizeof wi);
  if (wi.ct >= NCTYPES || wi.n > MAX_BYTES / ctypes[wi.ct].size ||
      (wi.isvalue && wi.n != 1) || wi.locked > 1 ||
      (wi.how != 'P' && wi.how != 'F' && wi.how != 'N'))
    luaL_error(L, "bad Array encoding");
  a = newarray(L, wi.ct, (size_t)wi.n, wi.isvalue);
  ai = lua_gettop(L);
  size = HDR_SIZE + nbytes(a);
  if (wi.how == 'P') {
    const char *p = mp_read_bytes(L, r, nbytes(a));
    alloc_private(L, a);
    memcpy(a->data, p, nbytes(a));
    if (wi.locked) decode_lock(L, r, ai, a);
    return;
  }
  /* memory already mapped here (most often: the same array sent again)
  ** comes back as that mapping */
  if (wi.how == 'F') {
    int fd = mp_read_fd(L, r);
    m = mp_map_from_fd(L, fd, size);
  } else {
    char name[MP_SHM_NAMELEN];
    memcpy(name, mp_read_bytes(L, r, MP_SHM_NAMELEN), MP_SHM_NAMELEN);
    name[MP_SHM_NAMELEN - 1] = '\0';
    m = mp_map_from_name(L, name, size);
  }
  attach_map(L, ai, a, m);
  /* file_system: the message's reference is ours, but a broadcast's stays
  ** with its sender (0: a pid nobody has) */
  a->refpid = (mp_read_flags(r) & MP_CODEC_BROADCAST) ? 0 : getpid();
  if (wi.how == 'N') {
    if (a->refpid != 0) own_reference(L, ai);
    m->seg.trkid = array_hdr(a)->trkid;
    m->seg.trkslot = array_hdr(a)->trkslot;
  }
  if (array_hdr(a)->magic != ARR_MAGIC || array_hdr(a)->ctype != wi.ct ||
      array_hdr(a)->n != wi.n) {
    array_release(L, ai, a);
    luaL_error(L, "received shared memory is not the Array it claims to be");
  }
  if (wi.locked) decode_lock(L, r, ai, a);
}

static const mp_CodecType array_codec = {ARRAY_T, array_encode, array_decode};
static const mp_CodecType value_codec = {VALUE_T, array_encode, array_decode};

/* --- registration -------------------------------------------------------- */

static const luaL_Reg methods[] = {
  {"fill", array_fill}, {"totable", array_totable}, {"tostring", array_tostring},
  {"copy", array_copy}, {"share_memory", array_share_memory},
  {"is_shared", array_is_shared}, {"ctype", array_ctype}, {"itemsize", array_itemsize},
  {"get_lock", array_get_lock}, {"get_obj", array_get_obj},
  {"close", array_close}, {NULL, NULL}
};

static const luaL_Reg meta[] = {
  {"__gc", array_gc}, {"__close", array_gc}, {"__tostring", array__tostring},
  {"__index", array_index}, {"__newindex", array_newindex}, {"__len", array_len},
  {NULL, NULL}
};

void mp_open_array(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"Array", new_array}, {"Value", new_value}, {NULL, NULL}
  };
  mp_new_class(L, ARRAY_T, meta, methods);
  mp_new_class(L, VALUE_T, meta, methods);
  lua_pop(L, 2);
  mp_codec_register(L, &array_codec);
  mp_codec_register(L, &value_codec);
  luaL_setfuncs(L, funcs, 0);
}
