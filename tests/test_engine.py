"""SammieEngine without Ray: tiny config, CPU, random weights (seed 0, as `Segmenter.load` builds them).

* Results equal `Segmenter.segment`'s: bit for bit when the engine's batches have the shapes the segmenter uses
  (one image at a time, K in {1, 2, 4} prompts so no pair padding); under concurrent traffic (mixed image batches,
  padded pair batches) to float summation order only, because CPU GEMMs are not batch-size invariant: measured here,
  at most 3 flipped mask pixels (logits within ~1e-7 of 0) in 54 of 1536 masks and score/box deltas <= 1.2e-4 px.
  Tolerances below: mask IoU >= 0.999, |score delta| <= 1e-5, box corners within 1e-2 px.
* Batching forms batches > 1 under concurrency; the prompt cache hits; bad inputs raise BadRequest with a code and
  a message naming the problem; overload, deadlines and cancellation behave as the scheduler promises.

The image builders at the top are shared with tests/test_serve.py.
"""

import asyncio
import io
import math
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from engine_core.oracle import instance_metrics
from engine_core.request import DeadlineExceeded, Overloaded
from sammie.config import Sam3Config
from sammie.decode import decode_image
from sammie.engine import BadRequest, EngineConfig, NotReady, SammieEngine
from sammie.segmenter import Segmenter

TINY = {"config": "tiny", "device": "cpu", "warmup": False, "decode_threads": 2}
PROMPTS = ["a red car", "person", "water bottle", "the cat on the left!"]


# ---------------------------------------------------------------------------------------------------- images


def encode(image: Image.Image, fmt: str = "PNG", **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def photos() -> list[np.ndarray]:
    from skimage import data

    rng = np.random.default_rng(0)
    return [
        data.astronaut(),  # 512 x 512 RGB
        data.coffee()[:300, :380],  # non-square crop
        np.stack([data.camera()[::3, ::2]] * 3, -1),  # grey content, 171 x 256
        rng.integers(0, 256, (61, 143, 3), dtype=np.uint8),  # odd sizes, wide
    ]


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that declares width x height but holds almost no data: what a decompression bomb looks like to
    `Image.open` (which reads the header only)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def odd_images() -> dict[str, tuple[bytes, tuple[int, int], np.ndarray]]:
    """name -> (encoded bytes, expected (width, height) after EXIF rotation, expected uint8 RGB [H, W, 3])."""
    rng = np.random.default_rng(1)
    rgb = rng.integers(0, 256, (40, 64, 3), dtype=np.uint8)
    grey = rgb[..., 0]
    out = {}
    out["grayscale"] = (encode(Image.fromarray(grey)), (64, 40), np.stack([grey] * 3, -1))
    rgba = np.concatenate([rgb, np.full((40, 64, 1), 7, np.uint8)], -1)
    out["rgba"] = (encode(Image.fromarray(rgba)), (64, 40), rgb)
    cmyk = Image.fromarray(rgb).convert("CMYK")
    out["cmyk_jpeg"] = (encode(cmyk, "JPEG", quality=95), (64, 40), None)  # lossy: size only
    g16 = (grey.astype(np.uint16) << 8) | 0xAB
    out["png_16bit"] = (encode(Image.fromarray(g16)), (64, 40), np.stack([grey] * 3, -1))
    frames = [Image.fromarray(np.full((40, 64, 3), c, np.uint8)) for c in ((255, 0, 0), (0, 0, 255))]
    out["animated_gif"] = (encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0),
                           (64, 40), np.broadcast_to(np.array([255, 0, 0], np.uint8), (40, 64, 3)))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise on display
    out["exif_rotated"] = (encode(Image.fromarray(rgb), "JPEG", exif=exif, quality=95), (40, 64), None)
    out["one_pixel"] = (encode(Image.fromarray(rgb[:1, :1])), (1, 1), rgb[:1, :1])
    out["palette"] = (encode(Image.fromarray(rgb).convert("P")), (64, 40), None)
    return out


