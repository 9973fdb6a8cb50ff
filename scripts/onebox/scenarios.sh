#!/bin/sh
# Run by onebox.sh (for slurm, through slurm-up.sh):
#   sh scripts/onebox/scenarios.sh openmpi|hydra|slurm library|mprun OUTDIR
# starts, with the engine from host h1, one copy per host of job.lua (the
# library used directly) or of `mprun -n 4 rank.lua`, in three runs, and
# leaves for each run NAME in OUTDIR: NAME.out (the engine's
# stdout and stderr), NAME.rc (its exit status), NAME.secs (how long it
# took), NAME.left (processes still on either host once the run settled,
# the engine's daemons left out) and NAME.shm (what the hosts' /dev/shm
# hold, as "HOST:ENTRY").  The runs:
#   ok    4 ranks per node, all exit 0
#   fail  rank 6 (on h2) exits 5 while the others sleep 600 s: the engine
#         must stop the job
#   two   two copies per node: refused before any rank starts
set -u
engine=$1 job=$2 out=$3
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
# shellcheck source=scripts/onebox/lib.sh
. "$ONEBOX_LIB"
export NPER=4 LUA_MP_BUILD="${LUA_MP_BUILD:-build}"

case $engine in
openmpi)
    mpirun="mpirun.openmpi --allow-run-as-root --host h1:2,h2:2 --mca plm_rsh_agent $here/nsrsh"
    mpirun="$mpirun --mca oob_tcp_if_include 10.99.0.0/24"
    mpirun="$mpirun -x NPER -x WORKER_SLEEP -x FAIL_RANK -x LUA_MP_BUILD"
    one="$mpirun -np 2 --map-by ppr:1:node"
    two="$mpirun -np 4 --map-by ppr:2:node" ;;
hydra)
    hydra="mpiexec.hydra -hosts h1,h2 -launcher rsh -launcher-exec $here/nsrsh"
    one="$hydra -n 2 -ppn 1"
    two="$hydra -n 4 -ppn 2" ;;
slurm)
    one="srun -N 2 --ntasks-per-node=1 --kill-on-bad-exit=1"
    two="srun -N 2 --ntasks-per-node=2 --kill-on-bad-exit=1" ;;
*)  echo "scenarios.sh: unknown engine $engine" >&2; exit 2 ;;
esac
case $job in
library) job="lua5.4 $root/scripts/onebox/job.lua" ;;
mprun)   job="$root/scripts/mprun -n 4 $root/scripts/onebox/rank.lua" ;;
*)  echo "scenarios.sh: unknown job $job" >&2; exit 2 ;;
esac

# what runs on the hosts before a job: the engine's daemons
for h in h1 h2; do onebox_procs "$h" > "$ONEBOX/$h.base"; done
left() {
    for h in h1 h2; do onebox_procs "$h" | grep -vxF -f "$ONEBOX/$h.base"; done
}

run() {   # run NAME LAUNCH
    start=$(date +%s)
    onebox_in h1 "timeout -k 5 300 $2 $job" \
        > "$out/$1.out" 2>&1
    echo $? > "$out/$1.rc"
    echo $(( $(date +%s) - start )) > "$out/$1.secs"
    # the engine's own cleanup (slurmstepd, orted) may take a moment
    i=0
    while [ -n "$(left)" ] && [ $i -lt 100 ]; do sleep 0.2; i=$((i + 1)); done
    for p in $(left); do ps -o pid=,args= -p "$p"; done > "$out/$1.left"
    for h in h1 h2; do onebox_shm "$h" | sed "s/^/$h:/"; done > "$out/$1.shm"
}

WORKER_SLEEP=0 FAIL_RANK=-1 run ok "$one"
WORKER_SLEEP=600 FAIL_RANK=6 run fail "$one"
WORKER_SLEEP=0 FAIL_RANK=-1 run two "$two"
exit 0
