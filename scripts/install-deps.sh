#!/bin/sh
# Installs everything the build, the specs and the example need on a fresh
# Debian machine.  Safe to run again: packages already present are skipped.
set -eu

packages="build-essential pkg-config lua5.4 liblua5.4-dev lua-busted clang libclang-rt-dev python3"
# the cluster engines of spec/onebox_spec.lua (about 10 s to install)
packages="$packages openmpi-bin mpich slurmctld slurmd slurm-client munge iproute2"
# luarocks, lua-check: packaging and lint (make check); lua-luv, lua-cqueues:
# the event-loop examples.
packages="$packages luarocks lua-check lua-luv lua-cqueues"
# strace: make bench counts the system calls of a fork worker with it.
packages="$packages strace"
# `install-deps.sh bench`: also the peers make bench measures us against
# (GNU parallel; torch, ~300 MB); without them their rows say so.
[ "${1:-}" = bench ] && packages="$packages parallel python3-torch"

missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
[ -z "$missing" ] && exit 0

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# shellcheck disable=SC2086
$SUDO apt-get install -y -q --no-install-recommends $missing
