"""`sammie.reference.cpu_safe` patches torch's factory functions while Meta's code runs; caches that
remember those functions must not keep the patched ones (a regression seen here: every later
`with torch.device("meta")` silently stopped applying and a full-size Qwen build on "meta" ran the
CI machine out of memory). Checked in a fresh interpreter, where the first use happens inside."""

import subprocess
import sys
from pathlib import Path

PROBE = """
import torch
from sammie.reference import cpu_safe
with cpu_safe("cpu"), torch.device("cpu"):   # first DeviceContext use of the process, while patched
    torch.zeros(2)
with torch.device("meta"):
    lin = torch.nn.Linear(10, 10)
assert lin.weight.is_meta, "torch.device('meta') no longer applies after cpu_safe"
assert torch.zeros is torch._C._VariableFunctions.zeros or torch.zeros.__module__ != "sammie.reference"
print("ok")
"""


def test_meta_device_still_works_after_cpu_safe():
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]
