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


@pytest.mark.skipif(not _nvidia_backend(), reason="this triton build has no NVIDIA backend")
def test_new_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    # 83 builds: the forty-first session added the few-row FP8 GEMM's three, the gated norm reading z as [T, heads]
    # slices and the GDN step over a bf16 state pool to the 77 before; the forty-fifth the router's top-k with the
    # routing alignment (kernels/router_align.py); the forty-ninth the GDN step's three state-store hints
    # (gdn_decode.STATE_STORE) and the lazy GDN step's two builds (kernels/gdn_decode_lazy.py): 88
    assert proc.stdout.count("ok   ") == 88
    # kernels/w4a16_mma.py's six builds: every inline-asm operand one element a lane (its mma fragments' premise)
    assert proc.stdout.count("lanes ") == 6
    # every launch of a PDL participant (kernels/pdl.py) also compiled with USE_PDL: griddepcontrol.wait, then
    # launch_dependents, before the kernel's first global memory access (25 kernels, 65 launches: the tensor-core
    # GEMV's gate_up prefetching down's slabs after its wait, the greedy argmax, gdn_prep's SPLIT_V build, the
    # attention combine with the output gate, the few-row FP8 GEMM's three builds, the z-slice norm, the bf16-pool
    # GDN step and the router's top-k with the alignment among them; 65 since the forty-ninth session's five above)
    assert proc.stdout.count("pdl  ") == 65 and "FAIL" not in proc.stdout
    # and the kernels with a weight prefetch (kernels/pdl.py prefetch_l2) compiled with it too: the L2 prefetch before
    # the wait in the FP8 GEMV (3 launches), the router, the dense W4A16 GEMV (3: SwiGLU's four ranges among them) and
    # gdn_prep's two b / a builds (one SPLIT_V); none in the grouped GEMV (its experts come from the router: 3
    # launches, and the build whose prefetch of the next launch's weights follows the wait) nor in gdn_prep without
    # b / a
    assert proc.stdout.count("pf   ") == 9 and proc.stdout.count("pf-  ") == 5
