"""The tiny family models (edgeflow/model/tiny.py builds them) and what the tests compare them with: prompts that outgrow
the sliding window, transformers' greedy continuation, an engine's worst logit difference, an RTN int4 checkpoint."""
from __future__ import annotations


from edgeflow.model.tiny import (COMMON, FAMILY_MODELS, FAMILY_TOKENS, GEMMA_LAYERS, LLAMA3_ROPE, VOCAB, WINDOW,  # noqa: F401
                                 build_tiny, family_tokenizer)
from edgeflow.quantize.rtn import rtn_int4  # noqa: F401

PROMPT_LENGTHS = (5, 23)  # the second outgrows the sliding window (8) before decoding starts


def family_prompts() -> list[list[int]]:
    """Random prompts of PROMPT_LENGTHS ids, above every family's special tokens."""
    import torch

    g = torch.Generator().manual_seed(1)
    return [torch.randint(8, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids`: exactly `n` tokens."""
    import torch

    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def fp32_worst_logit_diff(backend, session, model, new_tokens: int) -> float:
    """Asserts the engine's greedy tokens are transformers' on every family prompt (each sequence then outgrows the
    sliding window) and returns the largest |engine - transformers| logit over every position and vocabulary entry."""
    import numpy as np
    import torch

    worst = 0.0
    for ids in family_prompts():
        want = hf_greedy(model, ids, new_tokens)
        assert list(backend.generate(session, ids, new_tokens, [])) == want
        seq = ids + want
        assert len(seq) > WINDOW
        with torch.no_grad():
            ref = model(torch.tensor([seq])).logits[0].numpy()
        worst = max(worst, float(np.abs(backend.score(session, seq) - ref).max()))
    return worst
