/*
** sys.h -- system helpers that need no Lua and no context (sys.c): the
** clock, whole writes, marks (a shared word a process sets once), text
** without printf, the heap populated ahead or settled before a fork, which
** process we are, and the file of a module.
** Compiled into the core and into the launcher module alike, so neither
** keeps a copy of its own.
*/
#ifndef mp_sys_h
#define mp_sys_h

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

double mp_now(void);                               /* CLOCK_MONOTONIC seconds */
int    mp_write_all(int fd, const char *p, size_t n);  /* 0 or errno */

/* Text made without the printf family (nor scanf): in a fork, their
** machinery is some ten pages of libc's code and tables the child has not
** touched yet, each a page fault (20-60 us on a VM) to write or read a
** number.  The appenders append what fits before 'end' and return where
** the text goes on; mp_read_uint reads the decimal digits at *p (at least
** one), moves *p past them and returns 1, or returns 0. */
char  *mp_add_text(char *p, const char *end, const char *s);
char  *mp_add_int(char *p, const char *end, long v);
int    mp_read_uint(const char **p, unsigned long long *v);

/* A fresh worker writes to most of the heap malloc has taken from the
** system (sbrk) before it is done: one madvise(MADV_POPULATE_WRITE) makes
** those pages at ~3 us each, where each first write would be a page fault
** (11-15 us on this VM, 2-3x that beside other starting workers).  Only
** in a process of ours (a worker being booted, core.c), only for a heap
** of at most HEAP_PREFAULT_MAX bytes; a kernel before 5.14 says EINVAL,
** and the pages fault as before. */
#define HEAP_PREFAULT_MAX (1024 * 1024)
void   mp_prefault_heap(void);

/* Before forking children: glibc keeps small freed chunks on its "fast"
** lists, and the first request of a larger size that finds any merges
** them all (malloc_consolidate), writing beside each one.  In a fork child
** each such page of the parent's heap is a copy-on-write fault: a Pool
** worker, whose Lua stack grows past its first 40 slots, took 110-220 of
** them in one start of its pool out of twenty.  One such request here, in
** the parent, merges them once for all the children (and for the parent's
** own next large request, which would copy the pages the children share).
** Any other malloc: a request and a free. */
#define HEAP_SETTLE_BYTES 4096   /* past glibc's tcache (1032), below mmap */
void   mp_settle_heap(void);

/* Which process we are, without a system call per question: getpid is
** one (about 1 us on a VM, where a Queue round trip took 4 of them, half
** its time).  A page of our own that the kernel gives a fork's child
** zeroed (MADV_WIPEONFORK, Linux 4.14) remembers the pid: a getpid the
** first time in each process, a load after.  mp_self_new gives NULL where
** the page cannot be had; mp_self_pid(NULL) is getpid(). */
typedef struct mp_Self { pid_t pid; } mp_Self;
mp_Self *mp_self_new(void);
void     mp_self_free(mp_Self *s);
pid_t    mp_self_pid(mp_Self *s);

/* The absolute path of the loaded file (a module) that holds the code at
** 'code', as realpath gives it (the caller frees it), or NULL; *name is
** the path the dynamic linker loaded that file by, or NULL when it knows
** none. */
char  *mp_file_of(const void *code, const char **name);

/* A mark: one word of shared memory that a process sets to 1, through a
** mapping when it has one ('word'), else with pwrite at 'at' in 'fd' (a
** report memfd's table of marks, reports.c).  Setting is
** async-signal-safe. */
typedef struct mp_Mark { uint32_t *word; int fd; off_t at; } mp_Mark;
void   mp_mark_set(const mp_Mark *m);

#endif
