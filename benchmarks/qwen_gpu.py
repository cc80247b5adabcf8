"""Issue #5 on the H200: Qwen3.6-35B-A3B with packed NVFP4 / FP8 weights (W4A16 Triton + FP8 `_scaled_mm`), full
size, seeded random weights in the checkpoint's exact formats, generated on the GPU (nothing written to disk).

Measures, in one process (< 9 minutes on an H200, Triton autotuning included):
  (a) single-stream decode tok/s at `--context` (1k) tokens of context;
  (b) time to first token for a `--context`-token prompt (prefill + lm_head of the last token + argmax);
  (c) output tok/s of `--streams` (32) concurrent streams, each with a `--context`-token prompt;
  (d) the oracle: our logits vs transformers' eager bf16 `Qwen3_5MoeForCausalLM` holding the identical dequantised
      weights, on `--oracle-prompts` random prompts: max / RMS relative error, top-1 agreement (teacher-forced), greedy
      agreement over `--greedy-tokens` tokens; ours with the checkpoint's W8A8 FP8 layers and with them weight-only
      (isolating the kernels from the static activation quantisation); then transformers' own TTFT and decode tok/s
      at the settings of (a) and (b) as the baseline.

(a)-(c) use the model's own incremental forward (`QwenForCausalLM.forward` with a contiguous `QwenState`, greedy,
eager PyTorch + registry kernels, no CUDA graphs); (e) repeats (a)-(c) through the serving engine (`QwenEngine`:
CUDA graphs of the decode steps (`decode_graphs` auto), and once more without them for the lone request,
continuous batching, chunked prefill, paged KV, on-device sampling) over the same model. Random token
prompts; speed does not depend on the values, and the oracle is meaningful because both models hold the same values.

Memory plan (H200, 139 GiB): ours ~20.8 GB packed (+ ~1 GB quantiser temporaries while generating) + states (1k
context x 32 streams: KV 1.3 GB, GDN 2 GB) + prefill activations; then transformers' model in bf16, 69.3 GB, filled
from ours one dequantised tensor at a time (peak ~92 GB with both in Qwen run 3; the engine's dual expert layouts
have since grown ours to 34.6 GiB, so ~99 GiB together), after which ours is freed. Where the GPU cannot hold both (an
80 GB H100; --stage-transformers auto), transformers' model is filled in host memory (~70 GB) and moved to the GPU
after ours is freed.

    python benchmarks/qwen_gpu.py --out benchmarks/results/qwen_gpu          # H200
    python benchmarks/qwen_gpu.py --tiny --out /tmp/qwen_tiny                 # CPU dry run, tiny config, < 60 s

Writes qwen_gpu.json (updated after every phase, so a cut-off run keeps what it measured) and qwen_gpu.md.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qwen_engine.checkpoint import hf_text_config  # noqa: E402
from qwen_engine.config import QwenConfig  # noqa: E402
from qwen_engine.load_packed import load_quantized, model_bytes  # noqa: E402
from qwen_engine.model import QwenState  # noqa: E402
from qwen_engine.model.quantized import packed_modules, set_fp8_activation_quantization  # noqa: E402
from engine_core.registry import default_registry  # noqa: E402
from qwen_engine.random_weights import (  # noqa: E402
    calibrate_fp8_input_scales,
    random_packed_tensors,
    to_transformers,
)

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def gib(n: int) -> float:
    return round(n / 2**30, 3)


def new_state(model, batch: int, max_len: int) -> QwenState:
    p = model.embed_tokens.weight  # (the packed lm_head has no .weight for `model.new_state`)
    return QwenState.empty(model.config, batch, max_len, dtype=p.dtype, device=p.device)


@torch.no_grad()
def prefill_then_decode(model, prompt: torch.Tensor, steps: int, warm_steps: int = 0) -> dict:
    """Prefill `prompt` [B, P], then `warm_steps` untimed and `steps` timed one-token greedy steps."""
    dev = prompt.device
    b, p = prompt.shape
    state = new_state(model, b, p + warm_steps + steps + 1)
    sync(dev)
    t = time.perf_counter()
    tok = model(prompt, state, last_only=True)[:, -1].argmax(-1, keepdim=True)
    tok.cpu()  # the first token reaches the host
    ttft = time.perf_counter() - t
    for _ in range(warm_steps):
        tok = model(tok, state)[:, -1].argmax(-1, keepdim=True)
    sync(dev)
    t = time.perf_counter()
    for _ in range(steps):
        tok = model(tok, state)[:, -1].argmax(-1, keepdim=True)
    sync(dev)
    dt = time.perf_counter() - t
    return dict(ttft_s=ttft, decode_s=dt, tok_per_s=b * steps / dt if steps else None)


@torch.no_grad()
def greedy_ours(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    state = new_state(model, ids.shape[0], ids.shape[1] + n)
    out = [model(ids, state, last_only=True)[:, -1].argmax(-1, keepdim=True)]
    for _ in range(n - 1):
        out.append(model(out[-1], state)[:, -1].argmax(-1, keepdim=True))
    return torch.cat(out, 1).cpu()


def _cache_of(out):
    return getattr(out, "past_key_values", None) or getattr(out, "cache", None)


@torch.no_grad()
def hf_prefill_then_decode(hf, prompt: torch.Tensor, steps: int, warm_steps: int = 0) -> tuple[dict, torch.Tensor]:
    dev = prompt.device
    sync(dev)
    t = time.perf_counter()
    out = hf(prompt, use_cache=True, logits_to_keep=1)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    tok.cpu()
    ttft = time.perf_counter() - t
    cache, toks = _cache_of(out), [tok]
    for i in range(warm_steps + steps):
        if i == warm_steps:
            sync(dev)
            t = time.perf_counter()
        out = hf(toks[-1], past_key_values=cache, use_cache=True)
        cache = _cache_of(out)
        toks.append(out.logits[:, -1].argmax(-1, keepdim=True))
    sync(dev)
    dt = time.perf_counter() - t
    return (dict(ttft_s=ttft, decode_s=dt, tok_per_s=prompt.shape[0] * steps / dt if steps else None),
            torch.cat(toks, 1).cpu())


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    d = ours.float() - ref.float()
    return dict(max_rel_err=float(d.abs().max() / ref.float().abs().max()),
                rms_rel_err=float(d.norm() / ref.float().norm()),
                top1_agreement_pct=100.0 * float((ours.argmax(-1) == ref.argmax(-1)).float().mean()))


PROMPT_SEED = 20261201  # the engine phases' prompts (`engine_phase`): the same for every engine of a process


def same_tokens(r: dict) -> None:
    """Each side-by-side engine's greedy tokens against the first engine's (same prompts): r[key]["same_tokens"] =
    {lone: equal, streams: how many of the streams equal}. Equal where the arithmetic is the same (PDL, the router's
    column); an option that changes roundings (b / a outside the prep op, the GEMV's dequant mode) may flip a
    near-tied token of the random weights, after which the sequences diverge."""
    first = r.get("engine") or {}
    lone0, streams0 = (first.get("lone") or {}).get("ids"), (first.get("streams") or {}).get("ids")
    for key, v in r.items():
        if key == "engine" or not key.startswith("engine_") or not isinstance(v, dict) or "lone" not in v:
            continue
        ids = (v.get("streams") or {}).get("ids")
        v["same_tokens"] = dict(lone=lone0 is not None and v["lone"].get("ids") == lone0,
                                streams=None if not (ids and streams0) else sum(a == b for a, b in zip(ids, streams0)))
        if ids and streams0:  # where each differing stream first differs: (stream, token index, first's, this one's)
            v["stream_divergence"] = [  # a stream that is a prefix of the other: (i, shorter length, None, None)
                (i, j, a[j] if j < len(a) else None, b[j] if j < len(b) else None)
                for i, (a, b) in enumerate(zip(streams0, ids)) if a != b
                for j in [next((j for j, (p, q) in enumerate(zip(a, b)) if p != q), min(len(a), len(b)))]]
            log(f"(e) {key}: streams' first differing tokens: {v['stream_divergence'][:12]}")
        log(f"(e) {key}: same greedy tokens as the first engine: {v['same_tokens']}")


def greedy_agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    eq = a == b
    first = [int(row.logical_not().nonzero()[0]) if not row.all() else row.numel() for row in eq]
    return dict(greedy_agreement_pct=100.0 * float(eq.float().mean()), first_divergence=first)


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = [f"# Qwen3.6-35B-A3B packed NVFP4/FP8 ({'tiny config, CPU dry run' if s['tiny'] else 'full size'})", "",
             f"device: {r['env']['device']}; torch {r['env']['torch']}; transformers {r['env'].get('transformers')}; "
             f"{r['env']['path']}", "",
             f"weights: seeded random (seed {s['seed']}) in the checkpoint's formats, generated on the device; "
             f"model holds {r.get('memory', {}).get('model_gib')} GiB", "",
             "| metric | ours (packed W4A16 + FP8) | transformers eager bf16 |", "|---|---|---|"]
    a, b, c = r.get("decode_1stream", {}), r.get("ttft", {}), r.get("decode_streams", {})
    hf = r.get("transformers", {})
    fmt = lambda v, k=1: "-" if v is None else f"{v:.{k}f}"  # noqa: E731

    def side_by_side(v: dict | None, ttft: bool = True, burst: bool = False) -> str:
        """A side-by-side engine's lone decode tok/s / 32-stream tok/s (/ lone TTFT ms) (/ the concurrent requests'
        output tok/s (TTFT p50 / max ms))."""
        v = v or {}
        cells = [v.get("lone", {}).get("decode_tok_per_s"),
                 (v.get("streams", {}).get("decode_phase") or {}).get("tok_per_s")]
        text = " / ".join(fmt(c) for c in cells + ([v.get("lone", {}).get("ttft_ms")] if ttft else []))
        if burst:
            st_v = v.get("streams", {})
            text += (f" / {fmt(st_v.get('output_tok_per_s'))} ({fmt(st_v.get('ttft_p50_ms'))} / "
                     f"{fmt(st_v.get('ttft_max_ms'))}; first tokens = model forward: "
                     f"{st_v.get('first_vs_model_forward')})")
        return text
    lines += [
        f"| (a) decode tok/s, 1 stream, {s['context']} ctx | {fmt(a.get('tok_per_s'))} | {fmt(hf.get('tok_per_s'))} |",
        f"| (b) TTFT ms, {s['context']}-token prompt (median) | {fmt(b.get('median_ms'))} | "
        f"{fmt(hf.get('ttft_ms'))} |",
        f"| (c) output tok/s, {s['streams']} streams, {s['context']} ctx | {fmt(c.get('tok_per_s'))} | - |",
    ]
    e = r.get("engine") or {}
    if e:
        lo, st = e.get("lone", {}), e.get("streams", {})
        lines += [
            f"| (e) engine (decode + prefill graphs {e.get('decode_graphs')}): decode tok/s, lone request, "
            f"{s['context']} ctx | "
            f"{fmt(lo.get('decode_tok_per_s'))} | - |",
            f"| (e) engine: TTFT ms, lone {s['context']}-token request | {fmt(lo.get('ttft_ms'))} | - |",
            f"| (e) engine: output tok/s while all {st.get('n')} streams decode (no prefill in the window) | "
            f"{fmt((st.get('decode_phase') or {}).get('tok_per_s'))} | - |",
            f"| (e) engine without decode graphs: decode tok/s, lone request | "
            f"{fmt((r.get('engine_eager') or {}).get('lone', {}).get('decode_tok_per_s'))} | - |",
            f"| (e) engine without prefill graphs: TTFT ms, lone {s['context']}-token request | "
            f"{fmt((r.get('engine_eager') or {}).get('lone', {}).get('ttft_ms'))} | - |",
            f"| (e) engine without async_decode (decode steps not overlapped): decode tok/s, lone request / all "
            f"{st.get('n')} streams decoding | {side_by_side(r.get('engine_sync'), ttft=False)} | - |",
            f"| (e) engine without shared_expert_in_moe (the default: auto, on with dual_frag): decode tok/s, lone "
            f"request / all {st.get('n')} streams decoding / TTFT ms | {side_by_side(r.get('engine_no_shared'))} | - |",
            f"| (e) engine with the experts in the {(r.get('engine_layout') or {}).get('layout')} layout: decode "
            f"tok/s, lone request / all {st.get('n')} streams decoding / TTFT ms | "
            f"{side_by_side(r.get('engine_layout'))} | - |",
            *(f"| (e) engine with the experts in the {v.get('layout')} layout and the <= 4-token calls split "
              f"{v.get('split')} (gate_up, down): decode tok/s, lone request / all {st.get('n')} streams decoding / "
              f"TTFT ms | {side_by_side(v)} | - |" for key, v in r.items() if key.startswith("engine_layout_split")),
            *(f"| (e) engine without {w.get('without')}: decode tok/s, lone request / all {st.get('n')} streams "
              f"decoding / TTFT ms | {side_by_side(w)} | - |"
              for key, w in r.items() if key.startswith("engine_without")),
            f"| (e) engine with q/k/v and in_proj_qkv/z unfused (separate FP8 calls): decode tok/s, lone request / "
            f"all {st.get('n')} streams decoding / TTFT ms | {side_by_side(r.get('engine_unfused'))} | - |",
            f"| (e) engine with the W4A16 GEMV's dequant mode {(r.get('engine_gemv_deq') or {}).get('deq')} (default "
            f"3, DEQ_WIDE): decode tok/s, lone request / all {st.get('n')} streams decoding / TTFT ms | "
            f"{side_by_side(r.get('engine_gemv_deq'))} | - |",
            f"| (e) engine with max_num_batched_tokens "
            f"{((r.get('engine_batched_tokens') or {}).get('options') or {}).get('batched_tokens')}"
            f" (the first's: max(2048, context)): decode tok/s, lone request / all {st.get('n')} streams decoding / "
            f"TTFT ms / {st.get('n')} concurrent requests' output tok/s (TTFT p50 / max ms) | "
            f"{side_by_side(r.get('engine_batched_tokens'), burst=True)} | - |",
            f"| (e) engine without quant_in_producers (each FP8 projection launches its own activation quantiser; "
            f"the default: on): decode tok/s, lone request / all {st.get('n')} streams decoding / TTFT ms | "
            f"{side_by_side(r.get('engine_no_quant_producers'))} | - |",
            f"| (e) engine with moe_fused_decode (a one-token decode step's routed + shared experts in one launch "
            f"per layer; the default: off): decode tok/s, lone request / all {st.get('n')} streams decoding / "
            f"TTFT ms | {side_by_side(r.get('engine_moe_fused_decode'))} | - |",
            f"| (e) engine with lm_head_layout checkpoint (the tensor-core decode GEMV at one row, the dense "
            f"tensor-core kernel above; the default: auto, dual_frag on Hopper: that GEMV on a checkpoint-layout copy "
            f"at <= 4 rows, the swap-AB kernel on fragment-order bytes above): decode tok/s, lone request / "
            f"all {st.get('n')} streams decoding / TTFT ms | {side_by_side(r.get('engine_lm_head_checkpoint'))} | - |",
            f"| (e) engine with in_proj_b / in_proj_a as their own GEMM (not inside the GDN prep op): decode tok/s, "
            f"lone request / all {st.get('n')} streams decoding / TTFT ms | "
            f"{side_by_side(r.get('engine_no_fused_ba'))} | - |",
            f"| (e) engine with the paged attention's lone-sequence tiles at every batch (~1 program an SM at 8 warps; "
            f"the default: ~2 an SM at 4 warps from 8 programs, ~3 from 24): decode tok/s, lone "
            f"request / all {st.get('n')} streams decoding / TTFT ms | {side_by_side(r.get('engine_attn_lone_tiles'))} "
            f"| - |",
            f"| (e) engine with the paged attention's lone-sequence tiles below 24 programs (~1 program an SM at 8 "
            f"warps; the default: ~2 an SM at 4 warps from 8 programs): decode tok/s, lone request / all "
            f"{st.get('n')} streams decoding / TTFT ms | {side_by_side(r.get('engine_attn_few_lone'))} | - |",
            f"| (e) engine with the shared pair's routing column by torch.cat + fill (not inside router_topk): decode "
            f"tok/s, lone request / all {st.get('n')} streams decoding / TTFT ms | "
            f"{side_by_side(r.get('engine_router_cat'))} | - |",
            f"| (e) engine without programmatic_launch (PDL; the default: auto, on for Hopper): decode tok/s, lone "
            f"request / all {st.get('n')} streams decoding / TTFT ms | {side_by_side(r.get('engine_no_pdl'))} | - |",
            f"| (e) the first engine's settings again, last in the process (--again: order effects): decode tok/s, "
            f"lone request / all {st.get('n')} streams decoding / TTFT ms / {st.get('n')} concurrent requests' output "
            f"tok/s (TTFT p50 / max ms) | {side_by_side(r.get('engine_again'), burst=True)} | - |",
            f"| (e) engine start-up s (warm-up, self-checks, graph captures; prefill buckets "
            f"{e.get('prefill_buckets')}) | {fmt(e.get('start_s'))} | - |",
            f"| (e) engine: output tok/s, {st.get('n')} concurrent requests of {st.get('tokens_each')} tokens (TTFT "
            f"p50 / max ms); first tokens equal to the model's own forward | {fmt(st.get('output_tok_per_s'))} "
            f"({fmt(st.get('ttft_p50_ms'), 0)} / {fmt(st.get('ttft_max_ms'), 0)}); "
            f"{st.get('first_vs_model_forward')} of {st.get('n')} | - |",
        ]
        if s.get("base_engine_options"):
            lines.append(f"| (e) the first engine's options (--base) | {json.dumps(s['base_engine_options'])} | - |")
        for key in sorted(k for k in r if k.startswith("engine_v_")):  # --variant engines
            v = r[key] or {}
            lines.append(f"| (e) engine {key[len('engine_v_'):]} ({json.dumps(v.get('options'))}): decode tok/s, lone "
                         f"request / all {st.get('n')} streams decoding / TTFT ms / {st.get('n')} concurrent requests' "
                         f"output tok/s (TTFT p50 / max ms); same greedy tokens (lone, streams) "
                         f"| {side_by_side(v, burst=True)}; {v.get('same_tokens')} | - |")
    o = r.get("oracle", {})
    for mode in ("w8a8", "fp8_weight_only"):
        m = o.get(mode)
        if m:
            lines.append(f"| (d) oracle [{mode}]: max rel err / RMS rel err / top-1 % | "
                         f"{m['max_rel_err']:.3g} / {m['rms_rel_err']:.3g} / {m['top1_agreement_pct']:.1f} | ref |")
    if "fp32_full_width" in o:
        m = o["fp32_full_width"]
        lines.append(f"| (d) oracle fp32, full width, {m['layers']} layers: max rel err / RMS rel err / top-1 % | "
                     f"{m['max_rel_err']:.3g} / {m['rms_rel_err']:.3g} / {m['top1_agreement_pct']:.1f} | ref (fp32) |")
    if "greedy" in o:
        g = o["greedy"]
        lines.append(f"| (d) greedy agreement over {s['greedy_tokens']} tokens % (first divergence) | "
                     f"{g['greedy_agreement_pct']:.1f} ({g['first_divergence']}) | ref |")
    for name, m in (r.get("bisect") or {}).items():
        lines.append(f"| (d) bisect {name}: max rel err / RMS rel err / top-1 % | "
                     f"{m['max_rel_err']:.3g} / {m['rms_rel_err']:.3g} / {m['top1_agreement_pct']:.1f} | |")
    if r.get("errors"):
        lines += ["", "errors:"] + [f"- {e}" for e in r["errors"]]
    return "\n".join(lines) + "\n"


@contextmanager
def reference_kernels():
    """Every registry op on its plain reference inside (exact dequantisation, the expert loop: the oracle's fp32
    path), each op's own preference back afterwards."""
    registry = default_registry()
    before = {op: registry.preference(op) for op in registry.ops()}  # set_preference(p) sets every op
    try:
        registry.set_preference("reference")
        yield registry
    finally:
        for op, pref in before.items():
            registry.set_preference(pref, op)


