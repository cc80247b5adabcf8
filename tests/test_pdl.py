"""kernels/pdl.py (programmatic dependent launch, on by default on Hopper): every participating kernel waits before it
touches memory, and the launch options are empty unless enabled on compiled kernels. Its PTX (griddepcontrol) is
compiled for sm_90 in tests/sm90_compile.py; its speed and its CUDA-graph capture need a GPU (benchmarks/qwen_gpu.py
--no-pdl compares the default without it)."""

import ast
import importlib
import inspect
import textwrap

import pytest

from kernels import pdl

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents  # noqa: E402


@triton.jit
def _late_writer(x, n, value, SPIN: tl.constexpr, BLOCK: tl.constexpr):
    """Lets its dependents launch at once, then ~ms of dependent arithmetic (acc * 0 is kept: NaN semantics), then
    writes x[:n] = value."""
    gdc_launch_dependents()
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    for _ in range(SPIN):
        acc = acc * 0.999 + 1.0
    tl.store(x + offs, (value + acc * 0.0).to(x.dtype.element_ty), mask=offs < n)


# module -> kernels launched with `**pdl.launch_options()`: the decode step's Triton kernels
PARTICIPANTS = {
    "kernels.rms_norm": ("_rms_norm_zc_kernel", "_rms_norm_gated_kernel", "_add_rms_norm_zc_kernel"),
    "kernels.moe_combine": ("_moe_combine_kernel", "_moe_combine_parts_kernel"),
    "kernels.moe_router": ("_router_topk_kernel", "_router_gemv_topk_kernel", "_router_parts_kernel",
                           "_router_parts_topk_kernel"),
    "kernels.gdn_decode": ("_gdn_decode_kernel", "_gdn_decode_norm_kernel"),
    "kernels.gdn_prep": ("_gdn_prep_kernel",),
    "kernels.fp8_quant": ("_quant_static_kernel",),
    "kernels.fp8_gemv": ("_fp8_gemv_kernel",),
    "kernels.fp8_swapped": ("_fp8_swapped_kernel",),  # the FP8 projections at 5-64 rows (8-64 streams)
    "kernels.w4a16_gemv": ("_w4a16_gemv_kernel",),
    "kernels.w4a16_mma": ("_w4a16_mma_kernel",),  # the routed experts of <= 4-token steps
    "kernels.paged_attention": ("_paged_decode_kernel", "_combine_kernel"),
    "kernels.attn_prep": ("_attn_prep_kernel", "_gate_kernel"),
    # above the GEMV's 4 tokens (32 streams, prefill chunks): the routing alignment and the swap-AB experts
    "kernels.moe_align": ("_moe_align_sort_kernel",),
    "kernels.w4a16_swapped": ("_w4a16_grouped_swapped_kernel",),
    # expert_regs ("auto": on for sm_90 + Gluon): the thread-order experts' kernel; `pdl_enter` its Gluon twin
    "kernels.w4a16_regs": ("_w4a16_regs_kernel",),
    # moe_fused_decode (off by default): a one-token step's experts in one launch, and the combine over its rows
    "kernels.moe_decode": ("_moe_decode_kernel",),
    # router_align (off by default): the router's top-k with the routing alignment in its last program
    "kernels.router_align": ("_router_topk_align_kernel",),
    # the greedy argmax (argmax_kernel, off by default): launched plainly unless its module's PDL_LAUNCH asks for the
    # options (it runs right after a graph replay: RESULTS.md, thirty-seventh session)
    "kernels.argmax_rows": ("_argmax_rows_kernel",),
}
# launches whose options a module flag chooses instead of passing them always (the flag named in the launch)
FLAGGED_LAUNCHES = {"_argmax_rows_kernel": "**(pdl.launch_options() if PDL_LAUNCH else {})"}


