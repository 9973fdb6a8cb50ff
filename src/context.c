/*
** context.c -- start_processes, spawn, and the ProcessContext and Process
** handles they give back.
**
** A ProcessContext owns its workers and its report file: join, close,
** __close and __gc all end with every worker reaped and the file closed.
** Its uservalue is a table: processes (the Process handles), results (after
** a successful join), failure (the exception or error that ended it),
** payload (spawn, forkserver: the workers' encoded fn and args, holding the
** file_system references they need until the context ends).
** A Process handle keeps its context alive through its own uservalue.
**
** The contexts a process started are listed, weakly, in the registry
** (CONTEXTS_KEY: an array with holes, and its length in field n), for
** active_children(); current_process() reads what a worker knows of itself
** (MP_WORKER_KEY, worker.c).
*/
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <string.h>
#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/pidfd.h>
#include <unistd.h>

#include "mp.h"
#include "sharing.h"

#define MAX_PROCS 65536
#define CONTEXTS_KEY "multiprocessing.contexts"

typedef struct Process {
  int rank;
  int sentinel;     /* fileno(): made on first use; -1 none, -2 closed */
} Process;

/* --- argument checks, before any process starts ------------------------- */

static const mp_StartMethod *const methods[] = {
  &mp_start_fork, &mp_start_spawn, &mp_start_forkserver, NULL
};

/* Pushes '"fork", "spawn" or "forkserver"': the one list, for messages. */
static void push_method_names(lua_State *L) {
  luaL_Buffer b;
  int i;
  luaL_buffinit(L, &b);
  for (i = 0; methods[i] != NULL; i++) {
    if (i > 0) luaL_addstring(&b, methods[i + 1] != NULL ? ", " : " or ");
    luaL_addchar(&b, '"');
    luaL_addstring(&b, methods[i]->name);
    luaL_addchar(&b, '"');
  }
  luaL_pushresult(&b);
}

static const mp_StartMethod *check_method(lua_State *L, int arg) {
  const char *name = lua_isnoneornil(L, arg) ? "spawn" : luaL_checkstring(L, arg);
  int i;
  for (i = 0; methods[i] != NULL; i++)
    if (strcmp(methods[i]->name, name) == 0) return methods[i];
  push_method_names(L);
  mp_argerror(L, arg, lua_pushfstring(L, "unknown start method '%s' "
      "(expected %s)", name, lua_tostring(L, -1)));
  return NULL;
}

