"""engine_core.registry: preferences, guards, recorded and logged choices, the start-up self-check and its loud
fallback, on toy ops (plain Python, no torch); then the real registry (kernels/) self-checked on this machine."""

import json
import logging
import subprocess
import sys

import pytest

from engine_core.registry import KERNEL_MODULES, KernelPreference, Registry, default_registry


def double_ref(x):
    return [2 * v for v in x]


def double_fast(x):
    return [v + v for v in x]


def double_wrong(x):
    return [2 * v + 1 for v in x]


def double_crash(x):
    raise RuntimeError("kernel exploded")


def fits(*, n, **_):
    return n <= 4


def toy_registry(fast=double_fast, preference="auto") -> Registry:
    reg = Registry(preference)
    reg.add_op("double", double_ref, tolerance="exact",
               sample=lambda device: (([1, 2, 3],), {}),
               compare=lambda out, ref: None if out == ref else f"{out} != {ref}",
               describe=lambda x: {"n": len(x)})
    reg.add_implementation("double", "triton", fast, fits)
    return reg


def test_auto_prefers_the_fast_path_and_records_fallbacks(caplog):
    reg = toy_registry()
    caplog.set_level(logging.INFO, logger="engine_core.registry")
    assert reg.choose("double", n=3).name == "triton"
    assert reg.call("double", [1, 2]) == [2, 4]
    assert reg.choose("double", n=5).name == "reference"  # guard says no -> reference, recorded
    assert reg.choose("double", n=6).name == "reference"
    c = reg.choices()["double"]
    assert c["calls"] == {"triton": 2, "reference": 2}
    assert c["last"] == "reference" and "does not support {n=6}" in c["fallback"]
    assert c["implementations"] == ["triton", "reference"] and c["preference"] == "auto"
    json.dumps(reg.choices())  # /readyz-ready
    # logged once per (op, implementation), the fallback at WARNING
    msgs = [(r.levelno, r.getMessage()) for r in caplog.records if "kernel double" in r.getMessage()]
    assert len(msgs) == 2
    assert msgs[0][0] == logging.INFO and "using triton" in msgs[0][1]
    assert msgs[1][0] == logging.WARNING and "falling back to the reference" in msgs[1][1]
    assert reg.choose("double", n=3).name == "triton"
    assert reg.choices()["double"]["fallback"] is None


def test_disable_and_enable_an_implementation():
    reg = toy_registry()
    assert reg.disable("double", "triton", "side-by-side benchmark") is None
    assert reg.choose("double", n=3).name == "reference"
    assert "triton disabled: side-by-side benchmark" in reg.choices()["double"]["fallback"]
    reg.enable("double", "triton")
    assert reg.choose("double", n=3).name == "triton"
    # a failed self-check's verdict survives a disable / enable round trip
    bad = toy_registry(fast=double_wrong)
    bad.self_check("cpu")
    before = bad.disable("double", "triton", "benchmark")
    assert before.startswith("self-check failed")
    bad.enable("double", "triton", before)
    assert bad.choose("double", n=3).name == "reference"
    with pytest.raises(ValueError, match="no implementation named 'cuda'"):
        reg.disable("double", "cuda", "typo")


def test_explicit_preferences():
    reg = toy_registry()
    reg.set_preference("reference")
    assert reg.choose("double", n=1).name == "reference"
    reg.set_preference(KernelPreference.TRITON, op="double")
    assert reg.choose("double", n=4).name == "triton"
    with pytest.raises(NotImplementedError, match="preference triton cannot be met: triton does not support"):
        reg.choose("double", n=5)  # never a silent fallback under an explicit preference
    with pytest.raises(ValueError, match="valid: auto, reference, triton, torch"):
        reg.set_preference("cuda")
    # each explicit preference picks only its own kind; AUTO keeps registration order (triton first)
    reg.add_implementation("double", "native", double_fast, lambda **_: True, kind="torch")
    reg.set_preference("torch", op="double")
    assert reg.choose("double", n=9).name == "native"
    reg.set_preference("auto", op="double")
    assert reg.choose("double", n=3).name == "triton" and reg.choose("double", n=9).name == "native"
    # a preference set for all ops applies to ops registered later too
    reg.set_preference("reference")
    reg.add_op("noop", lambda: None, tolerance="exact")
    assert reg.preference("noop") is KernelPreference.REFERENCE


