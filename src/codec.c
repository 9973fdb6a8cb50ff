/*
** codec.c -- Lua values <-> bytes (the contract is codec.h).
**
** Wire format.  Numbers of fixed width are little-endian; a varint is
** LEB128 (7 bits a byte, low first, at most 10 bytes).
**
**   message = CODEC_MAGIC CODEC_VERSION varint(n) value{n}   nothing follows
**   value   = T_NIL | T_FALSE | T_TRUE
**           | T_INT varint(zigzag(i))
**           | T_FLOAT u64(IEEE 754 bits)          NaN payloads, -0.0 kept
**           | T_STRING str                        str = varint(len) bytes
**           | T_TABLE table | T_TABLEMT table value(metatable)
**           | T_REF varint(k)                     the k-th object, 1-based
**           | T_GLOBALS                           the receiver's globals
**           | T_MODULE str(name)                  require(name)
**           | T_MODFIELD str(name) str(field)     require(name)[field]
**           | T_FUNCTION u32(len) bytecode varint(nup) upvalue{nup}
**           | T_USERDATA str(tname) u32(nbytes) u32(nfds) bytes
**   table   = varint(narray) u32(nhash) value{narray} (key value){nhash}
**   key     = value | T_KEYREF varint(k)         the k-th short string key
**   upvalue = value | T_UPJOIN varint(k) varint(i)  shares upvalue i of the
**                                                  k-th object (a function)
**
** Objects are numbered in the order their T_TABLE, T_TABLEMT, T_FUNCTION or
** T_USERDATA tag appears, before their contents, so T_REF rebuilds cycles and
** shared references across all n values.  Keys have numbers of their own:
** every key that is a T_STRING of at most KEY_MAXLEN bytes is numbered in
** the order it appears, and a key met again crosses as T_KEYREF (a list of
** records sends its field names once, not once a record).  Module
** references and the globals are resolved by name and need no number.
** Counts known only after the contents are written (hash entries,
** bytecode, userdata payloads) are u32s patched in place.
**
** What crosses in each mode:
** - MP_CODEC_DATA: functions only as module fields (T_MODULE, T_MODFIELD);
**   tables are copied, except the globals; a metatable only as a module,
**   because a decoded metatable would run the sender's choice of functions
**   implicitly (__gc, __index) in the receiver.
** - MP_CODEC_FUNCTIONS: also Lua functions as unstripped bytecode with
**   their upvalues, module tables by reference, any metatable.
** Decoding in DATA mode takes untrusted input: every count is checked
** against the bytes left before anything is allocated, and everything
** allocated is a Lua object on the stack, so an error frees it.  What a
** message may cost the receiver is bounded as a whole, not per item: every
** allocation (a table's preallocated parts, a string, an object's number,
** a stack slot, a userdata) is charged against ONE budget of BUDGET_PER_BYTE
** times the message's size (plus BUDGET_BASE), which no honest message
** reaches.  Nested tables that each claim as many items as bytes are left
** pass every per-level check, and would otherwise cost the square of the
** message.
*/
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "codec.h"
#include "mp.h"

#if LUA_FLOAT_TYPE != LUA_FLOAT_DOUBLE || LUA_INT_TYPE != LUA_INT_LONGLONG
#error "the wire format assumes 64-bit Lua integers and double floats"
#endif

#define CODEC_MAGIC    0xCD   /* byte 0 of every message */
#define CODEC_VERSION  1      /* byte 1 */

/* Tables and functions nest at most this deep, which bounds the C
** recursion of both encoder and decoder (and the Lua stack they use). */
#define MAXDEPTH 1000

/* An argument list longer than this crosses as the table it is (a chunk's
** argument lists are the lists table.unpack can give: Lua's own stack
** limit, LUAI_MAXSTACK, refuses more with "too many results to unpack"). */
#define MAXARGS 1000000

/* The decoder's budget (bytes).  What an honest message costs per byte of
** its encoding peaks at about 18 (charge()): a table entry whose key is a
** new two-byte string (5 bytes with its value) costs a node, the string
** and the key's number; an empty table (6 bytes) in an array, a slot, the
** table and its object number.  (New one-byte keys cost 22 a byte, but
** there are only 256 of them: BUDGET_BASE covers them.) */
#define BUDGET_PER_BYTE 24
#define BUDGET_BASE     4096

/* The longest string key that is numbered (T_KEYREF): no longer than Lua's
** short strings (LUAI_MAXSHORTLEN), which are interned, so that equal keys
** are one string, which the encoder knows by its address. */
#define KEY_MAXLEN 40

/* The tag byte that starts every value (the grammar above).  The numbers
** are the format -- spec/codec_spec.lua and fuzz/make_corpus.lua write
** them by hand --: a new tag takes the next one, none is renumbered (15,
** an argument list as a table of its own, is retired: a chunk's lists
** cross flat, encode_chunk). */
typedef enum Tag {
  T_NIL = 0, T_FALSE = 1, T_TRUE = 2, T_INT = 3, T_FLOAT = 4, T_STRING = 5,
  T_TABLE = 6, T_TABLEMT = 7, T_REF = 8, T_GLOBALS = 9, T_MODULE = 10,
  T_MODFIELD = 11, T_FUNCTION = 12, T_USERDATA = 13, T_UPJOIN = 14,
  T_KEYREF = 16
} Tag;

/* registry key of the table tname -> light userdata (const mp_CodecType *) */
#define TYPES_KEY  "multiprocessing.codec.types"
#define BOX_T      "multiprocessing.codec.Box"
#define CHUNK_T    "multiprocessing.codec.Chunk"
#define FDLIST_T   "multiprocessing.codec.FdList"


/* Raises a message without a position: the contracts of codec.h are exact
** messages, and the position of whoever called into C says nothing. */
static int fail (lua_State *L, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  return lua_error(L);
}


/* --- the box: the encoding's bytes and descriptors ----------------------- */

typedef struct Box {
  char *data;
  size_t size, cap;
  int *fds;          /* borrowed from the objects in the uservalue */
  size_t nfds, fdcap;
} Box;

static void box_free (Box *b) {
  free(b->data);
  free(b->fds);
  memset(b, 0, sizeof(*b));
}

static int box_gc (lua_State *L) {
  box_free((Box *)luaL_checkudata(L, 1, BOX_T));
  return 0;
}

/* Pushes an empty box.  Its one uservalue will hold the userdata whose
** descriptors the box borrows. */
static Box *push_box (lua_State *L) {
  Box *b = (Box *)lua_newuserdatauv(L, sizeof(Box), 1);
  memset(b, 0, sizeof(*b));
  if (luaL_newmetatable(L, BOX_T)) {
    lua_pushcfunction(L, box_gc);
    lua_setfield(L, -2, "__gc");
    lua_pushcfunction(L, box_gc);
    lua_setfield(L, -2, "__close");
  }
  lua_setmetatable(L, -2);
  return b;
}

/* Makes room for 'n' more bytes or raises. */
static void box_grow (lua_State *L, Box *b, size_t n) {
  size_t cap;
  char *data;
  if (n > SIZE_MAX / 2 - b->size)
    fail(L, "message too large");
  cap = b->size + n;
  if (cap < 2 * b->cap) cap = 2 * b->cap;
  if (cap < 256) cap = 256;
  data = (char *)realloc(b->data, cap);
  if (data == NULL)
    fail(L, "not enough memory for a message of %I bytes", (lua_Integer)cap);
  b->data = data;
  b->cap = cap;
}

static void box_add_fd (lua_State *L, Box *b, int fd) {
  if (b->nfds == b->fdcap) {
    size_t cap = b->fdcap ? 2 * b->fdcap : 4;
    int *fds = (int *)realloc(b->fds, cap * sizeof(int));
    if (fds == NULL)
      fail(L, "not enough memory");
    b->fds = fds;
    b->fdcap = cap;
  }
  b->fds[b->nfds++] = fd;
}


/* --- the encoder --------------------------------------------------------- */

/* Stack slots of an encoding, as offsets from the box (e->box_idx).  Tables
** and memos start as nil and are made when first needed, so that a message
** of plain values costs none. */
enum {
  S_SEEN = 1,   /* the objects' memo's slots, once it outgrows its own */
  S_KEYS,       /* the same for the keys' memo */
  S_UPVALS,     /* lua_upvalueid -> number of its function * 256 + index */
  S_MODULES,    /* module value -> its name */
  S_FUNCS,      /* module field function -> its module's name */
  S_FIELDS,     /* module field function -> its field's name */
  S_GLOBALS,    /* the globals table */
  S_NSLOTS
};

/* What the encoder has numbered (objects, keys), by address: a hash table
** in C, as pickle's memo is (a Lua table keyed by the objects took a third
** of the time a list of records took to encode).  Its first slots are the
** memo's own (in the encoding's C frame: a small message allocates nothing
** for them); a larger memo's are a userdata's in the memo's stack slot (an
** error frees it with the rest).  Its keys are the addresses of objects
** the message holds: they stay theirs while the message is encoded (only a
** metamethod or finalizer that cuts a part out of the message while it is
** encoded could free one, and then the receiver gets a wrong reference in
** that part, never bad memory). */
#define MEMO_FIRST 16   /* the memo's own slots */

typedef struct MemoSlot {
  const void *p;    /* NULL: empty */
  lua_Integer k;
} MemoSlot;

typedef struct Memo {
  MemoSlot *slot;   /* 'first', or a userdata's; NULL until the first use */
  size_t mask;      /* slots - 1 (a power of two, minus one) */
  size_t n;         /* entries */
  int stack;        /* the slot (S_*) that holds a larger memo's userdata */
  MemoSlot first[MEMO_FIRST];
} Memo;

struct mp_Writer {
  lua_State *L;
  Box *box;
  int box_idx;
  int flags;
  int depth;
  int searches;        /* functions looked up in the modules by a walk */
  Memo seen, keys;     /* objects, short string keys -> their numbers
                          (seen.n, keys.n: how many so far) */
  const char *to;      /* ends the "cannot send" messages */
};

typedef mp_Writer Enc;

static inline char *room (Enc *e, size_t n) {
  Box *b = e->box;
  if (b->cap - b->size < n) box_grow(e->L, b, n);
  return b->data + b->size;
}

