"""FP8 (e4m3) linears for the SAM 3 ViT trunk, switched on only where they keep the image features close to bf16.

    report = enable_vit_fp8(detector, sample_pixels)      # swaps in place, measures, keeps or restores
    report.enabled, report.reason, report.rel_err         # per FPN level, FP8 vs bf16 on sample_pixels
    disable_vit_fp8(detector)                              # back to the exact bf16 nn.Linear modules

What is swapped: in every trunk block (`backbone.vision_backbone.trunk.blocks.{i}`) the four nn.Linear layers
`attn.qkv` [3C, C], `attn.proj` [C, C], `mlp.fc1` [H, C], `mlp.fc2` [C, H] (C = 1024, H = 4736 in SAM 3: ~all of
the ViT's FLOPs outside attention). Each becomes an `Fp8Linear`: weights quantised once per output channel, the
activations per token at run time, one row-wise scaled FP8 GEMM (op "fp8_rowwise_linear" in `kernels.fp8_linear`,
chosen through the kernel registry with its supports() guard; no host syncs, so CUDA graphs capture it, and
torch.compile(fullgraph=True) traces it). Attention (SDPA), LayerNorms, patch embedding and neck stay bf16.

Static activation scales (`static=`, EngineConfig.vit_fp8_static; off by default). A listed
linear quantises its input with ONE scale per layer instead of one per token: s = STATIC_HEADROOM x amax / 448, the
amax of that layer's bf16 input over the sample, recorded during the gate's bf16 pass (op
"fp8_static_rowwise_linear"). No reduction runs before the first code is written, so the quantiser is elementwise
and can fuse into the op before it (for fc2: the GELU pass the bf16 path runs anyway; under inductor, which was
chosen there in waterfall run 16: the fusion itself not profiled). Values beyond the headroom
saturate at +-448 x s; e4m3's normal range spans 2^14.8 (2^-6 .. 448), so the headroom's one binade leaves values
down to amax / 2^13.8 normal. The scales are only as good as the sample: the engine calibrates on
`vit_fp8_calibration_images` when given, else on its seeded noise image (fine for speed, not for a real checkpoint).
H200 (waterfall run 16): with all four linears in FP8 and fc2 static, the detector alone 72.9 -> 76.5 img/s (+5.1%,
0.16 ms per block) against fc2 in bf16, the engine 65.5 -> 72.7 (second in its process, so partly position); the
gate's error 0.070 -> 0.081 on the noise sample (in-sample: the gate runs on the images the scales were calibrated
on, so it cannot see saturation on other images; the oracle on real images decides).

The gate. `enable_vit_fp8` runs `detector.encode_images(sample_pixels)` in bf16, swaps, runs it again and keeps FP8
only if every FPN level's relative error ||fp8 - bf16|| / ||bf16|| is <= max_rel_err; otherwise it restores the
bf16 modules (bit-identical outputs: the very same nn.Linear objects go back). The gate is a cheap guard against a
broken kernel or a checkpoint whose activations FP8 cannot represent (outlier channels that crush the per-token
scale); the accuracy decision stays with the oracle (mask IoU against the bf16 engine), run on real images.

DEFAULT_MAX_REL_ERR = 0.1 (SQNR >= 20 dB), why: one e4m3 rounding has a relative RMS error of about 2^-4 / sqrt(3)
= 3.6% (3 mantissa bits, uniform error in +-half an ulp); a GEMM output whose two operands both carry it lands near
sqrt(2) x 3.6% ~ 5% for incoherent errors, and 32 residual blocks with LayerNorms add errors per block but the
residual stream carries the bulk of the signal. Measured with the FP8 emulation at the tiny test config (random
weights and pixels): 0.7%, 2.1%, 2.3% for levels 4G, 2G, G (tests/test_fp8_vit.py prints it); benchmarks/fp8_check.py
reports it at full size on the GPU (random weights). A broken kernel (wrong scale, transposed weight, saturation)
gives O(1). 0.1 passes healthy FP8 with margin and rejects broken FP8 by an order of magnitude; tighten it once
the real checkpoint's number is known.

Memory: the bf16 weights stay allocated (the undo path), so FP8 adds ~0.3 GB for SAM 3's 300M trunk weights.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from torch import nn

from kernels.fp8_linear import (
    ROWWISE_NAME,
    STATIC_ROWWISE_NAME,
    describe_rowwise,
    describe_static_rowwise,
    quantize_weight_rowwise,
)
from kernels.nvfp4 import E4M3_MAX

DEFAULT_MAX_REL_ERR = 0.1  # per FPN level, FP8 vs bf16; see the module docstring
STATIC_HEADROOM = 2.0  # static activation scale = headroom x calibrated amax / 448 (module docstring)
MAX_CALIBRATION_IMAGES = 8  # the engine's calibration sample runs as one ViT batch at start
VIT_LINEARS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")  # inside each trunk block
TRUNK = "backbone.vision_backbone.trunk"


@dataclass(frozen=True)
class Fp8Report:
    enabled: bool  # FP8 linears are in place now
    reason: str  # why (not); one line
    layers: tuple[str, ...]  # modules that run in FP8 (empty when not enabled)
    rel_err: tuple[float, ...]  # per FPN level [4G, 2G, G], FP8 vs bf16 on the sample (empty: not measured)
    max_rel_err: float  # the gate
    implementation: str | None  # the registry implementation the swapped layers use ("reference" = emulation)
    skipped: tuple[str, ...] = ()  # linears the fast path does not support (kept in bf16); why: see `reason`
    static: tuple[str, ...] = ()  # of `layers`, those with one calibrated activation scale (module docstring)
    input_scales: tuple[float, ...] = ()  # their scales, in `static`'s order
    calibration: str = ""  # what the sample (and so the static scales) came from; "" = not said

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Fp8Linear(nn.Module):
    """Drop-in for an nn.Linear: y = fp8_rowwise_linear(x, W_e4m3, w_scale, bias) with the implementation `fn`.

    `weight` / `bias` are the source layer's own Parameters (same state-dict keys, bf16 values kept for undo);
    `weight_fp8` [N, K] e4m3 and `weight_scale` [N] fp32 are non-persistent buffers derived from them."""

    def __init__(self, linear: nn.Linear, fn: Callable[..., torch.Tensor], impl_name: str, applies_gelu: bool = False,
                 input_scale: torch.Tensor | None = None):
        """`applies_gelu`: `fn` is an implementation of "fp8_rowwise_linear_gelu" -- it takes the pre-activation and
        applies the GELU in its quantiser; the ViT's `Mlp` then hands it fc1's output (`sammie.model.vit.Mlp`).
        `input_scale` (fp32, one element): `fn` is an implementation of "fp8_static_rowwise_linear", which quantises
        the input with this one calibrated scale (a buffer, so CUDA graphs and inductor see a constant)."""
        super().__init__()
        if applies_gelu and input_scale is not None:
            raise ValueError("an Fp8Linear applies the GELU (row-wise op) or takes a static input scale, not both")
        self.applies_gelu = applies_gelu
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        w_fp8, w_scale = quantize_weight_rowwise(linear.weight)
        self.register_buffer("weight_fp8", w_fp8, persistent=False)
        self.register_buffer("weight_scale", w_scale, persistent=False)
        self.fn = fn
        self.impl_name = impl_name
        self.static = input_scale is not None
        if self.static:
            self.register_buffer("input_scale", input_scale.detach().float().reshape(1).to(w_fp8.device),
                                 persistent=False)
        self.__dict__["source"] = linear  # not a submodule: restored as is by `disable_vit_fp8`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.static:
            return self.fn(x, self.weight_fp8, self.weight_scale, self.bias, self.input_scale)
        return self.fn(x, self.weight_fp8, self.weight_scale, self.bias)

    def extra_repr(self) -> str:
        gelu = ", GELU of its input in the quantiser" if self.applies_gelu else ""
        act = f", static input scale {float(self.input_scale):.4g}" if self.static else ", per-token input scales"
        return (f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 row-wise weights"
                f"{act}, {self.impl_name}{gelu}")


def check_linears(linears: tuple[str, ...]) -> None:
    """ValueError unless `linears` is a non-empty subset of VIT_LINEARS without repeats."""
    if not linears or len(set(linears)) != len(linears) or not set(linears) <= set(VIT_LINEARS):
        raise ValueError(f"vit_fp8_linears must be a non-empty subset of {list(VIT_LINEARS)} without repeats, got "
                         f"{list(linears)}")


def check_static(static: tuple[str, ...], linears: tuple[str, ...]) -> None:
    """ValueError unless `static` is a subset of `linears` (leaves of VIT_LINEARS) without repeats."""
    if len(set(static)) != len(static) or not set(static) <= set(linears):
        raise ValueError(f"vit_fp8_static must be a subset of vit_fp8_linears {list(linears)} without repeats, got "
                         f"{list(static)}")


def vit_linear_names(detector: nn.Module, linears: tuple[str, ...] = VIT_LINEARS) -> list[str]:
    """The module names of `linears` (leaves of VIT_LINEARS) in every trunk block, block by block."""
    check_linears(linears)
    trunk = detector.get_submodule(TRUNK)
    return [f"{TRUNK}.blocks.{i}.{leaf}" for i in range(len(trunk.blocks)) for leaf in VIT_LINEARS if leaf in linears]


def _set(detector: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(detector.get_submodule(parent), leaf, module)


def disable_vit_fp8(detector: nn.Module) -> list[str]:
    """Put the original bf16 nn.Linear modules back; returns the names restored (empty if FP8 was off)."""
    restored = []
    for name in vit_linear_names(detector):
        module = detector.get_submodule(name)
        if isinstance(module, Fp8Linear):
            _set(detector, name, module.source)
            restored.append(name)
    return restored


@torch.no_grad()
def _fpn(detector: nn.Module, pixels: torch.Tensor) -> list[torch.Tensor]:
    return [f.float() for f in detector.encode_images(pixels).fpn]


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """||ours - ref|| / ||ref|| in float64 (NaN stays NaN and fails the gate)."""
    ours, ref = ours.double(), ref.double()
    denom = ref.norm()
    return float((ours - ref).norm() / denom) if denom > 0 else float((ours - ref).norm())


def _describe_call(linear: nn.Linear, static: bool = False) -> dict[str, Any]:
    """The row-wise ops' description of one call of `linear` in FP8 (`static`: the static op's, with a one-element
    fp32 scale on the weight's device): the token count does not enter the guards, one row stands for all."""
    probe = linear.weight.new_empty((1, linear.in_features))
    w_probe = torch.empty(linear.weight.shape, dtype=torch.float8_e4m3fn, device=linear.weight.device)
    s_probe = torch.empty(linear.out_features, dtype=torch.float32, device=linear.weight.device)
    if static:
        scale = torch.ones(1, dtype=torch.float32, device=linear.weight.device)
        return describe_static_rowwise(probe, w_probe, s_probe, linear.bias, scale)
    return describe_rowwise(probe, w_probe, s_probe, linear.bias)


