"""What one token costs a model: the bytes a decode step reads (by layer, embedding and head), the KV cache a token
keeps and a step reads back, and the FLOPs of a prefill. Counted from the model description
(edgeflow/model/architecture.py `Architecture`) and a weight scheme; nothing is measured here.

Conventions (each a choice a runtime may make differently, which is what the runtime's efficiency factor absorbs):
- A linear layer of `bits`-bit weights in groups of `group_size` along its input carries one fp16 scale per group, and a
  `bits`-bit zero point per group when asymmetric (`group_size` None: one scale per output row).
- Norm weights and biases are fp16. The embedding is a table of fp16 rows (one row read per token); a tied head is that
  table read in full at `head_bits` (16: the table itself), an untied head its own matrix at `head_bits`.
- The KV cache holds K and V of every layer's KV heads at `kv_bytes` per value; a sliding layer keeps and reads at most
  its window.
- A prefill of P tokens multiplies every linear weight by P rows (2 FLOPs per weight and row), attends causally (q.k
  and p.v: 4 x head_dim FLOPs per query head and attended key) and runs the head for its last token only.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from edgeflow.model.architecture import Architecture

Bits = Literal[4, 8, 16, 32]


class Scheme(BaseModel):
    """How a variant stores its weights and its KV cache."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bits: Bits = Field(description="Bits per linear-layer weight: 4 and 8 (quantized), 16 (fp16/bf16), 32 (fp32).")
    group_size: int | None = Field(default=128, gt=0, description="Weights per scale along a row's input; None: one "
                                   "scale per output row. Ignored at 16 and 32 bits.")
    zero_point: bool = Field(default=False, description="Asymmetric: a zero point per group besides its scale.")
    head_bits: Bits = Field(default=16, description="Bits per weight of the output head.")
    kv_bytes: float = Field(default=2, gt=0, le=4, description="Bytes per cached K or V value (2: fp16, 1: fp8/int8).")

    def matrix_bytes(self, rows: int, cols: int, bits: int | None = None) -> float:
        """Bytes of one [rows, cols] weight matrix (rows: outputs) with its scales and zero points."""
        bits = self.bits if bits is None else bits
        weights = rows * cols * bits / 8
        if bits >= 16:
            return weights
        groups = rows * (-(-cols // self.group_size) if self.group_size else 1)
        return weights + groups * (2 + (bits / 8 if self.zero_point else 0))


class TokenCost(BaseModel):
    """One model's per-token costs under one scheme (see the module doc for what is counted how)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    layer_bytes: float = Field(description="Bytes of every decoder layer's weights, norms and biases: read once per decode step.")
    embedding_row_bytes: float = Field(description="Bytes of one embedding row: read once per token.")
    embedding_table_bytes: float = Field(description="Bytes of the embedding table resident in memory.")
    head_bytes: float = Field(description="Bytes of the output head read per decode step (the tied table, or its own matrix).")
    tied_head: bool = Field(description="The head is the embedding table (resident once).")
    linear_params: int = Field(description="Weights of every decoder layer's linear layers (the prefill's matmuls).")
    windows: tuple[int | None, ...] = Field(description="Per layer: its sliding window, or None.")
    kv_per_layer_token: float = Field(description="KV cache bytes one token keeps in one layer.")
    attn_flops_per_key: float = Field(description="FLOPs one query token spends on one attended key in one layer.")
    head_flops: float = Field(description="FLOPs of the head for one token.")
    weight_bits: int = Field(description="The layers' weight width (the scheme's bits): a runtime whose kernels differ "
                             "by width has factors per width (edgeflow/estimate/runtimes.py).")

    @property
    def step_weight_bytes(self) -> float:
        """Weight bytes one decode step reads, whatever the number of streams it carries."""
        return self.layer_bytes + self.head_bytes

    @property
    def resident_weight_bytes(self) -> float:
        """Weight bytes the engine keeps in memory: the layers, the embedding table and an untied head."""
        return self.layer_bytes + self.embedding_table_bytes + (0 if self.tied_head else self.head_bytes)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes one token keeps across all layers (a sliding layer stops growing at its window)."""
        return self.kv_per_layer_token * len(self.windows)

    def _keys(self, context: int) -> int:
        """Positions one query attends to at `context` tokens, summed over the layers (a sliding layer: its window)."""
        return sum(min(context, w) if w else context for w in self.windows)

    def kv_read_bytes(self, context: int) -> float:
        """KV cache bytes one stream's decode step reads at `context` tokens."""
        return self.kv_per_layer_token * self._keys(context)

    def kv_resident_bytes(self, tokens: int) -> float:
        """KV cache bytes one session of `tokens` tokens keeps."""
        return self.kv_read_bytes(tokens)

    def prefill_flops(self, prompt: int) -> float:
        """FLOPs of a prefill of `prompt` tokens: the linear layers on every token, causal attention, the last
        token's head."""
        attended = 0
        for w in self.windows:
            if w is None or w >= prompt:
                attended += prompt * (prompt + 1) // 2
            else:  # the first w queries see 1..w keys, the rest w each
                attended += w * (w + 1) // 2 + (prompt - w) * w
        return 2 * self.linear_params * prompt + self.attn_flops_per_key * attended + self.head_flops

    def decode_flops(self, context: int) -> float:
        """FLOPs of one stream's decode step at `context` tokens."""
        return 2 * self.linear_params + self.attn_flops_per_key * self._keys(context) + self.head_flops


def token_cost(arch: Architecture, scheme: Scheme) -> TokenCost:
    """The per-token costs of `arch` stored as `scheme`."""
    h, hd, inter = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
    mats = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]  # q k v o gate up down: [out, in]
    linear = sum(r * c for r, c in mats)
    small = (h * (4 if arch.sandwich_norms else 2) + (2 * hd if arch.qk_norm else 0)
             + (q + 2 * kv if arch.qkv_bias else 0) + (h if arch.o_bias else 0)
             + (2 * inter + h if arch.mlp_bias else 0))
    per_layer = sum(scheme.matrix_bytes(r, c) for r, c in mats) + 2 * small
    head = scheme.matrix_bytes(arch.vocab_size, h, scheme.head_bits)
    # tied: one table, read by rows for the embedding and whole for the head; untied: the embedding's own fp16 table
    table = head if arch.tie_word_embeddings else arch.vocab_size * h * 2.0
    kv_layer = 2 * kv * scheme.kv_bytes
    windows = tuple(arch.window(i) for i in range(arch.num_hidden_layers))
    return TokenCost(
        layer_bytes=arch.num_hidden_layers * per_layer + 2 * h,  # + the final norm
        embedding_row_bytes=h * 2.0, embedding_table_bytes=table, head_bytes=head, tied_head=arch.tie_word_embeddings,
        linear_params=arch.num_hidden_layers * linear, windows=windows, kv_per_layer_token=kv_layer,
        attn_flops_per_key=4.0 * arch.num_attention_heads * hd, head_flops=2.0 * arch.vocab_size * h,
        weight_bits=scheme.bits,
    )