def fp32_models(base: QwenConfig, layers: int, device, seed: int):
    """(cfg, ours, transformers') for the fp32 oracle: `base` cut to `layers` layers, our packed model in fp32 from
    seeded random tensors (FP8 layers weight-only) and transformers' fp32 `Qwen3_5MoeForCausalLM` (eager attention)
    holding the identical dequantised weights (built on the meta device, `empty_transformers`, then filled)."""
    import dataclasses

    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from qwen_engine.config import default_layer_types

    cfg = dataclasses.replace(base, num_hidden_layers=layers, layer_types=default_layer_types(layers))
    model = load_quantized(random_packed_tensors(cfg, device, seed=seed, dtype=torch.float32), cfg, device,
                           torch.float32)
    set_fp8_activation_quantization(model, False)
    hf_cfg = Qwen3_5MoeTextConfig.from_dict(hf_text_config(cfg))
    hf_cfg._attn_implementation = "eager"
    with torch.device("meta"):
        hf = Qwen3_5MoeForCausalLM(hf_cfg).eval().float()
    hf = empty_transformers(hf, torch.device(device))
    to_transformers(model, hf)
    return cfg, model, hf


@torch.no_grad()
def fp32_oracle(base: QwenConfig, layers: int, device, seed: int, prompts: int = 2, tokens: int = 32) -> dict:
    """The exactness check the chaotic full-depth bf16 comparison cannot give: at full width (hidden 2048, 256
    experts, vocab 248k, every layer shape of the real model) but `layers` deep, our packed model in fp32 (the
    registry's references: exact dequantisation, FP8 layers weight-only) against transformers' fp32
    Qwen3_5MoeForCausalLM holding the identical dequantised weights. 40 layers in fp32 would need 140 GB."""
    cfg, model, hf = fp32_models(base, layers, device, seed)
    g = torch.Generator().manual_seed(seed + 2)
    ids = torch.randint(0, cfg.vocab_size, (prompts, tokens), generator=g).to(device)
    with reference_kernels():
        ours = model(ids).cpu()
    del model
    ref = hf(ids).logits.float().cpu()
    del hf
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dict(layers=layers, prompts=prompts, tokens=tokens, **compare_logits(ours, ref))


