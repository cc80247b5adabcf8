"""benchmarks/qwen_profile.py's critical path by end-time deltas and its Chrome-trace parser, on synthetic kernels
(CPU only: no profiler run)."""

import gzip
import json
import random

import pytest

from benchmarks.qwen_profile import (KernelRecord, critical_path_table, kernel_records_from_trace,
                                     profile_critical_path)

MAIN, SIDE = 7, 13

# two steps on the main stream (times in us): B starts inside A (PDL's early start), a 10 us gap between the steps,
# the second B ends before A does (adds nothing); the side stream (the shared expert) overlaps the chain
RECORDS = [
    KernelRecord("A", MAIN, 0, 10),    # delta 10 (the first: its duration)
    KernelRecord("B", MAIN, 5, 18),    # delta 8, no idle
    KernelRecord("C", MAIN, 18, 20),   # delta 2
    KernelRecord("A", MAIN, 30, 40),   # delta 20 = idle 10 + 10 in the kernel
    KernelRecord("B", MAIN, 35, 38),   # delta 0: ends before A's end
    KernelRecord("C", MAIN, 39, 45),   # delta 5
    KernelRecord("S", SIDE, 6, 16),
    KernelRecord("S", SIDE, 32, 36),
]


def approx(x):
    return pytest.approx(x, rel=1e-12, abs=1e-15)


def test_deltas_idle_and_per_step_totals():
    t = critical_path_table(RECORDS, steps=2)
    assert t["main_stream"] == MAIN
    assert t["kernels_per_step"] == 3.0
    assert t["delta_ms_per_step"] == approx(45 / 2 / 1e3)  # the span: last end - first start
    assert t["idle_ms_per_step"] == approx(10 / 2 / 1e3)
    assert t["in_kernel_ms_per_step"] == approx(35 / 2 / 1e3)  # [0, 20] and [30, 45]
    assert t["idle_share"] == approx(10 / 45)
    assert t["streams"] == {
        str(MAIN): dict(kernels_per_step=3.0, kernel_ms_per_step=approx(44 / 2 / 1e3),
                        busy_ms_per_step=approx(35 / 2 / 1e3)),
        str(SIDE): dict(kernels_per_step=1.0, kernel_ms_per_step=approx(14 / 2 / 1e3),
                        busy_ms_per_step=approx(14 / 2 / 1e3)),
    }
    assert t["top_gaps"] == [dict(gap_us=10.0, after="C", before="A")]


def test_per_name_rows_sorted_by_delta():
    t = critical_path_table(RECORDS, steps=2)
    assert [r["name"] for r in t["top"]] == ["A", "B", "C"]
    a, b, c = t["top"]
    assert a == dict(name="A", calls_per_step=1.0, delta_ms_per_step=approx(30 / 2 / 1e3),
                     idle_ms_per_step=approx(10 / 2 / 1e3), delta_us_per_call=15.0, dur_us_per_call=10.0)
    assert b == dict(name="B", calls_per_step=1.0, delta_ms_per_step=approx(8 / 2 / 1e3), idle_ms_per_step=0.0,
                     delta_us_per_call=4.0, dur_us_per_call=8.0)
    assert c == dict(name="C", calls_per_step=1.0, delta_ms_per_step=approx(7 / 2 / 1e3), idle_ms_per_step=0.0,
                     delta_us_per_call=3.5, dur_us_per_call=4.0)
    # the deltas of the rows add up to the total
    assert sum(r["delta_ms_per_step"] for r in t["top"]) == approx(t["delta_ms_per_step"])


def test_side_stream_reported_by_duration_not_in_deltas():
    t = critical_path_table(RECORDS, steps=2)
    assert "S" not in [r["name"] for r in t["top"]]
    assert t["side"] == dict(kernels_per_step=1.0, kernel_ms_per_step=approx(14 / 2 / 1e3),
                             top=[dict(name="S", calls_per_step=1.0, dur_ms_per_step=approx(14 / 2 / 1e3),
                                       dur_us_per_call=7.0)])


def test_order_of_records_does_not_matter_and_top_truncates():
    shuffled = RECORDS[:]
    random.Random(0).shuffle(shuffled)
    assert critical_path_table(shuffled, steps=2) == critical_path_table(RECORDS, steps=2)
    assert [r["name"] for r in critical_path_table(RECORDS, steps=2, top=2)["top"]] == ["A", "B"]