static void put_byte (Enc *e, int byte) {
  *room(e, 1) = (char)byte;
  e->box->size++;
}

static void put_bytes (Enc *e, const void *p, size_t n) {
  memcpy(room(e, n), p, n);
  e->box->size += n;
}

static void put_varint (Enc *e, lua_Unsigned u) {
  unsigned char *p = (unsigned char *)room(e, 10);
  size_t n = 0;
  while (u >= 0x80) {
    p[n++] = (unsigned char)(u | 0x80);
    u >>= 7;
  }
  p[n++] = (unsigned char)u;
  e->box->size += n;
}

static void put_lstring (Enc *e, const char *s, size_t len) {
  put_varint(e, len);
  put_bytes(e, s, len);
}

/* Reserves a u32 to be patched when its value is known. */
static size_t reserve_u32 (Enc *e) {
  room(e, 4);
  e->box->size += 4;
  return e->box->size - 4;
}

static void patch_u32 (Enc *e, size_t at, size_t v, const char *what) {
  unsigned char *p = (unsigned char *)e->box->data + at;
  int i;
  if (v > UINT32_MAX)
    fail(e->L, "cannot send %s of %I bytes", what, (lua_Integer)v);
  for (i = 0; i < 4; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* A varint known only after what follows it is written: 5 bytes reserved,
** patched as a padded LEB128 (continuation bits on the first four, which
** the reader takes as the same number: no format of its own). */
#define VARINT5_MAX (((lua_Unsigned)1 << 35) - 1)

static size_t reserve_varint5 (Enc *e) {
  room(e, 5);
  e->box->size += 5;
  return e->box->size - 5;
}

static void patch_varint5 (Enc *e, size_t at, lua_Unsigned v,
                           const char *what) {
  unsigned char *p = (unsigned char *)e->box->data + at;
  int i;
  if (v > VARINT5_MAX)
    fail(e->L, "cannot send %s of %I items", what, (lua_Integer)v);
  for (i = 0; i < 4; i++) p[i] = (unsigned char)(0x80 | ((v >> (7 * i)) & 0x7F));
  p[4] = (unsigned char)(v >> 28);
}

/* Writes 'tag' and the varint 'u' in one go: the hot path of every
** integer and string length. */
static void put_tag_varint (Enc *e, int tag, lua_Unsigned u) {
  unsigned char *p = (unsigned char *)room(e, 11);
  size_t n = 1;
  p[0] = (unsigned char)tag;
  while (u >= 0x80) {
    p[n++] = (unsigned char)(u | 0x80);
    u >>= 7;
  }
  p[n++] = (unsigned char)u;
  e->box->size += n;
}

static void put_int (Enc *e, lua_Integer i) {
  lua_Unsigned u = (lua_Unsigned)i;
  put_tag_varint(e, T_INT, (u << 1) ^ (0 - (u >> 63)));  /* zigzag */
}

static void put_float (Enc *e, lua_Number x) {
  unsigned char *p = (unsigned char *)room(e, 9);
  uint64_t bits;
  int i;
  memcpy(&bits, &x, sizeof(bits));
  p[0] = T_FLOAT;
  for (i = 0; i < 8; i++) p[1 + i] = (unsigned char)(bits >> (8 * i));
  e->box->size += 9;
}

static void put_string (Enc *e, int idx) {
  size_t len;
  const char *s = lua_tolstring(e->L, idx, &len);
  put_tag_varint(e, T_STRING, len);
  put_bytes(e, s, len);
}

static void put_number (Enc *e, int idx) {
  lua_State *L = e->L;
  if (lua_isinteger(L, idx)) put_int(e, lua_tointeger(L, idx));
  else put_float(e, lua_tonumber(L, idx));
}

/* --- the encoder: memos -------------------------------------------------- */

static void memo_init (Memo *m, int stack) {
  m->slot = NULL;
  m->mask = MEMO_FIRST - 1;
  m->n = 0;
  m->stack = stack;
}

/* Where 'p' is looked for first: its address over 16 (what malloc aligns
** to), as pickle's memo hashes, folded with its high bits.  Objects made
** one after another lie close together, and so do their slots: a walk of
** a message goes through its memo mostly in order, where a hash that
** scatters them costs a cache miss an object (a memo of 20,000 objects is
** 512 KB). */
static size_t memo_hash (const Memo *m, const void *p) {
  uintptr_t u = (uintptr_t)p;
  return (size_t)((u >> 4) ^ (u >> 24)) & m->mask;
}

/* The slot of 'p' in 'm', or the empty slot where it would go. */
static size_t memo_slot (const Memo *m, const void *p) {
  size_t i = memo_hash(m, p);
  while (m->slot[i].p != NULL && m->slot[i].p != p) i = (i + 1) & m->mask;
  return i;
}

/* Moves the memo into twice as many slots, a userdata's. */
static void memo_grow (Enc *e, Memo *m) {
  lua_State *L = e->L;
  MemoSlot *old = m->slot;
  size_t oldmask = m->mask, i, bytes;
  m->mask = 2 * m->mask + 1;
  bytes = (m->mask + 1) * sizeof(MemoSlot);
  m->slot = (MemoSlot *)lua_newuserdatauv(L, bytes, 0);   /* slots */
  memset(m->slot, 0, bytes);
  for (i = 0; i <= oldmask; i++)
    if (old[i].p != NULL) m->slot[memo_slot(m, old[i].p)] = old[i];
  lua_replace(L, e->box_idx + m->stack);  /* the old ones may go now */
}

/* The number of 'p' in 'm', or 0 after giving it the next one, m->n (at
** most 3/4 of the slots are used). */
static lua_Integer memo_get (Enc *e, Memo *m, const void *p) {
  size_t i;
  if (m->slot == NULL) {
    memset(m->first, 0, sizeof m->first);
    m->slot = m->first;
  }
  i = memo_slot(m, p);
  if (m->slot[i].p != NULL) return m->slot[i].k;
  if (4 * (m->n + 1) > 3 * (m->mask + 1)) {
    memo_grow(e, m);
    i = memo_slot(m, p);
  }
  m->slot[i].p = p;
  m->slot[i].k = (lua_Integer)++m->n;
  return 0;
}

/* Table slots are made on first use. */
static int lazy_table (Enc *e, int slot) {
  int idx = e->box_idx + slot;
  if (lua_isnil(e->L, idx)) {
    lua_newtable(e->L);
    lua_replace(e->L, idx);
  }
  return idx;
}


/* --- the encoder: paths to values, for error messages -------------------- */

/* How the value being encoded was reached.  Steps live on the C stack of
** the recursion and cost nothing until a message needs them. */

enum {
  STEP_TOP,      /* value i of the message: names[i] */
  STEP_INDEX,    /* array item 'i' of the table reached by 'up' */
  STEP_FIELD,    /* value at the key at stack index 'key' */
  STEP_KEY,      /* a key of the table reached by 'up' */
  STEP_UPVALUE,  /* upvalue 'name' of the function reached by 'up' */
  STEP_META      /* the metatable of the table reached by 'up' */
};

typedef struct Step {
  const struct Step *up;
  int kind;
  const char *name;   /* STEP_UPVALUE; STEP_TOP: NULL for "value<i>" */
  int key;            /* STEP_FIELD */
  lua_Integer i;      /* STEP_INDEX, STEP_TOP */
} Step;

static int is_name (const char *s, size_t len) {
  static const char *const reserved[] = {
    "and", "break", "do", "else", "elseif", "end", "false", "for",
    "function", "goto", "if", "in", "local", "nil", "not", "or", "repeat",
    "return", "then", "true", "until", "while"
  };
  size_t i;
  for (i = 0; i < len; i++) {
    char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
          (i > 0 && c >= '0' && c <= '9')))
      return 0;
  }
  for (i = 0; i < sizeof(reserved) / sizeof(reserved[0]); i++)
    if (strcmp(s, reserved[i]) == 0) return 0;
  return len > 0;
}

#define MAXKEYSHOWN 40

/* Pushes ["key"], escaped and shortened the way a reader can make out. */
static void push_quoted_key (lua_State *L, const char *s, size_t len) {
  luaL_Buffer b;
  size_t i;
  luaL_buffinit(L, &b);
  luaL_addstring(&b, "[\"");
  for (i = 0; i < len && i < MAXKEYSHOWN; i++) {
    unsigned char c = (unsigned char)s[i];
    if (c == '"' || c == '\\') {
      luaL_addchar(&b, '\\');
      luaL_addchar(&b, (char)c);
    }
    else if (c < 32 || c >= 127) {
      char esc[5];
      snprintf(esc, sizeof(esc), "\\%03u", c);
      luaL_addstring(&b, esc);
    }
    else luaL_addchar(&b, (char)c);
  }
  if (len > MAXKEYSHOWN) luaL_addstring(&b, "...");
  luaL_addstring(&b, "\"]");
  luaL_pushresult(&b);
}

/* Pushes the suffix that indexes with the key at 'k': .name, [2], ["a b"],
** [table]. */
static void push_key_suffix (lua_State *L, int k) {
  switch (lua_type(L, k)) {
    case LUA_TSTRING: {
      size_t len;
      const char *s = lua_tolstring(L, k, &len);
      if (is_name(s, len)) lua_pushfstring(L, ".%s", s);
      else push_quoted_key(L, s, len);
      break;
    }
    case LUA_TNUMBER:
      if (lua_isinteger(L, k)) lua_pushfstring(L, "[%I]", lua_tointeger(L, k));
      else lua_pushfstring(L, "[%f]", lua_tonumber(L, k));
      break;
    case LUA_TBOOLEAN:
      lua_pushstring(L, lua_toboolean(L, k) ? "[true]" : "[false]");
      break;
    default:
      lua_pushfstring(L, "[%s]", luaL_typename(L, k));
  }
}

