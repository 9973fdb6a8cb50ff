/*
** worker_main.c -- the worker executable, for embedding hosts whose own
** executable does not run workers (mp.set_executable, executable.c).
**
** A minimal lua.c: `worker -e chunk [-e chunk ...]` runs each chunk in a
** fresh state with the standard libraries, as `lua5.4 -e chunk` would;
** exit status 0, or 1 after printing the error and its traceback.  The
** worker protocol's command line is one such call (multiprocessing.h); the
** core itself is loaded by the chunk (the program links only liblua).
*/
#include <stdio.h>

#include "multiprocessing.h"

int main(int argc, char **argv) {
  if (lmp_worker_main(argc, argv, NULL)) return lmp_worker_status();
  if (argc < 3) {
    fprintf(stderr, "usage: %s -e chunk [-e chunk ...]\n",
            argc > 0 ? argv[0] : "worker");
    return 1;
  }
  return lmp_run_chunks(argc, argv, NULL);
}