def test_registration_errors():
    reg = toy_registry()
    with pytest.raises(ValueError, match="already registered"):
        reg.add_op("double", double_ref, tolerance="exact")
    with pytest.raises(ValueError, match="already has an implementation"):
        reg.add_implementation("double", "triton", double_fast, fits)
    with pytest.raises(ValueError, match="cannot be of kind"):
        reg.add_implementation("double", "other", double_fast, fits, kind="reference")
    with pytest.raises(KeyError, match="unknown op 'triple'; registered: double"):
        reg.choose("triple")
    reg.add_op("bare", double_ref, tolerance="exact")
    with pytest.raises(TypeError, match="no describe"):
        reg.call("bare", [1])


@pytest.mark.parametrize("bad", [double_wrong, double_crash])
def test_self_check_failure_disables_loudly(bad, caplog):
    reg = toy_registry(fast=bad)
    caplog.set_level(logging.INFO, logger="engine_core.registry")
    outcome = reg.self_check("cpu")["double"]
    assert outcome.startswith("triton FAILED")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "KERNEL SELF-CHECK FAILED double/triton" in errors[0].getMessage()
    c = reg.choices()["double"]
    assert c["self_check"] == outcome and "self-check failed on cpu" in c["disabled"]["triton"]
    assert reg.choose("double", n=3).name == "reference"  # AUTO: loud fallback, recorded
    assert "triton disabled: self-check failed" in reg.choices()["double"]["fallback"]
    reg.set_preference("triton")
    with pytest.raises(NotImplementedError, match="disabled"):
        reg.choose("double", n=3)


def test_self_check_pass_and_skips():
    reg = toy_registry()
    assert reg.self_check("cpu") == {"double": "triton passed"}
    assert reg.choose("double", n=3).name == "triton"
    reg.set_preference("reference")
    assert reg.self_check("cpu")["double"].startswith("skipped: only the reference")
    reg2 = Registry()
    reg2.add_op("bare", double_ref, tolerance="exact")
    reg2.add_implementation("bare", "triton", double_fast, fits)
    assert reg2.self_check("cpu")["bare"].startswith("skipped: op has no sample")


def test_self_check_with_a_sample_per_regime():
    """An op whose fast paths split by size gives a list of samples: each path is checked on every one it supports
    (a small-input path on the small sample, a large-input one on the large, a path taking both on both), the
    reference run once per sample used; a path no sample fits is skipped, said so; a wrong large-input path fails on
    its own sample."""
    calls = []

    def ref(x):
        calls.append(len(x))
        return double_ref(x)

    def reg_with(large_fn):
        reg = Registry()
        reg.add_op("double", ref, tolerance="exact", sample=lambda device: [(([1, 2, 3],), {}), (([1] * 9,), {})],
                   compare=lambda out, ref_out: None if out == ref_out else f"{out} != {ref_out}",
                   describe=lambda x: {"n": len(x)})
        reg.add_implementation("double", "small", double_fast, fits)  # n <= 4
        reg.add_implementation("double", "large", large_fn, lambda *, n, **_: n > 4)
        reg.add_implementation("double", "huge", double_fast, lambda *, n, **_: n > 100)
        return reg

    assert reg_with(double_fast).self_check("cpu") == {
        "double": "small passed; large passed; huge skipped (does not support the samples on cpu)"}
    assert calls == [3, 9]
    outcome = reg_with(double_wrong).self_check("cpu")["double"]
    assert outcome.startswith("small passed; large FAILED")
    # a path that takes every sample is checked on each, not only the first: wrong on the large one, it fails there
    reg = reg_with(double_fast)
    reg.add_implementation("double", "any", lambda x: double_fast(x) if len(x) <= 4 else double_wrong(x),
                           lambda **_: True)
    outcome = reg.self_check("cpu")["double"]
    assert outcome.startswith("small passed; large passed; huge skipped (does not support the samples on cpu); "
                              "any FAILED: sample 1: "), outcome
    assert "any" in reg.choices()["double"]["disabled"], reg.choices()


