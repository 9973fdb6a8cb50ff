/*
** payload.c -- what a fresh worker ("spawn", "forkserver") receives: the
** function, its args and the parent's environment, encoded ONCE per
** context however many workers start (64 MiB of args must not be encoded
** again for each worker: torch #133010), into a sealed memfd that every
** worker maps.
**
** Layout: PayloadHeader, then two codec messages:
**   environment  {path, cpath, cwd, arg, environ, sharing, daemon} in
**                MP_CODEC_DATA: it is applied first, because decoding fn
**                may require modules, which needs the parent's package.path
**                and directory; 'sharing' is the sharing strategy, so the
**                worker shares as a forked one would; 'daemon' is the
**                context's flag, for mp.current_process();
**   main         fn, args in MP_CODEC_FUNCTIONS (bytecode, upvalues,
**                module references), with the codec's descriptors.
** The memfd is private to the parent and its workers (it has no name) and
** sealed, so decoding its bytecode is safe: nobody else can write it.
*/
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "codec.h"
#include "mp.h"
#include "sharing.h"

#define PAYLOAD_T "multiprocessing.Payload"
#define PAYLOAD_MAGIC "LMPPAYL1"
#define TO "to a spawned process: pass it differently or use start_method \"fork\""

typedef struct PayloadHeader {
  char magic[8];
  uint64_t env_size, main_size;
} PayloadHeader;

/* --- the parent's side --------------------------------------------------- */

/* The name of fn for error messages: the variable that holds it where
** start_processes was called, or further out -- the outermost name wins, as
** it is the one fn was defined with, not a wrapper's parameter -- as a local
** or an upvalue of a function on the stack, then a global; else "fn".
** Level 0 is start_processes itself. */
static int push_name_at(lua_State *L, lua_Debug *ar, int fn) {
  const char *name;
  int i;
  for (i = 1; (name = lua_getlocal(L, ar, i)) != NULL; i++) {  /* local */
    int hit = name[0] != '(' && lua_rawequal(L, -1, fn);
    lua_pop(L, 1);                                              /* */
    if (hit) {
      lua_pushstring(L, name);                                  /* name */
      return 1;
    }
  }
  lua_getinfo(L, "f", ar);                                      /* f */
  for (i = 1; (name = lua_getupvalue(L, -1, i)) != NULL; i++) { /* f up */
    int hit = name[0] != '\0' && lua_rawequal(L, -1, fn);
    lua_pop(L, 1);                                              /* f */
    if (hit) {
      lua_pop(L, 1);                                            /* */
      lua_pushstring(L, name);                                  /* name */
      return 1;
    }
  }
  lua_pop(L, 1);                                                /* */
  return 0;
}

#define NAME_LEVELS 8

/* Pushes fn's name (see above). */
static void push_fn_name(lua_State *L, int fn) {
  lua_Debug ar;
  int level, found = 0, top = mp_stack_top(L);
  for (level = 1; level <= NAME_LEVELS && lua_getstack(L, level, &ar); level++)
    if (push_name_at(L, &ar, fn)) {                   /* [older] name */
      if (found) lua_remove(L, -2);                   /* name */
      found = 1;
    }
  if (found) {
    mp_stack_check(L, top, 1);
    return;
  }
  lua_pushglobaltable(L);                             /* G */
  lua_pushnil(L);                                     /* G nil */
  while (lua_next(L, -2)) {                           /* G key value */
    if (lua_type(L, -2) == LUA_TSTRING && lua_rawequal(L, -1, fn)) {
      lua_pop(L, 1);                                  /* G key */
      lua_remove(L, -2);                              /* key */
      mp_stack_check(L, top, 1);
      return;
    }
    lua_pop(L, 1);                                    /* G key */
  }
  lua_pop(L, 1);                                      /* */
  lua_pushliteral(L, "fn");                           /* "fn" */
  mp_stack_check(L, top, 1);
}

/* arg, as strings and numbers only: a script may have put anything in it,
** and the worker only needs what a command line can hold. */
static void push_arg_copy(lua_State *L) {
  lua_newtable(L);                                    /* copy */
  if (lua_getglobal(L, "arg") != LUA_TTABLE) {        /* copy arg */
    lua_pop(L, 2);                                    /* */
    lua_pushnil(L);                                   /* nil */
    return;
  }
  lua_pushnil(L);                                     /* copy arg nil */
  while (lua_next(L, -2)) {                           /* copy arg k v */
    if (lua_isinteger(L, -2) && (lua_type(L, -1) == LUA_TSTRING ||
                                 lua_type(L, -1) == LUA_TNUMBER)) {
      lua_pushvalue(L, -2);                           /* copy arg k v k */
      lua_insert(L, -2);                              /* copy arg k k v */
      lua_rawset(L, -5);                              /* copy arg k */
    } else {
      lua_pop(L, 1);                                  /* copy arg k */
    }
  }
  lua_pop(L, 1);                                      /* copy */
}

