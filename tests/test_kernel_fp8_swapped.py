"""kernels/fp8_swapped.py: the few-row FP8 W8A8 linear on the tensor cores (weights as the MMA's M, split K) against
`fp8_linear_reference`, and its place in the registry and the fused decode projections.

Runs on the CPU under TRITON_INTERPRET=1 (tests/conftest.py) and on a GPU compiled. Tolerance, per output element,
with S = sum_k |q_k w_k| x input_scale x weight_scale (the products' magnitudes):
* interpreter (fp32 sums): |y - ref| <= (K - 1) 2^-24 S, the recursive-summation bound;
* GPU: `fp8_linear.ACC_REL_BOUND_HOPPER` S = 2^-9 S (the e4m3 wgmma's ~14-bit accumulator, promoted to fp32 every
  128 products: the bound cuBLASLt's path is held to, `kernels/fp8_linear.py`);
* bf16 output: the same plus 2^-8 |ref| (one rounding; 2x for a flipped tie).
Exactly representable sums (integer-valued activations and weights) must come out bit for bit, split or not, on
either device (every partial sum is an integer below 2^11: exact in the ~14-bit accumulator too).
"""

import pytest
import torch

from kernels import fp8_swapped
from kernels.fp8_linear import ACC_REL_BOUND_HOPPER, fp8_linear_swapped, supports_swapped, with_codes
from kernels.fp8_quant import quantize_static_reference
from kernels.nvfp4 import FP8Tensor, fp8_linear_reference
from tests.test_kernel_fp8_skinny import make  # e4m3 weights (per-tensor or per-row scales), x saturating a little

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON_HERE = fp8_swapped.triton is not None and (DEVICE == "cuda" or fp8_swapped._interpreted())
pytestmark = pytest.mark.skipif(not TRITON_HERE, reason="Triton does not run here")


def bound(x, w):
    """The summation bound x S per output element (the module docstring), on this device."""
    k = x.shape[-1]
    a = ACC_REL_BOUND_HOPPER if DEVICE == "cuda" else (k - 1) * 2.0**-24
    xq = quantize_static_reference(x, w.input_scale).float()
    return a * (xq.abs() @ w.data.float().abs().T) * (w.input_scale * w.scale) + 1e-30


def run(x, w, out_dtype, **kw):
    return fp8_swapped.fp8_swapped_op(x, w.data, w.scale.float(), w.input_scale.float(), out_dtype, **kw)


# (m, n, k, split, block_n, block_k): whole tiles, ragged N and K (masks), every row bucket (16 / 32 / 64), the
# default tiling (zeros), splits that do not divide the K tiles
CASES = [(5, 128, 256, 1, 64, 128), (8, 64, 512, 2, 64, 128), (32, 192, 384, 3, 64, 128), (17, 100, 200, 2, 64, 64),
         (64, 64, 256, 4, 64, 64), (12, 128, 1024, 0, 0, 0), (7, 64, 80, 1, 64, 64)]


@pytest.mark.parametrize("m,n,k,split,bn,bk", CASES)
@pytest.mark.parametrize("rowwise", [False, True])
def test_matches_reference_fp32(m, n, k, split, bn, bk, rowwise):
    x, w = make(m, n, k, seed=m * 100 + n + split, rowwise=rowwise)
    y = run(x, w, torch.float32, split_k=split, block_n=bn, block_k=bk)
    ref = fp8_linear_reference(x, w, out_dtype=torch.float32)
    err = (y - ref).abs()
    b = bound(x, w)
    assert y.shape == (m, n) and (err <= b).all(), f"max err {err.max():.3g}, worst err / bound {(err / b).max():.3g}"


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bf16_output_codes_and_input_dtypes(x_dtype):
    """bf16 output within one rounding of the fp32 reference; the producer's codes give the same bits as the op's own
    quantiser launch; `fp8_linear_swapped` (the registry's implementation) and its codes form agree."""
    x, w = make(24, 128, 256, seed=7, x_dtype=x_dtype)
    y = run(x, w, torch.bfloat16, split_k=2)
    assert y.dtype == torch.bfloat16 and y.shape == (24, 128)
    ref32 = fp8_linear_reference(x, w, out_dtype=torch.float32)
    err = (y.float() - ref32).abs()
    assert (err <= 2.0**-8 * ref32.abs() + bound(x, w)).all(), err.max()
    codes = quantize_static_reference(x, w.input_scale)
    assert torch.equal(run(x, w, torch.bfloat16, split_k=2, codes=codes), y)
    x3 = x.reshape(2, 12, 256)
    via_registry = fp8_linear_swapped(x3, w, torch.bfloat16)
    assert via_registry.shape == (2, 12, 128)
    assert torch.equal(with_codes("triton_quant+swapped")(x3, w, codes.reshape(2, 12, 256), torch.bfloat16),
                       via_registry)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_exact_sums_bit_for_bit(split):
    """Integer activations and weights with input_scale 1: every product and partial sum is an exact integer, so any
    summation order gives the reference's bits (fp32 out) -- the masks at ragged K and N, the split-K reduction and
    the epilogue's scales cannot hide an error behind the tolerance."""
    g = torch.Generator().manual_seed(split)
    m, n, k = 9, 77, 304
    w = torch.randint(-4, 5, (n, k), generator=g).float().to(torch.float8_e4m3fn)
    x = torch.randint(-3, 4, (m, k), generator=g).to(torch.bfloat16)
    x[0, :4] = torch.tensor([500.0, -600.0, 448.0, -0.0])  # saturation at +-448 and a signed zero
    wt = FP8Tensor(w.to(DEVICE), torch.tensor(0.5, device=DEVICE), torch.tensor(1.0, device=DEVICE))
    y = run(x.to(DEVICE), wt, torch.float32, split_k=split, block_n=64, block_k=64)
    assert torch.equal(y, fp8_linear_reference(x.to(DEVICE), wt, out_dtype=torch.float32))


