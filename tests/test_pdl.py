"""kernels/pdl.py (programmatic dependent launch, opt-in): every participating kernel waits before it touches memory,
and the launch options are empty unless enabled on compiled kernels. Its PTX (griddepcontrol) is compiled for sm_90
in tests/sm90_compile.py; its speed and its CUDA-graph capture need a GPU (benchmarks/qwen_gpu.py --pdl)."""

import ast
import importlib
import inspect
import textwrap

import pytest

from kernels import pdl

triton = pytest.importorskip("triton")

# module -> kernels launched with `**pdl.launch_options()`: the lone decode step's Triton kernels
PARTICIPANTS = {
    "kernels.rms_norm": ("_rms_norm_zc_kernel", "_rms_norm_gated_kernel", "_add_rms_norm_zc_kernel"),
    "kernels.moe_combine": ("_moe_combine_kernel",),
    "kernels.moe_router": ("_router_topk_kernel", "_router_gemv_topk_kernel"),
    "kernels.gdn_decode": ("_gdn_decode_kernel",),
    "kernels.gdn_prep": ("_gdn_prep_kernel",),
    "kernels.fp8_quant": ("_quant_static_kernel",),
    "kernels.fp8_gemv": ("_fp8_gemv_kernel",),
    "kernels.w4a16_gemv": ("_w4a16_gemv_kernel",),
    "kernels.paged_attention": ("_paged_decode_kernel", "_combine_kernel"),
    "kernels.attn_prep": ("_attn_prep_kernel", "_gate_kernel"),
}


def _source(kernel) -> ast.FunctionDef:
    fn = getattr(kernel, "fn", kernel)
    return ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]


@pytest.mark.parametrize("module", sorted(PARTICIPANTS))
def test_participants_wait_first(module):
    """USE_PDL a constexpr defaulting to False, and `pdl_enter(USE_PDL)` the first statement after the docstring (a
    load or store before it could race the predecessor); every launch of the kernel passes the launch options."""
    mod = importlib.import_module(module)
    src = inspect.getsource(mod)
    for name in PARTICIPANTS[module]:
        tree = _source(getattr(mod, name))
        param = inspect.signature(getattr(mod, name).fn).parameters["USE_PDL"]
        assert param.default is False
        body = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        first = ast.unparse(body[0])
        assert first == "pdl_enter(USE_PDL)", (name, first)
        launches = [i for i in range(len(src)) if src.startswith(f"{name}[", i)]
        assert launches, name
        for i in launches:  # the launch call up to its closing parenthesis names the options
            depth, j = 0, src.index("(", src.index("]", i))
            while True:
                depth += {"(": 1, ")": -1}.get(src[j], 0)
                if depth == 0:
                    break
                j += 1
            assert "**pdl.launch_options()" in src[i:j], (name, src[i:j][:200])
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


def test_engine_option_is_off_by_default_and_off_on_cpu():
    from qwen_engine.engine import QwenEngineConfig

    assert QwenEngineConfig(config="tiny").programmatic_launch is False
