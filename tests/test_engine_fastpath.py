"""The engine's fast paths (issue #4) against their plain references, on CPU with the tiny config:

* `postprocess_batch` (two host syncs per grounding batch, registry op "mask_post", column-packed masks) equals the
  per-pair reference `postprocess_pair`: boxes and every mask bit exactly, with either implementation of the op (the
  Triton kernel runs in its interpreter here; it is bit-exact on these inputs, see kernels/mask_post.py); scores to
  1 fp32 ulp (CPU sigmoid over [N, Q] vs [Q] puts elements in different SIMD lanes / scalar tails, which round
  differently; measured: a few scores 1 ulp apart; on cuda sigmoid is elementwise-identical);
* COCO RLE from the packed bits equals pycocotools' RLE of the reference bool masks;
* kernels="triton" vs kernels="reference" engines: pixels within the preprocess op's stated tolerance (1 uint8 step:
  the CPU reference is torchvision's native uint8 path, a different rounding from the CUDA algorithm the kernel
  reproduces), hence close results; with "preprocess" pinned to the reference, identical results;
* null_model never builds the detector and answers without instances; bad config values raise clear errors;
  health() reports the kernel choices, the compile mode, vit_fp8 and null_model.

GPU (the lead runs these): `python -m pytest -q tests/test_engine_fastpath.py` runs the same tests on cuda where they
apply, plus `test_cuda_graphs_match_eager` (compile="graphs" vs "none", needs sammie/model/graphs.py).
"""

import asyncio
import sys
import types

import numpy as np
import pytest
import torch
from PIL import Image

import sammie.build
from kernels.mask_post import upsample_threshold_reference
from sammie.engine import EngineConfig, SammieEngine
from sammie.masks import encode_instances, encode_rle, encode_rle_packed, unpack_masks
from sammie.segmenter import Instance, kernel_registry, postprocess_batch, postprocess_pair
from tests.test_engine import PROMPTS, TINY, assert_close, assert_identical, encode, photos, run_engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_same_but_score_ulp(ours, ref):
    """Same instances in the same order: boxes and masks exact, scores within 1 fp32 ulp (see the docstring)."""
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert abs(a.score - b.score) <= np.spacing(np.float32(b.score)), (a.score, b.score)
        assert a.box == b.box and np.array_equal(a.mask, b.mask)


