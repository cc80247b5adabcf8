"""End to end through a real Ray Serve instance on 127.0.0.1 (tiny model, CPU, random weights, seed 0).

One Ray for the module (about 30 s to start both apps on 2 cores), two applications:

* `sammie` at `/`: the default app, image batches wait up to 20 ms for company;
* `slow` at `/slow`: `max_queued=1` and image batches that wait a minute (release_when_idle off), so a request stays
  queued until we act:
  the overload (503 + Retry-After at once), deadline (504) and client-disconnect (work cancelled) cases.

Masks are compared with the in-process `Segmenter.segment` at the same weights: exactly (RLE decoded with
pycocotools, scores and boxes bit-equal) for requests sent one at a time, whose batches have the segmenter's shapes;
within float summation order (tests/test_engine.py says how much) for concurrent requests that batch together. The
reference runs with the replica's torch thread count (Ray gives a `num_cpus=1` actor one OpenMP thread), since CPU
GEMM results depend on it.
"""

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from urllib3 import encode_multipart_formdata

from sammie.config import Sam3Config
from sammie.masks import decode_png, decode_rle
from sammie.segmenter import Instance, Segmenter
from tests.test_engine import assert_close, assert_identical, bad_images, encode, odd_images, photos

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
from tests.local_serve import free_port, local_serve  # noqa: E402
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")  # pycocotools + numpy 2

REPO = Path(__file__).resolve().parents[1]
MAX_BODY = 2 * 2**20
MAIN = {"config": "tiny", "device": "cpu", "image_wait_ms": 20.0, "max_body_bytes": MAX_BODY, "decode_threads": 2}
SLOW = {"config": "tiny", "device": "cpu", "warmup": False, "max_queued": 1, "image_wait_ms": 60_000.0,
        "release_when_idle": False, "decode_threads": 1}  # (idle release would send the parked request at once)


METRICS_PORT = free_port()


@pytest.fixture(scope="module")
def base_url():
    from sammie.serve import build_app

    with local_serve({"/": ("sammie", build_app(MAIN)), "/slow": ("slow", build_app(SLOW))},
                     _metrics_export_port=METRICS_PORT) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client):
    """The in-process segmenter at the server's weights (seed 0) and thread count."""
    threads = client.get("/readyz").json()["engine"]["torch_threads"]
    seg = Segmenter.load(None, Sam3Config.tiny(), "cpu", torch.float32, seed=0)

    def segment(image: np.ndarray, prompts, **kwargs):
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return seg.segment(Image.fromarray(image), prompts, **kwargs)[0]
        finally:
            torch.set_num_threads(saved)

    return segment


def multipart(image: bytes | None, prompts=(), filename="image.png", **options) -> dict:
    """httpx request kwargs for a multipart body (values may be bytes, e.g. invalid UTF-8)."""
    fields = [] if image is None else [("image", (filename, image, "application/octet-stream"))]
    fields += [("prompt", p) for p in prompts] + [(k, str(v)) for k, v in options.items()]
    body, content_type = encode_multipart_formdata(fields)
    return {"content": body, "headers": {"content-type": content_type}}


def as_json(image: bytes, prompts, **options) -> dict:
    return {"json": {"image": base64.b64encode(image).decode(), "prompts": list(prompts), **options}}


def raw(body: bytes, prompts, content_type="image/jpeg", **options) -> dict:
    """httpx request kwargs for a raw image body with prompts and options in the query string."""
    return {"content": body, "headers": {"content-type": content_type},
            "params": [("prompt", p) for p in prompts] + [(k, str(v)) for k, v in options.items()]}


def instances(prompt_result: dict, height: int, width: int) -> list[Instance]:
    out = []
    for inst in prompt_result["instances"]:
        mask = decode_rle(inst["mask"])
        assert mask.shape == (height, width) and inst["area"] == int(mask.sum())
        out.append(Instance(inst["score"], tuple(inst["box"]), mask))
    return out


def error_of(response: httpx.Response) -> dict:
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"} and body["error"]["message"], body
    return body["error"]


def engine_health(client, prefix="") -> dict:
    return client.get(f"{prefix}/readyz").json()["engine"]


