"""The OpenAI-compatible wire format: request models and their validation, response bodies, SSE framing, stop-string
handling and the error table. No Ray and no model here; `qwen_engine/serve.py` wires these to `QwenEngine`.

Routes (OpenAI's shapes; https://platform.openai.com/docs/api-reference):

    POST /v1/completions        CompletionRequest      -> text_completion (or SSE chunks of it)
    POST /v1/chat/completions   ChatCompletionRequest  -> chat.completion (or SSE chat.completion.chunk)
    GET  /v1/models             the one served model

Streaming (`"stream": true`): `text/event-stream`, one `data: {json}\\n\\n` event per chunk, ended by
`data: [DONE]\\n\\n`. With `stream_options.include_usage`, every chunk carries `"usage": null` and one last chunk
before `[DONE]` has empty `choices` and the request's usage. An error after the first byte was sent arrives as a
`data: {"error": {...}}` event, then `[DONE]`.

Errors are `{"error": {"message", "type", "param", "code"}}`:

| status | when | code(s) |
|---|---|---|
| 400 | body not JSON / not an object / nested too deeply | invalid_json |
| 400 | a field missing, mistyped, out of range or unknown | missing_field, invalid_request, unknown_parameter |
| 400 | an option not implemented here (best_of, suffix, tools, ...) | unsupported_parameter |
| 400 | messages empty, a role other than system/user/assistant, a system message not first | invalid_messages |
| 400 | prompt (+ max_tokens) longer than the context | context_length_exceeded |
| 404 | `model` is not the served model | model_not_found |
| 413 | body over `max_body_bytes` | body_too_large |
| 499 | the client went away (nobody reads it) | cancelled |
| 500 | the model failed (logged) | internal_error |
| 503 | engine full (`Retry-After` set), starting or stopping (or stopped mid-request) | overloaded, not_ready |
| 504 | no answer within the deadline (`timeout_s`, default the engine's `request_timeout_s`) | deadline_exceeded |

A null option (`"temperature": null`, as OpenAI's API allows) asks for its default; a chat message's null fields
(`"refusal": null`, `"tool_calls": null` in a replayed reply) are ignored. Temperatures below 1e-5 are greedy.

Extensions beyond OpenAI (as vLLM names them): `top_k` (0 or -1 = off), `ignore_eos`, `stop_token_ids`,
`skip_special_tokens`, `chat_template_kwargs` (e.g. `{"enable_thinking": false}`), `timeout_s`.

Log-probabilities: `/v1/completions` `"logprobs": N` (0-20), `/v1/chat/completions` `"logprobs": true` with
`"top_logprobs": N` (0-20). Natural logs of the model's own next-token distribution (fp32 log-softmax of the logits,
before temperature / top-k / top-p, as OpenAI and vLLM report them), for every output token up to the one that
completes a stop string; a terminating eos / stop token id is left out, as its text is (with echo it keeps its
entry: below). Completions answer OpenAI's legacy object (`tokens`, `token_logprobs`, `top_logprobs`: the N most
likely and the sampled token as {token: logprob}, `text_offset`: characters of the completion before each token; a
token that is not whole UTF-8 characters is named `bytes:\\xNN...`), chat answers `{"content": [{token, logprob,
bytes, top_logprobs (the N most likely)}], "refusal": null}` (a token's string there is its bytes decoded with
U+FFFD for a partial character; `bytes` has them exactly). Streamed chunks carry the entries of the tokens whose
text they carry. A long answer's log-probabilities are built off the event loop (up to 16 choices x 20 alternatives
x the context's tokens).

Echo (`/v1/completions` `"echo": true`): each choice's text starts with the prompt as the model reads it (its tokens
decoded, control tokens kept: a text prompt comes back as given unless the tokenizer normalised it). With
`"logprobs": N` the log-probabilities start with the prompt's tokens too: the first has none (`null` logprob and top
entry, as OpenAI answers), each later one its log-probability given the tokens before it
(`SamplingParams.prompt_logprobs`: the engine keeps the logits of every prompt position, in chunks of at most
`PROMPT_LOGPROBS_CHUNK` positions a step, so such a prompt's first token comes later), and `text_offset` counts from
the start of the echoed text; a terminating eos / stop token keeps its entry there (its text stays out), so the
entries are one per prompt token and one per sampled token, as evaluation harnesses index them (lm-eval sums
`token_logprobs[ctxlen:-1]` of an echo with max_tokens 1). `"max_tokens": 0` is allowed with echo only: the prompt
scored, nothing generated (finish_reason "length", 0 completion tokens) -- what evaluation harnesses send for
log-likelihoods. Stop strings apply to the completion only.

Penalties: `presence_penalty` / `frequency_penalty` in [-2, 2], as OpenAI defines them over the output so far (not
the prompt), applied before temperature / top-k / top-p (greedy requests too); the engine keeps each penalized
request's output-token counts on the device.

Logit bias: `logit_bias` maps token ids (as strings: `{"13": -100}`) to a bias in [-100, 100] added to that token's
logit before sampling (greedy requests too; -100 bans a token in effect, 100 forces it), at most 300 ids, each in
the vocabulary. The reported log-probabilities stay the model's own, before the bias.

Several choices (`"n": 2`-16): n independent generations of each prompt, each its own engine sequence (the
prompt is prefilled n times: no prefix sharing), answered as choices 0..n-1; streamed, each chunk names its choice
(`index`) and chunks of different choices interleave as they are sampled. With a `seed`, choice i samples with seed
+ i, so choice 0 is the answer the same request with n = 1 gets. Usage counts the prompt once and every choice's
completion tokens. n is at most `MAX_CHOICES` and the engine's `max_queued` and `max_num_seqs` (more choices than
resident sequences would wait for whole generations of the others); the first byte waits for every choice's first
token.

Several prompts (`/v1/completions` with `"prompt"` a list of texts or of token-id lists, as OpenAI's API and lm-eval's
batched `local-completions` send them): one request, each prompt's n choices answered as choices k n .. k n + n - 1
(prompt k), every prompt checked before any runs (an error names the prompt's index); usage counts each prompt once.
The prompts' choices together count against the same limit as n (`max_queued`, `max_num_seqs`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine_core.continuous import MAX_LOGPROBS, SamplingParams, TokenLogprobs, logit_bias_pairs
from qwen_engine.chat_template import ChatMessage

MAX_STOP_STRINGS = 16
MAX_CHOICES = 16  # `n`: each choice is an engine sequence (a full-size engine batches 32-64)
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """An error the HTTP layer answers directly, in OpenAI's shape."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        super().__init__(f"{code}: {message}")