def grounding_outputs(n_padded: int, q: int, m: int, seed: int, dtype=torch.float32):
    """Random decoder outputs shaped like `Sam3Detector.ground`'s: logits spread so that thresholds keep some."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n_padded, q, generator=g) * 3).to(dtype).to(DEVICE)
    presence = (torch.randn(n_padded, generator=g) * 2).to(dtype).to(DEVICE)
    boxes = torch.rand(n_padded, q, 4, generator=g).to(DEVICE)
    mask_logits = (torch.randn(n_padded, q, m, m, generator=g) * 4).to(dtype).to(DEVICE)
    return logits, presence, boxes, mask_logits


@pytest.mark.parametrize("kernels", ["reference", "triton"])
def test_postprocess_batch_equals_per_pair_reference(kernels):
    registry = kernel_registry(kernels, DEVICE)
    # 6 real pairs + 2 padding rows; mixed image sizes (two pairs share 37 x 53), thresholds and caps
    sizes = [(37, 53), (37, 53), (120, 80), (1, 1), (64, 17), (9, 200)]
    thresholds = [0.0, 0.3, 0.1, 0.0, 0.9999, 0.2]
    caps = [None, 3, 5, 2, None, 1]
    total = 0
    for seed in range(3):
        logits, presence, boxes, mask_logits = grounding_outputs(8, 12, 16, seed)
        got = postprocess_batch(registry, logits, presence, boxes, mask_logits, sizes, thresholds, caps)
        assert len(got) == len(sizes)
        for n, ((h, w), thr, cap) in enumerate(zip(sizes, thresholds, caps)):
            ref = postprocess_pair(logits[n], presence[n], boxes[n], mask_logits[n], h, w, thr, cap)
            assert_same_but_score_ulp(got[n], ref)
            for inst, r in zip(got[n], ref):
                assert inst.packed is not None and inst.packed.shape == (w, (h + 7) // 8)
                assert inst.mask.shape == (h, w) and inst.area == int(r.mask.sum())
            total += len(ref)
    assert total > 20  # masks really were compared
    calls = registry.choices()["mask_post"]["calls"]
    assert set(calls) == {kernels} and calls[kernels] > 0, calls


def test_postprocess_batch_nothing_kept_needs_no_mask_op():
    registry = kernel_registry("reference", DEVICE)
    logits, presence, boxes, mask_logits = grounding_outputs(4, 8, 8, 0)
    got = postprocess_batch(registry, logits, presence, boxes, mask_logits, [(10, 10)] * 3, [1.0] * 3, [None] * 3)
    assert got == [[], [], []] and registry.choices()["mask_post"]["calls"] == {}


@pytest.mark.parametrize("h,w", [(37, 53), (8, 16), (1, 1), (300, 7), (61, 45)])
def test_packed_rle_equals_pycocotools(h, w):
    from pycocotools import mask as mask_utils

    registry = kernel_registry("auto", DEVICE)  # the op as the engine would run it here
    g = torch.Generator().manual_seed(h * 1000 + w)
    x = (torch.randn(4, 24, 24, generator=g) * 4).to(DEVICE)
    x[2] = -10.0  # an empty mask
    x[3] = 10.0  # a full one
    packed = registry.call("mask_post", x, h, w, 0.5).cpu().numpy()  # [K, W, HB]
    ref = upsample_threshold_reference(x, h, w).cpu().numpy()  # bool [K, H, W], Meta's masks
    assert np.array_equal(unpack_masks(packed, h), ref)
    rles = encode_rle_packed(packed, h)
    coco = mask_utils.encode(np.asfortranarray(ref.transpose(1, 2, 0).astype(np.uint8)))
    assert [r["counts"] for r in rles] == [c["counts"].decode("ascii") for c in coco]
    assert rles == [encode_rle(m) for m in ref] and all(r["size"] == [h, w] for r in rles)
    # the Instance route a server takes: packed instances and bool instances encode the same
    packed_instances = [Instance(0.9, (0, 0, 1, 1), packed=p, height=h) for p in packed]
    bool_instances = [Instance(0.9, (0, 0, 1, 1), m) for m in ref]
    assert encode_instances(packed_instances) == encode_instances(bool_instances) == rles
    assert encode_instances(packed_instances, "png") == encode_instances(bool_instances, "png")
    assert [i.area for i in packed_instances] == [int(m.sum()) for m in ref]


def test_instance_construction_errors():
    with pytest.raises(ValueError, match="exactly one of mask"):
        Instance(0.5, (0, 0, 1, 1))
    with pytest.raises(ValueError, match=r"packed must be uint8 \[W, ceil\(H / 8\)\]"):
        Instance(0.5, (0, 0, 1, 1), packed=np.zeros((5, 3), np.uint8), height=8)


# ---------------------------------------------------------------------------------------------------- engine


def small_photos() -> list[np.ndarray]:
    """Small images: Triton's interpreter pays per tap and per pixel (the 512 px photos take ~1.5 min)."""
    astronaut, coffee, _, noise = photos()
    return [astronaut[::6, ::6], coffee[40:90, 100:170], noise]  # 86 x 86, 50 x 70, 61 x 143


def segment_all(overrides, pin_preprocess_reference=False):
    """Sequential requests (same batch shapes in every engine) -> (the "preprocess" op's pixels for the three images
    in one call, the results, health())."""
    images = small_photos()
    cases = [(im, PROMPTS[:3]) for im in images] + [(images[2], PROMPTS[:1])]

    async def go(engine):
        if pin_preprocess_reference:
            engine.registry.set_preference("reference", op="preprocess")
        chw = [torch.from_numpy(np.ascontiguousarray(im)).permute(2, 0, 1).to(engine.device) for im in images]
        pixels = engine.registry.call("preprocess", chw, engine.model_cfg.image_size, torch.float32, layout="chw")
        results = [await engine.segment(encode(Image.fromarray(im)), ps, threshold=0.0, max_instances=3)
                   for im, ps in cases]
        return pixels, results, engine.health()

    return run_engine(go, **({"device": DEVICE} | overrides))  # on a GPU machine: the compiled kernels on cuda


