"""Prefect flows, one per stage. Importing this package tunes the stage process's allocator before torch loads
(tasks/allocator.py: torch's large CPU blocks reused instead of unmapped, about 20 % off a CPU distillation step)."""
from tasks.allocator import tune as _tune_allocator

_tune_allocator()
