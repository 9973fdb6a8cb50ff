/*
** shm.c -- shared memory segments, the sharing strategies, and the tracker
** of file_system names.  (Descriptors cross in fdpass.c.)
**
** file_descriptor: a memfd (MFD_CLOEXEC|MFD_ALLOW_SEALING), sealed against
**   shrinking and growing, freed by the kernel with its last fd and mapping.
** file_system: a shm_open name "/lmp_<32 random hex>" (O_EXCL, 0600).  Every
**   name is first registered in the table of a tracker: a tiny process
**   started (double fork: nobody's child, own session, every fd closed, only
**   system calls after fork) on first file_system use.  The table is a
**   MAP_SHARED anonymous mapping, so the creator holds no descriptor; forked
**   workers inherit it and register their names there too.  The tracker
**   watches its creator with a pidfd: when the creator exits -- normal end,
**   error, SIGKILL -- or its lua_State closes (the tracker userdata's __gc
**   sets a quit flag, seen within 0.1 s), the tracker unlinks every name
**   still registered and exits.  Names are also unlinked (and removed from
**   the table) as soon as their reference count drops to zero (array.c).
**   A tracker started in a worker outlives the worker while the worker's
**   parent runs and one of its names exists: its results and messages are
**   opened by their receivers after it is gone.  The references a killed
**   worker held are given back sooner, by its parent (ledger.c).
*/
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mp.h"
#include "sharing.h"

#define STRATEGY_KEY "multiprocessing.sharing_strategy"
#define TRACKER_T    "multiprocessing.Tracker"
#define TRACKER_KEY  "multiprocessing.tracker"

/* --- strategies ---------------------------------------------------------- */

static const char *const strategy_names[] = {
  "file_descriptor", "file_system", NULL
};

int mp_sharing_strategy(lua_State *L) {
  int s;
  lua_getfield(L, LUA_REGISTRYINDEX, STRATEGY_KEY);
  s = lua_isnil(L, -1) ? MP_SEG_FD : (int)lua_tointeger(L, -1);
  lua_pop(L, 1);
  return s;
}

void mp_set_sharing_strategy(lua_State *L, int kind) {
  lua_pushinteger(L, kind == MP_SEG_NAME ? MP_SEG_NAME : MP_SEG_FD);
  lua_setfield(L, LUA_REGISTRYINDEX, STRATEGY_KEY);
}

static int l_get_all_sharing_strategies(lua_State *L) {
  mp_checknoargs(L, 1);
  lua_createtable(L, 0, 2);
  lua_pushboolean(L, 1);
  lua_setfield(L, -2, "file_descriptor");
  lua_pushboolean(L, 1);
  lua_setfield(L, -2, "file_system");
  return 1;
}

static int l_get_sharing_strategy(lua_State *L) {
  mp_checknoargs(L, 1);
  lua_pushstring(L, mp_sharing_strategy(L) == MP_SEG_NAME
                        ? "file_system" : "file_descriptor");
  return 1;
}

static int l_set_sharing_strategy(lua_State *L) {
  const char *name = luaL_checkstring(L, 1);
  int i;
  for (i = 0; strategy_names[i]; i++)
    if (strcmp(strategy_names[i], name) == 0) break;
  if (!strategy_names[i])
    return luaL_argerror(L, 1, lua_pushfstring(L,
        "unknown sharing strategy '%s' (expected 'file_descriptor' or "
        "'file_system')", name));
  mp_set_sharing_strategy(L, i == 0 ? MP_SEG_FD : MP_SEG_NAME);
  return 0;
}

/* --- the tracker --------------------------------------------------------- */

#define TRACK_N 65536

typedef struct TrackEnt {
  uint32_t state;                 /* 0 free, 1 being written, 2 registered */
  char name[MP_SHM_NAMELEN];
} TrackEnt;

typedef struct TrackTable {
  uint32_t quit;                  /* the owner asks it to finish */
  uint32_t hint;
  uint64_t id;                    /* random: tells tables apart */
  TrackEnt ent[TRACK_N];
} TrackTable;

typedef struct Tracker {
  TrackTable *t;                  /* MAP_SHARED|MAP_ANONYMOUS: no fd */
  pid_t pid;                      /* the intermediate child (reaped) */
  pid_t owner;                    /* the process that started it */
} Tracker;

