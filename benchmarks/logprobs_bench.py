"""What a request's log-probabilities cost a decode step: `engine_core.sampling.token_logprobs` per call on the GPU,
at 1 and 32 rows of the Qwen3.6 vocabulary (248,320), n = 0 / 5 / 20, beside two alternatives that were tried:
log-sum-exp then top-k of the logits (no [B, V] log-softmax), and a two-stage top-k (256 chunks, then the
candidates). Per variant and size the median of 30 calls, each between synchronisations: device time (events) and
the host's launch time. Also checks each variant against `token_logprobs` (1e-4). Then the presence / frequency
penalties' share of a step the same way: the rows' counts gathered from the [slots, vocab] int32 table, the
penalised fp32 logits and their argmax (what `sample` adds for a penalised batch); and a logit bias's: `sample` of
an all-greedy batch whose rows each bias 10 or 300 ids (the sparse scatter into an fp32 copy, torch's argmax) beside
the same batch unbiased (torch's argmax of the raw logits). Last, prompt scoring (echo with logprobs): a
512-position chunk's log-probabilities in one call and in the runner's 128-row slices (time, peak memory).

    python benchmarks/logprobs_bench.py > logprobs_cost.txt      # results/logprobs62 (H100, 2026-12-07)
"""

import time

import torch

from engine_core.continuous import SamplingParams
from engine_core.sampling import SamplingTensors, apply_penalties, sample, token_logprobs


def lse_topk(logits, ids, n):
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = (x.gather(1, ids[:, None]) - lse)[:, 0]
    v, i = x.topk(n, dim=-1) if n else (x[:, :0], ids[:, None][:, :0])
    return chosen, v - lse, i


def two_stage(logits, ids, n, chunks=256):
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = (x.gather(1, ids[:, None]) - lse)[:, 0]
    if n == 0:
        return chosen, x[:, :0], ids[:, None][:, :0]
    b, v = x.shape
    v1, i1 = x.view(b, chunks, v // chunks).topk(n, dim=-1)  # [B, chunks, n]
    i1 = i1 + (torch.arange(chunks, device=x.device) * (v // chunks))[None, :, None]
    v2, j = v1.reshape(b, -1).topk(n, dim=-1)
    return chosen, v2 - lse, i1.reshape(b, -1).gather(1, j)


def timed(f, *args) -> tuple[float, float]:
    """Median device and host microseconds of 30 calls of f(*args), each between synchronisations."""
    for _ in range(3):
        f(*args)
    dev, host = [], []
    for _ in range(30):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        f(*args)
        t1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        dev.append(start.elapsed_time(end) * 1000)
        host.append((t1 - t0) * 1e6)
    return sorted(dev)[15], sorted(host)[15]


def penalties() -> None:
    table = torch.randint(0, 3, (64, 248320), device="cuda", dtype=torch.int32)
    for rows in (1, 32):
        logits = torch.randn(rows, 248320, device="cuda", dtype=torch.bfloat16)
        slots = torch.arange(rows, device="cuda")
        pres, freq = torch.full((rows,), 0.5, device="cuda"), torch.full((rows,), 0.25, device="cuda")

        def penalised():
            return apply_penalties(logits, table.index_select(0, slots), pres, freq).argmax(-1)

        dev, host = timed(penalised)
        print(f"B={rows:3d} penalties (gather + apply + argmax): device {dev:7.1f} us, host launch {host:6.1f} us")


def logit_bias() -> None:
    for rows in (1, 32):
        logits = torch.randn(rows, 248320, device="cuda", dtype=torch.bfloat16)
        plain = SamplingTensors.build([SamplingParams()] * rows, [0] * rows, [0] * rows, device="cuda")
        dev, host = timed(sample, logits, plain)
        print(f"B={rows:3d} greedy, no bias: device {dev:7.1f} us, host launch {host:6.1f} us")
        for ids in (10, 300):
            sp = SamplingParams(logit_bias={(7919 * i) % 248320: 1.0 for i in range(ids)})
            st = SamplingTensors.build([sp] * rows, [0] * rows, [0] * rows, device="cuda")
            dev, host = timed(sample, logits, st)
            print(f"B={rows:3d} greedy, {ids} biased ids a row: device {dev:7.1f} us, host launch {host:6.1f} us")


def prompt_scoring() -> None:
    """echo + logprobs: the log-probabilities of a 512-position chunk's prompt targets (PROMPT_LOGPROBS_CHUNK), in
    one call and in the runner's row slices (PROMPT_LOGPROBS_ROWS): device time and the peak memory above the logits."""
    from engine_core.continuous import PROMPT_LOGPROBS_CHUNK
    from qwen_engine.runner import PROMPT_LOGPROBS_ROWS

    rows = PROMPT_LOGPROBS_CHUNK
    logits = torch.randn(rows, 248320, device="cuda", dtype=torch.bfloat16) * 3
    ids = torch.randint(0, 248320, (rows,), device="cuda")

    def sliced(n):
        parts = [token_logprobs(logits[i:i + PROMPT_LOGPROBS_ROWS], ids[i:i + PROMPT_LOGPROBS_ROWS], n)
                 for i in range(0, rows, PROMPT_LOGPROBS_ROWS)]
        return tuple(torch.cat(t) for t in zip(*parts))

    for name, f in (("one call", lambda n: token_logprobs(logits, ids, n)), (f"slices of {PROMPT_LOGPROBS_ROWS}",
                                                                           sliced)):
        for n in (1, 20):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            f(n)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
            dev, host = timed(f, n)
            print(f"prompt scoring, {rows} positions, {name:14s} n={n:2d}: device {dev:8.1f} us, host launch "
                  f"{host:6.1f} us, peak {peak:7.1f} MiB above the logits")


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    for rows in (1, 32):
        logits = torch.randn(rows, 248320, device="cuda", dtype=torch.bfloat16) * 3
        ids = torch.randint(0, 248320, (rows,), device="cuda")
        ref = token_logprobs(logits, ids, 20)
        for name, f in (("plain", token_logprobs), ("lse_topk", lse_topk), ("two_stage", two_stage)):
            got = f(logits, ids, 20)
            ok = (got[0] - ref[0]).abs().max().item() < 1e-4 and (got[1] - ref[1]).abs().max().item() < 1e-4
            for n in (0, 5, 20):
                dev, host = timed(f, logits, ids, n)
                print(f"B={rows:3d} {name:10s} n={n:2d}: device {dev:7.1f} us, host launch {host:6.1f} us, "
                      f"match {ok}")


if __name__ == "__main__":
    main()
    penalties()
    logit_bias()
    prompt_scoring()
