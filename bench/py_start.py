"""Python peer for start+join of N trivial workers (issues 2 and 3).

    python3 bench/py_start.py METHOD REPS N [N...]

Per N, one JSON line {"bench":"py_start","method":M,"n":N,"samples":[ms,...]}:
Process(target=trivial) start for all N, then join all N, timed in the parent
with time.perf_counter (CLOCK_MONOTONIC), after one untimed warm-up call (for
forkserver: the server is already running when timing starts).
"""
import json
import multiprocessing as mp
import sys
import time


def trivial():
    pass


def once(ctx, n):
    t0 = time.perf_counter()
    ps = [ctx.Process(target=trivial) for _ in range(n)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    dt = (time.perf_counter() - t0) * 1e3
    for p in ps:
        if p.exitcode != 0:
            raise SystemExit("worker failed: %r" % p.exitcode)
    return dt


def main():
    method, reps = sys.argv[1], int(sys.argv[2])
    ctx = mp.get_context(method)
    for n in map(int, sys.argv[3:]):
        once(ctx, min(n, 2))  # warm-up; starts the forkserver
        samples = [once(ctx, n) for _ in range(reps)]
        print(json.dumps({"bench": "py_start", "method": method, "n": n,
                          "samples": samples}), flush=True)


if __name__ == "__main__":
    main()
