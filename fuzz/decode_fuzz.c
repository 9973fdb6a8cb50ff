/*
** decode_fuzz.c -- libFuzzer target: mp_decode on untrusted bytes (DATA
** mode).  Every input must decode or raise a Lua error; nothing may crash,
** leak, read out of bounds or allocate beyond what the input can justify
** (the decoder's budget: 24 bytes a byte; -malloc_limit_mb catches more).
**
** One lua_State serves all inputs; a test userdata type "fuzz.Blob" is
** registered so that the userdata path (payload window, descriptors) is
** fuzzed too.  The descriptors given with each input are fake numbers:
** the type only records them, it never uses them as descriptors.
*/
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "lua.h"
#include "lauxlib.h"
#include "lualib.h"

#include "codec.h"
#include "mp.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* fuzz.Blob payload: u8 flags (bit 0: takes a descriptor), u8 n, n bytes */
static void blob_encode(lua_State *L, int idx, mp_Writer *w) {
  (void)L; (void)idx; (void)w;
}

static void blob_decode(lua_State *L, mp_Reader *r) {
  const unsigned char *head = (const unsigned char *)mp_read_bytes(L, r, 2);
  const char *bytes = mp_read_bytes(L, r, head[1]);
  int *fd = (int *)lua_newuserdatauv(L, sizeof(int), 1);
  *fd = (head[0] & 1) ? mp_read_fd(L, r) : -1;
  lua_pushlstring(L, bytes, head[1]);
  lua_setiuservalue(L, -2, 1);
  luaL_setmetatable(L, "fuzz.Blob");
}

static const mp_CodecType blob_type = {"fuzz.Blob", blob_encode, blob_decode};

typedef struct Input {
  const uint8_t *data;
  size_t size;
} Input;

/* Each input twice: as a receiver decodes it, and as a context that
** finished gives back what nobody took (module references unresolved). */
static int decode(lua_State *L) {
  const Input *in = (const Input *)lua_touserdata(L, 1);
  int flags = (int)lua_tointeger(L, 2);
  int fds[3] = {1000, 1001, -1};
  mp_decode(L, (const char *)in->data, in->size, flags, fds, 3);
  return 0;
}

static lua_State *setup(void) {
  lua_State *L = luaL_newstate();
  luaL_openlibs(L);
  /* module references resolve against what is loaded: no file searches */
  luaL_dostring(L, "package.path = '' package.cpath = ''");
  luaL_newmetatable(L, "fuzz.Blob");
  lua_pop(L, 1);
  mp_codec_register(L, &blob_type);
  lua_newtable(L);
  mp_open_codec(L);
  lua_pop(L, 1);
  return L;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static lua_State *L;
  static unsigned runs;
  Input in;
  if (L == NULL) L = setup();
  in.data = data;
  in.size = size;
  lua_pushcfunction(L, decode);
  lua_pushlightuserdata(L, &in);
  lua_pushinteger(L, MP_CODEC_DATA);
  lua_pcall(L, 2, 0, 0);
  lua_settop(L, 0);
  lua_pushcfunction(L, decode);
  lua_pushlightuserdata(L, &in);
  lua_pushinteger(L, MP_CODEC_DISCARD);
  lua_pcall(L, 2, 0, 0);
  lua_settop(L, 0);
  if (++runs % 1024 == 0) lua_gc(L, LUA_GCCOLLECT);
  return 0;
}
