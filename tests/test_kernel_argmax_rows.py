"""kernels/argmax_rows.py: the greedy sampler's argmax in one launch, equal to `torch.argmax(x, dim=-1)` index for
index -- first maximum on ties, a NaN above every number, a row of -inf -> 0 -- on CPU through Triton's interpreter
(tests/conftest.py), on a GPU compiled; and the runner's sampler taking it."""

import pytest
import torch

from kernels.argmax_rows import (
    argmax_rows_reference,
    argmax_rows_triton,
    compare,
    describe,
    random_inputs,
    supports,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _runs_here() -> bool:
    return supports(**describe(random_inputs(1, 8, device=DEVICE)))


pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")


@pytest.mark.parametrize("b,v,programs", [(1, 5000, None), (3, 777, 4), (2, 100, 8), (4, 4096, 2), (1, 1, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_torch_argmax_with_ties(b, v, programs, dtype):
    """Coarse-grid values: the maximum repeats across tiles and slices (and slices past the row's end are empty)."""
    x = random_inputs(b, v, dtype, seed=b * v, device=DEVICE)
    out = argmax_rows_triton(x, programs=programs)
    assert compare(out, argmax_rows_reference(x)) is None


def test_first_maximum_in_a_later_slice_and_special_values():
    """The maximum only in the last slice; exact ties at both ends (the first wins); NaN rows (the first NaN wins,
    whatever the numbers, +inf included); a row of -inf (index 0); a row whose maximum is the last element."""
    v = 3000
    x = torch.full((6, v), -1.0)
    x[0, v - 7] = 5.0
    x[1, 3], x[1, v - 1] = 2.0, 2.0
    x[2, 100], x[2, 2000], x[2, 10] = float("nan"), float("nan"), float("inf")
    x[3] = float("-inf")
    x[4, v - 1] = 0.5
    x[5, 1500], x[5, 2999] = float("inf"), float("inf")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype).to(DEVICE)
        for programs in (None, 4, 2):
            out = argmax_rows_triton(xd, programs=programs)
            assert out.tolist() == argmax_rows_reference(xd).tolist() == [v - 7, 3, 100, 0, v - 1, 1500], dtype


def test_supports_and_registry():
    """2-D rows with a unit inner stride in bf16 / fp16 / fp32 only; the runner's registry has the op (checked at
    start like its other kernels) and the engine's sampler uses it for the greedy rows."""
    from engine_core.registry import Registry
    from kernels import argmax_rows

    assert not supports(**describe(random_inputs(2, 8, device=DEVICE).t().contiguous().t()))
    assert not supports(**describe(torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)))
    assert not supports(**describe(torch.zeros(8, device=DEVICE)))
    reg = Registry()
    argmax_rows.register(reg)
    assert reg.self_check(torch.device(DEVICE), ops=["argmax_rows"])["argmax_rows"].startswith("triton passed")


def test_sampler_takes_the_kernel():
    """`sample(..., argmax=...)` returns the kernel's greedy ids (all-greedy rows) and `ModelRunner._argmax` is the
    registry's op."""
    from engine_core.sampling import SamplingTensors, sample
    from qwen_engine.runner import gdn_registry

    x = random_inputs(3, 600, seed=5, device=DEVICE)
    seen = []

    def fake(logits):
        seen.append(logits.shape)
        return argmax_rows_triton(logits)

    st = SamplingTensors(all_greedy=True, needs_sort=False, temperature=None, top_k=None, top_p=None, seed=None,
                         step=None)
    assert sample(x, st, argmax=fake).tolist() == torch.argmax(x, dim=-1).tolist() and seen == [x.shape]
    assert torch.equal(gdn_registry().call("argmax_rows", x), torch.argmax(x, dim=-1))


def test_engine_option_on_by_default_plain_launch_same_tokens():
    """QwenEngineConfig.argmax_kernel is on (H200 variants runs 1 / 2: the same greedy tokens as torch.argmax), for
    CUDA engines only (a CPU engine keeps torch.argmax: the interpreter's kernel is far slower), the kernel never
    launches with PDL unless PDL_LAUNCH asks (benchmarks/pdl_after_graph.py), and a CPU engine whose runner is made
    to call it gives the greedy tokens of one that does not, the registry's op then called."""
    from kernels import argmax_rows
    from qwen_engine.engine import QwenEngineConfig
    from tests.test_qwen_engine import CPU_TRITON, collect, engine_config, run

    assert QwenEngineConfig().argmax_kernel is True and argmax_rows.PDL_LAUNCH is False

    def body_forcing(force: bool):
        async def body(engine):
            default = engine.runner.argmax_kernel
            engine.runner.argmax_kernel = force
            calls = sum(engine.registry.choices().get("argmax_rows", {}).get("calls", {}).values())
            tokens, _ = await collect(engine, [5, 9, 2, 7, 11], max_new_tokens=4)
            used = sum(engine.registry.choices().get("argmax_rows", {}).get("calls", {}).values()) - calls
            return default, tokens, (used, engine.registry.choices().get("argmax_rows", {}).get("last"))
        return body

    # the kernel where it runs on the engine's CPU tensors (the interpreter, asked for as "triton": "auto" on a CPU
    # device applies the references); "auto" (the reference) on a GPU host, whose compiled kernel cannot take them
    default, tokens_on, (used_on, impl) = run(engine_config(argmax_kernel=True, kernels=CPU_TRITON), body_forcing(True))
    _, tokens_off, (used_off, _) = run(engine_config(argmax_kernel=True, kernels=CPU_TRITON), body_forcing(False))
    assert default is False  # a CPU engine
    assert used_on > 0 and used_off == 0
    assert (impl == "triton") == (CPU_TRITON == "triton"), impl
    assert tokens_on == tokens_off and len(tokens_on) == 4
