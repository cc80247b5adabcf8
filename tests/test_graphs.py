"""GraphedDetector (sammie/model/graphs.py) against the plain eager detector, tiny config, random inputs.

CPU (always), no CUDA graphs, through the same static buffers and gather as on CUDA, two wrappers:
- "uncompiled" (compile_mode=None), buckets images (1, 2, 4) x pairs (1, 2, 4, 8): the gather / copy-in logic;
- "dynamo" (torch.compile, backend="eager": dynamo's fullgraph trace, guards and per-bucket compiles without
  AOTAutograd or codegen), buckets (1, 2) x (1, 4): one trace per bucket costs 10-20 s on the shared 2-core box,
  so few buckets; AOTAutograd (`aot_eager`) and inductor run in the opt-in SAMMIE_TEST_INDUCTOR test.
Tolerance: rel <= 1e-6 in fp32. The gathered inputs are bit-identical and the same aten ops run at the same batch
size, so the measured difference is 0; 1e-6 only leaves room for a traced composite op. A wrong gather (wrong image
or prompt row) gives O(1).
CUDA (skipped without a GPU): graphs captured at tiny config; replay vs eager, new inputs give new outputs
(copy-in), outputs survive later replays (clone-out).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch._dynamo

from sammie.config import Sam3Config
from sammie.model.detector import ImageFeatures, Sam3Detector
from sammie.model.graphs import GraphedDetector
from tests.parity import rel_error

CFG = Sam3Config.tiny()
TOL = 1e-6
WRAPPERS = {  # name -> (GraphedDetector keyword arguments, image buckets, pair buckets)
    "uncompiled": (dict(compile_mode=None), (1, 2, 4), (1, 2, 4, 8)),
    "dynamo": (dict(backend="eager"), (1, 2), (1, 4)),
}


def _detector(device: str = "cpu") -> Sam3Detector:
    torch.manual_seed(0)
    return Sam3Detector(CFG).to(device).eval()


def _pixels(b: int, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, 3, CFG.image_size, CFG.image_size, generator=gen).to(device)


def _tokens(u: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """[U, L] token ids with different lengths, so the padding masks differ per prompt."""
    gen = torch.Generator().manual_seed(seed)
    ctx = CFG.text.context_length
    ids = torch.zeros(u, ctx, dtype=torch.long)
    for i in range(u):
        n = 2 + (5 * i + seed) % (ctx - 2)
        ids[i, :n] = torch.randint(1, 1000, (n,), generator=gen)
    return ids.to(device)


def _pairs(p: int, images: int, prompts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """P pairs with repeated and mixed rows; every image and prompt row used at least once when p allows."""
    gen = torch.Generator().manual_seed(seed)
    image_index = torch.randint(0, images, (p,), generator=gen)
    prompt_index = torch.randint(0, prompts, (p,), generator=gen)
    image_index[: min(p, images)] = torch.arange(min(p, images)).flip(0)
    prompt_index[: min(p, prompts)] = torch.arange(min(p, prompts))
    return image_index, prompt_index


def _assert_close(got, want, what: str, tol: float = TOL) -> None:
    for name in want._fields:
        a, b = getattr(got, name), getattr(want, name)
        if isinstance(b, list):
            for i, (x, y) in enumerate(zip(a, b)):
                assert rel_error(x, y) <= tol, f"{what} {name}[{i}]: rel {rel_error(x, y):.3e} > {tol:.0e}"
        else:
            assert a.dtype == b.dtype, f"{what} {name}: dtype {a.dtype} != {b.dtype}"
            assert rel_error(a, b) <= tol, f"{what} {name}: rel {rel_error(a, b):.3e} > {tol:.0e}"


@pytest.fixture(scope="module")
def detector():
    return _detector()


@pytest.fixture(scope="module", params=sorted(WRAPPERS))
def cpu_graphed(request, detector):
    kwargs, image_buckets, pair_buckets = WRAPPERS[request.param]
    torch._dynamo.reset()
    g = GraphedDetector(detector, image_buckets, pair_buckets, **kwargs)
    assert not g.cuda_graphs  # CPU -> no graphs
    g.capture()
    return detector, g


@torch.inference_mode()
def test_encode_images_every_bucket_matches_eager(cpu_graphed):
    det, g = cpu_graphed
    for b in g.image_buckets:
        px = _pixels(b, seed=b)
        got, want = g.encode_images(px), det.encode_images(px)
        _assert_close(got, want, f"encode_images B={b}")
    # pos is input independent: the wrapper returns the same persistent tensors every call
    assert g.encode_images(_pixels(1, 9)).pos[0] is g.encode_images(_pixels(2, 9)).pos[0]


@torch.inference_mode()
def test_ground_every_bucket_with_mixed_indices_matches_eager(cpu_graphed):
    det, g = cpu_graphed
    images = det.encode_images(_pixels(3, seed=1))  # 3 distinct images
    prompts = det.encode_prompts(_tokens(5, seed=2))  # 5 distinct prompts, different lengths
    for p in g.pair_buckets:
        image_index, prompt_index = _pairs(p, 3, 5, seed=p)
        want = det.ground(images, prompts, image_index, prompt_index)
        got = g.ground(images, prompts, image_index, prompt_index)
        _assert_close(got, want, f"ground P={p} {image_index.tolist()} x {prompt_index.tolist()}")
        # host lists go through the pinned copy path
        got_list = g.ground(images, prompts, image_index.tolist(), prompt_index.tolist())
        _assert_close(got_list, want, f"ground P={p} (host lists)")


@torch.inference_mode()
def test_ground_from_single_image_views_matches_eager(cpu_graphed):
    """The engine's call: per-image views into two image batches, pairs in batch order, out of order, repeated
    (padding) and mixed across batches. Host index lists -> run copies; the result equals the eager call on the
    concatenated images."""
    det, g = cpu_graphed
    first, second = det.encode_images(_pixels(2, seed=11)), det.encode_images(_pixels(3, seed=12))
    views = [ImageFeatures([f[i:i + 1] for f in batch.fpn], batch.pos, batch.geometry[i:i + 1])
             for batch, n in ((first, 2), (second, 3)) for i in range(n)]  # 5 distinct images, as the engine has them
    joined = ImageFeatures([torch.cat(level) for level in zip(first.fpn, second.fpn)], first.pos,
                           torch.cat([first.geometry, second.geometry]))
    prompts = det.encode_prompts(_tokens(3, seed=13))
    for p in g.pair_buckets:
        gen = torch.Generator().manual_seed(p)
        cases = [list(range(min(p, 5))) + [min(p, 5) - 1] * (p - min(p, 5)),  # in order, then padding
                 torch.randint(0, 5, (p,), generator=gen).tolist()]  # mixed
        for image_index in cases:
            prompt_index = [j % 3 for j in range(p)]
            want = det.ground(joined, prompts, torch.tensor(image_index), torch.tensor(prompt_index))
            _assert_close(g.ground(views, prompts, image_index, prompt_index), want, f"views P={p} {image_index}")


def test_copy_rows_copies_each_adjacent_run_once():
    """Runs: consecutive rows of one tensor (any layout) join; a repeat, a step back or another tensor splits."""
    from sammie.model.graphs import adjacent_runs, copy_rows

    a = torch.randn(4, 3, 5)
    b = torch.randn(6, 5, 3).transpose(1, 2)[::2]  # [3, 3, 5], non-contiguous rows two apart in memory
    rows = [a[1:2], a[2:3], a[3:4], b[0:1], b[1:2], b[1:2], a[0:1], b[2:3]]
    assert adjacent_runs(rows) == [(0, 3), (3, 5), (5, 6), (6, 7), (7, 8)]
    assert adjacent_runs([a[i:i + 1] for i in range(4)]) == [(0, 4)]  # a whole batch in order: one copy
    dst = torch.full((9, 3, 5), float("nan"))
    with pytest.raises(ValueError, match=r"rows must be \[1, \.\.\.\]"):
        copy_rows(dst, [a[0:2]])
    copy_rows(dst, rows)
    assert torch.equal(dst[:8], torch.cat(rows)) and dst[8].isnan().all()  # rows past len(rows) untouched


@torch.inference_mode()
def test_ground_one_image_one_prompt_repeated(cpu_graphed):
    """All pairs on one row: the gather must broadcast it, not read rows that do not exist."""
    det, g = cpu_graphed
    images = det.encode_images(_pixels(1, seed=3))
    prompts = det.encode_prompts(_tokens(1, seed=4))
    zeros = torch.zeros(4, dtype=torch.long)
    _assert_close(g.ground(images, prompts, zeros, zeros), det.ground(images, prompts, zeros, zeros), "ground 1x1")


@torch.inference_mode()
def test_graphed_chain_matches_eager_chain(cpu_graphed):
    """encode_images -> ground through the wrapper only (its own pos tensors), against the eager chain."""
    det, g = cpu_graphed
    px, tok = _pixels(2, seed=5), _tokens(3, seed=6)
    image_index, prompt_index = torch.tensor([1, 0, 1, 1]), torch.tensor([2, 2, 0, 1])
    want = det.ground(det.encode_images(px), det.encode_prompts(tok), image_index, prompt_index)
    got = g.ground(g.encode_images(px), g.encode_prompts(tok), image_index, prompt_index)
    _assert_close(got, want, "chain")


@torch.inference_mode()
def test_no_recompiles_on_second_pass_and_counter_can_fire(cpu_graphed):
    det, g = cpu_graphed
    before = g.stats()
    compiled = g.compile_mode is not None
    assert before["compiles"] == (len(g.image_buckets) + len(g.pair_buckets) if compiled else 0), before
    images = det.encode_images(_pixels(2, seed=7))
    prompts = det.encode_prompts(_tokens(2, seed=8))
    for b in g.image_buckets:
        g.encode_images(_pixels(b, seed=10 + b))
    for p in g.pair_buckets:
        g.ground(images, prompts, *_pairs(p, 2, 2, seed=p))
    after = g.stats()
    assert after["recompiles"] == 0 and after["compiles"] == before["compiles"], after
    assert all(after["encode_images"]["replays"][b] > before["encode_images"]["replays"][b] for b in g.image_buckets)
    assert all(after["ground"]["replays"][p] > before["ground"]["replays"][p] for p in g.pair_buckets)

    if compiled:  # the counter is live: a shape outside the buckets reaching the compiled function is a recompile
        g._image.run(det, _pixels(3, seed=11))
        assert g.stats()["recompiles"] == 1
        g._counter.recompiles -= 1  # keep the shared fixture's stats clean for the other tests
        g._counter.compiles -= 1


def test_clear_errors(cpu_graphed):
    det, g = cpu_graphed
    with pytest.raises(ValueError, match=re.escape(f"batch size 3 is not a captured bucket {list(g.image_buckets)}")):
        g.encode_images(_pixels(3, seed=0))
    with pytest.raises(ValueError, match=r"pixels must be \[B, 3, 112, 112\]"):
        g.encode_images(torch.zeros(1, 3, 64, 64))
    with pytest.raises(ValueError, match="pixels must be torch.float32"):
        g.encode_images(_pixels(1, seed=0).double())
    with torch.inference_mode():
        images = det.encode_images(_pixels(1, seed=0))
        prompts = det.encode_prompts(_tokens(1, seed=0))
    with pytest.raises(ValueError, match=re.escape(f"pair count 3 is not a captured bucket {list(g.pair_buckets)}")):
        g.ground(images, prompts, [0, 0, 0], [0, 0, 0])
    with pytest.raises(ValueError, match="must be two \\[P\\] vectors of the same length"):
        g.ground(images, prompts, [0, 0], [0])
    with pytest.raises(ValueError, match="prompt features is"):
        g.ground(images, prompts._replace(features=prompts.features[..., :8]), [0], [0])
    with pytest.raises(ValueError, match="needs the image_index as a host list"):
        g.ground([images], prompts, torch.zeros(1, dtype=torch.long), [0])
    with pytest.raises(ValueError, match="must hold single-image features"):
        g.ground([ImageFeatures([torch.cat([f, f]) for f in images.fpn], images.pos, images.geometry)], prompts,
                 [0], [0])
    with pytest.raises(ValueError, match="out of range for 1 images"):
        g.ground([images], prompts, [1], [0])
    with pytest.raises(ValueError, match="out of range for 1 images"):  # one [I, ...] with a host index: the same
        g.ground(images, prompts, [1], [0])
    fresh = GraphedDetector(det, [1], [1], compile_mode=None)
    with pytest.raises(RuntimeError, match="call capture"):
        fresh.encode_images(_pixels(1, seed=0))
    with pytest.raises(ValueError, match="inductor's own CUDA graphs"):
        GraphedDetector(det, [1], [1], compile_mode="reduce-overhead")
    with pytest.raises(ValueError, match="image_buckets must be a non-empty"):
        GraphedDetector(det, [], [1])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs the detector on a CUDA device"):
            GraphedDetector(det, [1], [1], cuda_graphs=True)


def test_each_stage_compiles_with_its_own_inductor_mode(monkeypatch, detector):
    """image_compile_mode reaches the image stage's inductor call only; the ground stage keeps compile_mode.

    Stand-in stage functions (one op each) keep dynamo's trace to ~a second, and a spy in place of inductor's
    compile_fx records the config patches each compile got and runs the graph uncompiled."""
    import torch._inductor.compile_fx as compile_fx_module

    import sammie.model.graphs as graphs

    seen: list[dict] = []

    def spy_compile_fx(gm, example_inputs, config_patches=None):
        seen.append(dict(config_patches or {}))
        return gm.forward

    monkeypatch.setattr(compile_fx_module, "compile_fx", spy_compile_fx)
    monkeypatch.setattr(graphs, "_encode_images_stage", lambda det, pixels: pixels * 2)
    monkeypatch.setattr(graphs, "_ground_stage", lambda det, fpn, pos, geometry, text, padding: text + 1)
    torch._dynamo.reset()
    g = GraphedDetector(detector, [1], [1], compile_mode="default", image_compile_mode="max-autotune-no-cudagraphs")
    g.capture()
    torch._dynamo.reset()
    assert len(seen) == 2, seen  # images first, then ground (capture's order)
    assert seen[0].get("max_autotune") is True and seen[0]["triton.cudagraphs"] is False, seen[0]
    assert not seen[1].get("max_autotune") and seen[1]["triton.cudagraphs"] is False, seen[1]
    stats = g.stats()
    assert (stats["compile_mode"], stats["image_compile_mode"]) == ("default", "max-autotune-no-cudagraphs")
    assert GraphedDetector(detector, [1], [1]).image_compile_mode == "default"  # None: the same as compile_mode
    with pytest.raises(ValueError, match="image_compile_mode 'max-autotune' turns on inductor's own CUDA graphs"):
        GraphedDetector(detector, [1], [1], image_compile_mode="max-autotune")
    with pytest.raises(ValueError, match="needs a compile_mode"):
        GraphedDetector(detector, [1], [1], compile_mode=None, image_compile_mode="default")


# AOTAutograd traces of the whole tiny detector take ~30-60 s per bucket on the shared 2-core box and inductor's CPU
# C++ codegen minutes: opt in.
@pytest.mark.skipif(not os.environ.get("SAMMIE_TEST_INDUCTOR"), reason="slow (CPU codegen); set SAMMIE_TEST_INDUCTOR=1")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@torch.inference_mode()
def test_backend_cpu_one_bucket(backend):
    torch._dynamo.reset()
    det = _detector()
    g = GraphedDetector(det, [2], [2], backend=backend)
    g.capture()
    images = det.encode_images(_pixels(2, seed=20))
    prompts = det.encode_prompts(_tokens(2, seed=21))
    ii, pi = torch.tensor([1, 0]), torch.tensor([1, 1])
    # inductor fuses/reorders LayerNorm and softmax reductions: fp32 rounding-level differences
    tol = TOL if backend == "aot_eager" else 1e-5
    _assert_close(g.encode_images(_pixels(2, seed=20)), images, f"{backend} encode", tol)
    _assert_close(g.ground(images, prompts, ii, pi), det.ground(images, prompts, ii, pi), f"{backend} ground", tol)
    assert g.stats()["recompiles"] == 0 and g.stats()["compiles"] == 2


# --- CUDA graphs ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("compile_mode", [None, "default"])
@torch.inference_mode()
def test_cuda_graph_replay(compile_mode):
    torch._dynamo.reset()
    det = _detector("cuda")
    g = GraphedDetector(det, [1, 2], [1, 4], compile_mode=compile_mode)
    assert g.cuda_graphs
    g.capture()
    # eager capture replays the same kernels (exact up to cuBLAS/cuDNN algorithm choice under capture);
    # inductor reorders fp32 reductions
    tol = 1e-5 if compile_mode is None else 1e-4
    prompts = det.encode_prompts(_tokens(3, seed=30, device="cuda"))
    ii, pi = (t.cuda() for t in _pairs(4, 2, 3, seed=31))

    px_a, px_b = _pixels(2, seed=32, device="cuda"), _pixels(2, seed=33, device="cuda")
    feats_a = g.encode_images(px_a)
    ground_a = g.ground(feats_a, prompts, ii, pi)
    feats_b = g.encode_images(px_b)  # same bucket, new inputs
    ground_b = g.ground(feats_b, prompts, ii, pi)
    g.encode_images(_pixels(1, seed=34, device="cuda"))  # other buckets replay in the same pools
    g.ground(feats_b, prompts, ii[:1], pi[:1])

    want_a, want_b = det.encode_images(px_a), det.encode_images(px_b)
    # replay == eager, and the first outputs survived the later replays (clone-out)
    _assert_close(feats_a, want_a, "replay A", tol)
    _assert_close(feats_b, want_b, "replay B", tol)
    _assert_close(ground_a, det.ground(want_a, prompts, ii, pi), "ground A", tol)
    _assert_close(ground_b, det.ground(want_b, prompts, ii, pi), "ground B", tol)
    # new inputs gave new outputs (copy-in reached the graph)
    assert rel_error(feats_a.fpn[0], feats_b.fpn[0]) > 1e-2
    assert rel_error(ground_a.mask_logits, ground_b.mask_logits) > 1e-2

    s = g.stats()
    assert s["encode_images"]["captured"] == [1, 2] and s["ground"]["captured"] == [1, 4]
    assert s["encode_images"]["replays"] == {1: 1, 2: 2} and s["ground"]["replays"] == {1: 1, 4: 2}
    assert s["recompiles"] == 0
    # each stage's graphs were captured on its own side stream (their cuBLAS workspaces: the engine replays the two
    # stages concurrently on two streams)
    assert None not in (g._image.capture_stream, g._pair.capture_stream)
    assert g._image.capture_stream != g._pair.capture_stream