/* get_all_start_methods() -> {"fork", "spawn", "forkserver"}: the list
** every Lua module and message reads. */
static int l_get_all_start_methods(lua_State *L) {
  int i;
  lua_createtable(L, 3, 0);
  for (i = 0; methods[i] != NULL; i++) {
    lua_pushstring(L, methods[i]->name);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

static int check_flag(lua_State *L, int arg, int def) {
  if (lua_isnoneornil(L, arg)) return def;
  mp_checktype(L, arg, LUA_TBOOLEAN);
  return lua_toboolean(L, arg);
}

static int check_nprocs(lua_State *L, int arg) {
  lua_Integer n = 0;
  int isint = 0;
  if (lua_isnoneornil(L, arg)) return 1;
  if (lua_type(L, arg) == LUA_TNUMBER) n = lua_tointegerx(L, arg, &isint);
  if (!isint || n < 1)
    mp_argerror(L, arg, lua_pushfstring(L, "positive integer expected, got %s",
        lua_type(L, arg) == LUA_TNUMBER ? luaL_tolstring(L, arg, NULL)
                                        : luaL_typename(L, arg)));
  if (n > MAX_PROCS)
    mp_argerror(L, arg, lua_pushfstring(L, "at most %d processes, got %I",
                                          MAX_PROCS, n));
  return (int)n;
}

/* A duration in seconds named 'what': nil gives 'def', anything else must
** be a number >= 0 (NaN is not). */
static double check_seconds(lua_State *L, int arg, const char *what,
                            double def) {
  double s;
  if (lua_isnoneornil(L, arg)) return def;
  if (lua_type(L, arg) != LUA_TNUMBER)
    mp_argerror(L, arg, lua_pushfstring(L, "%s must be a non-negative "
        "number of seconds, got %s", what, luaL_typename(L, arg)));
  s = lua_tonumber(L, arg);
  if (!(s >= 0))
    mp_argerror(L, arg, lua_pushfstring(L, "%s must be a non-negative "
        "number of seconds, got %s", what, luaL_tolstring(L, arg, NULL)));
  return s;
}

/* --- ProcessContext ------------------------------------------------------ */

mp_Context *mp_checkcontext(lua_State *L, int idx) {
  return mp_checkudata(L, idx, MP_CONTEXT_T);
}

/* A forked worker inherits its parent's contexts: there, closing one
** drops this process's copies of the descriptors and signals nobody. */
void mp_context_close(lua_State *L, mp_Context *ctx, double grace) {
  int i;
  if (ctx->owner != getpid()) mp_watch_close(ctx);  /* copies, in a fork */
  if (ctx->closed) return;
  if (getpid() == ctx->owner)
    mp_terminate_all(ctx, grace);
  else
    for (i = 0; i < ctx->started; i++)
      if (ctx->workers[i].pidfd >= 0) close(ctx->workers[i].pidfd);
  mp_context_finish(L, ctx);
}

/* Joining or signalling is for the process that started the workers. */
static mp_Context *check_owned(lua_State *L, mp_Context *ctx) {
  if (getpid() != ctx->owner)
    luaL_error(L, "this ProcessContext belongs to process %d, which started "
                  "its workers", (int)ctx->owner);
  return ctx;
}

static void push_process(lua_State *L, int ctxidx, int rank) {
  Process *p = lua_newuserdatauv(L, sizeof *p, 1);
  p->rank = rank;
  p->sentinel = -1;
  lua_pushvalue(L, ctxidx);
  lua_setiuservalue(L, -2, 1);
  luaL_setmetatable(L, MP_PROCESS_T);
}

static mp_Context *new_context(lua_State *L, const mp_StartMethod *method,
                               int nprocs, int daemon) {
  size_t size = sizeof(mp_Context) + (size_t)(nprocs - 1) * sizeof(mp_Worker);
  mp_Context *ctx = lua_newuserdatauv(L, size, 1);
  int ctxidx = lua_gettop(L), i;
  memset(ctx, 0, size);
  ctx->nprocs = nprocs;
  ctx->daemon = daemon;
  ctx->closed = 1;  /* nothing to clean until the report file exists */
  ctx->owner = getpid();
  ctx->method = method;
  ctx->first = 0;
  ctx->last = nprocs;
  ctx->reports.fd = ctx->reports.sock = ctx->reports.peer = -1;
  ctx->watch = ctx->timer = -1;
  ctx->lifeline[0] = ctx->lifeline[1] = -1;
  ctx->next_at = HUGE_VAL;
  for (i = 0; i < nprocs; i++) {
    ctx->workers[i].ctx = ctx;
    ctx->workers[i].pidfd = -1;
  }
  luaL_setmetatable(L, MP_CONTEXT_T);
  lua_createtable(L, 0, 3);
  lua_createtable(L, nprocs, 0);
  for (i = 0; i < nprocs; i++) {
    push_process(L, ctxidx, i);
    lua_rawseti(L, -2, i + 1);
  }
  lua_setfield(L, -2, "processes");
  lua_setiuservalue(L, ctxidx, 1);
  return ctx;
}

/* Pushes the list of the contexts this state started (weak values). */
static void push_contexts(lua_State *L) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, CONTEXTS_KEY) == LUA_TTABLE)
    return;                                         /* list */
  lua_pop(L, 1);
  lua_newtable(L);                                  /* list */
  lua_createtable(L, 0, 1);                         /* list mt */
  lua_pushliteral(L, "v");
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);                          /* list */
  lua_pushinteger(L, 0);
  lua_setfield(L, -2, "n");
  lua_pushvalue(L, -1);                             /* list list */
  lua_setfield(L, LUA_REGISTRYINDEX, CONTEXTS_KEY); /* list */
}

static void remember_context(lua_State *L, int ctxidx) {
  int top = mp_stack_top(L);
  lua_Integer n;
  push_contexts(L);                                 /* list */
  lua_getfield(L, -1, "n");                         /* list n */
  n = lua_tointeger(L, -1) + 1;
  lua_pop(L, 1);                                    /* list */
  lua_pushvalue(L, ctxidx);                         /* list ctx */
  lua_rawseti(L, -2, n);                            /* list */
  lua_pushinteger(L, n);
  lua_setfield(L, -2, "n");
  lua_pop(L, 1);
  mp_stack_check(L, top, 0);
}

