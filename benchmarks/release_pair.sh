#!/bin/bash
# A test-tiny release, cold then cached, from a fresh EDGEFLOW_HOME; each broken down stage by stage
# (benchmarks/release_stages.py, with the MLflow server's requests); then the workers stopped and `edgeflow plan`
# three times. Figures: BENCHMARKS.md#stage-fixed-costs and #edgeflow-plan.
#
#   bash benchmarks/release_pair.sh                 # EDGEFLOW_HOME=/tmp/edgeflow-bench-home, removed first
#   AB=1 bash benchmarks/release_pair.sh            # then cached re-runs with Prefect's own process-pool template
#                                                   # and with edgeflow's (benchmarks/engine_command_ab.py)
set -u
cd "$(dirname "$0")/.."
export EDGEFLOW_HOME=${EDGEFLOW_HOME_BENCH:-/tmp/edgeflow-bench-home}
rm -rf "$EDGEFLOW_HOME"
export EDGEFLOW_SCHEDULES=off
set -a; eval "$(.venv/bin/python scripts/services.py env | sed 's/^export //')"; set +a
# at the end: the servers and workers, and test-tiny's edge server (its work directory is the checkout's, not the home's:
# left serving, it holds the stable port the end-to-end tests' fixture needs free)
trap '.venv/bin/python -c "from edgeflow.preflight import load_profile; from edgeflow.device.spawn import stop_device; stop_device(load_profile(\"configs/test-tiny.yaml\"))"; .venv/bin/python scripts/services.py down > /dev/null 2>&1' EXIT
.venv/bin/python scripts/services.py up > "$EDGEFLOW_HOME.up.log" 2>&1 || { echo "up failed: $EDGEFLOW_HOME.up.log"; exit 1; }
release() {
  .venv/bin/python -c "
import time
from prefect.deployments import run_deployment as r
t = time.time()
fr = r('release/release', parameters={'profile': 'configs/test-tiny.yaml', 'deploy': 'pool'}, timeout=1800, poll_interval=1)
print(fr.id, fr.state.type.value, f'{time.time() - t:.1f}')"
}
busy() { grep -c "busy: " "$EDGEFLOW_HOME/logs/prefect-server.log" 2>/dev/null || true; }
for label in cold cached; do
  before=$(busy)
  out=$(release); echo "$label release: $out s"
  echo "  requests the Prefect server retried after SQLite answered busy (edgeflow/pipeline/server.py): $(( $(busy) - before ))"
  .venv/bin/python -W ignore benchmarks/release_stages.py --flow-run "${out%% *}"
done
if [ "${AB:-0}" = 1 ]; then .venv/bin/python -W ignore benchmarks/engine_command_ab.py; fi
for f in "$EDGEFLOW_HOME"/run/worker-*.pid; do kill -INT -- -"$(awk '{print $1; exit}' "$f")" 2>/dev/null; done
sleep 3
for i in 1 2 3; do
  /usr/bin/time -f "edgeflow plan: %e s" .venv/bin/edgeflow plan configs/test-tiny.yaml > "$EDGEFLOW_HOME.plan.txt" 2> "$EDGEFLOW_HOME.plan.err"
  tail -1 "$EDGEFLOW_HOME.plan.err"
done
tail -1 "$EDGEFLOW_HOME.plan.txt"
lscpu | grep -E "^Model name|^CPU family|^Model:"; grep -o -w "avx2\|fma\|avx512f" /proc/cpuinfo | sort -u | tr "\n" " "; echo
