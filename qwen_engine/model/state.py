"""Per-sequence decoding state: a KV cache per full-attention layer, conv + recurrent state per Gated DeltaNet layer.

One `QwenState` serves a batch of B sequences that advance together (same number of tokens so far); `forward(ids,
state)` appends to it in place, so prefill in any number of pieces followed by one-token decode steps gives the same
logits as one full-sequence forward.

The KV cache here is contiguous (`[B, kv_heads, max_len, head_dim]`), enough for the reference model and the tests.
Paged KV blocks plug in behind `KVCache.append`: a paged cache keeps a block table per sequence and per-sequence
lengths, `append` scatters the new keys/values into the sequence's blocks and returns what the attention needs (a
gather, or the block table for a paged-attention kernel). The GDN state is O(1) per sequence and needs no paging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FULL_ATTENTION, QwenConfig


@dataclass
class KVCache:
    """Keys/values of one full-attention layer (after k_norm and RoPE) for positions 0..length-1."""

    k: torch.Tensor  # [B, kv_heads, max_len, head_dim]
    v: torch.Tensor  # [B, kv_heads, max_len, head_dim]
    length: int = 0  # positions filled (shared by the batch)

    @classmethod
    def empty(cls, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device) -> "KVCache":
        shape = (batch, kv_heads, max_len, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v `[B, kv_heads, T, head_dim]` at positions length..length+T-1; return all keys/values so far."""
        t = k.shape[2]
        end = self.length + t
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache full: {self.length} + {t} tokens > max_len {self.k.shape[2]}")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


@dataclass
class GDNState:
    """Gated DeltaNet state of one layer: the last conv inputs and the fp32 delta-rule memory."""

    conv: torch.Tensor  # [B, conv_dim, kernel - 1] previous in_proj_qkv outputs (model dtype), oldest first
    recurrent: torch.Tensor  # [B, v_heads, k_head_dim, v_head_dim] fp32

    @classmethod
    def empty(cls, cfg: QwenConfig, batch: int, dtype, device) -> "GDNState":
        conv = torch.zeros(batch, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1, dtype=dtype, device=device)
        rec = torch.zeros(batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                          dtype=torch.float32, device=device)
        return cls(conv, rec)


@dataclass
class QwenState:
    """Decoding state of B sequences; `layers[i]` is a `KVCache` for full-attention layers, a `GDNState` otherwise."""

    layers: list[KVCache | GDNState]
    pos: int = 0  # tokens consumed so far = position id of the next token

    @classmethod
    def empty(cls, cfg: QwenConfig, batch: int, max_len: int, dtype=torch.float32, device=None) -> "QwenState":
        layers: list[KVCache | GDNState] = []
        for t in cfg.layer_types:
            if t == FULL_ATTENTION:
                layers.append(KVCache.empty(batch, cfg.num_key_value_heads, max_len, cfg.head_dim, dtype, device))
            else:
                layers.append(GDNState.empty(cfg, batch, dtype, device))
        return cls(layers)

    @property
    def batch(self) -> int:
        first = self.layers[0]
        return (first.k if isinstance(first, KVCache) else first.recurrent).shape[0]
