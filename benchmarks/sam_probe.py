"""Two questions a lone-request profile raised about the detector (issue 4; waterfall run 10's profile, RESULTS.md):

1. `sdpa`: which SDPA backend each attention call of the detector gets, and why the others refuse it. The profile of
   a lone request (inductor engine) shows fp32 GEMMs (`sm80_xmma_gemm_f32f32...`, `cutlass_80_simt_sgemm`) and an
   online-softmax reduction six times per request, ~1.5 ms of ~24: the signature of SDPA's math fallback, which
   upcasts bf16 to fp32. One eager pass of `encode_images` (batch 1), `encode_prompts` and `ground` (1 pair) runs
   with `F.scaled_dot_product_attention` wrapped: per call site, the shapes, the mask, the backends' verdicts
   (`torch.backends.cuda.can_use_*(..., debug=True)` warnings) and the aten SDPA op that actually ran.
   `box_bias`: `ground` at 1 and 8 pairs with the decoder's box bias contiguous (SDPA's choice: cuDNN) and in its
   old channels-last layout (which the fused kernels refuse), side by side.
   `attention_backends`: the ViT's, the encoder's and the decoder's biased attention shapes at batch 8 on cuDNN,
   flash and efficient alone (is SDPA's first choice the fastest? run 2: yes, for all four).
2. `patch_embed`: the ViT's patch embedding as Meta's conv (cuDNN serves it with a CUDA-core kernel,
   `implicit_convolve_sgemm`: 2.45 ms per batch of 8 in the compiled stage profile) against the unfolded-patches GEMM
   `sammie.model.vit.PatchEmbed` uses on CUDA: median ms at batch 1 and 8, eager and compiled, and the largest
   difference between the two.
3. `pair_gather`: the grounding batch's input gather at 8 pairs (concatenation + `index_select`, as the engine did,
   against `copy_rows`' run copies), in one image batch's order and split over two batches.

    python benchmarks/sam_probe.py --out DIR     # CUDA, full size, random weights (the speed does not depend on them)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: sammie
sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/: cuda_timing

from cuda_timing import median_ms  # noqa: E402
from sammie.build import build_detector  # noqa: E402
from sammie.config import PRESETS  # noqa: E402


def _site() -> str:
    """Where SDPA was called from: the innermost frame inside sammie/model and the innermost one outside the shared
    attention module ("attention.py:81 <- decoder.py:120": the module and the layer that used it)."""
    frames = [f"{Path(f.filename).name}:{f.lineno}" for f in reversed(traceback.extract_stack()[:-2])
              if "/sammie/model/" in f.filename]
    if not frames:
        return "?"
    caller = next((f for f in frames[1:] if not f.startswith("attention.py:")), None)
    return frames[0] if caller is None or caller == frames[0] else f"{frames[0]} <- {caller}"


def _describe(t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} strides {list(t.stride())}"


def _verdicts(site: str, q, k, v, attn_mask, is_causal, enable_gqa) -> dict[str, str]:
    """Each fused backend's can_use_* answer on these inputs. torch gives its reasons as C++ warnings, which reach
    Python's warnings here or else stderr (the log), right after the marker line printed before each check."""
    params = torch.backends.cuda.SDPAParams(q, k, v, attn_mask, 0.0, is_causal, enable_gqa)
    out = {}
    for name in ("flash", "efficient", "cudnn"):
        check = getattr(torch.backends.cuda, f"can_use_{name}_attention", None)
        if check is None:
            out[name] = "no such check in this torch"
            continue
        print(f"[sam_probe] can_use_{name}_attention at {site}:", file=sys.stderr, flush=True)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ok = check(params, True)
        except Exception as e:  # e.g. cuDNN's check without a usable CUDA runtime
            out[name] = f"check failed: {e!r}"[:300]
            continue
        reasons = "; ".join(str(w.message).replace("\n", " ")[:300] for w in caught)
        out[name] = ("yes" if ok else "no") + (f": {reasons}" if reasons else " (reasons, if any: the log)")
    return out


