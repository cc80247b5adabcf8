"""The FP8 KV cache (`QwenEngineConfig.kv_cache_dtype` "fp8" / "auto"): e4m3 codes at scale 1.0 in the paged pools.

What must hold, and the tolerances:
- the pool cast (`kernels.fp8_quant.kv_pool_cast`) is `quantize_static_reference` at scale 1.0 bit for bit (RNE,
  saturating at +-448, NaN kept);
- every writer stores those codes: the torch write (`PagedKV.write`) exactly; the attention prep kernel
  (`attn_decode_prep`) exactly for v (copied) and for k wherever its normed + rotated row equals the reference's
  (>= 99% of the rows' elements in bf16, as tests/test_kernel_attn_prep.py holds the bf16 pools), else one e4m3 step;
- every reader attends to the stored values: the Triton decode attention on e4m3 pools within the op's tolerance of
  its fp32 reference, and that reference on e4m3 pools equal (bit for bit) to it on model-dtype pools holding the same
  values; the model's paged path (prefill, continued chunks, decode, preemption) against the contiguous reference
  whose KV cache rounds k / v the same way: tests/test_qwen_engine.py::test_paged_forward_matches_contiguous (fp8
  cases), within that test's tolerances;
- the engine: pools of e4m3, half the bytes a block, greedy tokens equal to that rounding reference's; "auto" follows
  the checkpoint's declaration; bad values are refused.
"""

import asyncio

import pytest
import torch

from kernels.fp8_quant import kv_pool_cast, quantize_static_reference
from qwen_engine.config import QwenConfig
from qwen_engine.model.paged import PagedKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def test_pool_cast_is_the_static_quantiser_at_scale_one():
    x = torch.cat([torch.randn(4096) * 60, torch.tensor([448.0, 449.0, 500.0, -1e4, 1e-9, 0.0, float("nan")])])
    codes = kv_pool_cast(x.to(torch.bfloat16), E4M3)
    ref = quantize_static_reference(x.to(torch.bfloat16), torch.tensor(1.0))
    assert codes.dtype == E4M3
    assert torch.equal(codes.view(torch.uint8), ref.view(torch.uint8))
    tail = codes[-7:].float()
    assert tail[:4].tolist() == [448.0, 448.0, 448.0, -448.0] and torch.isnan(tail[-1])
    assert kv_pool_cast(x, torch.bfloat16).dtype == torch.bfloat16  # other pools: a plain cast
    assert kv_pool_cast(x, torch.float32) is x or torch.equal(kv_pool_cast(x, torch.float32)[:-1], x[:-1])


def test_paged_kv_write_and_stored_round_trip():
    pool = lambda: torch.zeros(6, 4, 2, 8, dtype=E4M3)  # noqa: E731  [blocks, block_size, KVH, D]
    kv = PagedKV(pool(), pool())
    k, v = torch.randn(5, 2, 8) * 100, torch.randn(5, 2, 8)
    slots = torch.tensor([0, 7, 8, 22, 23])
    kv.write(slots, k, v)
    assert torch.equal(kv.k.view(-1, 2, 8)[slots].float(), kv_pool_cast(k, E4M3).float())
    assert torch.equal(kv.v.view(-1, 2, 8)[slots].float(), kv_pool_cast(v, E4M3).float())
    others = torch.ones(24, dtype=torch.bool)
    others[slots] = False
    assert not kv.k.view(-1, 2, 8)[others].float().any()
    assert torch.equal(kv.stored(k, torch.float32), kv_pool_cast(k, E4M3).float())
    plain = PagedKV(torch.zeros(6, 4, 2, 8), torch.zeros(6, 4, 2, 8))
    assert kv.stored(k, torch.float32).ne(k).any() and torch.equal(plain.stored(k, torch.float32), k)
    from qwen_engine.model.attention import gather_kv

    table = torch.tensor([0, 1, 2, 5])
    gk, gv = gather_kv(kv, table, 9, torch.bfloat16)
    assert gk.dtype == torch.bfloat16 and gk.shape == (1, 2, 9, 8)
    assert torch.equal(gk[0, :, 7].float(), kv_pool_cast(k[1], E4M3).float())  # position 7 = slot 7