HF_MODULE = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"


def block_gdn_kernels() -> str | None:
    """Make fla and causal_conv1d unimportable from here on, so that transformers' Qwen3.5/3.6 model module, imported
    after this, binds its pure-torch Gated DeltaNet code: where fla imports, transformers takes fla's chunk kernel,
    whose Triton dots are not fp32 (the 8-layer fp32 oracle: max relative error 0.196 with it against 4.06e-6 with
    the torch code, H100, benchmarks/qwen_fp32_oracle.py, fifty-fourth session). Modules already imported (our
    engine's fla prefill) keep working. Returns why it is too late (that module already imported), else None."""
    for name in ("fla", "causal_conv1d"):
        sys.modules[name] = None  # `import fla` now raises ImportError
    if HF_MODULE in sys.modules:
        return f"{HF_MODULE} was imported before fla was blocked: its GDN may run fla's kernels"
    return None


def transformers_stage(setting: str, hf_meta: torch.nn.Module, device: torch.device) -> str:
    """Where transformers' model is filled (--stage-transformers): "device", or "cpu" (then moved to the device once
    ours is freed); "auto" picks "cpu" on a CUDA device whose free memory is short of the model's bytes + 8 GiB (our
    model still lives there while it is filled: an 80 GB H100 holds one of the two, not both)."""
    if setting != "auto":
        return setting
    if device.type != "cuda":
        return "device"
    need = sum(p.numel() * p.element_size() for p in hf_meta.parameters()) + (8 << 30)
    return "cpu" if torch.cuda.mem_get_info(device)[0] < need else "device"