static void tracker_unlink(const char *name) {
  char path[MP_SHM_NAMELEN + 16];
  size_t n = strnlen(name, MP_SHM_NAMELEN - 1);
  if (n < 2 || name[0] != '/' || memchr(name + 1, '/', n - 1)) return;
  memcpy(path, "/dev/shm", 8);
  memcpy(path + 8, name, n);
  path[8 + n] = '\0';
  unlink(path);
}

/* Waits 0.1 s for 'pid' to exit (pidfd 'pfd', or -1: kill(0) polling);
** 1 when it has. */
static int exited(int pfd, pid_t pid) {
  struct timespec ts = {0, 100000000L};
  if (pfd >= 0) {
    struct pollfd p;
    p.fd = pfd;
    p.events = POLLIN;
    return poll(&p, 1, 100) > 0;
  }
  if (kill(pid, 0) < 0 && errno == ESRCH) return 1;
  nanosleep(&ts, NULL);
  return 0;
}

static int pidfd_of(pid_t pid) {
  return (int)syscall(SYS_pidfd_open, pid, 0);
}

/* Forgets the names that are gone (released by whoever held them last);
** returns how many are left. */
static size_t forget_gone(TrackTable *t) {
  char path[MP_SHM_NAMELEN + 16];
  size_t i, left = 0;
  for (i = 0; i < TRACK_N; i++) {
    TrackEnt *e = &t->ent[i];
    size_t n;
    if (__atomic_load_n(&e->state, __ATOMIC_ACQUIRE) != 2) continue;
    n = strnlen(e->name, MP_SHM_NAMELEN - 1);
    memcpy(path, "/dev/shm", 8);
    memcpy(path + 8, e->name, n);
    path[8 + n] = '\0';
    if (access(path, F_OK) != 0 && errno == ENOENT)
      __atomic_store_n(&e->state, 0, __ATOMIC_RELEASE);
    else
      left++;
  }
  return left;
}

/* The tracker: only system calls, so it is safe after fork() in a threaded
** host.  It watches its creator through a pidfd (poll) and checks the quit
** flag every 0.1 s; then it unlinks every registered name.  A worker's
** tracker ('job' is the worker's parent) outlives the worker as long as
** the job does and a name of the worker's is still there: a result or a
** message the worker left may still have to be opened by its receiver,
** whose reference keeps the name until it is released. */
static void tracker_main(TrackTable *t, pid_t creator, pid_t job)
    __attribute__((noreturn));
static void tracker_main(TrackTable *t, pid_t creator, pid_t job) {
  size_t i;
  int pfd = pidfd_of(creator);
  while (!__atomic_load_n(&t->quit, __ATOMIC_ACQUIRE) && !exited(pfd, creator))
    ;
  if (job > 0 && !__atomic_load_n(&t->quit, __ATOMIC_ACQUIRE)) {
    int jfd = pidfd_of(job);
    if (jfd >= 0 || errno != ESRCH)
      while (forget_gone(t) > 0 && !exited(jfd, job))
        ;
  }
  for (i = 0; i < TRACK_N; i++)
    if (__atomic_load_n(&t->ent[i].state, __ATOMIC_ACQUIRE) != 0) {
      t->ent[i].name[MP_SHM_NAMELEN - 1] = '\0';
      tracker_unlink(t->ent[i].name);
    }
  _exit(0);
}

/* The owner's lua_State is closing: the tracker cleans up and leaves. */
static int tracker_gc(lua_State *L) {
  Tracker *t = (Tracker *)luaL_checkudata(L, 1, TRACKER_T);
  if (t->t && t->owner == getpid())
    __atomic_store_n(&t->t->quit, 1, __ATOMIC_RELEASE);
  if (t->t) munmap(t->t, sizeof(TrackTable));
  t->t = NULL;
  return 0;
}

static int tracker_tostring(lua_State *L) {
  Tracker *t = (Tracker *)luaL_checkudata(L, 1, TRACKER_T);
  lua_pushfstring(L, "multiprocessing.Tracker (pid %d)", (int)t->pid);
  return 1;
}