def error_type(status: int) -> str:
    """OpenAI's `error.type` for a status."""
    if status == 404:
        return "not_found_error"
    if status < 500:
        return "invalid_request_error"
    if status in (503, 504):
        return "service_unavailable_error"
    return "server_error"


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type(status), "param": param,
                                 "code": code}}).encode()


# --------------------------------------------------------------------------------------------------------------
# Requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


def drop_nulls(model: type[BaseModel], data: Any) -> Any:
    """OpenAI's API marks its options nullable, and clients send them so (`"temperature": null`; a chat history
    replayed from responses carries `"refusal": null`, `"tool_calls": null`): a null asks for the default, or for
    nothing, so its key is dropped before validation -- known or not. A required field's null stays (its error)."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items() if v is not None or (k in fields and fields[k].is_required())}


class _SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are refused (a misspelled option would otherwise be ignored)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        return drop_nulls(cls, data)

    model: str = Field(..., description="the served model name (GET /v1/models)")
    max_tokens: int | None = Field(None, description="completion tokens at most; prompt + max_tokens must fit "
                                                     "the context")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=2**31 - 1,
                       description="extension: keep the k most likely tokens; 0 or -1 = off")
    seed: int | None = Field(None, description="fixes the sampling of this request")
    stop: str | list[str] | None = Field(None, description="up to 16 strings; the output ends before the first one")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="independent choices, each its own sequence")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logprobs: Any = Field(None, description="completions: 0-20 most likely tokens' log-probabilities per output "
                                           "token; chat: true / false (`requested_logprobs`)")
    top_logprobs: int | None = Field(None, description="chat, with logprobs true: 0-20 most likely tokens")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted from the logit of every token "
                                                                     "the output already holds")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="subtracted once per time the output holds "
                                                                       "the token")
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string) -> bias in [-100, 100] "
                                                                 "added to its logit; at most 300 ids")
    # extensions
    ignore_eos: bool = Field(False, description="extension: do not stop at <|im_end|> / <|endoftext|>")
    stop_token_ids: list[int] | None = Field(None, description="extension: more token ids that end the output")
    skip_special_tokens: bool = Field(True, description="extension: leave <|...|> control tokens out of the text")
    timeout_s: float | None = Field(None, gt=0.0, description="extension: deadline in seconds")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text or token ids; or a batch: a list of texts or of token-id lists")
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_means_absent(cls, data: Any) -> Any:
        return drop_nulls(cls, data)

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[Message] = Field(..., description="the conversation, oldest first")
    max_completion_tokens: int | None = Field(None, description="OpenAI's newer name for max_tokens")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description='extension: e.g. {"enable_thinking": '
                                                                          'false}')
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def parse_request(body: bytes, kind: type[BaseModel]) -> BaseModel:
    """Body bytes -> a request model, or ApiError 400 naming the first problems."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"the body is not valid JSON ({exc})") from None
    except RecursionError:  # arrays / objects nested deeper than the parser's stack: a client error, not a 500
        raise ApiError(400, "invalid_json", "the body's JSON is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_json", f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        param = ".".join(str(x) for x in first.get("loc", ())) or None
        code = {"missing": "missing_field", "extra_forbidden": "unknown_parameter"}.get(first["type"],
                                                                                        "invalid_request")
        raise ApiError(400, code, _describe(errors), param) from None


def _describe(errors: list[dict]) -> str:
    parts = []
    for e in errors[:5]:
        where = ".".join(str(x) for x in e.get("loc", ())) or "body"
        msg = "unrecognized request argument" if e["type"] == "extra_forbidden" else e["msg"]
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)