/* Pushes the path from the nearest boundary above 's' (a top-level value,
** an upvalue, a key) down to 's', e.g. "args[2].conn" or "cfg.conn"; returns
** that boundary. */
static const Step *push_local_path (lua_State *L, const Step *s) {
  const Step *b;
  switch (s->kind) {
    case STEP_TOP:
      if (s->name) lua_pushstring(L, s->name);
      else lua_pushfstring(L, "value%I", s->i);
      return s;
    case STEP_UPVALUE:
      lua_pushstring(L, s->name);
      return s;
    case STEP_KEY:
      lua_pushliteral(L, "");
      return s;
    default: break;
  }
  b = push_local_path(L, s->up);
  switch (s->kind) {
    case STEP_INDEX:
      lua_pushfstring(L, "[%I]", s->i);
      lua_concat(L, 2);
      break;
    case STEP_FIELD:
      push_key_suffix(L, s->key);
      lua_concat(L, 2);
      break;
    default:  /* STEP_META */
      lua_pushfstring(L, "getmetatable(%s)", lua_tostring(L, -1));
      lua_remove(L, -2);
  }
  return b;
}

/* Pushes the description of the value reached by 's'.  'owner': the value
** is a function whose upvalue is being described, which reads
** "function 'worker'" rather than "worker" at the top level. */
static void push_description (lua_State *L, const Step *s, int owner) {
  const Step *b;
  const char *path;
  luaL_checkstack(L, 4, NULL);
  b = push_local_path(L, s);
  path = lua_tostring(L, -1);
  switch (b->kind) {
    case STEP_TOP:
      if (owner) lua_pushfstring(L, "function '%s'", path);
      else return;  /* the path itself */
      break;
    case STEP_UPVALUE:
      lua_pushfstring(L, "upvalue '%s' of ", path);
      push_description(L, b->up, 1);
      lua_concat(L, 2);
      break;
    default:  /* STEP_KEY: "a key of t", "[1] in a key of t" */
      lua_pushfstring(L, "%s%sa key of ", path + (*path == '.'),
                      *path ? " in " : "");
      push_description(L, b->up, 0);
      lua_concat(L, 2);
  }
  lua_remove(L, -2);
}

/* Raises "cannot send <path> (<what>) <to>"; 'what' defaults to the type.
** In MP_CODEC_DESCRIBE mode it writes "<type>" in the value's place. */
static int cannot_send (Enc *e, int idx, const Step *at, const char *what) {
  lua_State *L = e->L;
  if (e->flags & MP_CODEC_DESCRIBE) {
    const char *s = lua_pushfstring(L, "<%s>", luaL_typename(L, idx));
    put_byte(e, T_STRING);
    put_lstring(e, s, strlen(s));
    lua_pop(L, 1);
    return 0;
  }
  if (what == NULL) what = luaL_typename(L, idx);
  push_description(L, at, 0);
  lua_pushfstring(L, "cannot send %s (%s)%s%s", lua_tostring(L, -1), what,
                  e->to ? " " : "", e->to ? e->to : "");
  return lua_error(L);
}

static void enter (Enc *e, const Step *at) {
  if (++e->depth > MAXDEPTH) {
    while (at->kind != STEP_TOP) at = at->up;
    push_local_path(e->L, at);
    fail(e->L, "cannot send %s: nesting too deep (more than %d levels)",
         lua_tostring(e->L, -1), MAXDEPTH);
  }
  luaL_checkstack(e->L, 8, NULL);
}


/* --- the encoder: module references -------------------------------------- */

/* Module references are looked up in package.loaded, per message and
** only as far as needed.  The modules themselves (any table or function
** met looks there) are indexed once: value -> name.  Their function fields
** (only a function looks there) are many more -- every field of every
** module, _G's included, ~30 times the modules --: the first few functions
** of a message are looked for by a walk that stops where it finds them,
** and only a message with more builds their index.  Both ways find the
** same name: the first in the order of one walk. */
#define SEARCHES 4

/* Enters v -> name (and, when 'field', v -> field in the slot after 'idx')
** into the index at 'idx', unless v is there: the first name found stays. */
static void index_entry (lua_State *L, int idx, int v, int name, int field) {
  lua_pushvalue(L, v);                            /* v */
  if (lua_rawget(L, idx) == LUA_TNIL) {           /* known */
    lua_pushvalue(L, v);                          /* nil v */
    lua_pushvalue(L, name);                       /* nil v name */
    lua_rawset(L, idx);                           /* nil */
    if (field) {
      lua_pushvalue(L, v);                        /* nil v */
      lua_pushvalue(L, field);                    /* nil v field */
      lua_rawset(L, idx + 1);                     /* nil */
    }
  }
  lua_pop(L, 1);                                  /* */
}

/* Indexes the function fields of the module at 'mod' into S_FUNCS and
** S_FIELDS.  The Lua functions of the globals table are the user's script,
** not a module the receiver can require: they are left to be sent as
** bytecode. */
static void index_fields (Enc *e, int name, int mod, int globals) {
  lua_State *L = e->L;
  lua_pushnil(L);                                 /* nil */
  while (lua_next(L, mod)) {                      /* key value */
    if (lua_type(L, -2) == LUA_TSTRING && lua_isfunction(L, -1) &&
        !(globals && !lua_iscfunction(L, -1)))
      index_entry(L, e->box_idx + S_FUNCS, lua_gettop(L), name,
                  lua_gettop(L) - 1);
    lua_pop(L, 1);                                /* key */
  }                                               /* */
}

/* Builds S_MODULES (fields == 0) or S_FUNCS and S_FIELDS (fields == 1)
** from package.loaded. */
static void index_modules (Enc *e, int fields) {
  lua_State *L = e->L;
  int slot = e->box_idx + (fields ? S_FUNCS : S_MODULES);
  lua_createtable(L, 0, fields ? 256 : 32);
  lua_replace(L, slot);
  if (fields) {
    lua_createtable(L, 0, 256);
    lua_replace(L, slot + 1);
  }
  if (lua_getfield(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE) == LUA_TTABLE) {
    lua_pushnil(L);                               /* loaded nil */
    while (lua_next(L, -2)) {                     /* loaded name mod */
      int mod = lua_gettop(L);
      if (lua_type(L, mod - 1) == LUA_TSTRING) {
        int globals = lua_rawequal(L, mod, e->box_idx + S_GLOBALS);
        if (fields) {
          if (lua_istable(L, mod)) index_fields(e, mod - 1, mod, globals);
        }
        else if (lua_isfunction(L, mod) || (lua_istable(L, mod) && !globals))
          index_entry(L, slot, mod, mod - 1, 0);
      }
      lua_pop(L, 1);                              /* loaded name */
    }
  }
  lua_pop(L, 1);                                  /* */
}

/* Pushes the name of the module the value at 'v' is (and returns 1), or
** pushes nothing (and returns 0). */
static int module_name (Enc *e, int v) {
  lua_State *L = e->L;
  int mods = e->box_idx + S_MODULES;
  if (lua_isnil(L, mods)) index_modules(e, 0);
  lua_pushvalue(L, v);                            /* v */
  if (lua_rawget(L, mods) != LUA_TNIL) return 1;  /* name */
  lua_pop(L, 1);                                  /* */
  return 0;
}

/* Is the value at 'v' a function field of the table at 'mod', under a
** string key?  Then pushes that key and returns 1; else pushes nothing. */
static int field_of (lua_State *L, int mod, int v, int globals) {
  lua_pushnil(L);                                 /* nil */
  while (lua_next(L, mod)) {                      /* key value */
    if (lua_rawequal(L, -1, v) && lua_type(L, -2) == LUA_TSTRING &&
        !(globals && !lua_iscfunction(L, -1))) {
      lua_pop(L, 1);                              /* key */
      return 1;
    }
    lua_pop(L, 1);                                /* key */
  }                                               /* */
  return 0;
}

/* The walk index_modules(e, 1) makes, stopped at the function at 'v':
** pushes its module's name and its field's (and returns 1), or nothing. */
static int search_field (Enc *e, int v) {
  lua_State *L = e->L;
  if (lua_getfield(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE) == LUA_TTABLE) {
    lua_pushnil(L);                               /* loaded nil */
    while (lua_next(L, -2)) {                     /* loaded name mod */
      int mod = lua_gettop(L);
      if (lua_type(L, mod - 1) == LUA_TSTRING && lua_istable(L, mod) &&
          field_of(L, mod, v, lua_rawequal(L, mod, e->box_idx + S_GLOBALS))) {
        lua_replace(L, mod);                      /* loaded name field */
        lua_remove(L, mod - 2);                   /* name field */
        return 1;
      }
      lua_pop(L, 1);                              /* loaded name */
    }
  }
  lua_pop(L, 1);                                  /* */
  return 0;
}

/* Pushes the names of the module and the field the function at 'v' is
** (and returns 1), or pushes nothing. */
static int field_name (Enc *e, int v) {
  lua_State *L = e->L;
  int funcs = e->box_idx + S_FUNCS;
  if (lua_isnil(L, funcs)) {
    if (e->searches < SEARCHES) {
      e->searches++;
      return search_field(e, v);
    }
    index_modules(e, 1);
  }
  lua_pushvalue(L, v);                            /* v */
  if (lua_rawget(L, funcs) == LUA_TNIL) {         /* name */
    lua_pop(L, 1);                                /* */
    return 0;
  }
  lua_pushvalue(L, v);                            /* name v */
  lua_rawget(L, funcs + 1);  /* S_FIELDS */       /* name field */
  return 1;
}

/* Writes a module reference for the value at 'v' when it is a module or a
** module's function field; returns whether it did. */
static int put_module (Enc *e, int v) {
  lua_State *L = e->L;
  size_t len;
  const char *s;
  if (module_name(e, v)) {                        /* name */
    put_byte(e, T_MODULE);
    s = lua_tolstring(L, -1, &len);
    put_lstring(e, s, len);
    lua_pop(L, 1);                                /* */
    return 1;
  }
  if (!lua_isfunction(L, v) || !field_name(e, v)) return 0;
  put_byte(e, T_MODFIELD);                        /* name field */
  s = lua_tolstring(L, -2, &len);
  put_lstring(e, s, len);
  s = lua_tolstring(L, -1, &len);
  put_lstring(e, s, len);
  lua_pop(L, 2);                                  /* */
  return 1;
}

