#!/usr/bin/env bash
# Run multi-rank tests N times in a row under a concurrent CPU load and log every iteration
# (issue #31: a multi-rank test must not fail now and then, e.g. the gloo exit abort).
#
#   tests/loop_multirank.sh [-n N] [-l LOAD] [-o LOG] [-- PYTEST ARGS]
#
#   -n N      iterations (default 50)
#   -l LOAD   busy-loop processes running beside the tests for the whole loop (default: the core count)
#   -o LOG    log file (default benchmarks/results/flaky_loop/loop_<date>.log); the full pytest output of
#             a failing iteration goes next to it (<log>.iter<i>.txt)
#   PYTEST ARGS  what to run (default: -m dist tests, i.e. every multi-rank test: the gloo spawn
#             tests and each torchrun-based test carry the dist marker)
#
# One log line per iteration: index, pytest's exit code, seconds, passed/failed counts, failing test
# ids, and how many "terminate called" lines the output had; the last line sums it up. Exit code: 0
# when every iteration passed. Needs the CPU venv of launch/setup.sh (.venv).
set -u
cd "$(dirname "$0")/.."
N=50
LOAD=$(nproc)
LOG=""
while [ $# -gt 0 ]; do
  case "$1" in
    -n) N=$2; shift 2 ;;
    -l) LOAD=$2; shift 2 ;;
    -o) LOG=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(-m dist tests)
PY=${PYTHON:-.venv/bin/python}
[ -n "$LOG" ] || LOG=benchmarks/results/flaky_loop/loop_$(date +%Y%m%d_%H%M%S).log
mkdir -p "$(dirname "$LOG")"

LOAD_PIDS=()
stop_load() { for p in "${LOAD_PIDS[@]}"; do kill "$p" 2>/dev/null; done; }
trap stop_load EXIT
trap 'exit 130' INT TERM
for _ in $(seq 1 "$LOAD"); do
  "$PY" -c "while True: pass" &
  LOAD_PIDS+=($!)
done

{
  echo "# loop_multirank: $N iterations of: pytest ${ARGS[*]}"
  echo "# load: $LOAD busy-loop processes on $(nproc) cores; $(uname -srm); commit $(git rev-parse --short HEAD 2>/dev/null)$(git diff --quiet 2>/dev/null || echo ' (+ working tree changes)')"
  echo "# started $(date -Is)"
} > "$LOG"
fails=0
aborts=0
t_all=$SECONDS
for i in $(seq 1 "$N"); do
  out=$(mktemp)
  t0=$SECONDS
  HELION_INTERPRET=1 timeout 3600 "$PY" -m pytest -q -p no:cacheprovider -rf "${ARGS[@]}" > "$out" 2>&1
  rc=$?
  dt=$((SECONDS - t0))
  summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|no tests ran|error" "$out" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  failed=$(grep -E "^FAILED " "$out" | sed 's/^FAILED //; s/ - .*//' | tr '\n' ' ')
  term=$(grep -c "terminate called" "$out")
  aborts=$((aborts + term))
  if [ "$rc" -ne 0 ]; then
    fails=$((fails + 1))
    cp "$out" "$LOG.iter$i.txt"
  fi
  printf '%3d rc=%d %5ds  %s  terminate=%d%s\n' "$i" "$rc" "$dt" "$summary" "$term" "${failed:+  FAILED: $failed}" >> "$LOG"
  rm -f "$out"
done
echo "# done $(date -Is): $N iterations, $fails failed, $aborts 'terminate called' lines, $((SECONDS - t_all)) s" >> "$LOG"
tail -1 "$LOG"
[ "$fails" -eq 0 ]
