"""kernels/preprocess.py: the fused resize + normalise kernel against Meta's chain (`sammie.preprocess.Preprocessor`)
and against `aa_resize_emulated` (torch's CUDA antialiased-bilinear arithmetic written out in PyTorch).

On CPU the kernel runs in Triton's interpreter (tests/conftest.py), which computes FMAs unfused: there it must equal
`aa_resize_emulated(fma=False)` bit for bit. torchvision's CPU reference takes a different, native uint8 path (int16
fixed-point weights, uint8 intermediate), so against it only "<= 1 step" holds (~20% of values differ, measured and
printed). On a GPU the reference is torchvision's CUDA path, the one the kernel reproduces: <= 1 step at <= 1e-3 of
values, and the exact counts are printed (`pytest -s`) for the record.
"""

import pytest
import torch
import torch.nn.functional as F

from kernels.preprocess import (
    MAX_DOWNSCALE,
    aa_resize_emulated,
    compare,
    describe,
    normalise_lut,
    pack_images,
    preprocess_packed,
    preprocess_reference,
    preprocess_triton,
    supports,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"

# (H, W, S): downscale, both axes; mixed (one axis up, one down); pure upscale; identity; SAM-like aspect
SHAPES = [(37, 53, 28), (120, 90, 56), (10, 13, 28), (20, 90, 56), (28, 28, 28)]


def random_image(h, w, seed, layout="hwc"):
    g = torch.Generator().manual_seed(seed)
    img = torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g)
    return (img if layout == "hwc" else img.permute(2, 0, 1).contiguous()).to(DEVICE)


def steps(a, b):
    d = (a.int() - b.int()).abs()
    return int(d.max()), int((d > 0).sum())


@pytest.mark.parametrize("h,w,s", SHAPES)
def test_uint8_intermediate(h, w, s):
    img = random_image(h, w, seed=h * w)
    out = preprocess_triton([img], s, torch.uint8)[0]
    ref = preprocess_reference([img], s, torch.uint8)[0]  # torchvision Resize on this device
    chw = img.permute(2, 0, 1).cpu()
    max_step, n_ref = steps(out, ref)
    msg = f"\n{h}x{w}->{s} on {DEVICE}: vs torchvision {n_ref}/{out.numel()} values differ (max {max_step} step)"
    assert max_step <= 1
    assert compare(out, ref) is None
    if ON_GPU:  # for the record: which arithmetic do torch's CUDA kernel and ours compute? (Triton's PTX fuses the
        # span arithmetic into FMAs: fused_span=True; counts are printed, the tolerance above is what is asserted)
        for fused in (False, True):
            emu = aa_resize_emulated(chw, s, fma=True, fused_span=fused).round().to(torch.uint8)
            msg += (f"; emulated(fma, fused_span={fused}): vs kernel {steps(out.cpu(), emu)[1]}, "
                    f"vs torchvision {steps(ref.cpu(), emu)[1]}")
        print(msg)
        return
    # the interpreter computes exactly the emulated arithmetic without FMA
    emulated = aa_resize_emulated(chw, s, fma=False).round().to(torch.uint8)
    assert torch.equal(out, emulated)
    # torchvision's CPU *float* path (the GPU's algorithm, compiled here with FMA for <= 4 taps only): a few ties
    flt = F.interpolate(chw[None].float(), (s, s), mode="bilinear", antialias=True)[0].round().to(torch.uint8)
    max_flt, n_flt = steps(out, flt)
    print(msg + f"; vs torchvision's CPU float path {n_flt}")
    assert max_flt <= 1 and n_flt <= 1e-3 * out.numel()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalised_output(dtype):
    img = random_image(37, 53, seed=1)
    out = preprocess_triton([img], 28, dtype)
    assert out.shape == (1, 3, 28, 28) and out.dtype == dtype and out.device.type == DEVICE
    # exactly the lookup of the resized uint8 values through torchvision's own normalisation
    u8 = preprocess_triton([img], 28, torch.uint8)[0].long()
    lut = normalise_lut((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), dtype, str(img.device))
    assert torch.equal(out[0], torch.stack([lut[c][u8[c]] for c in range(3)]))
    assert compare(out, preprocess_reference([img], 28, dtype)) is None  # Meta's chain, <= 1 step


def test_lut_is_torchvisions_normalisation():
    lut = normalise_lut((0.5, 0.25, 0.75), (0.5, 0.2, 0.3), torch.float32, DEVICE)
    u = torch.arange(256, device=DEVICE).float() * (1.0 / 255)  # ToDtype(float32, scale=True)
    mean = torch.tensor([0.5, 0.25, 0.75], device=DEVICE)[:, None]
    std = torch.tensor([0.5, 0.2, 0.3], device=DEVICE)[:, None]
    assert torch.equal(lut, (u[None] - mean) / std)