# ---- the decode attention on e4m3 pools ----------------------------------------------------------------------------
def _e4m3_inputs(contexts, heads, kv_heads, head_dim, block_size, dtype, seed):
    from kernels.paged_attention import random_inputs

    q, k, v, tables, ctx, scale = random_inputs(contexts, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                                block_size=block_size, dtype=torch.float32, seed=seed,
                                                device=DEVICE)
    return q.to(dtype), kv_pool_cast(4 * k, E4M3), kv_pool_cast(4 * v, E4M3), tables, ctx, scale


def _attention_runs_here() -> bool:
    from kernels.paged_attention import describe, supports

    return supports(**describe(*_e4m3_inputs([3], 2, 1, 16, 4, torch.bfloat16, 0)[:5]))


@pytest.mark.skipif(not _attention_runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_attention_on_e4m3_pools(dtype, num_splits):
    from kernels.paged_attention import compare, paged_decode_attention_reference, paged_decode_attention_triton

    args = _e4m3_inputs([1, 8, 2 * 8 + 3, 5 * 8 + 1], 8, 2, 32, 8, dtype, seed=11)
    out = paged_decode_attention_triton(*args, num_splits=num_splits)
    ref = paged_decode_attention_reference(*args)
    assert out.dtype == dtype and compare(out, ref) is None, compare(out, ref)
    q, kp, vp, *rest = args  # the same values in pools of q's dtype: the reference sees no difference
    same = paged_decode_attention_reference(q, kp.to(dtype), vp.to(dtype), *rest)
    assert torch.equal(ref, same)


@pytest.mark.skipif(not _attention_runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")
def test_gated_decode_attention_on_e4m3_pools():
    """The engine's decode path (the output gate and o_proj's codes in the combine) on e4m3 pools."""
    from kernels.paged_attention import (
        compare_gated,
        paged_decode_attention_gated_fp8_reference,
        paged_decode_attention_gated_fp8_triton,
    )

    args = _e4m3_inputs([5, 37, 64], 16, 2, 64, 16, torch.bfloat16, seed=5)
    gate = torch.randn(args[0].shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    extra = (gate, torch.tensor(0.01, device=DEVICE))
    out = paged_decode_attention_gated_fp8_triton(*args, *extra)
    ref = paged_decode_attention_gated_fp8_reference(*args, *extra)
    assert compare_gated(out, ref) is None, compare_gated(out, ref)


def test_e4m3_pools_need_sm89_on_a_gpu(monkeypatch):
    """Triton's e4m3 type compiles from sm_89 on: below it both kernels refuse e4m3 pools (the references run them),
    while bf16 pools still take the kernels from sm_80."""
    import kernels.attn_prep as ap
    import kernels.paged_attention as pa

    monkeypatch.setattr(pa, "_interpreted", lambda: False)
    monkeypatch.setattr(ap, "_interpreted", lambda: False)
    base = dict(device="cuda", same_device=True, index_dtypes={torch.int64}, shapes_ok=True, head_dim=256, group=8,
                unit_strides=True, dtypes={torch.bfloat16})
    for cap, want in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        assert pa.supports(capability=cap, pool_dtypes={E4M3}, **base) is want, cap
        assert pa.supports(capability=cap, pool_dtypes={torch.bfloat16}, **base)
        assert ap.supports(capability=cap, pool_dtypes={E4M3}, dtypes={torch.bfloat16}, device="cuda",
                           same_device=True, slots_ok=True, shapes_ok=True, head_dim=256, pools_contiguous=True,
                           unit_strides=True) is want, cap


def test_decode_attention_guard_takes_e4m3_pools_not_mixed_ones():
    from kernels.paged_attention import describe, supports

    q, kp, vp, tables, ctx, _ = _e4m3_inputs([3, 9], 4, 2, 16, 4, torch.bfloat16, 1)
    info = describe(q, kp, vp, tables, ctx)
    assert info["pool_dtypes"] == {E4M3}
    if not _attention_runs_here():
        pytest.skip("the kernel's guard needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")
    assert supports(**info)
    assert not supports(**describe(q, kp.to(torch.bfloat16), vp, tables, ctx))  # mixed pools
    assert not supports(**describe(q, kp.to(torch.float16), vp.to(torch.float16), tables, ctx))  # pools != q


# ---- the attention prep's pool write --------------------------------------------------------------------------------
def _prep_runs_here() -> bool:
    from kernels.attn_prep import describe, random_inputs, supports

    args = random_inputs(1, 2, 1, 16, 8, device=DEVICE)
    return supports(**describe(*args[:9], args[9].to(E4M3), args[10].to(E4M3)))


@pytest.mark.skipif(not _prep_runs_here(), reason="needs triton (CUDA, or TRITON_INTERPRET=1 on the CPU)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_attn_prep_writes_the_pool_codes(dtype):
    from kernels.attn_prep import attn_decode_prep_reference, attn_decode_prep_triton, random_inputs

    args = random_inputs(6, 16, 2, 256, 64, num_blocks=4, block_size=8, dtype=dtype, seed=9, device=DEVICE)
    *rest, kp, vp = args
    rest[2] = rest[2].clone()
    rest[2][:, :, :8] *= 1000  # v rows past e4m3's 448: the codes saturate (an unclamped cast would not)
    slots = rest[8]
    kp, vp = kv_pool_cast(kp, E4M3), kv_pool_cast(vp, E4M3)
    q_ref, kp_ref, vp_ref = attn_decode_prep_reference(*rest, kp.clone(), vp.clone())
    q, kp_out, vp_out = attn_decode_prep_triton(*rest, kp.clone(), vp.clone())
    from kernels import tolerance
    from kernels.attn_prep import TOLERANCE

    assert kp_out.dtype == E4M3 and tolerance.compare(q, q_ref, TOLERANCE[dtype]) is None  # q as with bf16 pools
    flat = lambda t: t.view(torch.uint8).reshape(-1, *t.shape[2:])  # noqa: E731
    assert torch.equal(flat(vp_out), flat(vp_ref))  # v's codes: copied, then cast the same way
    untouched = torch.ones(kp.shape[0] * kp.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(flat(kp_out)[untouched], flat(kp)[untouched])
    got, want = kp_out.view(-1, *kp.shape[2:])[slots].float(), kp_ref.view(-1, *kp.shape[2:])[slots].float()
    same = float((got == want).float().mean())
    assert same >= 0.99, same
    # where a normed value moved by an ulp across a rounding boundary: one e4m3 step (2^-3 relative) at most
    assert bool(((got - want).abs() <= want.abs() * 2 ** -3 + 2 ** -9).all())


# ---- the engine -----------------------------------------------------------------------------------------------------
def test_resolve_kv_cache_dtype_follows_the_checkpoint_for_auto():
    from qwen_engine.engine import KV_CACHE_DTYPES, QwenEngineConfig, resolve_kv_cache_dtype

    plain = QwenConfig.tiny()
    nvidia = QwenConfig.tiny(quantization_config={"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8"})
    sidecar = QwenConfig.tiny(quantization_config={"quantization": {"kv_cache_quant_algo": "FP8"}})
    other = QwenConfig.tiny(quantization_config={"kv_cache_quant_algo": "NVFP4"})
    assert plain.kv_cache_quant_algo is None and nvidia.kv_cache_quant_algo == "FP8" == sidecar.kv_cache_quant_algo
    bf16 = torch.bfloat16
    assert resolve_kv_cache_dtype("model", nvidia, bf16) == bf16
    assert resolve_kv_cache_dtype("fp8", plain, bf16) == E4M3
    assert resolve_kv_cache_dtype("auto", plain, bf16) == bf16
    assert resolve_kv_cache_dtype("auto", nvidia, bf16) == E4M3 == resolve_kv_cache_dtype("auto", sidecar, bf16)
    with pytest.raises(ValueError, match="kv_cache_quant_algo 'NVFP4'"):
        resolve_kv_cache_dtype("auto", other, bf16)
    assert resolve_kv_cache_dtype("fp8", other, bf16) == E4M3
    assert KV_CACHE_DTYPES == ("model", "fp8", "auto")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        QwenEngineConfig(config="tiny", kv_cache_dtype="int8")


def test_read_config_takes_the_sidecars_kv_cache_declaration(tmp_path):
    """NVIDIA's export: config.json's quantization_config names no KV cache precision, hf_quant_config.json does."""
    import json

    from qwen_engine.checkpoint import read_config, save_checkpoint
    from qwen_engine.model import QwenForCausalLM

    cfg = QwenConfig.tiny()
    weights = QwenForCausalLM(cfg).state_dict()
    save_checkpoint(tmp_path / "nv", cfg, weights, return_weights=False)
    raw = json.loads((tmp_path / "nv" / "config.json").read_text())
    assert "kv_cache_quant_algo" not in raw["quantization_config"]
    assert read_config(tmp_path / "nv").kv_cache_quant_algo == "FP8"
    save_checkpoint(tmp_path / "none", cfg, weights, return_weights=False, kv_cache_quant_algo=None)
    assert read_config(tmp_path / "none").kv_cache_quant_algo is None
    save_checkpoint(tmp_path / "bf16", cfg, weights, recipe=None, return_weights=False)
    assert read_config(tmp_path / "bf16").kv_cache_quant_algo is None
    # a config.json whose block nests its keys under "quantization", as the sidecar does: the declaration lands there
    raw["quantization_config"] = {"quantization": raw["quantization_config"]}
    (tmp_path / "nv" / "config.json").write_text(json.dumps(raw))
    assert read_config(tmp_path / "nv").kv_cache_quant_algo == "FP8"


def test_an_unsupported_kv_declaration_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    """kv_cache_dtype "auto" on a checkpoint declaring a KV cache precision the engine lacks: the ValueError comes from
    the config files, before any weight is read (at full size loading takes minutes)."""
    import json

    from qwen_engine import engine as engine_mod
    from qwen_engine.checkpoint import save_checkpoint
    from qwen_engine.model import QwenForCausalLM

    cfg = QwenConfig.tiny()
    save_checkpoint(tmp_path, cfg, QwenForCausalLM(cfg).state_dict(), return_weights=False)
    sidecar = tmp_path / "hf_quant_config.json"
    raw = json.loads(sidecar.read_text())
    raw["quantization"]["kv_cache_quant_algo"] = "NVFP4"
    sidecar.write_text(json.dumps(raw))

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the KV cache declaration was checked")

    monkeypatch.setattr(engine_mod, "build_model", no_load)
    with pytest.raises(ValueError, match="kv_cache_quant_algo 'NVFP4'"):
        engine_mod.QwenEngine(engine_mod.QwenEngineConfig(checkpoint=str(tmp_path), kv_cache_dtype="auto",
                                                          device="cpu"))
    with pytest.raises(AssertionError, match="weights were loaded"):  # "model" does not look at the declaration
        engine_mod.QwenEngine(engine_mod.QwenEngineConfig(checkpoint=str(tmp_path), kv_cache_dtype="model",
                                                          device="cpu"))


def test_engine_with_an_fp8_kv_cache(monkeypatch):
    """kv_cache_dtype "fp8": e4m3 pools at half the bytes a block, reported by health(); every request (preempted,
    split over prefill chunks, decoded in batches) completes with the greedy tokens of the contiguous reference whose
    KV cache rounds k / v to e4m3 the same way. (The tiny model's tokens do not tell rounded keys from unrounded ones:
    the logits-level check that the paged paths attend to the stored values is
    tests/test_qwen_engine.py::test_paged_forward_matches_contiguous's fp8 cases.)"""
    from qwen_engine.model.paged import PagedKV as Pool
    from qwen_engine.model.state import KVCache
    from qwen_engine.runner import kv_block_bytes

    from .test_qwen_engine import LENGTHS, collect, engine_config, prompt, reference_greedy, run

    async def body(engine):
        outs = await asyncio.gather(*(collect(engine, prompt(i, n), max_new_tokens=5)
                                      for i, n in enumerate(LENGTHS)))
        return engine, outs

    engine, outs = run(engine_config(kv_cache_dtype="fp8", num_kv_blocks=24, max_model_len=96), body)
    pools = [layer for layer in engine.runner.cache.layers if isinstance(layer, Pool)]
    assert pools and {p.k.dtype for p in pools} == {p.v.dtype for p in pools} == {E4M3}
    cfg = QwenConfig.tiny()
    assert kv_block_bytes(cfg, 4, E4M3) * 4 == kv_block_bytes(cfg, 4, torch.float32)
    assert engine.scheduler.stats.preemptions > 0  # 24 blocks of 4 for 10 prompts of up to 45 tokens
    assert engine.health()["kv_blocks"]["dtype"] == "float8_e4m3fn"

    append = KVCache.append

    def rounded(self, k, v):
        return append(self, kv_pool_cast(k, E4M3).to(k.dtype), kv_pool_cast(v, E4M3).to(v.dtype))

    monkeypatch.setattr(KVCache, "append", rounded)
    for i, (n, (tokens, _)) in enumerate(zip(LENGTHS, outs)):
        assert tokens == reference_greedy(engine, prompt(i, n), 5), f"prompt {i} ({n} tokens)"
