/*
** time_cmd.c -- wall time of a command, start to exit, for the rows that
** time whole programs (mprun, torchrun, and their floors).
**
**   time_cmd NAME REPS PAR OUT prog [args...]
** Each repetition truncates OUT, starts PAR copies of prog at once (copy i
** with RANK=i in its environment, stdout appended to OUT, stderr to
** /dev/null) and waits for all; a copy that fails ends the run.  Prints
** {"bench":NAME,"samples":[ms,...]} after one warm-up.
*/
#define _GNU_SOURCE
#include <fcntl.h>
#include <spawn.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

extern char **environ;

/* environ with RANK=rank first */
static char **with_rank(int rank) {
  static char var[32];
  static char **env;
  size_t n = 0, i;
  while (environ[n] != NULL) n++;
  if (env == NULL) env = malloc(sizeof(char *) * (n + 2));
  snprintf(var, sizeof var, "RANK=%d", rank);
  env[0] = var;
  for (i = 0; i < n; i++) env[i + 1] = environ[i];
  env[n + 1] = NULL;
  return env;
}

static double once(int par, const char *out, char **av) {
  pid_t *pids = malloc(sizeof(pid_t) * (size_t)par);
  posix_spawn_file_actions_t fa;
  double t0;
  int i, fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) { perror(out); exit(1); }
  close(fd);
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out, O_WRONLY | O_APPEND, 0644);
  posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
  t0 = now_s();
  for (i = 0; i < par; i++) {
    int e = posix_spawnp(&pids[i], av[0], &fa, NULL, av, with_rank(i));
    if (e != 0) { fprintf(stderr, "posix_spawnp %s: %s\n", av[0], strerror(e)); exit(1); }
  }
  for (i = 0; i < par; i++) {
    int st;
    while (waitpid(pids[i], &st, 0) < 0) {}
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "%s failed (status %d)\n", av[0], st);
      exit(1);
    }
  }
  t0 = (now_s() - t0) * 1e3;
  posix_spawn_file_actions_destroy(&fa);
  free(pids);
  return t0;
}

int main(int argc, char **argv) {
  int reps, par, r;
  double *s;
  if (argc < 6) {
    fprintf(stderr, "usage: time_cmd NAME REPS PAR OUT prog [args...]\n");
    return 2;
  }
  reps = atoi(argv[2]);
  par = atoi(argv[3]);
  s = malloc(sizeof(double) * (size_t)reps);
  once(par, argv[4], argv + 5);   /* warm-up (page cache) */
  for (r = 0; r < reps; r++) s[r] = once(par, argv[4], argv + 5);
  printf("{\"bench\":\"%s\",", argv[1]);
  print_samples(s, reps);
  free(s);
  return 0;
}
