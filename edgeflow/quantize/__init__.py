"""Quantization with llm-compressor: the recipes (recipe.py, read without torch) and the one-shot run (run.py).
"""
