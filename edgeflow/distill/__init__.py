"""Knowledge distillation: teacher -> student, trained with α·KL·T² + (1−α)·CE (+ β·hidden-state MSE).

Order of work in run_distill (run.py): checks that need no compute (checks.py: tokenizers, frozen teacher, memory
budget, size ratio) -> the student cut from the teacher or loaded (student.py) -> training set built once into
Parquet, cached by content hash (data.py) -> the resumable training loop train() (train.py; checkpoints keyed by the
run's content hash in checkpoints.py, stall watchdog and Pushgateway gauges in telemetry.py) -> held-out evaluation
and save (run.py). The loss math is edgeflow/distill/losses.py. The same loop runs in every process of a multi-process run
(edgeflow/distill/launch.py), each on its share of a step.

This module re-exports the names other modules import from edgeflow.distill. `edgeflow.distill.train` is the function
train() (as it was before the package); import its module's other names with `from edgeflow.distill.train import ...`.

Tiny CPU run (services up): python -m edgeflow.pipeline.release --profile configs/test-tiny.yaml --deploy none
"""
from edgeflow.distill.checkpoints import checkpoint_root, distill_run_key, latest_checkpoint
from edgeflow.distill.checks import check_memory_budget, check_same_tokenizer, load_tokenizer, param_ratio
from edgeflow.distill.data import TOKEN_SCHEMA, BatchOrder, TokenDataset, build_token_dataset, prepare_dataset
from edgeflow.distill.run import compare_to_teacher, finish_run, prepare_run, run_distill, teacher_logits
from edgeflow.distill.student import build_student, every_kth, keep_layers, kept_layers, resolve_layer_map
from edgeflow.distill.telemetry import TrainingStalled
from edgeflow.distill.train import LogFn, train

__all__ = [
    "TOKEN_SCHEMA", "BatchOrder", "LogFn", "TokenDataset", "TrainingStalled", "build_student", "build_token_dataset",
    "check_memory_budget", "check_same_tokenizer", "checkpoint_root", "compare_to_teacher", "distill_run_key", "every_kth",
    "finish_run", "keep_layers", "kept_layers", "latest_checkpoint", "load_tokenizer", "param_ratio", "prepare_dataset",
    "prepare_run", "resolve_layer_map", "run_distill", "teacher_logits", "train",
]