/* A context of several workers keeps what a restarted worker gets (the
** workers' end of the reports' socket, the read end of the lifeline, the
** payload) until it ends.  One of a single worker (each of mprun's ranks)
** sheds them once its worker runs: descriptors count there, and no other
** worker holds the old ones when a restart makes them again (renew). */
static void shed(lua_State *L, mp_Context *ctx, int ctxidx) {
  mp_Payload *p;
  if (ctx->nprocs > 1) return;
  mp_reports_shed(&ctx->reports);
  if (ctx->lifeline[0] >= 0) close(ctx->lifeline[0]);
  ctx->lifeline[0] = -1;
  p = mp_payload_get(L, ctxidx);                    /* holder */
  if (p != NULL) mp_payload_close(p);
  lua_pop(L, 1);                                    /* */
}

/* Before a restart: makes again what shed closed.  0, or an errno with a
** message pushed.  fn at 'fn', args at 'args'. */
static int renew(lua_State *L, mp_Context *ctx, int ctxidx, int fn,
                 int args) {
  int err, fresh[2];
  mp_Payload *p;
  if (ctx->lifeline[0] < 0) {  /* nobody holds the old pipe's read end */
    if ((err = mp_lifeline_create(fresh)) != 0)
      return mp_push_errno(L, "cannot create the worker's lifeline", err);
    close(ctx->lifeline[1]);
    ctx->lifeline[0] = fresh[0];
    ctx->lifeline[1] = fresh[1];
  }
  if (ctx->reports.peer < 0) {
    mp_watch_unsock(ctx);
    if ((err = mp_reports_renew(&ctx->reports)) != 0)
      return mp_push_errno(L, "cannot create the reports' socket", err);
  }
  if (ctx->method == &mp_start_fork) return 0;
  p = mp_payload_get(L, ctxidx);                    /* holder */
  lua_pop(L, 1);                                    /* */
  if (p != NULL) return 0;
  mp_payload_drop(L, ctxidx);
  return mp_payload_make(L, ctxidx, fn, args, ctx->daemon);
}

/* fn (at 1) and args (at 2) stay in the context's uservalue for restart,
** until it ends (mp_payload_release). */
static void keep_start(lua_State *L, int ctxidx) {
  lua_getiuservalue(L, ctxidx, 1);                  /* uv */
  lua_pushvalue(L, 1);
  lua_setfield(L, -2, "fn");
  lua_pushvalue(L, 2);
  lua_setfield(L, -2, "args");
  lua_pop(L, 1);                                    /* */
}

/* fn at 1, args at 2: starts the workers and joins them when asked. */
static int start(lua_State *L, const mp_StartMethod *method, int nprocs,
                 int join, int daemon) {
  mp_Context *ctx;
  int ctxidx, chans, err;
  mp_sharing_collect(L, 1, 2);                      /* fn args ... chans */
  chans = lua_gettop(L);
  ctx = new_context(L, method, nprocs, daemon);     /* ... chans ctx */
  ctxidx = lua_gettop(L);
  err = mp_reports_create(&ctx->reports);
  if (err != 0)
    return luaL_error(L, "cannot create the workers' report file: %s",
                      strerror(err));
  ctx->closed = 0;
  remember_context(L, ctxidx);
  if ((err = mp_lifeline_create(ctx->lifeline)) != 0) {
    mp_context_close(L, ctx, 0);
    return luaL_error(L, "cannot create the workers' lifeline: %s",
                      strerror(err));
  }
  keep_start(L, ctxidx);
  if (method != &mp_start_fork && mp_payload_make(L, ctxidx, 1, 2, daemon)) {
    mp_context_close(L, ctx, 0);  /* nothing started */
    mp_payload_release(L, ctxidx);
    return lua_error(L);          /* the codec's own message, as is */
  }
  ctx->chans = chans;
  err = method->start(L, ctx, ctxidx, 1, 2);
  ctx->chans = 0;
  if (err != 0) {
    int started = ctx->started;
    mp_context_close(L, ctx, 0);
    mp_payload_release(L, ctxidx);
    return luaL_error(L, "cannot start %d processes with start method \"%s\" "
                         "(%d started, now terminated): %s", nprocs,
                      method->name, started, lua_tostring(L, -1));
  }
  shed(L, ctx, ctxidx);
  mp_sharing_handed(L, chans, ctx->workers, ctx->started);  /* sharing.h */
  lua_settop(L, ctxidx);
  if (!join) return 1;
  mp_join(L, ctx, ctxidx, -1, MP_DEFAULT_GRACE, 0);
  lua_getiuservalue(L, ctxidx, 1);
  lua_getfield(L, -1, "results");
  return 1;
}

