"""engine_core.sampling: greedy, temperature, top-k, top-p and seeds, against the plain reference sampler.

Statistical tests draw N = 20,000 samples per parameter set on an 8-token vocabulary (one batched call: the same
logits row N times, output index 0..N-1) and compare the counts with the exact filtered distribution by Pearson's
chi-square. The threshold is the 0.999 quantile of chi-square with (support - 1) degrees of freedom: a correct
sampler fails a given seed with probability 1e-3, and everything here is seeded, so the outcome is fixed. Tokens
outside the top-k / top-p support must never be drawn (checked exactly).
"""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine_core.continuous import ContinuousConfig, ContinuousScheduler, GenerateRequest, SamplingParams, StepOutput
from engine_core.request import FakeClock
from engine_core.sampling import (
    adjust_logits,
    SamplingTensors,
    apply_penalties,
    gumbel_noise,
    reference_adjusted,
    reference_logprobs,
    reference_probs,
    reference_sample,
    sample,
    token_logprobs,
)

V = 8
N = 20_000
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}  # chi2.ppf(0.999, df)
LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -1.0, -3.0])[torch.tensor([3, 0, 6, 1, 7, 2, 5, 4])]
PARAM_SETS = [
    SamplingParams(1.0),
    SamplingParams(0.5),
    SamplingParams(2.0),
    SamplingParams(1.0, top_k=3),
    SamplingParams(1.0, top_p=0.7),
    SamplingParams(0.8, top_p=0.9, top_k=5),
    SamplingParams(1.5, top_p=0.5),
]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the support of `probs`, and its degrees of freedom."""
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts.tolist()}"
    expected = probs[support] * counts.sum()
    stat = ((counts[support].double() - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def batch_of(params: list[SamplingParams], seed: int = 1234, step0: int = 0) -> SamplingTensors:
    return SamplingTensors.build(params, [seed] * len(params), range(step0, step0 + len(params)))


def test_greedy_is_argmax_whatever_the_other_parameters():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 1000, generator=g)
    params = [SamplingParams(0.0, top_p=0.5, top_k=3, seed=i) for i in range(16)]
    st = batch_of(params)
    assert st.all_greedy
    assert st.temperature is None and st.seed is None  # nothing built or copied for an all-greedy step
    assert torch.equal(sample(logits, st), logits.argmax(-1))
    # greedy rows inside a sampled batch (sorted path) are still argmax
    mixed = [p if i % 2 else SamplingParams(1.0, top_p=0.9) for i, p in enumerate(params)]
    st = batch_of(mixed)
    assert not st.all_greedy and st.needs_sort
    out = sample(logits.to(torch.bfloat16), st)
    assert torch.equal(out[1::2], logits.to(torch.bfloat16).argmax(-1)[1::2])
    assert torch.equal(reference_sample(logits[1::2], params[1::2]), logits.argmax(-1)[1::2])


def test_vanishing_temperatures_are_greedy():
    """0 < T < 1e-5 samples greedily: logits / 1e-45 overflow to inf, where the sampler once returned the first
    infinite logit (a low id) instead of the most likely token."""
    logits = torch.full((2, 1000), -50.0)
    logits[:, 3], logits[:, 700] = 1.0, 40.0  # 1.0 / 1e-45 = inf in fp32, as 40 / 1e-45
    params = [SamplingParams(1e-45, seed=1), SamplingParams(9.9e-6, seed=2)]
    assert all(p.greedy and p.temperature == 0.0 for p in params)
    assert torch.equal(sample(logits, batch_of(params)), torch.tensor([700, 700]))
    assert not SamplingParams(1e-5).greedy


@pytest.mark.parametrize("params", PARAM_SETS, ids=repr)
def test_sampler_matches_the_exact_distribution(params):
    probs = reference_probs(LOGITS, params)
    counts = torch.bincount(sample(LOGITS.expand(N, V), batch_of([params] * N)), minlength=V)
    stat, df = chi_square(counts, probs)
    assert stat < CHI2_999[df], f"chi2={stat:.1f} (df={df}), counts={counts.tolist()}, p={probs.tolist()}"


@pytest.mark.parametrize("params", PARAM_SETS[::2], ids=repr)
def test_reference_sampler_matches_the_exact_distribution_and_the_fast_one(params):
    probs = reference_probs(LOGITS, params)
    g = torch.Generator().manual_seed(7)
    ref = torch.bincount(torch.multinomial(probs, N, replacement=True, generator=g), minlength=V)
    stat, df = chi_square(ref, probs)
    assert stat < CHI2_999[df], f"reference sampler: chi2={stat:.1f}, counts={ref.tolist()}"
    # two-sample (homogeneity) test: fast vs reference counts come from the same distribution
    fast = torch.bincount(sample(LOGITS.expand(N, V), batch_of([params] * N, seed=99)), minlength=V)
    keep = (ref + fast) > 0
    table = torch.stack([ref[keep], fast[keep]]).double()  # [2, k]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum().item()
    assert stat < CHI2_999[int(keep.sum()) - 1], f"fast {fast.tolist()} vs reference {ref.tolist()}: chi2={stat:.1f}"


def test_heterogeneous_batch_each_row_follows_its_own_parameters():
    """All parameter sets in one batch (sorted path; rows without top-k/top-p pass through it unmasked)."""
    n = 5000
    params = [p for p in PARAM_SETS for _ in range(n)]
    out = sample(LOGITS.expand(len(params), V), batch_of(params))
    for i, p in enumerate(PARAM_SETS):
        stat, df = chi_square(torch.bincount(out[i * n:(i + 1) * n], minlength=V), reference_probs(LOGITS, p))
        assert stat < CHI2_999[df], f"{p}: chi2={stat:.1f}"


def test_top_k_top_p_support_boundaries():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    cases = {SamplingParams(1.0, top_p=0.5): {0, 1}, SamplingParams(1.0, top_p=0.75): {0, 1, 2},
             SamplingParams(1.0, top_k=1): {0}, SamplingParams(1.0, top_k=2, top_p=0.5): {0}}
    # (top_k=2, top_p=0.5): top-2 renormalised is (4/7, 3/7), so the first token alone already reaches 0.5
    for p, support in cases.items():
        got = set(sample(logits.expand(4000, 4), batch_of([p] * 4000)).unique().tolist())
        assert got == support == set(torch.nonzero(reference_probs(logits, p)).flatten().tolist()), p


def sample_rows(rows: list[tuple[torch.Tensor, SamplingParams, int, int]]) -> list[int]:
    """rows of (logits [V], params, seed, step) -> sampled token per row, all in one batched call."""
    st = SamplingTensors.build([r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows])
    return sample(torch.stack([r[0] for r in rows]), st).tolist()


def test_seeded_draws_are_reproducible_and_independent_of_batch_position():
    g = torch.Generator().manual_seed(3)
    vocab = 500
    rows = [(torch.randn(vocab, generator=g), SamplingParams(0.9, top_p=0.95, top_k=50 * (i % 3), seed=s), s, t)
            for i, (s, t) in enumerate([(1, 0), (1, 1), (2, 0), (2**62 + 5, 17), (12345, 3)])]
    alone = [sample_rows([row])[0] for row in rows]
    for trial in range(5):  # the same rows at random positions among random neighbours, batches of 8..12
        batch = [(torch.randn(vocab, generator=g), SamplingParams(1.0), 99, 7) for _ in range(3 + trial)]
        for row in rows:
            batch.insert(int(torch.randint(len(batch) + 1, (), generator=g)), row)
        out = sample_rows(batch)
        assert [out[next(i for i, b in enumerate(batch) if b is row)] for row in rows] == alone
    # and a fresh call gives the same again; a different seed or step gives (here) different draws
    x = torch.zeros(4, 1000)  # uniform over 1000 tokens: a collision would be a 1-in-1000 coincidence
    st = SamplingTensors.build([SamplingParams(1.0)] * 4, [5, 5, 6, 5], [0, 0, 0, 1])
    a, b = sample(x, st), sample(x, st)
    assert torch.equal(a, b) and a[0] == a[1] and a[0] != a[2] and a[0] != a[3]


def test_gumbel_noise_is_gumbel():
    """The hash-driven noise has the Gumbel(0, 1) mean (Euler-Mascheroni) and variance (pi^2 / 6) to within
    5 standard errors over 2M draws, and its uniforms fill 64 bins evenly (chi-square, df = 63, 0.999: 103.4)."""
    seed = torch.arange(200, dtype=torch.int64) * 7919
    step = torch.arange(200, dtype=torch.int64) % 13
    g = gumbel_noise(seed, step, torch.arange(10_000)).double().flatten()
    n = g.numel()
    assert abs(g.mean().item() - 0.5772156649) < 5 * math.sqrt(math.pi**2 / 6 / n)
    # the sample variance's standard error is sigma^2 sqrt((kurtosis - 1) / n); Gumbel's kurtosis is 3 + 12/5
    assert abs(g.var().item() - math.pi**2 / 6) < 5 * (math.pi**2 / 6) * math.sqrt(4.4 / n)
    u = torch.exp(-torch.exp(-g))  # back to uniforms
    counts = torch.histc(u, bins=64, min=0.0, max=1.0)
    expected = n / 64
    assert ((counts - expected) ** 2 / expected).sum().item() < 103.4


class RecordOps(TorchDispatchMode):
    """Records the name of every aten op dispatched inside the `with` block."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func._schema.name.split("::")[-1])
        return func(*args, **(kwargs or {}))


