"""The SAM 3 image trunk: a ViTDet-style ViT with windowed + global attention and 2-D RoPE.

Maths from Meta's `sam3/model/vitdet.py` (`ViT`, `Block`, `Attention`, `compute_axial_cis`,
`apply_rotary_enc`, `get_abs_pos`, `window_partition`), at the configuration of
`sam3/model_builder.py` (`_create_vit_backbone`):

    pixels [B,3,S,S] -> patch conv (no bias) -> + abs-pos table tiled from the pretrain grid
    -> LayerNorm (ln_pre) -> `depth` pre-norm blocks -> [B, width, G, G]     (no ln_post)

Each block is x += attn(norm1(x)); x += mlp(norm2(x)), with GELU (erf) in the MLP. Blocks in
`global_blocks` attend over all G*G tokens; the others attend inside non-overlapping
window_size^2 windows. Both use 2-D axial RoPE on q and k: the first half of each head's
(interleaved) rotation pairs turns with the column index, the second half with the row index.
Window blocks use positions 0..window_size-1; global blocks use positions 0..G-1 scaled by
window_size / G ("interpolated" RoPE, Meta's `scale_pos`), so both see the same angle range.

Token order. Everything in a block except attention acts per token, so runs of window blocks
keep their tokens in *window-major* order ([B, windows, window_size^2, C] flattened): a window
block is then a free view [B*windows, window_size^2, C]. Global blocks run in row-major order.
The order changes only where the kind of block changes (2 copies per global block; Meta makes 2
per window block), and every attention sums in Meta's token order, so fp32 results are
bit-equal to Meta's on CPU (tests/test_vision.py, tests/test_end_to_end.py).

Checkpoint keys equal Meta's `backbone.vision_backbone.trunk.*`, except the RoPE tables (see
`IGNORED_REFERENCE_SUFFIX`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sammie.config import VisionConfig

# Meta stores each block's RoPE table as a persistent complex64 buffer
# `blocks.N.attn.freqs_cis` ([window^2, head_dim/2] or [G^2, head_dim/2]). We recompute real
# cos/sin tables (non-persistent) instead, so these keys are dropped when loading; the loader can
# check them against `rope_reference_table` / `ViT.reference_freqs_cis()`.
IGNORED_REFERENCE_SUFFIX = ".attn.freqs_cis"


def is_ignored_reference_key(key: str) -> bool:
    """True for Meta trunk keys we deliberately do not keep (the complex RoPE tables)."""
    return key.endswith(IGNORED_REFERENCE_SUFFIX)


# --- 2-D axial RoPE ---------------------------------------------------------------------


def rope_angles(side: int, head_dim: int, theta: float, scale: float, device=None) -> torch.Tensor:
    """Rotation angles for a side x side grid in row-major order: [side^2, head_dim/2] float32.

    Pair j < head_dim/4 turns by col * scale * f_j, pair head_dim/4 + j by row * scale * f_j,
    with f_j = theta^(-4j/head_dim) (Meta's `compute_axial_cis`, same float32 op order).
    """
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 4, dtype=torch.float32, device=device) / head_dim)
    t = torch.arange(side * side, dtype=torch.float32, device=device)
    col = (t % side) * scale  # [side^2]
    row = torch.div(t, side, rounding_mode="floor") * scale
    return torch.cat((torch.outer(col, freqs), torch.outer(row, freqs)), dim=-1)  # [side^2, head_dim/2]


def rope_scale(cfg: VisionConfig, global_attention: bool) -> float:
    """Meta's `scale_pos`: RoPE was trained on window_size^2 grids; global blocks squeeze
    their G positions into the same range (window_size / G), window blocks use 1."""
    return cfg.window_size / cfg.grid_size if global_attention else 1.0


def rope_reference_table(cfg: VisionConfig, global_attention: bool, device=None) -> torch.Tensor:
    """The complex64 table Meta keeps in `blocks.N.attn.freqs_cis` for this kind of block:
    [window_size^2, head_dim/2] (window) or [G^2, head_dim/2] (global), row-major tokens.
    Our cos/sin buffers are its real and imaginary parts."""
    side = cfg.grid_size if global_attention else cfg.window_size
    angles = rope_angles(side, cfg.width // cfg.heads, cfg.rope_theta, rope_scale(cfg, global_attention), device)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2j, 2j+1) of x by the angles behind cos/sin.

    x: [N, heads, L, head_dim]; cos, sin: [L, head_dim/2]. Real-arithmetic form of Meta's
    `view_as_complex(x) * freqs_cis`; runs in x's dtype (Meta upcasts to float32 only because
    complex multiplication needs it)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)  # [N, heads, L, head_dim/2] each
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


# --- window-major token order ------------------------------------------------------------


def to_window_major(x: torch.Tensor, window: int) -> torch.Tensor:
    """[B, G, G, C] row-major grid -> [B, G*G, C] with each window's tokens contiguous
    (windows in row-major order, tokens row-major inside a window: Meta's `window_partition`)."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, H * W, C)


def from_window_major(x: torch.Tensor, window: int, side: int) -> torch.Tensor:
    """Inverse of `to_window_major`: [B, G*G, C] -> [B, G, G, C] (Meta's `window_unpartition`)."""
    B, _, C = x.shape
    n = side // window
    x = x.view(B, n, n, window, window, C)
    return x.permute(0, 1, 3, 2, 4, 5).reshape(B, side, side, C)


# --- modules (names follow Meta's state-dict keys) ---------------------------------------


class PatchEmbed(nn.Module):
    """pixels [B, 3, S, S] -> patch tokens [B, G, G, width] (G = S / patch_size), Meta's stride-p conv.

    On CUDA the conv runs as one GEMM over the unfolded patches ([B*G*G, 3*p*p] @ [3*p*p, width]): cuDNN serves this
    conv (3 input channels, 14 x 14 kernel, stride 14) with a CUDA-core kernel (`implicit_convolve_sgemm`), 2.45 ms
    per batch of 8 on the H200 (compiled stage profile, RESULTS.md), where the same 50 GFLOP on tensor cores take
    ~0.1 ms. The products are the conv's (the weight flattened in its (c, kh, kw) order); only the summation order
    differs, so fp32 agrees to rounding (`tests/test_vision.py`). Elsewhere (CPU) the conv stays: it keeps fp32
    bit-equal to Meta's model there. `as_gemm` overrides the choice (None: by device)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        p = cfg.patch_size
        self.proj = nn.Conv2d(3, cfg.width, kernel_size=p, stride=p, bias=False)
        self.as_gemm: bool | None = None

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if not (self.as_gemm if self.as_gemm is not None else pixels.is_cuda):
            return self.proj(pixels).permute(0, 2, 3, 1)  # [B, G, G, width], channels-last memory
        B, C, S, W = pixels.shape
        p = self.proj.kernel_size[0]
        G = S // p
        if S != W or S % p or self.proj.bias is not None:  # the detector's pixels always qualify (VisionConfig)
            raise ValueError(f"PatchEmbed as a GEMM needs square pixels whose side is a multiple of {p} and no conv "
                             f"bias, got {tuple(pixels.shape)}, bias {self.proj.bias is not None}")
        # [B, C, G, p, G, p] -> [B, G, G, C, p, p]: one copy, each patch's values in the weight's (c, kh, kw) order
        patches = pixels.view(B, C, G, p, G, p).permute(0, 2, 4, 1, 3, 5).reshape(B, G, G, C * p * p)
        return patches @ self.proj.weight.reshape(self.proj.out_channels, C * p * p).t()  # [B, G, G, width]


# Devices where `Mlp.fused_gelu` takes cuBLASLt's GEMM + GELU epilogue (a module attribute so the CPU tests can
# exercise the path: on the CPU `torch._addmm_activation` applies the exact GELU).
FUSED_GELU_DEVICES = ("cuda",)


class Mlp(nn.Module):
    """fc1 -> GELU -> fc2. `fused_gelu` (off by default; `set_fused_gelu`): on CUDA, fc1 and the GELU as one cuBLASLt
    GEMM with its GELU epilogue (`torch._addmm_activation`), which spares the separate GELU pass over the 4,736-wide
    hidden activations (9.4 ms of ~117 per batch of 8 on the H200, compiled stage profile). cuBLASLt's GELU is the
    tanh approximation, not Meta's exact (erf) GELU: the two differ by at most 4.7e-4 absolute (at x ~ 2.7, where a
    bf16 ulp is 0.0156), so in bf16 the fused path moves results at rounding level. It applies to a plain nn.Linear
    fc1 only (an FP8 fc1 keeps its own GEMM)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(width, hidden)
        self.fc2 = nn.Linear(hidden, width)
        self.fused_gelu = False

    def can_fuse_gelu(self) -> bool:
        """fc1 + GELU can be one cuBLASLt GEMM: a plain nn.Linear fc1 and an fc2 that does not apply the GELU itself
        (an FP8 fc2 with `applies_gelu`); the device is checked per call."""
        return type(self.fc1) is nn.Linear and not getattr(self.fc2, "applies_gelu", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gelu and x.device.type in FUSED_GELU_DEVICES and self.can_fuse_gelu():
            h = torch._addmm_activation(self.fc1.bias, x.reshape(-1, x.shape[-1]), self.fc1.weight.t(), use_gelu=True)
            return self.fc2(h.view(*x.shape[:-1], h.shape[-1]))
        h = self.fc1(x)
        if getattr(self.fc2, "applies_gelu", False):  # an FP8 fc2 whose quantiser applies the GELU (sammie.model.fp8)
            return self.fc2(h)
        return self.fc2(F.gelu(h))  # exact (erf) GELU, as nn.GELU() in Meta's timm Mlp


def set_fused_gelu(module: nn.Module, on: bool) -> list[Mlp]:
    """Turn `Mlp.fused_gelu` on or off in every ViT MLP under `module`; returns the MLPs it set."""
    mlps = [m for m in module.modules() if isinstance(m, Mlp)]
    for m in mlps:
        m.fused_gelu = on
    return mlps


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)  # one GEMM for q, k, v (Meta's layout)
        self.proj = nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        N, L, C = x.shape  # N = B * windows (window block) or B (global block)
        qkv = self.qkv(x).view(N, L, 3, self.heads, C // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [N, heads, L, head_dim] each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = F.scaled_dot_product_attention(q, k, v)  # scale head_dim^-0.5, no mask
        return self.proj(x.transpose(1, 2).reshape(N, L, C))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig, global_attention: bool):
        super().__init__()
        self.global_attention = global_attention
        self.tokens_per_group = cfg.grid_size**2 if global_attention else cfg.window_size**2
        self.norm1 = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)
        self.mlp = Mlp(cfg.width, cfg.mlp_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # [B, G*G, C], window-major
        # Window block: each window is one attention group (a free view thanks to the order).
        h = self.norm1(x).view(-1, self.tokens_per_group, C)  # [B*groups, tokens, C]
        x = x + self.attn(h, cos, sin).view(B, T, C)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Image trunk. forward(pixels [B,3,S,S] float) -> [B, width, G, G] (G = S / patch_size),
    same dtype as the weights; memory is channels-last (a permuted view of [B, G, G, width])."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        P = cfg.pretrain_grid_size
        self.patch_embed = PatchEmbed(cfg)
        # Meta's pretrain table keeps a cls slot at index 0; the detector never uses it.
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + P * P, cfg.width))  # [1, 1+P^2, width]
        self.blocks = nn.ModuleList(Block(cfg, i in cfg.global_blocks) for i in range(cfg.depth))
        self.ln_pre = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)  # registered last, as in Meta
        self._register_rope_buffers()

    def _register_rope_buffers(self, device=None) -> None:
        """cos/sin tables, float32 at creation; `.to(dtype)` moves them with the weights."""
        cfg = self.cfg
        hd = cfg.width // cfg.heads
        window = rope_angles(cfg.window_size, hd, cfg.rope_theta, rope_scale(cfg, False), device)  # [w^2, hd/2]
        glob = rope_angles(cfg.grid_size, hd, cfg.rope_theta, rope_scale(cfg, True), device)  # [G^2, hd/2] row-major
        for name, angles in (("window", window), ("global", glob)):
            # via torch.polar, as Meta builds its table: its cos can differ from angles.cos() by
            # one ulp, and bit-equal tables keep fp32 results bit-equal to Meta's
            table = torch.polar(torch.ones_like(angles), angles)
            self.register_buffer(f"rope_{name}_cos", table.real.contiguous(), persistent=False)
            self.register_buffer(f"rope_{name}_sin", table.imag.contiguous(), persistent=False)

    def reset_buffers(self, device=None) -> None:
        """Recompute the non-persistent RoPE tables (e.g. after `to_empty` from the meta device)."""
        device = device if device is not None else self.pos_embed.device
        dtype = self.rope_window_cos.dtype
        self._register_rope_buffers(device)
        for name in ("rope_window_cos", "rope_window_sin", "rope_global_cos", "rope_global_sin"):
            setattr(self, name, getattr(self, name).to(dtype))

    def reference_freqs_cis(self) -> dict[str, torch.Tensor]:
        """Meta's `blocks.N.attn.freqs_cis` buffers as they should be for this config (complex64)."""
        tables = {g: rope_reference_table(self.cfg, g) for g in (False, True)}
        return {f"blocks.{i}.attn.freqs_cis": tables[b.global_attention] for i, b in enumerate(self.blocks)}

    def abs_pos(self) -> torch.Tensor:
        """The pretrain table tiled over the token grid (Meta's `get_abs_pos(tiling=True)`):
        [1, G, G, width], token (i, j) gets table entry (i mod P, j mod P)."""
        P, G = self.cfg.pretrain_grid_size, self.cfg.grid_size
        table = self.pos_embed[:, 1:].view(1, P, P, -1)  # drop the cls slot
        return table.repeat(1, G // P, G // P, 1)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        G, w = cfg.grid_size, cfg.window_size
        x = self.patch_embed(pixels)  # [B, G, G, width]
        x = self.ln_pre(x + self.abs_pos())
        B, C = x.shape[0], x.shape[-1]
        # Window blocks run in window-major token order (a window is a free view), global blocks
        # in row-major order. Switching only where the kind of block changes costs 2 copies per
        # global block instead of Meta's 2 per window block, and keeps every attention sum in
        # Meta's token order, so fp32 results match Meta's bit for bit on CPU.
        windowed = False
        x = x.reshape(B, G * G, C)
        for blk in self.blocks:
            if blk.global_attention and windowed:
                x, windowed = from_window_major(x, w, G).reshape(B, G * G, C), False
            elif not blk.global_attention and not windowed:
                x, windowed = to_window_major(x.view(B, G, G, C), w), True
            if blk.global_attention:
                x = blk(x, self.rope_global_cos, self.rope_global_sin)
            else:
                x = blk(x, self.rope_window_cos, self.rope_window_sin)
        x = from_window_major(x, w, G) if windowed else x.view(B, G, G, C)  # [B, G, G, width]
        return x.permute(0, 3, 1, 2)  # [B, width, G, G], channels-last memory
