"""kernels/gdn_chunk.py: the GDN prefill of all of a step's prefill sequences in one call (flash-linear-attention's
chunked kernels on CUDA) against the per-sequence torch reference.

On the CPU only the reference and the registry's fallback are exercised: fla's kernels need a GPU driver even under
Triton's interpreter. On a GPU with `fla-core` installed, fla against the reference (tolerance: 2e-3 x max |ref|,
TF32 products; kernels/gdn_chunk.py)."""

import copy

import pytest
import torch

from engine_core.registry import Registry
from kernels import gdn_chunk
from kernels.gdn_chunk import compare, describe, gdn_chunk_reference, random_inputs, supports
from qwen_engine.model.gdn import gated_delta_rule_recurrent

CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("lengths", [(70,), (5, 130, 64), (1, 1)])
def test_reference_equals_the_token_recurrence(lengths):
    """The flat varlen reference (chunked rule per sequence, chunk 16 here) against the token-by-token recurrence of
    each sequence from its own entering state: fp32 level (1e-5 of max |ref|)."""
    q, k, v, g, beta, states, cu = random_inputs(lengths, 2, 16, 24, seed=len(lengths))
    o, finals = gdn_chunk_reference(q, k, v, g, beta, states, cu, chunk_size=16)
    bounds = cu.tolist()
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        o_ref, f_ref = gated_delta_rule_recurrent(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e],
                                                  beta[None, s:e], states[i:i + 1])
        assert compare((o[s:e], finals[i]), (o_ref[0], f_ref[0]), tol=1e-5) is None
    assert not torch.equal(finals, states)  # the states advanced (and the inputs were not modified in place)


def test_one_sequence_without_cu_seqlens():
    """cu_seqlens None = one sequence of all T tokens (the fixed-length call a single prefill row takes): the same
    numbers as [0, T]; the guard wants exactly one entering state then."""
    q, k, v, g, beta, states, cu = random_inputs((37,), 2, 16, 16, seed=4)
    assert compare(gdn_chunk_reference(q, k, v, g, beta, states, None),
                   gdn_chunk_reference(q, k, v, g, beta, states, cu), tol=0.0) is None
    assert describe(q, k, v, g, beta, states, None)["shapes_ok"]
    assert not describe(q, k, v, g, beta, states.expand(2, -1, -1, -1), None)["shapes_ok"]


def padded_with_zero_gates(args, pad: int):
    """`random_inputs` of one sequence plus `pad` tokens of random q, k, v whose decay g and write strength beta are
    0: what a padded prefill graph feeds (qwen_engine/prefill_graphs.py)."""
    q, k, v, g, beta, states, _ = args
    gen = torch.Generator().manual_seed(99)
    extra = [torch.nn.functional.normalize(torch.randn(pad, *t.shape[1:], generator=gen), dim=-1).to(t.device)
             for t in (q, k, v)]
    zeros = torch.zeros(pad, *g.shape[1:], device=g.device)
    return (*(torch.cat((t, e)) for t, e in zip((q, k, v), extra)), torch.cat((g, zeros)), torch.cat((beta, zeros)),
            states, None)


def test_zero_gate_padding_leaves_outputs_and_state():
    """Padding tokens with g = beta = 0 after a sequence (the prefill graphs' padding) change neither its outputs nor
    its final state: S_t = exp(0) S_{t-1} (I - 0) + 0 = S_{t-1}. 37 real tokens + 27 padding, chunk 16 (padding fills
    a chunk of its own)."""
    args = random_inputs((37,), 2, 16, 16, seed=6)
    o, finals = gdn_chunk_reference(*args[:-1], None, chunk_size=16)
    o_pad, finals_pad = gdn_chunk_reference(*padded_with_zero_gates(args, 27), chunk_size=16)
    assert compare((o_pad[:37], finals_pad), (o, finals), tol=1e-6) is None


def test_guard_and_cpu_fallback():
    args = random_inputs((9, 4), 2, 16, 16)
    info = describe(*args)
    assert info["shapes_ok"] and not supports(**info)  # CPU tensors: never fla
    q, k, v, g, beta, states, cu = args
    assert not describe(q, k, v, g, beta, states[:1], cu)["shapes_ok"]  # 2 sequences, 1 state
    assert not supports(**{**info, "device": "cuda", "dtypes": {torch.bfloat16}})
    reg = Registry()
    gdn_chunk.register(reg)
    out = reg.call(gdn_chunk.NAME, *args)
    assert reg.choices()[gdn_chunk.NAME]["last"] == "reference"
    assert compare(out, gdn_chunk_reference(*args), tol=0.0) is None


@pytest.mark.skipif(not CUDA, reason="fla's kernels need a GPU")
@pytest.mark.parametrize("lengths,dk", [((1024,), 128), ((70, 5, 130, 64, 1), 128), ((300,), 64)])
def test_fla_matches_reference_on_gpu(lengths, dk):
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core; the device bundle has it)")
    args = random_inputs(lengths, 4, dk, 128, seed=sum(lengths), device="cuda")
    info = describe(*args)
    assert supports(**info), info
    got, ref = gdn_chunk.gdn_chunk_fla(*args), gdn_chunk_reference(*args)
    err = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, ref))
    print(f"\nfla vs reference, lengths {lengths}, Dk {dk}: max rel err {err:.2e}")
    assert compare(got, ref) is None
    host = args[-1].cpu()  # the offsets on the host too (the engine's form: fla builds its chunk indices sync-free)
    assert supports(**describe(*args, host)) and not supports(**describe(*args, host[:-1]))
    assert compare(gdn_chunk.gdn_chunk_fla(*args, host), ref) is None
    if len(lengths) == 1:  # fla's fixed-length path (no cu_seqlens): what a single prefill row and its graph run
        fixed = gdn_chunk.gdn_chunk_fla(*args[:-1], None)
        assert compare(fixed, ref) is None
    reg = Registry()
    gdn_chunk.register(reg)
    assert all("passed" in v for v in reg.self_check("cuda").values())


