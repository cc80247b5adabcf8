from dataclasses import dataclass

import numpy as np

from engine_core.oracle import Threshold, instance_metrics, logit_metrics, mask_iou, run_oracle, sqnr_db


@dataclass
class Inst:
    score: float
    box: tuple
    mask: np.ndarray


def _mask(y0, y1, x0, x1, shape=(20, 30)):
    m = np.zeros(shape, bool)
    m[y0:y1, x0:x1] = True
    return m


def test_mask_iou_values():
    a, b = _mask(0, 10, 0, 10), _mask(0, 10, 5, 15)
    assert mask_iou(a, a) == 1.0
    assert abs(mask_iou(a, b) - 50 / 150) < 1e-12
    assert mask_iou(np.zeros((3, 3), bool), np.zeros((3, 3), bool)) == 1.0


def test_instance_metrics_matches_out_of_order_and_penalises_missing():
    a = Inst(0.9, (0, 0, 10, 10), _mask(0, 10, 0, 10))
    b = Inst(0.7, (20, 0, 30, 10), _mask(0, 10, 20, 30))
    same = instance_metrics([a, b], [b, a])
    assert same["mask_iou"] == 1.0 and same["count_mismatch"] == 0.0 and same["max_score_delta"] == 0.0
    missing = instance_metrics([a], [a, b])
    assert missing["mask_iou"] == 0.5 and missing["count_mismatch"] == 1.0
    shifted = Inst(0.8, (0, 0, 10, 11), _mask(0, 10, 1, 11))
    d = instance_metrics([shifted], [a])
    assert abs(d["max_score_delta"] - 0.1) < 1e-9 and d["max_box_delta_px"] == 1.0 and d["mask_iou"] < 1.0


def test_run_oracle_thresholds_fail_and_pass():
    a = Inst(0.9, (0, 0, 10, 10), _mask(0, 10, 0, 10))
    cases = [0, 1, 2]
    good = run_oracle(cases, lambda c: [a], lambda c: [a], [instance_metrics],
                      [Threshold("mask_iou", "mean", ">=", 0.99), Threshold("count_mismatch", "sum", "<=", 0)])
    assert good.passed and "PASS" in good.table()
    bad = run_oracle(cases, lambda c: [] if c == 1 else [a], lambda c: [a], [instance_metrics],
                     [Threshold("count_mismatch", "sum", "<=", 0)])
    assert not bad.passed and "FAIL" in bad.table() and bad.aggregate("count_mismatch", "sum") == 1.0
    assert bad.to_json()["passed"] is False


def test_logit_metrics():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(8, 50))
    assert sqnr_db(ref, ref) == float("inf")
    noisy = ref + 0.01 * rng.normal(size=ref.shape)
    m = logit_metrics(noisy, ref)
    assert 35 < m["logit_sqnr_db"] < 45 and m["top1_agreement"] == 1.0
