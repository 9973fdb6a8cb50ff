"""Python peer of bench/lua_pool.lua: multiprocessing.Pool(4).

    python3 bench/py_pool.py METHOD REPS MAPN APPLYN [MAXN]

JSON lines, one sample per repetition:
  py_pool_map1: tasks/s of pool.map(f, range(MAPN), chunksize=1)
  py_pool_mapdef: tasks/s of pool.map(f, range(MAPN)) (default chunking)
  py_pool_unord: tasks/s of pool.imap_unordered(f, range(MAPN), c), c what
    map's default chunking takes (MAPN / 16, rounded up)
  py_pool_starmap: tasks/s of pool.starmap(f, [(0,), ...]) (default chunking)
  py_pool_apply: tasks/s of APPLYN apply_async(f, (i,)), then get() each
  py_pool_start: ms of Pool(4) + close + join, in a fresh process (MAPN =
    APPLYN = 0); after the rows above it is py_pool_start_heap
f returns its argument.  The pool is warmed up (one small map) first.
MAPN = APPLYN = 0: only py_pool_start.  MAXN > 0: only
  py_pool_maxtasks: tasks/s of pool.map(f, range(MAXN), chunksize=1) on a
    fresh Pool(4, maxtasksperchild=1)
"""
import json
import multiprocessing as mp
import sys
import time


# the rows of whole chunks run this many times, after as many calls that
# are not timed, as bench/lua_pool.lua's do: their median is a warmed
# pool's, not its first calls'
CHUNKED_REPS = 15


def f(x):
    return x


def emit(name, method, samples):
    print(json.dumps({"bench": name, "method": method, "samples": samples}),
          flush=True)


def rate(ctx, reps, n, body, warm=0):
    samples = []
    with ctx.Pool(4) as pool:
        pool.map(f, range(8), chunksize=1)
        for _ in range(warm):
            body(pool)
        for _ in range(reps):
            t0 = time.perf_counter()
            body(pool)
            samples.append(n / (time.perf_counter() - t0))
    return samples


def main():
    method, reps = sys.argv[1], int(sys.argv[2])
    mapn, applyn = int(sys.argv[3]), int(sys.argv[4])
    maxn = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    ctx = mp.get_context(method)
    if maxn > 0:
        samples = []
        for _ in range(reps):
            with ctx.Pool(4, maxtasksperchild=1) as pool:
                t0 = time.perf_counter()
                assert pool.map(f, range(maxn), chunksize=1)[-1] == maxn - 1
                samples.append(maxn / (time.perf_counter() - t0))
        emit("py_pool_maxtasks", method, samples)
        return
    data = list(range(mapn))
    stars = [(i,) for i in range(mapn)]
    cs = (mapn + 15) // 16

    def unord(pool):
        assert sum(1 for _ in pool.imap_unordered(f, data, cs)) == mapn

    def starmap(pool):
        assert pool.starmap(f, stars)[-1] == mapn - 1

    def map1(pool):
        assert pool.map(f, data, chunksize=1)[-1] == mapn - 1

    def mapdef(pool):
        assert pool.map(f, data)[-1] == mapn - 1

    def apply(pool):
        ars = [pool.apply_async(f, (i,)) for i in range(applyn)]
        for i, ar in enumerate(ars):
            assert ar.get() == i

    if mapn > 0:
        emit("py_pool_map1", method, rate(ctx, reps, mapn, map1))
        emit("py_pool_mapdef", method, rate(ctx, CHUNKED_REPS, mapn, mapdef, CHUNKED_REPS))
        emit("py_pool_unord", method, rate(ctx, CHUNKED_REPS, mapn, unord, CHUNKED_REPS))
        emit("py_pool_starmap", method, rate(ctx, CHUNKED_REPS, mapn, starmap, CHUNKED_REPS))
        emit("py_pool_apply", method, rate(ctx, reps, applyn, apply))
    warm = ctx.Pool(2)
    warm.close()
    warm.join()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pool = ctx.Pool(4)
        pool.close()
        pool.join()
        samples.append((time.perf_counter() - t0) * 1e3)
    emit("py_pool_start_heap" if mapn > 0 or applyn > 0 else "py_pool_start",
         method, samples)


if __name__ == "__main__":
    main()
