"""Test-session setup shared by all test modules.

Triton kernels (`kernels/*.py`) run on the CPU through Triton's interpreter when no GPU is present. Triton reads
TRITON_INTERPRET when a `@triton.jit` decorator runs, i.e. when a kernel module is first imported, so it has to be set
before collection imports any test module; conftest.py is loaded first. With a GPU the variable is left alone and the
same tests run the compiled kernels.
"""

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for the module (opt in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    the tiny Qwen models' ops on a shared 2-core box only gain synchronisation from more threads (measured ~80x
    slower per step)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def one_autotune_config(monkeypatch):
    """Every autotuned kernel (kernels/autotune_table.py AUTOTUNED) with only its first configuration: Triton then
    compiles that one per key and times nothing. For the tiny packed engines' CUDA tests, whose small shapes miss the
    shipped autotune table: tuning every configuration of every key cold kept each such test running past 150-200 s
    on the H200 (2026-12-03, steps 101-104), before its first case ended. Engines built under it need
    autotune_table="off" (the table names configurations this leaves out). Both sides of a test's comparison run the
    same configuration, so their tokens stay comparable."""
    from kernels.autotune_table import autotuners

    for tuner in autotuners().values():
        monkeypatch.setattr(tuner, "configs", tuner.configs[:1])


@pytest.fixture(autouse=True)
def process_registry_preferences():
    """Each test leaves the process-wide kernel registry's per-op preferences as it found them (as a fresh registry
    sets them, AUTO, for ops first registered during the test). An engine sets them for the whole process
    (QwenEngine: its model ops, the last engine built wins), and a CPU engine that asks for "triton" -- the
    interpreted kernels, which never fall back -- made a later test's direct call on a shape no Triton kernel takes
    on the CPU raise (CI, 2026-12-05: test_kernel_gdn_prep's engine, then test_kernel_w4a16_regs). Only once the
    registry exists: a test that never builds it does not import the kernels for it."""
    import sys

    module = sys.modules.get("engine_core.registry")
    created = module is not None and module.default_registry.cache_info().currsize > 0
    before = {}
    if created:
        registry = module.default_registry()
        before = {op: registry.preference(op) for op in registry.ops()}
    yield
    module = sys.modules.get("engine_core.registry")
    if module is None or module.default_registry.cache_info().currsize == 0:
        return
    registry = module.default_registry()
    for op in registry.ops():
        want = before.get(op, module.KernelPreference.AUTO)
        if registry.preference(op) is not want:
            registry.set_preference(want, op)
