"""kernels/gdn_decode.py: the Gated DeltaNet decode step against `qwen_engine.model.gdn.gated_delta_step` (on CPU
through Triton's interpreter, tests/conftest.py).

Tolerance: 1e-5 x max |ref| on o and on the new state: the kernel performs the reference's fp32 operations, only the
two reductions over Dk are summed in another order and exp may differ by an ulp (~1e-7 relative; measured and
printed with `pytest -s`). Multi-step: 16 chained tokens stay within 1e-5 as well (the decay keeps errors bounded).
"""

import pytest
import torch

from kernels.gdn_decode import (
    compare,
    describe,
    describe_rows,
    gdn_decode_,
    gdn_decode_reference,
    gdn_decode_rows_,
    gdn_decode_rows_reference,
    gdn_decode_rows_triton,
    gdn_decode_triton,
    random_inputs,
    supports,
    supports_rows,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bsz,heads,dk,dv", [(1, 2, 128, 128), (3, 4, 32, 48), (2, 1, 24, 40)])  # model dims; Dv
def test_step_matches_reference(bsz, heads, dk, dv):  # not a power of two; Dk not either
    args = random_inputs(bsz, heads, dk, dv, seed=bsz * dk + dv, device=DEVICE)
    state0 = args[-1].clone()
    ref = gdn_decode_reference(*args)
    out = gdn_decode_triton(*args)
    assert torch.equal(args[-1], state0)  # out of place: the input state is untouched
    problem = compare(out, ref)
    assert problem is None, problem
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(out, ref))
    print(f"\nB={bsz} H={heads} Dk={dk} Dv={dv}: max relative error {err:.2g}")


def test_in_place_chain_of_tokens():
    """The in-place op the model uses, 16 tokens in a row, vs the reference chained the same way; strided q/k
    (views into a fused projection, as the model produces them)."""
    bsz, heads, dk, dv = 2, 3, 32, 32
    _, _, _, _, _, state = random_inputs(bsz, heads, dk, dv, seed=1, device=DEVICE)
    ref_state, state = state.clone(), state.clone()
    for t in range(16):
        q, k, v, g, beta, _ = random_inputs(bsz, heads, dk, dv, seed=100 + t, device=DEVICE)
        qk = torch.cat((q, k), dim=-1)  # [B, H, 2 Dk]: q and k are strided views
        o_ref, ref_state = gdn_decode_reference(q, k, v, g, beta, ref_state)
        o = gdn_decode_(qk[..., :dk], qk[..., dk:], v, g, beta, state)
        assert compare((o, state), (o_ref, ref_state)) is None, f"token {t}"


def test_guard_boundaries():
    args = random_inputs(1, 2, 32, 32, device=DEVICE)
    info = describe(*args)
    assert supports(**info)
    assert not supports(**describe(*args[:5], args[5].double()))  # fp64 state
    assert not supports(**describe(args[0][:, :1], *args[1:]))  # q heads != state heads (not repeated)
    assert not supports(**{**info, "head_dims": (512, 128)})
    assert not supports(**{**info, "device": "cuda" if DEVICE == "cpu" else "cpu"})
    with pytest.raises(ValueError, match="contiguous"):
        gdn_decode_(*args[:5], args[5].transpose(2, 3))


def test_registry_self_check():
    from engine_core.registry import Registry

    from kernels import gdn_decode

    reg = Registry()
    gdn_decode.register(reg)
    checks = reg.self_check(DEVICE)
    assert checks == {"gdn_decode": "triton passed", "gdn_decode_rows": "triton passed",
                      "gdn_decode_rows_norm_fp8": "triton passed"}, checks


