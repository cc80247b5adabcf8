"""benchmarks/prefetch_ahead.py's warm-up kernel (the `--warm` rows; the engine option it modelled was removed after
Qwen run 62): its load modes read every word -- each program's xor equals `warm_reference`'s bit for bit (xor is
order-free) -- under the interpreter here; the prefetch mode is inline PTX, compiled on a GPU only."""

import pytest
import torch

from benchmarks import prefetch_ahead as pa

STEP = pa.WARM_STEP


@pytest.mark.parametrize("n", [1, STEP - 1, STEP + 1, 3 * STEP * 4 + 17])
@pytest.mark.parametrize("programs", [1, 3])
@pytest.mark.parametrize("mode", ["load", "load_last"])
def test_warm_loads_read_every_word(n, programs, mode):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    words = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))
    out = torch.full((programs,), 7, dtype=torch.int32, device=dev)
    pa.warm(words.to(dev), mode, programs, out)
    want = pa.warm_reference(words, programs)
    assert torch.equal(out.cpu(), want)
    words[n // 2] ^= 1 << 5  # one flipped bit changes one program's xor: the reference is not blind
    assert not torch.equal(pa.warm_reference(words, programs), want)