@pytest.mark.skipif(not CUDA, reason="fla's kernels need a GPU")
def test_fla_zero_gate_padding_on_gpu():
    """fla's fixed-length call over a sequence padded with g = beta = 0 tokens (what the prefill graphs run) against
    the reference on the unpadded sequence: within fla's tolerance."""
    pytest.importorskip("fla", reason="fla-core is not installed (pip install fla-core; the device bundle has it)")
    args = random_inputs((1000,), 4, 128, 128, seed=5, device="cuda")
    ref = gdn_chunk_reference(*args[:-1], None)
    o, finals = gdn_chunk.gdn_chunk_fla(*padded_with_zero_gates(args, 24))
    assert compare((o[:1000], finals), ref) is None


def test_model_prefill_rows_through_the_op():
    """`GatedDeltaNet.forward_paged` of a bf16 model with `batch.gdn_chunk` set (one call for every prefill row, what
    the runner does on CUDA) against its own per-sequence loop: a step of 2 decode rows and 3 prefill chunks (1, 20
    and 37 tokens) over state rows out of order, from non-zero states. Same outputs and states to fp32 level (here
    the op is the reference; on a GPU the runner's registry serves it with fla, checked above). An fp32 model does
    not take the op (fla's TF32 products)."""
    from qwen_engine.config import QwenConfig
    from qwen_engine.engine import randomise
    from qwen_engine.model.causal_lm import QwenForCausalLM
    from qwen_engine.model.gdn import GatedDeltaNet
    from qwen_engine.model.paged import FlatBatch, GDNSlots

    cfg = QwenConfig.tiny()
    model = QwenForCausalLM(cfg, gdn_chunk_size=16).eval()
    randomise(model, 0)
    gdn32 = next(m for m in model.modules() if isinstance(m, GatedDeltaNet))
    gdn = copy.deepcopy(gdn32).to(torch.bfloat16)  # the op serves bf16 / fp16 models
    gen = torch.Generator().manual_seed(3)
    lengths, state_rows = (1, 1, 1, 20, 37), (4, 0, 2, 5, 1)
    seqs = [(7 if n == 1 and i < 2 else 0, n, (0,), r) for i, (n, r) in enumerate(zip(lengths, state_rows))]
    x = torch.randn(sum(lengths), cfg.hidden_size, generator=gen)
    conv = torch.randn(6, gdn.conv1d.weight.shape[0], cfg.linear_conv_kernel_dim - 1, generator=gen)
    rec = torch.randn(6, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, generator=gen) * 0.3

    def refuse(*_):
        raise AssertionError("an fp32 model must not take the op")

    with torch.no_grad():  # fp32: the torch loop, never the op
        gdn32.forward_paged(x, GDNSlots(conv.clone(), rec.clone()), FlatBatch.build(seqs, 2, 64, "cpu",
                                                                                       gdn_chunk=refuse))
    x, conv = x.to(torch.bfloat16), conv.to(torch.bfloat16)
    calls = []

    def op_spy(*args):  # the op as the runner passes it: records the offsets (device, host) it was handed
        calls.append((args[-2], args[-1]))
        return gdn_chunk_reference(*args)

    outs, states = [], []
    for op in (None, op_spy):
        slots = GDNSlots(conv.clone(), rec.clone())
        batch = FlatBatch.build(seqs, 2, 64, "cpu", gdn_chunk=op)
        with torch.no_grad():
            outs.append(gdn.forward_paged(x, slots, batch))
            if op is op_spy:  # a second GDN layer of the same step
                gdn.forward_paged(x, GDNSlots(conv.clone(), rec.clone()), batch)
        states.append(slots.recurrent)
    # one call per layer for the 3 prefill rows, offsets relative to the first of them, on the host too; every layer
    # of the step gets the very same tensors (fla caches its chunk indices by identity)
    assert len(calls) == 2 and calls[0][0].tolist() == calls[0][1].tolist() == [0, 1, 21, 58]
    assert calls[1][0] is calls[0][0] and calls[1][1] is calls[0][1] and calls[0][1].device.type == "cpu"
    # a step with one prefill row hands over no cu_seqlens (fla's fixed-length path)
    one = [seqs[0], seqs[1], seqs[3]]
    calls.clear()
    n1 = 2 + lengths[3]
    with torch.no_grad():
        gdn.forward_paged(x[:n1], GDNSlots(conv.clone(), rec.clone()),
                          FlatBatch.build(one, 2, 64, "cpu", gdn_chunk=lambda *a: (calls.append(a[-2:]),
                                                                                     gdn_chunk_reference(*a))[1]))
    assert calls == [(None, None)]
    assert compare((outs[1].float(), states[1]), (outs[0].float(), states[0]), tol=1e-5) is None
    assert torch.equal(states[1][3], rec[3])  # row 3 belongs to nobody: untouched
    assert not torch.equal(states[1][5], rec[5])  # a prefill row advanced
