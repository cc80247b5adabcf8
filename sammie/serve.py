"""Ray Serve app: one deployment (`Sammie`) whose FastAPI ingress is a thin adapter over `SammieEngine`.

    POST /v1/segment   multipart, JSON, or the raw image with ?prompt=... -> SegmentResponse (schema and status
                       codes: sammie/api.py, /docs)
    GET  /healthz      200 while the process and its batch loop are alive
    GET  /readyz       200 once weights are loaded and warm-up is done (503 otherwise); says if weights are random

Per request the event loop only reads the body (bounded by `max_body_bytes`) and awaits: body parsing, image
decoding and mask/JSON encoding run on the engine's CPU pool, the model on the engine's stage threads. Batching
lives in the engine (no `@serve.batch`), inside the replica that receives the requests, which is where batches fill
(serving.md 2.1). A client disconnect or Ray's own timeout cancels the handler task; the engine then drops the
request's queued work. Access logs are off (`logging_config.enable_access_log`), they cost event-loop time per
request.

Start: `python -m sammie serve` or `serve run serve_configs/local.yaml` (`build_app(args)`, args = EngineConfig).
"""

# No `from __future__ import annotations`: FastAPI must see real classes (e.g. `Request`) in the route
# signatures that `serve.ingress` rewrites, or it treats `request` as a query parameter.

import asyncio
import logging
import math
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve import metrics
from ray.serve.deployment import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_core.request import Cancelled, DeadlineExceeded, Overloaded, RunFailed
from engine_core.scheduler import BatchRecord
from sammie.api import (
    BAD_REQUEST_STATUS,
    ApiError,
    ErrorResponse,
    InstanceOut,
    PromptOut,
    ReadyResponse,
    SegmentResponse,
    Timings,
    check_media_type,
    error_body,
    openapi_request_body,
    parse_body,
)
from sammie.engine import BadRequest, EngineConfig, NotReady, SammieEngine, SegmentResult
from sammie.masks import encode_instances

log = logging.getLogger("sammie.serve")

