"""The Qwen engine's newest Triton kernels compile for the H200 (sm_90) on this CPU-only machine: the CPU tests run
them in Triton's interpreter, which accepts code the GPU compiler rejects. A subprocess without TRITON_INTERPRET
(tests/conftest.py sets it for this process) runs tests/sm90_compile.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


# The GPU machine's image has another Triton than this project's torch pins (triton 3.6 beside torch 2.11 there; 3.8
# here), and the two front ends differ: a nested @triton.jit call's string-constexpr default compiled on 3.8 and
# failed on 3.6 ("'str' object has no attribute 'type'"; the fused GDN step + norm, caught by the H200's start-up
# self-check in the fifty-first session). SAMMIE_DEVICE_TRITON names a directory holding that Triton (`pip install
# --no-deps --target DIR triton==3.6.0`; .ci/run makes one), put first on the script's path.
DEVICE_TRITON = os.environ.get("SAMMIE_DEVICE_TRITON")


def _compile_all(triton_dir: str | None = None) -> str:
    """tests/sm90_compile.py's stdout, asserted to exit 0; with `triton_dir`, that directory's Triton imported."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if triton_dir:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (triton_dir, env.get("PYTHONPATH")) if p)
    script = Path(__file__).with_name("sm90_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(not _nvidia_backend(), reason="this triton build has no NVIDIA backend")
def test_new_kernels_compile_for_sm90():
    _check_builds(_compile_all())


@pytest.mark.skipif(not DEVICE_TRITON, reason="SAMMIE_DEVICE_TRITON unset (the GPU image's Triton; .ci/run sets it)")
def test_new_kernels_compile_for_sm90_with_the_gpu_images_triton():
    out = _compile_all(DEVICE_TRITON)
    assert f"triton {os.environ.get('SAMMIE_DEVICE_TRITON_VERSION', '3.6.0')}" in out  # that Triton, not this one
    _check_builds(out)


def _check_builds(stdout: str) -> None:
    """The build counts of one sm90_compile.py run."""
    # 83 builds: the forty-first session added the few-row FP8 GEMM's three, the gated norm reading z as [T, heads]
    # slices and the GDN step over a bf16 state pool to the 77 before; the forty-fifth the router's top-k with the
    # routing alignment (kernels/router_align.py); the forty-ninth's five (the GDN step's three state-store hints and
    # the lazy GDN step's two builds) were removed in the fifty-first, neither gaining on the H200: 83
    # 85: the fifty-second session's router GEMM at 5-64 rows and its top-k over the partials (router_linear_topk);
    # 86: the fifty-third's top-k + alignment over those partials (router_linear_topk_align)
    # 88: the fifty-eighth's e4m3 KV pools (the paged decode attention reading them, the attention prep writing them)
    # 91: the sixty-sixth's router top-k + alignment in both last-program forms (GATHER and reload, 1 and 4 warps)
    # and its 64-token launch over the partials (1,024 pairs: the reload form)
    assert stdout.count("ok   ") == 91
    # kernels/w4a16_mma.py's six builds: every inline-asm operand one element a lane (its mma fragments' premise)
    assert stdout.count("lanes ") == 6
    # every launch of a PDL participant (kernels/pdl.py) also compiled with USE_PDL: griddepcontrol.wait, then
    # launch_dependents, before the kernel's first global memory access (24 kernels, 60 launches: the tensor-core
    # GEMV's gate_up prefetching down's slabs after its wait, the greedy argmax, gdn_prep's SPLIT_V build, the
    # attention combine with the output gate, the few-row FP8 GEMM's three builds, the z-slice norm, the bf16-pool
    # GDN step and the router's top-k with the alignment among them; 65 with the forty-ninth session's five, which
    # the fifty-first removed)
    # (62 with the fifty-second session's two router launches; 63 with the fifty-third's top-k + alignment over the
    # partials)
    # (65 with the fifty-eighth's two e4m3 KV pool builds; 68 with the sixty-sixth's three router builds)
    assert stdout.count("pdl  ") == 68 and "FAIL" not in stdout
    # and the kernels with a weight prefetch (kernels/pdl.py prefetch_l2) compiled with it too: the L2 prefetch before
    # the wait in the FP8 GEMV (3 launches), the router, the dense W4A16 GEMV (3: SwiGLU's four ranges among them) and
    # gdn_prep's two b / a builds (one SPLIT_V); none in the grouped GEMV (its experts come from the router: 3
    # launches, and the build whose prefetch of the next launch's weights follows the wait) nor in gdn_prep without
    # b / a
    assert stdout.count("pf   ") == 9 and stdout.count("pf-  ") == 5
    # and the kernels with early loads (kernels/pdl.py set_early: EARLY) compiled with them: global loads before the
    # wait, no store, atomic or async copy there -- the GDN step over fp32 and bf16 pools, gdn_prep's three builds and
    # the same with its weight prefetch too (weight_prefetch with early loads), the router's GEMM at 5-64 rows (its
    # weight tile); the experts' EARLY down is Gluon: tests/test_kernel_w4a16_regs.py checks its PTX
    assert stdout.count("early ") == 9