def test_rows_in_place_over_a_pool():
    """The engine's form: batch rows own rows 3, 0, 4 of a 6-row pool; 8 tokens in a row, strided q/k; the pool's
    other rows stay bit-identical, the owned rows track the reference (gather, step, scatter) within 1e-5."""
    bsz, heads, dk, dv = 3, 2, 32, 48
    *_, pool = random_inputs(6, heads, dk, dv, seed=7, device=DEVICE)
    ref_pool, pool0 = pool.clone(), pool.clone()
    rows = torch.tensor([3, 0, 4], device=DEVICE)
    for t in range(8):
        q, k, v, g, beta, _ = random_inputs(bsz, heads, dk, dv, seed=200 + t, device=DEVICE)
        qk = torch.cat((q, k), dim=-1)
        o_ref, _ = gdn_decode_rows_reference(q, k, v, g, beta, ref_pool, rows)
        o, same = gdn_decode_rows_triton(qk[..., :dk], qk[..., dk:], v, g, beta, pool, rows)
        assert same is pool
        assert compare((o, pool), (o_ref, ref_pool)) is None, f"token {t}"
    assert torch.equal(pool[[1, 2, 5]], pool0[[1, 2, 5]])
    assert not torch.equal(pool[[0, 3, 4]], pool0[[0, 3, 4]])


@pytest.mark.parametrize("block_v,num_warps,maxnreg", [(16, 2, None), (32, 8, 168), (64, 4, 128)])
def test_rows_launch_overrides(block_v, num_warps, maxnreg):
    """`_launch`'s launch settings (benchmarks/gdn_step_launch_bench.py's sweep) compute the same step: a pool's rows
    against the reference within 1e-5, the other rows untouched, Dv 48 not a multiple of the wider tiles."""
    from kernels.gdn_decode import _launch

    bsz, heads, dk, dv = 3, 2, 32, 48
    q, k, v, g, beta, _ = random_inputs(bsz, heads, dk, dv, seed=11, device=DEVICE)
    *_, pool = random_inputs(5, heads, dk, dv, seed=12, device=DEVICE)
    ref_pool, pool0 = pool.clone(), pool.clone()
    rows = torch.tensor([4, 1, 2], device=DEVICE)
    o_ref, _ = gdn_decode_rows_reference(q, k, v, g, beta, ref_pool, rows)
    o = _launch(q, k, v, g, beta, pool, pool, rows, block_v=block_v, num_warps=num_warps, maxnreg=maxnreg)
    assert compare((o, pool), (o_ref, ref_pool)) is None
    assert torch.equal(pool[[0, 3]], pool0[[0, 3]])


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_rows_early_same_bits(monkeypatch, pool_dtype):
    """EARLY (early loads, the engine's `early_loads`: the rows op reads its state slices before the PDL wait):
    o and the advanced pool bit for bit as the plain launch's, over tokens, fp32 and bf16 pools; the op asks for it
    only through `pdl.early_options` (off unless PDL is on and `pdl.set_early`). Under the interpreter the wait is a
    no-op: this checks the EARLY build's arithmetic; its order is tests/sm90_compile.py's "early" check."""
    from kernels import pdl

    bsz, heads, dk, dv = 3, 2, 32, 48
    *_, pool = random_inputs(6, heads, dk, dv, seed=21, device=DEVICE)
    pools = {False: pool.to(pool_dtype).clone(), True: pool.to(pool_dtype).clone()}  # (.to(fp32) would alias)
    rows = torch.tensor([5, 0, 3], device=DEVICE)
    for t in range(3):
        q, k, v, g, beta, _ = random_inputs(bsz, heads, dk, dv, seed=400 + t, device=DEVICE)
        outs = {}
        for early in (False, True):
            monkeypatch.setattr(pdl, "early_options", lambda early=early: {"EARLY": True} if early else {})
            ref_pool = pools[early].clone()
            o_ref, _ = gdn_decode_rows_reference(q, k, v, g, beta, ref_pool, rows)
            outs[early], _ = gdn_decode_rows_triton(q, k, v, g, beta, pools[early], rows)
            if pool_dtype == torch.float32:
                assert compare((outs[early], pools[early]), (o_ref, ref_pool)) is None
        assert torch.equal(outs[True], outs[False]) and torch.equal(pools[True], pools[False]), t


