#!/usr/bin/env bash
# make test's main suite in two lanes at once, each its own pytest session with its own Ray cluster, ports and
# files, then the multinode tests. Usage: bash tests/lanes.sh PYTHON
#
# Why two: one session keeps a 2-core machine about three quarters busy (it waits on graph deploys, engine starts
# and the tests' own timeouts); the vLLM-family modules (marker `vllm_cpu`: their engines are the heaviest starts)
# and the rest each take about half of it, so side by side they fill the idle quarter.
#   lane "graphs"   the tests without the vllm_cpu marker on OMNI_SERVE_TEST_PORT (default 18765), then the
#                   multinode tests (their own multi-raylet clusters, Serve's Python proxy)
#   lane "engines"  the vllm_cpu tests on port 28765, Serve's direct-ingress ports 31100-32000 / 41100-42000
#                   (the first lane keeps Serve's defaults, 30000-31000 / 40000-41000)
# Each lane's output goes to .make/lanes/LANE.log and is printed whole when both have ended; the exit status is
# the first failing lane's. Ctrl-C or SIGTERM stops both.
set -uo pipefail
PY="${1:-python3}"
LOGS=.make/lanes
SELECT="not gpu and not multinode and not oracle"
mkdir -p "$LOGS"

graphs() {
  "$PY" -m pytest -q -m "$SELECT and not vllm_cpu" -p no:cacheprovider --durations=15 || return
  RAY_SERVE_ENABLE_HA_PROXY=0 "$PY" -m pytest -q -m multinode -p no:cacheprovider
}
engines() {
  OMNI_SERVE_TEST_PORT=28765 \
    RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=31100 RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=32000 \
    RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT=41100 RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT=42000 \
    "$PY" -m pytest -q -m "$SELECT and vllm_cpu" -p no:cacheprovider --durations=15
}

started=$(date +%s)
# Each lane in its own process group (set -m), so that stopping make stops a lane's whole tree.
set -m
graphs > "$LOGS/graphs.log" 2>&1 & graphs_pid=$!
engines > "$LOGS/engines.log" 2>&1 & engines_pid=$!
set +m
trap 'kill -INT -- -$graphs_pid -$engines_pid 2>/dev/null; wait' INT TERM
wait "$engines_pid"; engines_rc=$?
echo "omni_serve: lane engines ended (exit $engines_rc) after $(( $(date +%s) - started )) s"
wait "$graphs_pid"; graphs_rc=$?
echo "omni_serve: lane graphs ended (exit $graphs_rc) after $(( $(date +%s) - started )) s"
for lane in graphs engines; do
  echo "omni_serve: ===== lane $lane ($LOGS/$lane.log) ====="
  cat "$LOGS/$lane.log"
done
[ "$graphs_rc" -ne 0 ] && exit "$graphs_rc"
exit "$engines_rc"
