"""Kernel registry: op name -> a plain-PyTorch reference plus ordered fast implementations; one is chosen per call,
and every choice is recorded (`choices()`, shown by `/readyz`) and logged the first time it is made.

    registry = default_registry()                      # the process-wide one, with every module in KERNEL_MODULES
    registry.set_preference("auto")                    # explicit, at engine start (STYLE A1: no env switches)
    registry.self_check("cuda")                        # optional: each chosen kernel vs its reference, loud fallback
    impl = registry.choose("mask_post", device="cuda", dtype=torch.float32, shape=(7, 288, 288),
                           height=480, width=640)
    impl.fn(...)                                       # or registry.call("mask_post", *args) = describe + choose + run

Rules (STYLE P4, A2):

* every op has a reference (`Implementation` named "reference"), always supported: the P8 baseline one flag away;
* fast implementations are tried in registration order; each has a `supports(**info) -> bool` guard that sees
  shapes / dtypes / device and must not raise;
* no silent fallback: a fallback to the reference is counted per op and logged (once per op and implementation); an
  explicit preference (e.g. TRITON) never falls back, it raises with the reason;
* the optional start-up `self_check` runs each fast implementation the preference could pick on the op's random
  sample inputs (every sample it supports, where an op gives one per regime) and compares with the reference at
  the op's stated tolerance; a failure is logged at ERROR, recorded in `choices()` and disables that implementation
  for the life of the registry (AUTO then uses the next one).

`choose()` is plain Python with a dict update: call it outside `torch.compile`d regions (at plan time) and call the
returned implementation inside; fast paths are `torch.library.custom_op`s with fake implementations, so
`torch.compile(fullgraph=True)` traces through them.

This module imports no torch: ops bring their own tensors, samples and comparisons.
"""

from __future__ import annotations

import enum
import functools
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger(__name__)

# Modules that define ops; each has `register(registry)`. Imported lazily by `default_registry()` (vLLM's backend
# registry keeps import paths as strings the same way, so `engine_core` never imports triton by itself).
KERNEL_MODULES: tuple[str, ...] = (
    "kernels.preprocess", "kernels.mask_post", "kernels.w4a16_gemm", "kernels.fp8_quant", "kernels.fp8_linear",
    "kernels.gdn_decode", "kernels.nvfp4", "kernels.paged_attention", "kernels.rms_norm", "kernels.moe_combine",
    "kernels.moe_router", "kernels.attn_prep", "kernels.moe_decode", "kernels.router_align",
)


class KernelPreference(str, enum.Enum):
    """Which implementation `choose()` may return (torchao's `KernelPreference` in spirit)."""

    AUTO = "auto"
    """The first fast implementation, in registration order, whose `supports()` accepts the call and whose
    self-check (if run) passed; otherwise the reference. The default. Every fallback is counted and logged."""

    REFERENCE = "reference"
    """Always the plain-PyTorch reference: the numerics of the upstream model, for bisecting an accuracy or speed
    regression (STYLE P8: the baseline stays one flag away)."""

    TRITON = "triton"
    """Only the Triton implementation. A call it does not support, or one disabled by a failed self-check, raises
    `NotImplementedError` instead of falling back: for tests and benchmark rows that must measure the kernel."""

    TORCH = "torch"
    """Only a fast path built from PyTorch / vendor-library calls rather than our own kernels (e.g.
    `torch._scaled_mm`, cuBLASLt, cuDNN); same no-fallback rule as TRITON."""

    @classmethod
    def parse(cls, value: "KernelPreference | str") -> "KernelPreference":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            valid = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown kernel preference {value!r}; valid: {valid}") from None


def resolve_preference(preference: KernelPreference | str, device: Any) -> KernelPreference:
    """The preference an engine on `device` (a `torch.device` or a string such as "cpu", "cuda:1") actually applies:
    AUTO on a CPU device is REFERENCE -- there the reference IS the fastest path (Triton runs on the CPU only through
    its interpreter, TRITON_INTERPRET=1, ~100x slower: a correctness tool); an explicit preference (TRITON: tests)
    is kept, and elsewhere AUTO stays AUTO. The rule of `sammie.segmenter.resolve_kernels`, here for engines that do
    not import sammie. Plain string handling: this module imports no torch."""
    preference = KernelPreference.parse(preference)
    kind = getattr(device, "type", None) or str(device).split(":", 1)[0]
    return KernelPreference.REFERENCE if preference is KernelPreference.AUTO and kind == "cpu" else preference