# ops that sync on CUDA although their output shape is static (gpt-fast: "multinomial ... without a cuda
# synchronization" is why the exponential race exists)
STATIC_SHAPE_SYNC_OPS = {"multinomial", "equal", "allclose", "is_nonzero", "_local_scalar_dense"}


PATHS = {"greedy": [SamplingParams(0.0)] * 4,
         "plain": [SamplingParams(0.7, seed=1), SamplingParams(0.0), SamplingParams(1.3), SamplingParams(1.0)],
         "sorted": [SamplingParams(0.7, top_p=0.8), SamplingParams(0.0), SamplingParams(1.0, top_k=5),
                    SamplingParams(1.0)],
         "penalized": [SamplingParams(0.0, presence_penalty=0.5), SamplingParams(0.8, frequency_penalty=-1.0),
                       SamplingParams(0.0), SamplingParams(1.0, top_p=0.9, frequency_penalty=0.2)],
         "biased": [SamplingParams(0.0, logit_bias={3: 5.0, 7: -100.0}),
                    SamplingParams(0.9, logit_bias={1: 2.0}, presence_penalty=0.3), SamplingParams(0.0),
                    SamplingParams(1.0, top_k=4, logit_bias={299: 100.0})]}


def path_inputs(path: str, device: str = "cpu") -> tuple[torch.Tensor, SamplingTensors]:
    st = SamplingTensors.build(PATHS[path], [11, 12, 13, 14], [0, 5, 9, 2], device=device)
    return torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).to(device), st