def test_split_counters_rearmed():
    """Two split launches in a row over the same counters: the second starts from re-armed counters (a stale count
    would make the wrong program reduce, or none) and gives the first's bits."""
    x, w = make(16, 256, 512, seed=3)
    a = run(x, w, torch.float32, split_k=4, block_n=64, block_k=64)
    b = run(x, w, torch.float32, split_k=4, block_n=64, block_k=64)
    assert torch.equal(a, b)
    from kernels.split_k import split_counters

    assert int(split_counters(x.device, 4).count_nonzero()) == 0


def test_config_rule():
    """`swapped_config` at Qwen3.6's projections: unsplit from SPLIT_BELOW_TILES output tiles on; below, a power of
    two split up to SPLIT_TARGET_PROGRAMS programs, every split keeping >= MIN_K_TILES_PER_SPLIT K tiles (the values
    the H200 sweep chose: 2048 x 4096 and 512 x 2048 split 4, the rest unsplit)."""
    picks = {}
    for n, k in [(8192, 2048), (4096, 2048), (2048, 4096), (512, 2048), (12288, 2048), (9216, 2048), (64, 256)]:
        c = fp8_swapped.swapped_config(n, k)
        tiles, k_tiles = -(-n // c.block_n), k // c.block_k
        assert c.split & (c.split - 1) == 0 and 1 <= c.split <= fp8_swapped.MAX_SPLIT_K
        assert k_tiles // c.split >= min(k_tiles, fp8_swapped.MIN_K_TILES_PER_SPLIT), (n, k, c)
        if tiles >= fp8_swapped.SPLIT_BELOW_TILES:
            assert c.split == 1, (n, k, c)
        else:
            assert (tiles * c.split >= fp8_swapped.SPLIT_TARGET_PROGRAMS
                    or k_tiles < 2 * c.split * fp8_swapped.MIN_K_TILES_PER_SPLIT), (n, k, c)
        picks[n, k] = c.split
    assert picks == {(8192, 2048): 1, (4096, 2048): 1, (2048, 4096): 4, (512, 2048): 4, (12288, 2048): 1,
                     (9216, 2048): 1, (64, 256): 1}


def test_rejects_bad_arguments():
    x, w = make(8, 64, 128, seed=1)
    with pytest.raises(ValueError, match="codes must be e4m3"):
        run(x, w, torch.float32, codes=torch.zeros(8, 64, dtype=torch.float8_e4m3fn, device=DEVICE))
    big = torch.zeros(fp8_swapped.SWAPPED_MAX_M + 1, 128, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="fp8_swapped_linear"):
        run(big, w, torch.float32)
    with pytest.raises(ValueError, match="input_scale"):
        fp8_linear_swapped(x, FP8Tensor(w.data, w.scale, None))


def test_registry_rule():
    """Where the registry uses it: Hopper, 5-64 rows, K a multiple of 16, a static input scale; the decode GEMV keeps
    1-4 rows, cuBLASLt more than 64 rows and other GPUs."""
    info = dict(device="cuda", capability=(9, 0), dtype=torch.bfloat16, out_dtype=torch.bfloat16, rows=32, k=2048,
                weight_shape=(8192, 2048), weight_dtype=torch.float8_e4m3fn, weight_contiguous=True, scale_ok=True,
                has_input_scale=True)
    assert supports_swapped(**info)
    assert supports_swapped(**{**info, "rows": 5}) and supports_swapped(**{**info, "rows": 64})
    for change in ({"rows": 4}, {"rows": 65}, {"capability": (10, 0)}, {"capability": (8, 9)}, {"device": "cpu"},
                   {"k": 2040, "weight_shape": (8192, 2040)}, {"has_input_scale": False},
                   {"weight_dtype": torch.bfloat16}, {"weight_contiguous": False}):
        assert not supports_swapped(**{**info, **change}), change


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_cuda_graph_replay():
    """Captured (split K: the counters allocated by the eager call before) and replayed: the eager bits."""
    x, w = make(32, 2048, 4096, seed=5)
    codes = quantize_static_reference(x, w.input_scale)
    eager = run(x, w, torch.bfloat16, codes=codes)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(x, w, torch.bfloat16, codes=codes)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