/* Could the table at 'v' go as a module reference? */
static int is_module (Enc *e, int v) {
  if (!module_name(e, v)) return 0;
  lua_pop(e->L, 1);
  return 1;
}


/* --- the encoder: values ------------------------------------------------- */

/* Writes a reference when the object at 'o' was met before in this
** message and returns 1; otherwise numbers it (e->seen.n) and returns 0. */
static int put_ref (Enc *e, int o) {
  lua_Integer k = memo_get(e, &e->seen, lua_topointer(e->L, o));
  if (k != 0) put_tag_varint(e, T_REF, (lua_Unsigned)k);
  return k != 0;
}

/* Writes the string key at 'k': a short one met before as T_KEYREF, one
** met first numbered (the receiver numbers it as it reads it). */
static void put_key (Enc *e, int k) {
  size_t len;
  const char *s = lua_tolstring(e->L, k, &len);
  if (len <= KEY_MAXLEN) {
    lua_Integer n = memo_get(e, &e->keys, s);
    if (n != 0) {
      put_tag_varint(e, T_KEYREF, (lua_Unsigned)n);
      return;
    }
  }
  put_tag_varint(e, T_STRING, len);
  put_bytes(e, s, len);
}

static void encode_value (Enc *e, int idx, const Step *at);

/* Array item i, on top of the stack.  Numbers and strings, the bulk of
** most messages, are written at once; the rest go encode_value's way. */
static void encode_item (Enc *e, lua_Unsigned i, const Step *at) {
  lua_State *L = e->L;
  if (lua_isinteger(L, -1)) {
    put_int(e, lua_tointeger(L, -1));
    return;
  }
  switch (lua_type(L, -1)) {
    case LUA_TNUMBER: put_float(e, lua_tonumber(L, -1)); break;
    case LUA_TSTRING: put_string(e, -1); break;
    default: {
      Step s = {at, STEP_INDEX, NULL, 0, (lua_Integer)i};
      encode_value(e, lua_gettop(L), &s);
    }
  }
}

/* Writes the entry k v on top of the stack and the rest of the lua_next
** walk of the table at 't', but for the keys 1..n; pops them; returns how
** many entries it wrote. */
static lua_Unsigned encode_pairs (Enc *e, int t, lua_Unsigned n,
                                  const Step *at) {
  lua_State *L = e->L;
  lua_Unsigned nhash = 0;
  do {                                                /* k v */
    int v = lua_gettop(L), string = lua_type(L, v - 1) == LUA_TSTRING;
    if (string || !(lua_isinteger(L, v - 1) &&
                    (lua_Unsigned)lua_tointeger(L, v - 1) - 1 < n)) {
      Step key = {at, STEP_KEY, NULL, 0, 0};
      Step field = {at, STEP_FIELD, NULL, v - 1, 0};
      if (string) put_key(e, v - 1);
      else encode_value(e, v - 1, &key);
      encode_value(e, v, &field);
      nhash++;
    }
    lua_pop(L, 1);                                    /* k */
  } while (lua_next(L, t));                           /* */
  return nhash;
}

/* Writes the items 1..n of the table at 't' (a border may have holes: they
** go as nil), then its other entries; returns how many of those.  One
** lua_next walk serves both: while it yields the keys 1, 2, ... in order
** (Lua's array part, the common case), their values are the items, written
** at once; from the first key out of that order on, the items not yet
** written are read by index, and the walk goes on, skipping the keys 1..n.
** So an array is walked once, not by index and then again by lua_next. */
static lua_Unsigned encode_entries (Enc *e, int t, lua_Unsigned n,
                                    const Step *at) {
  lua_State *L = e->L;
  lua_Unsigned i = 1;
  int more;
  lua_pushnil(L);                                     /* nil */
  while ((more = lua_next(L, t)) != 0 && i <= n &&    /* k v */
         lua_isinteger(L, -2) && lua_tointeger(L, -2) == (lua_Integer)i) {
    encode_item(e, i++, at);
    lua_pop(L, 1);                                    /* k */
  }                                /* more ? k v : (nothing) */
  for (; i <= n; i++) {
    lua_rawgeti(L, t, (lua_Integer)i);                /* [k v] item */
    encode_item(e, i, at);
    lua_pop(L, 1);                                    /* [k v] */
  }
  return more ? encode_pairs(e, t, n, at) : 0;        /* */
}

static void encode_table (Enc *e, int t, const Step *at) {
  lua_State *L = e->L;
  lua_Unsigned n, nhash;
  size_t counter;
  int mt;
  if (lua_rawequal(L, t, e->box_idx + S_GLOBALS)) {
    put_byte(e, T_GLOBALS);
    return;
  }
  if (((e->flags & MP_CODEC_FUNCTIONS) || at->kind == STEP_META) &&
      put_module(e, t))
    return;
  if (at->kind == STEP_META && !(e->flags & MP_CODEC_FUNCTIONS)) {
    cannot_send(e, t, at, "a metatable that is not a module");
    return;
  }
  if (put_ref(e, t)) return;
  enter(e, at);
  mt = lua_getmetatable(L, t) ? lua_gettop(L) : 0;    /* [mt] */
  if (mt && (e->flags & MP_CODEC_DESCRIBE) &&
      !(e->flags & MP_CODEC_FUNCTIONS) && !is_module(e, mt)) {
    lua_pop(L, 1);  /* described: the fields go, the class stays behind */
    mt = 0;                                           /* */
  }
  put_byte(e, mt ? T_TABLEMT : T_TABLE);
  n = lua_rawlen(L, t);
  put_varint(e, n);
  counter = reserve_u32(e);
  nhash = encode_entries(e, t, n, at);                /* [mt] */
  patch_u32(e, counter, nhash, "a table");  /* Lua tables stay far below */
  if (mt) {
    Step s = {at, STEP_META, NULL, 0, 0};
    encode_value(e, mt, &s);
    lua_pop(L, 1);                                    /* */
  }
  e->depth--;
}

/* core._chunk(head, list, first, n [, args]): a view that crosses as one
** table, as if it were built as
**   t = {head[1], ..., head[#head]}; table.move(list, first, first+n-1, #t+1, t)
** plus head's other entries.  The Pool's messages are such views: a run of
** the caller's list crosses without being copied into a message table
** first, and its items are only indexed, not walked with lua_next (which
** costs a table's items as much again).  With 'args' (a starmap's), the
** items cross flat, each as its argument list (encode_args): the table
** holds, after head's items, for each item a count c and then c values,
** and a worker calls fn(table.unpack(t, p + 1, p + c)) with no table made
** per item, which is what a starmap's 100,000 small tables cost. */
typedef struct Chunk {
  lua_Integer first, n;
  int args;
} Chunk;

/* Writes list item i (on top of the stack) as the argument list it stands
** for: the count n and the n values table.unpack(item, 1, item.n or #item)
** gives, read as it reads them (raw, for a table with no metatable: the
** same, cheaper); no object number, no metatable, no walk of the table.
** An item that is no table, or whose n is neither nil nor a count, or a
** count over MAXARGS, goes as -1 and the item itself: the worker's unpack
** of it says what is wrong.  Returns how many array items it wrote. */
static lua_Unsigned encode_args (Enc *e, int nkey, lua_Unsigned i,
                                 const Step *at) {
  lua_State *L = e->L;
  Step s = {at, STEP_INDEX, NULL, 0, (lua_Integer)i};
  int t = lua_gettop(L), isnum = 1, raw = 0;
  lua_Integer n = -1, k;
  if (lua_istable(L, t)) {
    raw = !lua_getmetatable(L, t);                            /* [mt] */
    lua_settop(L, t);                                         /* */
    lua_pushvalue(L, nkey);   /* "n", interned once: not looked up per item */
    if ((raw ? lua_rawget(L, t) : lua_gettable(L, t)) != LUA_TNIL)   /* n */
      n = lua_tointegerx(L, -1, &isnum);
    else n = raw ? (lua_Integer)lua_rawlen(L, t) : luaL_len(L, t);
    lua_pop(L, 1);                                            /* */
    if (!isnum || n > MAXARGS) n = -1;
    else if (n < 0) n = 0;
  }
  put_int(e, n);
  if (n < 0) {
    encode_item(e, i, at);
    return 2;
  }
  if (n > 0) enter(e, at);
  for (k = 1; k <= n; k++) {
    if (raw) lua_rawgeti(L, t, k);                            /* v */
    else lua_geti(L, t, k);
    encode_item(e, (lua_Unsigned)k, &s);
    lua_pop(L, 1);                                            /* */
  }
  if (n > 0) e->depth--;
  return 1 + (lua_Unsigned)n;
}

static void encode_chunk (Enc *e, int u, const Step *at) {
  lua_State *L = e->L;
  const Chunk *c = (const Chunk *)lua_touserdata(L, u);
  lua_Unsigned nh, i, narr, nhash = 0;
  size_t counter, count = 0;
  int head, nkey;
  if (put_ref(e, u)) return;
  enter(e, at);
  lua_getiuservalue(L, u, 1);                         /* head */
  lua_getiuservalue(L, u, 2);                         /* head list */
  lua_pushliteral(L, "n");                            /* head list "n" */
  head = lua_gettop(L) - 2;
  nkey = head + 2;
  nh = lua_rawlen(L, head);
  put_byte(e, T_TABLE);
  if (c->args) count = reserve_varint5(e);  /* known once the lists are */
  else put_varint(e, nh + (lua_Unsigned)c->n);
  counter = reserve_u32(e);
  for (i = 1; i <= nh; i++) {
    lua_rawgeti(L, head, (lua_Integer)i);             /* head list "n" item */
    encode_item(e, i, at);
    lua_pop(L, 1);                                    /* head list "n" */
  }
  narr = nh;
  for (i = 0; i < (lua_Unsigned)c->n; i++) {  /* as table.move reads */
    lua_geti(L, head + 1, c->first + (lua_Integer)i); /* head list "n" item */
    if (c->args) narr += encode_args(e, nkey, nh + 1 + i, at);
    else encode_item(e, nh + 1 + i, at);
    lua_pop(L, 1);                                    /* head list "n" */
  }
  if (c->args) patch_varint5(e, count, narr, "a table");
  lua_pushnil(L);                                     /* head list "n" nil */
  if (lua_next(L, head))                              /* head list "n" k v */
    nhash = encode_pairs(e, head, nh, at);            /* head list "n" */
  patch_u32(e, counter, nhash, "a table");
  lua_pop(L, 3);                                      /* */
  e->depth--;
}

