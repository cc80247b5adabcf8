"""Text encoder: CLIP-style causal transformer over the prompt's 32 token ids, projected to d_model.

Maths from Meta's `sam3/model/text_encoder_ve.py` (`VETextEncoder` -> `TextTransformer` ->
`Transformer` -> `ResidualAttentionBlock`), checkpoint prefix `backbone.language_backbone.`:

    x = token_embedding(ids) + positional_embedding[:L]          # learned, added once
    per block: x += attn(ln_1(x), causal);  x += c_proj(gelu(c_fc(ln_2(x))))   # pre-norm
    features = resizer(ln_final(x))                              # every token, not a pooled vector

Meta's block uses `nn.MultiheadAttention(batch_first=True)` with an additive -inf upper-triangular
mask; here SDPA with `is_causal=True` (same maths). GELU is the exact (erf) one, LayerNorm eps 1e-5.
Padding tokens are encoded like any other token: the causal mask keeps them out of the real tokens'
features, and the fusion encoder / decoder ignore them through the padding mask.

Meta vs ours at the boundary: Meta returns `(mask [P, L] bool, memory [L, P, d], embeds [L, P, width])`
with mask True = padding (it computes `ids != 0` and inverts it, "because it's the opposite in
pytorch transformer"), memory sequence-first. Ours returns batch-first `features [P, L, d]` and the
same mask; Meta's third output (raw token embeddings, `language_embeds`) is not read by the image
model and is not produced.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from sammie.config import Sam3Config
from sammie.tokenizer import PAD_ID

# Meta's TextTransformer always builds `text_projection` [width, 512] (its default output_dim; the
# VETextEncoder never changes it) and multiplies it into a pooled output it then throws away. We keep
# the parameter so Meta's state dict loads strictly, and never compute with it.
TEXT_PROJECTION_DIM = 512
UNUSED_REFERENCE_KEYS = ("encoder.text_projection",)
IGNORED_REFERENCE_KEYS = ()  # nothing of Meta's is dropped (its causal mask buffer is non-persistent)


class CausalSelfAttention(nn.Module):
    """`nn.MultiheadAttention` parameter layout (`in_proj_weight` = q, k, v stacked), causal SDPA."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, L, w]
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # [P, L, 3w]
        q, k, v = qkv.unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)  # [P, h, L, w/h] each
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [P, h, L, w/h]
        return self.out_proj(out.transpose(1, 2).flatten(2))  # [P, L, w]


class ResidualAttentionBlock(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        hidden = int(width * mlp_ratio)  # Meta: mlp_ratio 4.0
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict([("c_fc", nn.Linear(width, hidden)), ("gelu", nn.GELU()), ("c_proj", nn.Linear(hidden, width))])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, L, w]
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        self.resblocks = nn.ModuleList(ResidualAttentionBlock(width, heads) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.resblocks:
            x = block(x)
        return x


class TextTransformer(nn.Module):
    """Token states after `ln_final`: `[P, L] long -> [P, L, width]`."""

    def __init__(self, cfg: Sam3Config):
        super().__init__()
        t = cfg.text
        self.token_embedding = nn.Embedding(t.vocab_size, t.width)
        self.positional_embedding = nn.Parameter(torch.empty(t.context_length, t.width))
        self.transformer = Transformer(t.width, t.depth, t.heads)
        self.ln_final = nn.LayerNorm(t.width)
        self.text_projection = nn.Parameter(torch.empty(t.width, TEXT_PROJECTION_DIM))  # unused, see above
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        nn.init.normal_(self.positional_embedding, std=0.01)
        nn.init.normal_(self.text_projection, std=t.width**-0.5)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        seq_len = token_ids.shape[1]
        x = self.token_embedding(token_ids) + self.positional_embedding[:seq_len]  # [P, L, w]
        return self.ln_final(self.transformer(x))  # [P, L, w]


class TextEncoder(nn.Module):
    """`forward(token_ids [P, L] long, L <= context_length) -> (features [P, L, d_model] float,
    padding_mask [P, L] bool, True = padding)`.

    `padding_mask` is `token_ids == 0`, exactly Meta's rule, so it also flags a word-internal "!"
    BPE piece (id 0, e.g. in "hello!~") as padding, as Meta does. It is the key_padding_mask
    convention of `nn.MultiheadAttention` / `sammie.model.attention` (True = ignore this key).
    """

    def __init__(self, cfg: Sam3Config):
        super().__init__()
        self.encoder = TextTransformer(cfg)
        self.resizer = nn.Linear(cfg.text.width, cfg.d_model)

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = self.resizer(self.encoder(token_ids))  # [P, L, d_model]
        return features, token_ids == PAD_ID  # [P, L, d], [P, L]