def test_participant_list_is_every_kernel_with_use_pdl():
    """The list above is every Triton kernel in kernels/ that takes USE_PDL (a new one must be checked here), and no
    module outside kernels/ launches one (the launch-site scan below looks in the defining module)."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    found = {}
    for path in sorted((root / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(a.arg == "USE_PDL" for a in node.args.args):
                found.setdefault(f"kernels.{path.stem}", set()).add(node.name)
    found.pop("kernels.pdl", None)  # `enter` itself
    for names in found.values():
        names.discard("pdl_enter")  # a Gluon kernel module's own `enter` (kernels/w4a16_regs.py)
    assert found == {m: set(names) for m, names in PARTICIPANTS.items()}
    names = [n for ns in PARTICIPANTS.values() for n in ns]
    for path in root.rglob("*.py"):
        rel = path.parts[len(root.parts):]
        if rel[0] in ("kernels", "tests") or any(p.startswith(".") for p in rel):  # (.devbundle, a .snap copy)
            continue
        text = path.read_text(errors="ignore")
        assert not [n for n in names if f"{n}[" in text], path


def _source(kernel) -> ast.FunctionDef:
    fn = getattr(kernel, "fn", kernel)
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


# what a kernel may call before `pdl_enter(USE_PDL)`: index arithmetic and the weight prefetch (`prefetch_l2`, under
# `if PREFETCH`), nothing that reads or writes memory
BEFORE_WAIT = {"tl.program_id", "tl.arange", "tl.cdiv", "tl.minimum", "tl.where", "prefetch_l2", "prefetch_l2_once"}


# the wait statement at a kernel's top level: `pdl_enter(USE_PDL)`, or, in a kernel with an EARLY constexpr
# (kernels/w4a16_regs.py, default False), the same under `if not EARLY:` -- EARLY builds wait after their weights'
# first loads, a contract of their own that test_kernel_w4a16_regs.py checks in their PTX
WAITS = ("pdl_enter(USE_PDL)", "if not EARLY:\n    pdl_enter(USE_PDL)")


def _calls_before_wait(body: list) -> list[str]:
    """The callee names of every call in the statements before `pdl_enter(USE_PDL)` (`x.to(...)`: `.to`)."""
    names = []
    stmts = [ast.unparse(s) for s in body]
    for stmt in body[:next(i for i, s in enumerate(stmts) if s in WAITS)]:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call):
                names.append(".to" if isinstance(node.func, ast.Attribute) and node.func.attr == "to"
                             else ast.unparse(node.func))
    return names


@pytest.mark.parametrize("module", sorted(PARTICIPANTS))
def test_participants_wait_first(module):
    """USE_PDL a constexpr defaulting to False, and `pdl_enter(USE_PDL)` before any statement that touches memory (a
    load or store before it could race the predecessor): only index arithmetic and, in the kernels that take a
    PREFETCH constexpr (default False), L2 prefetches of weights come first. Every launch of the kernel passes the
    launch options."""
    mod = importlib.import_module(module)
    src = inspect.getsource(mod)
    for name in PARTICIPANTS[module]:
        tree = _source(getattr(mod, name))
        params = inspect.signature(getattr(mod, name).fn).parameters
        assert params["USE_PDL"].default is False
        assert "EARLY" not in params or params["EARLY"].default is False, name
        body = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        before = _calls_before_wait(body)
        assert set(before) <= BEFORE_WAIT | {".to"}, (name, before)
        if {"prefetch_l2", "prefetch_l2_once"} & set(before):
            assert inspect.signature(getattr(mod, name).fn).parameters["PREFETCH"].default is False, name
        launches = [i for i in range(len(src)) if src.startswith(f"{name}[", i)]
        assert launches, name
        for i in launches:  # the launch call up to its closing parenthesis names the options
            depth, j = 0, src.index("(", src.index("]", i))
            while True:
                depth += {"(": 1, ")": -1}.get(src[j], 0)
                if depth == 0:
                    break
                j += 1
            assert FLAGGED_LAUNCHES.get(name, "**pdl.launch_options()") in src[i:j], (name, src[i:j][:200])
    autotuned = [n for n in dir(mod) if n.endswith("_autotuned")]
    for name in autotuned:  # the autotuned wrappers of participants launch with the options too
        for i in [i for i in range(len(src)) if src.startswith(f"{name}[", i)]:
            assert "**pdl.launch_options()" in src[i:src.index("\n\n", i)], name


def test_options_empty_unless_enabled_on_compiled_kernels():
    before = pdl.enabled()  # (SAMMIE_PDL=1 runs start enabled)
    try:
        assert not pdl.set_enabled(False) and pdl.launch_options() == {}
        on = pdl.set_enabled(True)
        assert on == pdl.available()  # never under the interpreter
        assert pdl.launch_options() == ({"USE_PDL": True, "launch_pdl": True} if on else {})
        assert not pdl.set_enabled(False) and pdl.launch_options() == {}
    finally:
        pdl.set_enabled(before)


@pytest.mark.parametrize("major, auto, true", [(8, False, False), (9, True, True), (10, False, True),
                                               (12, False, False)])
def test_wanted_by_compute_capability(monkeypatch, major, auto, true):
    """`wanted`: "auto" only on Hopper (AUTO_MAJORS, where it was measured), True on sm_9x and sm_10x, False never,
    and never off CUDA or on ROCm (a faked device: the selection logic, not the GPU)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    cuda = torch.device("cuda", 0)
    assert (pdl.wanted("auto", cuda), pdl.wanted(True, cuda), pdl.wanted(False, cuda)) == (auto, true, False)
    assert not pdl.wanted("auto", torch.device("cpu")) and not pdl.wanted(True, torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not pdl.wanted(True, cuda)


def test_engine_option_auto_by_default_and_off_on_cpu(caplog):
    """"auto" by default (on for Hopper only: AUTO_MAJORS); on the CPU both "auto" (silently) and True (with a
    warning) leave it off, and the process setting with it; other values are refused."""
    import asyncio
    import logging

    from qwen_engine.engine import QwenEngine, QwenEngineConfig

    assert QwenEngineConfig(config="tiny").programmatic_launch == "auto"
    assert pdl.AUTO_MAJORS == (9,) and set(pdl.AUTO_MAJORS) <= set(pdl.SUPPORTED_MAJORS)
    for bad in ("on", 1):
        with pytest.raises(ValueError, match="programmatic_launch"):
            QwenEngineConfig(config="tiny", programmatic_launch=bad)
    before, early_before = pdl.enabled(), pdl._EARLY
    try:
        for option, warns in (("auto", False), (True, True)):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="qwen_engine.engine"):
                engine = QwenEngine(QwenEngineConfig(config="tiny", device="cpu", programmatic_launch=option,
                                                     warmup=False, max_model_len=64, kernel_self_check=False,
                                                     early_loads=True))
            assert engine.health()["programmatic_launch"] is False and not pdl.enabled()
            assert engine.health()["early_loads"] is False and pdl.early_options() == {}  # (only with PDL)
            assert ("programmatic_launch" in caplog.text) is warns, option
            asyncio.run(engine.aclose())
    finally:
        pdl.set_enabled(before)
        pdl.set_early(early_before)  # (the engines asked for it: process-wide)