def path_counts(path: str, device: str = "cpu") -> torch.Tensor | None:
    """The output-token counts a penalized path's `sample` reads (None for the others)."""
    if path not in ("penalized", "biased"):
        return None
    return torch.randint(0, 3, (4, 300), generator=torch.Generator().manual_seed(1), dtype=torch.int32).to(device)


@pytest.mark.parametrize("path", list(PATHS))
def test_no_host_sync_runs_on_the_meta_device(path):
    """CUDA's `torch.cuda.set_sync_debug_mode` is not available on CPU. Instead the sampler runs on the meta device,
    where tensors have no data: `.item()`, `.tolist()`, `bool(t)` / `if t:`, `nonzero` and boolean-mask indexing all
    raise there, so completing proves the path never reads a device value on the host. The dispatched ops are also
    recorded, to rule out ops that sync on CUDA with static shapes (multinomial)."""
    logits, st = path_inputs(path, device="meta")
    counts = path_counts(path, device="meta")
    with RecordOps() as rec:
        out = sample(logits, st, counts=counts)
    assert out.device.type == "meta" and out.shape == (4,) and out.dtype == torch.int64
    assert rec.ops and not rec.ops & STATIC_SHAPE_SYNC_OPS, rec.ops & STATIC_SHAPE_SYNC_OPS


@pytest.mark.parametrize("path", list(PATHS))
def test_compiles_as_one_graph(path):
    """`fullgraph=True` turns a graph break into an error: `.tolist()` and branches on tensor values break the
    graph (in torch 2.14 `.item()` and `nonzero` no longer do, hence `test_no_host_sync_ops`). aot_eager traces
    through AOTAutograd without generating code: fast, and the same ops."""
    logits, st = path_inputs(path)
    counts = path_counts(path)
    torch._dynamo.reset()
    compiled = torch.compile(sample, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(logits, st, counts=counts), sample(logits, st, counts=counts))


