"""Python peer for the failure latency (issue 2): 8 fork workers, worker 3
raises while the others sleep (time.sleep, blocking), and a hand-written wait
loop like torch's ProcessContext.join: multiprocessing.connection.wait on the
sentinels, join the one that ended, on a non-zero exit terminate (SIGTERM)
the live ones, join all, read the failed worker's error file and raise.

    python3 bench/py_fail.py REPS

{"bench":"py_fail","samples":[ms until the parent holds the exception and
every worker is reaped,...],"start":[ms for starting the 8,...]}
"""
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import sys
import tempfile
import time
import traceback

NPROCS, FAILING = 8, 3


class ProcessRaisedException(Exception):
    pass


def wrap(i, error_file):
    # like torch's _wrap: the exception goes to a per-worker file, exit 1
    try:
        if i == FAILING:
            raise RuntimeError("boom")
        time.sleep(30)
    except Exception:
        with open(error_file, "w") as f:
            f.write(traceback.format_exc())
        sys.exit(1)


def join(procs, error_files):
    sentinels = {p.sentinel: i for i, p in enumerate(procs)}
    while sentinels:
        ready = mp.connection.wait(list(sentinels.keys()))
        error_index = None
        for s in ready:
            i = sentinels.pop(s)
            procs[i].join()
            if procs[i].exitcode != 0:
                error_index = i
                break
        if error_index is None:
            continue
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
        with open(error_files[error_index]) as f:
            msg = f.read()
        raise ProcessRaisedException(msg)


def once(ctx):
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="pybench")
    error_files = [os.path.join(tmp, "err%d" % i) for i in range(NPROCS)]
    procs = [ctx.Process(target=wrap, args=(i, error_files[i]))
             for i in range(NPROCS)]
    for p in procs:
        p.start()
    t1 = time.perf_counter()
    try:
        join(procs, error_files)
    except ProcessRaisedException as e:
        t2 = time.perf_counter()
        assert "boom" in str(e)
    else:
        raise SystemExit("no exception")
    for p in procs:
        assert p.exitcode is not None
    shutil.rmtree(tmp)
    return (t2 - t0) * 1e3, (t1 - t0) * 1e3


def main():
    reps = int(sys.argv[1])
    ctx = mp.get_context("fork")
    once(ctx)  # warm-up
    res = [once(ctx) for _ in range(reps)]
    print(json.dumps({"bench": "py_fail", "samples": [r[0] for r in res],
                      "start": [r[1] for r in res]}), flush=True)


if __name__ == "__main__":
    main()
