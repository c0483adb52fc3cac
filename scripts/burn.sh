#!/usr/bin/env bash
# Busy-host proof harness (issue 27 item 8): start N plain CPU-burning loops (default: one
# per core), print their pids, and stop exactly those pids on exit or signal.
# Unpinned on purpose: the host's other work is not under our control, which is the point.
#   bash scripts/burn.sh [N]                 # burn until Ctrl-C / SIGTERM
#   bash scripts/burn.sh [N] -- CMD ARGS...  # burn while CMD runs; exit with CMD's status
set -euo pipefail
n="${1:-$(nproc)}"
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "burn.sh: N must be a positive integer, got '$n'" >&2; exit 2; }
shift $(( $# > 0 ? 1 : 0 ))
pids=()
stop() {
    # Only the loops this script started, by pid.
    if ((${#pids[@]})); then kill "${pids[@]}" 2>/dev/null || true; wait "${pids[@]}" 2>/dev/null || true; fi
    pids=()
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for _ in $(seq "$n"); do
    ( trap - INT TERM; while :; do :; done ) &
    pids+=("$!")
done
echo "burn.sh: ${n} burners, pids: ${pids[*]}" >&2
if [[ "${1:-}" == "--" ]]; then
    shift
    rc=0; "$@" || rc=$?
    exit "$rc"
fi
wait
