#!/bin/sh
# Two "hosts" on one machine, for running the cluster engines for real.
#
#   sh scripts/onebox/onebox.sh COMMAND [ARGS...]
#
# runs COMMAND (as root) in a private world holding two hosts, h1 (10.99.0.1)
# and h2 (10.99.0.2): each host is a network namespace joined to the other by
# a veth pair, with its own hostname (UTS namespace) and its own /dev/shm (a
# mount namespace with a tmpfs on it).  The world itself is a fresh network
# and mount namespace, so nothing in it -- interfaces, /run/netns, /etc/hosts,
# /run/munge -- is seen by, or collides with, the rest of the machine.
# COMMAND gets these in its environment:
#   ONEBOX       the state directory (host namespaces; scratch space)
#   ONEBOX_LIB   this directory's lib.sh: `. "$ONEBOX_LIB"` gives
#                onebox_in HOST CMD (a shell command run on HOST),
#                onebox_procs HOST (pids running on HOST),
#                onebox_shm HOST (what HOST's /dev/shm holds), onebox_kill HOST
# When COMMAND ends (or fails, or the script is interrupted) every process
# left on either host is killed and the world is dropped.
#
# Exit status: COMMAND's; 77 when this machine gives no right to create
# namespaces (not root, or a container without CAP_SYS_ADMIN), with the
# reason on stderr.
set -eu
here=$(cd "$(dirname "$0")" && pwd)

if [ "${ONEBOX_WORLD:-}" != 1 ]; then
    if ! unshare --mount --net --uts true 2>/dev/null; then
        echo "onebox: cannot create namespaces here (need root with CAP_SYS_ADMIN): skipped" >&2
        exit 77
    fi
    ONEBOX_WORLD=1 exec unshare --mount --net --uts --propagation private \
        sh "$here/onebox.sh" "$@"
fi

ONEBOX=$(mktemp -d "${TMPDIR:-/tmp}/onebox.XXXXXX")
export ONEBOX ONEBOX_LIB="$here/lib.sh"
# shellcheck source=scripts/onebox/lib.sh
. "$ONEBOX_LIB"

teardown() {
    for h in h1 h2; do onebox_kill "$h"; done
    ip netns del h1 2>/dev/null || true
    ip netns del h2 2>/dev/null || true
    rm -rf "$ONEBOX"
}
trap teardown EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

# The world's own copies of what the engines look up by path.
mkdir -p /run/netns /run/munge
mount -t tmpfs -o mode=755 tmpfs /run/netns
mount -t tmpfs -o mode=755 tmpfs /run/munge
printf '127.0.0.1 localhost\n10.99.0.1 h1\n10.99.0.2 h2\n' > "$ONEBOX/hosts"
mount --bind "$ONEBOX/hosts" /etc/hosts
ip link set lo up

ip link add veth-h1 type veth peer name veth-h2
for h in h1 h2; do
    n=${h#h}
    ip netns add "$h"
    ip link set "veth-$h" netns "$h"
    ip -n "$h" addr add "10.99.0.$n/24" dev "veth-$h"
    ip -n "$h" link set lo up
    ip -n "$h" link set "veth-$h" up
    # its hostname and its /dev/shm, held by a keeper process that the
    # commands on this host join (lib.sh)
    nsenter --net="/run/netns/$h" unshare --uts --mount --propagation private \
        sh -c "hostname $h && mount -t tmpfs -o size=64m tmpfs /dev/shm && exec sleep infinity" &
    echo $! > "$ONEBOX/$h.keeper"
done
for h in h1 h2; do   # up once the keeper has its hostname and /dev/shm
    k=$(cat "$ONEBOX/$h.keeper")
    while [ "$(nsenter -t "$k" --uts hostname 2>/dev/null)" != "$h" ] ||
          [ "$(readlink "/proc/$k/exe")" != "$(readlink -f "$(command -v sleep)")" ]; do
        kill -0 "$k" || { echo "onebox: host $h did not come up" >&2; exit 1; }
        sleep 0.05
    done
done

set +e
"$@"
