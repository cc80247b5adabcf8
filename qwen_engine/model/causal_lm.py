"""The causal LM: embeddings -> 40 decoder layers -> final zero-centred RMSNorm -> untied lm_head.

Mirrors `Qwen3_5MoeForCausalLM` (text only; the MTP head and vision tower are not part of it) in transformers 5.24
`modeling_qwen3_5_moe.py`. The forward is incremental: `forward(input_ids, state)` consumes T new tokens of B
sequences, reading and advancing `state` in place, so prefill (in one or several pieces) followed by one-token decode
steps equals a full-sequence forward (`state=None`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import QwenConfig
from .attention import RotaryEmbedding
from .decoder import DecoderLayer
from .norm import ZeroCentredRMSNorm
from .paged import FlatBatch, PagedCache
from .state import QwenState


class QwenForCausalLM(nn.Module):
    # `forward_paged`: each decoder layer's MoE combine also writes the next layer's input norm (with its FP8 codes)
    # or, after the last layer, the final norm, in the same launch where it can (`SparseMoE.forward_and_norm`):
    # 40 launches fewer per decode step; bit for bit the two launches under the interpreter, compiled the bf16 output
    # bit-identical and the norm within rms_norm_zc's tolerance (its sum of squares may reduce in another order). Set
    # by the engine (QwenEngineConfig.combine_next_norm)
    combine_next_norm: bool = False

    def __init__(self, cfg: QwenConfig, gdn_chunk_size: int = 64):
        super().__init__()
        if cfg.tie_word_embeddings:
            raise ValueError("tied embeddings are not supported (Qwen3.6-35B-A3B has a separate lm_head)")
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, gdn_chunk_size) for t in cfg.layer_types)
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg)

    def new_state(self, batch: int, max_len: int) -> QwenState:
        p = self.embed_tokens.weight  # lm_head may be a packed NVFP4 module without a `.weight`
        return QwenState.empty(self.config, batch, max_len, dtype=p.dtype, device=p.device)

    def forward(self, input_ids: torch.Tensor, state: QwenState | None = None,
                last_only: bool = False) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab] ([B, 1, vocab] with `last_only`)."""
        b, t = input_ids.shape
        if state is not None and state.batch != b:
            raise ValueError(f"input batch {b} != state batch {state.batch}")
        pos0 = 0 if state is None else state.pos
        positions = torch.arange(pos0, pos0 + t, device=input_ids.device)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, None if state is None else state.layers[i])
        if state is not None:
            state.pos += t
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))

    def forward_paged(self, input_ids: torch.Tensor, batch: FlatBatch, cache: PagedCache,
                      logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """A variable-length step: input_ids [N] (the flat tokens of `batch`'s sequences, decode rows first) ->
        logits [M, vocab] at the flat token indices `logits_indices` [M] (None: every token, M = N). Reads and
        advances each sequence's paged KV blocks and GDN state slot in place (the caller zeroes reset slots)."""
        x = self.embed_tokens(input_ids)  # [N, hidden]
        cos, sin = self.rotary.lookup(batch.positions, x.dtype)  # [N, rotary_dim]: positions < the reserved count
        normed = None  # (layer i's input norm of x, its FP8 codes), where layer i - 1's MoE combine wrote it
        for i, layer in enumerate(self.layers):
            nxt = None
            if self.combine_next_norm:  # the next layer's input norm, or the final norm, in this layer's combine
                nxt = (self.norm, None) if i + 1 == len(self.layers) else \
                    (self.layers[i + 1].input_layernorm, self.layers[i + 1].input_scale(x, batch))
            x, normed = layer.forward_paged(x, cos, sin, cache.layers[i], batch, normed, nxt)
        if normed is not None:  # the final norm of every row (row-wise: the selected rows' are the same)
            return self.lm_head(normed[0] if logits_indices is None else normed[0][logits_indices])
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(self.norm(x))


@torch.no_grad()
def greedy_generate(model: QwenForCausalLM, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Reference greedy decoding: one prefill, then one-token steps. input_ids [B, T] -> new tokens [B, n_new]."""
    state = model.new_state(input_ids.shape[0], input_ids.shape[1] + max_new_tokens)
    logits = model(input_ids, state, last_only=True)
    out = [logits[:, -1].argmax(-1, keepdim=True)]  # [B, 1] each
    for _ in range(max_new_tokens - 1):
        out.append(model(out[-1], state)[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, dim=1)