def _gelu_implementation(registry, info: dict[str, Any], preference: str):
    """The "fp8_rowwise_linear_gelu" implementation for an FP8 `mlp.fc2` described by `info` (its input's GELU in
    the quantiser), or None: the op absent, or nothing but the reference where FP8 is wanted for speed. Chosen with
    the same preference as the row-wise op: "auto" (eager) takes the one-pass Triton GELU-quantiser; "torch" (the
    engine under inductor) the torch ops, which inductor fuses into one looped pass -- measured faster than the
    Triton kernel there in waterfall run 8 (fc2 in FP8 cost 0.27 ms per block more than bf16 with inductor's fusion,
    0.40 ms with the Triton kernel of then); alone, the kernel's two-tile version now beats that fusion (quant_probe
    run 1: 0.846 against 1.052 ms a call), not yet measured inside the engine; "reference" the emulation."""
    from kernels.fp8_linear import ROWWISE_GELU_NAME

    if ROWWISE_GELU_NAME not in registry.ops():
        return None
    if preference == "reference":
        return registry.spec(ROWWISE_GELU_NAME).reference
    try:
        with _OpPreference(registry, preference, ROWWISE_GELU_NAME):
            impl = registry.choose(ROWWISE_GELU_NAME, **info)
    except NotImplementedError:  # that kind disabled (a failed self-check) or unsupported: fc2 takes F.gelu + row-wise
        return None
    return None if impl.name == "reference" else impl


