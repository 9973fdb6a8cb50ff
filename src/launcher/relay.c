/*
** relay.c -- the output relay of a launcher: reads the ranks' pipes,
** copies the raw bytes to log files, and writes whole, prefixed lines to
** one console, one rank's line never split by another's; it also draws
** and erases a status line, and waits in the same poll(2) on the
** contexts' fileno() and a signalfd.
*/
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include "launcher.h"

#define FD_T    "multiprocessing.Fd"
#define RELAY_T "multiprocessing.Relay"

#define READ_SIZE   (256 * 1024)   /* one read from a worker's pipe */
#define OUT_FLUSH   (256 * 1024)   /* console bytes buffered before a write */
#define LINE_MAX_   (1024 * 1024)  /* a longer partial line is cut */

typedef struct Out {
  int fd;
  int broken;        /* the console went away (EPIPE): output is dropped */
  char *buf;
  size_t len, cap;
} Out;

typedef struct Source {
  int fd;            /* the read end, -1 once closed */
  int console;       /* 1 or 2: that Out; 0: not shown */
  int file;          /* the raw bytes go here too, or -1 */
  char *prefix;
  size_t plen;
  char *line;        /* the partial line so far */
  size_t len, cap;
} Source;

typedef struct Relay {
  Out out[2];        /* the console's stdout and stderr */
  int status_fd;     /* where the status line is drawn */
  int status_shown;
  int file_err;      /* the first error writing a log file, or 0 */
  Source *src;
  size_t nsrc, capsrc;
  char *chunk;       /* READ_SIZE bytes */
  struct pollfd *pfd;    /* relay:wait's poll set */
  int *who;              /* for each entry: the index of its context, or 0 */
  size_t cappfd;
} Relay;

static Relay *check_relay(lua_State *L, int arg) {
  Relay *R = luaL_checkudata(L, arg, RELAY_T);
  if (R->chunk == NULL) luaL_error(L, "the relay is closed");
  return R;
}

static int grow(char **buf, size_t *cap, size_t need) {
  size_t n = *cap ? *cap : 256;
  char *p;
  if (need <= *cap) return 1;
  while (n < need) n *= 2;
  p = realloc(*buf, n);
  if (p == NULL) return 0;
  *buf = p;
  *cap = n;
  return 1;
}

static void erase_status(Relay *R) {
  if (!R->status_shown) return;
  R->status_shown = 0;
  mp_write_all(R->status_fd, "\r\033[K", 4);
}

static void flush_out(Relay *R, Out *o) {
  if (o->len == 0) return;
  erase_status(R);
  if (!o->broken && mp_write_all(o->fd, o->buf, o->len) == EPIPE) o->broken = 1;
  o->len = 0;
}

static void flush_all(Relay *R) {
  flush_out(R, &R->out[0]);
  flush_out(R, &R->out[1]);
}

/* One console line: prefix, the partial line kept so far, then 'p' ('n'
** bytes); a newline is added when 'p' does not end one. */
static void emit(Relay *R, Source *s, const char *p, size_t n) {
  Out *o = &R->out[s->console - 1];
  size_t need = o->len + s->plen + s->len + n + 1;
  int nl = n > 0 && p[n - 1] == '\n';
  if (!o->broken && grow(&o->buf, &o->cap, need)) {
    memcpy(o->buf + o->len, s->prefix, s->plen);
    o->len += s->plen;
    if (s->len > 0) memcpy(o->buf + o->len, s->line, s->len);  /* line may be NULL */
    o->len += s->len;
    memcpy(o->buf + o->len, p, n);
    o->len += n;
    if (!nl) o->buf[o->len++] = '\n';
  }
  s->len = 0;
  if (o->len >= OUT_FLUSH) flush_out(R, o);
}

/* Bytes from a source: all of them to its file, whole lines to the
** console, the rest kept for the next read. */
static void feed(Relay *R, Source *s, const char *p, size_t n) {
  const char *end = p + n, *nl;
  int err;
  if (s->file >= 0 && (err = mp_write_all(s->file, p, n)) != 0) {
    close(s->file);  /* a full disk loses the log, not the console */
    s->file = -1;
    if (R->file_err == 0) R->file_err = err;  /* relay:close says so */
  }
  if (s->console == 0) return;
  while ((nl = memchr(p, '\n', (size_t)(end - p))) != NULL) {
    emit(R, s, p, (size_t)(nl - p) + 1);
    p = nl + 1;
  }
  if (p == end) return;
  if (!grow(&s->line, &s->cap, s->len + (size_t)(end - p))) {
    emit(R, s, p, (size_t)(end - p));  /* no memory: cut the line here */
    return;
  }
  memcpy(s->line + s->len, p, (size_t)(end - p));
  s->len += (size_t)(end - p);
  if (s->len >= LINE_MAX_) emit(R, s, "", 0);
}

/* The partial last line is shown with a newline; the log keeps it as is. */
static void close_source(Relay *R, Source *s) {
  if (s->console != 0 && s->len > 0) emit(R, s, "", 0);
  if (s->fd >= 0) close(s->fd);
  if (s->file >= 0) close(s->file);
  s->fd = s->file = -1;
  free(s->line);
  free(s->prefix);
  s->line = s->prefix = NULL;
  s->len = s->cap = 0;
}

