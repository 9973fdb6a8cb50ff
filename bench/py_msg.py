"""Python peer for messages between the parent and one fork worker (issue 4).

    python3 bench/py_msg.py REPS ROUNDTRIPS MIB_PER_REP SENDS SHM_MIB

JSON lines, one sample per repetition:
  py_queue_pingpong / py_pipe_pingpong: round trips per second of a 24-byte
      bytes object (two Queues / one duplex Pipe; the worker echoes); "cpu":
      the parent's CPU time per round trip in us (process_time, all threads)
  py_queue_mib / py_pipe_mib: MB/s (10^6 bytes) of 1 MiB bytes objects one
      way, the worker acknowledging once per repetition with the bytes it got
  py_queue_shm: us per round trip of a multiprocessing.shared_memory
      SharedMemory of SHM_MIB MiB put on a Queue; the worker reads one byte
      and replies with it (the nearest Python peer of sending a shared array)
"""
import json
import multiprocessing as mp
import sys
import time
from multiprocessing import shared_memory

SMALL = b"m" * 24
MIB = 1024 * 1024


def emit(name, samples, **kw):
    d = {"bench": name}
    d.update(kw)
    d["samples"] = samples
    print(json.dumps(d), flush=True)


def q_echo(qin, qout):
    while True:
        v = qin.get()
        if v is None:
            return
        qout.put(v)


def q_sink(qin, qout):
    n = 0
    while True:
        v = qin.get()
        if v is None:
            return
        if v == b"sync":
            qout.put(n)
            n = 0
        else:
            n += len(v)


def p_echo(c):
    while True:
        v = c.recv()
        if v is None:
            return
        c.send(v)


def p_sink(c):
    n = 0
    while True:
        v = c.recv()
        if v is None:
            return
        if v == b"sync":
            c.send(n)
            n = 0
        else:
            n += len(v)


def q_shm(qin, qout):
    while True:
        shm = qin.get()
        if shm is None:
            return
        b = shm.buf[0]
        shm.close()
        qout.put(b)


def main():
    reps, rts, mibs, sends, shm_mib = map(int, sys.argv[1:6])
    ctx = mp.get_context("fork")
    big = b"x" * MIB

    # Queue ping-pong
    q1, q2 = ctx.Queue(), ctx.Queue()
    w = ctx.Process(target=q_echo, args=(q1, q2)); w.start()
    for _ in range(200):
        q1.put(SMALL); q2.get()
    s, cpu = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        c0 = time.process_time()
        for _ in range(rts):
            q1.put(SMALL); q2.get()
        s.append(rts / (time.perf_counter() - t0))
        cpu.append((time.process_time() - c0) * 1e6 / rts)
    q1.put(None); w.join()
    emit("py_queue_pingpong", s, cpu=cpu)

    # Pipe ping-pong
    a, b = ctx.Pipe()
    w = ctx.Process(target=p_echo, args=(b,)); w.start()
    for _ in range(200):
        a.send(SMALL); a.recv()
    s, cpu = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        c0 = time.process_time()
        for _ in range(rts):
            a.send(SMALL); a.recv()
        s.append(rts / (time.perf_counter() - t0))
        cpu.append((time.process_time() - c0) * 1e6 / rts)
    a.send(None); w.join()
    emit("py_pipe_pingpong", s, cpu=cpu)

    # Queue 1 MiB one way
    q1, q2 = ctx.Queue(), ctx.Queue()
    w = ctx.Process(target=q_sink, args=(q1, q2)); w.start()
    s = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        for _ in range(mibs):
            q1.put(big)
        q1.put(b"sync")
        assert q2.get() == mibs * MIB
        if r:
            s.append(mibs * MIB / 1e6 / (time.perf_counter() - t0))
    q1.put(None); w.join()
    emit("py_queue_mib", s)

    # Pipe 1 MiB one way
    a, b = ctx.Pipe()
    w = ctx.Process(target=p_sink, args=(b,)); w.start()
    s = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        for _ in range(mibs):
            a.send(big)
        a.send(b"sync")
        assert a.recv() == mibs * MIB
        if r:
            s.append(mibs * MIB / 1e6 / (time.perf_counter() - t0))
    a.send(None); w.join()
    emit("py_pipe_mib", s)

    # shared memory through a Queue
    shm = shared_memory.SharedMemory(create=True, size=shm_mib * MIB)
    try:
        shm.buf[0] = 42
        q1, q2 = ctx.Queue(), ctx.Queue()
        w = ctx.Process(target=q_shm, args=(q1, q2)); w.start()
        s = []
        for r in range(reps + 1):
            t0 = time.perf_counter()
            for _ in range(sends):
                q1.put(shm)
                assert q2.get() == 42
            if r:
                s.append((time.perf_counter() - t0) * 1e6 / sends)
        q1.put(None); w.join()
        emit("py_queue_shm", s, mib=shm_mib)
    finally:
        shm.close()
        shm.unlink()


if __name__ == "__main__":
    main()