static int dump_writer (lua_State *L, const void *p, size_t n, void *ud) {
  (void)L;
  put_bytes((Enc *)ud, p, n);
  return 0;
}

/* Each upvalue goes as its value, or, when another function of the message
** already shares it (same lua_upvalueid), as a join to that one. */
static void encode_upvalues (Enc *e, int f, lua_Integer id, const Step *at) {
  lua_State *L = e->L;
  int upvals = lazy_table(e, S_UPVALS);
  lua_Debug ar;
  int i;
  lua_pushvalue(L, f);                                /* f */
  lua_getinfo(L, ">u", &ar);                          /* */
  put_varint(e, ar.nups);
  for (i = 1; i <= ar.nups; i++) {
    void *uid = lua_upvalueid(L, f, i);
    lua_pushlightuserdata(L, uid);                    /* uid */
    if (lua_rawget(L, upvals) == LUA_TNUMBER) {       /* where */
      lua_Unsigned where = (lua_Unsigned)lua_tointeger(L, -1);
      put_byte(e, T_UPJOIN);
      put_varint(e, where >> 8);
      put_varint(e, where & 0xFF);
    }
    else {  /* MAXUPVAL is 255: the index fits in 8 bits */
      Step s = {at, STEP_UPVALUE, NULL, 0, 0};        /* nil */
      lua_pushlightuserdata(L, uid);                  /* nil uid */
      lua_pushinteger(L, id * 256 + i);               /* nil uid where */
      lua_rawset(L, upvals);                          /* nil */
      s.name = lua_getupvalue(L, f, i);               /* nil value */
      /* A function's globals are the receiver's, whatever table the
      ** sender ran it with (busted, sandboxes): nothing of it is copied. */
      if (strcmp(s.name, "_ENV") == 0 && lua_istable(L, -1))
        put_byte(e, T_GLOBALS);
      else
        encode_value(e, lua_gettop(L), &s);
      lua_pop(L, 1);                                  /* nil */
    }
    lua_pop(L, 1);                                    /* */
  }
}

static void encode_function (Enc *e, int f, const Step *at) {
  lua_State *L = e->L;
  size_t counter;
  if (put_module(e, f)) return;
  if (lua_iscfunction(L, f) || !(e->flags & MP_CODEC_FUNCTIONS)) {
    cannot_send(e, f, at, NULL);
    return;
  }
  if (put_ref(e, f)) return;
  enter(e, at);
  put_byte(e, T_FUNCTION);
  counter = reserve_u32(e);
  lua_pushvalue(L, f);
  lua_dump(L, dump_writer, e, 0);  /* unstripped: tracebacks keep lines */
  lua_pop(L, 1);
  patch_u32(e, counter, e->box->size - counter - 4, "a function");
  encode_upvalues(e, f, (lua_Integer)e->seen.n, at);
  e->depth--;
}

/* The type registered for the userdata at 'u', or NULL.  The metatable must
** be the one registered under its __name, not a copy of the name. */
static const mp_CodecType *find_type (lua_State *L, int u) {
  const mp_CodecType *type = NULL;
  int top = mp_stack_top(L);
  int t = luaL_getmetafield(L, u, "__name");          /* name */
  if (t != LUA_TSTRING) {
    if (t != LUA_TNIL) lua_pop(L, 1);                 /* */
    return NULL;
  }
  lua_getfield(L, LUA_REGISTRYINDEX, TYPES_KEY);      /* name types */
  lua_pushvalue(L, -2);                               /* name types name */
  if (lua_istable(L, -2) && lua_rawget(L, -2) == LUA_TLIGHTUSERDATA) {
    lua_getmetatable(L, u);                       /* name types type mt */
    luaL_getmetatable(L, lua_tostring(L, -4));    /* ... type mt named */
    if (lua_rawequal(L, -1, -2))
      type = (const mp_CodecType *)lua_touserdata(L, -3);
    lua_pop(L, 2);                                    /* name types type */
  }
  lua_pop(L, 3);                                      /* */
  mp_stack_check(L, top, 0);
  return type;
}

/* The box keeps alive the userdata whose descriptors it borrows (marked
** true) and the objects that hold references for it (marked "held"). */
static void keep_alive_as (Enc *e, int u, int held) {
  lua_State *L = e->L;
  u = lua_absindex(L, u);
  if (lua_getiuservalue(L, e->box_idx, 1) == LUA_TNIL) {   /* kept */
    lua_pop(L, 1);                                         /* */
    lua_newtable(L);                                       /* kept */
    lua_pushvalue(L, -1);                                  /* kept kept */
    lua_setiuservalue(L, e->box_idx, 1);                   /* kept */
  }
  lua_pushvalue(L, u);                                     /* kept u */
  if (held) lua_pushliteral(L, "held");                    /* kept u mark */
  else lua_pushboolean(L, 1);
  lua_rawset(L, -3);                                       /* kept */
  lua_pop(L, 1);                                           /* */
}

static void keep_alive (Enc *e, int u) {
  keep_alive_as(e, u, 0);
}

static void encode_userdata (Enc *e, int u, const Step *at) {
  lua_State *L = e->L;
  const mp_CodecType *type = find_type(L, u);
  size_t head, nfds = e->box->nfds;
  int top = lua_gettop(L);
  if (type == NULL) {
    cannot_send(e, u, at, NULL);
    return;
  }
  if (put_ref(e, u)) return;
  put_byte(e, T_USERDATA);
  put_lstring(e, type->tname, strlen(type->tname));
  head = reserve_u32(e);
  reserve_u32(e);
  type->encode(L, u, e);
  lua_settop(L, top);
  patch_u32(e, head, e->box->size - head - 8, "a userdata");
  patch_u32(e, head + 4, e->box->nfds - nfds, "descriptors");
  if (e->box->nfds > nfds) keep_alive(e, u);
}

static void encode_value (Enc *e, int idx, const Step *at) {
  lua_State *L = e->L;
  switch (lua_type(L, idx)) {
    case LUA_TNIL: put_byte(e, T_NIL); break;
    case LUA_TBOOLEAN:
      put_byte(e, lua_toboolean(L, idx) ? T_TRUE : T_FALSE);
      break;
    case LUA_TNUMBER: put_number(e, idx); break;
    case LUA_TSTRING: put_string(e, idx); break;
    case LUA_TTABLE: encode_table(e, idx, at); break;
    case LUA_TFUNCTION: encode_function(e, idx, at); break;
    case LUA_TUSERDATA:
      if (luaL_testudata(L, idx, CHUNK_T)) encode_chunk(e, idx, at);
      else encode_userdata(e, idx, at);
      break;
    default: cannot_send(e, idx, at, NULL);  /* threads, light userdata */
  }
}

void mp_encode_spare (lua_State *L, int first, int n, int flags,
                      const char *const names[], const char *to,
                      mp_Spare *spare, mp_Encoded *out) {
  Enc e;
  int i;
  first = lua_absindex(L, first);
  luaL_checkstack(L, S_NSLOTS + 8, "cannot send: too many values");
  e.L = L;
  e.box = push_box(L);
  if (spare != NULL) {   /* the box owns it now: freed with it on errors */
    e.box->data = spare->data;
    e.box->cap = spare->cap;
    spare->data = NULL;
    spare->cap = 0;
  }
  e.box_idx = lua_gettop(L);
  e.flags = flags;
  e.depth = 0;
  e.searches = 0;
  memo_init(&e.seen, S_SEEN);
  memo_init(&e.keys, S_KEYS);
  e.to = to;
  for (i = S_SEEN; i < S_GLOBALS; i++) lua_pushnil(L);
  lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_GLOBALS);
  put_byte(&e, CODEC_MAGIC);
  put_byte(&e, CODEC_VERSION);
  put_varint(&e, (lua_Unsigned)n);
  for (i = 0; i < n; i++) {
    Step top = {NULL, STEP_TOP, NULL, 0, 0};
    top.name = names ? names[i] : NULL;
    top.i = i + 1;
    encode_value(&e, first + i, &top);
  }
  lua_settop(L, e.box_idx);
  out->data = e.box->data;
  out->size = e.box->size;
  out->fds = e.box->fds;
  out->nfds = e.box->nfds;
}

void mp_encode (lua_State *L, int first, int n, int flags,
                const char *const names[], const char *to, mp_Encoded *out) {
  mp_encode_spare(L, first, n, flags, names, to, NULL, out);
}

void mp_encoded_spare (lua_State *L, int box, mp_Spare *spare, size_t keep) {
  Box *b = (Box *)luaL_checkudata(L, box, BOX_T);
  if (spare->data != NULL || b->data == NULL || b->cap > keep) return;
  spare->data = b->data;
  spare->cap = b->cap;
  b->data = NULL;
  b->size = b->cap = 0;
}

void mp_write_bytes (lua_State *L, mp_Writer *w, const void *p, size_t n) {
  (void)L;  /* w->L: a writer lives within one mp_encode */
  put_bytes(w, p, n);
}

void mp_write_fd (lua_State *L, mp_Writer *w, int fd) {
  box_add_fd(L, w->box, fd);
}

void mp_write_hold (lua_State *L, mp_Writer *w) {
  keep_alive_as(w, -1, 1);
  lua_pop(L, 1);
}

int mp_write_flags (const mp_Writer *w) {
  return w->flags;
}

void mp_encoded_close (lua_State *L, int box) {
  box = lua_absindex(L, box);
  box_free((Box *)luaL_checkudata(L, box, BOX_T));
  if (lua_getiuservalue(L, box, 1) != LUA_TTABLE) {
    lua_pop(L, 1);
    return;
  }
  lua_pushnil(L);
  while (lua_next(L, -2)) {
    if (lua_type(L, -1) == LUA_TSTRING) {  /* "held": ours to close */
      if (luaL_getmetafield(L, -2, "__close") != LUA_TNIL) {
        lua_pushvalue(L, -3);
        lua_call(L, 1, 0);
      }
    }
    lua_pop(L, 1);
  }
  lua_pop(L, 1);
  lua_pushnil(L);
  lua_setiuservalue(L, box, 1);
}