def wait_for(predicate, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


# ---------------------------------------------------------------------------------------------------- basics


def test_health_readiness_and_docs(client):
    assert client.get("/healthz").json() == {"alive": True}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["ready"] and body["random_weights"] and body["engine"]["warmup_s"] > 0
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()["paths"]["/v1/segment"]["post"]
    assert set(spec["requestBody"]["content"]) == {"multipart/form-data", "application/json", "image/jpeg", "image/png",
                                                   "image/webp", "image/gif", "image/bmp", "image/tiff",
                                                   "application/octet-stream"}
    assert {p["name"] for p in spec["parameters"]} == {"prompt", "threshold", "mask_format", "max_instances",
                                                       "timeout_s"}
    assert "SegmentResponse" in json.dumps(spec["responses"]["200"])


def test_rle_masks_match_segmenter_exactly(client, reference):
    """One request at a time: image batch 1 and K in {1, 2} pairs, the segmenter's shapes -> bit-equal."""
    n = 0
    for i, image in enumerate(photos()):
        for prompts in (["person"], ["a red car", "the cat on the left!"]):
            req = multipart(encode(Image.fromarray(image)), prompts, threshold=0.0, max_instances=4) if i % 2 else \
                as_json(encode(Image.fromarray(image)), prompts, threshold=0.0, max_instances=4)
            r = client.post("/v1/segment", **req)
            assert r.status_code == 200, r.text
            body = r.json()
            h, w = image.shape[:2]
            assert (body["height"], body["width"]) == (h, w) and body["mask_format"] == "rle"
            assert body["random_weights"] and set(body["timings_ms"]) >= {"decode", "image", "grounding", "total"}
            ref = reference(image, prompts, threshold=0.0, max_instances=4)
            assert [p["prompt"] for p in body["prompts"]] == prompts
            for got, want in zip(body["prompts"], ref):
                assert_identical(instances(got, h, w), want)
                n += len(want)
    assert n == 4 * 4 * 3  # threshold 0: every query is an instance, capped at 4


def test_concurrent_requests_all_answered_and_batched(base_url, client, reference):
    images = photos() * 10  # 40 requests, half multipart, half JSON
    prompts = ["person", "cat"]
    before = engine_health(client)["stats"]

    async def fire():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits) as ac:
            reqs = [(multipart if i % 2 else as_json)(encode(Image.fromarray(im)), prompts, threshold=0.3,
                                                       max_instances=3) for i, im in enumerate(images)]
            return await asyncio.gather(*(ac.post("/v1/segment", **req) for req in reqs))

    responses = asyncio.run(fire())
    assert [r.status_code for r in responses] == [200] * len(images), [r.text for r in responses if r.status_code != 200]
    stats = engine_health(client)["stats"]
    assert stats["answered_ok"] - before["answered_ok"] == len(images)
    assert stats["image.batch_size.max"] > 1 and stats["grounding.batch_size.max"] > 1, stats
    for image, r in zip(images[:8], responses[:8]):  # the comparison is the slow part; 8 cover both encodings
        body, (h, w) = r.json(), image.shape[:2]
        for got, want in zip(body["prompts"], reference(image, prompts, threshold=0.3, max_instances=3)):
            assert_close(instances(got, h, w), want)


def test_raw_body_matches_multipart(client):
    """The raw-image form (prompts in the query string) answers exactly what the multipart form answers."""
    for i, image in enumerate(photos()[:3]):
        data = encode(Image.fromarray(image), "JPEG" if i % 2 else "PNG", **({"quality": 90} if i % 2 else {}))
        prompts = ["person", "a red car & the cat?"]  # '&' and '?' must survive the query string
        opts = {"threshold": 0.0, "max_instances": 3}
        want = client.post("/v1/segment", **multipart(data, prompts, **opts))
        got = client.post("/v1/segment", **raw(data, prompts, "image/jpeg" if i % 2 else "image/png", **opts))
        assert want.status_code == got.status_code == 200, got.text
        a, b = want.json(), got.json()
        assert [p["prompt"] for p in b["prompts"]] == prompts and (a["width"], a["height"]) == (b["width"], b["height"])
        for pa, pb in zip(a["prompts"], b["prompts"]):
            assert [(x["score"], x["box"], x["mask"]) for x in pa["instances"]] == \
                [(x["score"], x["box"], x["mask"]) for x in pb["instances"]]
    # a PNG labelled image/jpeg is decoded as the PNG it is; octet-stream works too
    png = encode(Image.fromarray(photos()[3]))
    for ctype in ("image/jpeg", "application/octet-stream"):
        r = client.post("/v1/segment", **raw(png, ["person"], ctype, mask_format="png"))
        assert r.status_code == 200 and r.json()["mask_format"] == "png", r.text


def test_png_and_polygon_masks(client):
    image = encode(Image.fromarray(photos()[0]))
    by_format = {}
    for fmt in ("rle", "png", "polygon"):
        r = client.post("/v1/segment", **multipart(image, ["person"], threshold=0.0, max_instances=2, mask_format=fmt))
        assert r.status_code == 200, r.text
        by_format[fmt] = r.json()["prompts"][0]["instances"]
    for rle, png, poly in zip(by_format["rle"], by_format["png"], by_format["polygon"]):
        assert np.array_equal(decode_rle(rle["mask"]), decode_png(png["mask"]))
        assert isinstance(poly["mask"], list) and all(len(ring) % 2 == 0 for ring in poly["mask"])
    assert len(by_format["rle"]) == 2


