"""Accuracy oracle: run a candidate and a reference over the same cases, score every case with
metrics, print one table, and fail past thresholds.

Engine-agnostic: a case is any object; candidate and reference are callables returning any
output; a metric maps (candidate_output, reference_output) to named floats. Sammie plugs in
instance-segmentation metrics (mask IoU, instance-count mismatch, score and box deltas, the
columns segment-anything-fast and torchao report); the Qwen engine plugs in logit SQNR and top-1
agreement. Thresholds apply to the aggregate of a metric over all cases.

    report = run_oracle(cases, candidate, reference, [instance_metrics], thresholds)
    print(report.table()); sys.exit(0 if report.passed else 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

Metric = Callable[[Any, Any], dict[str, float]]


@dataclass(frozen=True)
class Threshold:
    """`aggregate(metric) op value` must hold, e.g. Threshold("mask_iou", "mean", ">=", 0.99)."""

    metric: str
    aggregate: str  # "mean" | "min" | "max" | "sum"
    op: str  # ">=" | "<="
    value: float

    def check(self, observed: float) -> bool:
        if math.isnan(observed):
            return False
        return observed >= self.value if self.op == ">=" else observed <= self.value

    def __str__(self) -> str:
        return f"{self.aggregate}({self.metric}) {self.op} {self.value:g}"


_AGGREGATES: dict[str, Callable[[np.ndarray], float]] = {
    "mean": lambda a: float(np.mean(a)), "min": lambda a: float(np.min(a)),
    "max": lambda a: float(np.max(a)), "sum": lambda a: float(np.sum(a)),
}


@dataclass
class OracleReport:
    case_names: list[str]
    rows: list[dict[str, float]]  # one per case
    thresholds: list[Threshold]
    failures: list[str] = field(default_factory=list)

    def aggregate(self, metric: str, how: str = "mean") -> float:
        values = np.array([r[metric] for r in self.rows if metric in r], dtype=np.float64)
        return _AGGREGATES[how](values) if values.size else float("nan")

    @property
    def passed(self) -> bool:
        return not self.failures

    def metrics(self) -> list[str]:
        names: list[str] = []
        for row in self.rows:
            names.extend(k for k in row if k not in names)
        return names

    def table(self, per_case: bool = True) -> str:
        """Markdown: one row per case, then mean/min/max rows, then the threshold verdicts."""
        cols = self.metrics()
        lines = ["| case | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
        if per_case:
            for name, row in zip(self.case_names, self.rows):
                lines.append(f"| {name} | " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
        for how in ("mean", "min", "max"):
            lines.append(f"| **{how}** | " + " | ".join(_fmt(self.aggregate(c, how)) for c in cols) + " |")
        for t in self.thresholds:
            observed = self.aggregate(t.metric, t.aggregate)
            lines.append(f"\n{'PASS' if t.check(observed) else 'FAIL'}: {t} (observed {_fmt(observed)})")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return {
            "cases": [{"case": n, **r} for n, r in zip(self.case_names, self.rows)],
            "aggregate": {c: {h: self.aggregate(c, h) for h in ("mean", "min", "max")} for c in self.metrics()},
            "thresholds": [{"rule": str(t), "observed": self.aggregate(t.metric, t.aggregate),
                            "passed": t.check(self.aggregate(t.metric, t.aggregate))} for t in self.thresholds],
            "passed": self.passed,
        }


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def run_oracle(
    cases: Iterable[Any],
    candidate: Callable[[Any], Any],
    reference: Callable[[Any], Any],
    metrics: Sequence[Metric],
    thresholds: Sequence[Threshold] = (),
    name_of: Callable[[Any], str] = str,
) -> OracleReport:
    names, rows = [], []
    for case in cases:
        ours, ref = candidate(case), reference(case)
        row: dict[str, float] = {}
        for metric in metrics:
            row.update(metric(ours, ref))
        names.append(name_of(case))
        rows.append(row)
    report = OracleReport(names, rows, list(thresholds))
    for t in thresholds:
        observed = report.aggregate(t.metric, t.aggregate)
        if not t.check(observed):
            report.failures.append(f"{t}: observed {_fmt(observed)}")
    return report


# --- instance segmentation metrics --------------------------------------------------------
# An output is a sequence of instances, each with `.score` (float), `.box` (4 floats, xyxy
# pixels) and `.mask` (bool HxW numpy array), as `sammie.segmenter.Instance` provides.


def mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    union = np.logical_or(a, b).sum()
    return 1.0 if union == 0 else float(np.logical_and(a, b).sum() / union)


def match_instances(ours: Sequence, ref: Sequence) -> list[tuple[int, int, float]]:
    """Greedy one-to-one matching by mask IoU, best pairs first: [(i_ours, j_ref, iou)]."""
    pairs = sorted(
        ((mask_iou(o.mask, r.mask), i, j) for i, o in enumerate(ours) for j, r in enumerate(ref)),
        reverse=True,
    )
    used_i, used_j, out = set(), set(), []
    for iou, i, j in pairs:
        if i not in used_i and j not in used_j and iou > 0:
            used_i.add(i)
            used_j.add(j)
            out.append((i, j, iou))
    return out


def instance_metrics(ours: Sequence, ref: Sequence) -> dict[str, float]:
    """Per (image, prompt) pair: mean mask IoU over the union of instances (an unmatched
    instance on either side counts as IoU 0; 1.0 when both are empty), count mismatch (0/1),
    instance counts, and the largest score and box-corner deltas over matched instances."""
    matches = match_instances(ours, ref)
    n = max(len(ours), len(ref))
    iou = 1.0 if n == 0 else sum(m[2] for m in matches) / n
    score_delta = max((abs(ours[i].score - ref[j].score) for i, j, _ in matches), default=0.0)
    box_delta = max(
        (float(np.max(np.abs(np.asarray(ours[i].box) - np.asarray(ref[j].box)))) for i, j, _ in matches),
        default=0.0,
    )
    return {
        "mask_iou": iou, "count_mismatch": float(len(ours) != len(ref)),
        "n_ours": float(len(ours)), "n_ref": float(len(ref)),
        "max_score_delta": float(score_delta), "max_box_delta_px": box_delta,
    }


# --- language-model metrics (used by qwen_engine) ---------------------------------------


def sqnr_db(candidate: np.ndarray, reference: np.ndarray) -> float:
    """Signal-to-quantisation-noise ratio in dB: 10 log10(|ref|^2 / |ref - cand|^2)."""
    reference = np.asarray(reference, dtype=np.float64)
    noise = np.sum((reference - np.asarray(candidate, dtype=np.float64)) ** 2)
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(reference**2) / noise))


def logit_metrics(candidate: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Logits [T, V]: SQNR and the share of positions whose argmax agrees."""
    candidate, reference = np.asarray(candidate), np.asarray(reference)
    return {
        "logit_sqnr_db": sqnr_db(candidate, reference),
        "top1_agreement": float(np.mean(candidate.argmax(-1) == reference.argmax(-1))),
    }
