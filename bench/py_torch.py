"""torch peer: torch.multiprocessing.start_processes, the API ours follows.

    python3 bench/py_torch.py start METHOD REPS N
    python3 bench/py_torch.py fail REPS

start: start_processes(trivial, nprocs=N, join=True, start_method=METHOD)
timed whole, after one untimed warm-up call; one JSON line
{"bench":"torch_start","method":M,"n":N,"samples":[ms,...]}.

fail: 8 fork workers, rank 3 raises at once, the others sleep 30 s (as
bench/lua_fail.lua and bench/py_fail.py); timed from the call until
start_processes raises ProcessRaisedException, which torch does once it
has terminated and joined the others; one JSON line
{"bench":"torch_fail","samples":[ms,...]}.

Needs a Python that imports torch (Debian: python3-torch, for
/usr/bin/python3); bench/run.lua finds one and skips these rows, saying why,
when there is none.
"""
import json
import sys
import time

import torch.multiprocessing as tmp

NPROCS, FAILING = 8, 3


def trivial(i):
    pass


def fails_or_sleeps(i):
    if i == FAILING:
        raise ValueError("boom")
    time.sleep(30)


def start(method, n):
    t0 = time.perf_counter()
    tmp.start_processes(trivial, nprocs=n, join=True, start_method=method)
    return (time.perf_counter() - t0) * 1e3


def fail():
    t0 = time.perf_counter()
    try:
        tmp.start_processes(fails_or_sleeps, nprocs=NPROCS, join=True,
                            start_method="fork")
    except tmp.ProcessRaisedException as e:
        if "boom" not in str(e):
            raise SystemExit("unexpected exception: %s" % e)
        return (time.perf_counter() - t0) * 1e3
    raise SystemExit("start_processes returned without raising")


def main():
    what, rest = sys.argv[1], sys.argv[2:]
    if what == "start":
        method, reps, n = rest[0], int(rest[1]), int(rest[2])
        start(method, min(n, 2))  # warm-up
        samples = [start(method, n) for _ in range(reps)]
        print(json.dumps({"bench": "torch_start", "method": method, "n": n,
                          "samples": samples}), flush=True)
    elif what == "fail":
        reps = int(rest[0])
        fail()  # warm-up
        samples = [fail() for _ in range(reps)]
        print(json.dumps({"bench": "torch_fail", "samples": samples}),
              flush=True)
    else:
        raise SystemExit("usage: py_torch.py start METHOD REPS N | fail REPS")


if __name__ == "__main__":
    main()
