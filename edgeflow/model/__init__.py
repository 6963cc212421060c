"""The model description: what a model is, read once from its config.json (architecture.py), and where a teacher
comes from and how it is converted (source.py).
"""
