"""The profile: the validated pydantic models of configs/*.yaml (config.py).
"""