static void push_environment(lua_State *L) {
  char *cwd = getcwd(NULL, 0);
  int i;
  lua_createtable(L, 0, 6);                           /* env */
  if (lua_getglobal(L, "package") == LUA_TTABLE) {    /* env package */
    lua_getfield(L, -1, "path");                      /* env package path */
    lua_setfield(L, -3, "path");                      /* env package */
    lua_getfield(L, -1, "cpath");
    lua_setfield(L, -3, "cpath");
  }
  lua_pop(L, 1);                                      /* env */
  if (cwd != NULL) {  /* a removed directory has no name: stay where we are */
    lua_pushstring(L, cwd);
    free(cwd);
    lua_setfield(L, -2, "cwd");
  }
  push_arg_copy(L);
  lua_setfield(L, -2, "arg");
  lua_pushinteger(L, mp_sharing_strategy(L));
  lua_setfield(L, -2, "sharing");
  /* A forkserver was started with an older environment than ours. */
  lua_newtable(L);                                    /* env list */
  for (i = 0; environ != NULL && environ[i] != NULL; i++) {
    lua_pushstring(L, environ[i]);                    /* env list s */
    lua_rawseti(L, -2, i + 1);                        /* env list */
  }
  lua_setfield(L, -2, "environ");                     /* env */
}

typedef struct Holder {
  mp_Payload p;
} Holder;

void mp_payload_close(mp_Payload *p) {
  if (p->fd >= 0) close(p->fd);
  p->fd = -1;
}

static int payload_gc(lua_State *L) {
  mp_payload_close(&((Holder *)luaL_checkudata(L, 1, PAYLOAD_T))->p);
  return 0;
}

/* 0 or -errno. */
static int write_payload(int fd, const mp_Encoded *env, const mp_Encoded *m) {
  PayloadHeader h;
  int err;
  memset(&h, 0, sizeof h);
  memcpy(h.magic, PAYLOAD_MAGIC, sizeof h.magic);
  h.env_size = env->size;
  h.main_size = m->size;
  if ((err = mp_write_all(fd, (const char *)&h, sizeof h)) != 0 ||
      (err = mp_write_all(fd, env->data, env->size)) != 0 ||
      (err = mp_write_all(fd, m->data, m->size)) != 0)
    return -err;
  /* Sealed: a worker's mapping can neither shrink under it (SIGBUS) nor
  ** change. */
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE |
                             F_SEAL_SEAL) != 0)
    return -errno;
  return 0;
}