def test_triton_kernels_engine_matches_reference_engine():
    from kernels.preprocess import compare

    ref_pixels, ref, ref_health = segment_all({"kernels": "reference"})
    tri_pixels, tri, tri_health = segment_all({"kernels": "triton"})
    _, exact, exact_health = segment_all({"kernels": "triton", "kernel_self_check": False},
                                         pin_preprocess_reference=True)
    assert compare(tri_pixels, ref_pixels) is None  # within 1 uint8 step of torchvision (the op's stated tolerance)
    n = 0
    for r, t, x in zip(ref, tri, exact):
        for pr, pt, px in zip(r.prompts, t.prompts, x.prompts):
            assert_identical(px.instances, pr.instances)  # mask_post: Triton == reference, bit for bit
            assert len(pt.instances) == len(pr.instances) == 3
            # one-step pixel differences move the tiny model's outputs a little: close, not identical
            assert_close(pt.instances, pr.instances, min_iou=0.98, max_score=1e-3, max_box_px=0.5)
            n += len(pr.instances)
    assert n == 3 * 10
    for health, pre, post in ((ref_health, "reference", "reference"), (tri_health, "triton", "triton"),
                              (exact_health, "reference", "triton")):
        k = health["kernels"]
        assert k["preprocess"]["last"] == pre and k["mask_post"]["last"] == post, k
        assert k["preprocess"]["fallback"] is None and k["mask_post"]["fallback"] is None
    assert ref_health["kernels_preference"] == "reference" and tri_health["kernels_preference"] == "triton"
    assert ref_health["kernels"]["mask_post"]["self_check"].startswith("skipped")
    assert tri_health["kernels"]["mask_post"]["self_check"] == "triton passed"
    assert tri_health["kernels"]["preprocess"]["self_check"] == "triton passed"
    assert exact_health["kernels"]["preprocess"]["self_check"] == "not run"


def test_auto_on_cpu_is_reference_and_health_reports_fast_paths():
    if DEVICE != "cpu":
        pytest.skip("auto resolves to the reference only on cpu")

    async def go(engine):
        await engine.segment(encode(Image.fromarray(photos()[3])), ["person"], threshold=0.0, max_instances=2)
        return engine.health()

    health = run_engine(go)
    assert health["kernels_preference"] == "reference"
    assert health["kernels"]["preprocess"]["calls"] == {"reference": 1}
    assert health["kernels"]["mask_post"]["calls"] == {"reference": 1}
    assert health["compile"] == {"mode": "none", "capture_s": None, "stats": None}
    assert health["vit_fp8"] is None and health["null_model"] is False


