"""Where a Qwen3.6 decode step spends its time: host (Python + launches) vs the GPU's kernels.

Full size, seeded random packed weights (speed does not depend on the values), a `--context`-token prompt per
stream, then for each batch size: wall time per decode step (synchronised), and under `torch.profiler` the number of
CUDA kernels per step, their summed device time per step, and the top kernels. If the summed kernel time is far
below the wall time, the step is launch-bound and CUDA graphs (plus fusion to cut the kernel count) are the remedy.

    python benchmarks/qwen_profile.py --out benchmarks/results/qwen_profile      # H200
    python benchmarks/qwen_profile.py --engine --batches "" --out DIR             # the graphed serving step
    python benchmarks/qwen_profile.py --engine-prefill --batches "" --out DIR     # the serving path's TTFT
    python benchmarks/qwen_profile.py --tiny --out /tmp/qwen_profile              # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.qwen_gpu import log, new_state, sync  # noqa: E402
from qwen_engine.config import QwenConfig  # noqa: E402
from qwen_engine.load_packed import load_quantized  # noqa: E402
from qwen_engine.random_weights import calibrate_fp8_input_scales, random_packed_tensors  # noqa: E402


def activities(device: torch.device) -> list:
    """What the profiler records: host ops, and the device's kernels on CUDA."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    return acts


def kernel_table(prof, steps: int, top: int = 20) -> dict:
    """Device-side events of the profiled steps -> per-step count and time, top kernels by total time."""
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if dev_us > 0 and e.count > 0 and getattr(e, "device_type", None) is not None and "CUDA" in str(
                e.device_type):
            rows.append((e.key, e.count, dev_us))
    if not rows:  # older key_averages: fall back to every event with device time
        rows = [(e.key, e.count, e.self_cuda_time_total) for e in prof.key_averages() if e.self_cuda_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    total_us = sum(r[2] for r in rows)
    return dict(kernels_per_step=sum(r[1] for r in rows) / steps, device_ms_per_step=total_us / steps / 1e3,
                top=[dict(name=n[:90], calls_per_step=c / steps, ms_per_step=us / steps / 1e3) for n, c, us in
                     rows[:top]])


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
               "aten::item", "aten::nonzero", "cudaMemcpy", "cudaMemcpyAsync")


def host_table(prof, top: int = 40) -> dict:
    """Host-side events: counts of the calls that can block the host on the device (syncs, `.item()`, `nonzero`,
    copies), the number of kernel launches, and the top host ops by self CPU time -- where a launch-bound step's
    host time goes."""
    syncs, launches, rows = {}, 0, []
    for e in prof.key_averages():
        if e.key in SYNC_EVENTS:
            syncs[e.key] = dict(count=e.count, self_cpu_ms=e.self_cpu_time_total / 1e3)
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"):
            launches += e.count
        if e.self_cpu_time_total > 0:
            rows.append((e.key, e.count, e.self_cpu_time_total))
    rows.sort(key=lambda r: -r[2])
    return dict(host_syncs=syncs, host_launches=launches,
                host_top=[dict(name=n[:90], calls=c, self_cpu_ms=us / 1e3) for n, c, us in rows[:top]])


@torch.no_grad()
def profile_decode(model, rand, batch: int, ctx: int, steps: int) -> dict:
    state = new_state(model, batch, ctx + 3 * steps + 8)
    tok = model(rand(batch, ctx), state, last_only=True)[:, -1].argmax(-1, keepdim=True)
    for _ in range(3):
        tok = model(tok, state)[:, -1].argmax(-1, keepdim=True)
    sync(tok.device)
    t = time.perf_counter()
    for _ in range(steps):
        tok = model(tok, state)[:, -1].argmax(-1, keepdim=True)
    sync(tok.device)
    wall_ms = 1e3 * (time.perf_counter() - t) / steps
    with torch.profiler.profile(activities=activities(tok.device)) as prof:
        for _ in range(steps):
            tok = model(tok, state)[:, -1].argmax(-1, keepdim=True)
        sync(tok.device)
    out = dict(batch=batch, context=ctx, wall_ms_per_step=wall_ms, tok_per_s=batch * 1e3 / wall_ms)
    if tok.is_cuda:
        out.update(kernel_table(prof, steps))
        out["launch_bound_share"] = 1 - out["device_ms_per_step"] / wall_ms
    return out


