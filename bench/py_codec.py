"""Python peer of bench/lua_codec.lua: pickle (protocol 5) of the same data.

    python3 bench/py_codec.py REPS

JSON lines py_codec/<kind>: ns per element of pickle.dumps + pickle.loads
(fields enc, dec: each alone), "bytes": the pickle's size.
"""
import gc
import json
import pickle
import sys
import time

WARM = 2  # untimed rounds first, as bench/lua_codec.lua runs them


def data(kind):
    if kind == "ints":
        return list(range(1, 1000001))
    if kind == "floats":
        return [i + 0.5 for i in range(1, 1000001)]
    if kind == "strings":
        return ["item%d" % i for i in range(1, 100001)]
    return [{"id": i, "name": "name%d" % i, "score": i * 0.5, "tags": ["a", "b"]}
            for i in range(1, 10001)]


def main():
    reps = int(sys.argv[1])
    for kind in ("ints", "floats", "strings", "nested"):
        v = data(kind)
        n = len(v)
        enc, dec, total = [], [], []
        # the first WARM rounds are not kept, as in bench/lua_codec.lua
        for r in range(WARM + reps):
            gc.collect()
            t0 = time.perf_counter()
            s = pickle.dumps(v, protocol=5)
            t1 = time.perf_counter()
            back = pickle.loads(s)
            t2 = time.perf_counter()
            assert len(back) == n
            if r < WARM:
                continue
            enc.append((t1 - t0) / n * 1e9)
            dec.append((t2 - t1) / n * 1e9)
            total.append((t2 - t0) / n * 1e9)
        print(json.dumps({"bench": "py_codec", "method": kind, "samples": total,
                          "enc": enc, "dec": dec, "bytes": len(s)}), flush=True)


if __name__ == "__main__":
    main()
