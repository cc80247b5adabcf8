"""kernels/attn_prep.py: the attention layers' decode-row preparation (q/k head norms, partial RoPE, k/v pool write)
in one launch, against `attn_decode_prep_reference` (the model's torch code), on CPU through Triton's interpreter
(tests/conftest.py), compiled on a GPU.

Tolerance: `compare` (q and both pools within 1e-5 x max |ref| in fp32, 1e-2 in bf16: the norm's rsqrt may move a
normed value by an ulp); pool rows not written must stay bit-identical; in bf16 >= 99% of q bit-identical (the RoPE's
three roundings reproduced: `test_rope_roundings_matter` shows an unrounded RoPE falls below that).
"""

import pytest
import torch

from kernels.attn_prep import (
    attn_decode_prep_reference,
    attn_decode_prep_triton,
    compare,
    describe,
    random_inputs,
    supports,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _runs_here() -> bool:
    return supports(**describe(*random_inputs(1, 2, 1, 16, 8, device=DEVICE)))


pytestmark = pytest.mark.skipif(not _runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")


def _run_both(args):
    *rest, k_pool, v_pool = args
    ref = attn_decode_prep_reference(*rest, k_pool.clone(), v_pool.clone())
    out = attn_decode_prep_triton(*rest, k_pool.clone(), v_pool.clone())
    return out, ref


@pytest.mark.parametrize("n,heads,kv_heads,d,rd", [(1, 16, 2, 256, 64), (3, 4, 2, 64, 16), (5, 2, 1, 96, 32),
                                                    (2, 4, 2, 64, 64), (3, 2, 1, 48, 16)])  # RD = D; D not 2^k
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(n, heads, kv_heads, d, rd, dtype):
    args = random_inputs(n, heads, kv_heads, d, rd, num_blocks=4, block_size=8, dtype=dtype, seed=n + d,
                         device=DEVICE)
    slots = args[8]
    (q, kp, vp), (q_ref, kp_ref, vp_ref) = _run_both(args)
    assert q.shape == q_ref.shape and q.is_contiguous() and q.dtype == dtype
    assert compare((q, kp, vp), (q_ref, kp_ref, vp_ref)) is None, compare((q, kp, vp), (q_ref, kp_ref, vp_ref))
    untouched = torch.ones(kp.shape[0] * kp.shape[1], dtype=torch.bool)
    untouched[slots.cpu()] = False
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    assert torch.equal(flat(kp)[untouched.to(DEVICE)], flat(args[9])[untouched.to(DEVICE)])
    assert torch.equal(flat(vp), flat(vp_ref))  # v is copied, not computed
    same = float((q == q_ref).float().mean())
    print(f"\nN={n} H={heads} KVH={kv_heads} D={d} RD={rd} {dtype}: q {same:.4f} bit-identical")
    if dtype == torch.bfloat16:
        assert same >= 0.99
        written = slots.to(DEVICE)
        assert float((flat(kp)[written] == flat(kp_ref)[written]).float().mean()) >= 0.99


def test_rope_roundings_matter():
    """RoPE on the same normed heads without the reference's intermediate bf16 roundings differs in many elements,
    so the bit-identical share above can fail."""
    from kernels.rms_norm import rms_norm_zc_reference

    args = random_inputs(9, 4, 2, 64, 64, dtype=torch.bfloat16, seed=3)
    q, cos, sin = args[0], args[6], args[7]
    y = rms_norm_zc_reference(q, args[3], 1e-6).float()
    rot = torch.cat((-y[..., 32:], y[..., :32]), dim=-1)
    unrounded = (y * cos[:, None].float() + rot * sin[:, None].float()).to(torch.bfloat16)
    ref = attn_decode_prep_reference(*args[:9], args[9].clone(), args[10].clone())[0]
    assert float((unrounded == ref).float().mean()) < 0.99


def test_guards():
    args = random_inputs(3, 4, 2, 64, 16, dtype=torch.bfloat16, device=DEVICE)
    assert supports(**describe(*args))
    q, k, v, wq, wk, eps, cos, sin, slots, kp, vp = args
    assert not supports(**describe(q, k, v, wq, wk, eps, cos, sin, slots.int(), kp, vp))  # int32 slots
    assert not supports(**describe(q, k, v, wq, wk, eps, cos[:, :15], sin[:, :15], slots, kp, vp))  # odd RD
    assert not supports(**describe(q, k, v, wq, wk, eps, cos, sin, slots, kp.transpose(2, 3), vp))  # pool layout
    assert not supports(**describe(*(t.half() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                                     for t in args)))  # fp16
    assert not supports(**describe(q, k[:2], v[:2], wq, wk, eps, cos, sin, slots, kp, vp))  # N mismatch
    strided_pool = torch.empty(kp.shape[0] * 2, *kp.shape[1:], dtype=kp.dtype, device=DEVICE)[::2]
    assert not supports(**describe(q, k, v, wq, wk, eps, cos, sin, slots, strided_pool, vp))  # same shape, strided
    assert not supports(**describe(q, k, v[..., ::2].repeat_interleave(2, -1).transpose(1, 2).contiguous()
                                   .transpose(1, 2), wq, wk, eps, cos, sin, slots, kp, vp))  # non-unit inner stride


def test_duplicate_slots_leave_other_rows_exact():
    """CUDA-graph padding: tokens 1 and 2 both write slot 5 (the scratch); token 0's slot and q of every token are
    as without the duplicate, and no other pool row changes."""
    args = list(random_inputs(3, 4, 2, 64, 16, num_blocks=2, block_size=4, dtype=torch.bfloat16, seed=5,
                              device=DEVICE))
    args[8] = torch.tensor([3, 5, 5], device=DEVICE)
    from kernels import tolerance

    kp0 = args[9].clone()
    (q, kp, _), (q_ref, kp_ref, _) = _run_both(args)
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    assert tolerance.compare(q, q_ref, 1e-2) is None
    assert tolerance.compare(flat(kp)[3], flat(kp_ref)[3], 1e-2) is None
    others = [i for i in range(8) if i not in (3, 5)]
    assert torch.equal(flat(kp)[others], flat(kp0)[others])


@pytest.mark.parametrize("e4m3", [False, True], ids=["model_pools", "e4m3_pools"])
def test_registry_self_check(monkeypatch, e4m3):
    """The start-up self-check; an engine of e4m3 KV pools (`fp8_quant.E4M3_POOL_SAMPLES`) also checks the kernel
    on e4m3 pools, each sample fresh (the op writes its pools)."""
    from engine_core.registry import Registry

    from kernels import attn_prep, fp8_quant

    monkeypatch.setattr(fp8_quant, "E4M3_POOL_SAMPLES", e4m3)
    samples = attn_prep._sample(DEVICE)
    assert [s[0][-1].dtype for s in samples] == [torch.bfloat16] + [torch.float8_e4m3fn] * e4m3
    reg = Registry()
    attn_prep.register(reg)
    assert reg.self_check(DEVICE) == {"attn_decode_prep": "triton passed", "attn_output_gate": "triton passed",
                                      "attn_output_gate_fp8": "triton passed"}


def test_self_check_compare_on_e4m3_pools():
    """`compare` on e4m3 pools: equal codes pass, a k code one e4m3 step off passes (a normed value's ulp may cross
    a rounding boundary), two steps off or any v code changed fails, and so does q out of tolerance."""
    from kernels.fp8_quant import kv_pool_cast

    args = random_inputs(3, 4, 2, 64, 16, dtype=torch.bfloat16, seed=1)
    *rest, kp, vp = args
    ref = attn_decode_prep_reference(*rest, *(kv_pool_cast(p, torch.float8_e4m3fn) for p in (kp, vp)))
    assert compare(ref, ref) is None

    def moved(pool, steps):  # a written code of magnitude 1-240 `steps` codes up (e4m3 codes of one sign are
        out = pool.clone()  #    ordered like their values; 0x7f would be NaN)
        row = out.view(torch.uint8).view(-1, *pool.shape[2:])[int(rest[8][0])].view(-1)
        i = int(((row & 0x7F) >= 0x38).logical_and((row & 0x7F) < 0x77).nonzero()[0])
        row[i] += steps
        return out

    q, k, v = ref
    assert compare((q, moved(k, 1), v), ref) is None
    assert "k_pool" in compare((q, moved(k, 2), v), ref)
    assert "v_pool" in compare((q, k, moved(v, 1)), ref)
    assert compare((q * 1.1, k, v), ref).startswith("q:")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [0.02, 1e-5], ids=["rounding", "saturating"])
def test_output_gate_fp8_codes(dtype, scale):
    """"attn_output_gate_fp8": the output bit-identical to "attn_output_gate"'s, and the codes exactly
    `quantize_static_reference` of that output (o_proj's quantiser, fused); a scale small enough saturates to +-448.
    A code changed by one step is caught by `compare_gate_fp8`."""
    from kernels.attn_prep import (attn_output_gate_fp8_op, attn_output_gate_fp8_reference, attn_output_gate_op,
                                   compare_gate_fp8, gate_inputs)
    from kernels.fp8_quant import quantize_static_reference

    o, gate = gate_inputs(3, 4, 96, dtype=dtype, seed=7, device=DEVICE)
    s = torch.tensor(scale, device=DEVICE)
    y, codes = attn_output_gate_fp8_op(o, gate, s)
    assert torch.equal(y, attn_output_gate_op(o, gate))
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == y.shape
    assert torch.equal(codes.view(torch.uint8), quantize_static_reference(y, s).view(torch.uint8))
    assert (codes.float().abs() == 448).any() == (scale < 1e-3)
    assert compare_gate_fp8((y, codes), attn_output_gate_fp8_reference(o, gate, s)) is None
    bumped = codes.view(torch.uint8).clone()
    bumped.view(-1)[5] ^= 1
    want = attn_output_gate_fp8_reference(o, gate, s)
    assert "codes" in compare_gate_fp8((y, bumped.view(torch.float8_e4m3fn)), want)


# ---- the output gate (o * sigmoid(gate)) in one launch ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,heads,d", [(3, 4, 64), (1, 2, 96), (5, 3, 256)])
def test_output_gate_matches_reference(n, heads, d, dtype):
    """Within the op's tolerance (1e-5 fp32, 1e-2 bf16 of max |ref|) and, in bf16, >= 99% bit-identical (torch's
    sigmoid rounding is reproduced: skipping it leaves far fewer identical, asserted)."""
    from kernels.attn_prep import attn_output_gate_reference, attn_output_gate_triton, compare_gate, gate_inputs

    o, gate = gate_inputs(n, heads, d, dtype, seed=d + n, device=DEVICE)
    assert not gate.is_contiguous()
    out, ref = attn_output_gate_triton(o, gate), attn_output_gate_reference(o, gate)
    assert out.shape == (n, heads * d) and out.dtype == dtype and out.is_contiguous()
    assert compare_gate(out, ref) is None, compare_gate(out, ref)
    if dtype == torch.bfloat16:
        assert float((out == ref).float().mean()) >= 0.99
        unrounded = (o.float().reshape(n, -1) * torch.sigmoid(gate.float().reshape(n, -1))).to(dtype)
        assert float((unrounded == ref).float().mean()) < 0.99
    else:
        assert compare_gate(out * 1.001, ref) is not None  # the comparison has teeth


def test_output_gate_guards_and_registry():
    from engine_core.registry import Registry

    from kernels import attn_prep
    from kernels.attn_prep import describe_gate, gate_inputs, supports_gate

    o, gate = gate_inputs(2, 2, 64, device=DEVICE)
    assert supports_gate(**describe_gate(o, gate))
    assert not supports_gate(**describe_gate(o, gate.float()))
    assert not supports_gate(**describe_gate(o.half(), gate.half()))
    assert not supports_gate(**describe_gate(o, gate[:1]))
    assert not supports_gate(**describe_gate(o.transpose(1, 2), gate.transpose(1, 2)))
    reg = Registry()
    attn_prep.register(reg)
    assert reg.self_check(DEVICE, ops=["attn_output_gate"]) == {"attn_output_gate": "triton passed"}
    torch.library.opcheck(torch.ops.qwen.attn_output_gate.default, (o, gate),
                          test_utils=("test_schema", "test_faketensor"))
