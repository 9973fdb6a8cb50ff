# Sourced by the commands onebox.sh runs: how to reach its two hosts.
# ONEBOX is the state directory onebox.sh made; $ONEBOX/HOST.keeper the pid
# of the process that holds HOST's hostname and /dev/shm.

# onebox_in HOST CMD: runs the shell command CMD on HOST, in the current
# directory.
onebox_in() {
    nsenter -t "$(cat "$ONEBOX/$1.keeper")" --net --uts --mount \
        sh -c "cd '$PWD' && $2"
}

# onebox_procs HOST: the pids of the processes running on HOST (those in
# its network namespace), its keeper left out, one a line.
onebox_procs() {
    _keeper=$(cat "$ONEBOX/$1.keeper")
    _ns=$(readlink "/proc/$_keeper/ns/net")
    for _p in /proc/[0-9]*; do
        [ "${_p#/proc/}" != "$_keeper" ] &&
            [ "$(readlink "$_p/ns/net" 2>/dev/null)" = "$_ns" ] && echo "${_p#/proc/}"
    done
    return 0
}

# onebox_shm HOST: the entries of HOST's /dev/shm, one a line.
onebox_shm() {
    nsenter -t "$(cat "$ONEBOX/$1.keeper")" --mount ls -A /dev/shm
}

# onebox_kill HOST: SIGKILLs everything running on HOST, its keeper too.
onebox_kill() {
    _pids="$(onebox_procs "$1") $(cat "$ONEBOX/$1.keeper")"
    # shellcheck disable=SC2086  # one word per pid
    kill -KILL $_pids 2>/dev/null
    return 0
}
