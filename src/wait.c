/*
** wait.c -- the one way multiprocessing.core waits for another process:
** deadlines, futex sleeps, EINTR, Ctrl-C, wake-up accounting, robust
** process-shared mutexes, and the statuses every wait ends with.
**
** A wait (mp_Wait) is started with a timeout and sleeps in slices of at
** most MP_SLICE seconds, each computed again from one absolute deadline on
** CLOCK_MONOTONIC: a signal (EINTR) only ends a slice early and a storm of
** them changes nothing.  Between slices it checks for Ctrl-C.
**
** Ctrl-C.  lua.c's SIGINT handler (laction) does nothing but set a hook,
** lstop, on the main thread; lstop resets the hook to none and raises
** "interrupted!" at the next instruction.  A C function blocked in a wait
** never runs an instruction, so the wait watches the hooks instead: a hook
** that differs from the one the wait started with (on the running thread or
** on the main one) means an interrupt.  The wait then takes it as lstop
** would -- it puts the hooks back as they were when it started, so that
** lstop does not raise a second time after a pcall caught the first -- and
** ends with MP_INTERRUPT, which its caller raises as an mp.Interrupted
** ("interrupted: SIGINT during Type.method; <what became of it>",
** mp_raise_interrupt).  A host that sets hooks for other reasons sees its own
** change undone only if it happens during a wait: hosts signal through
** their own hooks, and the same rule serves them.
**
** Waiting for a condition (mp_wait_for): the waker changes shared state,
** then bumps a futex word (mp_wake); the waiter samples the word, tests the
** condition, and sleeps only while the word is unchanged.  Who waits is
** counted, so that a wake with no sleeper costs no system call, and how
** many are woken is the waker's choice (a semaphore's release(n) wakes n,
** not all).  A short spin before the first sleep keeps the hand-over
** between two busy processes (a queue's reader and writer) off the futex.
*/
#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mp.h"
#include "sharing.h"

/* --- statuses ------------------------------------------------------------ */

const char *mp_status_string(int st) {
  switch (st) {
    case MP_OK: return "success";
    case MP_TIMEOUT: return "timed out";
    case MP_INTERRUPT: return "interrupted";
    case MP_PEERGONE: return "no other process is using it any more";
    case MP_OWNERDEAD: return "previous owner died";
    case MP_BROKEN: return "the barrier is broken";
    default: return strerror(st);
  }
}

int mp_status_error(lua_State *L, const char *what, int st) {
  if (st == MP_INTERRUPT)      /* a caller that did not say what it left */
    return mp_raise_interrupt(L, what, "nothing was done");
  return luaL_error(L, "%s: %s", what, mp_status_string(st));
}

/* --- deadlines and interrupts -------------------------------------------- */

static void hooks_save(mp_Hooks *h, lua_State *L) {
  h->L = L;
  h->hook = lua_gethook(L);
  h->mask = lua_gethookmask(L);
  h->count = lua_gethookcount(L);
}

/* 1 when the hooks of h->L changed since hooks_save; they are put back. */
static int hooks_take(mp_Hooks *h) {
  if (h->L == NULL) return 0;
  if (lua_gethook(h->L) == h->hook && lua_gethookmask(h->L) == h->mask)
    return 0;
  lua_sethook(h->L, h->hook, h->mask, h->count);
  return 1;
}

void mp_wait_init(mp_Wait *w, lua_State *L, double timeout) {
  memset(w, 0, sizeof *w);
  if (L != NULL) {
    lua_State *main;
    hooks_save(&w->self, L);
    lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);  /* ... main */
    main = lua_tothread(L, -1);
    lua_pop(L, 1);                                          /* ... */
    if (main != NULL && main != L) hooks_save(&w->main, main);
  }
  w->started = w->lastcheck = mp_now();
  w->deadline = timeout < 0 ? -1.0 : w->started + timeout;
  w->spins = MP_SPINS;
}

double mp_wait_slice(mp_Wait *w) {
  double left;
  if (w->deadline < 0) return MP_SLICE;
  left = w->deadline - mp_now();
  if (left <= 0) return 0;
  return left < MP_SLICE ? left : MP_SLICE;
}

