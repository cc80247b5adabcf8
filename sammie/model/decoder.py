"""DETR decoder: 200 object queries + a presence token attend to the prompt and the fused image.

Maths from Meta's `sam3/model/decoder.py` (`TransformerDecoder`, `TransformerDecoderLayer`) and
`sam3/model/model_misc.py` (`MLP`, `gen_sineembed_for_position`, `inverse_sigmoid`), as built by
`sam3/model_builder.py` (`boxRPB="log"`, `box_refine=True`, `presence_token=True`,
`use_text_cross_attention=True`) and driven in eval mode by `sam3/model/sam3_image.py`
`Sam3Image._run_decoder` / `_update_scores_and_boxes`:

    x  = [presence_token; query_embed]                       # [N, 1+Q, d], presence at row 0
    r0 = sigmoid(reference_points)                           # [N, Q, 4] cxcywh in [0, 1]
    per layer l, with reference boxes r:
        pos  = [0; ref_point_head(sine(r))]                  # presence token has no position
        bias = [0; boxRPB_x(logdist_x(r)) + boxRPB_y(logdist_y(r))]   # [N, heads, 1+Q, G*G]
        x = norm2(x + self_attn(q=k=x+pos, v=x))
        x = catext_norm(x + ca_text(q=x+pos, k=v=prompt, prompt padding masked))
        x = norm1(x + cross_attn(q=x+pos, k=memory+memory_pos, v=memory, + bias))
        x = norm3(x + linear2(relu(linear1(x))))
        r = sigmoid(inverse_sigmoid(r) + bbox_embed(norm(x[:, 1:])))
    queries  = norm(x[:, 1:]);  boxes = the last r
    presence = presence_token_head(presence_token_out_norm(x[:, 0]))
    logits   = DotProductScoring(queries, prompt)            # sammie/model/scoring.py

Only the last layer's outputs are returned (Meta stacks every layer for its auxiliary losses;
`_update_out` keeps `[-1]` as the output in eval). Eval only: `dac` (the duplicated one-to-many query half) is a
training branch (`apply_dac = decoder.dac and self.training`), so there are `num_queries` queries.

Deliberate differences, none of which changes the fp32 result:
- no `valid_ratios` / `level_start_index` / `spatial_shapes` inputs: the image path has one
  level and no padding mask, so `valid_ratios` is all ones (the multiply is exact) and the
  level is the `cfg.feat_size` square grid;
- the pixel coordinates of the box bias (`compilable_cord_cache` / `coord_cache` in Meta, plain
  attributes, not state) are rebuilt in each forward as an fp32 `arange`, a constant under
  `torch.compile`;
- the presence logit is NOT clamped: Meta's `clamp_presence_logits` branch calls the
  out-of-place `Tensor.clamp` and drops the result, so its ±10 clamp never happens;
- under `model.to(bfloat16)` the tiny box state (reference boxes, their sine embedding and the
  box-bias distances) stays fp32, as it does in Meta's bf16-autocast runs (autocast only casts
  matmuls); in bf16 a box cx in [0.5, 1) would step by 2^-8 of the image, ~4 px at 1008.
- Meta wraps the FFN in `autocast(device_type="cuda", enabled=False)` (`decoder.py:74`). Under
  bf16 autocast its input is the fp32 output of `norm1` (autocast runs LayerNorm in fp32), so
  the FFN becomes an fp32 (TF32) island; without autocast the context does nothing. Here the
  FFN runs in the module dtype: on an H200 with random full-size weights, forcing it to fp32
  moved the bf16 error vs fp32 only from 7.3e-3 to 7.0e-3 on the queries (Meta's own autocast
  run: 3.3e-3 with the island, 4.0e-3 without), so it is not worth the casts.

Every parameter keeps Meta's `transformer.decoder.*` name (relative to the decoder); the
scorer's keys live at Meta's top level (`dot_prod_scoring.*`), so it is passed to `forward`
instead of being a child module.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sammie.config import Sam3Config
from sammie.model.attention import MultiheadAttention

if TYPE_CHECKING:
    from sammie.model.scoring import DotProductScoring

# Meta state-dict keys of `TransformerDecoder` that this module does not keep: none. (Meta's
# coordinate caches are plain attributes, not buffers; `instance_*` and `fine_layers` modules
# exist only with `instance_query` / `separate_*_instance` / `interaction_layer`, all off.)
IGNORED_REFERENCE_KEYS: tuple[str, ...] = ()

INVERSE_SIGMOID_EPS = 1e-3  # Meta's `inverse_sigmoid` default: logits limited to about ±6.9
RPB_LOG_SCALE = 8.0  # box-bias distances are scaled to [-8, 8] then log2(|d| + 1) / log2(8)


class DecoderOutput(NamedTuple):
    queries: torch.Tensor  # [N, Q, d] last layer, after the final `norm` (the mask head's input)
    boxes: torch.Tensor  # [N, Q, 4] float32 cxcywh in [0, 1] (Meta's `pred_boxes`)
    presence_logits: torch.Tensor  # [N, 1] (Meta's `presence_logit_dec`), unclamped
    logits: torch.Tensor  # [N, Q] per-query scores, clamped to ±12 (Meta's `pred_logits[..., 0]`)


class MLP(nn.Module):
    """Meta's `model_misc.MLP`: `num_layers` Linear layers (`layers.i`) with ReLU between, an
    optional residual (input added to the output) and an optional LayerNorm (`out_norm`) last."""

    def __init__(
        self, in_dim: int, hidden_dim: int, out_dim: int, num_layers: int,
        residual: bool = False, out_norm: bool = False,
    ):
        super().__init__()
        if residual and in_dim != out_dim:
            raise ValueError("a residual MLP needs in_dim == out_dim")
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.residual = residual
        self.out_norm = nn.LayerNorm(out_dim) if out_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for i, layer in enumerate(self.layers):
            y = layer(y)
            if i < len(self.layers) - 1:
                y = F.relu(y)
        if self.residual:
            y = y + x
        return y if self.out_norm is None else self.out_norm(y)


def inverse_sigmoid(x: torch.Tensor, eps: float = INVERSE_SIGMOID_EPS) -> torch.Tensor:
    """log(x / (1 - x)) with both terms floored at `eps` (Meta's `model_misc.inverse_sigmoid`)."""
    x = x.clamp(0.0, 1.0)
    return torch.log(x.clamp(min=eps) / (1.0 - x).clamp(min=eps))


def box_sine_embed(boxes: torch.Tensor, d_model: int) -> torch.Tensor:
    """Meta's `gen_sineembed_for_position` for cxcywh boxes: [..., 4] -> [..., 2 * d_model].

    Each coordinate gets d_model / 2 features, (sin, cos) pairs of `2*pi*c / 10000^(2k / (d/2))`,
    concatenated in the order (cy, cx, w, h). Computed in the dtype of `boxes` (fp32 here)."""
    n = d_model // 2  # features per coordinate
    k = torch.arange(n // 2, device=boxes.device, dtype=torch.float32)
    dim_t = 10000.0 ** (2 * k / n)  # [n/2] the wavelength of pair k
    # [..., 4] in Meta's (y, x, w, h) order; slices, not a list index: a list becomes a host tensor copied to the
    # device on every call, which CUDA graph capture refuses (and which costs a sync-free but real H2D copy)
    coords = torch.cat([boxes[..., 1:2], boxes[..., 0:1], boxes[..., 2:4]], dim=-1) * (2 * math.pi)
    angles = coords[..., None] / dim_t  # [..., 4, n/2]
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-3)  # [..., 4 * n]


def _log_distance(coords: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """Signed log distance from every grid coordinate to both box edges.

    coords [G] fp32 in [0, 1); edges [N, Q, 2] (low, high) -> [N, Q, G, 2]."""
    d = (coords[:, None] - edges[..., None, :]) * RPB_LOG_SCALE  # [N, Q, G, 2]
    return torch.sign(d) * torch.log2(d.abs() + 1.0) / math.log2(RPB_LOG_SCALE)


class DecoderLayer(nn.Module):
    """Meta's post-norm `TransformerDecoderLayer` with text cross-attention; keys `self_attn`,
    `ca_text`, `cross_attn`, `norm1..3`, `catext_norm`, `linear1`, `linear2`."""

    def __init__(self, d_model: int, heads: int, ffn_dim: int):
        super().__init__()
        self.cross_attn = MultiheadAttention(d_model, heads)
        self.norm1 = nn.LayerNorm(d_model)
        self.ca_text = MultiheadAttention(d_model, heads)
        self.catext_norm = nn.LayerNorm(d_model)
        self.self_attn = MultiheadAttention(d_model, heads)
        self.norm2 = nn.LayerNorm(d_model)
        self.linear1 = nn.Linear(d_model, ffn_dim)
        self.linear2 = nn.Linear(ffn_dim, d_model)
        self.norm3 = nn.LayerNorm(d_model)

    def forward(
        self,
        x: torch.Tensor,  # [N, 1+Q, d] presence token at row 0, then the queries
        pos: torch.Tensor,  # [N, 1+Q, d] query position (zero row for the presence token)
        prompt: torch.Tensor,  # [N, L, d]
        prompt_padding: torch.Tensor,  # [N, L] bool, True = pad
        memory: torch.Tensor,  # [N, HW, d] image values
        memory_keys: torch.Tensor,  # [N, HW, d] memory + memory_pos
        bias: torch.Tensor,  # [N, heads, 1+Q, HW] box relative-position bias
    ) -> torch.Tensor:
        qk = x + pos
        x = self.norm2(x + self.self_attn(qk, qk, x))
        x = self.catext_norm(x + self.ca_text(x + pos, prompt, prompt, key_padding_mask=prompt_padding))
        x = self.norm1(x + self.cross_attn(x + pos, memory_keys, memory, attn_bias=bias))
        return self.norm3(x + self.linear2(F.relu(self.linear1(x))))


class Decoder(nn.Module):
    """`forward(memory [N, HW, d], memory_pos [N, HW, d], prompt [N, L, d], prompt_padding [N, L]
    bool True = pad, scoring: DotProductScoring) -> DecoderOutput`.

    memory is the fusion encoder's output over the `cfg.feat_size`^2 grid (row-major, HW = G*G),
    memory_pos the image sine position encoding of the same grid, prompt the encoded prompt
    tokens (text + geometry) with their padding mask. Every prompt needs >= 1 valid token.
    """

    def __init__(self, cfg: Sam3Config):
        super().__init__()
        d, q = cfg.d_model, cfg.num_queries
        if not cfg.presence_token:
            raise ValueError("the SAM 3 decoder is built with a presence token")
        self.d_model, self.heads, self.grid = d, cfg.heads, cfg.feat_size
        self.layers = nn.ModuleList(DecoderLayer(d, cfg.heads, cfg.ffn_dim) for _ in range(cfg.decoder_layers))
        self.norm = nn.LayerNorm(d)  # final norm, applied to the queries after every layer
        self.bbox_embed = MLP(d, d, 4, 3)  # box delta in logit space
        self.query_embed = nn.Embedding(q, d)
        self.reference_points = nn.Embedding(q, 4)  # initial boxes, pre-sigmoid cxcywh
        self.boxRPB_embed_x = MLP(2, d, cfg.heads, 2)  # per-head bias from (x - x0, x - x1)
        self.boxRPB_embed_y = MLP(2, d, cfg.heads, 2)  # per-head bias from (y - y0, y - y1)
        self.presence_token = nn.Embedding(1, d)
        self.presence_token_head = MLP(d, d, 1, 3)
        self.presence_token_out_norm = nn.LayerNorm(d)
        self.ref_point_head = MLP(2 * d, d, d, 2)  # query position from the box sine embedding

    def _box_bias(self, boxes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, Q, 4] fp32 cxcywh -> [N, heads, 1+Q, G*G] attention bias in `dtype`; the
        presence row is zero (Meta prepends `zeros_like` for it)."""
        g = self.grid
        coords = torch.arange(g, device=boxes.device, dtype=torch.float32) / g  # [G] cell corners
        cx, cy, w, h = boxes.unbind(-1)
        xs = torch.stack((cx - 0.5 * w, cx + 0.5 * w), dim=-1)  # [N, Q, 2] (x0, x1)
        ys = torch.stack((cy - 0.5 * h, cy + 0.5 * h), dim=-1)  # [N, Q, 2] (y0, y1)
        bx = self.boxRPB_embed_x(_log_distance(coords, xs).to(dtype))  # [N, Q, G(W), heads]
        by = self.boxRPB_embed_y(_log_distance(coords, ys).to(dtype))  # [N, Q, G(H), heads]
        # contiguous before the pad: a permuted [N, heads, 1+Q, W] is channels-last to torch, the pad and the add keep
        # that layout, and a bias whose last dim is not its innermost (stride(-1) = heads) is refused by SDPA's fused
        # kernels: the decoder's image cross-attention then ran SDPA's math fallback, which upcasts bf16 to fp32
        # (a lone request's profile, waterfall run 10: fp32 GEMMs and softmax, six per request)
        bx = F.pad(bx.permute(0, 3, 1, 2).contiguous(), (0, 0, 1, 0))[:, :, :, None, :]  # [N, heads, 1+Q, 1, W]
        by = F.pad(by.permute(0, 3, 1, 2).contiguous(), (0, 0, 1, 0))[:, :, :, :, None]  # [N, heads, 1+Q, H, 1]
        return (by + bx).flatten(3)  # [N, heads, 1+Q, H*W] contiguous, index y * W + x like the memory

    def forward(
        self,
        memory: torch.Tensor,  # [N, HW, d]
        memory_pos: torch.Tensor,  # [N, HW, d]
        prompt: torch.Tensor,  # [N, L, d]
        prompt_padding: torch.Tensor,  # [N, L] bool, True = pad
        scoring: DotProductScoring,
    ) -> DecoderOutput:
        n, hw, _ = memory.shape
        if hw != self.grid * self.grid:
            raise ValueError(f"memory has {hw} tokens, expected a {self.grid}x{self.grid} grid")
        dtype = self.query_embed.weight.dtype
        memory_keys = memory + memory_pos  # the same for every layer

        x = torch.cat((self.presence_token.weight, self.query_embed.weight))  # [1+Q, d]
        x = x.expand(n, -1, -1)  # [N, 1+Q, d]
        boxes = self.reference_points.weight.float().sigmoid().expand(n, -1, -1)  # [N, Q, 4] fp32

        for layer in self.layers:
            pos = self.ref_point_head(box_sine_embed(boxes, self.d_model).to(dtype))  # [N, Q, d]
            pos = F.pad(pos, (0, 0, 1, 0))  # [N, 1+Q, d]
            bias = self._box_bias(boxes, dtype)
            x = layer(x, pos, prompt, prompt_padding, memory, memory_keys, bias)
            queries = self.norm(x[:, 1:])  # [N, Q, d]
            boxes = (inverse_sigmoid(boxes) + self.bbox_embed(queries).float()).sigmoid()

        presence = self.presence_token_head(self.presence_token_out_norm(x[:, 0]))  # [N, 1]
        logits = scoring(queries, prompt, prompt_padding)  # [N, Q]
        return DecoderOutput(queries, boxes, presence, logits)
