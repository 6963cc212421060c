"""edgeflow: distill, quantize, compile and serve a chat model on edge GPUs, as a Prefect DAG with MLflow lineage.

The layers, top to bottom (each imports only those below it; tests/test_import_layers.py holds them to it):
cli -> pipeline -> fleet, device, ops, preflight -> distill, calibration, quantize, evaluation, engines, pii, model, serving,
tracking -> profile -> paths. docs/development/layout.md says what each package owns.
"""
