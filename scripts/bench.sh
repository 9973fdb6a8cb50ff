#!/bin/sh
# make bench: builds the C floors and the bench's clock module into
# build/bench/, then runs bench/run.lua, which measures and prints the tables.
# Benchmarks print, they never fail the build: this script exits 0.
#   BENCH_QUICK=1 make bench     fewer repetitions (a smoke run)
cd "$(dirname "$0")/.." || exit 0
CC=${CC:-cc}
LUA=${LUA:-lua5.4}
mkdir -p build/bench
# The floors bind their symbols at start (-z now), as our library is bound
# when require loads it: a fork child that calls _exit (or, --safe, setpgid,
# open, fcntl...) first would otherwise look each one up in the dynamic
# linker, 8 of the 16 page faults of a floor_fork child, and the floor
# would measure ld.so, not fork.
for f in floor_fork floor_spawn floor_pipe floor_fdpass time_cmd; do
    "$CC" -O2 -Wl,-z,now -o "build/bench/$f" "bench/$f.c" ||
        echo "bench: could not build $f (its rows will be skipped)"
done
LUA_CFLAGS=$(pkg-config --cflags lua5.4 2>/dev/null)
# shellcheck disable=SC2086
"$CC" -O2 -shared -fPIC $LUA_CFLAGS -o build/bench/benchclock.so bench/benchclock.c ||
    echo "bench: could not build the clock module (Lua rows will be skipped)"
# The embedding row's host: the example engine host (examples/frame_host.c).
# shellcheck disable=SC2086
"$CC" -O2 -std=c99 -D_GNU_SOURCE -Isrc -o build/bench/frame_host examples/frame_host.c \
    $LUA_CFLAGS $(pkg-config --libs lua5.4 2>/dev/null) -lpthread ||
    echo "bench: could not build the frame host (its rows will be skipped)"
export LUA
"$LUA" bench/run.lua || echo "bench: the driver failed (status $?)"
exit 0
