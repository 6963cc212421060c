"""Generators of the shipped data: each writes its files under data/, deterministically (the same bytes every run), and
is imported as a module by the tests that check what it wrote (`tools.make_planted`).

    python -m tools.make_math        # data/corpora/math.jsonl and data/eval/math.jsonl
    python -m tools.make_planted     # data/pii/planted.jsonl
"""
