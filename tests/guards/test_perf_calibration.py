"""The calibration's evaluation: false alarms on A/A data, power on planted slowdowns (synthetic
samples with known effects, so the rates are known)."""

from __future__ import annotations

import random

from guards.perf_calibration import evaluate


def _trial(rng: random.Random, slow: float) -> dict:
    base = [100.0 + rng.gauss(0, 1.0) for _ in range(150)]
    cand = [(100.0 + rng.gauss(0, 1.0)) * (1 + slow) for _ in range(150)]
    return {"baseline_us": base, "candidate_us": cand}


def test_evaluate_counts_false_alarms_and_power():
    rng = random.Random(0)
    data = {"configs": [{"name": "c", "trials": {"aa": [_trial(rng, 0.0) for _ in range(40)],
                                                   "slow3": [_trial(rng, 0.03) for _ in range(20)],
                                                   "slow10": [_trial(rng, 0.10) for _ in range(10)]}}]}
    res = evaluate(data, grid_pct=(1.0, 5.0), grid_alpha=(0.01,), current=(5.0, 0.01))
    by = {(s["max_regression_pct"], s["alpha"]): s for s in res["per_setting"]}
    # 1% noise per call, 150 calls: a 3% shift is always seen at a 1% threshold, never at 5%
    assert by[(1.0, 0.01)]["false_alarm_rate"] == 0.0
    assert by[(1.0, 0.01)]["power"] == {"slow3": 1.0, "slow10": 1.0}
    assert by[(5.0, 0.01)]["power"] == {"slow3": 0.0, "slow10": 1.0}
    assert by[(5.0, 0.01)]["is_task_setting"]
    assert res["chosen"]["max_regression_pct"] == 1.0
    assert res["target"]["at_slowdown"] == "slow3"
    assert by[(1.0, 0.01)]["trials"] == {"aa": 40, "slow3": 20, "slow10": 10}
