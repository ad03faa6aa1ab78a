"""Keep-best in ``omrl loop``, with scripted policies standing in for trained checkpoints: a stage
whose policy is significantly worse on the dev slice is rejected (training goes on from the kept
one), a stage that is not worse is kept, a better one becomes the best; each decision and its
reason is recorded in the stage, the round's summary and the report. Also: the dev slice is
disjoint by puzzle from every task the run searched, and the statistics of the decision."""
from __future__ import annotations

import dataclasses
import json

import pytest

import omrl_search as om
from train import loop_stages
from train.loop import LoopConfig, run_loop
from train.loop_select import check_disjoint, decide, dev_slice, puzzle_key, without

#: what each fake training stage "produces": a scripted policy of known quality
PRODUCES = {"sft": "scripted:oracle:p=0.05", "rs_sft": "scripted:oracle:p=1.0",
            "dpo": "scripted:oracle:p=0.05"}


@pytest.fixture
def fake_trainers(monkeypatch):
    calls = []

    def run_trainer(kind, settings):
        calls.append((kind, settings["model"]))
        return PRODUCES[kind]

    monkeypatch.setattr(loop_stages, "run_trainer", run_trainer)
    return calls


def _cfg(tmp_path, **kw) -> LoopConfig:
    base = dict(env="game24", policy="scripted:oracle:p=0.4", rounds=2, out=str(tmp_path / "run"),
                prm=False, train_limit=6, search_strategy="best_of_n:n=3", search_budget="tokens=100000",
                first=["sft"], then=["rs_sft", "dpo"], dev_limit=40, dev_strategies="react",
                dev_budget="tokens=100000", test_limit=8, eval_strategies="react",
                eval_budgets="tokens=100000", progress=False)
    return LoopConfig(**{**base, **kw})


def test_worse_stage_rejected_not_worse_kept_and_recorded(tmp_path, fake_trainers):
    cfg = _cfg(tmp_path)
    run_loop(cfg)
    root = tmp_path / "run"
    sft = json.loads((root / "round_1/dev_sft/stage.json").read_text())["decision"]
    rs = json.loads((root / "round_2/dev_rs_sft/stage.json").read_text())["decision"]
    dpo = json.loads((root / "round_2/dev_dpo/stage.json").read_text())["decision"]
    assert sft["keep"] and sft["new_best"] and "new best" in sft["reason"]
    assert not rs["keep"] and not rs["new_best"] and "significantly worse" in rs["reason"]
    assert rs["tests"]["react"]["p_value"] < 0.05 and rs["tests"]["react"]["diff"] < 0
    # equal to the best on every dev task: kept, but not better (training goes on from the best)
    assert dpo["keep"] and not dpo["new_best"] and dpo["tests"]["react"]["p_value"] == 1.0
    # the rejected stage's checkpoint is not trained from: dpo starts from sft's policy
    assert fake_trainers == [("sft", cfg.policy), ("rs_sft", PRODUCES["sft"]), ("dpo", PRODUCES["sft"])]
    summary = json.loads((root / "round_2/loop_summary.json").read_text())
    assert [(s["trainer"], s["decision"]["keep"]) for s in summary["stages"]] == [("rs_sft", False), ("dpo", True)]
    assert summary["best"]["where"] == "round 1, sft"
    assert json.loads((root / "best.json").read_text())["model"] == PRODUCES["sft"]
    report = (root / "report.md").read_text()
    assert "**rejected**" in report and "**new best**" in report and "Best checkpoint: `scripted:oracle:p=0.05`" in report
    assert "Wilson" in report and "round 2 vs 1" in report


def test_a_worse_first_stage_leaves_the_base_as_best(tmp_path, fake_trainers, monkeypatch):
    monkeypatch.setitem(PRODUCES, "sft", "scripted:oracle:p=1.0")
    cfg = _cfg(tmp_path, rounds=1, policy="scripted:oracle:p=0.1")
    run_loop(cfg)
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["model"] == cfg.policy and best["where"] == "round 0, base" and best["current"] == cfg.policy
    test = json.loads((tmp_path / "run/round_1/eval/stage.json").read_text())
    assert test["policy"] == cfg.policy  # the round's held-out eval is of the kept policy
    # the best was evaluated in round 0 already: results.json's best is that row, no eval of its own
    results = json.loads((tmp_path / "run/results.json").read_text())
    assert not (tmp_path / "run/eval_best").exists()
    assert results["best"]["heldout"] == results["rounds"][0]["heldout"]
    assert results["best"]["vs_base"] == {"b_only": 0, "a_only": 0, "p_value": 1.0}


def _outcomes(folder) -> dict[str, bool]:
    rows = [json.loads(line) for line in (folder / "outcomes.jsonl").read_text().splitlines()]
    return {r["task_id"]: bool(r["success"]) for r in rows}


