#!/bin/sh
# Run by onebox.sh: `sh scripts/onebox/slurm-up.sh COMMAND [ARGS...]` starts
# munged, slurmctld and slurmd h1 on host h1 and slurmd h2 on host h2, waits
# until both nodes are idle, then runs COMMAND with SLURM_CONF set (srun
# must run on a host: onebox_in h1 "srun ...").  onebox.sh's teardown stops
# the daemons with everything else on the hosts; munged, which runs in the
# world rather than on a host, is stopped here.  Exit status: COMMAND's; 1
# with the daemons' logs on stderr when the cluster does not come up.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=scripts/onebox/lib.sh
. "$ONEBOX_LIB"
state=$ONEBOX/slurm
mkdir -p "$state/state" "$state/spool/h1" "$state/spool/h2" "$state/log"
export SLURM_CONF="$state/slurm.conf"
sed "s#@STATE@#$state#g" "$here/slurm.conf.in" > "$SLURM_CONF"

# munged on the world's private /run/munge (onebox.sh), as the munge user
chown munge:munge /run/munge
runuser -u munge -- /usr/sbin/munged --force
stop_munge() { kill "$(cat /run/munge/munged.pid)" 2>/dev/null || true; }
trap stop_munge EXIT

# nsenter, not `ip netns exec`: slurmd must see /sys/fs/cgroup
onebox_in h1 "slurmctld -c -f '$SLURM_CONF' && slurmd -f '$SLURM_CONF' -N h1"
onebox_in h2 "slurmd -f '$SLURM_CONF' -N h2"
n=0
for _ in $(seq 100); do
    n=$(onebox_in h1 "sinfo -h -N -t idle -o %N" 2>/dev/null | sort -u | wc -l)
    [ "$n" = 2 ] && break
    sleep 0.3
done
if [ "$n" != 2 ]; then
    echo "slurm-up: the two nodes did not come up" >&2
    onebox_in h1 "sinfo -N" >&2 || true
    tail -n 20 "$state"/log/* >&2
    exit 1
fi
set +e
"$@"
