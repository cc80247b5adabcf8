"""The fp32 full-width oracle layer by layer: our packed model in fp32 (the registry's references, FP8 layers
weight-only) against transformers' fp32 `Qwen3_5MoeForCausalLM` holding the identical dequantised weights, at the real
model's width (hidden 2048, 256 experts, vocab 248k) and `--layers` deep -- each decoder layer's output compared, so
that a disagreement is located (the layer and its type), in a fresh process (no engine has set process-wide flags),
with cuDNN's and cuBLAS's TF32 as PyTorch's defaults and then both off.

    python benchmarks/qwen_fp32_oracle.py --out benchmarks/results/qwen_fp32_oracle [--hf-gdn any]   # GPU; ~1-2 min

Why: the fifty-fourth session's full run (results/qwen_full54_run3) measured the 8-layer fp32 oracle at max relative
error 0.196 (top-1 87.5%), where Qwen run 3 (2026-11-30) had 4.1e-6. Found with this script (results/
qwen_fp32_oracle54_run4, H100): transformers had taken fla's chunk kernel (fla is carried to the GPU machine since
the eleventh session, for our prefill), which is not fp32-exact -- 0.196 with it, 4.06e-6 with transformers'
pure-torch code (--hf-gdn torch, the default here and in qwen_gpu.py), TF32 settings and a prior engine immaterial.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rel(a, b) -> float:
    """max |a - b| / max |b| over fp32 copies."""
    a, b = a.float(), b.float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/qwen_fp32_oracle")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="the tiny config on the CPU (a dry run)")
    ap.add_argument("--hf-gdn", choices=("torch", "any"), default="torch",
                    help="torch: transformers' Gated DeltaNet on its pure-torch code (fla and causal_conv1d made "
                         "unimportable before transformers' model module loads); any: whatever it finds (fla's Triton "
                         "chunk kernel where fla is installed, as on the GPU machine)")
    args = ap.parse_args()
    if args.hf_gdn == "torch":
        from benchmarks.qwen_gpu import block_gdn_kernels

        block_gdn_kernels()
    import torch

    from benchmarks.qwen_gpu import fp32_models, reference_kernels
    from qwen_engine.config import QwenConfig

    device = torch.device("cpu" if args.tiny else "cuda")
    base = QwenConfig.tiny() if args.tiny else QwenConfig()  # the default: Qwen3.6-35B-A3B
    layers = min(args.layers, base.num_hidden_layers) if args.tiny else args.layers
    cfg, model, hf = fp32_models(base, layers, device, args.seed)
    g = torch.Generator().manual_seed(args.seed + 2)
    ids = torch.randint(0, cfg.vocab_size, (2, args.tokens), generator=g).to(device)

    outs: dict[str, list] = {"ours": [], "hf": []}

    def hook(key):
        return lambda mod, inp, out: outs[key].append((out[0] if isinstance(out, tuple) else out).detach())

    handles = [layer.register_forward_hook(hook("ours")) for layer in model.layers]
    handles += [layer.register_forward_hook(hook("hf")) for layer in hf.model.layers]
    rows = []
    # the process-wide settings a default engine leaves (qwen_gpu.py's oracle runs after them); with --hf-gdn torch
    # fla is already unimportable here, so this engine is built without it (fla's own import-time effects: --hf-gdn any)
    def engine_flags():
        from qwen_engine.engine import QwenEngine, QwenEngineConfig

        QwenEngine(QwenEngineConfig(config="tiny", device=str(device), dtype="bf16", warmup=False,
                                    kernel_self_check=False, max_num_seqs=2, num_kv_blocks=16, max_model_len=64))

    for label, tf32, before_run in (("tf32 defaults", None, None), ("tf32 off", False, None),
                                    ("after a default engine's constructor", None, engine_flags)):
        if before_run is not None:
            before_run()
        saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        if tf32 is not None:
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            for v in outs.values():
                v.clear()
            with torch.no_grad(), reference_kernels():
                ours = model(ids)
                ref = hf(ids).logits
        finally:
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
        row = dict(variant=label, cudnn_tf32=torch.backends.cudnn.allow_tf32 if tf32 is None else tf32,
                   matmul_tf32=torch.backends.cuda.matmul.allow_tf32 if tf32 is None else tf32,
                   logits_max_rel=rel(ours, ref),
                   top1_pct=100.0 * float((ours.argmax(-1) == ref.argmax(-1)).float().mean()),
                   layers=[dict(layer=i, type=cfg.layer_types[i], max_rel=rel(a, b))
                           for i, (a, b) in enumerate(zip(outs["ours"], outs["hf"]))])
        rows.append(row)
        print(json.dumps(row), flush=True)
    for h in handles:
        h.remove()
    out = Path(args.out) / args.hf_gdn
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                transformers=transformers.__version__, layers=layers, tokens=args.tokens, seed=args.seed,
                hf_gdn=args.hf_gdn)
    (out / "qwen_fp32_oracle.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