def test_a_best_no_round_evaluated_gets_its_own_test_eval_and_record(tmp_path, fake_trainers, monkeypatch):
    import jsonschema

    from train.loop_report import RESULTS_SCHEMA

    # round 1 trains sft (the best: never deviates) then rs_sft (kept, not better); training
    # continues from the last kept stage, so the round's eval is of rs_sft's policy and the
    # checkpoint handed back has no test figure from the rounds
    monkeypatch.setitem(PRODUCES, "sft", "scripted:oracle:p=0.0")
    monkeypatch.setitem(PRODUCES, "rs_sft", "scripted:oracle:p=0.02")
    cfg = _cfg(tmp_path, rounds=1, first=["sft", "rs_sft"], policy="scripted:oracle:p=0.6",
               best_search="best_of_n:n=2", best_budget="tokens=100000", continue_from="kept")
    run_loop(cfg)
    root = tmp_path / "run"
    best = json.loads((root / "best.json").read_text())
    assert (best["model"], best["current"]) == (PRODUCES["sft"], PRODUCES["rs_sft"])
    own = json.loads((root / "eval_best/stage.json").read_text())
    assert own["policy"] == PRODUCES["sft"]
    results = json.loads((root / "results.json").read_text())
    jsonschema.validate(results, RESULTS_SCHEMA)
    record = results["best"]
    assert (record["model"], record["where"]) == (PRODUCES["sft"], "round 1, sft")
    assert record["heldout"]["successes"] == own["rows"]["react"]["tokens=100000"]["successes"]
    base, mine = _outcomes(root / "round_0/eval"), _outcomes(root / "eval_best")
    # McNemar's b_only: solved by the later run alone (the best; then the search)
    assert record["vs_base"]["b_only"] == sum(mine[t] and not base[t] for t in base) > 0
    assert record["vs_base"]["a_only"] == sum(base[t] and not mine[t] for t in base)
    searched = _outcomes(root / "search_on_best")
    vs = results["search_on_best"]["vs_best_greedy"]
    assert (vs["b_only"], vs["a_only"]) == (sum(searched[t] and not mine[t] for t in mine),
                                            sum(mine[t] and not searched[t] for t in mine))
    # the stage is a stage: run again, nothing is redone
    before = {p: p.stat().st_mtime_ns for p in root.glob("**/stage.json")}
    run_loop(cfg)
    assert {p: p.stat().st_mtime_ns for p in root.glob("**/stage.json")} == before


def test_training_continues_from_the_best_not_from_a_kept_stage_that_is_no_better(tmp_path, fake_trainers,
                                                                                 monkeypatch):
    # round 1: sft is the best (never deviates); rs_sft is kept (not significantly worse) but
    # worse. Round 2's stage trains from sft, the rounds' evals are sft's, and the best
    # needs no eval of its own
    monkeypatch.setitem(PRODUCES, "sft", "scripted:oracle:p=0.0")
    monkeypatch.setitem(PRODUCES, "rs_sft", "scripted:oracle:p=0.02")
    cfg = _cfg(tmp_path, rounds=2, first=["sft", "rs_sft"], then=["rs_sft"], policy="scripted:oracle:p=0.6")
    assert cfg.continue_from == "best"
    run_loop(cfg)
    root = tmp_path / "run"
    rs = json.loads((root / "round_1/dev_rs_sft/stage.json").read_text())["decision"]
    assert rs["keep"] and not rs["new_best"] and "not better than the best" in rs["reason"]
    assert fake_trainers == [("sft", cfg.policy), ("rs_sft", PRODUCES["sft"]), ("rs_sft", PRODUCES["sft"])]
    assert [json.loads((root / f"round_{r}/eval/stage.json").read_text())["policy"] for r in (1, 2)] == \
        [PRODUCES["sft"]] * 2
    best = json.loads((root / "best.json").read_text())
    assert best["model"] == best["current"] == PRODUCES["sft"] and not (root / "eval_best").exists()
    assert "not better: not trained on" in (root / "report.md").read_text()


def test_promote_not_worse_hands_on_the_newest_kept_stage(tmp_path, fake_trainers, monkeypatch):
    # the same stages as above: rs_sft is no better on dev but not significantly worse, so with
    # promote: not_worse it becomes the best, round 2 trains from it and the run hands it back
    monkeypatch.setitem(PRODUCES, "sft", "scripted:oracle:p=0.0")
    monkeypatch.setitem(PRODUCES, "rs_sft", "scripted:oracle:p=0.02")
    cfg = _cfg(tmp_path, rounds=2, first=["sft", "rs_sft"], then=["rs_sft"], policy="scripted:oracle:p=0.6",
               promote="not_worse")
    run_loop(cfg)
    root = tmp_path / "run"
    rs = json.loads((root / "round_1/dev_rs_sft/stage.json").read_text())["decision"]
    assert rs["keep"] and rs["new_best"] and rs["score"] <= rs["best_score"]
    assert "the newest kept as the best" in rs["reason"]
    # compared with the best (sft) and with the one best before it (the base)
    assert set(rs["earlier"]) == {"round 0, base"} and "round 0, base" in rs["reason"]
    assert fake_trainers == [("sft", cfg.policy), ("rs_sft", PRODUCES["sft"]), ("rs_sft", PRODUCES["rs_sft"])]
    best = json.loads((root / "best.json").read_text())
    assert best["model"] == best["current"] == PRODUCES["rs_sft"] and best["where"] == "round 2, rs_sft"
    assert "kept as the new best (`promote: not_worse`)" in (root / "report.md").read_text()