@pytest.mark.parametrize("dtype,n", [(torch.float32, 5), (torch.bfloat16, 20), (torch.float32, 0)])
def test_token_logprobs_match_the_float64_reference(dtype, n):
    """`token_logprobs` (fp32 log-softmax) against `reference_logprobs` (float64) on random logits of spread ~10:
    within 1e-5 (fp32 rounding of logits ~1e1 and a log-sum-exp over 300 terms); the top values in order, and each
    top id's own reference value (bf16 logits tie, so tied ids may come in either order); the sampled token's entry
    whatever its rank."""
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 300, generator=g) * 4).to(dtype)
    ids = torch.randint(0, 300, (6,), generator=g)
    chosen, top, top_ids = token_logprobs(logits, ids, n)
    assert chosen.shape == (6,) and top.shape == top_ids.shape == (6, n) and top_ids.dtype == torch.int64
    for r in range(6):
        want, want_top = reference_logprobs(logits[r], int(ids[r]), n)
        assert abs(chosen[r].item() - want) < 1e-5
        assert torch.allclose(top[r].double(), torch.tensor([v for _, v in want_top], dtype=torch.float64),
                              atol=1e-5, rtol=0)
        for t, v in zip(top_ids[r].tolist(), top[r].tolist()):
            assert abs(reference_logprobs(logits[r], t, 0)[0] - v) < 1e-5
        if dtype == torch.float32:  # no ties: the same ids in the same order
            assert top_ids[r].tolist() == [t for t, _ in want_top]


def test_token_logprobs_read_nothing_on_the_host():
    """As `sample`: on the meta device every host read raises, so completing proves none."""
    chosen, top, top_ids = token_logprobs(torch.randn(4, 300, device="meta"), torch.zeros(4, dtype=torch.int64,
                                                                                          device="meta"), 3)
    assert chosen.shape == (4,) and top.shape == (4, 3) and top_ids.device.type == "meta"


def test_penalties_match_the_reference_and_need_counts():
    """`apply_penalties` against `reference_adjusted` (float64, token by token) within 1e-5; in `sample` a greedy
    penalized row takes the argmax of the penalized logits, an unpenalized row of the same batch is unchanged, and
    penalized rows without counts are refused."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 50, generator=g) * 2
    outputs = [[4, 4, 7], [], [9, 9, 9, 1]]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=1.25), SamplingParams(presence_penalty=2.0),
              SamplingParams()]
    counts = torch.zeros(3, 50, dtype=torch.int32)
    for r, out in enumerate(outputs):
        for t in out:
            counts[r, t] += 1
    st = SamplingTensors.build(params, [1, 2, 3], [0, 0, 0])
    got = apply_penalties(logits, counts, st.presence, st.frequency)
    for r in range(3):
        want = reference_adjusted(logits[r], outputs[r], params[r])
        assert torch.allclose(got[r].double(), want, atol=1e-5, rtol=0)
    ids = sample(logits, st, counts=counts)
    assert ids.tolist() == [int(reference_adjusted(logits[r], outputs[r], params[r]).argmax()) for r in range(3)]
    assert ids[2] == logits[2].argmax()  # penalties 0: the plain argmax although its counts are not empty
    with pytest.raises(ValueError, match="counts"):
        sample(logits, st)
    for bad in (2.5, -2.01, float("nan")):
        with pytest.raises(ValueError, match="penalty"):
            SamplingParams(frequency_penalty=bad)


def test_logit_bias_matches_the_reference():
    """`adjust_logits` against `reference_adjusted` (float64, token by token) within 1e-5 for rows with a bias, a
    bias and penalties, and neither, bf16 logits; `sample` takes the greedy rows' argmax of the adjusted logits (+100
    forces a token, -100 bans the top one) and never writes into the logits it is given (fp32, where `.float()` is
    the tensor itself)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 60, generator=g) * 3
    top = logits.argmax(-1).tolist()
    params = [SamplingParams(logit_bias={top[0]: -100.0, 5: 1.5}), SamplingParams(logit_bias={59: 100.0}),
              SamplingParams(logit_bias=[(2, 0.75)], presence_penalty=1.0, frequency_penalty=-0.5), SamplingParams()]
    outputs = [[], [], [2, 2, 9], []]
    counts = torch.zeros(4, 60, dtype=torch.int32)
    for r, out in enumerate(outputs):
        for t in out:
            counts[r, t] += 1
    st = SamplingTensors.build(params, [1, 2, 3, 4], [0, 0, 3, 0])
    for x in (logits, logits.bfloat16()):
        got = adjust_logits(x, st, counts)
        assert got.dtype == torch.float32
        for r in range(4):
            assert torch.allclose(got[r].double(), reference_adjusted(x[r].float(), outputs[r], params[r]),
                                  atol=1e-5, rtol=0), r
    before = logits.clone()
    ids = sample(logits, st, counts=counts).tolist()
    assert torch.equal(logits, before)
    assert ids == [int(reference_adjusted(logits[r], outputs[r], params[r]).argmax()) for r in range(4)]
    assert ids[0] != top[0] and ids[1] == 59 and ids[3] == top[3]
    unbiased = SamplingTensors.build([SamplingParams()] * 4, [1, 2, 3, 4], [0] * 4)
    assert adjust_logits(logits, unbiased) is logits  # nothing asked: no copy, no fp32 pass


