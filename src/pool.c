/*
** pool.c -- what mp.Pool (lua/multiprocessing/pool.lua) needs from C: the
** number of processors, a quick look at whether a list holds only plain
** values (which need no check), emptying a table for reuse, and the
** exceptions of failed tasks, including mp.TimeoutError (a kind of
** ProcessException).  (Its clock and whether stderr is a terminal:
** core.c's _now and _isatty.)  The pool itself is Lua: a policy over
** ProcessContexts and Queues.
**
** The board: one int64 word per worker in a sealed memfd, where a worker
** writes which task it is running before each one.  A worker writes it
** through a marker, a C closure over the word's address, because it does
** so once per task and an Array's __newindex costs several times more.
**
** The waiter: an epoll descriptor over the pool's results queue and its
** workers' contexts, made when an AsyncResult's fileno() is first asked
** for, so that mp.wait (or an event loop) wakes when a result arrives and
** when a worker ends, which no result would tell.
*/
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <unistd.h>

#include "mp.h"
#include "codec.h"
#include "sharing.h"

#define BOARD_T "multiprocessing.PoolBoard"
#define WAITER_T "multiprocessing.PoolWaiter"

typedef struct Board {
  mp_Seg seg;
  uint64_t n;             /* words */
} Board;

/* Word i (from 1) of board b, or NULL when b is closed. */
static int64_t *word_at(const Board *b, lua_Integer i) {
  return b->seg.base == NULL ? NULL : (int64_t *)(void *)b->seg.base + (i - 1);
}

static int64_t *board_word(lua_State *L, int idx, int arg) {
  Board *b = (Board *)luaL_checkudata(L, idx, BOARD_T);
  lua_Integer i = luaL_checkinteger(L, arg);
  if (b->seg.base == NULL) luaL_error(L, "attempt to use a closed board");
  luaL_argcheck(L, i >= 1 && (uint64_t)i <= b->n, arg, "index out of range");
  return word_at(b, i);
}

static Board *new_board(lua_State *L) {
  Board *b = (Board *)lua_newuserdatauv(L, sizeof(Board), 0);
  memset(b, 0, sizeof *b);
  b->seg.fd = -1;
  luaL_setmetatable(L, BOARD_T);
  return b;
}

/* _board(n) -> a board of n zeroed words */
static int l_board(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 1);
  Board *b;
  luaL_argcheck(L, n >= 1 && n <= (1 << 20), 1, "out of range");
  b = new_board(L);
  mp_seg_create(L, &b->seg, (size_t)n * sizeof(int64_t), MP_SEG_FD);
  b->n = (uint64_t)n;
  return 1;
}

static int board_get(lua_State *L) {
  lua_pushinteger(L, __atomic_load_n(board_word(L, 1, 2), __ATOMIC_RELAXED));
  return 1;
}

static int board_set(lua_State *L) {
  int64_t *w = board_word(L, 1, 2);
  __atomic_store_n(w, (int64_t)luaL_checkinteger(L, 3), __ATOMIC_RELAXED);
  return 0;
}

/* upvalues: the board (kept alive), the word's index */
static int marker(lua_State *L) {
  int64_t *w = word_at((Board *)lua_touserdata(L, lua_upvalueindex(1)),
                       lua_tointeger(L, lua_upvalueindex(2)));
  if (w == NULL) return 0;                    /* closed: nothing to mark */
  if (lua_isnone(L, 1)) {                     /* mark() reads the word */
    lua_pushinteger(L, __atomic_load_n(w, __ATOMIC_RELAXED));
    return 1;
  }
  __atomic_store_n(w, (int64_t)luaL_checkinteger(L, 1), __ATOMIC_RELAXED);
  return 0;
}

/* board:marker(i) -> function([v]): writes v into word i, or (no v)
** returns it */
static int board_marker(lua_State *L) {
  board_word(L, 1, 2);
  lua_settop(L, 2);
  lua_pushcclosure(L, marker, 2);
  return 1;
}