static void check_fn_and_args(lua_State *L) {
  mp_checktype(L, 1, LUA_TFUNCTION);
  if (lua_isnoneornil(L, 2)) {
    lua_newtable(L);
    lua_replace(L, 2);
  } else {
    lua_Integer n;
    int isint;
    mp_checktype(L, 2, LUA_TTABLE);
    lua_pushliteral(L, "n");
    if (lua_rawget(L, 2) != LUA_TNIL) {
      n = lua_tointegerx(L, -1, &isint);
      if (!isint || n < 0 || n > MP_MAX_ARGS)
        mp_argerror(L, 2, lua_pushfstring(L, "args.n must be an integer "
            "from 0 to %d, got %s", MP_MAX_ARGS, luaL_tolstring(L, -1, NULL)));
    }
    lua_pop(L, 1);
  }
}

/* start_processes(fn, args, nprocs, join, daemon, start_method) */
static int l_start_processes(lua_State *L) {
  int nprocs, join, daemon;
  const mp_StartMethod *method;
  lua_settop(L, 6);
  check_fn_and_args(L);
  nprocs = check_nprocs(L, 3);
  join = check_flag(L, 4, 1);
  daemon = check_flag(L, 5, 0);
  method = check_method(L, 6);
  return start(L, method, nprocs, join, daemon);
}

/* spawn(...): as start_processes, always with "spawn"; another start method
** is warned about and ignored, as torch does. */
static int l_spawn(lua_State *L) {
  int nprocs, join, daemon;
  lua_settop(L, 6);
  check_fn_and_args(L);
  nprocs = check_nprocs(L, 3);
  join = check_flag(L, 4, 1);
  daemon = check_flag(L, 5, 0);
  if (!lua_isnil(L, 6)
      && !(lua_type(L, 6) == LUA_TSTRING
           && strcmp(lua_tostring(L, 6), "spawn") == 0)) {
    lua_pushliteral(L, "multiprocessing.spawn only supports start_method "
                       "\"spawn\" (got: ");
    luaL_tolstring(L, 6, NULL);
    lua_pushliteral(L, "); use multiprocessing.start_processes(...) for "
                       "another start method");
    lua_concat(L, 3);
    mp_warning(L, lua_tostring(L, -1));
    lua_pop(L, 1);
  }
  return start(L, &mp_start_spawn, nprocs, join, daemon);
}

static int ctx_join(lua_State *L) {
  double timeout, grace;
  mp_Context *ctx = check_owned(L, mp_checkcontext(L, 1));
  timeout = mp_opttimeout(L, 2);
  grace = check_seconds(L, 3, "grace_period", MP_DEFAULT_GRACE);
  lua_pushboolean(L, mp_join(L, ctx, 1, timeout, grace,
                             !lua_isnoneornil(L, 3)));
  return 1;
}

/* The worker 'rank' (0-based) at 'arg'. */
static int check_rank(lua_State *L, const mp_Context *ctx, int arg) {
  lua_Integer rank = mp_checkinteger(L, arg);
  if (rank < 0 || rank >= ctx->nprocs)
    mp_argerror(L, arg, lua_pushfstring(L, "rank from 0 to %d expected, "
                                           "got %I", ctx->nprocs - 1, rank));
  return (int)rank;
}

/* terminate([grace [, rank]]): see mp_terminate (every worker) and
** mp_terminate_rank (one); returns at once. */
static int ctx_terminate(lua_State *L) {
  mp_Context *ctx = check_owned(L, mp_checkcontext(L, 1));
  double grace = check_seconds(L, 2, "grace", MP_DEFAULT_GRACE);
  if (lua_isnoneornil(L, 3))
    mp_terminate(ctx, grace);
  else
    mp_terminate_rank(ctx, check_rank(L, ctx, 3), grace);
  return 0;
}

/* poll() -> events, due: see mp_poll. */
static int ctx_poll(lua_State *L) {
  return mp_poll(L, check_owned(L, mp_checkcontext(L, 1)));
}

/* The worker 'rank' may start again: it ended, poll() told, and no ending
** is under way. */
static mp_Worker *check_restart(lua_State *L, mp_Context *ctx, int arg) {
  int rank = check_rank(L, ctx, arg);
  mp_Worker *w = &ctx->workers[rank];
  if (ctx->closed || ctx->ending != MP_END_NONE)
    luaL_error(L, "ProcessContext.restart: the context is %s",
               ctx->closed ? "closed" : "being terminated");
  if (w->pid <= 0 || w->state != MP_EXITED || !w->polled)
    luaL_error(L, "ProcessContext.restart: process %d has not ended, or "
                  "poll() has not reported its end yet", (int)rank);
  return w;
}

