"""Tracking: the content-addressed artifact store (artifacts.py, store.py), MLflow runs (runs.py), the registry,
lineage and promotion, the release and nightly reports, and the code version every cache key includes.
"""