/* The word the marker at 'idx' writes.  Raises when the function is not a
** board's marker, or its board is closed. */
static int64_t *marker_word(lua_State *L, int idx) {
  int64_t *w;
  luaL_argexpected(L, lua_tocfunction(L, idx) == marker, idx, "board marker");
  lua_getupvalue(L, idx, 1);                      /* ... board */
  lua_getupvalue(L, idx, 2);                      /* ... board i */
  w = word_at((Board *)lua_touserdata(L, -2), lua_tointeger(L, -1));
  lua_pop(L, 2);                                  /* ... */
  if (w == NULL) luaL_error(L, "attempt to use a closed board");
  return w;
}

/* How many values table.unpack(list, 1, list.n or #list) gives, for the
** list at 'list'. */
static lua_Integer unpack_count(lua_State *L, int list) {
  lua_Integer c;
  int isint = 1;
  if (lua_getfield(L, list, "n") == LUA_TNIL)     /* ... n */
    c = luaL_len(L, list);
  else c = lua_tointegerx(L, -1, &isint);
  if (!isint) luaL_error(L, "bad argument #3 to 'unpack' (number expected, "
                            "got %s)", luaL_typename(L, -1));
  lua_pop(L, 1);                                  /* ... */
  return c < 0 ? 0 : c;
}

/* Pushes the arguments of the next item of a starmap message at 'msg',
** from msg[*p] on: a count c and c values, or -1 and a list as it was
** (codec.c's encode_args); moves *p past them; returns their number. */
static int push_star_args(lua_State *L, int msg, lua_Integer *p) {
  lua_Integer at = *p, c, k;
  int list = 0;
  lua_rawgeti(L, msg, at);                        /* ... c */
  c = lua_tointeger(L, -1);
  lua_pop(L, 1);                                  /* ... */
  if (c >= 0) *p = at + 1 + c;
  else {
    lua_rawgeti(L, msg, at + 1);                  /* ... list */
    list = lua_gettop(L);
    c = unpack_count(L, list);
    *p = at + 2;
  }
  if (c >= INT_MAX || !lua_checkstack(L, (int)c))
    luaL_error(L, "too many results to unpack");
  for (k = 1; k <= c; k++) {                      /* ... [list] args */
    if (list) lua_geti(L, list, k);
    else lua_rawgeti(L, msg, at + k);
  }
  if (list) lua_remove(L, list);                  /* ... args */
  return (int)c;
}

/* _run_items(mark, base, fn, msg, from, to, out, off [, p]) -> p
** A Pool worker's loop over the items from..to of a task message (see
** poolworker.lua): before item i, the marker's word is set to base + i;
** then out[i + off] = fn(msg[4 + i]), or, with p, fn(args) of the flat
** argument lists from msg[p] on.  Returns where the next item's list
** starts (with p).  In C because a marker called from Lua per item cost
** as much as the loop itself.  A task's error goes through: the item that
** raised it is the one its word holds. */
static int l_run_items(lua_State *L) {
  int64_t *word = marker_word(L, 1);
  lua_Integer base = luaL_checkinteger(L, 2);
  lua_Integer from = luaL_checkinteger(L, 5), to = luaL_checkinteger(L, 6);
  lua_Integer off = luaL_checkinteger(L, 8), p = luaL_optinteger(L, 9, 0);
  lua_Integer i;
  luaL_checktype(L, 4, LUA_TTABLE);
  luaL_checktype(L, 7, LUA_TTABLE);
  lua_settop(L, 9);
  for (i = from; i <= to; i++) {
    int nargs = 1;
    __atomic_store_n(word, (int64_t)(base + i), __ATOMIC_RELAXED);
    lua_pushvalue(L, 3);                          /* ... fn */
    if (p > 0) nargs = push_star_args(L, 4, &p);  /* ... fn args */
    else lua_rawgeti(L, 4, 4 + i);                /* ... fn arg */
    lua_call(L, nargs, 1);                        /* ... result */
    lua_rawseti(L, 7, i + off);                   /* ... */
  }
  lua_pushinteger(L, p);
  return 1;
}

/* An imap_unordered's place: results handed out (i) of n, and the run
** being handed out, upvalue 2: its values j..last, value j being the
** result at position j + shift. */
typedef struct Runs {
  lua_Integer i, n, j, last, shift;
} Runs;

