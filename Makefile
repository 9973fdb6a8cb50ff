# lua-multiprocessing -- build, test and install.
#
#   make                  build the C core into build/
#   make test             run the specs (busted, Lua 5.4)
#   make check-asan       the same specs under AddressSanitizer + UBSan,
#                         plus a short fuzz run of the decoder
#   make check            both of the above, then one "N passed, N failed" line
#   make bench            benchmarks against the floors and the peers (Python's
#                         multiprocessing; torch and GNU parallel where installed:
#                         sh scripts/install-deps.sh bench), compared with
#                         bench/baseline.json (REGRESSED rows)
#   make bench-baseline   the median ratios of the last (up to 3) full bench runs
#                         of this commit -> bench/baseline.json
#   make soak             the Pool's random fault injection, long (SOAK_SECONDS)
#   make example          the example orchestration in examples/
#   make lint             luacheck on lua/ spec/ examples/ bench/ (.luacheckrc)
#   make install PREFIX=/usr/local DESTDIR=...
#                         the modules, mprun, multiprocessing.h and the man pages
#   make uninstall PREFIX=/usr/local DESTDIR=...
#                         removes exactly the files make install put there
#   make clean

LUA        ?= lua5.4
PKG_CONFIG ?= pkg-config
BUSTED     ?= busted

LUA_CFLAGS   := $(shell $(PKG_CONFIG) --cflags lua5.4)
LUA_LIBS     := $(shell $(PKG_CONFIG) --libs lua5.4)
PREFIX       ?= /usr/local
# Where lua5.4 looks: pkg-config's dirs under its own prefix (Debian's C
# dir is multiarch), else the dirs its default package.cpath and
# package.path list for any other prefix, such as /usr/local.
LUA_PREFIX   := $(shell $(PKG_CONFIG) --variable=prefix lua5.4)
ifeq ($(PREFIX),$(LUA_PREFIX))
INSTALL_CMOD ?= $(shell $(PKG_CONFIG) --variable=INSTALL_CMOD lua5.4)
INSTALL_LMOD ?= $(shell $(PKG_CONFIG) --variable=INSTALL_LMOD lua5.4)
else
INSTALL_CMOD ?= $(PREFIX)/lib/lua/5.4
INSTALL_LMOD ?= $(PREFIX)/share/lua/5.4
endif
INSTALL_BIN  ?= $(PREFIX)/bin
# multiprocessing.h goes next to lua.h: under Lua's own prefix that is
# pkg-config's includedir/lib_name_include (Debian: /usr/include/lua5.4).
ifeq ($(PREFIX),$(LUA_PREFIX))
INSTALL_INC  ?= $(shell $(PKG_CONFIG) --variable=includedir lua5.4)/$(shell $(PKG_CONFIG) --variable=lib_name_include lua5.4)
else
INSTALL_INC  ?= $(PREFIX)/include
endif
INSTALL_MAN  ?= $(PREFIX)/share/man

WARNINGS = -Wall -Wextra -Werror -Wshadow -Wpointer-arith -Wcast-qual \
           -Wstrict-prototypes -Wmissing-prototypes -Wmissing-declarations \
           -Wundef -Wwrite-strings -Wformat=2 -Wredundant-decls \
           -Wdeclaration-after-statement -Wnested-externs -Wvla
CFLAGS  ?= -O2 -g
ALL_CFLAGS = -std=c99 -D_GNU_SOURCE -fPIC -fvisibility=hidden $(WARNINGS) \
             $(LUA_CFLAGS) $(CFLAGS)

ifeq ($(SANITIZE),1)
BUILD      = build-asan
ALL_CFLAGS += -O1 -fno-omit-frame-pointer -fsanitize=address,undefined \
              -DMP_CHECK_STACK \
              -fno-sanitize-recover=undefined
LDSAN      = -fsanitize=address,undefined
else
BUILD      = build
endif

CORE_SRC = src/core.c src/args.c src/context.c src/join.c src/proc.c src/exception.c src/reports.c \
           src/worker.c src/start_fork.c src/start_spawn.c src/signames.c \
           src/codec.c src/fdpass.c src/shm.c src/ledger.c src/array.c \
           src/channel.c src/sync.c src/wait.c src/nested.c src/payload.c src/launch.c \
           src/executable.c src/forkserver.c src/fd.c src/sys.c src/cpus.c src/pool.c src/select.c src/title.c