@pytest.mark.skipif(not pdl.available() or not pdl.device_supports(), reason="needs an sm_90 / sm_100 CUDA GPU")
def test_participant_waits_for_a_late_writer():
    """On the GPU: a producer that lets its dependents launch at once (launch_dependents first), then spins and only
    then writes x; a participant (the zero-centred RMS norm) launched with PDL right after must read the final x. A
    control launch of the same kernel with PDL but without its wait (USE_PDL=False, launch_pdl=True) shows that the
    launches did overlap here, i.e. that the wait is what the correct result rests on."""
    import torch

    from kernels import rms_norm

    d = 2048
    w = torch.randn(d, device="cuda", dtype=torch.bfloat16)
    no_codes = (w, 0, w)  # codes, s_c, s_in: unread without QUANT (the kernel's FP8-codes output, off here)
    variants = (("waits", {"USE_PDL": True, "launch_pdl": True}),
                ("control", {"USE_PDL": False, "launch_pdl": True}))
    for _, options in variants:  # compiled first: a compile between the two launches would separate them
        x = torch.zeros(1, d, device="cuda", dtype=torch.bfloat16)
        _late_writer[(1,)](x, d, 3.0, SPIN=2_000_000, BLOCK=d)
        rms_norm._rms_norm_zc_kernel[(1,)](x, w, torch.empty_like(x), 1, d, x.stride(0), x.stride(0), 1e-6, *no_codes,
                                           BLOCK_R=1, BLOCK_D=d, INTERPRET=False, num_warps=4, **options)
    torch.cuda.synchronize()
    results = {}
    for label, options in variants:
        x = torch.zeros(1, d, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        _late_writer[(1,)](x, d, 3.0, SPIN=2_000_000, BLOCK=d)
        rms_norm._rms_norm_zc_kernel[(1,)](x, w, out, 1, d, x.stride(0), out.stride(0), 1e-6, *no_codes, BLOCK_R=1,
                                           BLOCK_D=d, INTERPRET=False, num_warps=4, **options)
        torch.cuda.synchronize()
        results[label] = out.float()
    want = rms_norm.rms_norm_zc_reference(torch.full((1, d), 3.0, device="cuda", dtype=torch.bfloat16), w, 1e-6)
    assert torch.allclose(results["waits"], want.float(), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(results["control"], want.float(), rtol=1e-2, atol=1e-2), \
        "the control read the final x too: the launches did not overlap, so this test cannot show the wait matters"


@pytest.mark.skipif(not pdl.available() or not pdl.device_supports(), reason="needs an sm_90 / sm_100 CUDA GPU")
@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16"])
def test_early_gdn_step_waits_for_a_late_writer(pool_dtype):
    """On the GPU, early loads (`pdl.set_early`): the GDN rows step with EARLY reads its state slices before its
    wait, its token inputs after it. A producer that lets dependents launch at once, spins, then writes v: the EARLY
    step launched with PDL right after must use the final v -- o and the pool equal those of the plain step run
    after a synchronize, bit for bit -- while its state read did overlap the producer (not shown here: nothing the
    producer writes is read early). A control launch without the wait shows the launches overlapped."""
    import torch

    from kernels import gdn_decode

    bsz, heads, dk, dv = 4, 2, 128, 128
    q, k, _, g, beta, _ = gdn_decode.random_inputs(bsz, heads, dk, dv, seed=5, device="cuda")
    *_, pool0 = gdn_decode.random_inputs(6, heads, dk, dv, seed=6, device="cuda")
    pool0 = pool0.to(getattr(torch, pool_dtype))
    rows = torch.tensor([5, 1, 0, 3], device="cuda")
    n = bsz * heads * dv
    before = (pdl.enabled(), pdl._EARLY)
    try:
        pdl.set_enabled(True)
        results = {}
        for label, early in (("early", True), ("early", True), ("plain", False)):  # the first compiles
            pdl.set_early(early)
            pool = pool0.clone()
            v = torch.zeros(bsz, heads, dv, device="cuda")
            if early:
                _late_writer[(1,)](v, n, 0.75, SPIN=2_000_000, BLOCK=triton.next_power_of_2(n))
            else:  # the plain step on the final v, after the writer has ended
                _late_writer[(1,)](v, n, 0.75, SPIN=1, BLOCK=triton.next_power_of_2(n))
                torch.cuda.synchronize()
            o = gdn_decode.gdn_decode_rows_(q, k, v, g, beta, pool, rows)
            torch.cuda.synchronize()
            results[label] = (o, pool)
        assert torch.equal(results["early"][0], results["plain"][0])
        assert torch.equal(results["early"][1], results["plain"][1])
        # control: the same EARLY launch without its wait (USE_PDL off, launch_pdl on) reads v before the writer
        # stores it, so it differs -- the launches did overlap, and the wait is what the result above rests on
        pool, v = pool0.clone(), torch.zeros(bsz, heads, dv, device="cuda")
        o = torch.empty(bsz, heads, dv, device="cuda")
        _late_writer[(1,)](v, n, 0.75, SPIN=2_000_000, BLOCK=triton.next_power_of_2(n))
        gdn_decode._gdn_decode_kernel[(bsz * heads, dv // 64)](
            q, k, v, g, beta, pool, pool, o, rows, heads, dk, dv, *gdn_decode._step_strides(q, k, v, g, beta, pool, o),
            BLOCK_K=dk, BLOCK_V=64, HAS_ROWS=True, USE_PDL=False, EARLY=True, launch_pdl=True)
        torch.cuda.synchronize()
        assert not torch.equal(o, results["plain"][0]), "the control read the final v: the launches did not overlap"
    finally:
        pdl.set_enabled(before[0])
        pdl.set_early(before[1])


def test_early_options_only_with_pdl():
    """`pdl.early_options`: {EARLY: True} only while early loads are asked for AND PDL is on (never under the
    interpreter, where PDL cannot be enabled); `set_early` returns what was asked."""
    before = (pdl.enabled(), pdl._EARLY)
    try:
        pdl.set_enabled(False)
        assert pdl.set_early(True) is True and not pdl.early() and pdl.early_options() == {}
        on = pdl.set_enabled(True)
        assert pdl.early() == on and pdl.early_options() == ({"EARLY": True} if on else {})
        assert pdl.set_early(False) is False and pdl.early_options() == {}
    finally:
        pdl.set_enabled(before[0])
        pdl.set_early(before[1])


def test_engine_early_loads_option():
    """`QwenEngineConfig.early_loads` and `router_parts`: on by default (in force only with PDL / on CUDA), bools (a
    clear error otherwise)."""
    from qwen_engine.engine import QwenEngineConfig

    assert QwenEngineConfig().early_loads is True and QwenEngineConfig().router_parts is True
    assert QwenEngineConfig(early_loads=False).early_loads is False
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="router_parts"):
            QwenEngineConfig(router_parts=bad)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="early_loads"):
            QwenEngineConfig(early_loads=bad)