def test_null_model_answers_without_instances_and_never_builds_the_detector(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("null_model built the real detector")

    monkeypatch.setattr(sammie.build, "build_detector", refuse)
    monkeypatch.setattr("sammie.model.detector.Sam3Detector.__init__", refuse)
    images = [encode(Image.fromarray(im)) for im in photos()]

    async def go(engine):
        results = await asyncio.gather(*(engine.segment(im, PROMPTS, threshold=0.0) for im in images * 2))
        return results, engine.health()

    results, health = run_engine(go, null_model=True, warmup=True, kernels="auto")
    assert len(results) == 8
    for res, im in zip(results, photos() * 2):
        assert (res.height, res.width) == im.shape[:2] and res.random_weights
        assert [p.prompt for p in res.prompts] == PROMPTS and all(p.instances == [] for p in res.prompts)
    assert health["null_model"] is True and health["random_weights"] and health["ready"]
    assert health["stats"]["answered_ok"] == 8 and health["prompt_cache"]["misses"] == len(PROMPTS)
    assert health["kernels"]["preprocess"]["calls"], health["kernels"]  # pre-processing still ran


class RefusedReport:
    """What a stand-in FP8 gate returns: refused."""

    enabled = False

    def as_dict(self):
        return {"enabled": False, "reason": "stand-in gate refused"}


def stand_in_fp8(monkeypatch, enable_vit_fp8):
    """Replace sammie/model/fp8.py by `enable_vit_fp8`, keeping the real module's config checks."""
    from sammie.model import fp8

    monkeypatch.setitem(sys.modules, "sammie.model.fp8", types.SimpleNamespace(
        enable_vit_fp8=enable_vit_fp8, check_linears=fp8.check_linears, check_static=fp8.check_static,
        MAX_CALIBRATION_IMAGES=fp8.MAX_CALIBRATION_IMAGES))


def test_vit_fp8_wiring_with_a_stand_in_gate(monkeypatch, caplog):
    """A stand-in for sammie/model/fp8.py checks the engine's side of the contract on CPU: called once with the
    detector, a [1, 3, S, S] sample in the model dtype and the engine's registry; a refused report is logged at ERROR
    and shown in health(). (The real gate runs on the GPU: tests/test_fp8_vit.py.)"""
    calls = []

    def enable_vit_fp8(detector, sample_pixels, *, registry, preference, linears, static, calibration):
        assert "fp8_rowwise_linear" in registry.ops()  # the engine's registry, with the FP8 ops registered
        assert preference == "auto"  # "torch" only under compile="inductor" (the fusable quantisation)
        assert linears == ("attn.qkv", "attn.proj", "mlp.fc1")  # EngineConfig.vit_fp8_linears' default
        assert static == () and calibration.startswith("a seeded noise image")  # the defaults
        calls.append((detector, tuple(sample_pixels.shape), sample_pixels.dtype))
        return RefusedReport()

    stand_in_fp8(monkeypatch, enable_vit_fp8)

    async def go(engine):
        return engine, engine.health()

    engine, health = run_engine(go, vit_fp8=True)
    assert len(calls) == 1 and calls[0][0] is engine.detector and calls[0][1] == (1, 3, 112, 112)
    assert calls[0][2] == engine.dtype
    assert health["vit_fp8"] == {"enabled": False, "reason": "stand-in gate refused"}
    assert any(r.levelname == "ERROR" and "vit_fp8" in r.getMessage() for r in caplog.records)


def test_vit_fp8_static_scales_calibrate_on_the_given_images(monkeypatch, tmp_path):
    """vit_fp8_static and vit_fp8_calibration_images reach the gate: the listed images (any size: the real decoding
    and preprocessing) are the sample, static names the linears with calibrated scales, and the report says what
    the sample was. A missing or broken image fails the engine's construction with its path in the message."""
    calls = []

    def enable_vit_fp8(detector, sample_pixels, *, registry, preference, linears, static, calibration):
        calls.append((tuple(sample_pixels.shape), linears, static, calibration))
        return RefusedReport()

    stand_in_fp8(monkeypatch, enable_vit_fp8)
    paths = []
    for i, im in enumerate(photos()[:2]):
        paths.append(str(tmp_path / f"calib{i}.{'png' if i else 'jpg'}"))
        Image.fromarray(im[: 40 + 20 * i]).save(paths[-1])
    all_four = ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]
    cfg = {"vit_fp8": True, "vit_fp8_linears": all_four, "vit_fp8_static": ["mlp.fc2"]}

    async def go(engine):
        return engine.health()

    health = run_engine(go, **cfg, vit_fp8_calibration_images=paths)
    assert calls == [((2, 3, 112, 112), tuple(all_four), ("mlp.fc2",), "2 calibration images")]
    assert health["vit_fp8"] == {"enabled": False, "reason": "stand-in gate refused"}
    (tmp_path / "broken.jpg").write_bytes(b"not an image")
    for bad, error, message in ((str(tmp_path / "missing.jpg"), FileNotFoundError,
                                                      r"missing\.jpg.*working directory"),
                                (str(tmp_path / "broken.jpg"), ValueError, "broken.jpg.*not a usable image")):
        with pytest.raises(error, match=message):
            SammieEngine(EngineConfig(**(TINY | cfg | {"vit_fp8_calibration_images": [paths[0], bad]})))
    assert len(calls) == 1  # neither reached the gate