int mp_wait_interrupted(mp_Wait *w) {
  int self = hooks_take(&w->self);
  int main = hooks_take(&w->main);
  return self || main;
}

/* --- futex --------------------------------------------------------------- */

static struct timespec reltime(double secs) {
  struct timespec ts;
  if (secs < 0) secs = 0;
  ts.tv_sec = (time_t)secs;
  ts.tv_nsec = (long)((secs - (double)ts.tv_sec) * 1e9);
  if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
  return ts;
}

int mp_futex_wait(uint32_t *addr, uint32_t val, double secs) {
  struct timespec ts = reltime(secs);
  long r = syscall(SYS_futex, addr, FUTEX_WAIT, val, &ts, NULL, 0);
  if (r == 0) return 0;
  if (errno == EAGAIN) return 0;
  return errno;
}

void mp_futex_wake(uint32_t *addr, int n) {
  syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

static void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ __volatile__("pause");
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

void mp_wake(uint32_t *word, uint32_t *waiters, int n) {
  __atomic_add_fetch(word, 1, __ATOMIC_SEQ_CST);
  if (waiters == NULL || __atomic_load_n(waiters, __ATOMIC_SEQ_CST))
    mp_futex_wake(word, n);
}

int mp_wait_for(mp_Wait *w, const mp_Waitable *on) {
  int spins = 0;
  for (;;) {
    uint32_t seq = __atomic_load_n(on->word, __ATOMIC_SEQ_CST);
    double sl;
    if (on->ready(on->arg)) return MP_OK;
    if (spins < w->spins) {
      spins++;
      cpu_relax();
      continue;
    }
    if ((sl = mp_wait_slice(w)) <= 0) return MP_TIMEOUT;
    /* a waker that read no sleeper bumped the word before we counted
       ourselves: the futex then sees it changed and returns at once */
    if (on->waiters) __atomic_add_fetch(on->waiters, 1, __ATOMIC_SEQ_CST);
    mp_futex_wait(on->word, seq, sl);
    if (on->waiters) __atomic_sub_fetch(on->waiters, 1, __ATOMIC_SEQ_CST);
    if (on->check) {
      double now = mp_now();
      if (now - w->lastcheck >= MP_SLICE) {
        int st;
        w->lastcheck = now;
        if ((st = on->check(on->arg)) != MP_OK) return st;
      }
    }
    if (mp_wait_interrupted(w)) return MP_INTERRUPT;
  }
}

/* --- robust mutexes ------------------------------------------------------ */

int mp_mutex_init(pthread_mutex_t *m, int recursive) {
  pthread_mutexattr_t a;
  int e;
  if ((e = pthread_mutexattr_init(&a)) != 0) return e;
  pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  pthread_mutexattr_settype(&a, recursive ? PTHREAD_MUTEX_RECURSIVE
                                          : PTHREAD_MUTEX_ERRORCHECK);
  e = pthread_mutex_init(m, &a);
  pthread_mutexattr_destroy(&a);
  return e;
}

int mp_mutex_lock(pthread_mutex_t *m, mp_Wait *w) {
  for (;;) {
    double s = mp_wait_slice(w);
    int e;
    if (s <= 0) {
      e = pthread_mutex_trylock(m);
      if (e == EBUSY) return MP_TIMEOUT;
    } else {
      struct timespec now, abs;
      clock_gettime(CLOCK_MONOTONIC, &now);
      abs = reltime(s);
      abs.tv_sec += now.tv_sec;
      abs.tv_nsec += now.tv_nsec;
      if (abs.tv_nsec >= 1000000000L) { abs.tv_sec++; abs.tv_nsec -= 1000000000L; }
      e = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &abs);
    }
    if (e == 0) return MP_OK;
    if (e == EOWNERDEAD) {
      pthread_mutex_consistent(m);
      return MP_OWNERDEAD;
    }
    if (e != ETIMEDOUT && e != EINTR) return e;
    if (mp_wait_interrupted(w)) return MP_INTERRUPT;
  }
}