def test_custom_mean_std_and_fp16():
    img = random_image(23, 31, seed=2)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    out = preprocess_triton([img], 28, torch.float16, mean, std)
    ref = preprocess_reference([img], 28, torch.float16, mean, std)
    assert compare(out, ref, std=min(std)) is None


def test_batch_of_sizes_and_layouts():
    """One launch for several sizes; HWC and CHW; a strided crop view passes through without a copy."""
    shapes = [(37, 53), (10, 13), (40, 29)]
    hwc = [random_image(h, w, seed=i) for i, (h, w) in enumerate(shapes)]
    chw = [im.permute(2, 0, 1).contiguous() for im in hwc]
    batch = preprocess_triton(hwc, 28, torch.uint8)
    assert batch.shape == (3, 3, 28, 28)
    assert torch.equal(preprocess_triton(chw, 28, torch.uint8, layout="chw"), batch)
    for i, im in enumerate(hwc):
        assert torch.equal(preprocess_triton([im], 28, torch.uint8)[0], batch[i])
    big = random_image(60, 80, seed=9)
    crop = big[5:42, 7:60]  # non-contiguous HWC view, 37 x 53
    packed, meta = pack_images([crop])
    assert packed.data_ptr() == crop.data_ptr() and meta[0].tolist() == [0, 37, 53, 240, 3, 1]
    assert torch.equal(preprocess_triton([crop], 28, torch.uint8)[0],
                       preprocess_triton([crop.contiguous()], 28, torch.uint8)[0])


def test_round_half_to_even():
    """A 2 x 2 image shrunk to 1 x 1 averages its 4 pixels with weights of exactly 0.25: sums of 2 mod 4 land on
    .5 and round to the even neighbour, as torchvision's CUDA path (`round_()`) does. Its CPU uint8 path rounds
    these ties up (fixed point + 0.5): one of the ways the two reference paths differ."""
    imgs = []
    for q in (0, 1, 2, 3, 254):  # pixels q, q, q + 1, q + 1: means .5, 1.5, 2.5, 3.5, 254.5
        vals = torch.tensor([q, q, q + 1, q + 1], dtype=torch.uint8)
        imgs.append(vals.view(2, 2, 1).expand(2, 2, 3).contiguous().to(DEVICE))
    out = preprocess_triton(imgs, 1, torch.uint8)[:, 0, 0, 0].cpu()
    assert out.tolist() == [0, 2, 2, 4, 254]
    ref = preprocess_reference(imgs, 1, torch.uint8)[:, 0, 0, 0].cpu().tolist()
    assert ref == ([0, 2, 2, 4, 254] if ON_GPU else [1, 2, 3, 4, 255])


def test_registry_op_traces_with_fullgraph_compile():
    img = random_image(37, 53, seed=3)
    packed, meta = pack_images([img])
    lut = normalise_lut((0.5,) * 3, (0.5,) * 3, torch.bfloat16, str(img.device))

    def f(packed, meta, lut):
        return torch.ops.sammie.preprocess(packed, meta, lut, 28, torch.bfloat16) * 2

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(packed, meta, lut), f(packed, meta, lut))
    assert torch.equal(f(packed, meta, lut), preprocess_packed(packed, meta, lut, 28, torch.bfloat16) * 2)


def test_supports_guard():
    img = random_image(37, 53, seed=4)
    good = describe([img], 28, torch.bfloat16)
    assert supports(**good)
    assert supports(**{**good, "dtype": torch.uint8})
    assert supports(**describe([img.permute(2, 0, 1)], 28, layout="chw"))
    other = "cuda" if DEVICE == "cpu" else "cpu"  # interpreter: CPU only; compiled: CUDA only
    cases = {
        "other device": {**good, "device": other},
        "meta device": {**good, "device": "meta"},
        "two devices": {**good, "devices": {"cuda:0", "cuda:1"}},
        "float image": {**good, "in_dtypes": {torch.float32}},
        "fp64 output": {**good, "dtype": torch.float64},
        "4 channels": {**good, "shapes": [(37, 53, 4)]},
        "1 channel": {**good, "shapes": [(37, 53, 1)]},
        "2-D image": {**good, "shapes": [(37, 53)]},
        "empty image": {**good, "shapes": [(0, 53, 3)]},
        "no images": {**good, "shapes": []},
        "size 0": {**good, "size": 0},
        "bad layout": {**good, "layout": "hw3"},
        "CHW read as HWC": {**good, "shapes": [(3, 37, 53)]},
    }
    for name, info in cases.items():
        assert not supports(**info), name
    s = 28
    assert supports(**{**good, "shapes": [(MAX_DOWNSCALE * s, 40, 3)]})  # 129 taps: the last shrink allowed
    assert not supports(**{**good, "shapes": [(MAX_DOWNSCALE * s + 1, 40, 3)]})
    assert not supports(**{**good, "shapes": [(40, MAX_DOWNSCALE * s + 1, 3)]})