/* restart(rank) -> pid, or nil, message: a fresh worker in the slot of one
** that ended, with the same fn, args and start method. */
static int ctx_restart(lua_State *L) {
  mp_Context *ctx = check_owned(L, mp_checkcontext(L, 1));
  mp_Worker *w = check_restart(L, ctx, 2), old = *w;
  int rank = (int)(w - ctx->workers), err;
  lua_settop(L, 1);
  lua_getiuservalue(L, 1, 1);                       /* ctx uv */
  lua_getfield(L, 2, "fn");                         /* ctx uv fn */
  lua_getfield(L, 2, "args");                       /* ctx uv fn args */
  if ((err = renew(L, ctx, 1, 3, 4)) != 0) {        /* ... msg */
    lua_pushnil(L);
    lua_insert(L, -2);                              /* ... nil msg */
    return 2;
  }
  mp_reports_clear(L, &ctx->reports, rank);
  memset(w, 0, sizeof *w);
  w->ctx = ctx;
  w->pidfd = -1;
  w->state = MP_RUNNING;
  mp_sharing_collect(L, 3, 4);                      /* ctx uv fn args chans */
  ctx->first = rank;
  ctx->last = rank + 1;
  ctx->chans = 5;
  err = ctx->method->start(L, ctx, 1, 3, 4);        /* ... [msg] */
  ctx->first = 0;
  ctx->last = ctx->nprocs;
  ctx->chans = 0;
  if (err == 0 && ctx->nprocs == 1) shed(L, ctx, 1);
  if (err == 0 && w->pid > 0 && w->state == MP_RUNNING) {
    mp_sharing_handed(L, 5, w, 1);  /* sharing.h */
    mp_watch_worker(w);
    lua_pushinteger(L, w->pid);
    return 1;
  }
  if (w->pid > 0 && w->state == MP_RUNNING) {  /* started, then failed */
    mp_discard(w);
    if (w->pidfd >= 0) close(w->pidfd);
    mp_reports_clear(L, &ctx->reports, rank);
  }
  *w = old;  /* ended as before: a later restart may try again */
  lua_pushnil(L);
  lua_pushfstring(L, "cannot restart process %d with start method \"%s\": "
                     "%s", rank, ctx->method->name,
                  err != 0 ? lua_tostring(L, -2) : "it did not start");
  return 2;
}

static int ctx_pids(lua_State *L) {
  mp_Context *ctx = mp_checkcontext(L, 1);
  int i;
  lua_createtable(L, ctx->nprocs, 0);
  for (i = 0; i < ctx->started; i++) {
    lua_pushinteger(L, ctx->workers[i].pid);
    lua_rawseti(L, -2, i + 1);
  }
  return 1;
}

/* results(): {rank0_value, ..., n = nprocs} once join has returned true. */
static int ctx_results(lua_State *L) {
  mp_Context *ctx = mp_checkcontext(L, 1);
  lua_getiuservalue(L, 1, 1);
  if (lua_getfield(L, -1, "failure") != LUA_TNIL) return lua_error(L);
  if (!ctx->closed)
    return luaL_error(L, "results are available once join has returned true");
  if (lua_getfield(L, -2, "results") == LUA_TNIL)
    return luaL_error(L, "no results: the context was closed before its "
                         "workers finished");
  return 1;
}

/* close([grace_period]) and __close/__gc: end what still runs.  Without a
** grace period (always for __close, __gc and lua_close) the workers get
** SIGKILL at once, and close waits only for the kernel to take them down:
** a frame is never blocked by a worker that ignores SIGTERM.  close(g)
** asks for SIGTERM and up to g seconds before SIGKILL, and waits for it.
** For a graceful end that never blocks, poll join(0) instead. */
static int end_context(lua_State *L, double grace) {
  mp_Context *ctx = mp_checkcontext(L, 1);
  mp_context_close(L, ctx, grace);
  mp_watch_close(ctx);
  ctx->shut = 1;
  mp_payload_release(L, 1);
  return 0;
}

static int ctx_close(lua_State *L) {
  return end_context(L, check_seconds(L, 2, "grace_period", 0));
}

static int ctx_gc(lua_State *L) {
  return end_context(L, 0);
}

