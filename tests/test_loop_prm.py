"""The loop's PRM calibration: the reliability table and ECE, and which steps count as "before the
end" (a finished row's last step shows its outcome)."""
from __future__ import annotations

import pytest

from train.loop_prm import reliability, step_predictions


def test_reliability_bins_and_ece():
    preds = [0.05, 0.15, 0.95, 1.0, 0.55]
    labels = [0.0, 0.5, 1.0, 1.0, 0.0]
    out = reliability(preds, labels, bins=10)
    assert out["steps"] == 5
    assert [(b["lo"], b["steps"]) for b in out["bins"]] == [(0.0, 1), (0.1, 1), (0.5, 1), (0.9, 2)]
    # |0.05-0| + |0.15-0.5| + |0.55-0| + 2 * |0.975-1|, over 5 steps
    assert out["ece"] == pytest.approx((0.05 + 0.35 + 0.55 + 2 * 0.025) / 5, abs=1e-4)
    assert reliability([0.3, 0.7], [0.3, 0.7])["ece"] == 0.0
    with pytest.raises(ValueError):
        reliability([0.1], [])


class FakePRM:
    """Scores step i of every episode as (i + 1) / 10."""

    def score_episodes(self, episodes):
        return [[(i + 1) / 10 for i in range(len(ep.completions))] for ep in episodes]


def _row(task, completions, soft, terminal):
    return {"task_id": task, "prompt": "solve", "completions": completions,
            "observations": ["obs"] * len(completions), "segments": None, "soft_labels": soft,
            "terminal": terminal}


def test_step_predictions_count_shared_steps_once_and_mark_the_end():
    rows = [_row("t", ["a", "b"], [0.5, 1.0], True), _row("t", ["a", "c"], [0.5, 0.0], False)]
    preds, gold, ends = step_predictions(FakePRM(), rows)
    assert preds == [0.1, 0.2, 0.2] and gold == [0.5, 1.0, 0.0]
    assert ends == [False, True, False]  # only the finished row's last step