class _OpPreference:
    """`with _OpPreference(registry, pref, op):` sets the preference of one op only (the row-wise FP8 op by default),
    restoring the registry's own."""

    def __init__(self, registry, preference: str, op: str = ROWWISE_NAME):
        self.registry, self.preference, self.op = registry, preference, op

    def __enter__(self):
        self.before = self.registry.preference(self.op)
        self.registry.set_preference(self.preference, self.op)

    def __exit__(self, *exc):
        self.registry.set_preference(self.before, self.op)


@contextlib.contextmanager
def _input_amax(detector: nn.Module, names: list[str]):
    """While inside, every call of the modules `names` folds its input's max |x| into `amax[name]` (fp32 [] on the
    device, no host sync); yields that dict."""
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def pre(_module, args):
            a = args[0].detach().abs().amax().float()
            amax[name] = a if name not in amax else torch.maximum(amax[name], a)
        return pre

    handles = [detector.get_submodule(n).register_forward_pre_hook(hook(n)) for n in names]
    try:
        yield amax
    finally:
        for h in handles:
            h.remove()


def static_input_scale(amax: torch.Tensor, headroom: float = STATIC_HEADROOM) -> torch.Tensor:
    """Calibrated amax (fp32 []) -> the one activation scale, headroom x amax / 448 (an all-zero input gives the
    smallest normal fp32 amax instead of a zero scale). Tensor / tensor: IEEE division on every device (CUDA divides
    by a Python scalar through its reciprocal, 1 ulp off), so the scale does not depend on the device."""
    a = headroom * amax.float().clamp_min(torch.finfo(torch.float32).tiny)
    return (a / torch.full_like(a, E4M3_MAX)).reshape(1)