/* upvalues: the Runs, the run's values, refill */
static int runs_step(lua_State *L) {
  Runs *r = (Runs *)lua_touserdata(L, lua_upvalueindex(1));
  if (r->i >= r->n) return 0;
  if (r->j > r->last) {
    lua_pushvalue(L, lua_upvalueindex(3));        /* refill */
    lua_pushinteger(L, r->i);                     /* refill i */
    lua_call(L, 1, 4);                            /* values j last shift */
    r->j = lua_tointeger(L, -3);
    r->last = lua_tointeger(L, -2);
    r->shift = lua_tointeger(L, -1);
    lua_copy(L, -4, lua_upvalueindex(2));
    lua_pop(L, 4);                                /* */
  }
  r->i++;
  lua_pushinteger(L, r->j + r->shift);            /* pos */
  lua_rawgeti(L, lua_upvalueindex(2), r->j++);    /* pos v */
  return 2;
}

/* _runs(n, refill) -> step: the iterator function of an imap_unordered of
** n items, which hands out (position, result) from runs of results:
** refill(i), when a run is done (i: how many were handed out), returns the
** next one as values, first index, last index and what makes an index a
** position, or raises.  In C because a Lua closure cost 42 ns a result,
** this 18. */
static int l_runs(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 1);
  Runs *r;
  luaL_checktype(L, 2, LUA_TFUNCTION);
  r = (Runs *)lua_newuserdatauv(L, sizeof *r, 0);  /* n refill runs */
  r->i = 0;
  r->n = n;
  r->j = 1;
  r->last = r->shift = 0;
  lua_pushnil(L);                                 /* n refill runs nil */
  lua_pushvalue(L, 2);                            /* n refill runs nil refill */
  lua_pushcclosure(L, runs_step, 3);              /* n refill step */
  return 1;
}

static int board_close(lua_State *L) {
  mp_seg_close(&((Board *)luaL_checkudata(L, 1, BOARD_T))->seg);
  return 0;
}

static void board_encode(lua_State *L, int idx, mp_Writer *w) {
  Board *b = (Board *)lua_touserdata(L, idx);
  if (b->seg.base == NULL) luaL_error(L, "cannot send a closed board");
  mp_write_bytes(L, w, &b->n, sizeof b->n);
  mp_write_fd(L, w, b->seg.fd);
}

static void board_decode(lua_State *L, mp_Reader *r) {
  uint64_t n;
  int fd;
  Board *b;
  memcpy(&n, mp_read_bytes(L, r, sizeof n), sizeof n);
  if (n < 1 || n > (1 << 20)) luaL_error(L, "bad board encoding");
  fd = mp_read_fd(L, r);
  b = new_board(L);
  if (mp_seg_from_fd(L, &b->seg, fd, (size_t)n * sizeof(int64_t), 1) != 0)
    lua_error(L);
  b->n = n;
}

static const mp_CodecType board_codec = {BOARD_T, board_encode, board_decode};

#define MP_EXC_TIMEOUT "multiprocessing.TimeoutError"

static int is_plain(int type) {
  return type == LUA_TNIL || type == LUA_TBOOLEAN || type == LUA_TNUMBER ||
         type == LUA_TSTRING;
}

/* Whether the table on top, a starmap's argument list, has no metatable
** and plain values where table.unpack(t, 1, t.n or #t) reads: what
** crosses of it is those values (codec.c's encode_args).  'nkey': where the
** string "n" is on the stack. */
static int plain_args(lua_State *L, int nkey) {
  int t = lua_gettop(L), plain = 1;
  lua_Integer len = (lua_Integer)lua_rawlen(L, t), n, k;
  if (lua_getmetatable(L, t)) return 0;           /* ... t mt */
  lua_pushvalue(L, nkey);   /* "n", interned once: not looked up per item */
  if (lua_rawget(L, t) == LUA_TNIL) n = len;      /* ... t n */
  else if (lua_isinteger(L, -1)) n = lua_tointeger(L, -1);
  else return 0;
  if (n > len + 1) return 0;                      /* n past its items */
  for (k = 1; plain && k <= n; k++) {
    plain = is_plain(lua_rawgeti(L, t, k));       /* ... t n v */
    lua_pop(L, 1);                                /* ... t n */
  }
  return plain;
}