@dataclass(frozen=True)
class Implementation:
    """One way to compute an op."""

    name: str  # "reference", "triton", ...; unique within the op
    kind: KernelPreference  # the explicit preference that selects it (REFERENCE for the reference)
    fn: Callable[..., Any]  # same signature as the op's reference
    supports: Callable[..., bool]  # supports(**info) -> bool, info = shapes / dtype / device of one call


def _always(**_info: Any) -> bool:
    return True


@dataclass
class OpSpec:
    """An op: its reference, its fast paths (priority order) and how to check them against each other."""

    name: str
    reference: Implementation
    tolerance: str  # what "agrees with the reference" means for this op, and why (shown in choices())
    # sample(device) -> (args, kwargs), or a list of them: small random inputs for the self-check (each fast path is
    # checked on every one it supports: ops whose paths, or whose kernels' builds, split by size give one per regime)
    sample: Callable[[Any], tuple[tuple, dict] | list[tuple[tuple, dict]]] | None = None
    # compare(out, ref) -> None when within tolerance, else a one-line description of the disagreement
    compare: Callable[[Any, Any], str | None] | None = None
    # describe(*args, **kwargs) -> info dict for supports(); needed by `call()` and `self_check()`
    describe: Callable[..., dict] | None = None
    implementations: list[Implementation] = field(default_factory=list)  # fast paths only, priority order
    mutates: bool = False  # the op updates tensor arguments in place: the self-check gives each call its own copies


@dataclass
class _OpRecord:
    preference: KernelPreference = KernelPreference.AUTO
    calls: dict[str, int] = field(default_factory=dict)  # implementation name -> times chosen
    last: str | None = None  # implementation chosen by the latest call
    fallback: str | None = None  # why the latest AUTO call did not get a fast path (None: it did, or none exist)
    self_check: str = "not run"
    disabled: dict[str, str] = field(default_factory=dict)  # implementation name -> why (failed self-check)