def bad_images() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, BadRequest code)."""
    jpeg = encode(Image.fromarray(np.random.default_rng(2).integers(0, 256, (256, 256, 3), dtype=np.uint8)), "JPEG")
    return {
        "zero_bytes": (b"", "empty_image"),
        "not_an_image": (b"%PDF-1.4 this is not an image" * 10, "invalid_image"),
        "text": ("hello".encode(), "invalid_image"),
        "truncated_jpeg": (jpeg[: len(jpeg) // 2], "invalid_image"),
        "truncated_header": (jpeg[:20], "invalid_image"),
        "bomb_over_our_cap": (png_header_only(8000, 6000), "image_too_large"),  # 48 MP > 40 MP
        "bomb_over_pils_cap": (png_header_only(30000, 30000), "image_too_large"),  # PIL refuses at open
        "unsupported_format": (encode(Image.fromarray(np.zeros((8, 8), np.uint8)), "PPM"), "invalid_image"),
    }


def bad_requests() -> dict[str, tuple[dict, str]]:
    """name -> (segment() keyword overrides, BadRequest code)."""
    return {
        "no_prompt": ({"prompts": []}, "missing_prompt"),
        "empty_prompt": ({"prompts": ["person", ""]}, "empty_prompt"),
        "blank_prompt": ({"prompts": ["   "]}, "empty_prompt"),
        "overlong_prompt": ({"prompts": ["x" * 257]}, "prompt_too_long"),
        "too_many_prompts": ({"prompts": [f"p{i}" for i in range(17)]}, "too_many_prompts"),
        "non_string_prompt": ({"prompts": [3]}, "invalid_prompt"),
        "threshold_above_1": ({"threshold": 1.5}, "invalid_threshold"),
        "threshold_nan": ({"threshold": math.nan}, "invalid_threshold"),
        "threshold_string": ({"threshold": "0.5"}, "invalid_threshold"),
        "max_instances_0": ({"max_instances": 0}, "invalid_max_instances"),
        "timeout_negative": ({"timeout_s": -1.0}, "invalid_timeout"),
    }


# ---------------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def segmenter() -> Segmenter:
    return Segmenter.load(None, Sam3Config.tiny(), "cpu", torch.float32, seed=0)


def run_engine(coro_fn, **overrides):
    """Build a started engine (tiny, CPU) on a fresh event loop, run `coro_fn(engine)`, close the engine."""
    async def main():
        engine = SammieEngine(EngineConfig(**(TINY | overrides)))
        await engine.start()
        try:
            return await coro_fn(engine)
        finally:
            await engine.aclose()

    return asyncio.run(main())


def assert_identical(ours, ref):
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref):
        assert a.score == b.score and a.box == b.box and np.array_equal(a.mask, b.mask)


def assert_close(ours, ref, min_iou=0.999, max_score=1e-5, max_box_px=1e-2):
    m = instance_metrics(ours, ref)
    assert m["count_mismatch"] == 0 and m["mask_iou"] >= min_iou, m
    assert m["max_score_delta"] <= max_score and m["max_box_delta_px"] <= max_box_px, m


# ---------------------------------------------------------------------------------------------------- config


def test_config_validation():
    assert EngineConfig.from_dict({"config": "tiny", "max_image_batch": 4}).max_image_batch == 4
    with pytest.raises(ValueError, match=r"unknown EngineConfig key\(s\) \['max_batch'\]; valid keys: .*max_image_batch"):
        EngineConfig.from_dict({"max_batch": 4})
    for bad in ({"max_image_batch": "8"}, {"warmup": 1}, {"max_queued": True}, {"config": "huge"}, {"dtype": "int8"},
                {"max_queued": 0}, {"image_wait_ms": -1}, {"request_timeout_s": 0}):
        with pytest.raises(ValueError):
            EngineConfig(**bad)
    assert EngineConfig(image_wait_ms=3, request_timeout_s=None).image_wait_ms == 3  # int for a float is fine


# ---------------------------------------------------------------------------------------------------- results


def test_identical_to_segmenter_when_batch_shapes_match(segmenter):
    """Sequential requests: image batch 1 (as the segmenter's one image), K in {1, 2, 4}: no padding anywhere."""
    cases = [(im, PROMPTS[:k]) for im in photos() for k in (1, 2, 4)]

    async def go(engine):
        return [await engine.segment(encode(Image.fromarray(im)), ps, threshold=0.0, max_instances=4)
                for im, ps in cases]

    results = run_engine(go)
    n_instances = 0
    for (im, ps), res in zip(cases, results):
        assert (res.height, res.width) == im.shape[:2] and res.random_weights
        ref = segmenter.segment(Image.fromarray(im), ps, threshold=0.0, max_instances=4)[0]
        assert [p.prompt for p in res.prompts] == ps
        for pr, rf in zip(res.prompts, ref):
            assert_identical(pr.instances, rf)
            n_instances += len(rf)
    assert n_instances == 4 * len(cases) * 7 / 3  # threshold 0 keeps every query: masks really were compared


def test_concurrent_requests_batch_and_match_segmenter(segmenter):
    images = photos() * 3
    prompts = PROMPTS[:3]  # 3 pairs per image -> pair batches padded to buckets

    async def go(engine):
        results = await asyncio.gather(*(engine.segment(encode(Image.fromarray(im)), prompts, threshold=0.2,
                                                        max_instances=5) for im in images))
        return results, engine.health()

    results, health = run_engine(go)
    stats = health["stats"]
    assert stats["image.batch_size.max"] > 1 and stats["grounding.batch_size.max"] > 1, stats
    assert stats["answered_ok"] == len(images) and stats["image.items"] == len(images)
    for im, res in zip(images, results):
        ref = segmenter.segment(Image.fromarray(im), prompts, threshold=0.2, max_instances=5)[0]
        for pr, rf in zip(res.prompts, ref):
            assert len(pr.instances) <= 5
            assert_close(pr.instances, rf)
    timings = results[0].timings_ms
    assert set(timings) == {"decode", "queue", "image", "grounding", "total"} and timings["total"] > 0


def test_prompt_cache_hits_and_evicts():
    image = encode(Image.fromarray(photos()[3]))

    async def go(engine):
        stats = []
        for prompts in (["a"], ["a"], ["a", "b"], ["c"], ["a"]):  # capacity 2: "c" evicts "a" (LRU)
            await engine.segment(image, prompts)
            stats.append(engine.prompt_cache.stats())
        return stats

    stats = run_engine(go, prompt_cache_size=2)
    assert [(s["hits"], s["misses"]) for s in stats] == [(0, 1), (1, 1), (2, 2), (2, 3), (2, 4)]
    assert stats[-1]["size"] == 2


# ---------------------------------------------------------------------------------------------------- inputs


def test_decode_handles_every_image_mode():
    for name, (data, (w, h), expected) in odd_images().items():
        rgb = decode_image(data, 40_000_000)
        assert rgb.dtype == torch.uint8 and tuple(rgb.shape) == (3, h, w), name
        if expected is not None:
            assert np.array_equal(rgb.permute(1, 2, 0).numpy(), expected), name


def test_bad_inputs_raise_bad_request_and_engine_stays_healthy():
    good = encode(Image.fromarray(photos()[3]))

    async def go(engine):
        seen = {}
        for name, (data, code) in bad_images().items():
            with pytest.raises(BadRequest) as info:
                await engine.segment(data, ["person"])
            seen[name] = (info.value.code, info.value.message)
            assert info.value.code == code, (name, info.value)
        for name, (kwargs, code) in bad_requests().items():
            with pytest.raises(BadRequest) as info:
                await engine.segment(**({"image_bytes": good, "prompts": ["person"]} | kwargs))
            seen[name] = (info.value.code, info.value.message)
            assert info.value.code == code, (name, info.value)
        with pytest.raises(BadRequest, match="payload_too_large"):
            await engine.segment(b"\0" * 200_001, ["person"])
        ok = await engine.segment(good, ["person"])  # still serving
        return seen, ok, engine.health()

    seen, ok, health = run_engine(go, max_body_bytes=200_000)
    assert (ok.width, ok.height) == (143, 61) and health["ready"]
    assert health["stats"]["submitted"] == 1  # nothing bad reached the scheduler
    assert "8000 x 6000" in seen["bomb_over_our_cap"][1] and "257 characters" in seen["overlong_prompt"][1]


def test_odd_images_segment_with_post_rotation_size():
    async def go(engine):
        return {name: await engine.segment(data, ["person"], max_instances=2)
                for name, (data, _, _) in odd_images().items()}

    for name, res in run_engine(go).items():
        w, h = odd_images()[name][1]
        assert (res.width, res.height) == (w, h), name
        for inst in res.prompts[0].instances:
            assert inst.mask.shape == (h, w), name


# ---------------------------------------------------------------------------------------------------- load


# a partial image batch waits a minute, even with nothing running (release_when_idle off): requests stay queued until
# we act
SLOW = {"image_wait_ms": 60_000.0, "release_when_idle": False}


def test_overload_rejects_at_once():
    image = encode(Image.fromarray(photos()[3]))

    async def go(engine):
        first = asyncio.create_task(engine.segment(image, ["person"]))
        while engine.scheduler.num_unfinished < 1:
            await asyncio.sleep(0.005)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(Overloaded) as info:
            await engine.segment(image, ["person"])
        elapsed = loop.time() - t0
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        return info.value, elapsed, engine.health()

    error, elapsed, health = run_engine(go, max_queued=1, **SLOW)
    assert elapsed < 0.05 and error.retry_after_s > 0 and error.max_queued == 1
    assert health["rejected"] == 1 and health["stats"]["cancelled"] == 1 and health["queue"]["unanswered"] == 0


def test_deadline_exceeded_while_queued():
    image = encode(Image.fromarray(photos()[3]))

    async def go(engine):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(DeadlineExceeded) as info:
            await engine.segment(image, ["person"], timeout_s=0.2)
        return info.value, loop.time() - t0, engine.health()

    error, elapsed, health = run_engine(go, **SLOW)
    assert 0.2 <= elapsed < 5.0 and error.stage.value == "image" and not error.running
    assert health["stats"]["deadline_exceeded"] == 1 and health["stats"]["image.batches"] == 0  # never ran


def test_deadline_defaults_to_request_timeout_s():
    async def go(engine):
        with pytest.raises(DeadlineExceeded):
            await engine.segment(encode(Image.fromarray(photos()[3])), ["person"], timeout_s=30.0)  # capped at 0.1

    run_engine(go, request_timeout_s=0.1, **SLOW)


def test_cancelling_the_awaiting_task_cancels_its_work():
    image = encode(Image.fromarray(photos()[3]))

    async def go(engine):
        task = asyncio.create_task(engine.segment(image, ["person", "car"]))
        while engine.scheduler.num_unfinished < 1:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return engine.health()

    health = run_engine(go, **SLOW)
    assert health["stats"]["cancelled"] == 1 and health["queue"]["unanswered"] == 0
    assert health["queue"]["image_queued"] == 0 and health["stats"]["image.batches"] == 0


def test_warmup_readiness_and_health():
    async def go():
        engine = SammieEngine(EngineConfig(**(TINY | {"warmup": True})))
        before = engine.health()
        with pytest.raises(NotReady):
            await engine.segment(b"x", ["person"])
        await engine.start()
        after = engine.health()
        await engine.aclose()
        return engine, before, after

    engine, before, after = asyncio.run(go())
    assert not before["ready"] and after["ready"] and after["warmup_s"] > 0
    assert after["random_weights"] and after["device"] == "cpu" and after["dtype"] == "float32"
    assert engine.warmup_stats["image.batches"] >= 4 and engine.warmup_stats["image.batch_size.max"] == 8
    assert engine.warmup_stats["grounding.batch_size.max"] == 16
    assert after["stats"]["submitted"] == 0 and after["prompt_cache"]["size"] == 0  # warm-up forgotten


def test_release_when_idle_skips_the_wait_budgets_of_a_lone_request():
    """release_when_idle (EngineConfig -> both scheduler stages): with minute-long wait budgets a lone request still
    completes at once while nothing else runs; without it, the same engine keeps it queued until its deadline (the
    budget, not the model, is what it waits for)."""
    image = encode(Image.fromarray(photos()[3]))

    async def go(engine):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        result = await engine.segment(image, ["person"], timeout_s=30.0)
        return result, loop.time() - t0

    budgets = {"image_wait_ms": 60_000.0, "pair_wait_ms": 60_000.0}
    result, elapsed = run_engine(go, release_when_idle=True, **budgets)
    assert elapsed < 30.0 and result.prompts[0].prompt == "person"

    async def waits(engine):
        with pytest.raises(DeadlineExceeded):
            await engine.segment(image, ["person"], timeout_s=0.5)

    run_engine(waits, release_when_idle=False, **budgets)  # off: the minute-long image budget holds it past its
    #                                                         deadline
    assert EngineConfig().release_when_idle  # on by default (H200, waterfall run 5)