def test_main_stream_is_the_busiest_and_names_are_shortened():
    long = "k" * 120
    recs = [KernelRecord(long, 3, 0, 1), KernelRecord(long, 3, 1, 2), KernelRecord("x", 1, 0, 5)]
    t = critical_path_table(recs, steps=1)
    assert t["main_stream"] == 3
    assert t["top"] == [dict(name="k" * 90, calls_per_step=2.0, delta_ms_per_step=approx(2e-3), idle_ms_per_step=0.0,
                             delta_us_per_call=1.0, dur_us_per_call=1.0)]
    assert t["side"]["top"][0]["name"] == "x"


def test_empty_trace_gives_an_empty_table():
    t = critical_path_table([], steps=17)
    assert t["main_stream"] is None and t["streams"] == {} and t["top"] == [] and t["top_gaps"] == []
    assert t["delta_ms_per_step"] == 0.0 and t["idle_ms_per_step"] == 0.0 and t["idle_share"] is None
    assert t["side"] == dict(kernels_per_step=0.0, kernel_ms_per_step=0.0, top=[])


TRACE = {
    "schemaVersion": 1,
    "traceEvents": [
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 100.0, "dur": 50.0},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": 101.0, "dur": 4.0},
        {"ph": "X", "cat": "kernel", "name": "gemv_kernel", "pid": 0, "tid": 7, "ts": 110.5, "dur": 3.25,
         "args": {"stream": 7, "device": 0, "correlation": 1}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "pid": 0, "tid": 7, "ts": 115.0, "dur": 2.0,
         "args": {"stream": 7}},
        {"ph": "X", "cat": "Kernel", "name": "shared_expert", "pid": 0, "tid": 13, "ts": 111.0, "dur": 1.0},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 110.5},
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPU 0"}},
    ],
}


def test_parser_keeps_only_kernels(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(TRACE))
    assert kernel_records_from_trace(path) == [KernelRecord("gemv_kernel", 7, 110.5, 113.75),
                                               KernelRecord("shared_expert", 13, 111.0, 112.0)]  # stream from tid


def test_parser_reads_gzip_and_bare_lists(tmp_path):
    gz = tmp_path / "trace.json.gz"
    with gzip.open(gz, "wt") as f:
        json.dump(TRACE, f)
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(TRACE["traceEvents"]))
    want = [KernelRecord("gemv_kernel", 7, 110.5, 113.75), KernelRecord("shared_expert", 13, 111.0, 112.0)]
    assert kernel_records_from_trace(gz) == want
    assert kernel_records_from_trace(bare) == want


class FakeProfile:
    """export_chrome_trace as torch.profiler.profile's: writes the trace JSON to the given path."""
    def __init__(self, trace):
        self.trace = trace

    def export_chrome_trace(self, path):
        with open(path, "w") as f:
            json.dump(self.trace, f)


def test_profile_critical_path_parses_and_keeps_gzipped(tmp_path):
    keep = tmp_path / "engine_decode_trace_1.json.gz"
    t = profile_critical_path(FakeProfile(TRACE), steps=1, keep=keep)
    assert t["main_stream"] == 7  # one kernel each: the more kernel time
    assert t["top"][0]["name"] == "gemv_kernel" and t["delta_ms_per_step"] == approx(3.25e-3)
    with gzip.open(keep, "rt") as f:
        assert json.load(f) == TRACE
    empty = profile_critical_path(FakeProfile({"traceEvents": []}), steps=3)
    assert empty["top"] == [] and empty["main_stream"] is None


def test_graph_replays_spread_over_streams_are_merged():
    """No stream holds half the kernels (a CUDA graph's nodes on the driver's streams): one chain of all of them,
    stream "merged", no side table; deltas then sum to the span from the first start to the last end."""
    recs = [KernelRecord("A", 1, 0, 10), KernelRecord("B", 2, 8, 15), KernelRecord("C", 3, 20, 26),
            KernelRecord("D", 4, 22, 25)]
    t = critical_path_table(recs, steps=1)
    assert t["main_stream"] == "merged" and t["kernels_per_step"] == 4
    assert t["delta_ms_per_step"] * 1e3 == pytest.approx(26.0)  # 10 + 5 + (5 idle + 6) + 0
    assert t["idle_ms_per_step"] * 1e3 == pytest.approx(5.0)
    by = {r["name"]: r["delta_us_per_call"] for r in t["top"]}
    assert by == pytest.approx({"A": 10.0, "B": 5.0, "C": 11.0, "D": 0.0})
    assert t["side"]["kernels_per_step"] == 0