@torch.no_grad()
def profile_prefill(model, rand, ctx: int, reps: int = 2) -> dict:
    """One `ctx`-token prompt (batch 1, last-token logits): wall time and, profiled, kernels and device time."""
    def once():
        state = new_state(model, 1, ctx + 1)
        return model(rand(1, ctx), state, last_only=True)[:, -1].argmax(-1)

    once()
    sync(next(model.parameters()).device)
    t = time.perf_counter()
    for _ in range(reps):
        tok = once()
    sync(tok.device)
    wall_ms = 1e3 * (time.perf_counter() - t) / reps
    with torch.profiler.profile(activities=activities(tok.device)) as prof:
        tok = once()
        sync(tok.device)
    out = dict(batch=1, prompt_tokens=ctx, wall_ms=wall_ms)
    if tok.is_cuda:
        t = kernel_table(prof, 1)
        out.update(kernels=t["kernels_per_step"], device_ms=t["device_ms_per_step"], top=t["top"],
                   launch_bound_share=1 - t["device_ms_per_step"] / wall_ms)
    return out


def profile_engine_decode(model, cfg, device, rand, ctx: int, tokens: int = 16, streams: int = 1,
                          prefill_graphs: str = "auto") -> dict:
    """The serving path's decode step: a QwenEngine (decode graphs as configured by default: captured on CUDA) over
    `model`, `streams` concurrent `ctx`-token requests; once every one has its first token (all prefills done), the
    profiler records until the least-advanced stream has `tokens` more, every stream still decoding (a steady batch
    of `streams`), then the requests are dropped. Kernels launched by graph replays are counted like any others
    (CUPTI traces them)."""
    import asyncio

    from engine_core.continuous import SamplingParams
    from qwen_engine.engine import QwenEngine, QwenEngineConfig

    seqs = max(4, streams)
    margin = 8 + 2 * streams  # tokens past the window: early streams decode while later prompts prefill
    ecfg = QwenEngineConfig(config="tiny" if cfg.num_hidden_layers < 8 else "qwen3.6-35b-a3b", device=str(device),
                            dtype="bf16", max_num_seqs=seqs, max_num_batched_tokens=max(2048, ctx), block_size=16,
                            num_kv_blocks=seqs * ((ctx + tokens + margin) // 16 + 1),
                            max_model_len=ctx + tokens + margin,
                            request_timeout_s=None, warmup=True, prefill_graphs=prefill_graphs,
                            # PDL off: a kernel launched with it starts before its predecessor ends and waits in
                            # the kernel, so CUPTI's kernel times would overlap and count the waits (the sum of
                            # kernel times per step stays comparable with the profiles before it; the step's wall
                            # time without PDL is the one reported)
                            programmatic_launch=False)

    async def run() -> dict:
        engine = QwenEngine(ecfg, model=model)
        await engine.start()
        try:
            prof, counts, t0, first, launched = None, [0] * streams, None, [0] * streams, 0
            done = asyncio.Event()

            async def one(i: int) -> None:
                nonlocal prof, t0, first, launched
                # every stream must still be decoding when the window closes (a steady batch of `streams`)
                gen = engine.generate(rand(1, ctx)[0].tolist(), max_new_tokens=tokens + margin - 4,
                                      sampling=SamplingParams(), eos_token_ids=())
                try:
                    async for chunk in gen:
                        counts[i] += len(chunk.new_token_ids)
                        if prof is None and all(counts):  # every prefill is out: profile from here
                            if device.type == "cuda":
                                torch.cuda.synchronize()
                            prof = torch.profiler.profile(activities=activities(device))
                            prof.__enter__()
                            first, t0 = list(counts), time.perf_counter()
                            launched = engine.runner.launches  # steps launched before the window
                        if prof is not None and min(c - f for c, f in zip(counts, first)) >= tokens:
                            done.set()
                        if done.is_set():
                            break
                finally:
                    await gen.aclose()

            tasks = [asyncio.create_task(one(i)) for i in range(streams)]
            waiter = asyncio.create_task(done.wait())
            await asyncio.wait({waiter, *tasks}, return_when=asyncio.FIRST_COMPLETED)
            if not done.is_set():  # a stream failed or ended before the window filled: report it, do not hang
                waiter.cancel()
                for t in tasks:
                    if t.done() and t.exception() is not None:
                        raise t.exception()
                raise RuntimeError("a stream ended before the profile window filled (max_new_tokens too small?)")
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            prof.__exit__(None, None, None)
            # the steps whose kernels the window holds: those launched in it (the synchronise before it drained the
            # one in flight; async decode launches one past the last token read, hence one more than the tokens --
            # the 17 steps of a 16-token window that RESULTS normalised by hand from profile run 14 to run 17;
            # `steps_launched` and the per-step kernel numbers use them since 2026-12-01, after profile run 17).
            # To within one step: the counter is read on this thread while the worker may be mid-launch
            launched = engine.runner.launches - launched
            # every stream decoded in every step of the window: steps = the least-advanced stream's new tokens
            steps = min(c - f for c, f in zip(counts, first))
            produced = sum(c - f for c, f in zip(counts, first))
            await asyncio.gather(*tasks, return_exceptions=True)
            out = dict(context=ctx, streams=streams, steps=steps, steps_launched=launched,
                       wall_ms_per_step=1e3 * wall / steps,
                       tok_per_s=produced / wall, runner=engine.health().get("runner"),
                       kernel_checks=engine.health().get("kernel_checks"))
            if device.type == "cuda":
                out.update(kernel_table(prof, launched or steps, top=80))  # per launched step
            return out
        finally:
            await engine.aclose()

    return asyncio.run(run())


def profile_engine_prefill(model, cfg, device, rand, ctx: int, reps: int = 3, trace_path: Path | None = None,
                           prefill_graphs: str = "auto", prefill_buckets: tuple[int, ...] = (), burst: int = 1) -> dict:
    """The serving path's time to first token: a QwenEngine (paged prefill: fla's GDN prefill on CUDA, the
    scheduler's chunking) over `model`, lone `ctx`-token requests of one output token; `reps` timed (TTFT median and
    all), then one under the profiler (kernels and device time of the whole request, prefill chunks + first
    sample), with the host's side (`host_table`: syncs, top host ops) and, given `trace_path`, a Chrome trace.
    `burst` > 1: each "request" is that many `ctx`-token requests submitted at once (the engine's default token
    budget of 2,048 per step, so multi-sequence prefill steps: no prefill graph), TTFTs per request and the plans'
    tokens and sequences per step recorded -- where a burst's first tokens wait (H200 run 31: 32 x 1k prompts, TTFT
    p50 7.3 s, max 11.9 s, against 40 ms for a lone one)."""
    import asyncio

    from engine_core.continuous import SamplingParams
    from qwen_engine.engine import QwenEngine, QwenEngineConfig

    ecfg = QwenEngineConfig(config="tiny" if cfg.num_hidden_layers < 8 else "qwen3.6-35b-a3b", device=str(device),
                            dtype="bf16", max_num_seqs=max(4, burst), max_num_batched_tokens=max(2048, ctx),
                            block_size=16, num_kv_blocks=max(4, burst) * ((ctx + 64) // 16 + 1), max_model_len=ctx + 64,
                            request_timeout_s=None, warmup=True, prefill_graphs=prefill_graphs,
                            prefill_buckets=prefill_buckets,
                            programmatic_launch=False)  # kernel times without PDL's overlap (profile_engine_decode)

    async def run() -> dict:
        engine = QwenEngine(ecfg, model=model)
        t_start = time.perf_counter()
        await engine.start()
        start_s = time.perf_counter() - t_start
        log(f"engine started in {start_s:.1f} s: {engine.runner.stats()}")
        try:
            async def first_token(ids: list[int], t0: float) -> float:
                async for _ in engine.generate(ids, max_new_tokens=1, sampling=SamplingParams(), eos_token_ids=()):
                    pass
                return 1e3 * (time.perf_counter() - t0)

            burst_ttfts: list[list[float]] = []

            async def one() -> float:
                """A lone request's TTFT ms, or (burst) the last of `burst` requests submitted together."""
                t0 = time.perf_counter()
                prompts = rand(burst, ctx).tolist()
                ttfts = await asyncio.gather(*(first_token(ids, t0) for ids in prompts))
                burst_ttfts.append(sorted(ttfts))
                return max(ttfts)

            seen: list = []  # (plan, host ms of its launch) of every step the engine runs
            launch = engine.runner.launch

            def recording(plan, *a, **kw):  # every step goes through launch (execute = result(launch(plan))); it was
                t = time.perf_counter()  # execute that was recorded, empty since async_decode became the default
                result = launch(plan, *a, **kw)
                seen.append((plan, 1e3 * (time.perf_counter() - t)))
                return result

            engine.runner.launch = recording
            await one()  # warm the shapes
            ttfts = sorted([await one() for _ in range(reps)])
            sync(device)
            n_before = len(seen)
            with torch.profiler.profile(activities=activities(device)) as prof:
                wall = await one()
                if device.type == "cuda":
                    torch.cuda.synchronize()
            out = dict(prompt_tokens=ctx, burst=burst, ttft_ms_median=ttfts[len(ttfts) // 2], ttft_ms=ttfts,
                       burst_ttft_ms=burst_ttfts[1:] if burst > 1 else None,  # (the first: the warm-up burst)
                       profiled_wall_ms=wall, kernel_checks=engine.health().get("kernel_checks"),
                       runner=engine.runner.stats(), engine_start_s=start_s)
            if device.type == "cuda":
                t = kernel_table(prof, 1, top=60)
                out.update(t, launch_bound_share=1 - t["device_ms_per_step"] / wall)
            # the host side: the engine runs its steps on a worker thread, which the profiler's host events miss, so
            # the profiled request's plans run again here, on this thread (a finished request's blocks and state slot
            # are free; the plan's reset_state zeroes the slot first)
            plans = [p for p, _ in seen[n_before:]]
            out["plans"] = [dict(seqs=len(p.seqs), tokens=sum(len(s.token_ids) for s in p.seqs),
                                 launch_ms=ms) for p, ms in seen[n_before:]]  # host time to queue the step
            if plans:
                for plan in plans:  # warm, then timed
                    engine.runner.execute(plan)
                sync(device)
                t0 = time.perf_counter()
                for plan in plans:
                    engine.runner.execute(plan)
                sync(device)
                out["execute_main_thread_ms"] = 1e3 * (time.perf_counter() - t0)
                with torch.profiler.profile(activities=activities(device)) as prof2:
                    for plan in plans:
                        engine.runner.execute(plan)
                    sync(device)
                out.update(host_table(prof2))
                if trace_path is not None:
                    prof2.export_chrome_trace(str(trace_path))
            return out
        finally:
            await engine.aclose()

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/qwen_profile")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prefill", action="store_true", help="also profile one --context-token prefill")
    ap.add_argument("--engine", action="store_true",
                    help="also profile the serving engine's decode steps (CUDA graphs on a GPU)")
    ap.add_argument("--engine-streams", default="1",
                    help="comma-separated concurrent request counts for --engine (e.g. 1,32)")
    ap.add_argument("--engine-prefill", action="store_true",
                    help="also profile the serving engine's time to first token for one --context-token request")
    ap.add_argument("--engine-burst", type=int, default=0,
                    help="also profile N concurrent --context-token requests submitted at once (multi-sequence "
                         "prefill: where a burst's first tokens wait)")
    ap.add_argument("--prefill-graphs", default="auto",
                    help="the engine's prefill_graphs mode (--engine-prefill; --engine too: 'off' saves the capture's "
                         "start-up time where only decode steps are profiled)")
    ap.add_argument("--prefill-buckets", default="",
                    help="--engine-prefill: the engine's prefill_buckets, e.g. 1024 (default: the engine's)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    cfg = QwenConfig.tiny() if args.tiny else QwenConfig()
    ctx = 16 if args.tiny else args.context
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = load_quantized(random_packed_tensors(cfg, device, seed=0, dtype=torch.bfloat16), cfg, device,
                           torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    rand = lambda *shape: torch.randint(0, cfg.vocab_size, shape, generator=g).to(device)  # noqa: E731
    calibrate_fp8_input_scales(model, rand(1, min(ctx, 256)))
    r = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
             path="QwenForCausalLM.forward + QwenState, eager", runs=[])
    if args.prefill:
        log(f"profiling a {ctx}-token prefill")
        r["prefill"] = profile_prefill(model, rand, ctx)
        log(json.dumps({k: v for k, v in r["prefill"].items() if k != "top"}))
        for row in r["prefill"].get("top", [])[:15]:
            print(f"  prefill {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['name']}")
        (out_dir / "qwen_profile.json").write_text(json.dumps(r, indent=2))
    if args.engine_prefill:
        log(f"profiling the engine's time to first token, {ctx}-token prompt")
        buckets = tuple(int(b) for b in args.prefill_buckets.split(",") if b)
        r["engine_prefill"] = profile_engine_prefill(model, cfg, device, rand, ctx,
                                                     trace_path=out_dir / "engine_prefill_trace.json",
                                                     prefill_graphs=args.prefill_graphs, prefill_buckets=buckets)
        log(json.dumps({k: v for k, v in r["engine_prefill"].items() if k not in ("top", "host_top")}))
        for row in r["engine_prefill"].get("top", [])[:25]:
            print(f"  engine_prefill {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['name']}")
        for row in r["engine_prefill"].get("host_top", [])[:25]:
            print(f"  engine_prefill host {row['self_cpu_ms']:8.3f} ms  x{row['calls']:6d}  {row['name']}")
        (out_dir / "qwen_profile.json").write_text(json.dumps(r, indent=2))
    if args.engine_burst > 1:
        log(f"profiling a burst of {args.engine_burst} x {ctx}-token requests")
        r["engine_burst"] = profile_engine_prefill(model, cfg, device, rand, ctx, reps=1, burst=args.engine_burst,
                                                   prefill_graphs=args.prefill_graphs)
        log(json.dumps({k: v for k, v in r["engine_burst"].items() if k not in ("top", "host_top", "plans")}))
        for p in r["engine_burst"].get("plans", []):
            print(f"  engine_burst step: {p['seqs']:3d} seqs {p['tokens']:5d} tokens, launched in {p['launch_ms']:9.1f} ms")
        for row in r["engine_burst"].get("top", [])[:25]:
            print(f"  engine_burst {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['name']}")
        for row in r["engine_burst"].get("host_top", [])[:25]:
            print(f"  engine_burst host {row['self_cpu_ms']:8.3f} ms  x{row['calls']:6d}  {row['name']}")
        (out_dir / "qwen_profile.json").write_text(json.dumps(r, indent=2))
    for n in (int(x) for x in args.engine_streams.split(",") if x) if args.engine else ():
        log(f"profiling the engine's decode steps, {n} stream(s)")
        key = "engine" if n == 1 else f"engine_{n}"
        r[key] = profile_engine_decode(model, cfg, device, rand, ctx, streams=n, prefill_graphs=args.prefill_graphs)
        log(json.dumps({k: v for k, v in r[key].items() if k != "top"}))
        for row in r[key].get("top", [])[:40]:
            print(f"  {key} {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['name']}")
        (out_dir / "qwen_profile.json").write_text(json.dumps(r, indent=2))
    for b in (int(x) for x in args.batches.split(",") if x):
        log(f"profiling decode at batch {b}")
        r["runs"].append(profile_decode(model, rand, b, ctx, args.steps))
        log(json.dumps({k: v for k, v in r["runs"][-1].items() if k != "top"}))
        (out_dir / "qwen_profile.json").write_text(json.dumps(r, indent=2))
    for run in r["runs"]:
        for row in run.get("top", [])[:12]:
            print(f"  b={run['batch']:>3} {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['name']}")


if __name__ == "__main__":
    main()
