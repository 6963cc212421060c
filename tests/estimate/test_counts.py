"""edgeflow/estimate/counts.py: the bytes a decode step reads, the KV cache a token keeps and the FLOPs of a prefill,
against values computed by hand (the arithmetic is in each comment) for two families: SmolLM2-135M (Llama, GQA 9:3,
tied head) and Gemma 3 270M (head_dim 256 over 4 heads and 1 KV head, four norms and q/k norms a layer, 5 sliding
layers of 512 to 1 full).
"""
from __future__ import annotations

import pytest

from edgeflow.estimate.counts import Scheme, token_cost
from edgeflow.model.architecture import describe
from tests.helpers.model_configs import SMOLLM2_135M, gemma3_270m

def test_smollm2_int4_group_64_symmetric():
    arch = describe(SMOLLM2_135M)
    assert arch.params() == 134_515_008  # the released model's count
    cost = token_cost(arch, Scheme(bits=4, group_size=64))
    # per layer: linear weights q 576x576 + k, v 192x576 + o 576x576 + gate, up 1536x576 + down 576x1536 = 3,538,944
    assert cost.linear_params == 30 * 3_538_944
    # 4 bits: 1,769,472 B; scales: rows x ceil(cols / 64) = 576*9 + 192*9*2 + 576*9 + 1536*9*2 + 576*24 = 55,296 groups
    # x 2 B = 110,592 B; two norms of 576 fp16 = 2,304 B: 1,882,368 B a layer; x 30 + the final norm's 1,152 B
    assert cost.layer_bytes == 56_472_192
    assert cost.head_bytes == 49152 * 576 * 2 == 56_623_104  # tied, fp16: the embedding table read whole
    assert cost.resident_weight_bytes == 56_472_192 + 56_623_104  # the table once
    assert cost.kv_bytes_per_token == 30 * 2 * 3 * 64 * 2 == 23_040
    assert cost.kv_read_bytes(1000) == 23_040 * 1000
    # 2 x 106,168,320 x 512 + (512*513/2 = 131,328 keys x 30 layers) x 4*9*64 + 2 x 49,152 x 576
    assert cost.prefill_flops(512) == 108_716_359_680 + 9_077_391_360 + 56_623_104


def test_gemma3_int4_group_128_with_sliding_layers():
    arch = describe(gemma3_270m())
    assert arch.params() == 268_098_176  # the teacher's count in the Gemma 3 demo's distillation log
    cost = token_cost(arch, Scheme(bits=4, group_size=128))
    # per layer: q 1024x640 + k, v 256x640 + o 640x1024 + gate, up 2048x640 + down 640x2048 = 5,570,560
    assert cost.linear_params == 18 * 5_570_560
    # 4 bits: 2,785,280 B; groups 1024*5 + 256*5*2 + 640*8 + 2048*5*2 + 640*16 = 43,520 x 2 B = 87,040 B; four norms of
    # 640 and q/k norms of 256: 3,072 fp16 = 6,144 B; 2,878,464 B a layer, x 18 + the final norm's 1,280 B
    assert cost.layer_bytes == 51_813_632
    assert cost.kv_bytes_per_token == 18 * 2 * 256 * 2 == 18_432
    # at 1,000 tokens the 15 sliding layers read 512 positions, the 3 full ones 1,000: 10,680 x 1,024 B
    assert cost.kv_read_bytes(1000) == 10_936_320
    # 1,024 tokens: full layers 1024*1025/2 = 524,800 keys (x3); sliding: 512*513/2 + 512*512 = 393,472 (x15);
    # 7,476,480 keys x 4*4*256 FLOPs + 2 x 100,270,080 x 1,024 + the head 2 x 262,144 x 640
    assert cost.prefill_flops(1024) == 30_623_662_080 + 205_353_123_840 + 335_544_320


def test_an_asymmetric_int8_head_and_per_row_scales():
    arch = describe(SMOLLM2_135M)
    per_row = token_cost(arch, Scheme(bits=8, group_size=None, zero_point=True, head_bits=8))
    # one scale (2 B) and one 8-bit zero point per output row: 576 + 192*2 + 576 + 1536*2 + 576 = 5,184 rows
    assert per_row.layer_bytes == 30 * (3_538_944 + 5_184 * 3 + 2_304) + 1_152
    # the tied head at 8 bits in groups: 49,152 rows x 1 B x 576 + one scale and zero point a row
    assert per_row.head_bytes == 49152 * 576 + 49152 * 3
    assert per_row.embedding_table_bytes == per_row.head_bytes  # one table for both


def test_a_family_the_description_cannot_count_is_refused_not_guessed():
    with pytest.raises(ValueError, match="model_type"):
        describe(SMOLLM2_135M | {"model_type": "mamba", "architectures": ["MambaForCausalLM"]})