def empty_transformers(hf_meta: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """transformers' model built on the meta device, given uninitialised storage on `device` (no random init of 35B
    parameters: `to_transformers` then writes every parameter, and says so if one is left), its rotary embedding's
    buffers (the only buffers; computed from the config, not stored) rebuilt there. Raises if the model has other
    buffers (a transformers version whose buffers this does not know)."""
    rotary = hf_meta.model.rotary_emb
    others = [n for n, _ in hf_meta.named_buffers() if not n.startswith("model.rotary_emb.")]
    if others:
        raise ValueError(f"empty_transformers: buffers other than the rotary embedding's: {others[:5]}")
    hf = hf_meta.to_empty(device=device)
    with torch.device(device):
        hf.model.rotary_emb = type(rotary)(config=hf.config)
    return hf


AUTOTUNE_TABLE = "off"  # the engines' autotune_table (--autotune-table)
AUTOTUNE_FOREIGN = False  # load AUTOTUNE_TABLE whatever GPU model it names (--autotune-foreign)
WARMUP_BURST = False  # the engines' warmup_burst (--warmup-burst)


async def engine_phase(model, cfg, device, ctx: int, steps: int, streams: int, rand,
                       decode_graphs: str = "auto", lone_only: bool = False, prefill_graphs: str = "auto",
                       async_decode: bool | None = None, shared_expert_in_moe: bool | str = "auto",
                       prefill_buckets: tuple = (), programmatic_launch: bool | str = "auto",
                       quant_in_producers: bool = True, batched_tokens: int | None = None,
                       moe_fused_decode: bool = False, lm_head_layout: str = "auto",
                       shared_expert_stream: bool = True, gdn_z_stream: bool = False,
                       combine_next_norm: bool = True, gdn_prep_tiling: list | None = None,
                       shared_expert_after_router: bool = True, weight_prefetch: str = "off",
                       gdn_decode_norm: bool = False, small_batch_tokens: int = 4,
                       gdn_prep_split_v_rows: int | None = None,
                       argmax_kernel: bool | None = None, attn_gate_in_combine: bool | None = None,
                       picks: list | None = None, gdn_state_dtype: str = "float32",
                       expert_regs: bool | str | None = None, router_align: bool | str | None = None,
                       early_loads: bool | None = None, router_parts: bool | None = None,
                       lone_prefill: bool | str | None = None, kv_cache_dtype: str | None = None,
                       router_align_gather: bool | None = None, regs_builds: dict | None = None) -> dict:
    """QwenEngine over the already-built model: a lone 1k-token request (TTFT = first chunk, then decode tok/s), then
    `streams` concurrent requests (output tok/s over the whole batch, TTFT p50/max). Greedy, no stop tokens.
    gdn_prep_tiling: [BA_FIRST, BA_BLOCK_H, NUM_WARPS] of kernels/gdn_prep.py's launch for this engine (process-wide
    module settings, restored after; benchmarks/gdn_prep_bench.py times them per call). small_batch_tokens: set on
    the shared model by every engine (default the loader's 4: an earlier variant's value must not carry over).
    regs_builds: w4a16_regs.BLOCK_M and ENGINE_BUILDS for this engine only (--regs-builds' form; read at each
    launch, so set from the engine's start to its close and put back after, like the module flags).
    picks: autotune picks for this engine only (`kernels/autotune_table.override`: [{"kernel", "key" prefix,
    "config"}]), put back after it; the engines' other options left None take QwenEngineConfig's defaults."""
    from engine_core.continuous import SamplingParams
    from qwen_engine.engine import QwenEngine, QwenEngineConfig

    ecfg = QwenEngineConfig(config="tiny" if cfg.num_hidden_layers < 8 else "qwen3.6-35b-a3b", device=str(device),
                            dtype="bf16", max_num_seqs=max(streams, 1),
                            max_num_batched_tokens=batched_tokens or max(2048, ctx),
                            block_size=16, num_kv_blocks=(streams + 1) * ((ctx + steps + 64) // 16 + 1),
                            max_model_len=ctx + steps + 64, max_queued=4 * streams, request_timeout_s=None,
                            warmup=True, decode_graphs=decode_graphs, prefill_graphs=prefill_graphs,
                            autotune_table=AUTOTUNE_TABLE,  # default off: tune afresh, the dumped picks are this run's
                            shared_expert_in_moe=shared_expert_in_moe, programmatic_launch=programmatic_launch,
                            quant_in_producers=quant_in_producers, warmup_burst=WARMUP_BURST,
                            moe_fused_decode=moe_fused_decode, lm_head_layout=lm_head_layout,
                            shared_expert_stream=shared_expert_stream, gdn_z_stream=gdn_z_stream,
                            combine_next_norm=combine_next_norm,
                            **({} if gdn_prep_tiling is None else dict(gdn_prep_ba_step=int(gdn_prep_tiling[1]))),
                            shared_expert_after_router=shared_expert_after_router, weight_prefetch=weight_prefetch,
                            gdn_decode_norm=gdn_decode_norm, small_batch_tokens=small_batch_tokens,
                            gdn_state_dtype=gdn_state_dtype,
                            **{k: v for k, v in dict(argmax_kernel=argmax_kernel,  # None: the config's default
                                                     expert_regs=expert_regs, router_align=router_align,
                                                     early_loads=early_loads, router_parts=router_parts,
                                                     attn_gate_in_combine=attn_gate_in_combine,
                                                     async_decode=async_decode, lone_prefill=lone_prefill,
                                                     kv_cache_dtype=kv_cache_dtype,
                                                     router_align_gather=router_align_gather,
                                                     gdn_prep_split_v_rows=gdn_prep_split_v_rows).items()
                               if v is not None},
                            prefill_buckets=tuple(prefill_buckets))
    from kernels import autotune_table

    replaced = autotune_table.override(picks) if picks else {}
    try:  # the process-wide settings inside: a failure anywhere puts them back
        if regs_builds is not None:
            _set_regs_builds(regs_builds)
        if gdn_prep_tiling is not None:
            from kernels import gdn_prep

            gdn_prep.BA_FIRST, gdn_prep.BA_BLOCK_H, gdn_prep.NUM_WARPS = bool(gdn_prep_tiling[0]), *map(
                int, gdn_prep_tiling[1:])
        engine = QwenEngine(ecfg, model=model)
        t_start = time.perf_counter()
        await engine.start()  # warm-up, kernel self-checks, graph captures (compile + autotune when the cache is cold)
    except BaseException:
        _engine_settings_off(model)  # a failed start must not leave them on for the rest of the process
        autotune_table.restore(replaced)
        raise
    start_s = time.perf_counter() - t_start
    pdl_on = engine.health().get("programmatic_launch")
    # the mode in force, and how many launches took it (process-wide counts, since import: compare engines' values)
    prefetch_on = dict(mode=engine.health().get("weight_prefetch"),
                       launches=engine.health().get("weight_prefetch_launches"))

    async def one(ids: list[int], n: int) -> dict:
        t0 = time.perf_counter()
        first, count, arrivals, out = None, 0, [], []
        async for chunk in engine.generate(ids, max_new_tokens=n, sampling=SamplingParams(), eos_token_ids=()):
            now = time.perf_counter()
            if first is None and chunk.new_token_ids:
                first = now
            count += len(chunk.new_token_ids)
            out.extend(chunk.new_token_ids)
            arrivals.append((now, len(chunk.new_token_ids)))
        end = time.perf_counter()
        return dict(ttft_s=first - t0, total_s=end - t0, tokens=count, decode_tok_per_s=(count - 1) / (end - first),
                    first=first, end=end, arrivals=arrivals, ids=out)

    def decode_phase(many: list[dict]) -> dict:
        """Output tok/s while every stream is decoding: from the last stream's first token to the first stream's
        end (no prefill in those steps), over the tokens that arrived in that window."""
        lo, hi = max(m["first"] for m in many), min(m["end"] for m in many)
        toks = sum(k for m in many for t, k in m["arrivals"] if lo < t <= hi)
        return dict(tok_per_s=toks / (hi - lo) if hi > lo else None, window_s=hi - lo, tokens=toks)

    # every engine of the process gets the same prompts (its own seeded generator), so side-by-side engines whose
    # arithmetic is the same (PDL on / off, the router's column by kernel or cat) must give the same greedy tokens
    pg = torch.Generator().manual_seed(PROMPT_SEED)
    prand = lambda *shape: torch.randint(0, cfg.vocab_size, shape, generator=pg).to(device)  # noqa: E731
    try:
        await one(rand(1, ctx)[0].tolist(), 4)  # warm the 1k prefill shape
        prompt = prand(1, ctx)
        lone = await one(prompt[0].tolist(), steps + 1)
        lone_r = dict(ttft_ms=1e3 * lone["ttft_s"], decode_tok_per_s=lone["decode_tok_per_s"], tokens=lone["tokens"],
                      context=ctx, ids=lone["ids"])
        # the engine's paged path (fla prefill, paged attention, decode graphs) against the model's own contiguous
        # forward on the same prompt: greedy tokens (random weights: near-ties can flip a token, then they diverge)
        n_chk = min(16, steps + 1)
        with torch.inference_mode():
            ref = greedy_ours(model, prompt.to(device), n_chk)[0]
        lone_r["vs_model_forward"] = greedy_agreement(torch.tensor([lone["ids"][:n_chk]]), ref[None])
        if lone_only:
            return dict(decode_graphs=decode_graphs, lone=lone_r, start_s=start_s, programmatic_launch=pdl_on,
                        weight_prefetch=prefetch_on, autotune_picks_loaded=engine.autotune_picks,
                        expert_layouts=engine.health().get("expert_layouts"), runner=engine.health().get("runner"),
                        kernel_checks=engine.health().get("kernel_checks"), async_decode=ecfg.async_decode,
                        steps_ahead=engine.scheduler.stats.steps_ahead)
        # each request asks for steps + 1 + streams tokens: under the lone-prefill rule a stream admitted early has
        # decoded up to ~one token per prefill of the others by the time the last one's first token comes, and the
        # decode phase (decode_phase: every stream decoding) must still span >= `steps` steps
        burst = [prand(1, ctx)[0] for _ in range(streams)]
        t0 = time.perf_counter()
        many = await asyncio.gather(*(one(p.tolist(), steps + 1 + streams) for p in burst))
        wall = time.perf_counter() - t0
        # each stream's first token against the model's own contiguous forward of its prompt (bf16: with random
        # weights' flat logits a near-tie can flip it; which prefill path agrees how often is the point)
        with torch.inference_mode():
            first = torch.cat([greedy_ours(model, torch.stack(burst[i:i + 8]), 1)[:, 0]
                               for i in range(0, len(burst), 8)]).tolist()
        first_same = sum(int(m["ids"][:1] == [f]) for m, f in zip(many, first))
        ttfts = sorted(m["ttft_s"] for m in many)
        return dict(decode_graphs=decode_graphs, lone=lone_r, runner=engine.health().get("runner"),
                    programmatic_launch=pdl_on, weight_prefetch=prefetch_on,
                    autotune_picks_loaded=engine.autotune_picks,  # the table's, applied
                    kernel_checks=engine.health().get("kernel_checks"), async_decode=ecfg.async_decode, start_s=start_s,
                    expert_layouts=engine.health().get("expert_layouts"),
                    shared_expert_stream_layers=engine.health().get("shared_expert_stream_layers"),
                    gdn_z_stream_layers=engine.health().get("gdn_z_stream_layers"),
                    combine_next_norm=engine.health().get("combine_next_norm"),
                    gdn_decode_norm_layers=engine.health().get("gdn_decode_norm_layers"),
                    shared_expert_after_router_layers=engine.health().get("shared_expert_after_router_layers"),
                    prefill_buckets=((engine.health().get("runner") or {}).get("prefill_graphs") or {}).get("buckets"),
                    steps_ahead=engine.scheduler.stats.steps_ahead,
                    dropped_tokens=engine.scheduler.stats.dropped_tokens,
                    streams=dict(n=streams, output_tok_per_s=sum(m["tokens"] for m in many) / wall, wall_s=wall,
                                 ids=[m["ids"] for m in many], tokens_each=steps + 1 + streams,
                                 first_vs_model_forward=first_same,
                                 decode_phase=decode_phase(many),
                                 ttft_p50_ms=1e3 * ttfts[len(ttfts) // 2], ttft_max_ms=1e3 * ttfts[-1]),
                    stats=engine.health().get("stats"))
    finally:
        await engine.aclose()
        _engine_settings_off(model)
        autotune_table.restore(replaced)


_MODULE_FLAGS = ("qwen_engine.model.quantized.QUANT_IN_PRODUCERS", "kernels.gdn_prep.SPLIT_V_ROWS",
                 "qwen_engine.model.attention.GATE_IN_COMBINE",
                 "kernels.router_align.GATHER",
                 # an engine's `regs_builds` (the values in force when the first engine starts: --regs-builds')
                 "kernels.w4a16_regs.BLOCK_M", "kernels.w4a16_regs.ENGINE_BUILDS")
# (gdn_prep's tiling: DEFAULT_TILING, below)
# the flags' values at import, before any engine set them (`_engine_settings_off`)
_FLAG_DEFAULTS: dict[str, object] = {}


def _module_flag(path: str):
    import importlib

    mod, name = path.rsplit(".", 1)
    return importlib.import_module(mod), name


def _regs_builds(text: str | dict) -> dict:
    """--regs-builds (and an engine's `regs_builds` option, already a dict): {"block_m": 8 | 16, "gate_up": {...},
    "down": {...}} with only `w4a16_regs_launch`'s build keywords (ahead, l2_ahead, ring, cols, maxnreg, early,
    cols_first, mma_v2); argparse reports anything else."""
    builds = json.loads(text) if isinstance(text, str) else text
    keys = {"ahead", "l2_ahead", "ring", "cols", "maxnreg", "early", "cols_first", "mma_v2"}
    if (not isinstance(builds, dict) or set(builds) != {"block_m", "gate_up", "down"}
            or builds["block_m"] not in (8, 16)
            or not all(isinstance(builds[p], dict) and set(builds[p]) <= keys for p in ("gate_up", "down"))):
        raise argparse.ArgumentTypeError(f"expected {{'block_m': 8 | 16, 'gate_up': {{...}}, 'down': {{...}}}} with "
                                         f"keys among {sorted(keys)}, got {text!r}")
    return builds


def _set_regs_builds(builds: dict) -> None:
    """`_regs_builds`' value into the process-wide `w4a16_regs.BLOCK_M` / `ENGINE_BUILDS` (new dicts: the ones
    `_FLAG_DEFAULTS` holds stay as they were)."""
    from kernels import w4a16_regs

    w4a16_regs.BLOCK_M = builds["block_m"]
    w4a16_regs.ENGINE_BUILDS = {p: dict(builds[p]) for p in ("gate_up", "down")}


def _remember_flag_defaults() -> None:
    """The process-wide module flags an engine sets (`QwenEngine.__init__`), as their modules define them: called
    before the first engine of the process."""
    for path in _MODULE_FLAGS:
        mod, name = _module_flag(path)
        _FLAG_DEFAULTS.setdefault(path, getattr(mod, name))


def _engine_settings_off(model) -> None:
    """Undo the process-wide settings an engine made on the shared model: the model's later users (phases, the
    oracle) get the dense shared expert and GDN's z projection on the one stream, lm_head in the checkpoint layout, no
    thread-order expert copy (`expert_regs`), the experts aligning their own routing (`router_align`),
    no programmatic launches, the GDN prep's default tiling, and the module flags an engine sets (the FP8 quantiser
    in the producing ops, the GDN prep's row split, the attention's output gate) as their modules define them
    (`_FLAG_DEFAULTS`)."""
    from kernels import gdn_prep, pdl
    from qwen_engine.engine import (
        set_combine_next_norm,
        set_expert_regs,
        set_gdn_decode_norm,
        set_gdn_z_stream,
        set_lm_head_layout,
        set_moe_fused_decode,
        set_router_align,
        set_shared_expert_after_router,
        set_shared_expert_in_moe,
        set_shared_expert_stream,
    )

    set_shared_expert_in_moe(model, False)
    set_moe_fused_decode(model, False)
    set_shared_expert_stream(model, False)
    set_gdn_z_stream(model, False)
    set_gdn_decode_norm(model, False)
    set_combine_next_norm(model, False)
    set_shared_expert_after_router(model, False)
    set_router_align(model, False)
    gdn_prep.BA_FIRST, gdn_prep.BA_BLOCK_H, gdn_prep.NUM_WARPS = gdn_prep.DEFAULT_TILING
    set_lm_head_layout(model, "checkpoint")
    set_expert_regs(model, False, torch.device("cpu"), torch.float32)  # drops any thread-order copy
    pdl.set_enabled(False)
    pdl.set_prefetch("off")
    for path, value in _FLAG_DEFAULTS.items():
        mod, name = _module_flag(path)
        setattr(mod, name, value)


def _json_options(text: str) -> dict:
    """argparse type of --base: a JSON object of `engine_phase` options, checked when the arguments are parsed (not
    after the model is built and a GPU's minutes are spent: an option engine_phase does not take is an error here)."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    known = {name for name, p in inspect.signature(engine_phase).parameters.items()
             if p.default is not inspect.Parameter.empty}  # its options; the run's own arguments have no default
    unknown = sorted(set(value) - known)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown engine option(s) {unknown} in {text!r}; engine_phase takes "
                                         f"{sorted(known)}")
    if value.get("regs_builds") is not None:
        value["regs_builds"] = _regs_builds(value["regs_builds"])  # the parsed dict (a JSON string is accepted too)
    return value


def _base_options(text: str) -> dict:
    """argparse type of --base: `_json_options`, without prefill_buckets (the first engine's come from
    --prefill-buckets; a variant may name its own)."""
    value = _json_options(text)
    if "prefill_buckets" in value:
        raise argparse.ArgumentTypeError("--base cannot name prefill_buckets: use --prefill-buckets")
    return value


def _variant(text: str) -> tuple[str, dict]:
    """argparse type of --variant: NAME=JSON -> (name, options)."""
    name, eq, opts = text.partition("=")
    if not eq or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=JSON with NAME an identifier, got {text!r}")
    return name, _json_options(opts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/qwen_gpu")
    ap.add_argument("--tiny", action="store_true", help="tiny config on the CPU (dry run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=None, help="prompt / context tokens (default 1024; tiny 24)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="timed decode steps (default 64; tiny 3)")
    ap.add_argument("--streams", type=int, default=None, help="concurrent streams for (c) (default 32; tiny 2)")
    ap.add_argument("--ttft-reps", type=int, default=3, help="(tiny: 2)")
    ap.add_argument("--oracle-prompts", type=int, default=4, help="(tiny: 2)")
    ap.add_argument("--oracle-len", type=int, default=None, help="tokens per oracle prompt (default 128; tiny 8)")
    ap.add_argument("--greedy-tokens", type=int, default=None, help="(default 32; tiny 4)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="keep random_weights.ACTIVATION_AMAX input scales instead of max-calibrating them")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--no-shared-in-moe", action="store_true",
                    help="(e) once more without the engine's shared_expert_in_moe (auto: on with the dual_frag "
                         "experts, Hopper: the shared experts inside the grouped launches), side by side")
    ap.add_argument("--sync-decode", action="store_true",
                    help="(e) once more without the engine's async_decode (on by default: decode steps overlapped), "
                         "side by side")
    ap.add_argument("--engine-only", action="store_true",
                    help="(e) only: skip the model-level phases (a)-(c), the engine without graphs and the oracle")
    ap.add_argument("--prefill-buckets", default="",
                    help="the (e) engines' prefill-graph token buckets, comma-separated ('' = the engine default; each "
                         "bucket costs start-up time)")
    ap.add_argument("--compare-layout", default="",
                    choices=["", "checkpoint", "tile_major", "split_halves", "split_frag", "dual", "dual_frag"],
                    help="(e) once more with the routed experts repacked into this byte layout (NVFP4Experts.repack; "
                         "the run's own is the loader's default), side by side")
    ap.add_argument("--swapped-split", action="append", default=[],
                    help="G,D -- with --compare-layout split_frag / split_halves (no dual copy: the swap-AB kernel "
                         "at every size): that engine once more with split K of the <= 4-token expert calls "
                         "(kernels.w4a16_swapped.DECODE_SPLIT = (G, D) for gate_up, down), side by side; repeatable")
    ap.add_argument("--without", action="append", default=[],
                    help="OP:IMPL[,OP:IMPL...] -- (e) once more with these registry implementations disabled (e.g. "
                         "fp8_linear:triton_skinny+scaled_mm: the FP8 layers on the next implementation), side by "
                         "side; repeatable, one engine each")
    ap.add_argument("--warmup-burst", action="store_true",
                    help="every engine of the process warms up with a burst of three prompts too (QwenEngineConfig."
                         "warmup_burst); its effect on the first concurrent burst shows only in the process's first "
                         "engine: compare with a process run without it")
    ap.add_argument("--batched-tokens", type=int, default=None,
                    help="(e) once more with this token budget per step (max_num_batched_tokens; the first engine's: "
                         "max(2048, context)): fewer, larger prefill steps for the concurrent requests' burst, "
                         "side by side")
    ap.add_argument("--no-quant-in-producers", action="store_true",
                    help="(e) once more without the engine's quant_in_producers (the decode steps' FP8 projections "
                         "each launch their own activation quantiser, instead of reading the codes the input norm, "
                         "the GDN gated norm and the attention output gate write), side by side")
    ap.add_argument("--unfused-projections", action="store_true",
                    help="(e) once more with the decode steps' FP8 projections unfused (quantized."
                         "FUSE_DECODE_PROJECTIONS off: q/k/v and in_proj_qkv/z as separate calls), side by side")
    ap.add_argument("--gemv-deq", type=int, choices=(0, 1, 2, 3), default=None,
                    help="(e) once more with the W4A16 GEMV's dequantiser for bf16 activations set to this mode "
                         "(kernels/w4a16_gemv.py DEQ_GPU; the default is 3, DEQ_WIDE), side by side")
    ap.add_argument("--moe-fused-decode", action="store_true",
                    help="(e) once more with moe_fused_decode (a one-token decode step's routed + shared experts in "
                         "one launch per layer, kernels/moe_decode.py)")
    ap.add_argument("--lm-head-checkpoint", action="store_true",
                    help="(e) once more with lm_head in the checkpoint layout only (lm_head_layout checkpoint: the "
                         "tensor-core decode GEMV at one row, the dense tensor-core kernel above; the Hopper default "
                         "is dual_frag since the thirty-ninth session, split_frag from run 42)")
    ap.add_argument("--base", type=_base_options, default={},
                    help="(e) the first engine's engine_phase options (and --again's and every --variant's, which "
                         "add to them), JSON, e.g. '{\"lm_head_layout\": \"split_frag\"}': an engine alone when a "
                         "call has time for one start-up only (its tokens then compared offline with an earlier "
                         "run's). The other side-by-side engines (--without, --sync-decode, ...) do not take them")
    ap.add_argument("--variant", type=_variant, action="append", default=[],
                    help="(e) once more with these engine_phase options (async_decode, programmatic_launch, "
                         "lm_head_layout, moe_fused_decode, decode_graphs, ...), NAME=JSON (repeatable), e.g. "
                         "'frag_no_pdl={\"lm_head_layout\": \"split_frag\", \"programmatic_launch\": false}': "
                         "its greedy tokens compared with the first engine's like the other variants")
    ap.add_argument("--no-pdl", action="store_true",
                    help="(e) once more without the engine's programmatic_launch (kernels/pdl.py: programmatic "
                         "dependent launch of the decode step's Triton kernels; auto = on for Hopper), side by side")
    ap.add_argument("--router-cat", action="store_true",
                    help="(e) once more with the shared expert's (k+1)-th routing column appended by torch.cat + fill "
                         "after router_topk (TopKRouter.extra_in_kernel off; default: the kernel writes it), side by "
                         "side")
    ap.add_argument("--attn-lone-tiles", action="store_true",
                    help="(e) once more with the paged decode attention's lone-sequence launch rule at every batch "
                         "(kernels/paged_attention.py MANY_PROGRAMS and FEW_PROGRAMS None; default: ~2 programs an SM "
                         "at 4 warps from 4 sequences, ~3 an SM, at most 8 splits, from 12), side by side")
    ap.add_argument("--attn-few-lone", action="store_true",
                    help="(e) once more with the paged decode attention's lone-sequence launch rule below 12 sequences "
                         "(kernels/paged_attention.py FEW_PROGRAMS None; default: ~2 programs an SM at 4 warps from 4 "
                         "sequences), side by side")
    ap.add_argument("--no-fused-ba", action="store_true",
                    help="(e) once more with the GDN layers' in_proj_b / in_proj_a as their own GEMM before the decode "
                         "prep op (GatedDeltaNet.fused_ba off; default: inside it, kernels/gdn_prep.py), side by side")
    ap.add_argument("--autotune-table", default="off",
                    help="the engines' autotune_table: off (default: tune afresh, so that autotune_picks.json holds "
                         "this run's own picks), auto (the shipped kernels/tuned/<GPU>.json: a fresh machine's start "
                         "time with it) or a JSON path")
    ap.add_argument("--autotune-foreign", nargs="?", const="", default=None, metavar="JSON",
                    help="load --autotune-table's JSON path (or this JSON, as qwen_profile.py's option of the same "
                         "name takes it) even when it was measured on another GPU model (an H100 run on the H200's "
                         "picks: a cold start tunes the graphs' shapes for > 400 s there, results/attn_tiles47_run1); "
                         "for side-by-side ratios, not for a table of this GPU's own")
    ap.add_argument("--again", action="store_true",
                    help="(e) the first engine once more after all the others, in the same process (the first of a "
                         "process also compiles and captures: its TTFT in run 16 differed by 2.4 ms, unexplained)")
    ap.add_argument("--fp32-oracle-layers", type=int, default=8,
                    help="depth of the full-width fp32 model compared with transformers' fp32 (0: skip; tiny: 4; "
                         "needs >= 4 for a full-attention layer)")
    ap.add_argument("--regs-builds", type=_regs_builds, default=None,
                    help="kernels/w4a16_regs.py's builds for the engines with expert_regs, JSON "
                         "'{\"block_m\": 16, \"gate_up\": {...}, \"down\": {...}}' (launcher keywords ahead, "
                         "l2_ahead, ring, cols, maxnreg, early, cols_first, mma_v2): sets w4a16_regs.BLOCK_M and "
                         "ENGINE_BUILDS for "
                         "the whole run (only the THREAD_ORDER experts read them), recorded under settings "
                         "(gpu_next.sh steps 162 / 167 pass step 161's / 166's fastest)")
    ap.add_argument("--hf-gdn", choices=("torch", "any"), default="torch",
                    help="transformers' Gated DeltaNet: torch (its pure-torch code, fla made unimportable before its "
                         "model module loads: an fp32 reference) or any (fla's chunk kernel where fla is installed: "
                         "not fp32-exact)")
    ap.add_argument("--skip-model-loop", action="store_true",
                    help="skip (a)-(c), the model's own eager loop: the engine (e), the oracle (d) and transformers' "
                         "baseline remain (the issue's numbers in one run, in less of a device call's time)")
    ap.add_argument("--stage-transformers", choices=("auto", "cpu", "device"), default="auto",
                    help="where transformers' bf16 model is filled from ours: on the GPU (device; both models at "
                         "once, ~99 GiB at full size), or on the CPU and moved to the GPU once ours is freed (cpu; "
                         "~65 GiB on the GPU: an 80 GB H100) -- auto: cpu when the GPU's free memory is short of "
                         "transformers' model + 8 GiB while ours is still there")
    ap.add_argument("--only-oracle", action="store_true",
                    help="skip the speed phases (a)-(c) and (e): build, then the oracle and the kernel bisection only")
    args = ap.parse_args()
    if args.regs_builds is not None:  # before the flags' defaults are taken: every engine's builds unless its own
        _set_regs_builds(args.regs_builds)
    _remember_flag_defaults()  # before any engine sets them
    if args.swapped_split and args.compare_layout not in ("split_halves", "split_frag"):
        ap.error("--swapped-split needs --compare-layout split_halves or split_frag (an engine without the dual copy)")
    for spec in args.swapped_split:
        if len(spec.split(",")) != 2 or not all(v.strip().isdigit() and int(v) >= 1 for v in spec.split(",")):
            ap.error(f"--swapped-split {spec!r}: expected G,D, two positive integers")
    if args.autotune_foreign:  # --autotune-foreign JSON: that table (qwen_profile.py's spelling)
        args.autotune_table = args.autotune_foreign
    if args.autotune_foreign is not None and args.autotune_table in ("off", "auto"):
        ap.error("--autotune-foreign needs a JSON file (its own argument or --autotune-table's)")
    global AUTOTUNE_TABLE, AUTOTUNE_FOREIGN, WARMUP_BURST
    AUTOTUNE_TABLE, AUTOTUNE_FOREIGN, WARMUP_BURST = (args.autotune_table, args.autotune_foreign is not None,
                                                      args.warmup_burst)
    tiny = args.tiny
    d = lambda v, full, small: v if v is not None else (small if tiny else full)  # noqa: E731
    ctx, steps, streams = d(args.context, 1024, 24), d(args.decode_tokens, 64, 3), d(args.streams, 32, 2)
    olen, gtok = d(args.oracle_len, 128, 8), d(args.greedy_tokens, 32, 4)
    ttft_reps, oracle_prompts = (args.ttft_reps, args.oracle_prompts) if not tiny else (2, 2)
    device = torch.device("cpu" if tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny for the CPU dry run")
    if tiny:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    cfg = QwenConfig.tiny() if tiny else QwenConfig()
    dtype = torch.bfloat16
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    try:
        import transformers
        tf_version = transformers.__version__
    except Exception as e:  # noqa: BLE001  (reported, the rest still runs)
        tf_version = f"unavailable: {e}"
    r: dict = dict(
        settings=dict(tiny=tiny, seed=args.seed, context=ctx, decode_tokens=steps, streams=streams,
                      oracle_prompts=oracle_prompts, oracle_len=olen, greedy_tokens=gtok, dtype="bf16",
                      regs_builds=args.regs_builds),
        env=dict(device=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                 torch=torch.__version__, transformers=tf_version, python=platform.python_version(),
                 path="(a)-(c): QwenForCausalLM.forward + QwenState (eager, greedy); (e): QwenEngine"),
        errors=[])

    def save():
        (out_dir / "qwen_gpu.json").write_text(json.dumps(r, indent=2, default=str))
        (out_dir / "qwen_gpu.md").write_text(markdown(r))
        if device.type == "cuda":  # the autotuners' picks so far: the table a fresh machine loads to skip tuning
            from kernels import autotune_table  # (copy to kernels/tuned/<GPU model>.json; kernels/autotune_table.py)

            autotune_table.dump(torch.cuda.get_device_name(), out_dir / "autotune_picks.json")

    def dump_picks_every(seconds: float):
        """Also every `seconds` from a daemon thread: a fresh machine's first engine start can outlast the call
        (> 560 s, mostly tuning), and the picks tuned so far are what the next start needs (kernels/tuned/)."""
        import threading

        from kernels import autotune_table

        def loop():
            while True:
                time.sleep(seconds)
                try:  # an autotuner may insert a pick mid-copy (RuntimeError): skip this round; never stop the loop
                    autotune_table.dump(torch.cuda.get_device_name(), out_dir / "autotune_picks.json")
                except Exception:  # noqa: BLE001 - the next round writes the file again
                    pass

        threading.Thread(target=loop, name="autotune-picks", daemon=True).start()

    if device.type == "cuda":
        dump_picks_every(15.0)

    # ---- build ----------------------------------------------------------------------------------------------------
    log(f"generating random packed weights for {'tiny' if tiny else 'full-size'} config on {device}")
    t = time.perf_counter()
    tensors = random_packed_tensors(cfg, device, seed=args.seed, dtype=dtype)
    # shared_expert_in_moe auto: on Hopper (dual_frag experts) the shared experts are also stacked with the routed ones
    # (in both copies: ~3.4 MB per layer), which the engines run inside the grouped launches unless told otherwise;
    # the model-level rows keep the dense shared expert, and their routed calls see the routed experts only
    # (`NVFP4Experts.forward(with_shared=False)`)
    model = load_quantized(tensors, cfg, device, dtype)
    del tensors
    sync(device)
    kinds = packed_modules(model)
    from qwen_engine.engine import expert_layouts

    r["build"] = dict(seconds=time.perf_counter() - t, packed_modules=len(kinds),
                      expert_layouts=expert_layouts(model),
                      bytes_by_dtype={k: gib(v) for k, v in model_bytes(model).items()})
    r["memory"] = dict(model_gib=gib(sum(model_bytes(model).values())))
    if device.type == "cuda":
        r["memory"].update(allocated_gib=gib(torch.cuda.memory_allocated()),
                           peak_during_build_gib=gib(torch.cuda.max_memory_allocated()))
        torch.cuda.reset_peak_memory_stats()
    log(f"model built: {r['build']}")
    save()
    g = torch.Generator().manual_seed(args.seed + 1)
    rand = lambda *shape: torch.randint(0, cfg.vocab_size, shape, generator=g).to(device)  # noqa: E731
    if AUTOTUNE_TABLE != "off" and device.type == "cuda":
        # the engines' table before the calibration's forward, which would otherwise tune its keys (the 256-row dense
        # W4A16 calls) here, differently in each process, and the engines would keep those picks (autotune_table.load
        # keeps a process's earlier ones): the greedy tokens then differed between processes (results/defaults_run1)
        from kernels import autotune_table

        if AUTOTUNE_FOREIGN:  # another GPU model's picks; the engines keep them (their own load refuses the table)
            loaded, measured_on = autotune_table.load_foreign(AUTOTUNE_TABLE)
        else:
            loaded, measured_on = autotune_table.load_setting(AUTOTUNE_TABLE, device), None
        log(f"autotune table {AUTOTUNE_TABLE}: {loaded} picks loaded before the calibration"
            + (f" (measured on {measured_on}, this is {torch.cuda.get_device_name(device)})" if measured_on else ""))
    if not args.no_calibrate:  # ModelOpt-style max calibration of the FP8 static input scales on one random prompt
        amax = sorted(calibrate_fp8_input_scales(model, rand(1, min(ctx, 256))).values())
        r["build"]["fp8_input_amax"] = dict(min=amax[0], median=amax[len(amax) // 2], max=amax[-1], n=len(amax))
        log(f"calibrated FP8 input scales: {r['build']['fp8_input_amax']}")

    if not args.only_oracle and not args.engine_only and not args.skip_model_loop:
        # ---- (b) TTFT and (a) single-stream decode -------------------------------------------------------------------
        log("warm-up (Triton autotuning for prefill and decode shapes)")
        prefill_then_decode(model, rand(1, ctx), steps=2)
        runs = []
        for i in range(ttft_reps):
            runs.append(prefill_then_decode(model, rand(1, ctx), steps=steps if i == 0 else 0, warm_steps=3 if i == 0
                                            else 0))
            log(f"run {i}: {runs[-1]}")
        ttfts = [x["ttft_s"] * 1e3 for x in runs]
        r["ttft"] = dict(median_ms=statistics.median(ttfts), all_ms=ttfts, prompt_tokens=ctx)
        r["decode_1stream"] = dict(tok_per_s=runs[0]["tok_per_s"], steps=steps, context=ctx,
                                   ms_per_token=1e3 * runs[0]["decode_s"] / steps)
        r["kernels"] = {op: {k: v[k] for k in ("last", "calls", "fallback")}
                        for op, v in default_registry().choices().items() if op in ("w4a16_linear", "w4a16_moe",
                                                                                      "fp8_linear")}
        save()

        # ---- (c) concurrent streams ----------------------------------------------------------------------------------
        log(f"{streams} streams x {ctx}-token prompts")
        try:
            prefill_then_decode(model, rand(streams, 16), steps=2)  # decode-shape warm-up at this batch
            c = prefill_then_decode(model, rand(streams, ctx), steps=steps, warm_steps=2)
            r["decode_streams"] = dict(tok_per_s=c["tok_per_s"], streams=streams, steps=steps,
                                       prefill_s=c["ttft_s"], prefill_tok_per_s=streams * ctx / c["ttft_s"],
                                       ms_per_step=1e3 * c["decode_s"] / steps)
            if device.type == "cuda":
                r["memory"]["peak_streams_gib"] = gib(torch.cuda.max_memory_allocated())
        except torch.OutOfMemoryError as e:
            r["errors"].append(f"(c) out of memory: {e}")
        log(f"(c) {r.get('decode_streams')}")
        save()

    buckets = tuple(int(b) for b in args.prefill_buckets.split(",") if b.strip())
    base = args.base  # the first engine's (and --again's and the --variant engines') options
    if base:
        r["settings"]["base_engine_options"] = base
    if not args.only_oracle:
        # ---- (e) the same through the serving engine (QwenEngine: continuous batching, paged KV, sampling) ---------
        try:
            r["engine"] = asyncio.run(engine_phase(model, cfg, device, ctx, steps, streams, rand,
                                                   prefill_buckets=buckets, **base))
        except Exception as e:  # noqa: BLE001 - recorded, the oracle still runs
            r["errors"].append(f"(e) engine: {type(e).__name__}: {e}")
        log(f"(e) {r.get('engine')}")
        save()
        if not args.engine_only:
            try:  # the same engine without decode graphs, lone request only: the graphs' side-by-side ratio
                r["engine_eager"] = asyncio.run(engine_phase(model, cfg, device, ctx, steps, streams, rand,
                                                             decode_graphs="off", lone_only=True,
                                                             prefill_graphs="off"))
            except Exception as e:  # noqa: BLE001 - recorded
                r["errors"].append(f"(e) engine without graphs: {type(e).__name__}: {e}")
            log(f"(e) without graphs {r.get('engine_eager')}")
        # the same graphed engine with one option switched, side by side: decode steps not overlapped (async_decode
        # off); the shared experts outside the grouped launches (shared_expert_in_moe off: the auto default has them in)
        variants = (("engine_sync", dict(async_decode=False), args.sync_decode),
                    ("engine_no_shared", dict(shared_expert_in_moe=False), args.no_shared_in_moe),
                    ("engine_no_pdl", dict(programmatic_launch=False), args.no_pdl),
                    ("engine_no_quant_producers", dict(quant_in_producers=False), args.no_quant_in_producers),
                    ("engine_batched_tokens", dict(batched_tokens=args.batched_tokens), args.batched_tokens),
                    ("engine_moe_fused_decode", dict(moe_fused_decode=True), args.moe_fused_decode),
                    ("engine_lm_head_checkpoint", dict(lm_head_layout="checkpoint"), args.lm_head_checkpoint))
        variants += tuple((f"engine_v_{name}", {**base, **options}, True)  # any combination (e.g. to bisect a
                          for name, options in args.variant)                 # token difference), on top of --base
        for key, options, wanted in variants:
            if not wanted:
                continue
            try:
                call = {"prefill_buckets": buckets, **options}  # a variant may name its own prefill buckets
                r[key] = dict(options=options, **asyncio.run(engine_phase(model, cfg, device, ctx, steps, streams,
                                                                          rand, **call)))
            except Exception as e:  # noqa: BLE001 - recorded
                r["errors"].append(f"(e) engine with {options}: {type(e).__name__}: {e}")
            log(f"(e) {options} {r.get(key)}")
            save()
        for i, without in enumerate(args.without):  # the same engine with kernels taken out of the registry's choice
            from qwen_engine.model.quantized import forget_kernel_choices

            pairs = [w.partition(":")[::2] for w in without.split(",")]  # "OP:IMPL[,OP:IMPL...]": one engine
            registry = default_registry()
            key = "engine_without" if i == 0 else f"engine_without_{i}"
            before = {}
            try:
                for op, impl in pairs:
                    before[op, impl] = registry.disable(op, impl, "benchmarks/qwen_gpu.py --without (side by side)")
                forget_kernel_choices(model)
                r[key] = dict(without=without, **asyncio.run(engine_phase(
                    model, cfg, device, ctx, steps, streams, rand, prefill_buckets=buckets)))
            except Exception as e:  # noqa: BLE001 - recorded
                r["errors"].append(f"(e) engine without {without}: {type(e).__name__}: {e}")
            finally:
                for (op, impl), why in before.items():
                    registry.enable(op, impl, why)  # a failed start-up self-check stays in force
                forget_kernel_choices(model)
            log(f"(e) without {without} {r.get(key)}")
            save()
        def engine_with(module, attr: str, value, key: str, label: str, **extra):
            """The same engine with `module.attr` = `value` (restored after), into r[key]."""
            before = getattr(module, attr)
            try:
                setattr(module, attr, value)
                r[key] = dict(**extra, **asyncio.run(engine_phase(model, cfg, device, ctx, steps, streams, rand,
                                                                  prefill_buckets=buckets)))
            except Exception as e:  # noqa: BLE001 - recorded
                r["errors"].append(f"(e) engine with {label}: {type(e).__name__}: {e}")
            finally:
                setattr(module, attr, before)
            log(f"(e) {label} {r.get(key)}")
            save()

        if args.unfused_projections:  # q/k/v and in_proj_qkv/z as separate FP8 calls
            from qwen_engine.model import quantized

            engine_with(quantized, "FUSE_DECODE_PROJECTIONS", False, "engine_unfused", "unfused projections")
        if args.attn_lone_tiles:  # the paged attention's one-program-an-SM rule at every batch
            from kernels import paged_attention

            with mock.patch.object(paged_attention, "FEW_PROGRAMS", None):  # restored on leaving
                engine_with(paged_attention, "MANY_PROGRAMS", None, "engine_attn_lone_tiles",
                            "the paged attention's lone-sequence tiles at every batch")
        if args.attn_few_lone:  # the paged attention's one-program-an-SM rule below MANY_PROGRAMS
            from kernels import paged_attention

            engine_with(paged_attention, "FEW_PROGRAMS", None, "engine_attn_few_lone",
                        "the paged attention's lone-sequence tiles below MANY_PROGRAMS")
        if args.no_fused_ba:  # the GDN b / a projections as their own GEMM
            from qwen_engine.model.gdn import GatedDeltaNet

            engine_with(GatedDeltaNet, "fused_ba", False, "engine_no_fused_ba", "b / a GEMM outside the prep op")
        if args.router_cat:  # the shared pair's router column by torch.cat + fill instead of inside router_topk
            from qwen_engine.model.moe import TopKRouter

            engine_with(TopKRouter, "extra_in_kernel", False, "engine_router_cat",
                        "the shared pair's column by torch.cat after router_topk")
        if args.gemv_deq is not None:  # the decode GEMV's dequantiser
            from kernels import w4a16_gemv

            engine_with(w4a16_gemv, "DEQ_GPU", args.gemv_deq, "engine_gemv_deq", f"GEMV dequant mode {args.gemv_deq}",
                        deq=args.gemv_deq)
        if args.compare_layout:  # the same engine on the same weights in another expert byte layout
            from qwen_engine.load_packed import apply_expert_layout
            from qwen_engine.model.quantized import NVFP4Experts

            experts = [m for m in model.modules() if isinstance(m, NVFP4Experts)]
            own = {id(m): (m.layout, m.small_tokens, m.small_layout) for m in experts}  # restored afterwards
            try:
                if not all(apply_expert_layout(m, args.compare_layout, device) for m in experts):
                    raise ValueError(f"experts do not split into the {args.compare_layout} tiles")
                r["engine_layout"] = dict(layout=args.compare_layout, **asyncio.run(engine_phase(
                    model, cfg, device, ctx, steps, streams, rand, prefill_buckets=buckets)))
                log(f"(e) {args.compare_layout} experts {r.get('engine_layout')}")
                save()
                for spec in args.swapped_split:  # the same layout, split K at decode sizes
                    from kernels import w4a16_swapped

                    split = tuple(int(v) for v in spec.split(","))
                    engine_with(w4a16_swapped, "DECODE_SPLIT", split, f"engine_layout_split_{split[0]}_{split[1]}",
                                f"{args.compare_layout} experts, decode split {split}", layout=args.compare_layout,
                                split=list(split))
            except Exception as e:  # noqa: BLE001 - recorded
                r["errors"].append(f"(e) engine with {args.compare_layout} experts: {type(e).__name__}: {e}")
            finally:
                for m in experts:
                    layout, small, small_layout = own[id(m)]
                    m.repack_dual(small, small_layout, layout) if small else m.repack(layout)
        if args.again:  # the first engine once more, after the others: separates order effects from the options'
            try:
                r["engine_again"] = asyncio.run(engine_phase(model, cfg, device, ctx, steps, streams, rand,
                                                             prefill_buckets=buckets, **base))
            except Exception as e:  # noqa: BLE001 - recorded
                r["errors"].append(f"(e) engine again: {type(e).__name__}: {e}")
            log(f"(e) again {r.get('engine_again')}")
            save()
        same_tokens(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    if args.engine_only:
        return

    # ---- (d) oracle ------------------------------------------------------------------------------------------------
    prompts = rand(oracle_prompts, olen)
    with torch.no_grad():
        ours_logits = model(prompts).float().cpu()
        set_fp8_activation_quantization(model, False)
        ours_wo = model(prompts).float().cpu()
        # bisect kernels vs model: the same weight-only forward with every registry op on its plain reference
        # (dequantise + matmul, expert loop): if this one agrees with transformers and the fast one does not, a
        # kernel is wrong at full size (the 2026-11-30 run disagreed, top-1 2%, while a full-width CPU model agrees)
        try:
            with reference_kernels():
                ours_ref = model(prompts[:1, : min(olen, 32)]).float().cpu()
        except Exception as e:  # noqa: BLE001 - recorded
            ours_ref = None
            r["errors"].append(f"(d) reference-kernel forward: {type(e).__name__}: {e}")
        # the fp32 noise floor: the same weights in fp32 activations with the plain reference kernels (on the CPU a
        # full-width fp32 model equals transformers' fp32 to 6e-7); transformers' bf16 and ours are judged against it
        try:
            with reference_kernels():
                model.float()
                ours_fp32 = model(prompts[:1, : min(olen, 32)]).float().cpu()
        except Exception as e:  # noqa: BLE001 - recorded
            ours_fp32 = None
            r["errors"].append(f"(d) fp32 reference forward: {type(e).__name__}: {e}")
        finally:
            model.to(dtype)  # the bf16 parameters came from bf16: the round trip is exact
        set_fp8_activation_quantization(model, True)
        if ours_ref is not None:
            r["bisect"] = dict(fast_vs_reference_kernels=compare_logits(ours_wo[:1, : ours_ref.shape[1]], ours_ref))
        if ours_fp32 is not None:
            n32 = ours_fp32.shape[1]
            r.setdefault("bisect", {})["ours_bf16_fast_vs_ours_fp32"] = compare_logits(ours_wo[:1, :n32], ours_fp32)
            if ours_ref is not None:
                r["bisect"]["ours_bf16_reference_vs_ours_fp32"] = compare_logits(ours_ref, ours_fp32)
        save()
    ours_greedy = greedy_ours(model, prompts, gtok)
    if args.skip_transformers:
        save()
        return
    if args.hf_gdn == "torch":
        late = block_gdn_kernels()
        if late:
            r["errors"].append(late)
    try:
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    except ImportError as e:
        r["errors"].append(f"transformers {tf_version} has no Qwen3_5MoeForCausalLM ({e}); oracle skipped")
        save()
        return
    log("building transformers' Qwen3_5MoeForCausalLM in bf16 from our dequantised weights")
    t = time.perf_counter()
    hf_cfg = Qwen3_5MoeTextConfig.from_dict(hf_text_config(cfg))
    hf_cfg._attn_implementation = "eager"
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):  # shapes only: its size decides where it is filled
            hf = Qwen3_5MoeForCausalLM(hf_cfg).eval()
    finally:
        torch.set_default_dtype(default)
    stage = transformers_stage(args.stage_transformers, hf, device)
    hf = empty_transformers(hf, torch.device("cpu") if stage == "cpu" else device)  # "cpu": moved once ours is freed
    n = to_transformers(model, hf)
    model = None  # freed (a rebinding rather than `del`: the engine_with closure above reads the name)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if stage == "cpu":
        hf.to(device)
    if device.type == "cuda":
        r["memory"]["transformers_gib"] = gib(torch.cuda.memory_allocated())
    r["transformers"] = dict(build_s=time.perf_counter() - t, tensors_copied=n, filled_on=stage, gdn=args.hf_gdn,
                             experts_implementation=getattr(hf_cfg, "_experts_implementation", None),
                             attn_implementation=hf_cfg._attn_implementation)
    log(f"transformers model ready: {r['transformers']}")
    with torch.no_grad():
        ref = hf(prompts).logits.float().cpu()
    r["oracle"] = dict(w8a8=compare_logits(ours_logits, ref), fp8_weight_only=compare_logits(ours_wo, ref),
                       prompts=oracle_prompts, tokens_per_prompt=olen)
    if ours_ref is not None:
        r["bisect"]["reference_kernels_vs_transformers"] = compare_logits(ours_ref, ref[:1, : ours_ref.shape[1]])
    if ours_fp32 is not None:  # transformers' own bf16 error: the floor any bf16 engine is judged by
        r["bisect"]["transformers_bf16_vs_ours_fp32"] = compare_logits(ref[:1, : ours_fp32.shape[1]], ours_fp32)
    _, hf_greedy = hf_prefill_then_decode(hf, prompts, steps=gtok - 1)
    r["oracle"]["greedy"] = greedy_agreement(ours_greedy, hf_greedy)
    log(f"oracle {r['oracle']}")
    save()
    hf_prefill_then_decode(hf, rand(1, 8), steps=1)  # warm-up
    base, _ = hf_prefill_then_decode(hf, rand(1, ctx), steps=min(steps, 32), warm_steps=0 if tiny else 2)
    r["transformers"].update(ttft_ms=1e3 * base["ttft_s"], tok_per_s=base["tok_per_s"],
                             decode_steps=min(steps, 32), context=ctx)
    if device.type == "cuda":
        r["memory"]["peak_transformers_gib"] = gib(torch.cuda.max_memory_allocated())
    log(f"transformers baseline {base}")
    save()
    del hf
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.fp32_oracle_layers:
        try:
            r["oracle"]["fp32_full_width"] = fp32_oracle(cfg, args.fp32_oracle_layers if not tiny else 4, device,
                                                           args.seed)
        except Exception as e:  # noqa: BLE001 - recorded
            r["errors"].append(f"(d) fp32 full-width oracle: {type(e).__name__}: {e}")
        log(f"fp32 full-width oracle {r['oracle'].get('fp32_full_width')}")
        save()
    print(markdown(r))


if __name__ == "__main__":
    main()
