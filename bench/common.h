/*
** common.h -- shared by the C floor programs of the benchmark suite.
** Each floor prints JSON lines: {"bench":..., ..., "samples":[...]} with one
** sample per repetition (milliseconds, or a rate); bench/run.lua takes the
** median.  CLOCK_MONOTONIC throughout.
*/
#ifndef bench_common_h
#define bench_common_h

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void print_samples(const double *s, int n) {
  int i;
  printf("\"samples\":[");
  for (i = 0; i < n; i++) printf("%s%.6f", i ? "," : "", s[i]);
  printf("]}\n");
  fflush(stdout);
}

static int arg_int(int argc, char **argv, int i, int dflt) {
  return i < argc ? atoi(argv[i]) : dflt;
}

#endif