/* _plain(t, n [, args]) -> whether t[1..n] are all nil, booleans, numbers
** or strings (with args: all argument lists of such values): such a list
** needs no check that it can be sent. */
static int l_plain(lua_State *L) {
  lua_Integer n = luaL_checkinteger(L, 2), i;
  int args = lua_toboolean(L, 3), plain = 1;
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_settop(L, 3);
  lua_pushliteral(L, "n");                        /* t n args "n" */
  for (i = 1; plain && i <= n; i++) {
    int type = lua_rawgeti(L, 1, i);              /* t n args "n" v */
    plain = args ? type == LUA_TTABLE && plain_args(L, 4) : is_plain(type);
    lua_settop(L, 4);                             /* t n args "n" */
  }
  lua_pushboolean(L, plain);
  return 1;
}

/* _clear(t): t holds nothing after, and keeps the room it had: the pool's
** loops decode one big message after another into the same table
** (Queue:_get_into), which must be empty each time.  The array part goes
** by index, the rest by lua_next (assigning nil to a field during the
** traversal is allowed). */
static int l_clear(lua_State *L) {
  lua_Integer i;
  luaL_checktype(L, 1, LUA_TTABLE);
  lua_settop(L, 1);
  for (i = (lua_Integer)lua_rawlen(L, 1); i > 0; i--) {
    lua_pushnil(L);                               /* t nil */
    lua_rawseti(L, 1, i);                         /* t */
  }
  lua_pushnil(L);                                 /* t nil */
  while (lua_next(L, 1)) {                        /* t k v */
    lua_pop(L, 1);                                /* t k */
    lua_pushvalue(L, -1);                         /* t k k */
    lua_pushnil(L);                               /* t k k nil */
    lua_rawset(L, 1);                             /* t k */
  }
  return 0;                                       /* t */
}

/* _check_sendable(v, name [, to [, data]]): raises the codec's error
** (naming the path from 'name') when v cannot be sent 'to' (default "to a
** pool worker"), with functions unless 'data'.  The encoding is a
** broadcast, so that it holds its references itself and gives them all
** back when closed: checking takes nothing. */
static int l_check_sendable(lua_State *L) {
  const char *names[1];
  const char *to = luaL_optstring(L, 3, "to a pool worker");
  int flags = lua_toboolean(L, 4) ? MP_CODEC_DATA : MP_CODEC_FUNCTIONS;
  mp_Encoded enc;
  luaL_checkany(L, 1);
  names[0] = luaL_checkstring(L, 2);
  lua_settop(L, 4);
  mp_encode(L, 1, 1, flags | MP_CODEC_BROADCAST, names, to, &enc);
  mp_encoded_close(L, 5);                     /* v name to data box */
  return 0;
}

/* --- the waiter -------------------------------------------------------- */

static int *check_waiter(lua_State *L) {
  int *epfd = (int *)luaL_checkudata(L, 1, WAITER_T);
  if (*epfd < 0) luaL_error(L, "attempt to use a closed waiter");
  return epfd;
}

/* _waiter() -> a waiter (an epoll descriptor watching nothing yet) */
static int l_waiter(lua_State *L) {
  int *epfd = (int *)lua_newuserdatauv(L, sizeof(int), 0);
  *epfd = -1;
  luaL_setmetatable(L, WAITER_T);
  if ((*epfd = epoll_create1(EPOLL_CLOEXEC)) < 0)
    return luaL_error(L, "epoll_create1: %s", strerror(errno));
  return 1;
}

/* waiter:add(fd): readable when fd is (a descriptor closed since leaves
** the set by itself; one already in it stays) */
static int waiter_add(lua_State *L) {
  int *epfd = check_waiter(L);
  int fd = (int)mp_checkinteger(L, 2);
  struct epoll_event ev;
  memset(&ev, 0, sizeof ev);
  ev.events = EPOLLIN;
  ev.data.fd = fd;
  if (epoll_ctl(*epfd, EPOLL_CTL_ADD, fd, &ev) != 0 && errno != EEXIST)
    return luaL_error(L, "epoll_ctl: %s", strerror(errno));
  return 0;
}

