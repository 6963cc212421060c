"""The `edgeflow` command (main.py) and `edgeflow init` (init_profile.py): the top layer, above the pipeline.
"""
