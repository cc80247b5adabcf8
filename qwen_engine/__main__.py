"""Command line: `python -m qwen_engine serve [...]` (OpenAI-compatible server on a local Ray).

For a cluster, or the tuned single-GPU settings, use the YAMLs: `serve run serve_configs/qwen_h200.yaml`.
"""

from __future__ import annotations

import argparse
import logging
import sys


def tiny_checkpoint(path: str, seed: int = 0) -> str:
    """Write the CPU demo / CI model to `path` (a BF16 checkpoint directory) and return `path`.

    The `tiny` preset (4 layers, hidden 64) with the real vocabulary size (248,320 rows) instead of its 512: the
    Qwen3.6 tokenizer emits ids up to 248,076, so a smaller embedding could not take real prompts. The two vocabulary
    matrices are 2 x 248,320 x 64 values (64 MB in BF16); a forward pass stays cheap on a CPU. EOS is <|im_end|>."""
    from qwen_engine.checkpoint import save_checkpoint
    from qwen_engine.config import QwenConfig
    from qwen_engine.engine import randomise
    from qwen_engine.model import QwenForCausalLM

    cfg = QwenConfig.tiny(vocab_size=QwenConfig.vocab_size, eos_token_id=248046)
    model = QwenForCausalLM(cfg)
    randomise(model, seed)
    save_checkpoint(path, cfg, model.state_dict(), recipe=None, return_weights=False)
    return path


def cmd_serve(args) -> int:
    """Start a local Ray, Serve on host:port and the app; block until Ctrl-C (or SIGTERM), then shut down."""
    import os

    from engine_core.local_serve import on_cuda, parse_set, serve_locally

    config = args.config
    if config == "auto":
        # Full size with a checkpoint or a GPU; on a CPU-only machine without weights the 35B model would take
        # minutes per token on random numbers, so the tiny random model stands in.
        config = "qwen3.6-35b-a3b" if (args.checkpoint or on_cuda(args.device)) else "tiny"
    engine_args = {"config": config, "checkpoint": args.checkpoint, "device": args.device, "dtype": args.dtype,
                   "max_model_len": args.max_model_len}
    if args.model_name:
        engine_args["served_model_name"] = args.model_name
    engine_args |= parse_set(args.set)
    from qwen_engine.serve import split_args

    engine_cfg, server_cfg = split_args(engine_args)  # fail on a typo before writing weights or starting Ray
    if engine_cfg.config == "tiny" and engine_cfg.checkpoint is None:
        # the tiny preset's 512-row embedding cannot take the real tokenizer's ids: write it with the full vocabulary
        import dataclasses
        import tempfile

        checkpoint = tiny_checkpoint(tempfile.mkdtemp(prefix="qwen-tiny-"), engine_cfg.seed)
        print(f"tiny random model with the full vocabulary written to {checkpoint}", file=sys.stderr)
        engine_cfg = dataclasses.replace(engine_cfg, checkpoint=checkpoint)
    from qwen_engine.serve import make_app

    # GPU: one GPU and a few CPUs. CPU: every core (Ray sets the replica's OMP_NUM_THREADS to its num_cpus).
    actor = {"num_cpus": 4, "num_gpus": 1} if on_cuda(engine_cfg.device) else {"num_cpus": os.cpu_count() or 1,
                                                                               "num_gpus": 0}
    return serve_locally(
        make_app(engine_cfg, server_cfg, ray_actor_options=actor), name="qwen", host=args.host, port=args.port,
        dashboard=args.dashboard, access_log=args.access_log,
        banner=f"Qwen ({server_cfg.served_model_name!r}) is serving on http://{args.host}:{args.port} "
               "(POST /v1/completions, /v1/chat/completions; GET /v1/models, /readyz, /docs); Ctrl-C to stop")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="qwen_engine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API on a local Ray",
                       description="Starts a local Ray and the Qwen app; Ctrl-C stops both. For clusters use "
                                   "`serve run serve_configs/qwen_h200.yaml`.")
    p.add_argument("--config", default="auto", choices=["auto", "qwen3.6-35b-a3b", "tiny"],
                   help="model preset; auto: qwen3.6-35b-a3b with a checkpoint or a GPU, else tiny (CPU demo: random "
                        "weights, written as a temporary checkpoint with the real vocabulary size)")
    p.add_argument("--checkpoint", default=None, help="checkpoint directory (config.json wins over --config); "
                                                      "default: random weights")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda if available)")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"])
    p.add_argument("--max-model-len", type=int, default=8192, help="prompt + completion tokens per sequence")
    p.add_argument("--model-name", default=None, help="served model name (default Qwen/Qwen3.6-35B-A3B)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other QwenEngineConfig / ServerConfig field, e.g. --set max_num_seqs=64 (repeatable)")
    p.add_argument("--dashboard", action="store_true", help="also start Ray's dashboard")
    p.add_argument("--access-log", action="store_true", help="log one line per request in the HTTP proxy")
    p.set_defaults(func=cmd_serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
