/*
** floor_pipe.c -- the floor for messages between two processes over pipes.
**
**   floor_pipe REPS ROUNDTRIPS MIB_PER_REP
** pingpong: parent writes a 24-byte message (one write), the child reads it
**   and writes it back on a second pipe; ROUNDTRIPS per repetition.
**   {"bench":"floor_pipe_pingpong","cpu":[parent CPU us per round trip,...],
**    "samples":[round trips per second,...]}
** bulk: parent writes MIB_PER_REP messages of 1 MiB one way (one write call
**   per message; the kernel splits it), the child reads each whole, then
**   acknowledges with one byte.
**   {"bench":"floor_pipe_mib","samples":[MB/s,...]}   (MB = 10^6 bytes)
*/
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#include "common.h"

#define SMALL 24

static double cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}
#define MIB (1024 * 1024)

static void wr(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t k = write(fd, p, n);
    if (k < 0) { if (errno == EINTR) continue; perror("write"); exit(1); }
    p += k; n -= (size_t)k;
  }
}

static int rd(int fd, char *p, size_t n) {   /* 0 on EOF */
  while (n > 0) {
    ssize_t k = read(fd, p, n);
    if (k < 0) { if (errno == EINTR) continue; perror("read"); exit(1); }
    if (k == 0) return 0;
    p += k; n -= (size_t)k;
  }
  return 1;
}

int main(int argc, char **argv) {
  int reps = arg_int(argc, argv, 1, 5);
  int rts = arg_int(argc, argv, 2, 20000);
  int mibs = arg_int(argc, argv, 3, 200);
  int down[2], up[2], r, i, st;
  char msg[SMALL], back[SMALL];
  char *big = malloc(MIB);
  double *s = malloc(sizeof(double) * (size_t)reps);
  double *cpu = malloc(sizeof(double) * (size_t)reps);
  pid_t pid;

  memset(big, 'x', MIB);
  memset(msg, 'm', SMALL);
  /* ---- ping-pong ---- */
  if (pipe(down) || pipe(up)) { perror("pipe"); return 1; }
  pid = fork();
  if (pid == 0) {
    close(down[1]); close(up[0]);
    while (rd(down[0], back, SMALL)) wr(up[1], back, SMALL);
    _exit(0);
  }
  close(down[0]); close(up[1]);
  for (i = 0; i < 1000; i++) { wr(down[1], msg, SMALL); rd(up[0], back, SMALL); }
  for (r = 0; r < reps; r++) {
    double t0 = now_s(), c0 = cpu_s();
    for (i = 0; i < rts; i++) { wr(down[1], msg, SMALL); rd(up[0], back, SMALL); }
    s[r] = rts / (now_s() - t0);
    cpu[r] = (cpu_s() - c0) * 1e6 / rts;
  }
  close(down[1]); close(up[0]);
  waitpid(pid, &st, 0);
  printf("{\"bench\":\"floor_pipe_pingpong\",\"bytes\":%d,\"cpu\":[", SMALL);
  for (r = 0; r < reps; r++) printf("%s%.6f", r ? "," : "", cpu[r]);
  printf("],");
  print_samples(s, reps);

  /* ---- 1 MiB one way ---- */
  if (pipe(down) || pipe(up)) { perror("pipe"); return 1; }
  pid = fork();
  if (pid == 0) {
    char *buf = malloc(MIB);
    int k;
    close(down[1]); close(up[0]);
    for (;;) {
      char cnt[4];
      int n;
      if (!rd(down[0], cnt, 4)) break;
      memcpy(&n, cnt, 4);
      for (k = 0; k < n; k++) rd(down[0], buf, MIB);
      wr(up[1], "k", 1);
    }
    _exit(0);
  }
  close(down[0]); close(up[1]);
  for (r = -1; r < reps; r++) {            /* r = -1: warm-up */
    char ack;
    double t0 = now_s();
    wr(down[1], (const char *)&mibs, 4);
    for (i = 0; i < mibs; i++) wr(down[1], big, MIB);
    rd(up[0], &ack, 1);
    if (r >= 0) s[r] = (double)mibs * MIB / 1e6 / (now_s() - t0);
  }
  close(down[1]); close(up[0]);
  waitpid(pid, &st, 0);
  printf("{\"bench\":\"floor_pipe_mib\",");
  print_samples(s, reps);
  free(big); free(s); free(cpu);
  return 0;
}
