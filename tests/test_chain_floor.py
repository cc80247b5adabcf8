"""benchmarks/chain_floor.py's kernel (the GPU measures the chain; here its arithmetic): each program stores the sum of
its 8 KB slice, or its index when it reads nothing."""

import pytest
import torch

triton = pytest.importorskip("triton")

from benchmarks import chain_floor  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("read", [True, False])
def test_chain_kernel_sums(read):
    programs = 3
    buf = torch.randint(0, 7, (programs * chain_floor.WORDS,), dtype=torch.int32, device=DEVICE)
    sums = torch.full((programs,), -1, dtype=torch.int32, device=DEVICE)
    chain_floor.launch(buf, sums, programs, read)
    want = buf.view(programs, -1).sum(1, dtype=torch.int32) if read else torch.arange(programs, dtype=torch.int32)
    assert torch.equal(sums.cpu(), want.cpu())