/* Protected: fn at 1, args at 2, fn's name at 3, daemon at 4 -> the
** holder. */
static int build(lua_State *L) {
  static const char *const env_names[] = {"environment"};
  const char *names[2];
  mp_Encoded m, env;
  Holder *h;
  int err;
  names[0] = lua_tostring(L, 3);
  names[1] = "args";
  h = lua_newuserdatauv(L, sizeof *h, 1);             /* fn args name d h */
  h->p.fd = -1;
  h->p.fds = NULL;
  h->p.nfds = 0;
  if (luaL_newmetatable(L, PAYLOAD_T)) {
    lua_pushcfunction(L, payload_gc);
    lua_setfield(L, -2, "__gc");
  }
  lua_setmetatable(L, -2);
  mp_encode(L, 1, 2, MP_CODEC_FUNCTIONS | MP_CODEC_BROADCAST, names, TO, &m);
                                                      /* fn args name d h box */
  lua_pushvalue(L, -1);
  lua_setiuservalue(L, 5, 1);  /* the box lends its descriptors: ... h box */
  h->p.fds = m.fds;
  h->p.nfds = m.nfds;
  push_environment(L);                                /* ... h box env */
  lua_pushvalue(L, 4);
  lua_setfield(L, -2, "daemon");
  mp_encode(L, -1, 1, MP_CODEC_DATA, env_names, TO, &env);
                                                      /* ... h box env ebox */
  h->p.fd = memfd_create("lua-multiprocessing-payload",
                         MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (h->p.fd < 0)
    return luaL_error(L, "cannot create the workers' payload: memfd_create: %s",
                      strerror(errno));
  if ((err = write_payload(h->p.fd, &env, &m)) != 0)
    return luaL_error(L, "cannot write the workers' payload: %s",
                      strerror(-err));
  lua_settop(L, 5);                                   /* fn args name d h */
  return 1;
}

int mp_payload_make(lua_State *L, int ctxidx, int fn, int args,
                    int daemon) {
  int top = mp_stack_top(L);
  ctxidx = lua_absindex(L, ctxidx);
  fn = lua_absindex(L, fn);
  args = lua_absindex(L, args);
  lua_pushcfunction(L, build);
  lua_pushvalue(L, fn);
  lua_pushvalue(L, args);
  push_fn_name(L, fn);                                /* build fn args name */
  lua_pushboolean(L, daemon);                         /* ... name daemon */
  if (lua_pcall(L, 4, 1, 0) != LUA_OK) {              /* h, or msg */
    mp_stack_check(L, top, 1);
    return EINVAL;  /* the codec's own message, for the caller to raise */
  }
  lua_getiuservalue(L, ctxidx, 1);                    /* h uv */
  lua_insert(L, -2);                                  /* uv h */
  lua_setfield(L, -2, "payload");                     /* uv */
  lua_pop(L, 1);                                      /* */
  mp_stack_check(L, top, 0);
  return 0;
}

mp_Payload *mp_payload_get(lua_State *L, int ctxidx) {
  Holder *h;
  int top = mp_stack_top(L);
  lua_getiuservalue(L, ctxidx, 1);                    /* uv */
  lua_getfield(L, -1, "payload");                     /* uv h|nil */
  lua_remove(L, -2);                                  /* h|nil */
  h = luaL_testudata(L, -1, PAYLOAD_T);
  mp_stack_check(L, top, 1);
  return h != NULL && h->p.fd >= 0 ? &h->p : NULL;
}

/* The payload of the uservalue at 'uv' goes; with 'all', fn and args too. */
static void drop(lua_State *L, int uv, int all) {
  if (lua_getfield(L, uv, "payload") == LUA_TUSERDATA) {  /* h */
    mp_payload_close(&((Holder *)lua_touserdata(L, -1))->p);
    if (lua_getiuservalue(L, -1, 1) == LUA_TUSERDATA)     /* h box */
      mp_encoded_close(L, -1);  /* the held references go */
    lua_pop(L, 1);                                        /* h */
  }
  lua_pop(L, 1);                                          /* */
  lua_pushnil(L);
  lua_setfield(L, uv, "payload");
  if (!all) return;
  lua_pushnil(L);
  lua_setfield(L, uv, "fn");  /* what restarts would have needed */
  lua_pushnil(L);
  lua_setfield(L, uv, "args");
}

static void release(lua_State *L, int ctxidx, int all) {
  int top = mp_stack_top(L);
  if (lua_getiuservalue(L, ctxidx, 1) == LUA_TTABLE)     /* uv */
    drop(L, lua_gettop(L), all);
  lua_pop(L, 1);                                          /* */
  mp_stack_check(L, top, 0);
}

void mp_payload_release(lua_State *L, int ctxidx) {
  release(L, lua_absindex(L, ctxidx), 1);
}

void mp_payload_drop(lua_State *L, int ctxidx) {
  release(L, lua_absindex(L, ctxidx), 0);
}

/* --- the worker's side --------------------------------------------------- */

typedef struct Load {
  const char *env, *main;
  size_t env_size, main_size;
  int *fds;
  size_t nfds;
} Load;

static void apply_environ(lua_State *L, int list) {
  lua_Integer i, n = (lua_Integer)lua_rawlen(L, list);
  clearenv();
  for (i = 1; i <= n; i++) {
    const char *s, *eq;
    if (lua_rawgeti(L, list, i) == LUA_TSTRING) {         /* s */
      s = lua_tostring(L, -1);
      eq = strchr(s, '=');
      if (eq != NULL && eq != s) {
        lua_pushlstring(L, s, (size_t)(eq - s));          /* s name */
        setenv(lua_tostring(L, -1), eq + 1, 1);
        lua_pop(L, 1);                                    /* s */
      }
    }
    lua_pop(L, 1);                                        /* */
  }
}

static void apply_environment(lua_State *L, int env) {
  if (lua_getfield(L, env, "environ") == LUA_TTABLE) apply_environ(L, -1);
  lua_pop(L, 1);
  if (lua_getfield(L, env, "cwd") == LUA_TSTRING &&
      chdir(lua_tostring(L, -1)) != 0)
    luaL_error(L, "cannot enter the parent's directory %s: %s",
               lua_tostring(L, -1), strerror(errno));
  lua_pop(L, 1);
  if (lua_getglobal(L, "package") == LUA_TTABLE) {        /* package */
    if (lua_getfield(L, env, "path") == LUA_TSTRING)      /* package path */
      lua_setfield(L, -2, "path");                        /* package */
    else
      lua_pop(L, 1);
    if (lua_getfield(L, env, "cpath") == LUA_TSTRING)
      lua_setfield(L, -2, "cpath");
    else
      lua_pop(L, 1);
  }
  lua_pop(L, 1);                                          /* */
  if (lua_getfield(L, env, "arg") == LUA_TTABLE)
    lua_setglobal(L, "arg");
  else
    lua_pop(L, 1);
  lua_getfield(L, env, "sharing");
  mp_set_sharing_strategy(L, (int)lua_tointeger(L, -1));
  lua_getfield(L, env, "daemon");
  mp_worker_daemon(L, lua_toboolean(L, -1));
  lua_pop(L, 2);
}

/* Protected: the Load at 1 -> fn, args. */
static int load(lua_State *L) {
  Load *ld = lua_touserdata(L, 1);
  if (mp_decode(L, ld->env, ld->env_size, MP_CODEC_DATA, NULL, 0) != 1 ||
      !lua_istable(L, 2))
    return luaL_error(L, "bad payload: no environment");
  apply_environment(L, 2);
  lua_settop(L, 1);
  if (mp_decode(L, ld->main, ld->main_size,
                MP_CODEC_FUNCTIONS | MP_CODEC_BROADCAST, ld->fds,
                ld->nfds) != 2 || !lua_isfunction(L, 2) || !lua_istable(L, 3))
    return luaL_error(L, "bad payload: no function and args");
  return 2;
}

static int raise_upvalue(lua_State *L) {
  lua_pushvalue(L, lua_upvalueindex(1));
  return lua_error(L);
}

/* Reads the header; pushes a message and returns 0 when the file is not a
** payload. */
static int map_payload(lua_State *L, int fd, Load *ld, void **map,
                       size_t *size) {
  struct stat st;
  PayloadHeader h;
  *map = MAP_FAILED;
  if (fstat(fd, &st) != 0) {
    mp_push_errno(L, "fstat", errno);
    return 0;
  }
  *size = (size_t)st.st_size;
  if (*size < sizeof h) {
    lua_pushliteral(L, "bad payload: too short");
    return 0;
  }
  *map = mmap(NULL, *size, PROT_READ, MAP_PRIVATE, fd, 0);
  if (*map == MAP_FAILED) {
    mp_push_errno(L, "mmap", errno);
    return 0;
  }
  memcpy(&h, *map, sizeof h);
  if (memcmp(h.magic, PAYLOAD_MAGIC, sizeof h.magic) != 0 ||
      h.env_size > *size - sizeof h ||
      h.main_size != *size - sizeof h - h.env_size) {
    lua_pushliteral(L, "bad payload: bad header");
    return 0;
  }
  ld->env = (const char *)*map + sizeof h;
  ld->env_size = (size_t)h.env_size;
  ld->main = ld->env + ld->env_size;
  ld->main_size = (size_t)h.main_size;
  return 1;
}

void mp_payload_load(lua_State *L, int fd, int *fds, size_t nfds) {
  Load ld;
  void *map;
  size_t size = 0, i;
  int ok = map_payload(L, fd, &ld, &map, &size);
  if (ok) {
    ld.fds = fds;
    ld.nfds = nfds;
    lua_pushcfunction(L, load);
    lua_pushlightuserdata(L, &ld);
    ok = lua_pcall(L, 1, 2, 0) == LUA_OK;
  }
  if (map != MAP_FAILED) munmap(map, size);
  for (i = 0; i < nfds; i++)  /* the ones no decoded object took */
    if (fds[i] >= 0) {
      close(fds[i]);
      fds[i] = -1;
    }
  if (ok) return;
  /* The failure (a module that cannot be required here, a directory that is
  ** gone) becomes this worker's error, reported like any other. */
  if (lua_type(L, -1) == LUA_TSTRING) {                   /* msg */
    lua_pushfstring(L, "cannot load the function and its args in the "
                       "worker: %s", lua_tostring(L, -1));  /* msg msg' */
    lua_remove(L, -2);                                    /* msg' */
  }
  lua_pushcclosure(L, raise_upvalue, 1);                  /* fn */
  lua_newtable(L);                                        /* fn args */
}
