"""The loop's curriculum with a scripted policy whose success depends on the task's level: each
round probes every level, trains on the levels whose search success is within [low, high], and
moves on as the (scripted) policy improves; the choice when no level is in the band; bad levels
fail before anything runs."""
from __future__ import annotations

import json

import pytest

import omrl_search as om
from omrl_search.backends.scripted import OraclePolicy
from omrl_search.policy import register_policy
from train import loop_stages
from train.loop import LoopConfig, run_loop
from train.loop_curriculum import CurriculumSettings, choose, probe
from train.loop_select import dev_slice, puzzle_key


class LevelPolicy(OraclePolicy):
    """The solver, wrong with a probability per task level (``x``: never a well-formed step)."""

    def __init__(self, arg: str):
        super().__init__()
        self.per_level = dict(part.split("=") for part in arg.split(","))
        self.name = f"levels:{arg}"

    def choose(self, env, rng, meta):
        p = self.per_level[str(meta["task"].data["level"])]
        if p == "x":
            return "I am not sure what to do.", 1.0
        self.p = float(p)
        return super().choose(env, rng, meta)


register_policy("levels")(LevelPolicy)

START = "levels:1=0,2=0.4,3=x"  # level 1 always solved, 2 sometimes, 3 never
AFTER = "levels:1=0,2=0,3=0.4"  # what the fake SFT stage "trains": level 2 mastered, 3 sometimes


def _search(tasks):
    return om.search_many(tasks, strategy="best_of_n:n=2", policy=START, seed=1)


def test_probe_picks_the_level_between_always_and_never():
    cur = CurriculumSettings(knob="level", levels=[1, 2, 3], probe_limit=12)
    held = dev_slice(om.load_tasks("game24", "train"), 50)
    info, results = probe("game24", cur, held, _search)
    assert info["rates"]["1"] == 1.0 and info["rates"]["3"] == 0.0
    assert 0.1 <= info["rates"]["2"] <= 0.9
    assert info["chosen"] == ["2"] and info["counts"]["2"][1] == 12
    assert all(r.task.data["level"] == 2 for r in results["2"])
    keys = {puzzle_key(t) for t in held}
    assert not any(puzzle_key(r.task) in keys for rs in results.values() for r in rs)


def test_choose_outside_the_band():
    assert choose({"1": 0.5, "2": 0.2, "3": 0.0}, 0.1, 0.9) == (["1", "2"], "search success within [0.1, 0.9]")
    levels, why = choose({"1": 0.05, "2": 0.0, "3": 0.0}, 0.1, 0.9)  # all too hard: the easiest
    assert levels == ["1"] and "below" in why
    levels, why = choose({"1": 1.0, "2": 1.0, "3": 0.95}, 0.1, 0.9)  # all too easy: the hardest
    assert levels == ["3"] and "above" in why
    levels, _ = choose({"1": 1.0, "2": 1.0, "3": 1.0}, 0.1, 0.9)  # a tie above: the harder level
    assert levels == ["3"]
    levels, _ = choose({"1": 0.0, "2": 0.0, "3": 0.0}, 0.1, 0.9)  # a tie below: the easier level
    assert levels == ["1"]


def test_the_loop_trains_where_the_policy_is_neither_always_right_nor_always_wrong(tmp_path, monkeypatch):
    monkeypatch.setattr(loop_stages, "run_trainer", lambda kind, settings: AFTER)
    cfg = LoopConfig(env="game24", policy=START, rounds=2, out=str(tmp_path / "run"), prm=False,
                     train_limit=10, search_strategy="best_of_n:n=2", search_budget="tokens=100000",
                     curriculum={"knob": "level", "levels": [1, 2, 3], "probe_limit": 8},
                     first=["sft"], then=["sft"], dev_limit=20, dev_strategies="react",
                     dev_budget="tokens=100000", test_limit=4, eval_strategies="react",
                     eval_budgets="tokens=100000", progress=False)
    run_loop(cfg)
    root = tmp_path / "run"
    r1 = json.loads((root / "round_1/curriculum/stage.json").read_text())
    r2 = json.loads((root / "round_2/curriculum/stage.json").read_text())
    assert r1["chosen"] == ["2"] and r1["rates"]["1"] == 1.0 and r1["rates"]["3"] == 0.0
    assert r2["chosen"] == ["3"] and r2["rates"]["2"] == 1.0  # the curriculum moved on
    for r, level in ((1, 2), (2, 3)):
        searched = list(om.read_results(root / f"round_{r}/search/results.jsonl"))
        assert len(searched) == 10 and {x.task.data["level"] for x in searched} == {level}
    assert "→ 3" in (root / "report.md").read_text()


@pytest.mark.parametrize("cur,needle", [({"knob": "level", "levels": [7]}, "level"),
                                        ({"knob": "nosuch", "levels": [1]}, "nosuch"),
                                        ({"levels": [1], "low": 0.8, "high": 0.2}, "low")])
def test_bad_curriculum_fails_before_anything_runs(cur, needle, tmp_path, capsys):
    from omrl_search.cli import main

    out = tmp_path / "run"
    args = ["loop", "--env", "game24", "--policy", "scripted:oracle", "--no-prm", "--out", str(out),
            "--set", "curriculum=" + json.dumps(cur)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not out.exists()