/* One read: 1 when bytes came, 0 when there are none now, -1 when the
** source is finished (EOF or an error) and closed. */
static int read_source(Relay *R, Source *s) {
  ssize_t n;
  do n = read(s->fd, R->chunk, READ_SIZE); while (n < 0 && errno == EINTR);
  if (n > 0) {
    feed(R, s, R->chunk, (size_t)n);
    return 1;
  }
  if (n < 0 && errno == EAGAIN) return 0;
  close_source(R, s);
  return -1;
}

/* _relay(stdout_fd, stderr_fd, status_fd): the console descriptors are
** borrowed (1, 2, 2 for a launcher). */
static int l_relay(lua_State *L) {
  Relay *R = lua_newuserdatauv(L, sizeof *R, 0);
  memset(R, 0, sizeof *R);
  R->out[0].fd = (int)luaL_checkinteger(L, 1);
  R->out[1].fd = (int)luaL_checkinteger(L, 2);
  R->status_fd = (int)luaL_checkinteger(L, 3);
  luaL_setmetatable(L, RELAY_T);
  R->chunk = malloc(READ_SIZE);
  if (R->chunk == NULL) return luaL_error(L, "not enough memory");
  return 1;
}

/* relay:add(read_end, console (0|1|2), prefix|nil, file|nil) -> id.
** Takes both descriptors from their Fds. */
static int relay_add(lua_State *L) {
  Relay *R = check_relay(L, 1);
  int console = (int)luaL_checkinteger(L, 3);
  size_t plen = 0;
  const char *prefix = lua_isnoneornil(L, 4) ? "" : luaL_checklstring(L, 4, &plen);
  Source *s;
  char *copy;
  luaL_argcheck(L, console >= 0 && console <= 2, 3, "0, 1 or 2 expected");
  luaL_checkudata(L, 2, FD_T);
  if (!lua_isnoneornil(L, 5)) luaL_checkudata(L, 5, FD_T);
  if (R->nsrc == R->capsrc) {
    size_t cap = R->capsrc ? 2 * R->capsrc : 16;
    Source *p = realloc(R->src, cap * sizeof *p);
    if (p == NULL) return luaL_error(L, "not enough memory");
    R->src = p;
    R->capsrc = cap;
  }
  copy = malloc(plen + 1);
  if (copy == NULL) return luaL_error(L, "not enough memory");
  memcpy(copy, prefix, plen + 1);
  s = &R->src[R->nsrc];
  memset(s, 0, sizeof *s);
  s->fd = lnc_take(L, 2);
  s->file = lnc_take(L, 5);
  s->console = console;
  s->prefix = copy;
  s->plen = plen;
  lua_pushinteger(L, (lua_Integer)++R->nsrc);
  return 1;
}

static Source *check_source(lua_State *L, Relay *R, int arg) {
  lua_Integer id = luaL_checkinteger(L, arg);
  luaL_argcheck(L, id >= 1 && (size_t)id <= R->nsrc, arg, "no such source");
  return &R->src[id - 1];
}

/* relay:drain(id): reads what the source holds now, then closes it (its
** writer is gone: whatever it wrote is in the pipe). */
static int relay_drain(lua_State *L) {
  Relay *R = check_relay(L, 1);
  Source *s = check_source(L, R, 2);
  while (s->fd >= 0 && read_source(R, s) > 0) {}
  close_source(R, s);
  flush_all(R);
  return 0;
}

/* Room for 'n' entries in the poll set. */
static void pollroom(lua_State *L, Relay *R, size_t n) {
  struct pollfd *p;
  int *w;
  if (n <= R->cappfd) return;
  n *= 2;
  p = realloc(R->pfd, n * sizeof *p);
  if (p != NULL) R->pfd = p;
  w = realloc(R->who, n * sizeof *w);
  if (w != NULL) R->who = w;
  if (p == NULL || w == NULL) luaL_error(L, "not enough memory");
  R->cappfd = n;
}

static void pollset_add(lua_State *L, Relay *R, size_t *n, int fd, int who) {
  pollroom(L, R, *n + 1);
  R->pfd[*n].fd = fd;
  R->pfd[*n].events = POLLIN;
  R->who[(*n)++] = who;
}

/* The poll set: open sources (who 0), the descriptors fds[1..nfds] that
** are integers (who = that index: a context's fileno(), readable when its
** join(0) or poll() has news), the signalfd (who -1). */
static size_t pollset(lua_State *L, Relay *R, int nfds, int sigfd) {
  size_t n = 0, k;
  int i;
  for (k = 0; k < R->nsrc; k++)
    if (R->src[k].fd >= 0) pollset_add(L, R, &n, R->src[k].fd, 0);
  for (i = 1; i <= nfds; i++) {
    int isnum;
    lua_Integer fd;
    lua_geti(L, 3, i);
    fd = lua_tointegerx(L, -1, &isnum);
    lua_pop(L, 1);
    if (isnum && fd >= 0) pollset_add(L, R, &n, (int)fd, i);
  }
  if (sigfd >= 0) pollset_add(L, R, &n, sigfd, -1);
  return n;
}