/* --- the decoder --------------------------------------------------------- */

/* What the decoder numbers as it reads, for the references back to it:
** the objects and the short string keys. */
typedef struct Numbered {
  int slot;                     /* stack slot: its table, nil until needed */
  lua_Integer n;                /* numbered so far */
} Numbered;

struct mp_Reader {
  lua_State *L;
  const char *start, *p, *end;  /* 'end' narrows to a userdata's payload */
  int *fds;
  size_t nfds;
  size_t fd, fdend;             /* the descriptors of the current userdata */
  int flags;
  int depth;
  Numbered objs, keys;          /* for T_REF, for T_KEYREF */
  size_t budget;                /* bytes the message may still cost */
  int first;                    /* 1 until the message's first value, if a
                                   table, is begun */
  int into;                     /* stack slot of the table that first table
                                   fills (mp_decode_into), or 0 */
  const mp_Spill *spill;        /* where that table's later items may go
                                   (mp_decode_spill), or NULL */
};

typedef mp_Reader Dec;

/* Raises "bad message at byte N: <what>". */
static int bad (Dec *d, const char *fmt, ...) {
  lua_State *L = d->L;
  va_list ap;
  lua_pushfstring(L, "bad message at byte %I: ",
                  (lua_Integer)(d->p - d->start));
  va_start(ap, fmt);
  lua_pushvfstring(L, fmt, ap);
  va_end(ap);
  lua_concat(L, 2);
  return lua_error(L);
}

/* A size hint for lua_createtable: the count was checked against the bytes
** left, so only inputs over 2 GiB reach the clamp. */
static int hint (lua_Unsigned n) {
  return n < INT_MAX ? (int)n : INT_MAX;
}

static size_t left (const Dec *d) {
  return (size_t)(d->end - d->p);
}

/* Checks that 'n' items of at least 'unit' bytes each fit in what is left,
** before anything is allocated for them.  'what' names them, with a %s for
** 'n' (which lua_pushfstring cannot print when it passes 2^63). */
static void need (Dec *d, lua_Unsigned n, size_t unit, const char *what) {
  if (n > left(d) / unit) {
    char count[24];
    snprintf(count, sizeof(count), "%llu", (unsigned long long)n);
    lua_pushfstring(d->L, what, count);
    bad(d, "truncated (%s, %I bytes left)", lua_tostring(d->L, -1),
        (lua_Integer)left(d));
  }
}

/* Charges 'n' items of 'each' bytes (what the receiver allocates for them)
** to the message's budget before they are allocated.  The costs are Lua
** 5.4's on 64 bits: a TValue or stack slot 16, a table 56, a hash node 32
** (Lua rounds the node count up to a power of two: the real cost stays
** within twice the charge), a string 24 plus its bytes. */
static void charge (Dec *d, lua_Unsigned n, size_t each, const char *what) {
  if (each != 0 && n > d->budget / each) {
    char count[24];
    snprintf(count, sizeof(count), "%llu", (unsigned long long)n);
    lua_pushfstring(d->L, what, count);
    bad(d, "%s would take more memory than a message of %I bytes may "
        "(%I bytes left of its budget)", lua_tostring(d->L, -1),
        (lua_Integer)(d->end - d->start), (lua_Integer)d->budget);
  }
  d->budget -= (size_t)n * each;
}

#define COST_SLOT   16
#define COST_TABLE  56
#define COST_NODE   32
#define COST_STRING 24

static int get_byte (Dec *d, const char *what) {
  need(d, 1, 1, what);
  return (unsigned char)*d->p++;
}

static const char *get_bytes (Dec *d, lua_Unsigned n, const char *what) {
  const char *p = d->p;
  need(d, n, 1, what);
  d->p += n;
  return p;
}

/* A varint read without a check per byte, when at least 10 bytes are
** left: sets *u and returns where it ends, or NULL when it is over 64 bits
** (get_varint then says so). */
static const char *fast_varint (const char *p, lua_Unsigned *u) {
  const unsigned char *q = (const unsigned char *)p;
  lua_Unsigned v = 0;
  int shift;
  for (shift = 0; shift < 63; shift += 7) {
    unsigned c = *q++;
    v |= (lua_Unsigned)(c & 0x7F) << shift;
    if (c < 0x80) {
      *u = v;
      return (const char *)q;
    }
  }
  if (*q > 1) return NULL;
  *u = v | (lua_Unsigned)*q << 63;
  return (const char *)q + 1;
}

static lua_Unsigned get_varint (Dec *d) {
  const char *start = d->p;
  lua_Unsigned u = 0;
  int shift;
  if (left(d) >= 10 && (start = fast_varint(d->p, &u)) != NULL) {
    d->p = start;
    return u;
  }
  start = d->p;
  for (shift = 0; ; shift += 7) {
    unsigned c = (unsigned)get_byte(d, "a varint");
    if (shift == 63 && c > 1) {
      d->p = start;
      bad(d, "bad varint (more than 64 bits)");
    }
    u |= (lua_Unsigned)(c & 0x7F) << shift;
    if (c < 0x80) return u;
  }
}

static lua_Unsigned get_fixed (Dec *d, int size) {
  const char *p = get_bytes(d, (lua_Unsigned)size, "a number of %s bytes");
  lua_Unsigned u = 0;
  int i;
  for (i = 0; i < size; i++) u |= (lua_Unsigned)(unsigned char)p[i] << (8 * i);
  return u;
}

static void push_lstring (Dec *d, const char *what) {
  lua_Unsigned len = get_varint(d);
  const char *s = get_bytes(d, len, what);
  charge(d, 1, COST_STRING + (size_t)len, what);
  lua_pushlstring(d->L, s, (size_t)len);
}

static void enter_dec (Dec *d) {
  if (++d->depth > MAXDEPTH)
    bad(d, "nesting too deep (more than %d levels)", MAXDEPTH);
  luaL_checkstack(d->L, 8, NULL);
}

/* Gives the value on top the next number of 'list' ('what' names it for
** the budget). */
static void number (Dec *d, Numbered *list, const char *what) {
  lua_State *L = d->L;
  charge(d, 1, 2 * COST_SLOT, what);  /* its slot, as the list grows */
  if (lua_isnil(L, list->slot)) {
    lua_newtable(L);
    lua_replace(L, list->slot);
  }
  lua_pushvalue(L, -1);
  lua_rawseti(L, list->slot, ++list->n);
}

/* Reads a number of 'list' and pushes what it numbers; a bad one is
** reported at 'at', as "bad <kind>reference (<n> <unit> so far)". */
static void push_numbered (Dec *d, const Numbered *list, const char *at,
                           const char *kind, const char *unit) {
  lua_Unsigned k = get_varint(d);
  if (k < 1 || k > (lua_Unsigned)list->n) {
    d->p = at;
    bad(d, "bad %sreference (%I %s so far)", kind, list->n, unit);
  }
  lua_rawgeti(d->L, list->slot, (lua_Integer)k);
}

static void push_ref (Dec *d) {
  push_numbered(d, &d->objs, d->p, "", "objects");
}

static void decode_value (Dec *d);

/* Lua cannot index with nil or NaN: a message that does is not ours. */
static void check_key (Dec *d, const char *at) {
  lua_State *L = d->L;
  int type = lua_type(L, -1);
  if (type == LUA_TNUMBER) {
    lua_Number x = lua_tonumber(L, -1);
    if (x == x) return;
  }
  else if (type != LUA_TNIL) return;
  d->p = at;
  bad(d, type == LUA_TNIL ? "nil key" : "NaN key");
}

/* Pushes a table's key: a short string is numbered, a T_KEYREF is the
** string of its number. */
static void decode_key (Dec *d) {
  lua_State *L = d->L;
  const char *at = d->p;
  int tag = d->p < d->end ? (unsigned char)*d->p : -1;
  if (tag == T_KEYREF) {
    d->p++;
    push_numbered(d, &d->keys, at, "key ", "keys");
    return;
  }
  decode_value(d);
  if (tag == T_STRING) {
    if (lua_rawlen(L, -1) <= KEY_MAXLEN) number(d, &d->keys, "a key");
  }
  else check_key(d, at);
}

/* In DATA mode the metatable must come as a module reference: the
** receiver then runs only the metamethods of a class it has itself. */
static void decode_metatable (Dec *d, int t) {
  lua_State *L = d->L;
  const char *at = d->p;
  if (d->flags & MP_CODEC_DISCARD) {  /* no module was loaded for it */
    decode_value(d);
    lua_pop(L, 1);
    return;
  }
  if (!(d->flags & MP_CODEC_FUNCTIONS) &&
      (d->p == d->end || (*d->p != T_MODULE && *d->p != T_GLOBALS)))
    bad(d, "metatable is not a module reference");
  decode_value(d);
  if (!lua_istable(L, -1)) {
    d->p = at;
    bad(d, "metatable is a %s", luaL_typename(L, -1));
  }
  lua_setmetatable(L, t);
}

static lua_Number load_float (const char *p) {
  uint64_t bits = 0;
  lua_Number x;
  int i;
  for (i = 0; i < 8; i++) bits |= (uint64_t)(unsigned char)p[i] << (8 * i);
  memcpy(&x, &bits, sizeof(x));
  return x;
}

