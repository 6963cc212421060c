"""A distributed distillation in a process of its own, for the tests that kill one mid-run and resume it
(tests/distill/test_distill_distributed.py): `python -m tests.helpers.distill_launch SPEC.json` runs
run_distill_distributed with the spec's arguments and writes its metrics to the spec's `result` file."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from edgeflow.distill.launch import run_distill_distributed
from edgeflow.profile import DistillConfig


def main(spec_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    metrics = run_distill_distributed(Path(spec["teacher"]), DistillConfig(**spec["cfg"]), [Path(spec["corpus"])],
                                      spec["eval_texts"], Path(spec["out"]), Path(spec["work"]),
                                      student_from=Path(spec["student_from"]))
    Path(spec["result"]).write_text(json.dumps(metrics))


if __name__ == "__main__":
    main(sys.argv[1])
