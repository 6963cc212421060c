"""Calibration data: the domain-mixed set (mix.py), the corpora readers (textdata.py), access logs as calibration
samples (access_logs.py) and the nightly's window and mix (nightly.py).
"""
