"""Locust load test for the Sammie HTTP API (`POST /v1/segment`).

Each simulated user posts real photographs (scikit-image's ``skimage.data``: astronaut, coffee, chelsea, rocket,
immunohistochemistry, camera), centre-cropped to 4:3, resized to 640x480 and JPEG-encoded once per process, with
text prompts from a rotating list, in a closed loop (``wait_time = constant(0)``: a user sends its next request as
soon as the previous one is answered). Request bodies are built once per process (multipart through
``urllib3.encode_multipart_formdata``, because FastHttpUser has no ``files=``; or base64 JSON with ``--body json``).

Every response is checked: HTTP 200, a JSON object whose ``prompts`` list has one entry per prompt sent, each with an
``instances`` list; anything else is a Locust failure (503 = overloaded, 504 = engine deadline, 408 = proxy
timeout are named as such). At the end the master (or the only process) prints ``images/s`` = successful
requests/s x images per request (one image per request in this API) and (image, prompt) pairs/s.

Commands (from the repository root; the server on 127.0.0.1:8000, e.g. ``serve run serve_configs/local.yaml``)::

    # smoke / CI gate: 20 s, 8 users, CSV + pass/fail exit code (Locust exits 1 if any request failed)
    locust -f benchmarks/locustfile.py --headless -u 8 -r 8 -t 20s --host http://127.0.0.1:8000 \\
        --csv out/loc --only-summary --exit-code-on-error 1

    # throughput at one concurrency, 4 load-generator processes (one process tops out near 150 req/s)
    locust -f benchmarks/locustfile.py --headless -u 64 -r 64 -t 40s --processes 4 \\
        --host http://127.0.0.1:8000 --csv out/u64 --only-summary

    # step load (find the knee): SAMMIE_LOAD_SHAPE=step defines the shape; -u/-r/-t are then ignored
    SAMMIE_LOAD_SHAPE=step SAMMIE_STEP_USERS=8,16,32,64 SAMMIE_STEP_SECONDS=30 \\
        locust -f benchmarks/locustfile.py --headless --processes 4 --host http://127.0.0.1:8000 \\
        --csv out/step --csv-full-history --only-summary

    # SLA gate on top of "no failures": exit 1 if p99 > 2000 ms
    locust -f benchmarks/locustfile.py --headless -u 16 -r 16 -t 30s --host http://127.0.0.1:8000 --max-p99-ms 2000

Outputs with ``--csv PREFIX``: ``PREFIX_stats.csv`` (row ``POST /v1/segment``: Request Count, Failure Count,
Requests/s, Failures/s, percentiles), ``PREFIX_stats_history.csv``, ``PREFIX_failures.csv``,
``PREFIX_exceptions.csv``. Images/s = (Requests/s - Failures/s) x 1.

Options (after the usual Locust ones; each also reads an env var): ``--body multipart|json|raw`` (SAMMIE_BODY;
raw = the JPEG as the body, prompts in the query string), ``--targets URL,URL`` (SAMMIE_TARGETS: spread users over
several base URLs, e.g. direct-ingress replica ports),
``--prompts-per-request K`` (SAMMIE_PROMPTS_PER_REQUEST, default 1), ``--mask-format rle|png|polygon``
(SAMMIE_MASK_FORMAT, default rle), ``--max-instances N`` (SAMMIE_MAX_INSTANCES, default 0 = server default),
``--threshold T`` (SAMMIE_THRESHOLD, default: server default), ``--max-p99-ms`` / ``--max-fail-ratio``
(SLA gates), ``--server-timings`` (also record the server's ``timings_ms`` as extra rows named ``server:<stage>``;
they then count in the Aggregated row). Step shape: SAMMIE_LOAD_SHAPE=step, SAMMIE_STEP_USERS (comma list),
SAMMIE_STEP_SECONDS.

Import order matters: ``locust`` first (gevent monkey-patching), then anything that touches ssl/urllib3
(serving.md §6; a RecursionError in ``create_urllib3_context`` otherwise).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # image prep in the load generator: no BLAS thread pools
os.environ.setdefault("OMP_NUM_THREADS", "1")

from locust import FastHttpUser, LoadTestShape, constant, events, task  # noqa: E402  (first: gevent patching)
from locust.runners import WorkerRunner  # noqa: E402

import base64  # noqa: E402
import io  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import urllib.parse  # noqa: E402

from urllib3 import encode_multipart_formdata  # noqa: E402

ENDPOINT = "/v1/segment"
IMAGE_SIZE = (640, 480)  # width, height
IMAGES_PER_REQUEST = 1  # the API takes one image per request
PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "camera")
PROMPTS = ("person", "cup", "cat", "rocket", "cell", "face", "spoon", "sky", "tree", "building", "hand", "ear")
REPO = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------- options


@events.init_command_line_parser.add_listener
def _add_options(parser):
    env = os.environ.get
    parser.add_argument("--body", choices=("multipart", "json", "raw"), default=env("SAMMIE_BODY", "multipart"),
                        help="request encoding (default multipart; raw: the JPEG as the body, prompts in the URL)")
    parser.add_argument("--targets", default=env("SAMMIE_TARGETS", ""),
                        help="comma-separated base URLs; users are spread over them round-robin (client-side "
                             "balancing over direct-ingress replicas); default: --host only")
    parser.add_argument("--prompts-per-request", type=int, default=int(env("SAMMIE_PROMPTS_PER_REQUEST", "1")),
                        help="text prompts per image (default 1)")
    parser.add_argument("--mask-format", choices=("rle", "png", "polygon"), default=env("SAMMIE_MASK_FORMAT", "rle"))
    parser.add_argument("--max-instances", type=int, default=int(env("SAMMIE_MAX_INSTANCES", "0")),
                        help="instances per prompt (0: server default)")
    parser.add_argument("--threshold", type=float, default=float(env("SAMMIE_THRESHOLD", "-1")),
                        help="score threshold (<0: server default)")
    parser.add_argument("--max-p99-ms", type=float, default=float(env("SAMMIE_MAX_P99_MS", "0")),
                        help="exit 1 if the p99 latency of successful+failed requests exceeds this (0: off)")
    parser.add_argument("--max-fail-ratio", type=float, default=float(env("SAMMIE_MAX_FAIL_RATIO", "0")),
                        help="exit 1 if failures/requests exceeds this (default 0: any failure; Locust's default)")
    parser.add_argument("--server-timings", action="store_true", default=env("SAMMIE_SERVER_TIMINGS", "") == "1",
                        help="record the server's timings_ms as extra stats rows server:<stage>")


# ----------------------------------------------------------------------------------------------- payloads


def _photos() -> list[tuple[str, bytes]]:
    """(name, JPEG bytes) of each photograph, 4:3 centre crop resized to 640x480, quality 90."""
    from PIL import Image

    arrays = []
    try:
        from skimage import data

        for name in PHOTOS:
            try:
                arrays.append((name, Image.fromarray(getattr(data, name)())))
            except Exception as e:  # noqa: BLE001  (a missing data file: skip that one picture)
                print(f"locustfile: skimage.data.{name} unavailable ({e}); skipped", file=sys.stderr)
    except ImportError:
        pass
    if not arrays:  # no scikit-image: the repository's example photographs
        arrays = [(p.stem, Image.open(p)) for p in sorted((REPO / "examples").glob("*.jpg"))]
    if not arrays:
        raise RuntimeError("no photographs: install scikit-image or keep examples/*.jpg")
    out = []
    w_out, h_out = IMAGE_SIZE
    for name, img in arrays:
        img = img.convert("RGB")
        w, h = img.size
        if w * h_out > h * w_out:  # too wide: crop width
            cw = h * w_out // h_out
            img = img.crop(((w - cw) // 2, 0, (w - cw) // 2 + cw, h))
        else:  # too tall: crop height
            ch = w * h_out // w_out
            img = img.crop((0, (h - ch) // 2, w, (h - ch) // 2 + ch))
        buf = io.BytesIO()
        img.resize(IMAGE_SIZE, Image.Resampling.LANCZOS).save(buf, format="JPEG", quality=90)
        out.append((name, buf.getvalue()))
    return out


class Payload:
    """One prepared request: body bytes, content type, and the number of prompts it carries."""

    __slots__ = ("body", "content_type", "n_prompts", "label", "query")

    def __init__(self, body: bytes, content_type: str, n_prompts: int, label: str, query: str = ""):
        self.body, self.content_type, self.n_prompts, self.label = body, content_type, n_prompts, label
        self.query = query  # "?prompt=...&..." for raw bodies, else ""


def build_payloads(options) -> list[Payload]:
    """Every photograph with a rotating window of prompts: len(PHOTOS) x len(PROMPTS) bodies (about 3 MB)."""
    k = max(1, options.prompts_per_request)
    extra: list[tuple[str, str]] = [("mask_format", options.mask_format)]
    if options.max_instances > 0:
        extra.append(("max_instances", str(options.max_instances)))
    if options.threshold >= 0:
        extra.append(("threshold", repr(options.threshold)))
    payloads = []
    for (name, jpeg), start in itertools.product(_photos(), range(len(PROMPTS))):
        prompts = [PROMPTS[(start + i) % len(PROMPTS)] for i in range(k)]
        query = ""
        if options.body == "raw":
            body, ctype = jpeg, "image/jpeg"
            query = "?" + urllib.parse.urlencode([("prompt", p) for p in prompts] + extra)
        elif options.body == "json":
            doc = {"image": base64.b64encode(jpeg).decode("ascii"), "prompts": prompts}
            doc.update({key: (json.loads(v) if key != "mask_format" else v) for key, v in extra})
            body, ctype = json.dumps(doc).encode(), "application/json"
        else:
            fields = [("image", (f"{name}.jpg", jpeg, "image/jpeg"))]
            fields += [("prompt", p) for p in prompts] + extra
            body, ctype = encode_multipart_formdata(fields)
        payloads.append(Payload(body, ctype, k, name, query))
    return payloads


_PAYLOADS: list[Payload] | None = None


def _payloads(environment) -> list[Payload]:
    global _PAYLOADS
    if _PAYLOADS is None:  # once per process (each --processes worker builds its own)
        _PAYLOADS = build_payloads(environment.parsed_options)
    return _PAYLOADS


# ----------------------------------------------------------------------------------------------- the user


def check_response(data, n_prompts: int) -> str | None:
    """None if `data` is a well-formed segmentation answer for `n_prompts` prompts, else what is wrong."""
    if not isinstance(data, dict):
        return f"response is {type(data).__name__}, not an object"
    prompts = data.get("prompts")
    if not isinstance(prompts, list):
        return "no 'prompts' list in the response"
    if len(prompts) != n_prompts:
        return f"{len(prompts)} prompt results for {n_prompts} prompts"
    for p in prompts:
        if not isinstance(p, dict) or not isinstance(p.get("instances"), list):
            return "a prompt result without an 'instances' list"
    return None


_USER_NUMBER = itertools.count()  # per process: spreads users over --targets

_STATUS_NAMES = {408: "proxy timeout", 429: "overloaded", 499: "cancelled", 503: "overloaded or unavailable",
                 504: "engine deadline"}


class SegmentUser(FastHttpUser):
    wait_time = constant(0)  # closed loop
    network_timeout = 120.0
    connection_timeout = 30.0

    def on_start(self):
        self.payloads = _payloads(self.environment)
        self.options = self.environment.parsed_options
        # Users start at different offsets so that concurrent requests carry different photographs and prompts.
        self.cursor = itertools.cycle(range(len(self.payloads)))
        for _ in range(hash(id(self)) % len(self.payloads)):
            next(self.cursor)
        targets = [t.strip().rstrip("/") for t in self.options.targets.split(",") if t.strip()]
        self.base = targets[next(_USER_NUMBER) % len(targets)] if targets else ""  # "" -> --host

    @task
    def segment(self):
        p = self.payloads[next(self.cursor)]
        with self.client.post(self.base + ENDPOINT + p.query, data=p.body, headers={"Content-Type": p.content_type},
                              name=ENDPOINT, catch_response=True) as r:
            if r.status_code != 200:
                what = _STATUS_NAMES.get(r.status_code, "error")
                r.failure(f"HTTP {r.status_code} ({what}): {(r.text or '')[:120]}")
                return
            try:
                data = r.json()
            except Exception:  # noqa: BLE001
                r.failure(f"200 but not JSON: {(r.text or '')[:120]}")
                return
            problem = check_response(data, p.n_prompts)
            if problem:
                r.failure(problem)
                return
            r.success()
        if self.options.server_timings and isinstance(data.get("timings_ms"), dict):
            for stage, ms in data["timings_ms"].items():
                if isinstance(ms, (int, float)):
                    self.environment.events.request.fire(
                        request_type="server", name=f"server:{stage}", response_time=float(ms),
                        response_length=0, exception=None, context={})


# ----------------------------------------------------------------------------------------------- step shape

if os.environ.get("SAMMIE_LOAD_SHAPE", "").lower() == "step":

    class StepLoad(LoadTestShape):
        """Hold each user count in SAMMIE_STEP_USERS for SAMMIE_STEP_SECONDS, then stop."""

        steps = [int(u) for u in os.environ.get("SAMMIE_STEP_USERS", "8,16,32,64").split(",") if u.strip()]
        seconds = float(os.environ.get("SAMMIE_STEP_SECONDS", "30"))

        def tick(self):
            i = int(self.get_run_time() // self.seconds)
            if i >= len(self.steps):
                return None
            return self.steps[i], float(self.steps[i])  # spawn the whole step within about a second


elif os.environ.get("SAMMIE_LOAD_SHAPE"):
    raise SystemExit(f"SAMMIE_LOAD_SHAPE={os.environ['SAMMIE_LOAD_SHAPE']!r}: only 'step' is defined")


# ----------------------------------------------------------------------------------------------- summary


@events.quitting.add_listener
def _summary(environment, **_kw):
    if isinstance(environment.runner, WorkerRunner):
        return  # the master prints the merged numbers
    stats = environment.stats
    seg = stats.get(ENDPOINT, "POST")
    total = stats.total
    if seg.num_requests == 0:
        print("sammie: no requests were made", file=sys.stderr)
        return
    duration = max(1e-9, (stats.last_request_timestamp or 0) - (stats.start_time or 0))  # what Locust's req/s uses
    ok = seg.num_requests - seg.num_failures
    k = max(1, environment.parsed_options.prompts_per_request)
    p50, p99 = seg.get_response_time_percentile(0.5), seg.get_response_time_percentile(0.99)
    print(
        f"sammie: {ok} ok / {seg.num_requests} requests in {duration:.1f} s -> "
        f"images/s {ok * IMAGES_PER_REQUEST / duration:.1f}, pairs/s {ok * IMAGES_PER_REQUEST * k / duration:.1f}, "
        f"p50 {p50:.0f} ms, p99 {p99:.0f} ms, failures {seg.num_failures} ({seg.fail_ratio:.1%})"
    )
    opts = environment.parsed_options
    reasons = []
    if opts.max_p99_ms > 0 and p99 > opts.max_p99_ms:
        reasons.append(f"p99 {p99:.0f} ms > --max-p99-ms {opts.max_p99_ms:.0f}")
    if opts.max_fail_ratio > 0:
        if seg.fail_ratio > opts.max_fail_ratio:
            reasons.append(f"fail ratio {seg.fail_ratio:.3f} > --max-fail-ratio {opts.max_fail_ratio}")
        elif total.num_failures and not reasons:
            environment.process_exit_code = 0  # failures within the allowed ratio: pass
    if reasons:
        print("sammie: FAIL: " + "; ".join(reasons), file=sys.stderr)
        environment.process_exit_code = 1