CORE_OBJ = $(CORE_SRC:src/%.c=$(BUILD)/obj/%.o)
CORE_SO  = $(BUILD)/multiprocessing/core.so
# The worker program for embedding hosts (worker_main.c), found next to
# core.so at run time.
WORKER   = $(BUILD)/multiprocessing/worker
# mprun's C, a module of its own beside the core (it uses the core's public
# faces only): the relay, rank stdio, log files, the signalfd.
LAUNCHER_SRC = src/launcher/launcher.c src/launcher/relay.c src/launcher/rank.c \
               src/launcher/fd.c src/proc.c src/sys.c
LAUNCHER_OBJ = $(LAUNCHER_SRC:src/%.c=$(BUILD)/obj/%.o)
LAUNCHER_SO  = $(BUILD)/multiprocessing/launcher.so

.PHONY: all test check check-asan soak fuzz bench bench-baseline example lint install uninstall clean
all: $(CORE_SO) $(WORKER) $(LAUNCHER_SO)

$(BUILD)/obj/%.o: src/%.c src/*.h
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -c -o $@ $<

$(BUILD)/obj/launcher/%.o: src/launcher/%.c src/launcher/*.h src/proc.h src/sys.h
	@mkdir -p $(@D)
	$(CC) $(ALL_CFLAGS) -c -o $@ $<

# No -llua5.4: the interpreter that loads the module already carries Lua.
$(CORE_SO): $(CORE_OBJ)
	@mkdir -p $(@D)
	$(CC) -shared $(LDSAN) $(LDFLAGS) -o $@ $(CORE_OBJ)

$(LAUNCHER_SO): $(LAUNCHER_OBJ)
	@mkdir -p $(@D)
	$(CC) -shared $(LDSAN) $(LDFLAGS) -o $@ $(LAUNCHER_OBJ)

# A program, not a module: it links liblua itself.
$(WORKER): $(BUILD)/obj/worker_main.o
	@mkdir -p $(@D)
	$(CC) $(LDSAN) $(LDFLAGS) -o $@ $< $(LUA_LIBS)

# Each busted run is bounded (SPEC_TIMEOUT seconds), so that a hang fails
# the run instead of taking CI's whole time (a procps tool deadlocked under
# the sanitizer's preload once did), and runs in a process group of its own
# (timeout's): the specs stop processes and signal groups, and none of that
# may reach make or the shell above it.
# spec/summary_handler.lua names the running spec in $(SPEC_NOW); the file
# is left only when the run ended in the middle of a spec.
SPEC_TIMEOUT ?= 1500
SPEC_NOW = $(BUILD)/spec-now
BUSTED_RUN = MP_SPEC_NOW=$(SPEC_NOW) timeout -k 30 $(SPEC_TIMEOUT) \
	$(BUSTED) --lua=$(LUA) -o spec/summary_handler.lua $(SPECS) \
	|| { rc=$$?; [ ! -f $(SPEC_NOW) ] || echo "busted ended (exit $$rc) in: $$(cat $(SPEC_NOW))"; exit $$rc; }

test: all
	@rm -f $(SPEC_NOW)
	LUA_MP_BUILD=$(BUILD) $(BUSTED_RUN)

# The interpreter is not instrumented, so the runtime is preloaded.
ASAN_LIB = $(shell $(CC) -print-file-name=libasan.so)
UBSAN_LIB = $(shell $(CC) -print-file-name=libubsan.so)
check-asan: SPEC_TIMEOUT = 2700
check-asan: BUILD = build-asan
check-asan:
	$(MAKE) SANITIZE=1 all
	@rm -f $(SPEC_NOW)
	LD_PRELOAD="$(ASAN_LIB) $(UBSAN_LIB)" \
	ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:allow_user_segv_handler=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	LUA_MP_BUILD=build-asan $(BUSTED_RUN)

check:
	sh scripts/check.sh

# The Pool's random fault injection for a long while (spec/pool_fault_spec.lua,
# SOAK_SECONDS per start method; a failure prints its seed: POOL_FAULT_SEED=n
# replays it), in a private /dev/shm.
SOAK_SECONDS ?= 600
soak: all
	POOL_SOAK_SECONDS=$(SOAK_SECONDS) unshare -m sh -c 'mount -t tmpfs tmpfs /dev/shm && \
	  LUA_MP_BUILD=$(BUILD) $(BUSTED) --lua=$(LUA) -o spec/summary_handler.lua \
	  --filter=random.faults spec/pool_fault_spec.lua'

# A short libFuzzer run of the decoder (clang); FUZZ_TIME=600 for a long one.
FUZZ_TIME ?= 20
fuzz:
	$(MAKE) -f fuzz/Makefile fuzz FUZZ_TIME=$(FUZZ_TIME)

# Examples use the installed module; here, this tree's.
EXAMPLE_ENV = LUA_PATH="./lua/?.lua;./lua/?/init.lua;;" LUA_CPATH="./$(BUILD)/?.so;;"
example: all
	$(EXAMPLE_ENV) $(LUA) examples/pipeline.lua

bench: all
	sh scripts/bench.sh

# After full `make bench` runs (best three): the median ratios of last.json
# and the earlier full runs of the same commit (build/bench/runs/) become the
# committed baseline (bench/guard.lua; a BENCH_QUICK run is refused).
bench-baseline:
	$(LUA) bench/guard.lua refresh

LUACHECK ?= luacheck
lint:
	$(LUACHECK) -q lua spec examples bench

# What install puts where; uninstall removes exactly these (and the
# directories it made, once empty).
LUA_MODULES := $(sort $(notdir $(wildcard lua/multiprocessing/*.lua)))
C_MODULES    = core.so launcher.so worker
MAN_PAGES    = man1/mprun.1 man3/multiprocessing.3
INSTALLED    = $(LUA_MODULES:%=$(INSTALL_LMOD)/multiprocessing/%) \
               $(C_MODULES:%=$(INSTALL_CMOD)/multiprocessing/%) \
               $(INSTALL_BIN)/mprun $(INSTALL_INC)/multiprocessing.h \
               $(MAN_PAGES:%=$(INSTALL_MAN)/%)

install: all
	install -d $(DESTDIR)$(INSTALL_CMOD)/multiprocessing $(DESTDIR)$(INSTALL_LMOD)/multiprocessing
	install -m 0755 $(C_MODULES:%=$(BUILD)/multiprocessing/%) $(DESTDIR)$(INSTALL_CMOD)/multiprocessing/
	install -m 0644 $(LUA_MODULES:%=lua/multiprocessing/%) $(DESTDIR)$(INSTALL_LMOD)/multiprocessing/
	install -d $(DESTDIR)$(INSTALL_BIN)
	printf '%s\n' '#!/usr/bin/env $(LUA)' '-- mprun, installed by make install' \
	  'package.path = "$(INSTALL_LMOD)/?.lua;$(INSTALL_LMOD)/?/init.lua;" .. package.path' \
	  'package.cpath = "$(INSTALL_CMOD)/?.so;" .. package.cpath' \
	  'return require("multiprocessing.mprun").main(arg)' > $(DESTDIR)$(INSTALL_BIN)/mprun
	chmod 0755 $(DESTDIR)$(INSTALL_BIN)/mprun
	install -d $(DESTDIR)$(INSTALL_INC) $(DESTDIR)$(INSTALL_MAN)/man1 $(DESTDIR)$(INSTALL_MAN)/man3
	install -m 0644 src/multiprocessing.h $(DESTDIR)$(INSTALL_INC)/multiprocessing.h
	install -m 0644 doc/mprun.1 $(DESTDIR)$(INSTALL_MAN)/man1/mprun.1
	install -m 0644 doc/multiprocessing.3 $(DESTDIR)$(INSTALL_MAN)/man3/multiprocessing.3

uninstall:
	rm -f $(INSTALLED:%=$(DESTDIR)%)
	rmdir $(DESTDIR)$(INSTALL_CMOD)/multiprocessing $(DESTDIR)$(INSTALL_LMOD)/multiprocessing 2>/dev/null || true

clean:
	rm -rf build build-asan