static int random_bytes(void *p, size_t n) {
  size_t got = 0;
  while (got < n) {
    ssize_t k = getrandom((char *)p + got, n - got, 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    got += (size_t)k;
  }
  return 0;
}

/* The job of this worker (its identity table's, MP_WORKER_KEY), or 0 in
** a process that is not a worker. */
static pid_t worker_job(lua_State *L) {
  pid_t job = 0;
  if (lua_getfield(L, LUA_REGISTRYINDEX, MP_WORKER_KEY) == LUA_TTABLE) {
    lua_getfield(L, -1, "job");                               /* id job */
    job = (pid_t)lua_tointeger(L, -1);
    lua_pop(L, 1);                                            /* id */
  }
  lua_pop(L, 1);                                              /* */
  return job;
}

static Tracker *get_tracker(lua_State *L) {
  Tracker *t;
  pid_t parent = getpid(), pid, job = worker_job(L);
  siginfo_t si;
  void *m;
  if (lua_getfield(L, LUA_REGISTRYINDEX, TRACKER_KEY) == LUA_TUSERDATA) {
    t = (Tracker *)lua_touserdata(L, -1);                     /* tracker */
    lua_pop(L, 1);                                            /* */
    if (t->t) return t;
  } else {
    lua_pop(L, 1);                                            /* */
  }
  t = (Tracker *)lua_newuserdatauv(L, sizeof(Tracker), 0);    /* tracker */
  memset(t, 0, sizeof *t);
  luaL_setmetatable(L, TRACKER_T);
  m = mmap(NULL, sizeof(TrackTable), PROT_READ | PROT_WRITE,
           MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) {
    mp_push_errno(L, "cannot start the shared memory tracker (mmap)", errno);
    lua_error(L);
  }
  t->t = (TrackTable *)m;
  random_bytes(&t->t->id, sizeof t->t->id);
  pid = fork();
  if (pid < 0) {
    int e = errno;
    munmap(m, sizeof(TrackTable));
    t->t = NULL;
    mp_push_errno(L, "cannot start the shared memory tracker (fork)", e);
    lua_error(L);
  }
  if (pid == 0) {
    /* Its own session before the tracker exists, and we go on only when
    ** this child has exited: by then nothing that signals our process
    ** group (Ctrl-C at the terminal, a parent reaping a worker with
    ** killpg) can reach the tracker, which must outlive us to unlink. */
    pid_t gc;
    setsid();
    gc = fork();                    /* nobody's child to reap or to count */
    if (gc != 0) _exit(gc < 0);
    close_range(0, ~0U, 0);         /* it holds no pipe or socket open */
    tracker_main(t->t, parent, job);
  }
  if (mp_wait_child(pid, -1, &si, 0) != 0 || mp_exit_code(&si) != 0) {
    munmap(m, sizeof(TrackTable));
    t->t = NULL;
    luaL_error(L, "cannot start the shared memory tracker (fork failed)");
  }
  t->pid = pid;
  t->owner = parent;
  lua_setfield(L, LUA_REGISTRYINDEX, TRACKER_KEY);            /* */
  return t;
}

static int tracker_register(lua_State *L, mp_Seg *s) {
  Tracker *t = get_tracker(L);
  uint32_t i, start = __atomic_load_n(&t->t->hint, __ATOMIC_RELAXED);
  for (i = 0; i < TRACK_N; i++) {
    uint32_t k = (start + i) % TRACK_N, zero = 0;
    TrackEnt *e = &t->t->ent[k];
    if (__atomic_compare_exchange_n(&e->state, &zero, 1, 0, __ATOMIC_ACQ_REL,
                                    __ATOMIC_RELAXED)) {
      memcpy(e->name, s->name, MP_SHM_NAMELEN);
      __atomic_store_n(&e->state, 2, __ATOMIC_RELEASE);
      __atomic_store_n(&t->t->hint, k + 1, __ATOMIC_RELAXED);
      s->trkid = t->t->id;
      s->trkslot = k;
      return 0;
    }
  }
  return ENOSPC;
}

static void tracker_forget(lua_State *L, mp_Seg *s) {
  Tracker *t;
  TrackEnt *e;
  if (lua_getfield(L, LUA_REGISTRYINDEX, TRACKER_KEY) != LUA_TUSERDATA) {
    lua_pop(L, 1);
    return;
  }
  t = (Tracker *)lua_touserdata(L, -1);
  lua_pop(L, 1);
  if (!t->t || t->t->id != s->trkid || s->trkslot >= TRACK_N) return;
  e = &t->t->ent[s->trkslot];
  if (__atomic_load_n(&e->state, __ATOMIC_ACQUIRE) == 2 &&
      memcmp(e->name, s->name, MP_SHM_NAMELEN) == 0)
    __atomic_store_n(&e->state, 0, __ATOMIC_RELEASE);
}

/* --- segments ------------------------------------------------------------ */

static int random_name(char *buf) {
  unsigned char r[16];
  size_t i;
  static const char hex[] = "0123456789abcdef";
  int e = random_bytes(r, sizeof r);
  if (e) return e;
  memcpy(buf, "/lmp_", 5);
  for (i = 0; i < sizeof r; i++) {
    buf[5 + 2 * i] = hex[r[i] >> 4];
    buf[6 + 2 * i] = hex[r[i] & 15];
  }
  buf[5 + 2 * sizeof r] = '\0';
  return 0;
}

static int map_fd(mp_Seg *s, int fd, size_t size) {
  void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return errno;
  s->base = (unsigned char *)p;
  s->size = size;
  return 0;
}

static void seg_init(mp_Seg *s) {
  s->base = NULL;
  s->size = 0;
  s->fd = -1;
  s->kind = MP_SEG_PRIVATE;
  s->name[0] = '\0';
  s->trkid = 0;
  s->trkslot = UINT32_MAX;
}

void mp_seg_create(lua_State *L, mp_Seg *s, size_t size, int kind) {
  int fd, e;
  const char *what;
  seg_init(s);
  if (kind == MP_SEG_FD) {
    what = "memfd_create";
    fd = memfd_create("multiprocessing", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) goto fail;
    what = "ftruncate";
    if (ftruncate(fd, (off_t)size) < 0) goto failfd;
    what = "F_ADD_SEALS";
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
      goto failfd;
    what = "mmap";
    if ((e = map_fd(s, fd, size)) != 0) { errno = e; goto failfd; }
    s->fd = fd;
    s->kind = MP_SEG_FD;
    return;
  }
  what = "getrandom";
  if ((e = random_name(s->name)) != 0) { errno = e; goto fail; }
  /* registered before it exists: a crash right after leaves nothing */
  what = "shared memory tracker";
  if ((e = tracker_register(L, s)) != 0) { errno = e; goto fail; }
  what = "shm_open";
  fd = shm_open(s->name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) goto fail;
  what = "ftruncate";
  if (ftruncate(fd, (off_t)size) < 0) goto failname;
  what = "mmap";
  if ((e = map_fd(s, fd, size)) != 0) { errno = e; goto failname; }
  close(fd);
  s->kind = MP_SEG_NAME;
  return;
failname:
  e = errno;
  close(fd);
  shm_unlink(s->name);
  tracker_forget(L, s);
  errno = e;
  goto fail;
failfd:
  e = errno;
  close(fd);
  errno = e;
fail:
  e = errno;
  seg_init(s);
  mp_push_errno(L, lua_pushfstring(L, "cannot create shared memory (%s)",
                                   what), e);
  lua_error(L);
}

static int check_stat(lua_State *L, int fd, size_t size, struct stat *st) {
  if (fstat(fd, st) < 0) return mp_push_errno(L, "fstat", errno);
  if (!S_ISREG(st->st_mode) || st->st_size < 0 ||
      (size_t)st->st_size != size) {
    lua_pushfstring(L, "shared memory has size %I, expected %I",
                    (lua_Integer)st->st_size, (lua_Integer)size);
    return EINVAL;
  }
  return 0;
}

static int check_size(lua_State *L, int fd, size_t size) {
  struct stat st;
  return check_stat(L, fd, size, &st);
}

/* A memfd that could shrink would turn a later access into SIGBUS. */
static int check_sealed(lua_State *L, int fd) {
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & (F_SEAL_SHRINK | F_SEAL_GROW)) !=
                       (F_SEAL_SHRINK | F_SEAL_GROW)) {
    lua_pushliteral(L, "received shared memory is not sealed against "
                       "resizing");
    return EINVAL;
  }
  return 0;
}