@pytest.mark.parametrize("mutates", [True, False])
def test_self_check_of_an_op_that_mutates_its_input(mutates):
    """An in-place op (like gdn_decode_rows) is checked on its own copy of the sample per call when registered with
    mutates=True; without it the fast path would see the reference's writes and fail."""
    class Buf(list):
        def clone(self):
            return Buf(self)

    def bump_ref(x):  # in place, returns the new contents
        x[:] = [v + 1 for v in x]
        return list(x)

    reg = Registry()
    reg.add_op("bump", bump_ref, tolerance="exact", sample=lambda device: ((Buf([1, 2]),), {}),
               compare=lambda out, ref: None if out == ref else f"{out} != {ref}", describe=lambda x: {"n": len(x)},
               mutates=mutates)
    reg.add_implementation("bump", "triton", bump_ref, fits)
    outcome = reg.self_check("cpu")["bump"]
    assert outcome == "triton passed" if mutates else outcome.startswith("triton FAILED: [3, 4] != [2, 3]")


def test_registry_imports_no_torch():
    code = "import sys, engine_core.registry; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_default_registry_self_check_on_this_machine():
    """The real ops: registered, their Triton paths chosen where they can run, and each passes its self-check
    against its reference (on CPU through the Triton interpreter; see tests/conftest.py)."""
    import torch

    reg = default_registry()
    assert reg is default_registry()
    # kernels.w4a16_gemm registers four ops (dense, dense with the SwiGLU epilogue, MoE, and kernels.w4a16_swapped's
    # dense on fragment-order bytes: lm_head), kernels.fp8_linear four (per-tensor static, row-wise dynamic, row-wise of
    # gelu(x): the ViT's fc2, row-wise weights with one static activation scale: the ViT's vit_fp8_static),
    # kernels.gdn_decode three (out of place, in place over the state pool, and that with the output's gated norm + FP8
    # codes), kernels.rms_norm five (zero-centred, gated, residual add + zero-centred, the first two with FP8 codes),
    # kernels.attn_prep three (decode prep, output gate, the gate with FP8 codes), kernels.moe_router three (top-k over
    # given logits; the router GEMV and the top-k in one launch; the router GEMM at 5-64 rows then the top-k),
    # kernels.moe_combine three (the MoE tail, the tail + the next layer's input norm, the same + its FP8 codes),
    # kernels.nvfp4 the Blackwell W4A4 linear, kernels.router_align two (the top-k + alignment after F.linear, and
    # after the router GEMM in Triton); every other module one
    assert set(reg.ops()) == {"preprocess", "mask_post", "w4a16_linear", "w4a16_swiglu", "w4a16_moe",
                              "w4a16_linear_frag",
                              "fp8_quant_rows", "fp8_linear", "fp8_rowwise_linear", "fp8_rowwise_linear_gelu",
                              "fp8_static_rowwise_linear",
                              "gdn_decode", "gdn_decode_rows", "gdn_decode_rows_norm_fp8",
                              "nvfp4_w4a4_linear", "paged_decode_attention", "paged_decode_attention_gated_fp8",
                              "rms_norm_zc", "rms_norm_gated",
                              "add_rms_norm_zc", "moe_combine", "moe_combine_norm", "moe_combine_norm_fp8",
                              "router_topk", "router_gemv_topk", "router_linear_topk", "attn_decode_prep",
                              "attn_output_gate", "rms_norm_zc_fp8", "rms_norm_gated_fp8", "attn_output_gate_fp8",
                              "w4a16_moe_decode", "router_topk_align", "router_linear_topk_align"}
    assert len(KERNEL_MODULES) == 14
    device = "cuda" if torch.cuda.is_available() else "cpu"
    outcomes = reg.self_check(device, ops=["preprocess", "mask_post"])
    assert outcomes == {"preprocess": "triton passed", "mask_post": "triton passed"}, outcomes
    c = reg.choices()
    assert c["preprocess"]["disabled"] == {} == c["mask_post"]["disabled"]
    json.dumps(c)