static Source *source_of(Relay *R, int fd) {
  size_t k;
  for (k = 0; k < R->nsrc; k++)
    if (R->src[k].fd == fd) return &R->src[k];
  return NULL;
}

/* relay:wait(timeout, fds, signalfd|nil) -> ready, signum
** Relays output until one of fds[i] (i = 1..fds.n, the integers; other
** values are skipped) is readable, a signal comes or 'timeout' seconds
** pass (negative: no limit).  'ready' lists those i; 'signum' is the number
** of the signal read, or nil. */
static int relay_wait(lua_State *L) {
  Relay *R = check_relay(L, 1);
  double timeout = luaL_checknumber(L, 2);
  double deadline = timeout < 0 ? INFINITY : mp_now() + timeout;
  int nctx, sigfd = -1, signo = 0, nexited = 0;
  luaL_checktype(L, 3, LUA_TTABLE);
  if (!lua_isnoneornil(L, 4)) sigfd = lnc_fileno(L, 4);
  lua_getfield(L, 3, "n");
  nctx = (int)lua_tointeger(L, -1);
  lua_pop(L, 1);
  lua_newtable(L);  /* exited */
  for (;;) {
    double left = deadline - mp_now();
    int ms = isinf(deadline) ? -1 : left <= 0 ? 0
           : left > INT_MAX / 1000 ? INT_MAX : (int)ceil(left * 1000);
    size_t n = pollset(L, R, nctx, sigfd), k;
    int r;
    flush_all(R);
    r = poll(R->pfd, (nfds_t)n, ms);
    if (r < 0 && errno != EINTR)
      return luaL_error(L, "poll: %s", strerror(errno));
    for (k = 0; r > 0 && k < n; k++) {
      struct signalfd_siginfo ssi;
      Source *s;
      if (R->pfd[k].revents == 0) continue;
      if (R->who[k] > 0) {
        lua_pushinteger(L, R->who[k]);
        lua_rawseti(L, -2, ++nexited);
      } else if (R->who[k] < 0) {
        if (read(sigfd, &ssi, sizeof ssi) == (ssize_t)sizeof ssi)
          signo = (int)ssi.ssi_signo;
      } else if ((s = source_of(R, R->pfd[k].fd)) != NULL) {
        read_source(R, s);
      }
    }
    if (nexited > 0 || signo != 0 || mp_now() >= deadline) break;
  }
  flush_all(R);
  if (signo == 0) return 1;
  lua_pushinteger(L, signo);
  return 2;
}

/* relay:status(text|nil): draws the status line (no newline), or erases
** it; output lines erase it before they are written. */
static int relay_status(lua_State *L) {
  Relay *R = check_relay(L, 1);
  size_t len;
  const char *text = lua_isnoneornil(L, 2) ? NULL : luaL_checklstring(L, 2, &len);
  flush_all(R);
  if (text == NULL) {
    erase_status(R);
    return 0;
  }
  lua_pushfstring(L, "\r%s\033[K", text);
  text = lua_tolstring(L, -1, &len);
  mp_write_all(R->status_fd, text, len);
  R->status_shown = 1;
  return 0;
}

/* relay:close() -> nil, or the error that cut a log file short: every
** source closed (partial lines shown), output flushed, the status line
** erased.  Also __gc and __close. */
static int relay_close(lua_State *L) {
  Relay *R = luaL_checkudata(L, 1, RELAY_T);
  size_t k;
  if (R->chunk == NULL) return 0;
  if (R->file_err != 0)
    lua_pushfstring(L, "a log file could not be written: %s",
                    strerror(R->file_err));
  else
    lua_pushnil(L);
  for (k = 0; k < R->nsrc; k++) close_source(R, &R->src[k]);
  flush_all(R);
  erase_status(R);
  free(R->out[0].buf);
  free(R->out[1].buf);
  free(R->src);
  free(R->pfd);
  free(R->who);
  free(R->chunk);
  memset(R, 0, sizeof *R);
  return 1;
}

void lnc_open_relay(lua_State *L) {
  static const luaL_Reg relay_meta[] = {
    {"__gc", relay_close}, {"__close", relay_close}, {NULL, NULL}
  };
  static const luaL_Reg relay_methods[] = {
    {"add", relay_add}, {"drain", relay_drain}, {"wait", relay_wait},
    {"status", relay_status}, {"close", relay_close}, {NULL, NULL}
  };
  luaL_newmetatable(L, RELAY_T);                  /* M mt */
  luaL_setfuncs(L, relay_meta, 0);
  luaL_newlib(L, relay_methods);                  /* M mt methods */
  lua_setfield(L, -2, "__index");                 /* M mt */
  lua_pop(L, 1);                                  /* M */
  lua_pushcfunction(L, l_relay);
  lua_setfield(L, -2, "_relay");
}