def enable_vit_fp8(detector: nn.Module, sample_pixels: torch.Tensor, *, max_rel_err: float = DEFAULT_MAX_REL_ERR,
                   preference: str = "auto", registry=None, linears: tuple[str, ...] = VIT_LINEARS,
                   static: tuple[str, ...] = (), calibration: str = "") -> Fp8Report:
    """Swap the ViT's linears for FP8 ones in place if the fast path runs here and the gate passes (module
    docstring). `preference`: "auto" (fastest supported FP8 GEMM; none -> enabled False with the reason),
    "triton" / "torch" (that implementation only; NotImplementedError from the registry if unsupported), or
    "reference" (the fp32 quantise-dequantise emulation on any device: for tests and numerics studies, slower than
    bf16). `preference` governs the row-wise op and, for an FP8 mlp.fc2, the GELU op ("fp8_rowwise_linear_gelu":
    the input's GELU inside the quantiser; see `_gelu_implementation`), and the static op. `sample_pixels`
    [B, 3, S, S] in the model dtype: use real preprocessed images when you have them. `linears`: which of each
    block's VIT_LINEARS to swap (the others stay bf16); `static`: which of `linears` take one activation scale
    calibrated on `sample_pixels` (module docstring; an FP8 fc2 listed there gets its GELU from the Mlp, not from
    its quantiser); `calibration`: what the sample is, for the report. Both lists are checked before anything is
    touched."""
    if registry is None:
        from engine_core.registry import default_registry

        registry = default_registry()
    needed = [ROWWISE_NAME] + ([STATIC_ROWWISE_NAME] if static else [])
    for op in needed:
        if op not in registry.ops():
            raise ValueError(f"kernel registry has no {op!r} op (kernels.fp8_linear not registered)")
    check_linears(linears)  # a bad list must not first undo an FP8 detector
    check_static(static, linears)
    disable_vit_fp8(detector)  # measure the bf16 baseline from a clean state
    names = vit_linear_names(detector, linears)
    static_names = set(vit_linear_names(detector, static)) if static else set()
    plan, skipped, fallbacks = [], [], []  # plan: (name, linear, implementation, "rowwise" | "gelu" | "static")
    with contextlib.ExitStack() as prefs:  # plan time: choose() outside any compiled region
        for op in needed:
            prefs.enter_context(_OpPreference(registry, preference, op))
        for name in names:
            linear = detector.get_submodule(name)
            op = STATIC_ROWWISE_NAME if name in static_names else ROWWISE_NAME
            info = _describe_call(linear, static=op == STATIC_ROWWISE_NAME)
            impl = registry.choose(op, **info)
            if impl.name == "reference" and preference != "reference":
                fallback = registry.choices()[op]["fallback"] or "no FP8 implementation registered"
                skipped.append(name)
                fallbacks.append(fallback)
            elif op == STATIC_ROWWISE_NAME:
                plan.append((name, linear, impl, "static"))
            elif name.endswith(".mlp.fc2") and (gelu := _gelu_implementation(registry, info, preference)):
                plan.append((name, linear, gelu, "gelu"))  # the GELU inside the quantiser (`Fp8Linear.applies_gelu`)
            else:
                plan.append((name, linear, impl, "rowwise"))
    planned_static = [name for name, *_, mode in plan if mode == "static"]

    def report(enabled: bool, reason: str, rel: tuple[float, ...] = (), layers: tuple[str, ...] = (),
               scales: tuple[float, ...] = ()) -> Fp8Report:
        impl_name = plan[0][2].name if plan else None
        return Fp8Report(enabled, reason, layers, rel, max_rel_err, impl_name, tuple(skipped),
                         tuple(planned_static) if enabled else (), scales if enabled else (), calibration)

    if not plan:
        device = sample_pixels.device
        return report(False, f"no FP8 GEMM for the ViT on {device.type}"
                             f"{' ' + str(torch.cuda.get_device_capability(device)) if device.type == 'cuda' else ''}"
                             f": {fallbacks[0] if fallbacks else 'nothing to swap'}")
    with _input_amax(detector, planned_static) as amax:  # the static layers' calibration rides on the bf16 pass
        baseline = _fpn(detector, sample_pixels)
    unseen = [name for name in planned_static if name not in amax]
    if unseen:  # e.g. an fc1 under vit_fused_gelu: the Mlp calls cuBLASLt with fc1's weights, not fc1 (the engine
        #         enables FP8 before the fused GELU, so only direct callers meet this)
        mlp = detector.get_submodule(unseen[0].rpartition(".")[0])
        why = " (vit_fused_gelu bypasses fc1)" if unseen[0].endswith("mlp.fc1") and getattr(mlp, "fused_gelu", False) \
            else ""
        return report(False, f"FP8 not enabled: {unseen[0]} (static) never ran on the sample, so its scale cannot be "
                             f"calibrated{why}; bf16 kept")
    scales = {name: static_input_scale(amax[name]) for name in planned_static}
    # one host sync (start-up only): every static layer's amax and scale, for the check and the report
    host = torch.cat([torch.stack([amax[n] for n in planned_static]), *scales.values()]).tolist() \
        if planned_static else []
    k = len(planned_static)
    finite = [math.isfinite(v) for v in host[:k]]
    if not all(finite):
        return report(False, f"FP8 not enabled: non-finite activations on the sample at "
                             f"{planned_static[finite.index(False)]} (static scales cannot be calibrated); bf16 kept")
    for name, linear, impl, mode in plan:
        _set(detector, name, Fp8Linear(linear, impl.fn, impl.name, mode == "gelu", input_scale=scales.get(name)))
    try:
        fp8 = _fpn(detector, sample_pixels)
    except Exception:
        disable_vit_fp8(detector)
        raise
    rel = tuple(_rel_err(o, r) for o, r in zip(fp8, baseline))
    bad = [f"level {i}: {e:.3g}" for i, e in enumerate(rel) if not e <= max_rel_err]  # NaN fails
    if bad:
        disable_vit_fp8(detector)
        return report(False, f"FP8 rejected, relative error above {max_rel_err:g} ({'; '.join(bad)}); bf16 restored",
                      rel)
    partial = f", {len(skipped)} kept in bf16 ({fallbacks[0]})" if skipped else ""
    gelu = sorted({impl.name for _, _, impl, mode in plan if mode == "gelu"})
    gelu = f" (fc2: {gelu[0]}, its input's GELU in the quantiser)" if gelu else ""
    fixed = (f", {len(planned_static)} with a static input scale ({STATIC_HEADROOM:g} x the amax on "
             f"{calibration or 'the sample'})") if planned_static else ""
    return report(True, f"FP8 {plan[0][2].name} on {len(plan)} linears{gelu}{fixed}{partial}; max relative error "
                        f"{max(rel):.3g} <= {max_rel_err:g}", rel, tuple(name for name, *_ in plan), tuple(host[k:]))
