"""Where a Qwen3.6 decode step spends its time: host (Python + launches) vs the GPU's kernels.

Full size, seeded random packed weights (speed does not depend on the values), a `--context`-token prompt per
stream, then for each batch size: wall time per decode step (synchronised), and under `torch.profiler` the number of
CUDA kernels per step, their summed device time per step, and the top kernels. If the summed kernel time is far
below the wall time, the step is launch-bound and CUDA graphs (plus fusion to cut the kernel count) are the remedy.

    python benchmarks/qwen_profile.py --out benchmarks/results/qwen_profile      # H200
    python benchmarks/qwen_profile.py --engine --batches "" --out DIR             # the graphed serving step
    python benchmarks/qwen_profile.py --engine-prefill --batches "" --out DIR     # the serving path's TTFT
    python benchmarks/qwen_profile.py --tiny --out /tmp/qwen_profile              # CPU dry run
    python benchmarks/qwen_profile.py --engine --engine-pdl --batches "" --out DIR   # critical path with PDL on

The engine's decode profile also gives a critical path by end-time deltas (`critical_path_table`): on the main
stream, kernel i (by start time) adds delta_i = end_i - (latest end of the kernels before it) to the step, which
stays meaningful with programmatic dependent launch (`--engine-pdl`), where kernels start early and wait inside,
so their durations overlap. CUPTI adds overhead per kernel, so the deltas' sum under the profiler exceeds the
un-profiled step's wall time: the ranking of the kernels is what the table is for, not its absolute sum.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

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


class KernelRecord(NamedTuple):
    """One device kernel of a profile: its name, CUDA stream id, start and end times in us (trace clock)."""
    name: str
    stream: int | str  # "merged": see critical_path_table
    start_us: float
    end_us: float


TRACE_KERNEL_CATS = ("kernel", "Kernel")  # kineto's kernel category (memcpy/memset: "gpu_memcpy", "gpu_memset")


def kernel_records_from_trace(path: str | Path) -> list[KernelRecord]:
    """The kernels of a Chrome trace written by `prof.export_chrome_trace` (plain or gzipped JSON): events of category
    "kernel" with "ts" and "dur" in us and the stream in "args" (else the event's "tid"). Copies, memsets, host
    events and flow arrows are left out."""
    path = Path(path)
    with path.open("rb") as f:
        gz = f.read(2) == b"\x1f\x8b"  # gzip's magic bytes, whatever the file's suffix
    with (gzip.open(path, "rt") if gz else path.open()) as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data  # an object, or a bare event list
    records = []
    for e in events:
        if e.get("cat") not in TRACE_KERNEL_CATS or "ts" not in e or "dur" not in e:
            continue
        stream = (e.get("args") or {}).get("stream", e.get("tid"))
        start = float(e["ts"])
        records.append(KernelRecord(str(e.get("name", "")), stream, start, start + float(e["dur"])))
    return records


def chain_walk(records: list[KernelRecord]) -> list[tuple[float, float, str | None]]:
    """Kernels of one stream sorted by start -> per kernel (delta us, idle us, name of the kernel that ended last
    before it). delta = its end - the latest end before it (>= 0; the first kernel's: its duration); idle = its start
    - that latest end (>= 0): time the stream ran nothing. Under PDL a kernel starts before the latest end, so its
    idle is 0 while its delta is still the time it added. Sum of deltas = last end - first start (the span); deltas
    - idles = the stream's busy time (the union of its kernels' intervals)."""
    out, prev_end, prev_name = [], None, None
    for r in records:
        base = r.start_us if prev_end is None else prev_end
        idle = 0.0 if prev_end is None else max(0.0, r.start_us - prev_end)
        out.append((max(0.0, r.end_us - base), idle, prev_name))
        if prev_end is None or r.end_us >= prev_end:
            prev_end, prev_name = r.end_us, r.name
    return out


def by_start(records) -> list[KernelRecord]:
    """Sorted by start, then end (us): the chain order of a stream's kernels."""
    return sorted(records, key=lambda r: (r.start_us, r.end_us))


def critical_path_table(events: list[KernelRecord], steps: int, top: int = 60, gaps: int = 10) -> dict:
    """Kernel records of `steps` profiled steps -> the critical path by end-time deltas (`chain_walk`) of the main
    stream (the one with the most kernels: the step's dependency chain), per kernel name sorted by summed delta;
    the other streams' kernels (the shared expert's side stream) overlap it, so they get their summed durations
    instead. Per step: ms; per call: us. An empty list gives an empty table (a CPU run has no kernels). Where no
    stream holds half the kernels (graph replays), all are merged into one chain, stream "merged"."""
    steps = max(1, steps)
    per_stream: dict = {}
    for r in events:
        per_stream.setdefault(r.stream, []).append(r)
    if per_stream and max(len(v) for v in per_stream.values()) * 2 < len(events):
        # no stream holds half the kernels: a CUDA graph's replay spreads its nodes over the driver's internal
        # streams (H200 profile run 22: 38 of 513 a step on the busiest), so the stream says nothing about the chain.
        # Then every kernel is walked as one chain: the side branch's kernels (shared expert) take the deltas of the
        # stretches they end in, so the rows rank the step's kernels rather than isolate the critical path
        events = [KernelRecord(r.name, "merged", r.start_us, r.end_us) for r in events]
        per_stream = {"merged": events}
    streams, walks = {}, {}  # walks: stream -> (its kernels by start, their chain_walk)
    for s, recs in per_stream.items():
        chain = by_start(recs)
        walks[s] = chain, chain_walk(chain)
        streams[str(s)] = dict(kernels_per_step=len(recs) / steps,
                               kernel_ms_per_step=sum(r.end_us - r.start_us for r in recs) / steps / 1e3,
                               busy_ms_per_step=sum(d - i for d, i, _ in walks[s][1]) / steps / 1e3)  # union
    # the main stream: the most kernels (a tie: the more kernel time, then the id's text, for a stable choice)
    main = min(per_stream, key=lambda s: (-len(per_stream[s]), -streams[str(s)]["kernel_ms_per_step"], str(s)),
               default=None)
    chain, walk = walks.get(main, ([], []))
    rows: dict = {}  # name -> [calls, delta us, idle us, duration us]
    for r, (delta, idle, _) in zip(chain, walk):
        row = rows.setdefault(r.name, [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += delta
        row[2] += idle
        row[3] += r.end_us - r.start_us
    delta_us, idle_us = sum(d for d, _, _ in walk), sum(i for _, i, _ in walk)
    table = [dict(name=n[:90], calls_per_step=c / steps, delta_ms_per_step=d / steps / 1e3,
                  idle_ms_per_step=i / steps / 1e3, delta_us_per_call=d / c, dur_us_per_call=t / c)
             for n, (c, d, i, t) in sorted(rows.items(), key=lambda kv: (-kv[1][1], kv[0]))]
    # the largest idle gaps of the main stream: between steps (host work, syncs) or launch-bound stretches
    gap_rows = sorted(((i, prev, r.name) for r, (_, i, prev) in zip(chain, walk) if i > 0), key=lambda g: -g[0])
    return dict(main_stream=main, streams=streams, kernels_per_step=len(chain) / steps,
                delta_ms_per_step=delta_us / steps / 1e3,  # ~ the step's wall time (plus CUPTI's overhead)
                idle_ms_per_step=idle_us / steps / 1e3,  # the main stream ran nothing
                in_kernel_ms_per_step=(delta_us - idle_us) / steps / 1e3,
                idle_share=idle_us / delta_us if delta_us > 0 else None,
                top=table[:top], side=side_table(events, main, steps, top),
                top_gaps=[dict(gap_us=i, after=(a or "")[:90], before=b[:90]) for i, a, b in gap_rows[:gaps]])


def side_table(events: list[KernelRecord], main, steps: int, top: int) -> dict:
    """The kernels off the main stream (they overlap the chain, so no deltas): per name, calls and summed duration
    per step (ms), mean duration per call (us), sorted by summed duration."""
    rows: dict = {}  # name -> [calls, duration us]
    for r in events:
        if r.stream != main:
            row = rows.setdefault(r.name, [0, 0.0])
            row[0] += 1
            row[1] += r.end_us - r.start_us
    total_calls, total_us = sum(c for c, _ in rows.values()), sum(t for _, t in rows.values())
    table = [dict(name=n[:90], calls_per_step=c / steps, dur_ms_per_step=t / steps / 1e3, dur_us_per_call=t / c)
             for n, (c, t) in sorted(rows.items(), key=lambda kv: (-kv[1][1], kv[0]))]
    return dict(kernels_per_step=total_calls / steps, kernel_ms_per_step=total_us / steps / 1e3, top=table[:top])


def profile_critical_path(prof, steps: int, keep: Path | None = None) -> dict:
    """A finished profiler's Chrome trace (written to a temporary file; gzipped to `keep` when given: several MB)
    -> `critical_path_table`."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d) / "trace.json"
        prof.export_chrome_trace(str(tmp))
        records = kernel_records_from_trace(tmp)
        if keep is not None:
            with tmp.open("rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return critical_path_table(records, steps)


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
                          prefill_graphs: str = "auto", programmatic_launch: bool = False,
                          trace_path: Path | None = None, settings: dict | None = None) -> dict:
    """The serving path's decode step: a QwenEngine (decode graphs as configured by default: captured on CUDA) over
    `model`, `streams` concurrent `ctx`-token requests; once every one has its first token (all prefills done), the
    profiler records until the least-advanced stream has `tokens` more, every stream still decoding (a steady batch
    of `streams`), then the requests are dropped. Kernels launched by graph replays are counted like any others
    (CUPTI traces them). `critical_path`: `critical_path_table` of the window's kernels (per launched step; `pdl`:
    whether PDL was in force). `programmatic_launch` False by default (the kernel table's times without PDL's
    overlap); True for the critical path with PDL. `trace_path`: also keep the window's Chrome trace there
    (gzipped)."""
    import asyncio

    from kernels import pdl

    from engine_core.continuous import SamplingParams
    from qwen_engine.engine import QwenEngine, QwenEngineConfig

    seqs = max(4, streams)
    margin = 8 + 2 * streams  # tokens past the window: early streams decode while later prompts prefill
    ecfg = QwenEngineConfig(config="tiny" if cfg.num_hidden_layers < 8 else "qwen3.6-35b-a3b", device=str(device),
                            dtype="bf16", max_num_seqs=seqs, max_num_batched_tokens=max(2048, ctx), block_size=16,
                            num_kv_blocks=seqs * ((ctx + tokens + margin) // 16 + 1),
                            max_model_len=ctx + tokens + margin,
                            request_timeout_s=None, warmup=True, prefill_graphs=prefill_graphs,
                            # PDL off by default: a kernel launched with it starts before its predecessor ends and
                            # waits in the kernel, so CUPTI's kernel times would overlap and count the waits (the
                            # sum of kernel times per step stays comparable with the profiles before it; the step's
                            # wall time without PDL is the one reported). On (--engine-pdl): read critical_path
                            programmatic_launch=programmatic_launch, **(settings or {}))

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
            health = engine.health()
            on = bool(health.get("programmatic_launch"))  # in force: off on a CPU even when asked for
            out = dict(context=ctx, streams=streams, steps=steps, steps_launched=launched,
                       wall_ms_per_step=1e3 * wall / steps,
                       tok_per_s=produced / wall, runner=health.get("runner"),
                       kernel_checks=health.get("kernel_checks"), pdl=on)
            if device.type == "cuda":
                out.update(kernel_table(prof, launched or steps, top=80))  # per launched step
            out["critical_path"] = dict(pdl=on, **profile_critical_path(prof, launched or steps, keep=trace_path))
            return out
        finally:
            await engine.aclose()

    was = pdl.enabled()
    try:
        return asyncio.run(run())
    finally:
        pdl.set_enabled(was)  # process-wide: the eager profiles after this one run as before it


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


def print_critical_path(key: str, cp: dict, rows: int = 40) -> None:
    """The critical path's summary, its top `rows` main-stream kernels by summed delta, then the side streams'."""
    log(json.dumps({k: v for k, v in cp.items() if k not in ("top", "side", "top_gaps")}))
    for row in cp["top"][:rows]:
        print(f"  {key} crit {row['delta_ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  "
              f"{row['delta_us_per_call']:8.2f} us/call (dur {row['dur_us_per_call']:8.2f}, idle before "
              f"{row['idle_ms_per_step']:6.3f} ms)  {row['name']}")
    side = cp["side"]
    print(f"  {key} crit side streams: {side['kernel_ms_per_step']:8.3f} ms  x{side['kernels_per_step']:6.1f} "
          f"(summed durations, overlapping the chain)")
    for row in side["top"][:10]:
        print(f"  {key} crit side {row['dur_ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['name']}")
    for g in cp["top_gaps"][:5]:
        print(f"  {key} crit gap {g['gap_us']:9.1f} us  after {g['after']}  before {g['before']}")


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
    ap.add_argument("--engine-pdl", action="store_true",
                    help="--engine: decode with programmatic dependent launch (default off, comparable with older "
                         "profiles); read the critical path by end-time deltas, not the kernel table")
    ap.add_argument("--autotune-foreign", metavar="JSON", default=None,
                    help="load this autotune table whatever GPU model measured it (kernels/tuned/nvidia_h200.json on "
                         "an H100: without it an H100 tunes at start for minutes), before the shipped table's")
    ap.add_argument("--engine-trace", action="store_true",
                    help="--engine: keep each decode window's Chrome trace as engine_decode_trace_<streams>.json.gz "
                         "under --out (several MB)")
    ap.add_argument("--engine-settings", default="{}",
                    help="--engine: more QwenEngineConfig fields for the decode profile, as JSON (e.g. "
                         "'{\"small_batch_tokens\": 32}')")
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
    if device.type == "cuda":  # the engines' table (QwenEngineConfig.autotune_table "auto") before the calibration's
        # forward, which would otherwise tune its keys in-process and the engine keep those picks (qwen_gpu.py's fix)
        from kernels import autotune_table

        if args.autotune_foreign:  # another GPU model's picks (kernels/autotune_table.load_foreign)
            n, measured_on = autotune_table.load_foreign(args.autotune_foreign)
            log(f"autotune table {args.autotune_foreign}: {n} picks (measured on {measured_on}) loaded")
        log(f"autotune table auto: {autotune_table.load_setting('auto', device)} picks loaded before the calibration")
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
            print(f"  engine_burst step: {p['seqs']:3d} seqs {p['tokens']:5d} tokens, "
                  f"launched in {p['launch_ms']:9.1f} ms")
        for row in r["engine_burst"].get("top", [])[:25]:
            print(f"  engine_burst {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['name']}")
        for row in r["engine_burst"].get("host_top", [])[:25]:
            print(f"  engine_burst host {row['self_cpu_ms']:8.3f} ms  x{row['calls']:6d}  {row['name']}")
        (out_dir / "qwen_profile.json").write_text(json.dumps(r, indent=2))
    for n in (int(x) for x in args.engine_streams.split(",") if x) if args.engine else ():
        log(f"profiling the engine's decode steps, {n} stream(s)")
        key = "engine" if n == 1 else f"engine_{n}"
        trace = out_dir / f"engine_decode_trace_{n}.json.gz" if args.engine_trace else None
        r[key] = profile_engine_decode(model, cfg, device, rand, ctx, streams=n, prefill_graphs=args.prefill_graphs,
                                       programmatic_launch=args.engine_pdl, trace_path=trace,
                                       settings=json.loads(args.engine_settings))
        log(json.dumps({k: v for k, v in r[key].items() if k not in ("top", "critical_path")}))
        for row in r[key].get("top", [])[:40]:
            print(f"  {key} {row['ms_per_step']:8.3f} ms  x{row['calls_per_step']:6.1f}  {row['name']}")
        print_critical_path(key, r[key]["critical_path"])
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
