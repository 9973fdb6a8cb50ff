/*
** start_spawn.c -- the "spawn" and "forkserver" start methods (to come).
*/
#include "mp.h"

static int unavailable(lua_State *L, mp_Context *ctx, int fn, int args) {
  (void)fn; (void)args;
  lua_pushfstring(L, "start method \"%s\" is not implemented yet; use \"fork\"",
                  ctx->method->name);
  return -1;
}

const mp_StartMethod mp_start_spawn = {"spawn", unavailable};
const mp_StartMethod mp_start_forkserver = {"forkserver", unavailable};
