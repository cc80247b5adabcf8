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
