"""The lazy GDN decode state (`QwenEngineConfig.gdn_lazy_rank`): `qwen_engine.model.gdn.gated_delta_rows_lazy`
against the plain recurrence it reorders (`gated_delta_rows`), and kernels/gdn_decode_lazy.py's Triton kernel against
that reference (on CPU through Triton's interpreter, tests/conftest.py).

Tolerances: 1e-5 x max |ref| -- the lazy form against the plain step over 40 chained tokens, folds, resets and
forced folds (measured ~2e-7: terms scaled once instead of decayed every step, fp32), and the kernel against the
reference on every output (the same fp32 operations, reductions in another order). Base positions exactly.
"""

import pytest
import torch

from kernels.gdn_decode import random_inputs
from kernels.gdn_decode_lazy import (
    FOLD_BELOW_ROWS,
    compare,
    describe,
    gdn_decode_lazy_reference,
    gdn_decode_lazy_triton,
    random_lazy_state,
    supports,
)
from qwen_engine.model.gdn import gated_delta_rows, gated_delta_rows_lazy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _fold_all(pool, base, keys, deltas, logs, rows, positions):
    """Fold every pending term of `rows` into the pool by one more step with zero input (g = 0: no decay, beta = 0:
    no new term), as a batch at or below fold_below does -- the pool then holds the plain state."""
    bsz, heads, dk, dv = len(rows), keys.shape[1], keys.shape[3], deltas.shape[3]
    zeros = torch.zeros(bsz, heads, dk, device=pool.device)
    gated_delta_rows_lazy(zeros, zeros, torch.zeros(bsz, heads, dv, device=pool.device),
                          torch.zeros(bsz, heads, device=pool.device), torch.zeros(bsz, heads, device=pool.device),
                          pool, base, keys, deltas, logs, rows, positions, fold_below=bsz + 1)


@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_lazy_rows_track_the_plain_step(rank):
    """Three sequences at staggered positions (folds fall on different steps) over 40 tokens, a batch that folds
    every step in between (steps 12-14: fold_below above the batch), and one sequence restarting at step 25 (its row
    reset: base -1, state zeroed, like `PagedCache.reset_slots`): o within 1e-5 of the plain step every token, and
    after a final fold the pool rows within 1e-5 of the plain pool; the pool row no batch row owns is untouched."""
    heads, dk, dv = 2, 16, 48
    plain = torch.randn(5, heads, dk, dv, generator=torch.Generator().manual_seed(1)) * 0.5
    pool, base, keys, deltas, logs = random_lazy_state(5, heads, dk, dv, rank)  # terms: stale garbage, base -1
    pool.copy_(plain)
    untouched = pool[3].clone()
    rows = torch.tensor([4, 0, 2])
    positions = torch.tensor([10, 3, 6])
    worst = 0.0
    for t in range(40):
        if t == 25:  # sequence 1 restarts: a fresh prompt's first decode token at position 5
            for p in (plain, pool):
                p[0] = 0
            base[0] = -1
            positions[1] = 5
        q, k, v, g, beta, _ = random_inputs(3, heads, dk, dv, seed=100 + t)
        want = gated_delta_rows(q, k, v, g, beta, plain, rows)
        got = gated_delta_rows_lazy(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions,
                                    fold_below=8 if 12 <= t <= 14 else 0)
        worst = max(worst, _rel(got, want))
        positions += 1
    assert worst < 1e-5, worst
    assert int((base[rows] >= 0).sum()) == base[rows].numel()  # every row has a base position (none left unset)
    _fold_all(pool, base, keys, deltas, logs, rows, positions)
    assert _rel(pool[rows], plain[rows]) < 1e-5
    assert torch.equal(pool[3], untouched)
    print(f"\nrank {rank}: worst o error {worst:.2g}, pool {_rel(pool[rows], plain[rows]):.2g}")


def test_lazy_writes_the_state_once_every_rank():
    """The point of it: at rank 4 a row's stored state changes on one step in 4 (its fold), not every step; the base
    position then moves to the folding token's."""
    heads, dk, dv = 2, 16, 32
    pool, base, keys, deltas, logs = random_lazy_state(2, heads, dk, dv, 4)
    rows, positions = torch.tensor([1]), torch.tensor([9])
    changed = []
    for t in range(8):
        before = pool.clone()
        q, k, v, g, beta, _ = random_inputs(1, heads, dk, dv, seed=t)
        gated_delta_rows_lazy(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions, fold_below=0)
        changed.append(not torch.equal(pool, before))
        positions += 1
    # positions 9 .. 16: the first step sets base 8 (no pending term); folds where the terms would reach 4 (the
    # 4th pending: positions 12 and 16), i.e. steps 3 and 7
    assert changed == [False, False, False, True, False, False, False, True], changed
    assert base[1].unique().tolist() == [16]


def _run_both(args, fold_below):
    ref = gdn_decode_lazy_reference(*(a.clone() for a in args), fold_below)
    out = gdn_decode_lazy_triton(*(a.clone() for a in args), fold_below)
    return out, ref