app = FastAPI(
    title="Sammie",
    summary="Text-prompted image segmentation (SAM 3 / SAM 3.1): an image and text prompts in, masks out.",
    version="0.1.0",
)

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 413, 415, 422, 500, 503, 504)}
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Routing errors (404, 405) in the same `{"error": ...}` shape as everything else."""
    return Response(error_body(_HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail)),
                    status_code=exc.status_code, headers=exc.headers, media_type="application/json")


class _Metrics:
    """Prometheus metrics through Ray's metrics agent (`ray start --metrics-export-port`); names get Ray's prefix
    `ray_`. Stages: decode, queue, image, grounding, encode, total (ms); batch stages: image, grounding."""

    _MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000]

    def __init__(self, max_batch: int):
        self.requests = metrics.Counter("sammie_requests", "answered requests by HTTP status and error code",
                                        tag_keys=("status", "code"))
        self.latency_ms = metrics.Histogram("sammie_request_stage_ms", "per-request time per stage (ms)",
                                            boundaries=self._MS, tag_keys=("stage",))
        self.queue_wait_ms = metrics.Histogram("sammie_queue_wait_ms", "per item: stage queue -> batch formed (ms)",
                                               boundaries=self._MS, tag_keys=("stage",))
        self.batch_run_ms = metrics.Histogram("sammie_batch_run_ms", "per batch: formed -> done (ms)",
                                              boundaries=self._MS, tag_keys=("stage",))
        sizes = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, max_batch})
        self.batch_size = metrics.Histogram("sammie_batch_size", "real items per batch",
                                            boundaries=[s + 0.5 for s in sizes], tag_keys=("stage",))

    def on_batch(self, record: BatchRecord) -> None:  # scheduler hook, on the event loop; must not raise
        try:
            tags = {"stage": record.stage.value}
            self.batch_size.observe(record.size, tags)
            self.batch_run_ms.observe(record.run_s * 1000.0, dict(tags))
            for wait_s in record.queue_wait_s:
                self.queue_wait_ms.observe(wait_s * 1000.0, dict(tags))
        except Exception:  # metrics must never take the batch loop down
            log.exception("metrics hook failed")

    def on_request(self, status: int, code: str, timings_ms: dict[str, float] | None) -> None:
        self.requests.inc(1, {"status": str(status), "code": code})
        for stage, ms in (timings_ms or {}).items():
            self.latency_ms.observe(ms, {"stage": stage})


# Helpers come before the deployment: `serve.ingress` snapshots the class (and the module globals its methods use)
# when it is decorated, so anything defined below it would be missing in the replica.


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes (Content-Length or streamed)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError("malformed_request", f"invalid Content-Length {declared!r}")
        if int(declared) > limit:
            raise ApiError("body_too_large", f"the body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError("body_too_large", f"the body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _render(result: SegmentResult, mask_format: str, t0: float) -> tuple[bytes, dict[str, float]]:
    """SegmentResult -> response JSON bytes (masks encoded here, on a pool thread) and the final timings (ms)."""
    t_encode = time.perf_counter()
    prompts = []
    for pr in result.prompts:
        masks = encode_instances(pr.instances, mask_format)  # from the bit-packed masks, no bool [H, W] images
        prompts.append(PromptOut(prompt=pr.prompt, instances=[
            InstanceOut(score=i.score, box=list(i.box), area=i.area, mask=m)
            for i, m in zip(pr.instances, masks)
        ]))
    now = time.perf_counter()
    timings = dict(result.timings_ms, encode=round((now - t_encode) * 1000, 3), total=round((now - t0) * 1000, 3))
    response = SegmentResponse(width=result.width, height=result.height, mask_format=mask_format, prompts=prompts,
                               timings_ms=Timings(**timings), random_weights=result.random_weights)
    return response.model_dump_json().encode(), timings


def _error(exc: Exception) -> tuple[int, str, str, dict[str, str]]:
    """Exception -> (status, code, message, headers): the one table (sammie/api.py documents it)."""
    if isinstance(exc, (ApiError, BadRequest)):
        return BAD_REQUEST_STATUS.get(exc.code, 422), exc.code, exc.message, {}
    if isinstance(exc, Overloaded):
        return 503, "overloaded", str(exc), {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    if isinstance(exc, NotReady):
        return 503, "not_ready", str(exc), {"Retry-After": "5"}
    if isinstance(exc, DeadlineExceeded):
        return 504, "deadline_exceeded", str(exc), {}
    if isinstance(exc, Cancelled):
        return 499, "cancelled", str(exc), {}
    if isinstance(exc, RunFailed):
        log.error("inference failed: %s", exc, exc_info=exc.__cause__)
        return 500, "internal_error", "the model failed on this request's batch (see the server log)", {}
    log.exception("unhandled error")
    return 500, "internal_error", f"internal error ({type(exc).__name__})", {}


@serve.deployment(
    name="Sammie",
    max_ongoing_requests=32,  # >= a few image batches in flight; YAML overrides (serve_configs/)
    ray_actor_options={"num_cpus": 1},
    logging_config={"enable_access_log": False},
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=65,  # > the default request_timeout_s: admitted requests get their answer
)
@serve.ingress(app)
class SammieServer:
    async def __init__(self, cfg: EngineConfig):
        # Ray marks the replica RUNNING only when this returns: no traffic reaches it before warm-up is done.
        self.engine = await asyncio.to_thread(SammieEngine, cfg)  # loading weights: seconds, off the loop
        await self.engine.start()
        self.metrics = _Metrics(max(cfg.max_image_batch, cfg.max_pair_batch))
        self.engine.scheduler.stats.on_batch.append(self.metrics.on_batch)

    async def __del__(self):
        """Ray calls this on shutdown after in-flight requests finished (graceful_shutdown_*): stop the engine."""
        engine = getattr(self, "engine", None)  # absent if __init__ failed
        if engine is not None:
            await engine.aclose()

    async def check_health(self) -> None:
        """Ray calls this every health_check_period_s; raising gets the replica restarted."""
        if not self.engine.alive:
            raise RuntimeError("the engine's batch loop has stopped")
        await self.engine.offload(self.engine.ping)  # a tiny op on the model's device: catches a wedged GPU

    @app.get("/healthz", summary="liveness")
    async def healthz(self) -> Response:
        alive = self.engine.alive
        return JSONResponse({"alive": alive}, status_code=200 if alive else 503)

    @app.get("/readyz", summary="readiness", response_model=ReadyResponse, responses={503: {"model": ReadyResponse}})
    async def readyz(self) -> Response:
        """503 while not ready. Ray routes nothing to a replica before __init__ (weights + warm-up) returns, so
        through Ray a 503 here means shutting down or a dead batch loop; the body has the engine's health."""
        health = self.engine.health()
        body = ReadyResponse(ready=health["ready"], random_weights=health["random_weights"], engine=health)
        return Response(body.model_dump_json(), status_code=200 if health["ready"] else 503,
                        media_type="application/json")

    @app.post("/v1/segment", summary="segment an image with text prompts", response_model=SegmentResponse,
              responses=_ERRORS, openapi_extra=openapi_request_body())
    async def segment(self, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            content_type = request.headers.get("content-type", "")
            check_media_type(content_type)  # 415 and 503 before reading the body
            self.engine.check_admission()
            body = await _read_body(request, self.engine.cfg.max_body_bytes)
            parsed = await self.engine.offload(parse_body, content_type, body, request.scope["query_string"])
            opts = parsed.options
            result = await self.engine.segment(parsed.image, parsed.prompts, opts.threshold, opts.max_instances,
                                               opts.timeout_s)
            payload, timings = await self.engine.offload(_render, result, opts.mask_format, t0)
        except asyncio.CancelledError:  # client gone or Ray's timeout: the engine already dropped the work
            self.metrics.on_request(499, "cancelled", None)
            raise
        except Exception as exc:
            status, code, message, headers = _error(exc)
            self.metrics.on_request(status, code, None)
            return Response(error_body(code, message), status_code=status, headers=headers,
                            media_type="application/json")
        self.metrics.on_request(200, "ok", timings)
        return Response(payload, media_type="application/json")


def build_app(args: dict) -> Application:
    """The Serve application for `args` (EngineConfig fields; unknown keys raise ValueError listing valid ones).

    `serve run serve_configs/local.yaml` calls this with the YAML's `args:` (Ray requires exactly one parameter).
    """
    return make_app(EngineConfig.from_dict(args))


def make_app(cfg: EngineConfig, **deployment_options) -> Application:
    """`build_app` with a ready EngineConfig and `@serve.deployment` overrides (e.g. `ray_actor_options=
    {"num_gpus": 1}` from `python -m sammie serve`); a YAML's `deployments:` section overrides both."""
    deployment = SammieServer.options(**deployment_options) if deployment_options else SammieServer
    return deployment.bind(cfg)
