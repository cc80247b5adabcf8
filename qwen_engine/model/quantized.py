"""Packed-weight modules of the NVFP4/FP8 checkpoint: drop-in replacements for the dense `nn.Linear` / `Experts` /
`SwiGLU` of the reference model, with the same `forward` signatures, computing through the kernel registry.

    NVFP4Linear   W4A16_NVFP4 linear (lm_head; shared expert when not fused): uint8 [N, K/2] + e4m3 [N, K/16] +
                  fp32 global per output row [N]  -> registry op "w4a16_linear" (Triton on CUDA, the exact-dequant
                  reference elsewhere). A layer exported as W4A4 (ModelOpt `NVFP4` with a static `input_scale`) may
                  instead run registry op "nvfp4_w4a4_linear" (`kernels/nvfp4.py`): see "W4A4" below.
    NVFP4SwiGLU   the shared expert with gate and up fused into one [2I, H] NVFP4 weight (per-row global scales keep
                  each half's ModelOpt `weight_scale_2` exact) + down [H, I]; the SiLU x up in the gate/up GEMM's
                  epilogue (registry op "w4a16_swiglu"): two launches for the whole expert
    NVFP4Experts  routed experts, stacked gate_up [E, 2I, H] and down [E, H, I] NVFP4 -> registry op "w4a16_moe"
                  (grouped Triton kernel: sort by expert, gate_up + SwiGLU, down + routing weight); on CUDA the
                  loader repacks their bytes into split halves for the swap-AB kernel (`repack`)
    FP8Linear     FP8 W8A8 static per-tensor (GDN in_proj_qkv / in_proj_z / out_proj, attention q/k/v/o):
                  e4m3 [N, K] + fp32 weight_scale [] + fp32 input_scale [] -> registry op "fp8_linear"
                  (on sm_89+: the decode GEMV for 1-4 rows, `torch._scaled_mm` beyond; the emulating reference
                  elsewhere); `fused_fp8_projections`: the projections that read one input as one FP8Linear in decode
                  steps

Formats: `kernels/nvfp4.py`; design doc `../shared/design/qwen3.6-nvfp4.md` sections 2.3-2.5, 4.

Numerics. The W4A16 ops dequantise exactly (E2M1 x e4m3 is exact in bf16) and accumulate in fp32, so with fp32
activations (CPU, reference path) an NVFP4 module equals the dense module holding the dequantised weight to fp32
rounding. FP8Linear quantises its input with the static `input_scale` (saturating e4m3, ~2^-4 relative rounding):
that is the checkpoint's W8A8 design, not a kernel error, and it does not exist in a dense model. `quantize_
activations=False` runs FP8 layers weight-only (dequantised weight, unquantised input) so that a test or the oracle
can separate the two effects.

Kernel choice: looked up in the registry once per (device, dtype, preference, variant) and cached on the module (the
registry docstring asks for `choose()` at plan time, not per call); the registry still records and logs the choice,
and any fallback to the reference. `dequantized_state_dict` gives the dense weights these modules compute with (our
parameter names), for the reference model and for transformers' `Qwen3_5MoeForCausalLM`.

W4A4 (dense NVFP4 layers only). Each NVFP4Linear has a switch `w4a4` (set by `load_quantized(..., w4a4=)`):
    "auto"     the layer has an input scale AND the registry's choice for "nvfp4_w4a4_linear" on this call is its
               native fast path (kind "torch": `torch._scaled_mm` with float4_e2m1fn_x2, compute capability >= 10)
               -> W4A4; otherwise (CPU, Hopper, a registry without the op, preference "reference" / "triton") W4A16
               exactly as before. The registry records the W4A4 op's fallback reason, which is why W4A16 ran.
    "off"      always W4A16 (bf16 activations: at least as accurate as the W4A4 GEMM the layer was exported for).
    "emulate"  `w4a4_linear_reference` on any device: the W4A4 numerics (activations quantised to NVFP4 with the
               checkpoint's input scale), for tests and the accuracy oracle; slow.
The routed experts (`NVFP4Experts`) stay W4A16 whatever the switch: there is no grouped W4A4 GEMM. W4A4 is an
accuracy change (activation quantisation, ~2^-3 relative per element) that the oracle must gate, as FP8 W8A8 is.

Module dtype casts (`model.to(torch.bfloat16)`) leave the packed buffers and their fp32 / e4m3 scales alone: they
are a storage format, not a compute dtype (`_KeepStorageDtype`); device moves apply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from engine_core.registry import KernelPreference
from kernels.nvfp4 import W4A4_OP, FP8Tensor, NVFP4Tensor, dequantize_fp8, dequantize_nvfp4, w4a4_linear_reference

log = logging.getLogger(__name__)

W4A16_DENSE_OP = "w4a16_linear"  # kernels/w4a16_gemm.py
W4A16_SWIGLU_OP = "w4a16_swiglu"  # the same GEMM with silu(gate) * up in its epilogue
W4A16_MOE_OP = "w4a16_moe"
W4A16_FRAG_OP = "w4a16_linear_frag"  # kernels/w4a16_swapped.py: dense calls on fragment-order bytes (lm_head)
W4A16_MOE_DECODE_OP = "w4a16_moe_decode"  # kernels/moe_decode.py: routed + shared experts of <= 4 tokens, one launch
FP8_OP = "fp8_linear"  # kernels/fp8_linear.py
W4A4_MODES = ("auto", "off", "emulate")  # NVFP4Linear.w4a4, see the module docstring


def _registry(registry):
    if registry is not None:
        return registry
    from engine_core.registry import default_registry

    return default_registry()


class _KeepStorageDtype(nn.Module):
    """Buffers keep their dtype under `module.to(dtype)` / `.half()` / `.bfloat16()`; device moves still apply."""

    def _apply(self, fn, recurse=True):
        def keep(t):
            out = fn(t)
            return out if out.dtype == t.dtype else t.to(out.device)

        return super()._apply(keep, recurse)


DUAL_ROWS = 4  # NVFP4Linear.repack_dual: calls of up to this many rows read the checkpoint-layout copy (the decode
#               graphs' 1 / 2 / 4 buckets; kernels/w4a16_mma.py takes <= 8 rows, the registry's wide entry the GEMV's)
SMALL_ROWS = 4  # = kernels.w4a16_gemv.GEMV_MAX_TOKENS (tests check): row counts the choice cache keeps apart
MID_ROWS = 64  # = kernels.w4a16_mma.SORTED_MAX_TOKENS (tests check): row counts above SMALL_ROWS up to this share one
#                choice, larger ones another (the tensor-core decode GEMV's sorted MoE takes only the first)


class _Dispatch(_KeepStorageDtype):
    """Chooses the registry implementation of one op per (device, dtype, preference) and caches it."""

    def __init__(self, op: str, registry=None):
        super().__init__()
        self.op = op
        self.registry = registry  # None: the process-wide default registry, looked up on first use
        self._impl: dict[tuple, object] = {}

    def _call(self, *args, op: str | None = None, variant=None):
        """`op` (default: the module's) on args, through the cached registry choice; `variant` overrides the module's
        `_variant` for this call (state its `supports()` depends on that differs between calls). Calls of up to
        SMALL_ROWS activation rows are cached per row count (decode kernels, e.g. `kernels/w4a16_gemv.py`, support
        only those), then those of up to MID_ROWS together, and larger ones together."""
        return self._choose(*args, op=op, variant=variant).fn(*args)

    def _choose(self, *args, op: str | None = None, variant=None):
        """The registry implementation `_call` runs on args (cached as it describes)."""
        op = op or self.op
        reg = self.registry = _registry(self.registry)
        x = args[0]
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
        key = (op, x.device.type, x.dtype, reg.preference(op), self._variant if variant is None else variant,
               rows if rows <= SMALL_ROWS else "mid" if rows <= MID_ROWS else None)
        impl = self._impl.get(key)
        if impl is None:
            impl = self._impl[key] = reg.choose(op, **reg.spec(op).describe(*args))
        return impl

    @property
    def _variant(self):
        """Any module state the op's `supports()` depends on besides device and dtype (part of the cache key)."""
        return None

    @property
    def implementation(self) -> str | None:
        """Name of the implementation chosen by the latest (device, dtype) seen, for benchmark headers."""
        return next(reversed(self._impl.values())).name if self._impl else None


def forget_kernel_choices(model: nn.Module) -> None:
    """Every packed module chooses its registry implementation again on its next call (after `Registry.disable` /
    `enable` or a preference change), the fused decode projections (`fused_fp8_projections`) included."""
    for mod in model.modules():
        if isinstance(mod, _Dispatch):
            mod._impl.clear()
        for entry in getattr(mod, FUSED_CACHE, {}).values():
            entry.impl_choice.clear()  # the registry may now choose differently for the fused call
            if entry.fused is not None:
                entry.fused._impl.clear()


def check_w4a4_mode(mode: str) -> str:
    if mode not in W4A4_MODES:
        raise ValueError(f"unknown w4a4 mode {mode!r}; valid: {', '.join(W4A4_MODES)}")
    return mode


def _global_per_row(g: torch.Tensor, lead: tuple[int, ...]) -> torch.Tensor:
    """Global scale [] / [...] / [..., N] -> fp32 [..., N] (per output row, what the kernels and the loader use)."""
    g = torch.as_tensor(g, dtype=torch.float32)
    if tuple(g.shape) == lead:
        return g.contiguous()
    if tuple(g.shape) in ((), tuple(lead[:-1])):
        return g.reshape(*g.shape, *([1] * (len(lead) - g.dim()))).expand(lead).contiguous()
    raise ValueError(f"global scale of shape {tuple(g.shape)} does not fit weight rows {lead}")


# ---- dense linears -------------------------------------------------------------------------------------------------
class NVFP4Linear(_Dispatch):
    """y = x @ W^T, W NVFP4 [N, K] (no bias: none of the checkpoint's quantised layers has one). W4A16, or W4A4 for a
    layer exported with an activation `input_scale` when `w4a4` allows it (module docstring)."""

    def __init__(self, w: NVFP4Tensor, registry=None, input_scale: torch.Tensor | float | None = None,
                 w4a4: str = "auto"):
        super().__init__(W4A16_DENSE_OP, registry)
        n, k = w.shape
        self.in_features, self.out_features = k, n
        self.register_buffer("packed", w.packed.contiguous())  # uint8 [N, K/2]
        self.register_buffer("scales", w.scales.contiguous())  # float8_e4m3fn [N, K/16]
        self.register_buffer("global_scale", _global_per_row(w.global_scale, (n,)).to(w.packed.device))  # fp32 [N]
        self.register_buffer("packed_small", None)  # dual_frag (`repack_dual`): the checkpoint's bytes [N, K/2]
        # ModelOpt's static activation global scale (amax / 2688) of a W4A4 export; NaN for a W4A16 layer. A Python
        # flag says which, so that forward never reads the buffer on the host (no sync).
        s_in = torch.as_tensor(float("nan") if input_scale is None else input_scale, dtype=torch.float32)
        if s_in.numel() != 1:
            raise ValueError(f"NVFP4Linear input_scale must be a scalar, got shape {tuple(s_in.shape)}")
        self.register_buffer("input_scale", s_in.reshape(()).to(w.packed.device))  # fp32 []
        self.w4a4_export = input_scale is not None
        if self.w4a4_export and not (torch.isfinite(self.input_scale) and self.input_scale > 0):
            raise ValueError(f"NVFP4Linear input_scale must be finite and positive, got {float(self.input_scale)}")
        self.w4a4 = check_w4a4_mode(w4a4)
        self._w4a4_impl: dict[tuple, object] = {}  # (device, dtype, preference) -> native implementation or None
        self._w4a4_registered: bool | None = None  # does the registry have op "nvfp4_w4a4_linear"

    layout = "checkpoint"  # of `packed`: "checkpoint", or "split_frag" after `repack_frag`, or "dual_frag" after
    #                        `repack_dual` (`packed` in fragment order plus `packed_small`, the checkpoint's bytes)

    @property
    def weight_nvfp4(self) -> NVFP4Tensor:
        """The stored weight (bytes in `layout`)."""
        return NVFP4Tensor(self.packed, self.scales, self.global_scale)

    @property
    def weight_checkpoint(self) -> NVFP4Tensor:
        """The weight with its bytes in the checkpoint's layout (a converted copy after `repack_frag`)."""
        if self.layout == "checkpoint":
            return self.weight_nvfp4
        if self.packed_small is not None:
            return NVFP4Tensor(self.packed_small, self.scales, self.global_scale)
        from kernels.w4a16_swapped import linear_to_frag

        return linear_to_frag(self.weight_nvfp4, inverse=True)

    def repack_frag(self) -> bool:
        """Store the bytes in wgmma fragment order (`kernels.w4a16_swapped.linear_to_frag`, in place: no second copy)
        and compute through registry op "w4a16_linear_frag" (the swap-AB kernel as a one-expert launch, at every row
        count; its reference elsewhere): lm_head on Hopper (`qwen_engine.engine.set_lm_head_layout`). False
        (unchanged) for a W4A4 export (its op reads the checkpoint layout) or a shape no stored tile divides."""
        from kernels.w4a16_swapped import frag_dense_tile, linear_to_frag

        if self.layout == "dual_frag":  # drop the checkpoint-layout copy
            self.packed_small, self.layout = None, "split_frag"
            self._impl.clear()
        if self.layout == "split_frag":
            return True
        if self.w4a4_export or frag_dense_tile(self.out_features, self.in_features) is None:
            return False
        self.packed = linear_to_frag(self.weight_nvfp4).packed
        self.layout, self.op = "split_frag", W4A16_FRAG_OP
        self._impl.clear()
        return True

    def repack_dual(self) -> bool:
        """`repack_frag`, plus a second copy of the bytes in the checkpoint's layout (`packed_small`; the block and
        global scales shared) that calls of <= DUAL_ROWS activation rows compute on through op "w4a16_linear" -- for
        lm_head at one row, the tensor-core decode GEMV ("triton_mma_wide": 100.2 against the swap-AB kernel's 121.3
        us a call, H200 lm_head_bench run 2) -- while larger calls keep the swap-AB kernel (the checkpoint layout's
        dense kernel lost 2.8% at 32 streams, Qwen run 59). Costs the bytes once more (254 MB for Qwen3.6's
        lm_head). False (unchanged) where `repack_frag` refuses."""
        if self.layout == "dual_frag":
            return True
        small = self.weight_checkpoint.packed
        if not self.repack_frag():
            return False
        self.packed_small = small  # the checkpoint bytes repack_frag replaced (a new tensor took their place)
        self.layout = "dual_frag"
        self._impl.clear()
        return True

    def repack_checkpoint(self) -> None:
        """Undo `repack_frag` / `repack_dual` (in place): the checkpoint's bytes and op "w4a16_linear" again."""
        if self.layout != "checkpoint":
            self.packed = self.weight_checkpoint.packed
            self.packed_small = None
            self.layout, self.op = "checkpoint", W4A16_DENSE_OP
            self._impl.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype."""
        if self.w4a4_export and self.w4a4 != "off":
            args = (x, self.weight_nvfp4, self.input_scale, x.dtype)  # the signature of op "nvfp4_w4a4_linear"
            if self.w4a4 == "emulate":
                return w4a4_linear_reference(*args)
            impl = self._w4a4_native(*args)
            if impl is not None:
                return impl.fn(*args)
        if self.packed_small is not None and x.numel() // max(x.shape[-1], 1) <= DUAL_ROWS:
            return self._call(x, self.weight_checkpoint, op=W4A16_DENSE_OP)  # dual_frag's small calls
        return self._call(x, self.weight_nvfp4)

    def _w4a4_native(self, *args):
        """The registry's native W4A4 implementation for this call, or None (then W4A16 runs). Chosen once per
        (device, dtype, preference) like `_Dispatch._call`. Only preferences that can pick the native path consult
        the registry: "reference" / "triton" mean W4A16 here (an explicit "triton" would otherwise raise, the op
        having no Triton kernel), and an explicit "torch" that cannot be met raises, as the registry promises."""
        reg = self.registry = _registry(self.registry)
        x = args[0]
        if self._w4a4_registered is None:  # looked up once: the registry object is fixed after the first call
            self._w4a4_registered = W4A4_OP in reg.ops()
            if not self._w4a4_registered:
                log.warning("W4A4 layer runs as W4A16: the registry has no op %r (kernels.nvfp4 not registered)",
                            W4A4_OP)
        if not self._w4a4_registered:
            return None
        pref = reg.preference(W4A4_OP)
        key = (x.device.type, x.dtype, pref)
        if key not in self._w4a4_impl:
            impl = None
            if pref in (KernelPreference.AUTO, KernelPreference.TORCH):
                chosen = reg.choose(W4A4_OP, **reg.spec(W4A4_OP).describe(*args))
                impl = chosen if chosen.kind is KernelPreference.TORCH else None  # the reference: W4A16 instead
            self._w4a4_impl[key] = impl
        return self._w4a4_impl[key]

    @property
    def runs(self) -> str:
        """What forward runs for the latest (device, dtype) seen (for reports): "W4A16", "W4A4 native (<impl>)" or
        "W4A4 emulated"."""
        if not self.w4a4_export or self.w4a4 == "off":
            return "W4A16"
        if self.w4a4 == "emulate":
            return "W4A4 emulated"
        impl = next(reversed(self._w4a4_impl.values()), None) if self._w4a4_impl else None
        return f"W4A4 native ({impl.name})" if impl is not None else "W4A16"

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(*self.weight_checkpoint, dtype=dtype)

    def extra_repr(self) -> str:
        fmt = f"NVFP4 W4A4 export, w4a4={self.w4a4}" if self.w4a4_export else f"W4A16_NVFP4, {self.layout} layout"
        return f"in_features={self.in_features}, out_features={self.out_features}, {fmt}"


class FP8Linear(_Dispatch):
    """y = (e4m3(x / input_scale) @ W_e4m3^T) * input_scale * weight_scale: static per-tensor W8A8."""

    def __init__(self, w: FP8Tensor, quantize_activations: bool = True, registry=None):
        super().__init__(FP8_OP, registry)
        n, k = w.shape
        self.in_features, self.out_features = k, n
        if quantize_activations and w.input_scale is None:
            raise ValueError("FP8Linear with quantize_activations needs the checkpoint's static input_scale")
        self.quantize_activations = quantize_activations
        self.register_buffer("weight", w.data.contiguous())  # float8_e4m3fn [N, K]
        self.register_buffer("weight_scale", torch.as_tensor(w.scale, dtype=torch.float32).to(w.data.device))
        s_in = w.input_scale if w.input_scale is not None else torch.tensor(float("nan"))
        self.register_buffer("input_scale", torch.as_tensor(s_in, dtype=torch.float32).reshape(()).to(w.data.device))

    @property
    def weight_fp8(self) -> FP8Tensor:
        return FP8Tensor(self.weight, self.weight_scale, self.input_scale if self.quantize_activations else None)

    @property
    def _variant(self):
        # W8A8 and weight-only are different calls for the registry (the fast path needs the input scale): a choice
        # made weight-only (calibration, the oracle) must not stick to the W8A8 forward (it did: the 2026-11-30 H200
        # runs measured the fp32 dequantising reference in every FP8 layer)
        return self.quantize_activations

    def forward(self, x: torch.Tensor, codes: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N] in x.dtype. `codes`: x's e4m3 activation codes with this layer's `input_scale`,
        made by the op that produced x (`QUANT_IN_PRODUCERS`); implementations with a separate quantiser launch read
        them instead (the same bits), the others ignore them."""
        w = self.weight_fp8
        if codes is None or not self.quantize_activations:
            return self._call(x, w)
        from kernels.fp8_linear import with_codes

        impl = self._choose(x, w)
        fn = with_codes(impl.name)
        return impl.fn(x, w) if fn is None else fn(x, w, codes)

    def dequantized(self, dtype=torch.float32) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, dtype)

    def extra_repr(self) -> str:
        act = "static e4m3 activations" if self.quantize_activations else "weight-only (activations unquantised)"
        return f"in_features={self.in_features}, out_features={self.out_features}, FP8 W8A8 per-tensor, {act}"