def probe_sdpa(det, tokenizer, cfg) -> dict:
    calls: dict[str, dict] = {}
    counts: collections.Counter = collections.Counter()
    plain = F.scaled_dot_product_attention

    def record(site, q, k, v, mask, is_causal, verdicts) -> None:
        """Count a call at `site`; the first time, its inputs and the backends' verdicts (a callable, run once)."""
        counts[site] += 1
        if site not in calls:
            calls[site] = {"q": _describe(q), "k": _describe(k), "v": _describe(v), "mask": _describe(mask),
                           "is_causal": is_causal, "verdicts": verdicts()}

    def wrapped(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        site = f"{_site()} q {list(q.shape)} mask {None if attn_mask is None else list(attn_mask.shape)}"
        record(site, q, k, v, attn_mask, is_causal,
               lambda: _verdicts(site, q, k, v, attn_mask, is_causal, enable_gqa))
        return plain(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)

    side, dev = cfg.image_size, next(det.parameters()).device
    dtype = next(det.parameters()).dtype
    px = torch.randn(1, 3, side, side, device=dev).to(dtype)
    ids = tokenizer(["a water bottle"]).to(dev)
    F.scaled_dot_product_attention = wrapped
    try:
        with torch.inference_mode():
            images = det.encode_images(px)
            prompts = det.encode_prompts(ids)
            index = torch.zeros(1, dtype=torch.long, device=dev)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                det.ground(images, prompts, index, index)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
    finally:
        F.scaled_dot_product_attention = plain
    ran = collections.Counter()
    for e in prof.events():
        if "scaled_dot_product" in e.name or "_attention" in e.name or e.name in ("aten::bmm", "aten::baddbmm"):
            ran[e.name] += 1
    kernels = sorted(((e.key, round(e.self_device_time_total / 1e3, 3), e.count) for e in prof.key_averages()
                      if e.self_device_time_total > 0), key=lambda r: -r[1])[:25]
    for site, c in calls.items():
        c["calls"] = counts[site]
    return {"sites": calls, "aten_ops_in_ground": dict(ran), "ground_top_kernels_ms": kernels}


def probe_box_bias(det, tokenizer, cfg) -> list[dict]:
    """`ground` (eager) at 1 and 8 pairs two ways: the decoder's box bias contiguous (now; SDPA's choice, cuDNN on
    Hopper) and channels-last as it was before (SDPA's fp32 math fallback): median ms, and the aten attention ops
    each ran. (Sam_probe run 2 also had the bias sent straight to the memory-efficient kernel: its device time lost
    to cuDNN's, `probe_attention_backends`.)"""
    from sammie.model.decoder import Decoder

    plain = Decoder._box_bias

    def channels_last(self, boxes, dtype):  # the old layout: heads innermost, stride(-1) = heads
        return plain(self, boxes, dtype).permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)

    side, rows = cfg.image_size, []
    param = next(det.parameters())
    with torch.inference_mode():
        images = det.encode_images(torch.randn(8, 3, side, side, device=param.device).to(param.dtype))
        prompts = det.encode_prompts(tokenizer([f"object number {i}" for i in range(8)]).to(param.device))
        for p in (1, 8):
            index = torch.arange(p, device=param.device)
            row = {"pairs": p}
            outs = {}
            for name, fn in (("sdpa_choice", plain), ("channels_last", channels_last)):
                Decoder._box_bias = fn
                try:
                    def run():
                        return det.ground(images, prompts, index, index)

                    outs[name] = run()
                    row[f"{name}_ms"] = median_ms(run, param.device, iters=10)
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                        run()
                    row[f"{name}_sdpa_ops"] = dict(collections.Counter(
                        e.name for e in prof.events() if "scaled_dot_product" in e.name or "attention" in e.name))
                finally:
                    Decoder._box_bias = plain
            a, b = outs["sdpa_choice"], outs["channels_last"]
            row["logits_max_abs_diff"] = (a.logits.float() - b.logits.float()).abs().max().item()
            print(f"[sam_probe] box_bias {row}", flush=True)
            rows.append(row)
    return rows