static int waiter_fileno(lua_State *L) {
  lua_pushinteger(L, *check_waiter(L));
  return 1;
}

static int waiter_close(lua_State *L) {
  int *epfd = (int *)luaL_checkudata(L, 1, WAITER_T);
  if (*epfd >= 0) close(*epfd);
  *epfd = -1;
  return 0;
}

/* _nofile_at_least(n) -> the soft limit on open descriptors, raised to n
** (at most to the hard limit) when it was lower: a pool holds several
** descriptors per worker.  The workers inherit the raised limit. */
static int l_nofile_at_least(lua_State *L) {
  lua_Integer n = mp_checkinteger(L, 1);
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
    return luaL_error(L, "getrlimit: %s", strerror(errno));
  if (rl.rlim_cur != RLIM_INFINITY && n > 0 && (rlim_t)n > rl.rlim_cur) {
    rlim_t want = rl.rlim_max != RLIM_INFINITY && (rlim_t)n > rl.rlim_max
                  ? rl.rlim_max : (rlim_t)n;
    struct rlimit nl = {want, rl.rlim_max};
    if (setrlimit(RLIMIT_NOFILE, &nl) == 0) rl.rlim_cur = want;
  }
  lua_pushinteger(L, rl.rlim_cur == RLIM_INFINITY ? -1
                                                  : (lua_Integer)rl.rlim_cur);
  return 1;
}

/* _exception(kind, fields) -> a new exception of kind "base", "raised",
** "exited" or "timeout" with the fields of the table 'fields'. */
static int l_exception(lua_State *L) {
  static const char *const kinds[] = {"base", "raised", "exited", "timeout",
                                      NULL};
  static const char *const tnames[] = {MP_EXC_BASE, MP_EXC_RAISED,
                                       MP_EXC_EXITED, MP_EXC_TIMEOUT};
  int kind = luaL_checkoption(L, 1, NULL, kinds);
  luaL_checktype(L, 2, LUA_TTABLE);
  mp_exception_new(L, tnames[kind], 2);
  return 1;
}

/* TimeoutError: a ProcessException, read and printed as the others are. */
static void open_timeout_error(lua_State *L) {
  luaL_newmetatable(L, MP_EXC_TIMEOUT);         /* mod mt */
  luaL_getmetatable(L, MP_EXC_BASE);            /* mod mt base */
  lua_getfield(L, -1, "__index");
  lua_setfield(L, -3, "__index");
  lua_getfield(L, -1, "__tostring");
  lua_setfield(L, -3, "__tostring");
  lua_setfield(L, -2, "__parent");              /* mod mt */
  lua_setfield(L, -2, "TimeoutError");          /* mod */
}

void mp_open_pool(lua_State *L) {
  static const luaL_Reg board_meta[] = {
    {"__gc", board_close}, {"__close", board_close}, {NULL, NULL}
  };
  static const luaL_Reg board_methods[] = {
    {"get", board_get}, {"set", board_set}, {"marker", board_marker},
    {"close", board_close}, {NULL, NULL}
  };
  static const luaL_Reg waiter_meta[] = {
    {"__gc", waiter_close}, {"__close", waiter_close}, {NULL, NULL}
  };
  static const luaL_Reg waiter_methods[] = {
    {"add", waiter_add}, {"fileno", waiter_fileno}, {"close", waiter_close},
    {NULL, NULL}
  };
  static const luaL_Reg funcs[] = {
    {"_waiter", l_waiter},
    {"_exception", l_exception}, {"_plain", l_plain}, {"_board", l_board},
    {"_clear", l_clear}, {"_run_items", l_run_items}, {"_runs", l_runs},
    {"_check_sendable", l_check_sendable},
    {"_nofile_at_least", l_nofile_at_least},
    {NULL, NULL}
  };
  mp_new_class(L, BOARD_T, board_meta, board_methods);
  lua_pop(L, 1);
  mp_new_class(L, WAITER_T, waiter_meta, waiter_methods);
  lua_pop(L, 1);
  mp_codec_register(L, &board_codec);
  open_timeout_error(L);
  luaL_setfuncs(L, funcs, 0);
}