/* The array items from..to, item i into index i + shift of the table at
** 't'.  Integers, floats, strings
** and holes, the bulk of most messages, are read here, without
** decode_value's checks per byte, while a whole number surely fits in what
** is left (a tag and the longest varint or a float: 11 bytes); a string's
** length is checked and its bytes charged as push_lstring does.  Anything
** else or unusual goes decode_value's way, which checks and says what is
** wrong. */
static void decode_items (Dec *d, int t, lua_Unsigned from, lua_Unsigned to,
                          lua_Integer shift) {
  lua_State *L = d->L;
  lua_Unsigned i, u;
  for (i = from; i <= to; i++) {
    lua_Integer k = (lua_Integer)i + shift;
    if (left(d) >= 11) {
      const char *p = d->p + 1;
      switch ((unsigned char)*d->p) {
        case T_INT:
          if ((p = fast_varint(p, &u)) == NULL) break;
          d->p = p;
          lua_pushinteger(L, (lua_Integer)((u >> 1) ^ (0 - (u & 1))));
          lua_rawseti(L, t, k);
          continue;
        case T_FLOAT:
          d->p = p + 8;
          lua_pushnumber(L, load_float(p));
          lua_rawseti(L, t, k);
          continue;
        case T_STRING:
          if ((p = fast_varint(p, &u)) == NULL || u > (size_t)(d->end - p))
            break;
          d->p = p + u;
          charge(d, 1, COST_STRING + (size_t)u, "a string of %s bytes");
          lua_pushlstring(L, p, (size_t)u);
          lua_rawseti(L, t, k);
          continue;
        case T_NIL:   /* written: a table being reused may hold an item */
          d->p++;
          lua_pushnil(L);
          lua_rawseti(L, t, k);
          continue;
        default: break;
      }
    }
    decode_value(d);
    lua_rawseti(L, t, k);
  }
}

/* The items of mp_decode_spill's table at 't': the first 'after' into it,
** then, if spill->where pushes a table, the rest into that one. */
static void decode_spilled (Dec *d, int t, lua_Unsigned narr) {
  lua_State *L = d->L;
  lua_Unsigned after = (lua_Unsigned)d->spill->after;
  lua_Integer shift = 0;
  decode_items(d, t, 1, after, 0);
  if (d->spill->where(L, t, d->spill->ud, (lua_Integer)(narr - after),
                      &shift)) {                      /* dest */
    decode_items(d, lua_gettop(L), after + 1, narr, shift);
    lua_pop(L, 1);                                      /* */
  }
  else decode_items(d, t, after + 1, narr, 0);
}

static void decode_table (Dec *d, int hasmt) {
  lua_State *L = d->L;
  lua_Unsigned narr = get_varint(d), nhash, i;
  int t, first = d->first, into = d->into;
  d->first = d->into = 0;       /* the first value's table, not its parts */
  need(d, narr, 1, "an array of %s items");
  nhash = get_fixed(d, 4);
  need(d, nhash, 2, "%s table entries");
  enter_dec(d);
  /* the counts are below the bytes left, and charged */
  charge(d, 1, COST_TABLE, "a table");
  charge(d, narr, COST_SLOT, "an array of %s items");
  charge(d, nhash, COST_NODE, "%s table entries");
  if (into && !hasmt) lua_pushvalue(L, into);   /* mp_decode_into's */
  else lua_createtable(L, hint(narr), hint(nhash));
  t = lua_gettop(L);
  number(d, &d->objs, "an object");
  if (first && !hasmt && d->spill && narr > (lua_Unsigned)d->spill->after)
    decode_spilled(d, t, narr);
  else decode_items(d, t, 1, narr, 0);
  for (i = 0; i < nhash; i++) {
    decode_key(d);
    decode_value(d);
    lua_rawset(L, t);
  }
  if (hasmt) decode_metatable(d, t);
  d->depth--;
}

/* Replaces the module name on top with require(name). */
static void require_module (Dec *d) {                 /* name */
  lua_State *L = d->L;
  if (lua_getfield(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE) == LUA_TTABLE) {
    lua_pushvalue(L, -2);                             /* name loaded name */
    lua_rawget(L, -2);                                /* name loaded mod */
    lua_remove(L, -2);                                /* name mod */
  }
  if (!lua_toboolean(L, -1)) {  /* not loaded yet: what require would do */
    lua_pop(L, 1);                                    /* name */
    if (lua_getglobal(L, "require") != LUA_TFUNCTION) /* name require */
      bad(d, "module '%s' is not loaded and there is no require",
          lua_tostring(L, -2));
    lua_pushvalue(L, -2);                             /* name require name */
    lua_call(L, 1, 1);                                /* name mod */
  }
  lua_remove(L, -2);                                  /* mod */
}

static void decode_module (Dec *d, int field) {
  lua_State *L = d->L;
  const char *at = d->p - 1;
  push_lstring(d, "a module name of %s bytes");
  if (d->flags & MP_CODEC_DISCARD) {  /* nothing to load for nobody */
    if (field) get_bytes(d, get_varint(d), "a field name of %s bytes");
    lua_pop(L, 1);
    lua_pushnil(L);
    return;
  }
  if (!field) {
    require_module(d);
    return;
  }
  push_lstring(d, "a field name of %s bytes");        /* name field */
  lua_insert(L, -2);                                  /* field name */
  require_module(d);                                  /* field mod */
  if (lua_istable(L, -1)) {
    lua_pushvalue(L, -2);                             /* field mod field */
    lua_rawget(L, -2);                                /* field mod f */
  }
  else lua_pushnil(L);                                /* field mod nil */
  if (!lua_isfunction(L, -1)) {
    d->p = at;
    bad(d, "module has no function '%s'", lua_tostring(L, -3));
  }
  lua_replace(L, -3);                                 /* f mod */
  lua_pop(L, 1);                                      /* f */
}

/* T_UPJOIN: upvalue 'i' of the function at 'f' becomes upvalue 'n' of an
** earlier function, as it was in the sender. */
static void join_upvalue (Dec *d, int f, int i) {
  lua_State *L = d->L;
  const char *at = d->p;
  lua_Unsigned n;
  push_ref(d);                                        /* g */
  n = get_varint(d);
  if (!lua_isfunction(L, -1) || lua_iscfunction(L, -1) || n < 1 || n > 255 ||
      lua_getupvalue(L, -1, (int)n) == NULL) {        /* g up */
    d->p = at;
    bad(d, "bad upvalue reference");
  }
  lua_pop(L, 1);                                      /* g */
  lua_upvaluejoin(L, f, i, -1, (int)n);
  lua_pop(L, 1);                                      /* */
}

static void decode_function (Dec *d) {
  lua_State *L = d->L;
  const char *at = d->p - 1;
  lua_Unsigned len, nup;
  const char *code;
  lua_Debug ar;
  int f, i;
  if (!(d->flags & MP_CODEC_FUNCTIONS)) {
    d->p = at;
    bad(d, "function bytecode is not accepted on this channel");
  }
  len = get_fixed(d, 4);
  code = get_bytes(d, len, "bytecode of %s bytes");
  charge(d, len, 4, "bytecode of %s bytes");  /* a prototype outweighs it */
  enter_dec(d);
  if (luaL_loadbufferx(L, code, (size_t)len, "=(bytecode)", "b") != LUA_OK) {
    d->p = at;
    bad(d, "%s", lua_tostring(L, -1));
  }
  f = lua_gettop(L);
  number(d, &d->objs, "an object");
  lua_pushvalue(L, f);
  lua_getinfo(L, ">u", &ar);
  nup = get_varint(d);
  if (nup != ar.nups)
    bad(d, "function has %d upvalues, not %I", (int)ar.nups, (lua_Integer)nup);
  for (i = 1; i <= ar.nups; i++) {
    if (d->p < d->end && *d->p == T_UPJOIN) {
      d->p++;
      join_upvalue(d, f, i);
    }
    else {  /* load gave the first upvalue the globals: set them all */
      decode_value(d);
      lua_setupvalue(L, f, i);
    }
  }
  d->depth--;
}

/* The payload is handed to the type with the reader narrowed to it, and
** the type must consume all of it. */
static void decode_userdata (Dec *d) {
  lua_State *L = d->L;
  const char *at = d->p - 1, *end = d->end;
  const mp_CodecType *type;
  lua_Unsigned nbytes, nfds;
  int top;
  push_lstring(d, "a type name of %s bytes");
  lua_getfield(L, LUA_REGISTRYINDEX, TYPES_KEY);
  lua_pushvalue(L, -2);
  if (!lua_istable(L, -2) || lua_rawget(L, -2) != LUA_TLIGHTUSERDATA) {
    d->p = at;
    bad(d, "unknown userdata type '%s'", lua_tostring(L, -3));
  }
  type = (const mp_CodecType *)lua_touserdata(L, -1);
  lua_pop(L, 2);
  nbytes = get_fixed(d, 4);
  nfds = get_fixed(d, 4);
  need(d, nbytes, 1, "a userdata of %s bytes");
  charge(d, 1, (size_t)nbytes + COST_TABLE, "a userdata");
  if (nfds > d->nfds - d->fd)
    bad(d, "userdata '%s' needs %I descriptors, %I came",
        type->tname, (lua_Integer)nfds, (lua_Integer)(d->nfds - d->fd));
  d->end = d->p + nbytes;
  d->fdend = d->fd + nfds;
  top = lua_gettop(L);
  type->decode(L, d);
  if (lua_gettop(L) != top + 1)
    fail(L, "codec type '%s' pushed %d values, not 1", type->tname,
         lua_gettop(L) - top);
  if (d->p != d->end || d->fd != d->fdend)
    bad(d, "userdata '%s' left %I bytes and %I descriptors unread",
        type->tname, (lua_Integer)left(d), (lua_Integer)(d->fdend - d->fd));
  d->end = end;
  lua_remove(L, -2);  /* the type name */
  number(d, &d->objs, "an object");
  if ((d->flags & MP_CODEC_DISCARD) &&
      luaL_getmetafield(L, -1, "__close") != LUA_TNIL) {
    lua_pushvalue(L, -2);
    lua_call(L, 1, 0);
  }
}

static void decode_value (Dec *d) {
  lua_State *L = d->L;
  int tag = get_byte(d, "a tag");
  switch (tag) {
    case T_NIL: lua_pushnil(L); break;
    case T_FALSE: lua_pushboolean(L, 0); break;
    case T_TRUE: lua_pushboolean(L, 1); break;
    case T_INT: {
      lua_Unsigned u = get_varint(d);
      lua_pushinteger(L, (lua_Integer)((u >> 1) ^ (0 - (u & 1))));
      break;
    }
    case T_FLOAT: {
      uint64_t bits = get_fixed(d, 8);
      lua_Number x;
      memcpy(&x, &bits, sizeof(x));
      lua_pushnumber(L, x);
      break;
    }
    case T_STRING: push_lstring(d, "a string of %s bytes"); break;
    case T_TABLE: case T_TABLEMT: decode_table(d, tag == T_TABLEMT); break;
    case T_REF: push_ref(d); break;
    case T_GLOBALS: lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_GLOBALS); break;
    case T_MODULE: case T_MODFIELD: decode_module(d, tag == T_MODFIELD); break;
    case T_FUNCTION: decode_function(d); break;
    case T_USERDATA: decode_userdata(d); break;
    default:
      d->p--;
      bad(d, "bad tag %d", tag);
  }
}