# ---- fused decode projections ----------------------------------------------------------------------------------------
FUSED_CACHE = "_fused_fp8"  # a plain attribute of the owner module: {names: _FusedProjections}, no state_dict entry
FUSE_DECODE_PROJECTIONS = True  # switch for A/B runs (benchmarks/qwen_gpu.py --unfused-projections) and tests
# kernels/fp8_linear.py: the fused call must land on one of these (the decode GEMV at 1-4 rows, the few-row
# tensor-core GEMM at 5-64: both take per-row weight scales)
FUSED_IMPLS = ("triton_quant+gemv", "triton_gemv", "triton_quant+swapped")


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version  # inference tensors keep no version counter


@dataclass
class _FusedProjections:
    """One owner's fused projections: the FP8Linear (None while the input scales differ), the source buffers it was
    built from (kept alive and compared by identity: a replaced buffer -- a reload by assignment, `.to()` -- means a
    rebuild), the versions of their scales (an in-place write is copied into the fused buffers), and per (device,
    dtype, rows) whether the registry gives the fused call one of FUSED_IMPLS."""

    fused: FP8Linear | None
    sources: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]  # (weight, weight_scale, input_scale) each
    scale_versions: tuple[int, ...]
    impl_choice: dict = field(default_factory=dict)

    def current(self, mods) -> bool:
        return all(m.weight is w and m.weight_scale is sw and m.input_scale is si
                   for m, (w, sw, si) in zip(mods, self.sources))

    @staticmethod
    def versions(mods) -> tuple[int, ...]:
        return tuple(v for m in mods for v in (_version(m.weight_scale), _version(m.input_scale)))

    @classmethod
    def build(cls, mods) -> "_FusedProjections":
        fused = None
        s_in = mods[0].input_scale
        if all(m.in_features == mods[0].in_features and torch.equal(m.input_scale, s_in) for m in mods[1:]):
            # a normal tensor even when called under inference_mode (the engine's steps): versioned like the sources
            with torch.inference_mode(False), torch.no_grad():
                w = torch.cat([m.weight for m in mods])  # e4m3 [sum N, K]
                scale = torch.cat([m.weight_scale.float().reshape(-1).expand(m.out_features) for m in mods])
                fused = FP8Linear(FP8Tensor(w, scale, s_in.clone()), registry=mods[0].registry)
                start = 0
                for m in mods:  # the projections keep working on their own, as views of the one copy
                    m.weight = w[start:start + m.out_features]
                    start += m.out_features
        return cls(fused, tuple((m.weight, m.weight_scale, m.input_scale) for m in mods), cls.versions(mods))

    def sync_scales(self, mods) -> None:
        """After an in-place write of a scale (a reload): the same values in the fused buffers, in place (captured
        graphs keep their pointers); weights need nothing (they are views of the fused weight). Input scales that
        no longer agree end the fusion (the weights stay views: each projection still runs alone)."""
        if self.fused is None or self.versions(mods) == self.scale_versions:
            return
        s_in = mods[0].input_scale
        with torch.inference_mode(False), torch.no_grad():
            if all(torch.equal(m.input_scale, s_in) for m in mods[1:]):
                self.fused.input_scale.copy_(s_in.reshape(()))
                start = 0
                for m in mods:
                    self.fused.weight_scale[start:start + m.out_features].copy_(
                        m.weight_scale.float().reshape(-1).expand(m.out_features))
                    start += m.out_features
            else:
                self.fused = None
        self.scale_versions = self.versions(mods)