int mp_seg_from_fd(lua_State *L, mp_Seg *s, int fd, size_t size, int sealed) {
  int e;
  seg_init(s);
  if ((e = check_size(L, fd, size)) != 0) goto fail;
  if (sealed && (e = check_sealed(L, fd)) != 0) goto fail;
  if ((e = map_fd(s, fd, size)) != 0) {
    mp_push_errno(L, "mmap", e);
    goto fail;
  }
  s->fd = fd;
  s->kind = MP_SEG_FD;
  return 0;
fail:
  close(fd);
  return e;
}

/* Maps the first 'size' bytes of the segment 'name', whose size must be
** exactly that, or when not 'exact' at least that. */
static int map_name(lua_State *L, mp_Seg *s, const char *name, size_t size,
                    int exact) {
  struct stat st;
  int fd, e;
  seg_init(s);
  if (name[0] != '/' || strlen(name) >= MP_SHM_NAMELEN || strchr(name + 1, '/')) {
    lua_pushliteral(L, "bad shared memory name");
    return EINVAL;
  }
  fd = shm_open(name, O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (fd < 0) {
    e = errno;
    mp_push_errno(L, lua_pushfstring(L, "cannot open shared memory '%s'%s",
                  name, e == ENOENT ? " (its last owner released it)" : ""),
                  e);
    return e;
  }
  if (exact)
    e = check_size(L, fd, size);
  else if (fstat(fd, &st) != 0)
    e = mp_push_errno(L, "fstat", errno);
  else if (st.st_size < 0 || (size_t)st.st_size < size)
    e = mp_push_errno(L, "shared memory too small", EINVAL);
  else
    e = 0;
  if (e == 0 && (e = map_fd(s, fd, size)) != 0)
    mp_push_errno(L, "mmap", e);
  close(fd);
  if (e == 0) {
    s->kind = MP_SEG_NAME;
    strcpy(s->name, name);
  }
  return e;
}

int mp_seg_from_name(lua_State *L, mp_Seg *s, const char *name, size_t size) {
  return map_name(L, s, name, size, 1);
}

int mp_seg_head_from_name(lua_State *L, mp_Seg *s, const char *name,
                          size_t size) {
  return map_name(L, s, name, size, 0);
}

void mp_seg_close(mp_Seg *s) {
  if (s->base) munmap(s->base, s->size);
  if (s->fd >= 0) close(s->fd);
  s->base = NULL;
  s->fd = -1;
}

void mp_seg_unlink(lua_State *L, mp_Seg *s) {
  if (s->kind != MP_SEG_NAME || !s->name[0]) return;
  shm_unlink(s->name);
  tracker_forget(L, s);
}

/* --- mappings shared by the Arrays of a lua_State ------------------------ */

#define MAP_T    "multiprocessing.Mapping"
#define MAPS_KEY "multiprocessing.mappings"  /* identity -> mp_Map, weak */
#define MAP_KEYLEN 48

/* Collected with its last Array; unmaps only when no open Array uses it:
** at lua_close the Arrays' finalizers may run after this one, and they
** still read the header (file_system references). */
static int map_gc(lua_State *L) {
  mp_Map *m = (mp_Map *)luaL_checkudata(L, 1, MAP_T);
  if (m->users == 0) mp_seg_close(&m->seg);
  return 0;
}

static mp_Map *new_map(lua_State *L) {
  mp_Map *m = (mp_Map *)lua_newuserdatauv(L, sizeof(mp_Map), 0);
  seg_init(&m->seg);
  m->users = 0;
  luaL_setmetatable(L, MAP_T);
  return m;
}

/* The same memfd reached through any descriptor: a live one's inode
** cannot be reused, and the mapping holds the descriptor open. */
static void fd_key(char *key, const struct stat *st) {
  snprintf(key, MAP_KEYLEN, "fd:%llx:%llx", (unsigned long long)st->st_dev,
           (unsigned long long)st->st_ino);
}

/* Pushes the cache: key -> mapping, weak in its values. */
static void push_cache(lua_State *L) {
  if (lua_getfield(L, LUA_REGISTRYINDEX, MAPS_KEY) == LUA_TTABLE)
    return;                                           /* cache */
  lua_pop(L, 1);                                      /* */
  lua_newtable(L);                                    /* cache */
  lua_createtable(L, 0, 1);                           /* cache mt */
  lua_pushliteral(L, "v");     /* a mapping goes with its last Array */
  lua_setfield(L, -2, "__mode");
  lua_setmetatable(L, -2);                            /* cache */
  lua_pushvalue(L, -1);                               /* cache cache */
  lua_setfield(L, LUA_REGISTRYINDEX, MAPS_KEY);       /* cache */
}

/* Pushes and returns the live mapping cached under 'key', or returns NULL
** and pushes nothing.  A closed one (its Arrays all closed, not yet
** collected) does not count. */
static mp_Map *find_map(lua_State *L, const char *key) {
  mp_Map *m;
  push_cache(L);                                      /* cache */
  lua_getfield(L, -1, key);                           /* cache m */
  m = (mp_Map *)luaL_testudata(L, -1, MAP_T);
  if (m && m->seg.base) {
    lua_remove(L, -2);                                /* m */
    return m;
  }
  lua_pop(L, 2);                                      /* */
  return NULL;
}

/* Caches the mapping at the top of the stack under 'key'. */
static void remember_map(lua_State *L, const char *key) {  /* m */
  push_cache(L);                                      /* m cache */
  lua_pushvalue(L, -2);                               /* m cache m */
  lua_setfield(L, -2, key);                           /* m cache */
  lua_pop(L, 1);                                      /* m */
}

/* A mapping found in the cache must still have the size expected: the
** elements beyond it would not be mapped. */
static void check_cached(lua_State *L, const mp_Map *m, size_t size) {
  if (m->seg.size != size)
    luaL_error(L, "shared memory has size %I, expected %I",
               (lua_Integer)m->seg.size, (lua_Integer)size);
}

mp_Map *mp_map_create(lua_State *L, size_t size, int kind) {
  int top = mp_stack_top(L);
  mp_Map *m = new_map(L);                             /* m */
  char key[MAP_KEYLEN];
  struct stat st;
  mp_seg_create(L, &m->seg, size, kind);
  if (kind == MP_SEG_NAME) {
    remember_map(L, m->seg.name);
  } else if (fstat(m->seg.fd, &st) == 0) {   /* else just not found later */
    fd_key(key, &st);
    remember_map(L, key);
  }
  mp_stack_check(L, top, 1);
  return m;
}

mp_Map *mp_map_from_fd(lua_State *L, int fd, size_t size) {
  int top = mp_stack_top(L);
  mp_Map *m = new_map(L), *hit;                       /* m */
  char key[MAP_KEYLEN];
  struct stat st;
  int e;
  m->seg.fd = fd;              /* closed with m from now on */
  if ((e = check_stat(L, fd, size, &st)) != 0) goto fail;
  fd_key(key, &st);
  /* a hit's seals were checked when it was mapped, and seals stay */
  if ((hit = find_map(L, key)) != NULL) {             /* m hit */
    mp_seg_close(&m->seg);     /* the duplicate descriptor, at once */
    lua_remove(L, -2);                                /* hit */
    check_cached(L, hit, size);
    mp_stack_check(L, top, 1);
    return hit;
  }
  if ((e = check_sealed(L, fd)) != 0) goto fail;
  if ((e = map_fd(&m->seg, fd, size)) != 0) {
    mp_push_errno(L, "mmap", e);
    goto fail;
  }
  m->seg.kind = MP_SEG_FD;
  remember_map(L, key);
  mp_stack_check(L, top, 1);
  return m;
fail:
  mp_seg_close(&m->seg);       /* now, not at the next collection */
  lua_error(L);
  return NULL;
}

mp_Map *mp_map_from_name(lua_State *L, const char *name, size_t size) {
  mp_Map *m;
  /* names are random and never reused: a live mapping of one is its
  ** memory, with no shm_open, fstat, mmap or munmap */
  if ((m = find_map(L, name)) != NULL) {              /* m */
    check_cached(L, m, size);
    return m;
  }
  m = new_map(L);                                     /* m */
  if (mp_seg_from_name(L, &m->seg, name, size) != 0) lua_error(L);
  remember_map(L, name);
  return m;
}

void mp_map_use(mp_Map *m) {
  m->users++;
}

void mp_map_release(mp_Map *m) {
  if (m->users > 0 && --m->users == 0) mp_seg_close(&m->seg);
}

/* --- registration -------------------------------------------------------- */

void mp_open_shm(lua_State *L) {
  static const luaL_Reg funcs[] = {
    {"get_all_sharing_strategies", l_get_all_sharing_strategies},
    {"get_sharing_strategy", l_get_sharing_strategy},
    {"set_sharing_strategy", l_set_sharing_strategy},
    {NULL, NULL}
  };
  static const luaL_Reg tracker_meta[] = {
    {"__gc", tracker_gc}, {"__close", tracker_gc},
    {"__tostring", tracker_tostring}, {NULL, NULL}
  };
  static const luaL_Reg map_meta[] = {{"__gc", map_gc}, {NULL, NULL}};
  mp_new_class(L, TRACKER_T, tracker_meta, NULL);     /* M tracker_mt */
  mp_new_class(L, MAP_T, map_meta, NULL);             /* M tracker_mt map_mt */
  lua_pop(L, 2);                                      /* M */
  luaL_setfuncs(L, funcs, 0);
}