/* fileno(): a descriptor that becomes readable when join(0) has something
** to do -- a worker exited, a report's descriptors came, the ending's next
** step is due -- and stays readable once the context is settled.  Valid
** until close (or collection) of the context: stop watching it first.
** After close() it raises, as Queue.fileno does: a new epoll and timer
** would be held until collection for nothing. */
static int ctx_fileno(lua_State *L) {
  mp_Context *ctx = check_owned(L, mp_checkcontext(L, 1));
  int fd;
  if (ctx->shut)
    return luaL_error(L, "ProcessContext.fileno: the context is closed");
  fd = mp_watch(ctx);
  if (fd < 0)
    return luaL_error(L, "ProcessContext.fileno: %s", strerror(-fd));
  lua_pushinteger(L, fd);
  return 1;
}

/* As of now (the workers that ended are reaped first, never waiting):
** ProcessContext (fork, 4 processes: 3 running, 1 done, 1 failed): 0x... */
static int ctx_tostring(lua_State *L) {
  mp_Context *ctx = mp_checkcontext(L, 1);
  int i, alive = 0, done = 0, failed = 0;
  for (i = 0; i < ctx->started; i++) {
    mp_Worker *w = &ctx->workers[i];
    if (w->state == MP_RUNNING &&
        (ctx->owner != getpid() || w->pid <= 0 || !mp_reap(w))) {
      alive++;
      continue;
    }
    done++;
    failed += w->exitcode != 0 && !w->terminated;
  }
  if (failed > 0) lua_pushfstring(L, ", %d failed", failed);
  else lua_pushliteral(L, "");
  lua_pushfstring(L, "ProcessContext (%s, %d processes: %d running, %d done%s"
                  "): %p", ctx->method->name, ctx->nprocs, alive, done,
                  lua_tostring(L, -1), (void *)ctx);
  return 1;
}

static int ctx_index(lua_State *L) {
  mp_Context *ctx = mp_checkcontext(L, 1);
  const char *key = lua_tostring(L, 2);
  if (key != NULL && strcmp(key, "processes") == 0) {
    lua_getiuservalue(L, 1, 1);
    lua_getfield(L, -1, "processes");
  } else if (key != NULL && strcmp(key, "daemon") == 0) {
    lua_pushboolean(L, ctx->daemon);
  } else if (key != NULL && strcmp(key, "start_method") == 0) {
    lua_pushstring(L, ctx->method->name);
  } else {
    mp_push_method(L);
  }
  return 1;
}

/* --- Process ------------------------------------------------------------- */

static mp_Worker *check_process(lua_State *L, int idx) {
  Process *p = mp_checkudata(L, idx, MP_PROCESS_T);
  mp_Context *ctx;
  lua_getiuservalue(L, idx, 1);
  ctx = lua_touserdata(L, -1);
  lua_pop(L, 1);  /* the process handle keeps the context alive */
  return &check_owned(L, ctx)->workers[p->rank];
}

static int process_is_alive(lua_State *L) {
  mp_Worker *w = check_process(L, 1);
  lua_pushboolean(L, w->pid > 0 && !mp_reap(w));
  return 1;
}

static int process_signal(lua_State *L, int sig) {
  mp_Worker *w = check_process(L, 1);
  int err;
  if (w->pid > 0 && !mp_reap(w) && (err = mp_signal_worker(w, sig)) != 0)
    return luaL_error(L, "cannot signal process %d: %s", (int)w->pid,
                      strerror(-err));
  return 0;
}

static int process_terminate(lua_State *L) { return process_signal(L, SIGTERM); }
static int process_kill(lua_State *L) { return process_signal(L, SIGKILL); }

/* A descriptor readable once the worker has ended: a pidfd of our own,
** which stays readable after the worker is reaped; for one reaped
** already, an eventfd that is readable for ever. */
static int open_sentinel(const mp_Worker *w) {
  if (w->state == MP_EXITED) return eventfd(1, EFD_CLOEXEC);
  if (w->pidfd >= 0) return fcntl(w->pidfd, F_DUPFD_CLOEXEC, 3);
  return pidfd_open(w->pid, 0);  /* our unreaped child: it is that one */
}

/* fileno() and p.sentinel: readable once the worker has ended (Python's
** Process.sentinel), for poll(2), mp.wait or an event loop; the handle's
** own, valid until close() or its collection. */
static int process_fileno(lua_State *L) {
  mp_Worker *w = check_process(L, 1);
  Process *p = lua_touserdata(L, 1);
  if (p->sentinel == -2)
    return luaL_error(L, "Process.fileno: the handle is closed");
  if (p->sentinel < 0 && (p->sentinel = open_sentinel(w)) < 0)
    return luaL_error(L, "Process.fileno: %s", strerror(errno));
  lua_pushinteger(L, p->sentinel);
  return 1;
}