def fused_fp8_projections(owner: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> FP8Linear | None:
    """One FP8Linear over the concatenated rows of `owner`'s FP8 projections `names` (in that order), which read the
    same activations x [rows, K] -- attention q/k/v_proj, GDN in_proj_qkv/z -- or None: when the switch is off, any
    of them is not a W8A8 FP8Linear, their input scales differ, the call would be neither a decode GEMV
    (`kernels.fp8_gemv.gemv_ok`: at 2-4 rows these fused weights, 19-25 MB, are not the GEMV's regime) nor a few-row
    tensor-core GEMM (`kernels.fp8_swapped.swapped_ok`: 5-64 rows), or the registry would not give the fused call
    one of FUSED_IMPLS (disabled, another device: a per-row-scaled call elsewhere can fall to the dequantising
    reference, and cuBLASLt's row-wise GEMM is no faster fused).

    Why: a lone decode step ran 130 FP8 projections, each a quantiser launch and a GEMM launch; q/k/v and
    in_proj_qkv/z quantise the same row with the same static scale (one calibrated input), so one quantiser and one
    GEMV over [sum N, K] give the same codes and the same exact products: 100 launches fewer per step (H200, run 18:
    295.6 -> 315.0 tok/s). The output is [rows, sum N]; callers take column slices (strided views). Numerics:
    identical quantised activations; products and fp32 sums as each projection alone, each row's weight scale its
    projection's; only the kernel's tiling (summation order) may differ. At 8-64 rows (the few-row GEMM) the same
    saves one launch per GDN layer and two per attention layer.

    Memory: the concatenated weight is the only copy -- each projection's `weight` buffer becomes a view of it, so an
    in-place weight write reaches it and captured graphs keep their pointers (in-place scale writes are copied into
    the fused buffers, `_FusedProjections.sync_scales`). Built on the first call (the CUDA-graph warm-up runs each
    decode bucket eagerly before capture: the input-scale comparison syncs with the host then); rebuilt when a
    source buffer is replaced (`.to()` drops it: the owners' `_apply`)."""
    if not FUSE_DECODE_PROJECTIONS:
        return None
    mods = [getattr(owner, n) for n in names]
    if not all(type(m) is FP8Linear and m.quantize_activations for m in mods):
        return None
    from kernels.fp8_gemv import gemv_ok
    from kernels.fp8_swapped import swapped_ok

    rows = x.numel() // max(x.shape[-1], 1)
    n, k = sum(m.out_features for m in mods), mods[0].in_features
    if not (gemv_ok(rows, n, k) or swapped_ok(rows, n, k)):
        return None
    cache = owner.__dict__.setdefault(FUSED_CACHE, {})
    entry = cache.get(names)
    if entry is None or not entry.current(mods):
        entry = cache[names] = _FusedProjections.build(mods)
    else:
        entry.sync_scales(mods)
    fused = entry.fused
    if fused is None:
        return None
    key = (x.device.type, x.dtype, rows)
    if key not in entry.impl_choice:
        reg = fused.registry = _registry(fused.registry)
        impl = reg.choose(FP8_OP, **reg.spec(FP8_OP).describe(x, fused.weight_fp8))
        entry.impl_choice[key] = impl.name in FUSED_IMPLS
    return fused if entry.impl_choice[key] else None


def project_together(owner: nn.Module, names: tuple[str, ...], x: torch.Tensor,
                     codes: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """`owner`'s projections `names` of the same x, one output each (in that order): column views of one fused call
    where `fused_fp8_projections` gives one (decode steps), else one call per projection. `codes`: x's activation
    codes made with `producer_scale(owner, names)` (FP8Linear.forward)."""
    fused = fused_fp8_projections(owner, names, x)
    extra = () if codes is None else (codes,)
    if fused is None:
        return tuple(getattr(owner, n)(x, *extra) for n in names)
    return fused(x, *extra).split([getattr(owner, n).out_features for n in names], dim=-1)


# ---- the activation quantiser in the producing op ----------------------------------------------------------------------
# On (Qwen run 33, H200, one process: 373.7 vs 369.3 tok/s lone, 2,926.7 vs 2,829.5 at 32 streams, the same greedy
# tokens lone and 32/32 streams; set by QwenEngineConfig.quant_in_producers; benchmarks/qwen_gpu.py
# --no-quant-in-producers runs the engine without it beside the default): a decode step's FP8
# projections each launched the one-launch quantiser before their GEMV / GEMM (80 launches in a lone step, 130 at 32
# streams; 0.12 / 0.40 ms of kernel time, Qwen profile run 17). With it on, the op that produces their input writes
# the codes beside its output -- the mixers' input norm ("rms_norm_zc_fp8"), the GDN gated norm
# ("rms_norm_gated_fp8"), the attention output gate ("attn_output_gate_fp8") -- with the same bits (the quantiser's
# fp32 operations on the stored output), and the projections read them (`kernels.fp8_linear.with_codes`).
QUANT_IN_PRODUCERS = True
PRODUCER_SCALE_CACHE = "_fp8_producer_scale"  # a plain attribute of the owner: {names: (versions, scale or None)}


def producer_scale(owner: nn.Module, names: tuple[str, ...]) -> torch.Tensor | None:
    """The static scale an op producing the input of `owner`'s projections `names` quantises with, or None (switch
    off; one of them not a W8A8 FP8Linear; their input scales differ). The comparison reads the device once per
    version of the scales (the decode graphs' eager warm-up comes before their capture, as for
    `fused_fp8_projections`)."""
    if not QUANT_IN_PRODUCERS:
        return None
    mods = [getattr(owner, n) for n in names]
    if not all(type(m) is FP8Linear and m.quantize_activations for m in mods):
        return None
    versions = tuple((id(m.input_scale), _version(m.input_scale)) for m in mods)
    cache = owner.__dict__.setdefault(PRODUCER_SCALE_CACHE, {})
    hit = cache.get(names)
    if hit is None or hit[0] != versions:
        s0 = mods[0].input_scale
        hit = cache[names] = (versions, s0 if all(torch.equal(m.input_scale, s0) for m in mods[1:]) else None)
    return hit[1]


def drop_fused_projections(owner: nn.Module) -> None:
    """Forget `owner`'s fused projections (its buffers are about to move: `.to()`, `.cuda()`): the next decode call
    builds them again from the moved buffers, and the old fused copy is freed now, not then."""
    owner.__dict__.pop(FUSED_CACHE, None)


# ---- MoE -------------------------------------------------------------------------------------------------------------
class NVFP4SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate/up fused into one NVFP4Linear [2I, H]: the shared expert."""

    def __init__(self, gate: NVFP4Tensor, up: NVFP4Tensor, down: NVFP4Tensor, registry=None,
                 gate_up_input_scale: torch.Tensor | float | None = None,
                 down_input_scale: torch.Tensor | float | None = None, w4a4: str = "auto"):
        """`*_input_scale`: the W4A4 activation scales of the fused gate/up (one input, so one scale) and of down;
        None for W4A16 layers."""
        super().__init__()
        i = gate.shape[0]
        if up.shape != gate.shape or down.shape[1] != i:
            raise ValueError(f"shared expert shapes gate {tuple(gate.shape)}, up {tuple(up.shape)}, "
                             f"down {tuple(down.shape)} do not form a SwiGLU")
        self.intermediate = i
        fused = NVFP4Tensor(torch.cat((gate.packed, up.packed)), torch.cat((gate.scales, up.scales)),
                            torch.cat((_global_per_row(gate.global_scale, (i,)).to(gate.packed.device),
                                       _global_per_row(up.global_scale, (i,)).to(up.packed.device))))
        self.gate_up_proj = NVFP4Linear(fused, registry, gate_up_input_scale, w4a4)
        self.down_proj = NVFP4Linear(down, registry, down_input_scale, w4a4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj
        if gu.w4a4_export and gu.w4a4 != "off":  # W4A4 (native or emulated) or its W4A16 fallback: the plain GEMM
            gate, up = gu(x).chunk(2, dim=-1)
            return self.down_proj(nn.functional.silu(gate) * up)
        # W4A16: registry op "w4a16_swiglu", the SiLU and product in the GEMM's fp32 epilogue (one launch instead
        # of GEMM + SiLU + mul; one rounding instead of three)
        return self.down_proj(gu._call(x, gu.weight_nvfp4, op=W4A16_SWIGLU_OP))

    def dequantized(self, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """The three dense weights in `SwiGLU`'s parameter names."""
        gu = self.gate_up_proj.dequantized(dtype)
        return {"gate_proj.weight": gu[: self.intermediate], "up_proj.weight": gu[self.intermediate:],
                "down_proj.weight": self.down_proj.dequantized(dtype)}


class NVFP4Experts(_Dispatch):
    """Routed experts with stacked NVFP4 weights: gate_up [E, 2I, H] (rows :I gate, I: up), down [E, H, I]; global
    scales per expert and output row ([E, 2I], [E, H]). Same forward as `moe.Experts`.

    Always W4A16, even for a W4A4 export: there is no grouped W4A4 GEMM here (the `w4a4` switch covers the dense
    NVFP4Linear layers only); bf16 activations are at least as accurate as the W4A4 the experts were exported for.

    `shared` (the layer's shared expert as NVFP4 gate_up [2I, H] (rows :I gate, I: up) and down [H, I], the routed
    experts' width): stacked after the routed experts as expert E (`shared_index`), so that `SparseMoE` can run it
    as one more (token, expert) pair per token inside the grouped launches instead of two dense GEMM launches
    (`SparseMoE.shared_in_experts`). The router only ever picks 0..E-1; `dequantized` returns the routed ones."""

    def __init__(self, gate_up: NVFP4Tensor, down: NVFP4Tensor, registry=None,
                 shared: tuple[NVFP4Tensor, NVFP4Tensor] | None = None):
        super().__init__(W4A16_MOE_OP, registry)
        e, n13, h = gate_up.shape
        if down.shape[0] != e or down.shape[1] != h or 2 * down.shape[2] != n13:
            raise ValueError(f"expert stacks gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} "
                             "are not [E, 2I, H] and [E, H, I]")
        self.num_experts, self.intermediate = e, n13 // 2
        self.shared_index: int | None = None
        dev = gate_up.packed.device
        gu_global = _global_per_row(gate_up.global_scale, (e, n13)).to(dev)
        dn_global = _global_per_row(down.global_scale, (e, h)).to(dev)
        if shared is not None:
            s_gu, s_dn = shared
            if tuple(s_gu.shape) != (n13, h) or tuple(s_dn.shape) != (h, n13 // 2):
                raise ValueError(f"shared expert gate_up {tuple(s_gu.shape)} / down {tuple(s_dn.shape)} do not match "
                                 f"the routed experts' [{n13}, {h}] / [{h}, {n13 // 2}]")
            cat = lambda a, b: torch.cat((a, b[None].to(a.device)))  # noqa: E731
            gate_up = NVFP4Tensor(cat(gate_up.packed, s_gu.packed), cat(gate_up.scales, s_gu.scales), None)
            down = NVFP4Tensor(cat(down.packed, s_dn.packed), cat(down.scales, s_dn.scales), None)
            gu_global = cat(gu_global, _global_per_row(s_gu.global_scale, (n13,)))
            dn_global = cat(dn_global, _global_per_row(s_dn.global_scale, (h,)))
            self.shared_index = e
        self.register_buffer("gate_up_packed", gate_up.packed.contiguous())  # uint8 [E(+1), 2I, H/2]
        self.register_buffer("gate_up_scales", gate_up.scales.contiguous())  # e4m3 [E(+1), 2I, H/16]
        self.register_buffer("gate_up_global", gu_global.contiguous())  # fp32 [E(+1), 2I]
        self.register_buffer("down_packed", down.packed.contiguous())  # uint8 [E(+1), H, I/2]
        self.register_buffer("down_scales", down.scales.contiguous())  # e4m3 [E(+1), H, I/16]
        self.register_buffer("down_global", dn_global.contiguous())  # fp32 [E(+1), H]
        from kernels.w4a16_gemm import CHECKPOINT

        self.layout = CHECKPOINT  # kernels.w4a16_gemm.EXPERT_LAYOUTS: the checkpoint's until `repack`
        self.small_tokens = 0  # `repack_dual`: calls of at most this many tokens read the copy `small_*`,
        self.small_layout = CHECKPOINT  # stored in this layout
        self.regs_copy = False  # `repack_regs`: decode-sized calls above small_tokens read the thread-order copy

    def repack(self, layout: int) -> bool:
        """Repack both stacks' bytes into `layout` (`kernels.w4a16_gemm.experts_repack`; EXPERT_LAYOUTS: tile-major
        for the grouped kernel, split halves for the swap-AB kernel, the checkpoint's), from whatever layout they are
        in. The values do not change (`dequantized` undoes the layout). Returns False, changing nothing, when the
        shapes do not split into that layout's tiles. Peak memory: one repacked copy of both stacks (~400 MB per layer
        at full size, transient). The module's state_dict then holds repacked bytes; loading a state_dict into a
        repacked module is refused (`_load_from_state_dict`). With the registry's reference preference, each call
        unpacks a copy first (the reference dequantises every expert per call anyway). A `repack_dual` copy is
        dropped. Never while an engine holding CUDA graphs of this model is alive: the graphs keep the old buffers'
        addresses (benchmarks repack between engines, after `aclose`)."""
        from kernels.w4a16_gemm import experts_repack, layout_ok

        if layout == self.layout:
            self._drop_small_copy()
            self._drop_regs_copy()
            return True
        w13, w2 = self._checkpoint_layout()
        if not layout_ok(w13, w2, layout):
            return False
        self._drop_small_copy()
        self._drop_regs_copy()
        w13, w2 = experts_repack(w13, w2, layout)
        self.gate_up_packed, self.down_packed = w13.packed, w2.packed
        self.layout = layout
        return True

    def repack_dual(self, small_tokens: int | None = None, small_layout: int | None = None,
                    large_layout: int | None = None) -> bool:
        """Split halves for the swap-AB kernel (`repack(SPLIT_HALVES)`), plus a second copy of both packed stacks in
        `small_layout` that calls of at most `small_tokens` tokens read. On the H200 (benchmarks/RESULTS.md, Qwen run
        13) the swap-AB kernel made TTFT 17% shorter and 32 streams 15% faster, but a lone request's decode 11%
        slower; two copies keep both, for +1 packed copy of the experts (~400 MB per layer, ~16 GB at full size).
        `small_layout` (default: the checkpoint's, which the decode GEMV `kernels/w4a16_gemv.py` reads; until the
        ninth session tile-major, for the grouped kernel: run 15, lone decode 213.6 -> 238.8 tok/s). `small_tokens`
        (default: the GEMV's GEMV_MAX_TOKENS = 4; for the checkpoint layout at most kernels/w4a16_mma.py's
        SORTED_MAX_TOKENS, whose tensor-core decode GEMV takes 5-64 tokens there -- without it larger calls on that
        copy run the grouped kernel on the checkpoint layout, the slowest decode path measured). Returns False,
        changing nothing, when the shapes do not split into both layouts' tiles. `large_layout`: SPLIT_HALVES (default)
        or SPLIT_FRAG (the same kernel on fragment-ordered bytes, `kernels.w4a16_swapped.split_frag`)."""
        from kernels.w4a16_gemm import CHECKPOINT, SPLIT_HALVES, SWAPPED_LAYOUTS, experts_repack, layout_ok
        from kernels.w4a16_gemv import GEMV_MAX_TOKENS
        from kernels.w4a16_mma import SORTED_MAX_TOKENS

        large_layout = SPLIT_HALVES if large_layout is None else large_layout
        if large_layout not in SWAPPED_LAYOUTS:
            raise ValueError(f"repack_dual: the large layout is the swap-AB kernel's (split halves, split frag), got "
                             f"{large_layout}")
        small_layout = CHECKPOINT if small_layout is None else small_layout
        small_tokens = GEMV_MAX_TOKENS if small_tokens is None else small_tokens
        if small_layout == CHECKPOINT and small_tokens > SORTED_MAX_TOKENS:
            raise ValueError(f"repack_dual: a checkpoint-layout copy serves the decode GEMVs' <= {SORTED_MAX_TOKENS} "
                             f"tokens, got small_tokens={small_tokens}")
        w13, w2 = self._checkpoint_layout()
        if small_tokens < 1 or not (layout_ok(w13, w2, large_layout) and layout_ok(w13, w2, small_layout)):
            return False
        self.repack(large_layout)
        t13, t2 = experts_repack(w13, w2, small_layout)
        # not persistent: derived bytes, the state_dict keeps one copy (whose loads are refused once repacked). In
        # the checkpoint layout these are the stacks from before the split-halves repack (new tensors replaced them),
        # which may share storage with the loader's tensors: nothing writes them in place
        self.register_buffer("small_gate_up_packed", t13.packed, persistent=False)
        self.register_buffer("small_down_packed", t2.packed, persistent=False)
        self.small_tokens, self.small_layout = small_tokens, small_layout
        return True

    def repack_regs(self) -> bool:
        """A third copy of both packed stacks in thread order (`kernels/w4a16_regs.py`, THREAD_ORDER), which the calls
        the swap-AB kernel would run in 16-row blocks -- more than `small_tokens` tokens, at most 16 (token, expert)
        pairs an expert on average (`kernels.w4a16_swapped.swapped_block_m`): decode batches of 5 to ~500 tokens --
        read instead of the main stacks. Opt-in (`QwenEngineConfig.expert_regs`) and NOT YET MEASURED: the kernel has
        only been compiled offline. +1 packed copy of the experts (~400 MB per layer, ~16 GB at full size). Call after
        `repack` / `repack_dual` (which drop it). Returns False, changing nothing, when the shapes do not split into
        its 64 x 128 tiles."""
        from kernels.w4a16_gemm import THREAD_ORDER, experts_repack, layout_ok

        w13, w2 = self._checkpoint_layout()
        if not layout_ok(w13, w2, THREAD_ORDER):
            return False
        t13, t2 = experts_repack(w13, w2, THREAD_ORDER)
        self._drop_regs_copy()
        self.register_buffer("regs_gate_up_packed", t13.packed, persistent=False)  # derived bytes, as `small_*`
        self.register_buffer("regs_down_packed", t2.packed, persistent=False)
        self.regs_copy = True
        return True

    def _drop_regs_copy(self) -> None:
        if self.regs_copy:
            del self.regs_gate_up_packed, self.regs_down_packed
            self.regs_copy = False

    def _drop_small_copy(self) -> None:
        if self.small_tokens:
            del self.small_gate_up_packed, self.small_down_packed
            self.small_tokens = 0

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.layout:  # the bytes' layout is not part of the state: a load could mix the two silently
            error_msgs.append(f"{prefix[:-1] or 'NVFP4Experts'}: cannot load a state_dict into experts repacked "
                              "for a kernel; load before `repack`")
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _checkpoint_layout(self) -> tuple[NVFP4Tensor, NVFP4Tensor]:
        from kernels.w4a16_gemm import experts_repack

        return experts_repack(self.gate_up_nvfp4, self.down_nvfp4, self.layout, inverse=True)

    @property
    def _variant(self):
        return self.layout  # the registry's supports() checks the tiles of a repacked layout

    @property
    def gate_up_nvfp4(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.gate_up_packed, self.gate_up_scales, self.gate_up_global)

    @property
    def down_nvfp4(self) -> NVFP4Tensor:
        return NVFP4Tensor(self.down_packed, self.down_scales, self.down_global)

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, reduce: bool = True,
                with_shared: bool = False, routing=None) -> torch.Tensor:
        """x [N, H]; idx, weights [N, k] -> [N, H] in x.dtype; `reduce=False`: [N, k, H] unsummed (moe.Experts).
        `with_shared`: idx may name the stacked shared expert (`shared_index`); otherwise the launches see the
        routed experts only (views of the first E: the alignment and the kernels size for E, not E + 1).
        `routing`: idx's alignment (`w4a16_gemm.MoeRouting`) built beforehand as `routing_shape` says (the router's
        launch: `SparseMoE.router_align`); a kernel that would build another ignores it: it never changes a result."""
        w13, w2, layout = self._stacks(x.shape[0], with_shared, pairs=idx.numel())
        return self._call(x, w13, w2, idx, weights.to(x.dtype), reduce, layout, routing, variant=layout)

    def routing_shape(self, n: int, pairs: int, with_shared: bool = False) -> tuple[int, int] | None:
        """(experts, rows per block) of the alignment that a call of n tokens and `pairs` (token, expert) pairs has its
        kernels build (`w4a16_gemm.moe_routing_block_m` over the launch's experts), so that the router's launch can
        build it instead (`SparseMoE.router_align`); None for the calls that the small-batch copy's decode GEMV
        serves, which build none."""
        if self.small_tokens and n <= self.small_tokens:
            return None
        from kernels.w4a16_gemm import moe_routing_block_m

        w13, _, layout = self._stacks(n, with_shared, pairs=pairs)
        experts = w13.packed.shape[0]
        return experts, moe_routing_block_m(layout, pairs, experts)

    def _stacks(self, n: int, with_shared: bool = False,
                pairs: int | None = None) -> tuple[NVFP4Tensor, NVFP4Tensor, int]:
        """(gate_up, down, their layout) that a call of n tokens (and `pairs` (token, expert) pairs) reads: the
        `repack_dual` small-batch copy for n <= small_tokens, the `repack_regs` copy for calls of at most 16 pairs
        an expert above that, else the stacks; without `with_shared`, views of the routed experts only (the
        alignment and the kernels size for E, not E + 1)."""
        w13, w2, layout = self.gate_up_nvfp4, self.down_nvfp4, self.layout
        if self.small_tokens and n <= self.small_tokens:  # `repack_dual`: the small-batch copy
            w13 = NVFP4Tensor(self.small_gate_up_packed, self.gate_up_scales, self.gate_up_global)
            w2 = NVFP4Tensor(self.small_down_packed, self.down_scales, self.down_global)
            layout = self.small_layout
        elif self.regs_copy and pairs is not None:  # `repack_regs` (imports only where a copy is held)
            from kernels.w4a16_gemm import THREAD_ORDER
            from kernels.w4a16_swapped import swapped_block_m

            launch_experts = self.num_experts + (1 if with_shared and self.shared_index is not None else 0)
            if swapped_block_m(pairs, launch_experts) == 16:  # the swap-AB kernel's 16-row calls
                w13 = NVFP4Tensor(self.regs_gate_up_packed, self.gate_up_scales, self.gate_up_global)
                w2 = NVFP4Tensor(self.regs_down_packed, self.down_scales, self.down_global)
                layout = THREAD_ORDER
        if self.shared_index is not None and not with_shared:
            e = self.num_experts
            w13, w2 = (NVFP4Tensor(w.packed[:e], w.scales[:e], w.global_scale[:e]) for w in (w13, w2))
        return w13, w2, layout

    def _decode_stacks(self, n: int) -> tuple[NVFP4Tensor, NVFP4Tensor] | None:
        """The routed experts' stacks that a call of n tokens reads (`_stacks`) when they are in the checkpoint
        layout, which the decode MoE kernel reads; else None."""
        from kernels.w4a16_gemm import CHECKPOINT

        w13, w2, layout = self._stacks(n)
        return (w13, w2) if layout == CHECKPOINT else None

    def fused_decode_ok(self, n: int, shared: nn.Module) -> bool:
        """Whether `decode_with_shared` serves a call of n tokens with this shared expert: n <= the kernel's
        MODEL_MAX_TOKENS (one: the H200 measured it faster there, slower at four), checkpoint-layout stacks for n
        (`_decode_stacks`), a W4A16 `NVFP4SwiGLU` shared expert as wide as the routed experts, and the op in the
        module's registry."""
        from kernels.moe_decode import MODEL_MAX_TOKENS

        if not 0 < n <= MODEL_MAX_TOKENS or not isinstance(shared, NVFP4SwiGLU):
            return False
        if W4A16_MOE_DECODE_OP not in _registry(self.registry).ops():  # a registry built without kernels.moe_decode
            return False
        if any(m.w4a4_export and m.w4a4 != "off" for m in (shared.gate_up_proj, shared.down_proj)):
            return False  # the W4A4 layers run their own GEMM
        return shared.intermediate == self.intermediate and self._decode_stacks(n) is not None

    def decode_with_shared(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                           shared: NVFP4SwiGLU) -> torch.Tensor:
        """x [N, H] (N <= 4, the kernel's limit); idx, weights [N, k] -> [N, k + 1, S, H] fp32 through the registry op
        "w4a16_moe_decode" (`kernels/moe_decode.py`): slots :k the routed experts' outputs times their weights,
        slot k the shared expert's (ungated), each in S partial rows for `moe_combine` to sum. Needs
        `fused_decode_ok`. A call the kernel does not support (`kernels.moe_decode.supports`: row strides, dtype)
        runs the op's reference, which the registry logs once as a fallback."""
        stacks = self._decode_stacks(x.shape[0])
        if stacks is None:
            raise ValueError("decode_with_shared: no checkpoint-layout copy of the experts for this call "
                             "(fused_decode_ok)")
        from kernels.w4a16_gemm import CHECKPOINT

        return self._call(x, *stacks, idx, weights.to(x.dtype), shared.gate_up_proj.weight_nvfp4,
                          shared.down_proj.weight_nvfp4, op=W4A16_MOE_DECODE_OP, variant=CHECKPOINT)

    def dequantized(self, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Dense stacks in `Experts`' parameter names (full size in bf16: 2.1 GB per layer; dequantise per layer)."""
        w13, w2 = self._checkpoint_layout()
        e = self.num_experts  # the routed experts only (a stacked shared expert is the shared SwiGLU's)
        w13, w2 = (NVFP4Tensor(w.packed[:e], w.scales[:e], w.global_scale[:e]) for w in (w13, w2))
        return {"gate_up_proj": _dequantize_stack(w13, dtype), "down_proj": _dequantize_stack(w2, dtype)}


def _dequantize_stack(w: NVFP4Tensor, dtype: torch.dtype, chunk: int = 16) -> torch.Tensor:
    """[E, N, K] NVFP4 -> dense, `chunk` experts at a time (the decode's int64 temporaries are 8 B per weight)."""
    out = torch.empty(w.shape, dtype=dtype, device=w.packed.device)
    for lo in range(0, out.shape[0], chunk):
        hi = lo + chunk
        out[lo:hi] = dequantize_nvfp4(w.packed[lo:hi], w.scales[lo:hi], w.global_scale[lo:hi], dtype=dtype)
    return out


# ---- dense weights of a packed model ---------------------------------------------------------------------------------
def iter_dequantized(model: nn.Module, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """(our parameter name, dense tensor) for every parameter of the reference model, from a model that may hold
    packed modules: packed weights dequantised (`kernels/nvfp4.py` order: exact block value x global, one rounding
    to `dtype`), BF16 parameters cast. One tensor at a time, so the full-size model (70 GB in bf16) can be streamed
    into another model without holding two copies."""
    packed_prefixes = []
    for name, mod in model.named_modules():
        if any(name.startswith(p) for p in packed_prefixes):
            continue
        prefix = name + "." if name else ""
        if isinstance(mod, (NVFP4Linear, FP8Linear)):
            packed_prefixes.append(prefix)
            yield prefix + "weight", mod.dequantized(dtype)
        elif isinstance(mod, (NVFP4SwiGLU, NVFP4Experts)):
            packed_prefixes.append(prefix)
            for k, v in mod.dequantized(dtype).items():
                yield prefix + k, v
    for name, p in model.named_parameters():
        yield name, p.detach().to(dtype)


def dequantized_state_dict(model: nn.Module, dtype: torch.dtype = torch.float32,
                           device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """`iter_dequantized` collected into a state dict for `QwenForCausalLM` (tiny / test sizes)."""
    return {k: v if device is None else v.to(device) for k, v in iter_dequantized(model, dtype)}


def packed_modules(model: nn.Module) -> dict[str, str]:
    """module name -> kind, for reports: which layers run which format."""
    kinds = {NVFP4Linear: "W4A16_NVFP4", FP8Linear: "FP8", NVFP4SwiGLU: "W4A16_NVFP4 (gate/up fused)",
             NVFP4Experts: "W4A16_NVFP4 experts"}

    def kind(m: nn.Module) -> str:
        if isinstance(m, NVFP4Linear) and m.w4a4_export:
            return f"NVFP4 W4A4 export (w4a4={m.w4a4})"
        if isinstance(m, NVFP4SwiGLU) and (m.gate_up_proj.w4a4_export or m.down_proj.w4a4_export):
            return f"NVFP4 W4A4 export (gate/up fused, w4a4={m.gate_up_proj.w4a4})"
        return kinds[type(m)]

    return {n: kind(m) for n, m in model.named_modules() if type(m) in kinds}


def set_fp8_activation_quantization(model: nn.Module, enabled: bool) -> None:
    """Switch every FP8Linear between static W8A8 (the checkpoint's numerics) and weight-only (oracle isolation)."""
    for m in model.modules():
        if isinstance(m, FP8Linear):
            if enabled and not torch.isfinite(m.input_scale):
                raise ValueError("this FP8 layer has no input_scale; it can only run weight-only")
            m.quantize_activations = enabled
