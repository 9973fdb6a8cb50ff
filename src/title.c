/*
** title.c -- what ps, pgrep -f and top show for a process: its command
** line (the argv area the kernel reads /proc/PID/cmdline from) and its
** thread name (PR_SET_NAME, 15 bytes).
**
** The argv strings are rewritten in place, as setproctitle(3) does: the
** kernel says where they are (/proc/self/stat, arg_start..arg_end), and a
** title longer than them runs on into the environment strings that follow,
** once those are copied to the heap (environ then points at the copies).
** The kernel reads such a line up to its first NUL when the last byte of
** the argv area is not a NUL, so a title is written, then a NUL, and that
** last byte is made a space: ps shows the title, not the old arguments
** after it.
**
** Where the area is, is learnt once per state and kept in the registry: a
** parent learns it before it forks, and moves its environment strings to
** the heap then, once, so a forked worker sets its title with no system
** call but PR_SET_NAME and no copy of its own (each would fault in a page
** of the parent's memory, in every worker).
*/
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "mp.h"

#define AREA_KEY "multiprocessing.title_area"

typedef struct Area {
  char *arg_start, *arg_end;   /* NULL when /proc could not tell */
  char *env_start, *env_end;
  int env_free;                /* no environment string is left there */
} Area;

/* Fields 48..51 of /proc/self/stat (after the ')' that ends the command
** name, which may hold spaces, the fields count from 3).  Read without
** stdio and scanf: a fresh worker would fault in their code and a buffer
** for this alone (sys.h). */
static void find_area(Area *a) {
  char buf[1024];
  const char *p;
  unsigned long long v[4];
  ssize_t n;
  int field, fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
  memset(a, 0, sizeof *a);
  if (fd < 0) return;
  n = read(fd, buf, sizeof buf - 1);
  close(fd);
  if (n <= 0) return;
  buf[n] = '\0';
  p = strrchr(buf, ')');
  for (field = 2; field < 48 && p != NULL; field++) p = strchr(p + 1, ' ');
  for (field = 0; field < 4 && p != NULL; field++)
    if (*p++ != ' ' || !mp_read_uint(&p, &v[field])) p = NULL;
  if (p == NULL || v[1] <= v[0] || v[3] < v[2]) return;
  a->arg_start = (char *)(uintptr_t)v[0];
  a->arg_end = (char *)(uintptr_t)v[1];
  a->env_start = (char *)(uintptr_t)v[2];
  a->env_end = (char *)(uintptr_t)v[3];
}

static Area *get_area(lua_State *L) {
  Area *a;
  if (lua_getfield(L, LUA_REGISTRYINDEX, AREA_KEY) == LUA_TUSERDATA) {
    a = lua_touserdata(L, -1);
    lua_pop(L, 1);
    return a;
  }
  lua_pop(L, 1);
  a = lua_newuserdatauv(L, sizeof *a, 0);
  find_area(a);
  lua_setfield(L, LUA_REGISTRYINDEX, AREA_KEY);
  return a;
}

/* The environment strings move to the heap, so that the title may use
** their room; 1 when they did (or none was left there). */
static int free_environment(const Area *a) {
  size_t i;
  for (i = 0; environ != NULL && environ[i] != NULL; i++) {
    char *s = environ[i];
    if (s >= a->env_start && s < a->env_end) {
      char *copy = strdup(s);
      if (copy == NULL) return 0;
      environ[i] = copy;
    }
  }
  return 1;
}

/* Makes the room after the argv strings free for titles: 1 when it is. */
static int free_room(Area *a) {
  if (!a->env_free && a->env_start == a->arg_end &&
      a->env_end > a->env_start)
    a->env_free = free_environment(a);
  return a->env_free;
}

void mp_title_prepare(lua_State *L) {
  free_room(get_area(L));
}

void mp_title_set(lua_State *L, const char *text, size_t len) {
  Area *a = get_area(L);
  char name[16];
  size_t argsize, room, n;
  n = len < sizeof name - 1 ? len : sizeof name - 1;
  memcpy(name, text, n);
  name[n] = '\0';
  prctl(PR_SET_NAME, name, 0, 0, 0);
  if (a->arg_start == NULL) return;
  argsize = (size_t)(a->arg_end - a->arg_start);
  room = argsize;
  if (len + 2 > argsize && free_room(a))
    room = (size_t)(a->env_end - a->arg_start);
  n = len < room - 1 ? len : room - 1;
  memcpy(a->arg_start, text, n);
  memset(a->arg_start + n, 0, room - n);
  if (n + 1 < argsize) a->arg_end[-1] = ' ';
}

/* _set_title(text): this process's command line as ps shows it, and its
** thread name (the first 15 bytes). */
static int l_set_title(lua_State *L) {
  size_t len;
  const char *text = mp_checklstring(L, 1, &len);
  mp_title_set(L, text, len);
  return 0;
}

void mp_open_title(lua_State *L) {
  lua_pushcfunction(L, l_set_title);
  lua_setfield(L, -2, "_set_title");
}