@pytest.mark.parametrize("bsz,heads,dk,dv,rank,pool_dtype,block_v", [
    (3, 3, 32, 48, 4, torch.float32, None),  # Dv not a power of two: 3 granules, 16-column programs
    (2, 2, 128, 128, 8, torch.float32, None),  # the model's head dims
    (3, 2, 16, 64, 3, torch.float32, 32),  # 32-column programs (>= 264 programs' slices) over 2 granules each
    (3, 2, 16, 48, 3, torch.float32, 64),  # 64-column programs over 4 granules, the last one past Dv (masked)
    (3, 2, 24, 8, 2, torch.float32, None),  # Dv < the granule: one base copy a head
    (2, 2, 32, 32, 4, torch.bfloat16, None),  # gdn_state_dtype bfloat16: widened as read, rounded as a fold stores it
])
def test_kernel_matches_reference_over_steps(bsz, heads, dk, dv, rank, pool_dtype, block_v, monkeypatch):
    """12 chained tokens from garbage terms and unset base positions, the kernel and the reference each stepping
    their own copy: every output within 1e-5 x max |ref| (base positions equal) on every step, with and without
    forced folds (fold_below above the batch on steps 5-6). `block_v`: the program's columns forced (the engine's
    32 / 64 need >= 264 programs, too many for the interpreter)."""
    if block_v is not None:
        from kernels import gdn_decode_lazy

        monkeypatch.setattr(gdn_decode_lazy, "LAUNCH_BLOCK_V", block_v)
    slots = bsz + 2
    pool, base, keys, deltas, logs = random_lazy_state(slots, heads, dk, dv, rank, seed=bsz, device=DEVICE)
    state = [pool.to(pool_dtype), base, keys, deltas, logs]
    rows = torch.randperm(slots, generator=torch.Generator().manual_seed(dv))[:bsz].to(DEVICE)
    positions = (torch.arange(bsz) * 3 + 7).to(DEVICE)
    for t in range(12):
        q, k, v, g, beta, _ = random_inputs(bsz, heads, dk, dv, seed=t, device=DEVICE)
        args = (q, k, v, g, beta, *state, rows, positions)
        out, ref = _run_both(args, bsz + 1 if t in (5, 6) else 0)
        problem = compare(out, ref)
        assert problem is None, f"step {t}: {problem}"
        state = list(ref[1:])
        positions = positions + 1


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fold_below_folds_every_row(impl):
    """A batch below fold_below (a lone stream) folds on every step: the pool then equals the plain step's state
    (1e-5) each token, and no term is stored (base = the token's position). The term slots hold NaN (no slot is
    pending): the small-batch kernel loads every slot before it knows which are pending, and neither it nor the
    reference may let a slot that is not pending reach the results."""
    heads, dk, dv = 2, 32, 32
    pool, base, keys, deltas, logs = random_lazy_state(3, heads, dk, dv, 4, device=DEVICE)
    for t in (keys, deltas, logs):
        t.fill_(float("nan"))
    plain = pool.clone()
    rows, positions = torch.tensor([2], device=DEVICE), torch.tensor([30], device=DEVICE)
    step = gdn_decode_lazy_triton if impl == "triton" else gdn_decode_lazy_reference
    for t in range(5):
        q, k, v, g, beta, _ = random_inputs(1, heads, dk, dv, seed=t, device=DEVICE)
        want = gated_delta_rows(q, k, v, g, beta, plain, rows)
        got = step(q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions, FOLD_BELOW_ROWS)[0]
        assert _rel(got, want) < 1e-5 and _rel(pool[2], plain[2]) < 1e-5
        assert base[2].unique().tolist() == [30 + t]
        positions = positions + 1


def test_supports_and_registry_self_check():
    from engine_core.registry import Registry

    from kernels import gdn_decode_lazy

    q, k, v, g, beta, _ = random_inputs(2, 2, 16, 32, device=DEVICE)
    pool, base, keys, deltas, logs = random_lazy_state(3, 2, 16, 32, 4, device=DEVICE)
    rows, positions = torch.tensor([0, 2], device=DEVICE), torch.tensor([5, 9], device=DEVICE)
    args = (q, k, v, g, beta, pool, base, keys, deltas, logs, rows, positions)
    assert supports(**describe(*args))
    assert not supports(**describe(*args[:6], base.long(), *args[7:]))  # base positions must be int32
    assert not supports(**describe(*args[:9], logs[:, :1], *args[10:]))  # logs of another rank
    assert not supports(**describe(*args[:5], pool.double(), *args[6:]))
    big = random_lazy_state(3, 2, 16, 32, 17, device=DEVICE)  # rank 17 > MAX_RANK
    assert not supports(**describe(*args[:5], *big, rows, positions))
    assert not supports(**describe(*args[:7], keys.transpose(2, 3).contiguous().transpose(2, 3), *args[8:]))
    # the self-check runs both builds (the op's two samples): a path right on the large-batch build but not folding
    # every row of a small batch fails on the second sample alone
    reg = Registry()
    gdn_decode_lazy.register(reg)
    reg.add_implementation("gdn_decode_rows_lazy", "no_small_build",
                           lambda *a: gdn_decode_lazy_triton(*a[:-1], 0), supports)
    outcome = reg.self_check(DEVICE)["gdn_decode_rows_lazy"]
    assert outcome.startswith("triton passed; no_small_build FAILED: sample 1: pool: "), outcome