def check_unsupported(req: _SamplingFields) -> None:
    """Refuse options this server does not implement, unless they ask for the default."""
    def refuse(param: str, why: str):
        raise ApiError(400, "unsupported_parameter", f"{param}: {why}", param)

    if req.stream_options is not None and not req.stream:
        refuse("stream_options", "only allowed with stream: true")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            refuse("suffix", "suffix (fill-in-the-middle) is not supported")
        if req.best_of not in (None, 1):
            refuse("best_of", f"only best_of=1 is supported, got {req.best_of}")
    if isinstance(req, ChatCompletionRequest):
        if req.tools or req.tool_choice not in (None, "none"):
            refuse("tools", "tool calling is not supported")
        if req.response_format and req.response_format.get("type") != "text":
            refuse("response_format", "only {\"type\": \"text\"} is supported")
        if req.max_tokens is not None and req.max_completion_tokens is not None:
            refuse("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")


def requested_logprobs(req: _SamplingFields) -> int | None:
    """How many most likely tokens' log-probabilities each output token reports (`SamplingParams.logprobs`), None
    for none: completions' `logprobs` N, chat's `top_logprobs` N (0 when absent) under `logprobs: true`."""
    def bad(param: str, why: str):
        raise ApiError(400, "invalid_request", f"{param}: {why}", param)

    def count(param: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            bad(param, f"must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}")
        return value

    if isinstance(req, ChatCompletionRequest):
        if req.logprobs not in (None, True, False):
            bad("logprobs", f"must be true or false on chat completions (top_logprobs gives the count), got "
                            f"{req.logprobs!r}")
        if req.top_logprobs is not None and not req.logprobs:
            bad("top_logprobs", "needs logprobs: true")
        return (0 if req.top_logprobs is None else count("top_logprobs", req.top_logprobs)) if req.logprobs else None
    if req.top_logprobs is not None:
        bad("top_logprobs", "is a chat completions option; on /v1/completions give logprobs: N")
    if req.logprobs is None or req.logprobs is False:
        return None
    return count("logprobs", req.logprobs)


def requested_logit_bias(req: _SamplingFields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` {"token id": bias} -> `SamplingParams.logit_bias` pairs, or ApiError 400 naming the bad entry.
    Here the keys (decimal token ids of the vocabulary); the count, the biases' range and repeated ids ("7" and
    "007") are `logit_bias_pairs`'s checks, the ones `SamplingParams` applies."""
    def bad(why: str):
        raise ApiError(400, "invalid_request", f"logit_bias: {why}", "logit_bias")

    pairs = []
    for key, value in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            bad(f"keys must be token ids in [0, {vocab_size}) written as strings, got {key!r}")
        pairs.append((int(key), value))
    try:
        return logit_bias_pairs(pairs)
    except ValueError as exc:  # its message names logit_bias
        raise ApiError(400, "invalid_request", str(exc), "logit_bias") from None


def chat_messages(req: ChatCompletionRequest) -> list[ChatMessage]:
    """The request's messages for the template; `developer` is OpenAI's newer name for `system`."""
    if not req.messages:
        raise ApiError(400, "invalid_messages", "messages must hold at least one message", "messages")
    out = []
    for i, m in enumerate(req.messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant"):
            raise ApiError(400, "invalid_messages", f"messages[{i}].role {m.role!r} is not supported; use system, "
                                                    "user or assistant (tool messages are not supported)",
                           f"messages.{i}.role")
        if m.content is None:
            raise ApiError(400, "invalid_messages", f"messages[{i}] has no content", f"messages.{i}.content")
        text = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)
        if role == "system" and i > 0:
            raise ApiError(400, "invalid_messages", f"messages[{i}]: a system message must come first",
                           f"messages.{i}.role")
        out.append(ChatMessage(role, text, m.reasoning_content if role == "assistant" else None))
    return out


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts in order: one (text, or token ids) or a batch (a list of texts, or of token-id lists:
    OpenAI's prompt array). An empty batch or an empty token list is refused here; an empty text, once tokenised."""
    p = req.prompt
    batch = isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))
    prompts = list(p) if batch else [p]
    if isinstance(p, list) and not p:
        raise ApiError(400, "invalid_request", "prompt is empty", "prompt")
    for k, q in enumerate(prompts):
        if isinstance(q, list) and not q:  # the prompt's index where there are several (as `_plan` names them)
            raise ApiError(400, "invalid_request", f"prompt {k} is empty" if len(prompts) > 1 else "prompt is empty",
                           "prompt")
    return prompts


@dataclass(frozen=True)
class GenerationPlan:
    """A validated request, ready for the engine."""

    prompt_token_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    skip_special_tokens: bool
    stream: bool
    include_usage: bool
    timeout_s: float | None
    n: int = 1  # choices
    echo: bool = False  # completions: the prompt starts each choice's text (and its log-probabilities, if asked)
    # max_new_tokens 0 (echo only): score the prompt, generate nothing (the engine still samples one token, dropped)

    def choice_sampling(self, index: int, scored_by_first: bool = False) -> SamplingParams:
        """Choice `index`'s sampling: the request's, its seed (if given) + index (module docstring).
        `scored_by_first`: choice 0 scores an echoed prompt (`prompt_logprobs`) for every choice -- the entries do not
        depend on sampling; the server hands them over, serve.py `_text_stream` --, so the others' prompts prefill as
        any other's."""
        if index == 0:
            return self.sampling
        seed = None if self.sampling.seed is None else self.sampling.seed + index
        prompt_logprobs = None if scored_by_first else self.sampling.prompt_logprobs
        return dataclasses.replace(self.sampling, seed=seed, prompt_logprobs=prompt_logprobs)


def plan_generation(req: _SamplingFields, prompt_ids: list[int], *, max_model_len: int, eos_token_ids: tuple[int, ...],
                    vocab_size: int, default_max_tokens: int | None) -> GenerationPlan:
    """Validate lengths and sampling against the served model; `default_max_tokens` None = what the context has
    left (chat), else that number (completions: OpenAI's 16), cut to what is left."""
    n_prompt = len(prompt_ids)
    if n_prompt == 0:
        raise ApiError(400, "invalid_request", "the prompt is empty (0 tokens)", "prompt")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise ApiError(400, "invalid_request", f"prompt token ids must be in [0, {vocab_size}); got {bad[:5]}",
                       "prompt")
    room = max_model_len - n_prompt
    if room < 1:
        raise ApiError(400, "context_length_exceeded", f"this model's maximum context length is {max_model_len} "
                                                       f"tokens; the prompt has {n_prompt} tokens, which leaves no "
                                                       "room for a completion", "messages" if isinstance(
                                                           req, ChatCompletionRequest) else "prompt")
    max_tokens = req.max_tokens
    param = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    echo = isinstance(req, CompletionRequest) and req.echo
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens == 0 and echo:
        pass  # the prompt scored, nothing generated
    elif max_tokens < 1:
        raise ApiError(400, "invalid_request", f"{param} must be at least 1 (0 only with echo), got {max_tokens}",
                       param)
    elif max_tokens > room:
        raise ApiError(400, "context_length_exceeded", f"this model's maximum context length is {max_model_len} "
                                                       f"tokens; you requested {n_prompt + max_tokens} tokens "
                                                       f"({n_prompt} in the prompt, {max_tokens} for the "
                                                       f"completion); lower {param}", param)
    stop = () if req.stop is None else (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if len(stop) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, "invalid_request", f"stop: at most {MAX_STOP_STRINGS} non-empty strings of at most "
                                               f"{MAX_STOP_CHARS} characters", "stop")
    eos = () if req.ignore_eos else tuple(eos_token_ids)
    extra = tuple(req.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in extra):
        raise ApiError(400, "invalid_request", f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    logprobs = requested_logprobs(req)
    sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed,
                              logprobs=logprobs, presence_penalty=req.presence_penalty,
                              frequency_penalty=req.frequency_penalty,
                              logit_bias=requested_logit_bias(req, vocab_size),
                              prompt_logprobs=logprobs if echo else None)
    include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
    return GenerationPlan(tuple(prompt_ids), max_tokens, sampling, tuple(dict.fromkeys(eos + extra)), stop,
                          req.skip_special_tokens, req.stream, include_usage, req.timeout_s, req.n, echo)


# --------------------------------------------------------------------------------------------------------------
# Stop strings


class StopStringFilter:
    """Text deltas in, text deltas out, ending before the first stop string (OpenAI leaves the stop string out).

    A stop string can span deltas, so the tail that could still begin one is held back (at most the longest stop
    string minus one character) until it is ruled out or the stream ends.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self._held = ""
        self.stopped = False  # a stop string was found; nothing more comes out
        self.matched: str | None = None

    def push(self, delta: str) -> str:
        if self.stopped:
            return ""
        if not self.stops:
            return delta
        text = self._held + delta
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, s = min(hits)
            self.stopped, self.matched, self._held = True, s, ""
            return text[:at]
        keep = 0  # longest suffix of text that is a proper prefix of a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), keep, -1):
                if s.startswith(text[-k:]):
                    keep = k
                    break
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out


# --------------------------------------------------------------------------------------------------------------
# Responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def completion_body(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """`choices`: `completion_choice`s, index order."""
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def chat_body(rid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    """`choices`: `chat_choice`s, index order."""
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                     include_usage: bool, logprobs: dict | None = None, index: int = 0) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model,
           "choices": [completion_choice(index, text, finish_reason, logprobs)]}
    if include_usage:
        out["usage"] = None
    return out


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish_reason: str | None,
               include_usage: bool, logprobs: dict | None = None, index: int = 0) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
           "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if include_usage:
        out["usage"] = None
    return out


@dataclass(frozen=True)
class LoggedToken:
    """One token's log-probabilities on their way into a response (an output token's, or with echo a prompt
    token's)."""

    token_id: int
    logprobs: TokenLogprobs | None  # None: the echoed prompt's first token (nothing before it to condition on)
    text_offset: int  # characters of the choice's text (with echo, the prompt's included) before this token's


TokenBytes = Callable[[int], bytes]  # a token id's bytes (`QwenTokenizer.token_bytes`)


def _token_text(token_bytes: TokenBytes, token_id: int) -> str:
    """A completions token string: its UTF-8 text, or OpenAI's `bytes:\\xNN...` form for bytes that are not whole
    UTF-8 characters (part of one; ~660 byte-level ids of the Qwen vocabulary), so distinct byte strings stay distinct
    keys of `top_logprobs`."""
    raw = token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def _top_dict(token_bytes: TokenBytes, t: LoggedToken) -> dict[str, float] | None:
    """One token's completions `top_logprobs` entry: the n most likely and the sampled token (n + 1 entries when it
    is not among them, as OpenAI and vLLM answer); ids with the same string (e.g. empty padding ids) keep the most
    likely one's value. None for an echoed prompt's first token."""
    if t.logprobs is None:
        return None
    out: dict[str, float] = {}
    for i, v in t.logprobs.top:
        out.setdefault(_token_text(token_bytes, i), v)
    out.setdefault(_token_text(token_bytes, t.token_id), t.logprobs.logprob)
    return out


def completion_logprobs(logged: Sequence[LoggedToken], token_bytes: TokenBytes) -> dict:
    """OpenAI's legacy completions `logprobs` object (module docstring)."""
    return {"tokens": [_token_text(token_bytes, t.token_id) for t in logged],
            "token_logprobs": [None if t.logprobs is None else t.logprobs.logprob for t in logged],
            "top_logprobs": [_top_dict(token_bytes, t) for t in logged],
            "text_offset": [t.text_offset for t in logged]}


def chat_logprobs(logged: Sequence[LoggedToken], token_bytes: TokenBytes) -> dict:
    """OpenAI's chat `logprobs` object (module docstring)."""
    def entry(token_id: int, logprob: float) -> dict:
        raw = token_bytes(token_id)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**entry(t.token_id, t.logprobs.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.logprobs.top]} for t in logged],
            "refusal": None}


def usage_chunk(rid: str, created: int, model: str, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models_body(name: str, created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "qwen_engine",
                                        "max_model_len": max_model_len}]}


def sse(obj: dict) -> bytes:
    """One server-sent event: `data: <compact JSON>` and a blank line."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def now_s() -> int:
    return int(time.time())


def prompt_logged(prompt_ids: Sequence[int], logprobs: Sequence[TokenLogprobs], pieces: Sequence[str]
                  ) -> list[LoggedToken]:
    """The echoed prompt's log-probability entries: its first token without any, each later token with its
    `SamplingParams.prompt_logprobs` entry; `pieces[i]` is the text token i adds (`IncrementalDetokenizer`, control
    tokens kept), from which the offsets come."""
    if len(logprobs) != len(prompt_ids) - 1 or len(pieces) != len(prompt_ids):
        raise RuntimeError(f"{len(logprobs)} prompt log-probabilities / {len(pieces)} pieces for a prompt of "
                           f"{len(prompt_ids)} tokens")
    out, offset = [], 0
    for i, token in enumerate(prompt_ids):
        out.append(LoggedToken(token, None if i == 0 else logprobs[i - 1], offset))
        offset += len(pieces[i])
    return out
