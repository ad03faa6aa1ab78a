"""Success-rate intervals and paired tests (omrl_search.stats) against known values."""
import pytest

from omrl_search.stats import fmt_paired, fmt_rate, mcnemar, outcomes, paired, rate, wilson


def test_wilson_matches_the_closed_form():
    # Wilson (1927): centre (p + z²/2n) / (1 + z²/n), half-width z·sqrt(p(1-p)/n + z²/4n²)/(1 + z²/n)
    z = 1.959963984540054
    for k, n in [(0, 10), (3, 10), (10, 10), (57, 200), (1, 1)]:
        p = k / n
        centre = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
        low, high = wilson(k, n)
        assert low == pytest.approx(max(0.0, centre - half), abs=1e-9)
        assert high == pytest.approx(min(1.0, centre + half), abs=1e-9)


def test_wilson_edges_and_bad_input():
    assert wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(0, 200)
    assert low == 0.0 and 0.0 < high < 0.02
    with pytest.raises(ValueError):
        wilson(5, 3)


def test_rate_row_and_format():
    row = rate(7, 20)
    assert row["success_rate"] == 0.35 and row["ci_low"] < 0.35 < row["ci_high"]
    assert fmt_rate(row).startswith("7/20 = 0.35 [")


def test_mcnemar_exact_binomial_on_discordant_tasks():
    a = {f"t{i}": i < 10 for i in range(200)}          # a solves t0..t9
    b = {f"t{i}": 5 <= i < 30 for i in range(200)}     # b solves t5..t29
    res = mcnemar(a, b)
    assert (res["tasks"], res["b_only"], res["a_only"]) == (200, 20, 5)
    assert res["diff"] == pytest.approx(15 / 200)
    # two-sided exact binomial P(X <= 5 or X >= 20 | n=25, 1/2) = 0.0040...
    assert res["p_value"] == pytest.approx(0.004077, abs=1e-5)


def test_mcnemar_tiny_p_values_are_not_rounded_to_zero():
    a = {f"t{i}": False for i in range(300)}
    b = {f"t{i}": i < 150 for i in range(300)}   # 150 discordant, all one way: p = 2 * 0.5**150
    res = mcnemar(a, b)
    assert res["p_value"] == pytest.approx(2 * 0.5 ** 150, rel=1e-3) and res["p_value"] > 0
    assert fmt_paired({"vs": "react", **res}) == "+0.50 (150 vs 0) p=1.4e-45"


def test_mcnemar_identical_runs_and_disjoint_tasks():
    a = {"x": True, "y": False}
    assert mcnemar(a, dict(a))["p_value"] == 1.0
    with pytest.raises(ValueError, match="share no task"):
        mcnemar({"x": True}, {"y": True})


def test_outcomes_from_result_dicts():
    rows = [{"task": {"task_id": "a"}, "success": True}, {"task": {"task_id": "b"}, "success": False}]
    assert outcomes(rows) == {"a": True, "b": False}
    lines = [{"task_id": "a", "success": 1}, {"task_id": "c", "success": 0}]  # a bench's outcomes.jsonl
    assert outcomes(lines) == {"a": True, "c": False}


def test_paired_block_names_the_baseline():
    a, b = {"x": True, "y": False, "z": False}, {"x": True, "y": True, "z": True}
    block = paired("react", a, b)
    assert block == {"vs": "react", "tasks": 3, "b_only": 2, "a_only": 0, "diff": pytest.approx(0.6667),
                     "p_value": 0.5}
    assert fmt_paired(block) == "+0.67 (2 vs 0) p=0.5"
