"""benchmarks/decode_ncu.py (the driver Nsight Compute profiles on the GPU) runs its launches end to end at tiny
shapes under the CPU interpreter, so a GPU call does not lose its ncu step to a wrong argument."""

import pytest
import torch

pytest.importorskip("triton")

# --tiny runs on the CPU interpreter, which tests/conftest.py switches on only where there is no CUDA (on a GPU
# machine decode_ncu.py runs at full size under ncu: gpu_next steps 122-127; the H200 run of this file failed here)
cpu_interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="--tiny needs the CPU interpreter")


@cpu_interpreter
def test_tiny_driver_runs(capsys):
    from benchmarks.decode_ncu import main

    assert main(["--tiny", "--repeat", "1"]) == 0
    assert "[decode_ncu] done" in capsys.readouterr().out


@cpu_interpreter
def test_tiny_moe32_runs(capsys):
    """`--moe32`: the swap-AB experts at 32 tokens (routing, fragment-order bytes, both launches) at tiny shapes."""
    from benchmarks.decode_ncu import main

    assert main(["--tiny", "--moe32", "--repeat", "1"]) == 0
    assert "moe32: 32 tokens" in capsys.readouterr().out


def test_summarize_reads_a_raw_export():
    """ncu's raw page: a header row, a units row, one row per kernel; durations in ns become us, and the stall
    reasons are ranked by their share of the samples."""
    from benchmarks.decode_ncu import summarize

    text = "\n".join([
        '"ID","Kernel Name","gpu__time_duration.sum","dram__bytes_read.sum.pct_of_peak_sustained_elapsed",'
        '"smsp__pcsamp_warps_issue_stalled_long_scoreboard","smsp__pcsamp_warps_issue_stalled_barrier",'
        '"smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued"',
        '"","","nsecond","%","","",""',
        '"0","_w4a16_mma_kernel","7,440","23.5","300","100","999"',
    ])
    (line,) = summarize(text)
    assert line.startswith("_w4a16_mma_kernel | us 7.44 | DRAM read % 23.5 |")
    us = text.replace('"nsecond"', '"us"').replace('"7,440"', '"7.44"')  # ncu 2025.3's unit (decode_ncu run 1)
    assert summarize(us)[0].startswith("_w4a16_mma_kernel | us 7.44 |")
    assert line.endswith("stalls: long_scoreboard 75%, barrier 25%")
    assert summarize('"ID"') == ["(no kernels in the ncu export)"]