def test_vit_fused_gelu_wiring(monkeypatch):
    """vit_fused_gelu sets every ViT MLP's fused_gelu where cuBLASLt's GELU epilogue exists (the CPU stands in here)
    and leaves the model alone elsewhere, saying why in health(); the answers stay the same at this tiny size on the
    CPU, where torch._addmm_activation applies the exact GELU (the tanh epilogue's numerics: tests/test_vision.py)."""
    import sammie.model.vit as vit

    async def go(engine):
        res = await engine.segment(encode(Image.fromarray(photos()[3])), ["person"], threshold=0.0, max_instances=3)
        mlps = [m for m in engine.detector.modules() if isinstance(m, vit.Mlp)]
        return res, engine.health(), mlps

    _, health, mlps = run_engine(go, vit_fused_gelu=True)  # the tiny engine runs on the CPU
    assert health["vit_fused_gelu"]["enabled"] is False and "cuda" in health["vit_fused_gelu"]["reason"]
    assert mlps and not any(m.fused_gelu for m in mlps)
    plain, health, _ = run_engine(go)
    assert health["vit_fused_gelu"] is None
    monkeypatch.setattr(vit, "FUSED_GELU_DEVICES", ("cpu",))
    fused, health, mlps = run_engine(go, vit_fused_gelu=True)
    assert health["vit_fused_gelu"]["enabled"] and health["vit_fused_gelu"]["fused"] == len(mlps) > 0
    assert all(m.fused_gelu for m in mlps)
    # the exact GELU either way on the CPU: the same instances
    assert_close(fused.prompts[0].instances, plain.prompts[0].instances, min_iou=0.99, max_score=1e-4, max_box_px=0.5)


def test_ground_pairs_eager_and_graphed_forms():
    """`SammieEngine.ground_pairs`, the grounding stage's call that the waterfall's extra-prompt row shares: the eager
    form equals the detector's own call on the concatenated images with device indices; the graphed form (compile
    graphs / inductor) passes the per-image features and host lists through untouched (a GraphedDetector copies
    adjacent rows itself; on CUDA test_cuda_graphs_match_eager checks its result)."""
    from sammie.model.detector import ImageFeatures

    engine = SammieEngine(EngineConfig(**TINY))  # unstarted: only its detector is used
    det, cfg = engine.detector, engine.model_cfg
    try:
        with torch.inference_mode():
            torch.manual_seed(0)
            both = det.encode_images(torch.randn(2, 3, cfg.vision.image_size, cfg.vision.image_size))
            prompts = det.encode_prompts(engine.tokenizer(["person", "a red car"]))
            singles = [ImageFeatures([f[i:i + 1] for f in both.fpn], both.pos, both.geometry[i:i + 1])
                       for i in (0, 1)]
            image_index, prompt_index = [1, 0, 1], [0, 1, 1]
            got = engine.ground_pairs(singles, prompts, image_index, prompt_index)
            want = det.ground(both, prompts, torch.tensor(image_index), torch.tensor(prompt_index))
        for name, a, b in zip(got._fields, got, want, strict=True):
            assert torch.equal(a, b), name
        assert got.logits.shape[0] == 3

        calls = []

        class Recorder:  # stands in for a GraphedDetector: records what it is handed
            def ground(self, *args):
                calls.append(args)
                return "out"

        engine.detector, engine.compile = Recorder(), "graphs"
        assert engine.ground_pairs(singles, prompts, image_index, prompt_index) == "out"
        (images, got_prompts, got_image_index, got_prompt_index), = calls
        assert images is singles and got_prompts is prompts
        assert got_image_index == [1, 0, 1] and got_prompt_index == [0, 1, 1]
    finally:
        asyncio.run(engine.aclose())