int mp_decode (lua_State *L, const char *data, size_t size, int flags,
               int *fds, size_t nfds) {
  return mp_decode_into(L, 0, data, size, flags, fds, nfds);
}

int mp_decode_into (lua_State *L, int into, const char *data, size_t size,
                    int flags, int *fds, size_t nfds) {
  return mp_decode_spill(L, into, NULL, data, size, flags, fds, nfds);
}

int mp_decode_spill (lua_State *L, int into, const mp_Spill *spill,
                     const char *data, size_t size, int flags, int *fds,
                     size_t nfds) {
  Dec d;
  lua_Unsigned n, i;
  d.L = L;
  d.first = 1;
  d.into = into ? lua_absindex(L, into) : 0;
  d.spill = spill;
  d.start = d.p = data;
  d.end = data + size;
  d.fds = fds;
  d.nfds = nfds;
  d.fd = d.fdend = 0;
  d.flags = flags;
  d.depth = 0;
  d.objs.n = d.keys.n = 0;
  d.budget = size > (SIZE_MAX - BUDGET_BASE) / BUDGET_PER_BYTE
             ? SIZE_MAX : BUDGET_PER_BYTE * size + BUDGET_BASE;
  if (size < 2 || (unsigned char)data[0] != CODEC_MAGIC)
    fail(L, "bad message: not from this codec (no magic byte)");
  if (data[1] != CODEC_VERSION)
    fail(L, "bad message: codec version %d, expected %d",
         (unsigned char)data[1], CODEC_VERSION);
  d.p += 2;
  n = get_varint(&d);
  need(&d, n, 1, "a message of %s values");
  charge(&d, n, COST_SLOT, "a message of %s values");
  luaL_checkstack(L, hint(n + 2), "bad message: too many values");
  lua_pushnil(L);
  d.objs.slot = lua_gettop(L);
  lua_pushnil(L);
  d.keys.slot = lua_gettop(L);
  if (n == 0 || d.p == d.end || (unsigned char)*d.p != T_TABLE)
    d.first = d.into = 0;       /* the first value only, if a table */
  for (i = 0; i < n; i++) decode_value(&d);
  if (d.p != d.end)
    bad(&d, "trailing garbage (%I bytes)", (lua_Integer)left(&d));
  lua_remove(L, d.keys.slot);
  lua_remove(L, d.objs.slot);
  return (int)n;
}

const char *mp_read_bytes (lua_State *L, mp_Reader *r, size_t n) {
  (void)L;  /* r->L: a reader lives within one mp_decode */
  return get_bytes(r, n, "%s bytes of a userdata");
}

int mp_read_flags (const mp_Reader *r) {
  return r->flags;
}

int mp_read_fd (lua_State *L, mp_Reader *r) {
  int fd;
  (void)L;
  if (r->fd == r->fdend) bad(r, "missing descriptor");
  fd = r->fds[r->fd];
  if (fd < 0) bad(r, "invalid descriptor");
  r->fds[r->fd++] = -1;
  return fd;
}


/* --- codec types --------------------------------------------------------- */

void mp_codec_register (lua_State *L, const mp_CodecType *type) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, TYPES_KEY) != LUA_TTABLE) {
    lua_pop(L, 1);
    lua_newtable(L);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, TYPES_KEY);
  }
  lua_pushlightuserdata(L, (void *)(uintptr_t)type);
  lua_setfield(L, -2, type->tname);
  lua_pop(L, 1);
}


/* --- core.encode, core.decode: the codec from Lua, for specs and tools --- */

/* core.encode(opts, v1, ..., vn) -> string, fd1, ...
** opts: a boolean (allow functions) or a table {functions=, names=, to=}.
** The descriptors are borrowed: valid while the encoded objects live. */
static int l_encode (lua_State *L) {
  int n = lua_gettop(L) - 1, functions, box, i;
  const char *to = "to another process";
  const char **names = NULL;  /* mp_encode's default: value1, value2... */
  mp_Encoded out;
  size_t k;
  luaL_argexpected(L, lua_isboolean(L, 1) || lua_istable(L, 1), 1,
                   "boolean or table");
  if (lua_istable(L, 1)) {
    lua_getfield(L, 1, "functions");
    functions = lua_toboolean(L, -1);
    lua_getfield(L, 1, "to");
    to = luaL_optstring(L, -1, to);
    if (lua_getfield(L, 1, "names") == LUA_TTABLE) {
      int given = lua_gettop(L);
      names = (const char **)lua_newuserdatauv(L, n * sizeof(char *) + 1, 0);
      for (i = 0; i < n; i++) {  /* the names live in opts.names */
        names[i] = lua_rawgeti(L, given, i + 1) == LUA_TSTRING
                   ? lua_tostring(L, -1) : "?";
        lua_pop(L, 1);
      }
    }
  }
  else functions = lua_toboolean(L, 1);
  mp_encode(L, 2, n, functions ? MP_CODEC_FUNCTIONS : MP_CODEC_DATA, names,
            to, &out);
  box = lua_gettop(L);
  luaL_checkstack(L, (int)out.nfds + 1, "too many descriptors");
  lua_pushlstring(L, out.data, out.size);
  for (k = 0; k < out.nfds; k++) lua_pushinteger(L, out.fds[k]);
  box_free((Box *)lua_touserdata(L, box));  /* now, not at the next GC */
  return 1 + (int)out.nfds;
}

/* Descriptors that core.decode owns until a decoded object takes them. */
typedef struct FdList {
  size_t n;
  int fd[1];
} FdList;

static void fdlist_close (FdList *l) {
  size_t i;
  for (i = 0; i < l->n; i++)
    if (l->fd[i] >= 0) {
      close(l->fd[i]);
      l->fd[i] = -1;
    }
}

static int fdlist_gc (lua_State *L) {
  fdlist_close((FdList *)luaL_checkudata(L, 1, FDLIST_T));
  return 0;
}

/* Pushes a list of duplicates of the descriptors in the array at 'arg' (if
** any): the caller keeps its own, the decoded objects own theirs. */
static FdList *dup_fds (lua_State *L, int arg) {
  size_t n = lua_istable(L, arg) ? lua_rawlen(L, arg) : 0, i;
  FdList *l = (FdList *)lua_newuserdatauv(L, sizeof(FdList) + n * sizeof(int),
                                          0);
  l->n = 0;
  if (luaL_newmetatable(L, FDLIST_T)) {
    lua_pushcfunction(L, fdlist_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  for (i = 0; i < n; i++) {
    int fd;
    lua_rawgeti(L, arg, (lua_Integer)i + 1);
    luaL_argcheck(L, lua_isinteger(L, -1), arg, "descriptors must be integers");
    fd = fcntl((int)lua_tointeger(L, -1), F_DUPFD_CLOEXEC, 0);
    lua_pop(L, 1);
    if (fd < 0)
      fail(L, "core.decode: cannot duplicate descriptor: %s", strerror(errno));
    l->fd[l->n++] = fd;
  }
  return l;
}

/* core.decode(s [, allow_functions [, fds]]) -> v1, ..., vn */
static int l_decode (lua_State *L) {
  size_t size;
  const char *s = luaL_checklstring(L, 1, &size);
  int flags = lua_toboolean(L, 2) ? MP_CODEC_FUNCTIONS : MP_CODEC_DATA;
  FdList *l;
  int n;
  lua_settop(L, 3);
  l = dup_fds(L, 3);
  n = mp_decode(L, s, size, flags, l->fd, l->n);
  fdlist_close(l);
  return n;
}

/* core._chunk(head, list, first, n [, args]) -> the view encode_chunk
** writes: head a table without a metatable, first >= 1, n >= 0. */
static int l_chunk (lua_State *L) {
  lua_Integer first = luaL_checkinteger(L, 3), n = luaL_checkinteger(L, 4);
  int args = lua_toboolean(L, 5);
  Chunk *c;
  luaL_checktype(L, 1, LUA_TTABLE);
  luaL_checktype(L, 2, LUA_TTABLE);
  luaL_argcheck(L, !lua_getmetatable(L, 1), 1, "a table without a metatable");
  luaL_argcheck(L, first >= 1, 3, "must be at least 1");
  luaL_argcheck(L, n >= 0 && n <= LUA_MAXINTEGER - first, 4,
                "must be a count that fits after 'first'");
  c = (Chunk *)lua_newuserdatauv(L, sizeof(Chunk), 2);
  c->first = first;
  c->n = n;
  c->args = args;
  lua_pushvalue(L, 1);
  lua_setiuservalue(L, -2, 1);
  lua_pushvalue(L, 2);
  lua_setiuservalue(L, -2, 2);
  luaL_setmetatable(L, CHUNK_T);
  return 1;
}

/* core._table(narray, n) -> a table with room for 'narray' items (and one
** more entry), whose field n is 'n': the results of a Pool map, filled
** at once instead of growing through every power of two. */
static int l_table (lua_State *L) {
  lua_Integer narr = luaL_checkinteger(L, 1);
  luaL_argcheck(L, narr >= 0, 1, "must not be negative");
  lua_createtable(L, narr < INT_MAX ? (int)narr : INT_MAX, 1);
  lua_pushvalue(L, 2);
  lua_setfield(L, -2, "n");
  return 1;
}

void mp_open_codec (lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"encode", l_encode},
    {"decode", l_decode},
    {"_chunk", l_chunk},
    {"_table", l_table},
    {NULL, NULL}
  };
  luaL_newmetatable(L, CHUNK_T);
  lua_pop(L, 1);
  luaL_setfuncs(L, funcs, 0);
}
