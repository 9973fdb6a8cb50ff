/*
** thread_host.c -- a host that starts workers from a short-lived thread:
** the chunk argv[1] runs on a thread that then exits, and the chunk argv[2]
** on the main thread afterwards, in the same lua_State.  The workers belong
** to the process, not to the thread that started them.
*/
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "lauxlib.h"
#include "lua.h"
#include "lualib.h"

typedef struct Job {
  lua_State *L;
  const char *chunk, *name;
  int failed;
} Job;

static void *run(void *arg) {
  Job *job = arg;
  if (luaL_loadbuffer(job->L, job->chunk, strlen(job->chunk), job->name) != LUA_OK
      || lua_pcall(job->L, 0, 0, 0) != LUA_OK) {
    printf("%s: error: %s\n", job->name, luaL_tolstring(job->L, -1, NULL));
    job->failed = 1;
  }
  return NULL;
}

int main(int argc, char **argv) {
  pthread_t t;
  Job job;
  if (argc != 3) return 2;
  job.L = luaL_newstate();
  luaL_openlibs(job.L);
  job.chunk = argv[1];
  job.name = "thread";
  job.failed = 0;
  pthread_create(&t, NULL, run, &job);
  pthread_join(t, NULL);            /* the starting thread is gone */
  if (!job.failed) {
    job.chunk = argv[2];
    job.name = "main";
    run(&job);
  }
  lua_close(job.L);
  fflush(stdout);
  return job.failed;
}