def test_a_candidate_worse_than_an_earlier_best_is_rejected():
    # each step loses 2 tasks of 40 against the one before: never significant against the best,
    # but the fourth is significantly worse than the first, which was the best before
    first = {"react": {f"t{i}": i < 30 for i in range(40)}}
    second = {"react": {f"t{i}": i < 28 for i in range(40)}}
    third = {"react": {f"t{i}": i < 26 for i in range(40)}}
    fourth = {"react": {f"t{i}": i < 24 for i in range(40)}}
    assert decide(second, first, promote="not_worse")["new_best"]
    assert decide(third, second, promote="not_worse", earlier={"round 1": first})["new_best"]
    d = decide(fourth, third, promote="not_worse", earlier={"round 1": first, "round 2": second})
    assert d["tests"]["react"]["p_value"] > 0.05  # not worse than the best alone
    assert not d["keep"] and not d["new_best"]
    assert d["earlier"]["round 1"]["react"]["a_only"] == 6 and d["earlier"]["round 1"]["react"]["p_value"] < 0.05
    assert "worse on dev than round 1" in d["reason"] and "round 2" not in d["reason"]
    with pytest.raises(ValueError, match="promote must be one of"):
        decide(second, first, promote="newest")


def test_a_run_started_before_continue_from_existed_resumes_only_as_it_ran(tmp_path, fake_trainers):
    from train.loop import LoopError

    cfg = _cfg(tmp_path, rounds=1, continue_from="kept")
    run_loop(cfg)
    saved = tmp_path / "run" / "loop.json"
    settings = json.loads(saved.read_text())
    del settings["continue_from"], settings["promote"], settings["test_splits"]  # as runs started before them
    saved.write_text(json.dumps(settings))
    run_loop(cfg)  # those runs continued from the last kept stage and promoted the better: the same settings
    with pytest.raises(LoopError, match=r"other settings \(continue_from\)"):
        run_loop(cfg.model_copy(update={"continue_from": "best"}))
    with pytest.raises(LoopError, match=r"other settings \(promote\)"):
        run_loop(cfg.model_copy(update={"promote": "not_worse"}))


def test_the_dev_slice_is_disjoint_by_puzzle_from_everything_searched(tmp_path, fake_trainers):
    cfg = _cfg(tmp_path, rounds=1, expert_demos=30)
    run_loop(cfg)
    root = tmp_path / "run"
    dev = dev_slice(om.load_tasks("game24", "train"), cfg.dev_limit)
    dev_keys = {puzzle_key(t) for t in dev}
    searched = [r.task for f in ("results.jsonl", "demos.jsonl") for r in om.read_results(root / "round_1/search" / f)]
    assert searched and not {puzzle_key(t) for t in searched} & dev_keys
    evaluated = {json.loads(line)["task_id"] for line in (root / "round_0/dev/outcomes.jsonl").read_text().splitlines()}
    assert evaluated == {t.task_id for t in dev}
    assert all(t.split == "train" for t in dev)


def test_puzzles_not_ids_decide_disjointness():
    tasks = om.load_tasks("countdown", "train", 5)
    renamed = [dataclasses.replace(t, task_id="other-" + t.task_id) for t in tasks[:2]]
    assert without(tasks, renamed) == tasks[2:]
    with pytest.raises(ValueError, match="same puzzle"):
        check_disjoint(tasks, renamed)


def test_decide_uses_the_paired_test():
    best = {"react": {f"t{i}": i < 20 for i in range(40)}}
    worse = {"react": {f"t{i}": i < 8 for i in range(40)}}  # 12 tasks lost, none gained
    slightly = {"react": {f"t{i}": i < 18 for i in range(40)}}  # 2 lost: not significant
    better = {"react": {f"t{i}": i < 25 for i in range(40)}}
    d = decide(worse, best)
    assert not d["keep"] and d["tests"]["react"]["a_only"] == 12 and d["tests"]["react"]["p_value"] < 0.001
    d = decide(slightly, best)
    assert d["keep"] and not d["new_best"] and d["tests"]["react"]["p_value"] == 0.5
    d = decide(better, best)
    assert d["keep"] and d["new_best"] and d["score"] == 0.625
    # any significantly worse dev strategy rejects
    two = decide({"react": better["react"], "bon": worse["react"]}, {"react": best["react"], "bon": best["react"]})
    assert not two["keep"] and "bon" in two["reason"] and "react" not in two["reason"].split("bon")[0]


def test_schedule_names_each_rounds_trainers():
    cfg = LoopConfig(schedule=[["sft"], ["rs_sft", "dpo"], ["grpo"]])
    assert [cfg.trainers(r) for r in (1, 2, 3, 4)] == [["sft"], ["rs_sft", "dpo"], ["grpo"], ["grpo"]]
    assert LoopConfig(first=["dpo"], then=["grpo"]).trainers(2) == ["grpo"]
    with pytest.raises(ValueError, match="rlhf"):
        LoopConfig(schedule=[["sft"], ["rlhf"]], policy="scripted:oracle", prm=False).check()