def test_a_banned_token_is_never_sampled():
    """Temperature sampling with -100 on the most likely token (probability ~e^-100 after the bias) over 64 seeds
    never picks it, while without the bias it is picked most of the time."""
    logits = torch.full((64, 20), -4.0)
    logits[:, 6] = 4.0
    plain = SamplingTensors.build([SamplingParams(1.0)] * 64, list(range(64)), [0] * 64)
    banned = SamplingTensors.build([SamplingParams(1.0, logit_bias={6: -100.0})] * 64, list(range(64)), [0] * 64)
    assert (sample(logits, plain) == 6).sum() > 48
    assert (sample(logits, banned) != 6).all()


@pytest.mark.parametrize("bias, match", [
    ({1: 100.5}, "in \\[-100, 100\\]"), ({1: float("nan")}, "number"), ({1: True}, "number"), ({-1: 1.0}, ">= 0"),
    ([(1, 1.0), (1, 2.0)], "more than once"), ({i: 1.0 for i in range(301)}, "at most 300"), ([(1,)], "pairs"),
    ({"7": 1.0}, "pairs"),
])
def test_logit_bias_is_checked(bias, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(logit_bias=bias)


def test_logit_bias_is_stored_sorted_without_zeros():
    sp = SamplingParams(logit_bias={9: -1, 3: 2.5, 4: 0.0})
    assert sp.logit_bias == ((3, 2.5), (9, -1.0)) and sp.biased
    assert sp == SamplingParams(logit_bias=[(3, 2.5), (9, -1.0)]) and hash(sp) == hash(SamplingParams(
        logit_bias=[(9, -1.0), (3, 2.5)]))  # hashable, and equal however it was given
    assert not SamplingParams(logit_bias={4: 0.0}).biased and SamplingParams(logit_bias={4: 0}) == SamplingParams()


def test_the_sync_checks_are_not_vacuous():
    x = torch.randn(3, 5, device="meta")
    for syncs in (lambda t: t / t.max().item(), lambda t: t[t.nonzero()[:, 0]], lambda t: t.argmax(-1).tolist(),
                  lambda t: t[t > 0], lambda t: t if t.sum() > 0 else -t):
        with pytest.raises((RuntimeError, NotImplementedError)):
            syncs(x)
    with RecordOps() as rec:
        torch.multinomial(torch.ones(2, 5), 1)
    assert rec.ops & STATIC_SHAPE_SYNC_OPS

    def branches(t):
        return t if t.sum() > 0 else -t

    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)data-dependent"):
        torch.compile(branches, fullgraph=True, backend="aot_eager")(torch.randn(3, 5))


def test_sampled_streams_survive_preemption_exactly():
    """Scheduler + sampler end to end: temperature / top-p sampling with scheduler-drawn and explicit seeds gives
    the same completions with a KV pool that forces preemptions as with one that never does."""
    table = torch.randn(97, 64, generator=torch.Generator().manual_seed(5))

    def logits_for(context) -> torch.Tensor:  # a "model": the logits are a function of the whole context
        return table[hash(tuple(context)) % 97]

    requests = [GenerateRequest(tuple(range(1 + i, 6 + 2 * i)), 24,
                                SamplingParams(0.9, top_p=0.9, top_k=20 * (i % 2), seed=None if i % 3 else i))
                for i in range(6)]
    results = {}
    for blocks in (100, 9):
        sched = ContinuousScheduler(ContinuousConfig(num_kv_blocks=blocks, block_size=4, max_num_seqs=6,
                                                     max_num_batched_tokens=12, seed=0), FakeClock())
        rids = [sched.add(r) for r in requests]
        while (plan := sched.step()) is not None:
            rows = plan.sampled
            if rows:
                logits = torch.stack([logits_for(sched.sequence(r.request_id).token_ids) for r in rows])
                tokens = sample(logits, SamplingTensors.from_plan(plan)).tolist()  # the step's one D2H copy
            else:
                tokens = []
            sched.finish(plan, StepOutput(tuple(tokens)))
        answers = {a.request_id: a.outputs[0].token_ids for a in sched.pop_answers()}
        results[blocks] = [answers[rid] for rid in rids]
        if blocks == 9:
            assert sched.stats.preemptions > 0
    assert results[9] == results[100]
    assert len(set(results[100])) == len(requests)  # different seeds / prompts -> different streams