# ---------------------------------------------------------------------------------------------------- bad input


def _bad_cases() -> list[tuple[str, dict, int, str]]:
    good = encode(Image.fromarray(photos()[3]))
    cases = [(f"image_{name}", multipart(data, ["person"]), 413 if code == "image_too_large" else 422, code)
             for name, (data, code) in bad_images().items()]
    cases += [
        ("image_not_base64", {"json": {"image": "***", "prompts": ["person"]}}, 400, "malformed_request"),
        ("oversized_body", multipart(b"\0" * (MAX_BODY + 1), ["person"]), 413, "body_too_large"),
        ("oversized_chunked_body", {"content": iter([b"\0" * 2**20] * 3),  # no Content-Length: counted as read
                                    "headers": {"content-type": "multipart/form-data; boundary=x"}},
         413, "body_too_large"),
        ("no_prompt", multipart(good, []), 422, "missing_prompt"),
        ("no_prompt_json", {"json": {"image": base64.b64encode(good).decode()}}, 422, "missing_prompt"),
        ("empty_prompt", multipart(good, ["person", ""]), 422, "empty_prompt"),
        ("overlong_prompt", multipart(good, ["x" * 257]), 422, "prompt_too_long"),
        ("too_many_prompts", as_json(good, [f"p{i}" for i in range(17)]), 422, "too_many_prompts"),
        ("invalid_utf8_prompt", multipart(good, [b"caf\xe9 \xff"]), 400, "malformed_request"),
        ("invalid_utf8_json", {"content": b'{"image": "", "prompts": ["\xff"]}',
                               "headers": {"content-type": "application/json"}}, 400, "malformed_request"),
        ("malformed_json", {"content": b'{"image": ', "headers": {"content-type": "application/json"}},
         400, "malformed_request"),
        ("malformed_multipart", {"content": b"--x\r\nnonsense", "headers": {"content-type": "multipart/form-data"}},
         400, "malformed_request"),
        ("no_image", multipart(None, ["person"]), 422, "missing_image"),
        ("wrong_content_type", {"content": good, "headers": {"content-type": "text/plain"}}, 415,
         "unsupported_media_type"),
        ("raw_no_prompt", raw(good, [], "image/png"), 422, "missing_prompt"),
        ("raw_empty_body", raw(b"", ["person"]), 422, "empty_image"),
        ("raw_not_an_image", raw(b"%PDF-1.4 nope" * 10, ["person"], "application/octet-stream"), 422, "invalid_image"),
        ("raw_unknown_param", raw(good, ["person"], promt="cat"), 422, "unknown_field"),
        ("raw_image_param", raw(good, ["person"], image="x"), 422, "invalid_field"),
        ("raw_repeated_option", {**raw(good, ["person"]), "params": [("prompt", "a"), ("threshold", "0.1"),
                                                                      ("threshold", "0.2")]}, 422, "invalid_field"),
        ("raw_bad_threshold", raw(good, ["person"], threshold="abc"), 422, "invalid_threshold"),
        ("raw_invalid_utf8_query", {"content": good, "headers": {"content-type": "image/png"},
                                    "url": "/v1/segment?prompt=caf%E9"}, 400, "malformed_request"),
        ("raw_oversized", raw(b"\0" * (MAX_BODY + 1), ["person"]), 413, "body_too_large"),
        ("no_content_type", {"content": good}, 415, "unsupported_media_type"),
        ("threshold_not_a_number", multipart(good, ["person"], threshold="abc"), 422, "invalid_threshold"),
        ("threshold_out_of_range", as_json(good, ["person"], threshold=2), 422, "invalid_threshold"),
        ("bad_mask_format", multipart(good, ["person"], mask_format="bmp"), 422, "invalid_mask_format"),
        ("unknown_field", multipart(good, ["person"], promt="cat"), 422, "unknown_field"),
        ("unknown_json_field", as_json(good, ["person"], promts=["cat"]), 422, "unknown_field"),
        ("max_instances_zero", as_json(good, ["person"], max_instances=0), 422, "invalid_max_instances"),
    ]
    return cases