class Registry:
    """Op name -> `OpSpec`; chooses and records implementations. See the module docstring."""

    def __init__(self, preference: KernelPreference | str = KernelPreference.AUTO):
        self._ops: dict[str, OpSpec] = {}
        self._records: dict[str, _OpRecord] = {}
        self._default = KernelPreference.parse(preference)
        self._logged: set[tuple[str, str]] = set()

    # ---- registration ----------------------------------------------------------------------------------------------
    def add_op(self, name: str, reference: Callable[..., Any], *, tolerance: str,
               sample: Callable[[Any], tuple[tuple, dict] | list[tuple[tuple, dict]]] | None = None,
               compare: Callable[[Any, Any], str | None] | None = None,
               describe: Callable[..., dict] | None = None, mutates: bool = False) -> OpSpec:
        if name in self._ops:
            raise ValueError(f"op {name!r} is already registered")
        ref = Implementation("reference", KernelPreference.REFERENCE, reference, _always)
        spec = OpSpec(name, ref, tolerance, sample, compare, describe, mutates=mutates)
        self._ops[name] = spec
        self._records[name] = _OpRecord(preference=self._default)
        return spec

    def add_implementation(self, op: str, name: str, fn: Callable[..., Any], supports: Callable[..., bool],
                           kind: KernelPreference | str = KernelPreference.TRITON) -> Implementation:
        spec = self._spec(op)
        kind = KernelPreference.parse(kind)
        if kind in (KernelPreference.AUTO, KernelPreference.REFERENCE):
            raise ValueError(f"a fast implementation cannot be of kind {kind.value!r}")
        if name == "reference" or any(i.name == name for i in spec.implementations):
            raise ValueError(f"op {op!r} already has an implementation named {name!r}")
        impl = Implementation(name, kind, fn, supports)
        spec.implementations.append(impl)
        return impl

    # ---- configuration ---------------------------------------------------------------------------------------------
    def set_preference(self, preference: KernelPreference | str, op: str | None = None) -> None:
        """For one op, or (op=None) for every op registered so far and any registered later."""
        pref = KernelPreference.parse(preference)
        if op is None:
            self._default = pref
            for rec in self._records.values():
                rec.preference = pref
        else:
            self._record(op).preference = pref
        log.info("kernel preference %s for %s", pref.value, op or "all ops")

    def disable(self, op: str, name: str, why: str) -> str | None:
        """Take implementation `name` of `op` out of `choose()` (as a failed self-check does), with the reason
        `choices()` reports. Returns the reason it was disabled for before (None: it was enabled), for `enable`.
        Modules that cached a choice keep it until they forget it (the Qwen model:
        `qwen_engine.model.quantized.forget_kernel_choices`)."""
        if not any(i.name == name for i in self._spec(op).implementations):
            raise ValueError(f"op {op!r} has no implementation named {name!r}")
        rec = self._record(op)
        before = rec.disabled.get(name)
        rec.disabled[name] = why
        log.info("kernel %s/%s disabled: %s", op, name, why)
        return before

    def enable(self, op: str, name: str, before: str | None = None) -> None:
        """Undo `disable`: `before` is what it returned (a failed self-check's verdict stays in force)."""
        if before is None:
            self._record(op).disabled.pop(name, None)
        else:
            self._record(op).disabled[name] = before

    def preference(self, op: str) -> KernelPreference:
        return self._record(op).preference

    # ---- selection -------------------------------------------------------------------------------------------------
    def choose(self, op: str, **info: Any) -> Implementation:
        """The implementation for one call described by `info` (keywords of the op's `supports()`), recorded."""
        spec, rec = self._spec(op), self._record(op)
        pref = rec.preference
        if pref is KernelPreference.REFERENCE:
            return self._chosen(spec, rec, spec.reference, None)
        why: list[str] = []
        for impl in spec.implementations:
            if pref is not KernelPreference.AUTO and impl.kind is not pref:
                continue
            if impl.name in rec.disabled:
                why.append(f"{impl.name} disabled: {rec.disabled[impl.name]}")
            elif not impl.supports(**info):
                why.append(f"{impl.name} does not support {_short(info)}")
            else:
                return self._chosen(spec, rec, impl, None)
        if pref is not KernelPreference.AUTO:
            reason = "; ".join(why) or f"no {pref.value} implementation registered"
            raise NotImplementedError(f"{op}: preference {pref.value} cannot be met: {reason}")
        return self._chosen(spec, rec, spec.reference, "; ".join(why) or None)

    def call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """describe(args) -> choose -> run."""
        spec = self._spec(op)
        if spec.describe is None:
            raise TypeError(f"op {op!r} has no describe(); use choose(op, **info) and call the implementation")
        return self.choose(op, **spec.describe(*args, **kwargs)).fn(*args, **kwargs)

    def _chosen(self, spec: OpSpec, rec: _OpRecord, impl: Implementation, fallback: str | None) -> Implementation:
        rec.calls[impl.name] = rec.calls.get(impl.name, 0) + 1
        rec.last = impl.name
        rec.fallback = fallback
        key = (spec.name, impl.name)
        if key not in self._logged:  # once per op and implementation
            self._logged.add(key)
            if fallback:
                log.warning("kernel %s: falling back to the reference (%s)", spec.name, fallback)
            else:
                log.info("kernel %s: using %s (preference %s)", spec.name, impl.name, rec.preference.value)
        return impl

    # ---- start-up self-check ---------------------------------------------------------------------------------------
    def self_check(self, device: Any, ops: list[str] | None = None) -> dict[str, str]:
        """Run every fast implementation the current preference could choose against the reference on the op's
        sample inputs on `device` (each of the op's samples it supports, in order, stopping at the first failure). A
        failure (disagreement beyond tolerance or an exception) is logged at ERROR, recorded and disables the
        implementation. Returns op -> outcome."""
        outcomes: dict[str, str] = {}
        for name in ops if ops is not None else list(self._ops):
            spec, rec = self._spec(name), self._record(name)
            candidates = [i for i in spec.implementations
                          if rec.preference is KernelPreference.AUTO or i.kind is rec.preference]
            if rec.preference is KernelPreference.REFERENCE or not candidates:
                rec.self_check = outcomes[name] = "skipped: only the reference can be chosen"
                continue
            if spec.sample is None or spec.compare is None or spec.describe is None:
                rec.self_check = outcomes[name] = "skipped: op has no sample/compare/describe"
                continue
            produced = spec.sample(device)
            samples = produced if isinstance(produced, list) else [produced]
            infos = [spec.describe(*a, **kw) for a, kw in samples]
            refs: dict[int, Any] = {}  # sample index -> the reference's output, computed when first needed

            def fresh(i):  # an op that mutates its inputs must not see the previous call's writes
                args, kwargs = samples[i]
                if not spec.mutates:
                    return args, kwargs
                copy = lambda a: a.clone() if hasattr(a, "clone") else a  # tensors (no torch import here)  # noqa: E731
                return tuple(map(copy, args)), {k: copy(v) for k, v in kwargs.items()}

            results = []
            for impl in candidates:
                fits = [j for j, info in enumerate(infos) if impl.supports(**info)]
                if not fits:
                    which = "sample" if len(samples) == 1 else "samples"
                    results.append(f"{impl.name} skipped (does not support the {which} on {device})")
                    continue
                problem = None
                for i in fits:
                    if i not in refs:
                        a, kw = fresh(i)
                        refs[i] = spec.reference.fn(*a, **kw)
                    try:
                        a, kw = fresh(i)
                        problem = spec.compare(impl.fn(*a, **kw), refs[i])
                    except Exception as exc:  # a crashing kernel is a failed kernel, reported with its reason
                        problem = f"raised {type(exc).__name__}: {exc}"
                    if problem is not None:
                        if len(samples) > 1:
                            problem = f"sample {i}: {problem}"
                        break
                if problem is None:
                    results.append(f"{impl.name} passed")
                    log.info("kernel self-check %s/%s on %s: passed on %d sample(s) (%s)", name, impl.name, device,
                             len(fits), spec.tolerance)
                else:
                    rec.disabled[impl.name] = f"self-check failed on {device}: {problem}"
                    results.append(f"{impl.name} FAILED: {problem}")
                    log.error("KERNEL SELF-CHECK FAILED %s/%s on %s: %s -- disabled; tolerance: %s",
                              name, impl.name, device, problem, spec.tolerance)
            rec.self_check = outcomes[name] = "; ".join(results)
        return outcomes

    # ---- reporting -------------------------------------------------------------------------------------------------
    def choices(self) -> dict[str, dict[str, Any]]:
        """JSON-ready state per op, for `/readyz` and benchmark headers."""
        out = {}
        for name, spec in self._ops.items():
            rec = self._records[name]
            out[name] = {
                "preference": rec.preference.value,
                "implementations": [i.name for i in spec.implementations] + ["reference"],
                "last": rec.last,
                "calls": dict(rec.calls),
                "fallback": rec.fallback,
                "self_check": rec.self_check,
                "disabled": dict(rec.disabled),
                "tolerance": spec.tolerance,
            }
        return out

    def ops(self) -> list[str]:
        return list(self._ops)

    def spec(self, op: str) -> OpSpec:
        return self._spec(op)

    def _spec(self, op: str) -> OpSpec:
        try:
            return self._ops[op]
        except KeyError:
            raise KeyError(f"unknown op {op!r}; registered: {', '.join(self._ops) or 'none'}") from None

    def _record(self, op: str) -> _OpRecord:
        self._spec(op)
        return self._records[op]


def _short(info: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in info.items()) + "}"


@functools.lru_cache(maxsize=None)
def default_registry() -> Registry:
    """The process-wide registry with every module in KERNEL_MODULES registered (imported on first call)."""
    registry = Registry()
    for module in KERNEL_MODULES:
        importlib.import_module(module).register(registry)
    return registry