def test_bad_fast_path_config_raises_clear_errors():
    cases = {
        "kernels must be one of": {"kernels": "fast"},
        "EngineConfig.kernels must be str": {"kernels": 1},
        "compile must be one of": {"compile": "jit"},
        "EngineConfig.kernel_self_check must be bool": {"kernel_self_check": "yes"},
        "vit_fp8 needs the real detector": {"null_model": True, "vit_fp8": True},
        "vit_fp8_static needs vit_fp8: true": {"vit_fp8_static": ["attn.qkv"]},
        "vit_fp8_calibration_images needs vit_fp8: true": {"vit_fp8_calibration_images": ["a.jpg"]},
        "vit_fp8_static must be a subset of vit_fp8_linears": {"vit_fp8": True, "vit_fp8_static": ["mlp.fc2"]},
        "vit_fp8_static must be a subset.*without repeats": {"vit_fp8": True,
                                                              "vit_fp8_static": ["attn.qkv", "attn.qkv"]},
        "at most 8 images": {"vit_fp8": True, "vit_fp8_calibration_images": ["a.jpg"] * 9},
        "must be a list of file paths": {"vit_fp8": True, "vit_fp8_calibration_images": [""]},
        "vit_fused_gelu needs the real detector": {"null_model": True, "vit_fused_gelu": True},
        "compile='graphs' needs the real detector": {"null_model": True, "compile": "graphs"},
        "EngineConfig.null_model must be bool": {"null_model": 1},
    }
    for message, bad in cases.items():
        with pytest.raises(ValueError, match=message):
            EngineConfig(**bad)
    assert EngineConfig.from_dict({"kernels": "triton", "compile": "none"}).kernels == "triton"
    with pytest.raises(ValueError, match="compile='graphs' needs a cuda device"):
        SammieEngine(EngineConfig(**(TINY | {"compile": "graphs"})))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager():
    pytest.importorskip("sammie.model.graphs")
    cases = [(im, PROMPTS[:k]) for im in photos() for k in (1, 2, 3)]

    async def go(engine):
        results = await asyncio.gather(*(engine.segment(encode(Image.fromarray(im)), ps, threshold=0.0,
                                                        max_instances=4) for im, ps in cases))
        return results, engine.health()

    cuda = {"config": "tiny", "device": "cuda", "decode_threads": 2, "warmup": True}
    eager, _ = run_engine(go, **(cuda | {"compile": "none"}))
    graphed, health = run_engine(go, **(cuda | {"compile": "graphs"}))
    stats = health["compile"]["stats"]  # GraphedDetector.stats(): replays per bucket of each stage
    assert health["compile"]["mode"] == "graphs", health["compile"]
    assert sum(stats["encode_images"]["replays"].values()) > 0 and sum(stats["ground"]["replays"].values()) > 0, stats
    for a, b in zip(eager, graphed):
        for pa, pb in zip(a.prompts, b.prompts):
            assert_close(pb.instances, pa.instances, min_iou=0.99, max_score=1e-2, max_box_px=1.0)


def test_stage_streams_only_on_cuda():
    """The image and grounding stages get a stream each on cuda only (`EngineConfig.stage_streams`), as health()
    says, before start() too (until 2026-12-02 it read False until the batch loop existed); on the CPU, or switched
    off, both run on the default stream."""
    from engine_core.request import Stage

    def before_start(**overrides):
        return SammieEngine(EngineConfig(**(TINY | overrides))).health()["stage_streams"]

    # before start() health reports what the loop will build from the device and the option (nothing runs on it):
    # the CPU-built engine told it holds a cuda device says True, and False with the option off
    import dataclasses

    unstarted = SammieEngine(EngineConfig(**TINY))
    unstarted.device = torch.device("cuda")
    assert unstarted.health()["stage_streams"] is True
    unstarted.cfg = dataclasses.replace(unstarted.cfg, stage_streams=False)
    assert unstarted.health()["stage_streams"] is False

    async def go(engine):
        result = await engine.segment(encode(Image.fromarray(small_photos()[2])), PROMPTS[:1], threshold=0.0)
        return engine._batch_loop.runner.streams, result, engine.health()["stage_streams"]

    streams, result, reported = run_engine(go, device="cpu")
    assert streams == {} and result.prompts[0].instances and reported is False
    assert before_start(device="cpu") is False
    if torch.cuda.is_available():
        streams, _, reported = run_engine(go, device="cuda")
        assert set(streams) == {Stage.IMAGE, Stage.GROUNDING} and reported is True
        assert before_start(device="cuda") is True and before_start(device="cuda", stage_streams=False) is False
        assert streams[Stage.GROUNDING].priority < streams[Stage.IMAGE].priority  # grounding first
        assert run_engine(go, device="cuda", stage_streams=False)[0] == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stage streams need a GPU")
