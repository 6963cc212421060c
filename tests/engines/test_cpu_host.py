"""edgeflow/engines/cpu_host.py: EDGEFLOW_TORCH_THREADS, as a stage process applies it when it imports edgeflow/pipeline/."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = "import edgeflow.pipeline, torch; print(torch.get_num_threads(), flush=True)"


def _stage_process(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("EDGEFLOW_TORCH_THREADS", "OMP_NUM_THREADS")}
    return subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=base | env, capture_output=True, text=True)


def test_edgeflow_torch_threads_wins_over_the_jobs_omp_num_threads():
    # a cpu-pool run: prefect.yaml's job sets OMP_NUM_THREADS=2; the host says one thread per stage process
    r = _stage_process(OMP_NUM_THREADS="2", EDGEFLOW_TORCH_THREADS="1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["1"]
    r = _stage_process(OMP_NUM_THREADS="2")  # unset: the job's setting stands
    assert r.stdout.split() == ["2"], r.stderr[-2000:]


def test_a_bad_thread_count_is_refused_naming_the_variable():
    r = _stage_process(EDGEFLOW_TORCH_THREADS="0")
    assert r.returncode != 0
    assert "EDGEFLOW_TORCH_THREADS='0': must be an integer of at least 1 (torch intra-op threads" in r.stderr
