"""Operations on a host: detached processes (processes.py), the stage processes' allocator (allocator.py), the
monitoring stack (monitoring.py) and the host check the images run first (envcheck.py).
"""