@pytest.mark.parametrize("name,request_kwargs,status,code", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input_gets_a_json_error(client, name, request_kwargs, status, code):
    kwargs = dict(request_kwargs)
    r = client.post(kwargs.pop("url", "/v1/segment"), **kwargs)
    assert r.status_code == status, (name, r.status_code, r.text)
    assert error_of(r)["code"] == code, (name, r.text)


@pytest.mark.parametrize("name", sorted(odd_images()))
def test_odd_images_are_served_with_post_rotation_size(client, name):
    data, (w, h), _ = odd_images()[name]
    r = client.post("/v1/segment", **multipart(data, ["person"], max_instances=1))
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["width"], body["height"]) == (w, h)
    for inst in body["prompts"][0]["instances"]:
        assert inst["mask"]["size"] == [h, w]


def test_very_large_image_and_routing_errors(client):
    big = encode(Image.new("RGB", (6000, 4000), (40, 90, 200)))  # 24 MP, under the 40 MP cap
    r = client.post("/v1/segment", **multipart(big, ["sky"], threshold=1.0))  # threshold 1: no masks to upsample
    assert r.status_code == 200, r.text
    assert (r.json()["width"], r.json()["height"]) == (6000, 4000)
    assert error_of(client.get("/v1/segment"))["code"] == "method_not_allowed"
    assert error_of(client.get("/nowhere"))["code"] == "not_found"


def test_server_still_healthy_after_bad_input(client):
    assert client.get("/readyz").status_code == 200 and client.get("/healthz").status_code == 200
    r = client.post("/v1/segment", **multipart(encode(Image.fromarray(photos()[1])), ["cup"]))
    assert r.status_code == 200, r.text
    health = engine_health(client)
    assert health["stats"]["failed"] == 0 and health["queue"]["admitted"] == 0


# ---------------------------------------------------------------------------------------------------- overload


def test_overload_503_at_once_and_disconnect_cancels_work(base_url, client):
    image = encode(Image.fromarray(photos()[3]))
    before = engine_health(client, "/slow")["stats"]

    async def scenario():
        async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as ac:
            parked = asyncio.create_task(ac.post("/slow/v1/segment", **multipart(image, ["person"])))
            await asyncio.to_thread(wait_for, lambda: engine_health(client, "/slow")["queue"]["unanswered"] == 1)
            t0 = time.monotonic()
            rejected = await ac.post("/slow/v1/segment", **multipart(image, ["person"]))
            elapsed = time.monotonic() - t0
            parked.cancel()  # closes its connection: the proxy sees the client leave
            with pytest.raises(asyncio.CancelledError):
                await parked
            return rejected, elapsed

    rejected, elapsed = asyncio.run(scenario())
    assert rejected.status_code == 503 and error_of(rejected)["code"] == "overloaded"
    assert int(rejected.headers["retry-after"]) >= 1 and elapsed < 2.0
    # the disconnect reached the engine: the parked request was cancelled and its image never ran
    wait_for(lambda: engine_health(client, "/slow")["stats"]["cancelled"] == before["cancelled"] + 1)
    health = engine_health(client, "/slow")
    assert health["queue"]["admitted"] == 0 and health["stats"]["image.batches"] == 0 and health["rejected"] >= 1


def test_deadline_504(client):
    wait_for(lambda: engine_health(client, "/slow")["queue"]["admitted"] == 0)
    t0 = time.monotonic()
    r = client.post("/slow/v1/segment", **as_json(encode(Image.fromarray(photos()[3])), ["person"], timeout_s=0.5))
    assert r.status_code == 504 and error_of(r)["code"] == "deadline_exceeded", r.text
    assert 0.5 <= time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------------------------------- locust


def test_locust_headless_run_has_no_failures(base_url, tmp_path):
    locustfile = REPO / "benchmarks" / "locustfile.py"
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless", "-u", "4", "-r", "4", "-t", "8s",
           "--host", base_url, "--csv", str(tmp_path / "loc"), "--only-summary", "--exit-code-on-error", "1"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {row.split(",")[1]: row.split(",") for row in (tmp_path / "loc_stats.csv").read_text().splitlines()[1:]}
    requests, failures = int(rows["/v1/segment"][2]), int(rows["/v1/segment"][3])
    assert requests > 0 and failures == 0, rows


def test_prometheus_metrics_are_exported(client):
    """Ray's metrics agent exports our custom metrics (with Ray's `ray_` prefix) within its report interval."""
    wanted = ("ray_sammie_requests", "ray_sammie_batch_size_bucket", "ray_sammie_queue_wait_ms_bucket",
              "ray_sammie_request_stage_ms_bucket")

    def exported() -> bool:
        try:
            text = httpx.get(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).text
        except httpx.HTTPError:
            return False
        return all(name in text for name in wanted) and 'status="503"' in text

    wait_for(exported, timeout_s=40)
