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
from train.config import TrainError
from train.loop_curriculum import CurriculumSettings, choose, level_tasks, probe
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


def _searched(root, r):
    return [x.task.task_id for x in om.read_results(root / f"round_{r}/search/results.jsonl")]


@pytest.mark.parametrize("train_tasks", ["same", "fresh"])
def test_fresh_train_tasks_search_new_puzzles_each_round(train_tasks, tmp_path, monkeypatch):
    """With ``train_tasks: fresh`` a round probes and searches the tasks after those every
    earlier round took (the probe's and the chosen level's quota); with ``same`` it repeats them."""
    monkeypatch.setattr(loop_stages, "run_trainer", lambda kind, settings: START)  # level 2 stays chosen
    root = tmp_path / "run"
    cfg = LoopConfig(env="game24", policy=START, rounds=2, out=str(root), prm=False, train_limit=10,
                     train_tasks=train_tasks, search_strategy="best_of_n:n=2", search_budget="tokens=100000",
                     curriculum={"knob": "level", "levels": [1, 2, 3], "probe_limit": 8},
                     first=["sft"], then=["sft"], dev_limit=0, test_limit=2, eval_strategies="react",
                     eval_budgets="tokens=100000", progress=False)
    run_loop(cfg)
    cur = CurriculumSettings(knob="level", levels=[1, 2, 3], probe_limit=8)
    level2 = [t.task_id for t in level_tasks("game24", cur, 2, [])]
    first, second = _searched(root, 1), _searched(root, 2)
    r2 = json.loads((root / "round_2/curriculum/stage.json").read_text())
    assert first == level2[:10] and r2["chosen"] == ["2"]
    if train_tasks == "same":
        assert second == first and "starts" not in r2
    else:  # round 1 took 8 probe tasks of levels 1 and 3 and 10 of level 2 (its probe's 8 reused)
        assert r2["starts"] == {"1": 8, "2": 10, "3": 8} and second == level2[10:20]
        probed = [x.task.task_id for x in om.read_results(root / "round_2/curriculum/probe_0.jsonl")]
        level1 = [t.task_id for t in level_tasks("game24", cur, 1, [])]
        assert probed == level1[8:16]


def test_fresh_train_tasks_fail_in_one_line_when_a_level_runs_out():
    cur = CurriculumSettings(knob="level", levels=[1], probe_limit=4)
    n = len(level_tasks("game24", cur, 1, []))
    assert len(level_tasks("game24", cur, 1, [], n - 2, 5)) == 2  # same tasks: what is left
    with pytest.raises(TrainError, match=f"has {n} train tasks, not the {n + 3}"):
        level_tasks("game24", cur, 1, [], n - 2, 5, exact=True)


def test_fresh_train_tasks_without_a_curriculum_take_the_pools_next_slice():
    from types import SimpleNamespace

    sets = SimpleNamespace(pool=list(range(25)))
    cfg = SimpleNamespace(env="game24", train_limit=10, train_tasks="fresh")
    assert loop_stages.pool_window(cfg, sets, 2) == list(range(10, 20))
    with pytest.raises(TrainError, match="round 3 needs 30 game24 train tasks, the pool has 25"):
        loop_stages.pool_window(cfg, sets, 3)
    assert loop_stages.pool_window(SimpleNamespace(**{**vars(cfg), "train_tasks": "same"}), sets, 3) == list(range(10))