@pytest.mark.parametrize("compile_mode", ["none", "graphs"])
def test_stage_streams_wait_for_a_late_image_batch(compile_mode):
    """The grounding stream must wait on each image batch's event: here a ~50 ms device sleep is queued on the image
    stream before every encode, so the image stage returns long before its features exist. The results must equal
    the same engine's without the delay and the shared-stream engine's, bit for bit (one request at a time: the same
    batch shapes everywhere). A grounding stream that did not wait would read the features' memory unwritten."""
    import sammie.engine
    from engine_core.request import Stage

    cases = [(im, PROMPTS[:k]) for im, k in zip(small_photos(), (1, 2, 3))]
    early = []  # per grounding batch: had its image batch's event NOT yet completed when the grounding stream waited?
    wait_for_images = sammie.engine._wait_for_images

    def spy(stream, images):
        early.append(any(not im.ready.query() for im in images))
        return wait_for_images(stream, images)

    async def go(engine, delay_cycles):
        if delay_cycles:
            encode_images, image_stream = engine.detector.encode_images, engine._batch_loop.runner.streams[Stage.IMAGE]

            def late(pixels):
                assert torch.cuda.current_stream() == image_stream  # the stage really runs on its stream
                torch.cuda._sleep(delay_cycles)  # on the caller's stream: the image stream
                return encode_images(pixels)
            engine.detector.encode_images = late
            early.clear()  # the warm-up's grounding batches ran before the delay
        return [await engine.segment(encode(Image.fromarray(im)), ps, threshold=0.0, max_instances=4)
                for im, ps in cases]

    cuda = {"device": "cuda", "warmup": True, "compile": compile_mode}
    sammie.engine._wait_for_images = spy
    try:
        late = run_engine(lambda e: go(e, 100_000_000), **cuda)
    finally:
        sammie.engine._wait_for_images = wait_for_images
    assert early == [True] * len(cases)  # one grounding batch per request, each while its image batch still ran
    on_time = run_engine(lambda e: go(e, 0), **cuda)
    shared = run_engine(lambda e: go(e, 0), **(cuda | {"stage_streams": False}))
    n = 0
    for a, b, c in zip(late, on_time, shared):
        for pa, pb, pc in zip(a.prompts, b.prompts, c.prompts):
            assert_identical(pa.instances, pb.instances)
            assert_identical(pb.instances, pc.instances)
            n += len(pa.instances)
    assert n > 0


def test_bucket_lists_and_compile_modes_are_validated():
    """YAML lists become tuples and reach the scheduler; bad lists, and graph modes off cuda, fail at construction."""
    cfg = EngineConfig(config="tiny", max_image_batch=8, image_buckets=[1, 8], pair_buckets=(2, 16))
    sched = cfg.scheduler_config()
    assert cfg.image_buckets == (1, 8) and sched.image.buckets == (1, 8) and sched.grounding.buckets == (2, 16)
    with pytest.raises(ValueError, match="largest bucket"):
        EngineConfig(config="tiny", max_image_batch=8, image_buckets=[1, 4])
    with pytest.raises(ValueError, match="ascending"):
        EngineConfig(config="tiny", pair_buckets=[4, 2, 16])
    with pytest.raises(ValueError, match="list of ints"):
        EngineConfig(config="tiny", image_buckets=["1", 8])
    with pytest.raises(ValueError, match="compile must be"):
        EngineConfig(config="tiny", compile="reduce-overhead")
    with pytest.raises(ValueError, match="needs the real detector"):
        EngineConfig(config="tiny", null_model=True, compile="inductor")
    assert EngineConfig(config="tiny", compile="inductor",
                        image_inductor_mode="max-autotune-no-cudagraphs").image_inductor_mode.startswith("max-autotune")
    with pytest.raises(ValueError, match="image_inductor_mode must be one of"):
        EngineConfig(config="tiny", compile="inductor", image_inductor_mode="max-autotune")
    with pytest.raises(ValueError, match="needs compile='inductor'"):
        EngineConfig(config="tiny", compile="graphs", image_inductor_mode="max-autotune-no-cudagraphs")
    with pytest.raises(ValueError, match="needs a cuda device"):
        SammieEngine(EngineConfig(config="tiny", device="cpu", compile="inductor", warmup=False))


def test_every_bad_request_code_raised_is_documented():
    """Both engines list their BadRequest codes (BAD_REQUEST_CODES) and share one BadRequest / NotReady class
    (engine_core.request); a code raised anywhere in an engine module but missing from its list fails here."""
    import re
    from pathlib import Path

    import engine_core.request
    import qwen_engine.engine
    import sammie.engine

    for module in (sammie.engine, qwen_engine.engine):
        assert module.BadRequest is engine_core.request.BadRequest and module.NotReady is engine_core.request.NotReady
        raised = set(re.findall(r'BadRequest\(\s*"([a-z_]+)"', Path(module.__file__).read_text()))
        assert raised and raised <= set(module.BAD_REQUEST_CODES), sorted(raised - set(module.BAD_REQUEST_CODES))
