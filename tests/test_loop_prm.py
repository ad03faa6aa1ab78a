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


def test_heldout_scores_the_prm_on_trees_labelled_from_their_own_leaves(tmp_path, monkeypatch):
    """``heldout``: label rows from held-out trees (no extra rollouts), every distinct step scored
    once; a PRM that says (i + 1) / 10 at step i is ranked and calibrated against those labels,
    and "before the end" leaves out the finished rows' last steps."""
    import omrl_search as om
    from reward_models.labels import label_results
    from reward_models.prm import ProcessRewardModel
    from train.loop_prm import heldout

    results = om.search_many(om.load_tasks("countdown", "test", 4), strategy="best_of_n:n=3",
                             policy="scripted:oracle:p=0.5", agent="act", seed=0)
    f = tmp_path / "results.jsonl"
    om.write_results(f, results)
    monkeypatch.setattr(ProcessRewardModel, "from_pretrained", classmethod(lambda cls, *a, **k: FakePRM()))
    out = heldout("unused", [f])
    preds, gold, ends = step_predictions(FakePRM(), label_results(results, rollouts=0))
    assert out["results"] == 4 and out["all"]["steps"] == len(preds) > 0
    assert out["before_end"]["steps"] == ends.count(False) < len(preds)
    assert out["all"]["calibration"] == reliability(preds, gold)
    assert 0.0 <= out["all"]["auc"] <= 1.0
    assert heldout("unused", []) is None


def test_the_report_sets_the_held_out_auc_beside_the_validation_auc():
    from train.loop_report import prm_table

    prm = {"trained": True, "validation": {"steps": 177, "auc": 0.999, "auc_before_end": 1.0},
           "calibration": {"all": {"ece": 0.13}, "before_end": {"ece": 0.12}}}
    held = {"before_end": {"steps": 487, "auc": 0.42, "calibration": {"ece": 0.55}}}
    lines = prm_table([{"round": 0}, {"round": 1, "prm": prm, "eval": {"prm_heldout": held}},
                       {"round": 2, "prm": prm, "eval": {}}])
    rows = [line for line in lines if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert rows[0].endswith("| 487 | 0.420 | 0.550 |") and rows[1].endswith("| - | - | - |")