def test_rows_over_a_bf16_pool():
    """`gdn_state_dtype: bfloat16`: the pool is widened as read and the new state rounded to nearest even as stored,
    o from the unrounded fp32 state, as `gated_delta_rows` does. Per token, from the same bf16 pool: o within 1e-5
    of the reference's, the stored rows within one bf16 ulp of its (the fp32 sums' order may tip a rounding; exact
    ties aside, >= 99% bit-equal), the other rows untouched; the guard takes fp32 and bf16 pools, not fp16."""
    bsz, heads, dk, dv = 3, 2, 32, 48
    *_, pool32 = random_inputs(6, heads, dk, dv, seed=17, device=DEVICE)
    pool = pool32.to(torch.bfloat16)
    rows = torch.tensor([3, 0, 4], device=DEVICE)
    for t in range(4):
        q, k, v, g, beta, _ = random_inputs(bsz, heads, dk, dv, seed=300 + t, device=DEVICE)
        ref_pool, before = pool.clone(), pool.clone()
        o_ref, _ = gdn_decode_rows_reference(q, k, v, g, beta, ref_pool, rows)
        o, same = gdn_decode_rows_triton(q, k, v, g, beta, pool, rows)
        assert same is pool and pool.dtype == torch.bfloat16
        assert (o - o_ref).abs().max() <= 1e-5 * o_ref.abs().max(), f"token {t}"
        a, b = pool.float(), ref_pool.float()
        ulp = torch.finfo(torch.bfloat16).eps * b.abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
        assert ((a - b).abs() <= ulp).all(), f"token {t}: {float(((a - b).abs() / ulp).max()):.2g} ulp"
        assert (pool == ref_pool).float().mean() >= 0.99, f"token {t}"
        assert torch.equal(pool[[1, 2, 5]], before[[1, 2, 5]])
    assert supports_rows(**describe_rows(q, k, v, g, beta, pool, rows))
    assert not supports_rows(**describe_rows(q, k, v, g, beta, pool.half(), rows))


def test_rows_padding_share_a_scratch_row():
    """Decode-graph padding: batch rows 2 and 3 both point at scratch row 5. The real rows (0 -> pool row 1,
    1 -> pool row 3) and the pool rows nobody owns stay exactly what they are without the padding."""
    heads, dk, dv = 2, 32, 32
    *_, pool = random_inputs(6, heads, dk, dv, seed=11, device=DEVICE)
    q, k, v, g, beta, _ = random_inputs(4, heads, dk, dv, seed=12, device=DEVICE)
    alone = pool.clone()
    o_alone, _ = gdn_decode_rows_triton(q[:2], k[:2], v[:2], g[:2], beta[:2], alone,
                                        torch.tensor([1, 3], device=DEVICE))
    o, _ = gdn_decode_rows_triton(q, k, v, g, beta, pool, torch.tensor([1, 3, 5, 5], device=DEVICE))
    assert torch.equal(o[:2], o_alone)
    keep = [0, 1, 2, 3, 4]
    assert torch.equal(pool[keep], alone[keep])


def test_rows_guards():
    q, k, v, g, beta, pool = random_inputs(2, 2, 32, 32, device=DEVICE)
    rows = torch.tensor([1, 0], device=DEVICE)
    assert supports_rows(**describe_rows(q, k, v, g, beta, pool, rows))
    assert not supports_rows(**describe_rows(q, k, v, g, beta, pool, rows.int()))  # int32 rows
    assert not supports_rows(**describe_rows(q, k, v, g, beta, pool, rows[:1]))  # one row for two tokens
    assert not supports_rows(**describe_rows(q, k, v, g, beta, pool.transpose(2, 3), rows))  # not contiguous
    assert not supports_rows(**describe_rows(q, k, v, g, beta, pool, torch.tensor([1, 9, 0], device=DEVICE)[::2]))
    assert not supports_rows(**describe_rows(q, k, v, g, beta, pool, rows.to("meta")))  # rows elsewhere
    with pytest.raises(ValueError, match="int64"):
        gdn_decode_rows_(q, k, v, g, beta, pool, rows.int())