/* close(): gives back the handle's sentinel; the worker must have ended
** (Python's Process.close). */
static int process_close(lua_State *L) {
  mp_Worker *w = check_process(L, 1);
  Process *p = lua_touserdata(L, 1);
  if (w->pid > 0 && !mp_reap(w))
    return luaL_error(L, "Process.close: process %d is still running "
                         "(join, terminate or kill it first)", (int)w->pid);
  if (p->sentinel >= 0) close(p->sentinel);
  p->sentinel = -2;
  return 0;
}

static int process_gc(lua_State *L) {
  Process *p = luaL_checkudata(L, 1, MP_PROCESS_T);
  if (p->sentinel >= 0) close(p->sentinel);
  p->sentinel = -2;
  return 0;
}

static int process_index(lua_State *L) {
  mp_Worker *w = check_process(L, 1);
  const char *key = lua_tostring(L, 2);
  if (key != NULL && (strcmp(key, "pid") == 0 || strcmp(key, "ident") == 0)) {
    lua_pushinteger(L, w->pid);
  } else if (key != NULL && strcmp(key, "exitcode") == 0) {
    if (w->pid > 0 && mp_reap(w) && w->exitcode != MP_EXIT_UNKNOWN)
      lua_pushinteger(L, w->exitcode);
    else
      lua_pushnil(L);
  } else if (key != NULL && strcmp(key, "rank") == 0) {
    lua_pushinteger(L, ((Process *)lua_touserdata(L, 1))->rank);
  } else if (key != NULL && strcmp(key, "name") == 0) {
    lua_pushfstring(L, "Process-%d", ((Process *)lua_touserdata(L, 1))->rank);
  } else if (key != NULL && strcmp(key, "daemon") == 0) {
    lua_getiuservalue(L, 1, 1);
    lua_pushboolean(L, ((mp_Context *)lua_touserdata(L, -1))->daemon);
  } else if (key != NULL && strcmp(key, "sentinel") == 0) {
    process_fileno(L);
  } else {
    mp_push_method(L);
  }
  return 1;
}

static int process_tostring(lua_State *L) {
  mp_Worker *w = check_process(L, 1);
  Process *p = lua_touserdata(L, 1);
  if (w->pid > 0 && mp_reap(w))
    lua_pushfstring(L, "Process %d (pid %d, exitcode %d)", p->rank,
                    (int)w->pid, w->exitcode);
  else
    lua_pushfstring(L, "Process %d (pid %d, running)", p->rank, (int)w->pid);
  return 1;
}

/* --- the processes of this process -------------------------------------- */

/* active_children(): the Process handles of the workers this process
** started that still run, in the order they were started.  As Python's,
** it reaps the ones that have exited (their exit codes stay readable) and
** forgets the contexts that are over. */
static int l_active_children(lua_State *L) {
  lua_Integer i, n, kept = 0;
  int list, out, k;
  mp_checknoargs(L, 1);
  lua_newtable(L);                                  /* out */
  out = lua_gettop(L);
  push_contexts(L);                                 /* out list */
  list = lua_gettop(L);
  lua_getfield(L, list, "n");
  n = lua_tointeger(L, -1);
  lua_pop(L, 1);
  for (i = 1; i <= n; i++) {
    mp_Context *ctx;
    lua_rawgeti(L, list, i);                        /* out list ctx */
    ctx = lua_touserdata(L, -1);
    lua_pushnil(L);
    lua_rawseti(L, list, i);
    if (ctx != NULL && !ctx->closed && ctx->owner == getpid()) {
      lua_rawseti(L, list, ++kept);                 /* out list (kept) */
      lua_rawgeti(L, list, kept);
      lua_getiuservalue(L, -1, 1);
      lua_getfield(L, -1, "processes");             /* out list ctx uv procs */
      for (k = 0; k < ctx->started; k++)
        if (ctx->workers[k].pid > 0 && !mp_reap(&ctx->workers[k])) {
          lua_rawgeti(L, -1, k + 1);                /* ... procs p */
          lua_rawseti(L, out, (lua_Integer)lua_rawlen(L, out) + 1);
        }
      lua_pop(L, 3);                                /* out list */
    } else {
      lua_pop(L, 1);                                /* out list */
    }
  }
  lua_pushinteger(L, kept);
  lua_setfield(L, list, "n");
  lua_settop(L, out);                               /* out */
  return 1;
}