def probe_attention_backends(det, cfg) -> list[dict]:
    """The ViT's attention shapes at batch 8 (window blocks [8 x 9 windows, heads, 576, 64], global blocks [8, heads,
    5,184, 64]), the fusion encoder's self-attention [8, 8, 5,184, 32] and the decoder's image cross-attention with
    its box bias [8, 8, 201, 5,184], bf16, on each SDPA backend alone: median
    ms a call, and each output's largest difference from the math backend's (fp32) -- is cuDNN, SDPA's first choice
    on Hopper (18.6 ms of ~117 per batch of 8 in the compiled stage profile), the fastest here?"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    v = cfg.vision
    w2, g2, hd = v.window_size ** 2, v.grid_size ** 2, v.width // v.heads
    dh, f2 = cfg.d_model // cfg.heads, cfg.feat_size ** 2
    cases = {  # name -> (q shape, k / v shape, bias shape or None)
        "vit_window": ((8 * (v.grid_size // v.window_size) ** 2, v.heads, w2, hd),) * 2 + (None,),
        "vit_global": ((8, v.heads, g2, hd),) * 2 + (None,),
        "encoder_self": ((8, cfg.heads, f2, dh),) * 2 + (None,),
        # the decoder's image cross-attention with its box bias, 8 pairs: 1 + num_queries rows
        "decoder_cross_bias": ((8, cfg.heads, 1 + cfg.num_queries, dh), (8, cfg.heads, f2, dh),
                               (8, cfg.heads, 1 + cfg.num_queries, f2)),
    }
    param, rows = next(det.parameters()), []
    gen = torch.Generator(device=param.device).manual_seed(0)

    def rand(shape, scale=1.0):
        return (torch.randn(shape, device=param.device, generator=gen) * scale).to(param.dtype)

    with torch.inference_mode():
        for name, (q_shape, kv_shape, bias_shape) in cases.items():
            q, k, vv = rand(q_shape), rand(kv_shape), rand(kv_shape)
            bias = None if bias_shape is None else rand(bias_shape, 3.0)
            with sdpa_kernel([SDPBackend.MATH]):
                ref = F.scaled_dot_product_attention(q.float(), k.float(), vv.float(),
                                                     attn_mask=None if bias is None else bias.float())
            row = {"case": name, "q": list(q_shape), "kv": list(kv_shape), "bias": bias_shape and list(bias_shape)}
            calls = {f"sdpa_{b.name.lower()}": b for b in
                     (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)}
            for key, backend in calls.items():
                def attend(backend=backend):
                    with sdpa_kernel([backend]):
                        return F.scaled_dot_product_attention(q, k, vv, attn_mask=bias)
                try:
                    out = attend()
                    row[f"{key}_ms"] = median_ms(attend, param.device, iters=20)
                    row[f"{key}_max_abs_diff"] = (out.float() - ref).abs().max().item()
                except RuntimeError as e:  # this backend refuses the inputs (or is absent)
                    row[f"{key}_ms"] = f"refused: {str(e)[:120]}"
            print(f"[sam_probe] attention {row}", flush=True)
            rows.append(row)
    return rows


def probe_patch_embed(det, cfg) -> list[dict]:
    embed = det.backbone.vision_backbone.trunk.patch_embed
    param, rows = next(det.parameters()), []
    with torch.inference_mode():
        for b in (1, 8):
            px = torch.randn(b, 3, cfg.image_size, cfg.image_size, device=param.device).to(param.dtype)
            row = {"batch": b}
            outs = {}
            for path, as_gemm in (("conv", False), ("gemm", True)):
                embed.as_gemm = as_gemm

                def run(px=px):
                    return embed(px)

                outs[path] = run().float()
                row[f"{path}_eager_ms"] = median_ms(run, param.device, iters=30)
                if param.device.type == "cuda":  # inductor's CPU codegen would take minutes here
                    compiled = torch.compile(lambda x: embed(x).contiguous(), dynamic=False)
                    row[f"{path}_compiled_ms"] = median_ms(lambda px=px: compiled(px), param.device, iters=30)
                    torch._dynamo.reset()
            embed.as_gemm = None
            row["max_abs_diff"] = (outs["gemm"] - outs["conv"]).abs().max().item()
            row["max_abs"] = outs["conv"].abs().max().item()
            print(f"[sam_probe] patch_embed {row}", flush=True)
            rows.append(row)
    return rows


def probe_pair_gather(det, cfg) -> list[dict]:
    """The grounding batch's input gather at 8 pairs, full-size neck levels: the old way (the engine concatenated
    the batch's distinct images, then `index_select` into the graph's static buffers; waterfall run 14's profile:
    `indexSelectSmallIndex` ~0.8 ms a call, 1.8% of the GPU time) against `sammie.model.graphs.copy_rows` (one copy
    per run of adjacent rows, no concatenation): pairs in one image batch's order, and split over two batches."""
    from sammie.model.graphs import copy_rows

    param, rows = next(det.parameters()), []
    levels = [tuple(p.shape[-3:]) for p in det.backbone.vision_backbone.positions()]  # (d, h, w) per neck level
    with torch.inference_mode():
        batches = [[torch.randn(8, *shape, device=param.device).to(param.dtype) for shape in levels] for _ in range(2)]
        static = [torch.empty(8, *shape, device=param.device, dtype=param.dtype) for shape in levels]
        cases = {"one_batch_in_order": [(0, i) for i in range(8)],  # (batch, row) of each pair
                 "two_batches_5_3": [(0, 3 + i) for i in range(5)] + [(1, i) for i in range(3)]}
        for case, pairs in cases.items():
            views = [[batches[b][level][r:r + 1] for b, r in pairs] for level in range(len(levels))]
            index = torch.arange(8, device=param.device)

            def cat_then_select(views=views):
                for level, dst in enumerate(static):
                    torch.index_select(torch.cat(views[level]), 0, index, out=dst)

            def run_copies(views=views):
                for level, dst in enumerate(static):
                    copy_rows(dst, views[level])

            cat_then_select()
            want = [t.clone() for t in static]
            run_copies()
            row = {"case": case, "pairs": 8,
                   "mb_per_pair": round(sum(t[0].numel() * t.element_size() for t in static) / 1e6, 2),
                   "identical": all(torch.equal(a, b) for a, b in zip(static, want)),
                   "cat_index_select_ms": median_ms(cat_then_select, param.device, iters=30),
                   "copy_rows_ms": median_ms(run_copies, param.device, iters=30)}
            print(f"[sam_probe] pair_gather {row}", flush=True)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default="sam3")
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a dry run (tests: --config tiny, fp32)")
    ap.add_argument("--parts", default="sdpa,box_bias,attention_backends,patch_embed,pair_gather",
                    help="comma-separated parts to run")
    args = ap.parse_args()
    parts = {part.strip() for part in args.parts.split(",") if part.strip()}
    unknown = parts - set(ap.get_default("parts").split(","))
    if unknown:
        ap.error(f"unknown --parts {sorted(unknown)}; valid: {ap.get_default('parts')}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("sam_probe.py needs a CUDA device (or --device cpu for a dry run)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    det, cfg, tokenizer, _ = build_detector(None, PRESETS[args.config](), args.device, dtype, seed=0)
    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__}
    for name, fn in (("sdpa", lambda: probe_sdpa(det, tokenizer, cfg)),
                     ("box_bias", lambda: probe_box_bias(det, tokenizer, cfg)),
                     ("attention_backends", lambda: probe_attention_backends(det, cfg)),
                     ("patch_embed", lambda: probe_patch_embed(det, cfg)),
                     ("pair_gather", lambda: probe_pair_gather(det, cfg))):
        if name not in parts:
            continue
        try:
            result[name] = fn()
        except Exception as e:  # one part failing must not lose the other
            result[name] = {"error": repr(e), "traceback": traceback.format_exc()}
        (out / "sam_probe.json").write_text(json.dumps(result, indent=1))
    if "sdpa" not in result:
        return
    for site, c in (result["sdpa"].get("sites") or {}).items():
        print(f"[sam_probe] sdpa {site} x{c['calls']}: q {c['q']}, k {c['k']}, mask {c['mask']}", flush=True)
        for backend, verdict in c["verdicts"].items():
            print(f"[sam_probe]     {backend}: {verdict[:400]}", flush=True)
    print(f"[sam_probe] aten ops in ground: {result['sdpa'].get('aten_ops_in_ground')}", flush=True)
    for k in (result["sdpa"].get("ground_top_kernels_ms") or [])[:12]:
        print(f"[sam_probe] ground kernel {k[1]:8.3f} ms x{k[2]:4d} {k[0][:110]}", flush=True)
    if "error" in result["sdpa"]:
        print(result["sdpa"]["traceback"])


if __name__ == "__main__":
    main()
