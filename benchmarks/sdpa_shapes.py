"""What a new shape costs the prefill attention's SDPA call, per backend (issue 5: the first burst of concurrent
prompts after start).

The Qwen engine's eager prefill attends each prompt chunk with `F.scaled_dot_product_attention` (GQA 16:2 heads,
head_dim 256): from position 0 causally, or -- a chunk that continues its prompt -- with a boolean mask whose
diagonal is shifted by the keys before it. Chunked prefill cuts prompts wherever the step's token budget ends, so a
burst of requests makes a new (queries, keys) shape nearly every step. A backend that builds a plan per shape (cuDNN's
SDPA graphs) then pays that build on the hot path; the second engine in a process (the same shapes again) did not:
Qwen runs 33-34, the last of 32 concurrent 1k prompts' first token at 17.2-17.8 s in a process's first engine, 4.0-4.7
s in its second.

For each backend set and each case, `--shapes` distinct random (t, ctx) pairs: the first call's and the second
call's time (ms, synchronised), and the largest difference from the math backend's output in fp32.

    python benchmarks/sdpa_shapes.py --out DIR        # CUDA; --tiny: CPU dry run (math only)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

BACKEND_SETS = {  # name -> the backends SDPA may pick from (None: torch's default priority)
    "default": None,
    "no_cudnn": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


def attend(q, k, v, past: int, case: str, scale: float) -> torch.Tensor:
    """q [1, H, t, D], k/v [1, KV, ctx, D] (ctx = past + t). case "causal": past = 0, is_causal; "mask": the
    engine's boolean mask (token j sees keys 0..past+j); "lower_right": the same mask as torch's CausalBias."""
    t, ctx = q.shape[2], k.shape[2]
    if case == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    if case == "mask":
        mask = torch.ones(t, ctx, dtype=torch.bool, device=q.device).tril(diagonal=past)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    # CausalBias does not take enable_gqa: the kv heads repeated to the query heads
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=causal_lower_right(t, ctx), scale=scale)


def timed(fn, device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", type=int, default=12)
    ap.add_argument("--tiny", action="store_true", help="CPU, small heads, math backend only (dry run)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    h, kvh, d = (4, 2, 16) if args.tiny else (16, 2, 256)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    scale = d ** -0.5
    rng = random.Random(0)
    shapes = [(rng.randint(2, 1100), rng.randint(0, 1100)) for _ in range(args.shapes)]  # (t, past)
    sets = {"math": [SDPBackend.MATH]} if args.tiny else BACKEND_SETS
    results = []
    for case in ("causal", "mask", "lower_right"):
        for name, backends in sets.items():
            first, second, errs, error = [], [], [], None
            for t, past in shapes:
                past = 0 if case == "causal" else past
                g = torch.Generator(device=device).manual_seed(t * 7919 + past)
                q = torch.randn(1, h, t, d, device=device, dtype=dtype, generator=g)
                k = torch.randn(1, kvh, past + t, d, device=device, dtype=dtype, generator=g)
                v = torch.randn(1, kvh, past + t, d, device=device, dtype=dtype, generator=g)

                def run(q=q, k=k, v=v, past=past, backends=backends):
                    if backends is None:
                        return attend(q, k, v, past, case, scale)
                    with sdpa_kernel(backends):
                        return attend(q, k, v, past, case, scale)
                try:
                    a, out = timed(run, device)
                    b, _ = timed(run, device)
                except Exception as e:  # noqa: BLE001 - recorded: this backend set cannot serve the case
                    error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    break
                with sdpa_kernel([SDPBackend.MATH]):
                    ref = attend(q.float(), k.float(), v.float(), past, case, scale)
                first.append(a), second.append(b), errs.append(float((out.float() - ref).abs().max()))
            row = dict(case=case, backends=name, error=error, shapes=len(first),
                       first_ms_sum=round(sum(first), 2), second_ms_sum=round(sum(second), 2),
                       first_ms=[round(x, 2) for x in first], max_abs_err=max(errs) if errs else None)
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "first_ms"}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sdpa_shapes.json").write_text(json.dumps(dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
        heads=[h, kvh, d], dtype=str(dtype), shapes=shapes, results=results), indent=1))


if __name__ == "__main__":
    main()