static int current_is_alive(lua_State *L) {
  lua_pushboolean(L, 1);  /* whoever asks runs */
  return 1;
}

/* current_process(): {pid, ident, ppid, name, rank, daemon, is_alive} of this
** process, as Python's: in a worker its rank and the name of its Process
** handle in the parent ("Process-<rank>"), else "MainProcess" and no
** rank; exitcode is nil (it runs). */
/* tostring(current_process()): "MainProcess (pid 12, running)", in a
** worker "Process 2 (pid 15, running)", as its handle prints. */
static int current_tostring(lua_State *L) {
  lua_getfield(L, 1, "rank");
  lua_getfield(L, 1, "pid");
  if (lua_isinteger(L, -2))
    lua_pushfstring(L, "Process %d (pid %d, running)",
                    (int)lua_tointeger(L, -2), (int)lua_tointeger(L, -1));
  else
    lua_pushfstring(L, "MainProcess (pid %d, running)",
                    (int)lua_tointeger(L, -1));
  return 1;
}

static int l_current_process(lua_State *L) {
  int worker;
  mp_checknoargs(L, 1);
  worker = lua_getfield(L, LUA_REGISTRYINDEX, MP_WORKER_KEY) == LUA_TTABLE;
  lua_createtable(L, 0, 7);                         /* id t */
  if (luaL_newmetatable(L, "multiprocessing.CurrentProcess")) {
    lua_pushcfunction(L, current_tostring);         /* id t mt f */
    lua_setfield(L, -2, "__tostring");
  }
  lua_setmetatable(L, -2);                          /* id t */
  lua_pushcfunction(L, current_is_alive);
  lua_setfield(L, -2, "is_alive");
  lua_pushinteger(L, getppid());                    /* id t ppid */
  lua_setfield(L, -2, "ppid");
  lua_pushinteger(L, getpid());                     /* id t pid */
  lua_pushvalue(L, -1);
  lua_setfield(L, -3, "pid");
  lua_setfield(L, -2, "ident");                     /* id t */
  if (worker) {
    lua_getfield(L, -2, "rank");                    /* id t rank */
    lua_pushfstring(L, "Process-%d", (int)lua_tointeger(L, -1));
    lua_setfield(L, -3, "name");
    lua_setfield(L, -2, "rank");                    /* id t */
    lua_getfield(L, -2, "daemon");                  /* id t daemon */
  } else {
    lua_pushliteral(L, "MainProcess");
    lua_setfield(L, -2, "name");
    lua_pushboolean(L, 0);                          /* id t false */
  }
  lua_setfield(L, -2, "daemon");                    /* id t */
  return 1;
}

/* --- registration -------------------------------------------------------- */

void mp_open_context(lua_State *L) {
  static const luaL_Reg ctx_meta[] = {
    {"__index", ctx_index}, {"__gc", ctx_gc}, {"__close", ctx_gc},
    {"__tostring", ctx_tostring}, {NULL, NULL}
  };
  static const luaL_Reg ctx_methods[] = {
    {"join", ctx_join}, {"pids", ctx_pids}, {"results", ctx_results},
    {"close", ctx_close}, {"fileno", ctx_fileno},
    {"terminate", ctx_terminate}, {"poll", ctx_poll},
    {"restart", ctx_restart}, {NULL, NULL}
  };
  static const luaL_Reg process_meta[] = {
    {"__index", process_index}, {"__tostring", process_tostring},
    {"__gc", process_gc}, {NULL, NULL}
  };
  static const luaL_Reg process_methods[] = {
    {"is_alive", process_is_alive}, {"terminate", process_terminate},
    {"kill", process_kill}, {"fileno", process_fileno},
    {"close", process_close}, {NULL, NULL}
  };
  static const luaL_Reg funcs[] = {
    {"start_processes", l_start_processes}, {"spawn", l_spawn},
    {"active_children", l_active_children},
    {"current_process", l_current_process},
    {"get_all_start_methods", l_get_all_start_methods}, {NULL, NULL}
  };
  mp_new_class(L, MP_CONTEXT_T, ctx_meta, ctx_methods);
  lua_setfield(L, -2, "ProcessContext");
  mp_new_class(L, MP_PROCESS_T, process_meta, process_methods);
  lua_setfield(L, -2, "Process");
  luaL_setfuncs(L, funcs, 0);
}
