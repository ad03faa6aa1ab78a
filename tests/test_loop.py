"""``omrl loop`` on a tiny random model: every stage runs and is recorded, a loop killed in the
middle of its training stage and started again ends with the unbroken run's results, and a run
folder refuses to continue under other settings."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from omrl_search.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _argv(model: str, out: Path, steps: int = 24) -> list[str]:
    return ["loop", "--env", "game24", "--policy", model, "--prm-base", model, "--rounds", "1",
            "--out", str(out), "--train-limit", "3", "--test-limit", "2", "--expert-demos", "6",
            "--dev-limit", "3", "--set", "dev_strategies=react", "--set", "dev_budget=tokens=1200",
            "--search-strategy", "best_of_n:n=2", "--search-budget", "tokens=2500",
            "--strategies", "react,mcts", "--budgets", "tokens=1200", "--max-tokens", "12",
            "--no-progress", "--set", "prm_settings.max_steps=3", "--set", "prm_settings.batch_size=2",
            "--set", "prm_settings.keep_layers=null", "--set", "prm_settings.train_layers=null",
            "--set", "prm_settings.val_fraction=0.4", "--set", f"trainer_settings.sft.max_steps={steps}",
            "--set", "trainer_settings.sft.lr=3e-3", "--set", "save_every=3"]


def _outcome(out: Path) -> dict:
    """What a finished loop produced: eval figures (without wall time), the policy's weights."""
    figures = {}
    for r in (0, 1):
        summary = json.loads((out / f"round_{r}" / "eval" / "summary.json").read_text())
        figures[r] = {name: {b: {k: v for k, v in s.items() if k != "seconds"} for b, s in per.items()}
                      for name, per in summary["strategies"].items()}
    weights = out / "round_1" / "train_sft" / "model" / "model.safetensors"
    return {"eval": figures, "weights": hashlib.sha256(weights.read_bytes()).hexdigest(),
            "report": (out / "report.md").read_text()}


def _cmd(argv: list[str]) -> list[str]:
    return [sys.executable, "-c", "import sys; from omrl_search.cli import main; sys.exit(main())", *argv]


def test_killed_loop_resumes_to_the_unbroken_result(tiny_agent_model, tmp_path):
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    whole = tmp_path / "whole"
    subprocess.run(_cmd(_argv(tiny_agent_model, whole)), check=True, env=env, cwd=ROOT,
                   capture_output=True, timeout=300)
    stages = sorted(p.parent.relative_to(whole).as_posix() for p in whole.glob("round_*/*/stage.json"))
    assert stages == ["round_0/dev", "round_0/eval", "round_1/data", "round_1/dev_sft", "round_1/eval",
                      "round_1/labels", "round_1/prm", "round_1/search", "round_1/train_sft"]
    prm = json.loads((whole / "round_1/prm/stage.json").read_text())
    assert prm["trained"]
    # the PRM's calibration on its validation steps: every step in one bin of the table
    cal = prm["calibration"]["all"]
    assert cal["steps"] == prm["validation"]["steps"] > 0 and cal["ece"] is not None
    assert sum(b["steps"] for b in cal["bins"]) == cal["steps"]
    report = (whole / "report.md").read_text()
    assert "Reliability of round 1's PRM" in report
    # the host and the policy's dtype the figures were taken in (an hf model: float32 or bf16)
    assert "host: " in report and ("dtype: float32" in report or "dtype: bfloat16" in report)
    # the results file a reader checks the run by (issue 38's fields), valid by its schema
    import jsonschema

    from train.loop_report import RESULTS_SCHEMA

    results = json.loads((whole / "results.json").read_text())
    jsonschema.validate(results, RESULTS_SCHEMA)
    for broken_record in ({**results, "rounds": []}, {k: v for k, v in results.items() if k != "git"},
                          {**results, "rounds": [{**results["rounds"][0], "heldout": {"tasks": 0}}]}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken_record, RESULTS_SCHEMA)
    assert [r["round"] for r in results["rounds"]] == [0, 1] and results["env"] == "game24"
    assert results["host"]["dtype"] in ("float32", "bfloat16") and results["hours"] > 0
    assert results["rounds"][0]["vs_previous"] is None and results["rounds"][1]["vs_previous"] is not None
    search = json.loads((whole / "round_1/search/stage.json").read_text())["search"]
    assert results["rounds"][1]["train_search"]["successes"] == search["successes"]
    eval1 = json.loads((whole / "round_1/eval/stage.json").read_text())["rows"]
    name, budget = results["heldout_strategy"].split("@")
    assert results["rounds"][1]["heldout"]["successes"] == eval1[name][budget]["successes"]
    # every stage records the commit it ran at; a round lists its stages' commits
    from train.loop import git_commit

    here = git_commit()
    assert json.loads((whole / "round_1/train_sft/stage.json").read_text())["git"] == here
    assert all(r["git"] == ([here] if here else []) for r in results["rounds"])

    for png in ("learning_curve.png", "tokens_per_solved.png"):  # the report's two curves
        assert (whole / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert results["search_on_best"] is None
    # the checkpoint keep-best hands back, on the test split, against the base on the same tasks
    assert results["best"]["model"] == json.loads((whole / "best.json").read_text())["model"]
    assert results["best"]["heldout"]["tasks"] == 2 and results["best"]["vs_base"]["p_value"] <= 1.0

    # the search on the best checkpoint, added to the finished run: only that stage runs
    before = {p: p.stat().st_mtime_ns for p in whole.glob("round_*/*/stage.json")}
    extended = _argv(tiny_agent_model, whole) + ["--set", "best_search=best_of_n:n=2",
                                                  "--set", "best_budget=tokens=1500"]
    subprocess.run(_cmd(extended), check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    assert {p: p.stat().st_mtime_ns for p in whole.glob("round_*/*/stage.json")} == before
    results = json.loads((whole / "results.json").read_text())
    jsonschema.validate(results, RESULTS_SCHEMA)
    best = json.loads((whole / "best.json").read_text())["model"]
    row = json.loads((whole / "search_on_best" / "summary.json").read_text())["strategies"]
    ((_, per),) = row.items()
    row = per["tokens=1500"]
    found = results["search_on_best"]
    assert found["policy"].endswith(best) and found["budget"] == "tokens=1500"
    assert found["strategy"].startswith("best_of_n:n=2")
    assert (found["tasks"], found["successes"]) == (row["tasks"], row["successes"]) == (2, row["successes"])
    assert found["tokens_per_task"] == round((row["prompt_tokens"] + row["completion_tokens"]) / 2) > 0
    assert set(found["vs_best_greedy"]) == {"b_only", "a_only", "p_value"} and found["git"] == here
    # the same settings again: the finished search is the answer; another budget: it runs again,
    # the one before moved aside (the stage records the checkpoint, strategy and budget it ran on)
    searched_at = (whole / "search_on_best" / "stage.json").stat().st_mtime_ns
    subprocess.run(_cmd(extended), check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    assert (whole / "search_on_best" / "stage.json").stat().st_mtime_ns == searched_at
    rebudget = extended[:-1] + ["best_budget=tokens=1200"]
    subprocess.run(_cmd(rebudget), check=True, env=env, cwd=ROOT, capture_output=True, timeout=300)
    aside = json.loads((whole / "search_on_best.replaced" / "stage.json").read_text())
    assert aside["record"]["budget"] == "tokens=1500" and aside["inputs"]["budget"] == "tokens=1500"
    again = json.loads((whole / "results.json").read_text())["search_on_best"]
    assert again["budget"] == "tokens=1200" and again["policy"] == found["policy"]
    assert {p: p.stat().st_mtime_ns for p in whole.glob("round_*/*/stage.json")} == before

    broken = tmp_path / "broken"
    proc = subprocess.Popen(_cmd(_argv(tiny_agent_model, broken)), env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpts = broken / "round_1" / "train_sft.partial" / "model" / "checkpoints"
    deadline = time.monotonic() + 240
    while not any(ckpts.glob("step-*/trainer_state.pt")) and proc.poll() is None:
        assert time.monotonic() < deadline, "the training stage never wrote a checkpoint"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (broken / "round_1" / "train_sft" / "stage.json").exists()  # killed inside the stage
    assert (broken / "round_1" / "search" / "stage.json").exists()

    subprocess.run(_cmd(_argv(tiny_agent_model, broken)), check=True, env=env, cwd=ROOT,
                   capture_output=True, timeout=300)
    assert _outcome(broken) == _outcome(whole)
    assert not list(broken.glob("round_*/*.partial"))


def test_a_run_folder_refuses_other_settings(tiny_agent_model, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "loop.json").write_text(json.dumps({"env": "countdown"}))
    assert main(_argv(tiny_agent_model, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "other settings" in err[0] and "env" in err[0]


@pytest.mark.parametrize("setting,needle", [("expert_demos=100000", "expert_demos 100000 is more than the"),
                                             ("dev_limit=100000", "dev_limit 100000 leaves no train task")])
def test_more_tasks_than_the_train_split_holds_is_one_line_before_any_work(tiny_agent_model, tmp_path,
                                                                            capsys, setting, needle):
    out = tmp_path / "run"
    assert main(_argv(tiny_agent_model, out) + ["--set", setting]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    assert not list(out.glob("round_*"))


@pytest.mark.parametrize("flag,value,needle", [("--strategies", "react,nosuch", "nosuch"),
                                                ("--set", "first=[rlhf]", "rlhf"),
                                                ("--budgets", "tokens=abc", "tokens"),
                                                ("--set", "trainer_settings.dpo.nosuch=1", "nosuch")])
def test_bad_settings_fail_before_anything_runs(flag, value, needle, tiny_agent_model, tmp_path, capsys):
    out = tmp_path / "run"
    argv = _argv(tiny_agent_model, out) + [flag, value]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not out.exists()


def test_grpo_is_skipped_when_every_group_is_flat(tmp_path):
    """GRPO on groups whose rewards are all equal has zero advantages everywhere: the loop records
    a skip instead of spending a training stage on it; one group with a spread is trained."""
    import pandas as pd

    from train.loop import LoopConfig
    from train.loop_stages import all_groups_flat, train_stage

    data = tmp_path / "round_2" / "data"
    data.mkdir(parents=True)
    flat = pd.DataFrame({"group_id": ["a", "a", "b", "b"], "reward": [0.0, 0.0, 1.0, 1.0]})
    flat.to_parquet(data / "grpo.parquet")
    cfg = LoopConfig(out=str(tmp_path), then=["grpo"])
    info = train_stage(cfg, 2, "grpo", "some/model")(tmp_path / "train_grpo.partial")
    assert info == {"trainer": "grpo", "from": "some/model",
                    "skipped": "every group's rewards are equal (no signal)"}
    pd.DataFrame({"group_id": ["a", "a", "b", "b"], "reward": [0.0, 0.0, 0.0, 1.0]}).to_parquet(
        data / "grpo.parquet")
    assert not all_groups_flat(data / "grpo.parquet")


def test_the_loop_module_calls_functions_and_loads_no_torch_until_a_trainer_runs():
    """``omrl --help`` imports every command module: train.loop must not pull torch in (the
    trainers are imported when one runs), nor the CLI (stages call Python functions, not argv)."""
    code = ("import sys, train.loop; "
            "print(sorted(m for m in ('torch', 'omrl_search.cli', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         check=True).stdout.strip()
    assert out == "[]"


def test_missing_policy_is_refused_before_anything_is_written(tmp_path, capsys):
    from omrl_search.cli import main

    out = tmp_path / "loop"
    assert main(["loop", "--env", "game24", "--policy", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "policy:" in capsys.readouterr().err and not out.exists()


def test_rs_sft_dpo_and_grpo_stages_train_on_the_rounds_exports(tiny_agent_model, tmp_path):
    """Round 2's data and trainer stages with the real trainers (tiny model, 2 steps each) on a
    scripted search's trees (a tiny random model solves nothing): rs_sft rows are successes only,
    at most rs_cap per task; the trainer settings reach the trainers (DPO's RPO term, GRPO's
    dynamic sampling); each stage trains from the model it is given."""
    import pandas as pd

    import omrl_search as om
    from train.loop import LoopConfig
    from train.loop_stages import cfg_path, data_stage, last_metrics, train_stage

    small = {"max_steps": 2, "batch_size": 2, "lr": 1e-3, "save_every": 0}
    cfg = LoopConfig(env="game24", policy=tiny_agent_model, out=str(tmp_path), prm=False, rs_cap=2,
                     progress=False, trainer_settings={
                         "rs_sft": small, "dpo": {**small, "rpo_alpha": 1.0},
                         "grpo": {**small, "dynamic_sampling": True, "clip_high": 0.28}})
    results = om.search_many(om.load_tasks("game24", "train", 6), strategy="best_of_n:n=4",
                             policy="scripted:oracle:p=0.4", seed=0)
    assert 0 < sum(r.success for r in results) < 6
    search = cfg_path(cfg, 2, "search")
    search.mkdir(parents=True)
    om.write_results(search / "results.jsonl", results)
    data = cfg_path(cfg, 2, "data")
    data.mkdir()
    rows = data_stage(cfg, 2)(data)["rows"]
    assert all(rows[k] > 0 for k in ("sft", "rs_sft", "dpo", "grpo")), rows
    rs = pd.read_parquet(data / "rs_sft.parquet")
    assert rs["success"].all() and rs.groupby("task_id").size().max() <= 2
    for kind in ("rs_sft", "dpo", "grpo"):
        d = cfg_path(cfg, 2, f"train_{kind}")
        d.mkdir()
        info = train_stage(cfg, 2, kind, tiny_agent_model)(d)
        assert info["from"] == tiny_agent_model and info["step"] == 2, info
        assert info["model"] == str(d / "model") and (d / "model" / "model.safetensors").exists()
        if kind == "dpo":
            assert "nll_chosen" in last_metrics(d / "model")
        if kind == "grpo":  # dynamic sampling counted the flat groups it dropped
            assert "groups_flat" in (d / "model" / "metrics.jsonl").read_text()


@pytest.mark.parametrize("agent", ["act", "terse"])
def test_the_agent_format_reaches_the_loops_searches_demonstrations_and_evals(tmp_path, agent):
    """``agent: act`` (or ``terse``): the round's search, its solver demonstrations and the
    evals all run in that format (trees record it, steps are Act lines alone, or the action
    alone), so what is trained on is what is evaluated."""
    import json

    import omrl_search as om
    from train.loop import LoopConfig
    from train.loop_stages import TaskSets, bench_tasks, search_stage

    cfg = LoopConfig(env="countdown", policy="scripted:oracle:p=0.3", agent=agent, train_limit=2,
                     expert_demos=2, dev_limit=5, prm=False, progress=False, out=str(tmp_path),
                     search_strategy="best_of_n:n=2")
    sets = TaskSets(cfg)
    d = tmp_path / "search"
    d.mkdir()
    search_stage(cfg, sets, 1, cfg.policy, None)(d)
    for name in ("results.jsonl", "demos.jsonl"):
        results = list(om.read_results(d / name))
        assert len(results) == 2 and all(r.tree.agent == agent for r in results)
        steps = [s for r in results for t in r.trajectories for s in t.steps]
        assert steps and all(s.completion == (f"Act: {s.action}" if agent == "act" else s.action)
                             for s in steps)
    e = tmp_path / "dev"
    rows = bench_tasks(cfg, sets.dev[:2], "react", "tokens=2000", cfg.policy, None, e)
    assert rows["react"]
    assert json.loads((e / "summary.json").read_text())["config"]["agent"] == agent


def test_prm_soft_q_labels_the_rounds_mcts_trees_with_their_q_values(tmp_path):
    """``prm_soft: q``: the round's PRM learns MCTS Q values (solver-proven steps exact), the
    labels ``omrl label --soft q`` gives the same trees; the search stage records its host and
    dtype (None for a scripted policy, which runs no model)."""
    import json

    import omrl_search as om
    from reward_models.label_files import load_label_dir
    from reward_models.labels import label_results
    from train.loop import LoopConfig
    from train.loop_stages import TaskSets, cfg_path, labels_stage, search_stage

    soft, searched = {}, {}
    for kind in ("mc", "q", "q+share"):
        out = tmp_path / kind
        cfg = LoopConfig(env="game24", policy="scripted:oracle:p=0.5", agent="act", train_limit=3,
                         dev_limit=5, progress=False, out=str(out), prm_demos=False,
                         prm_soft=kind.split("+")[0], prm_share_proofs=kind == "q+share",
                         search_strategy="mcts:priors=policy,solver=true,simulations=12")
        d = cfg_path(cfg, 1, "search")
        d.mkdir(parents=True)
        search_stage(cfg, TaskSets(cfg), 1, cfg.policy, None)(d)
        (out / "labels").mkdir()
        labels_stage(cfg, 1, cfg.policy)(out / "labels")
        searched[kind] = om.read_results(d / "results.jsonl")
        soft[kind] = sorted(json.dumps([r["completions"], r["soft_labels"]]) for r in load_label_dir(str(out / "labels")))
    for kind, share in (("q", False), ("q+share", True)):
        want = label_results(searched[kind], rollouts=0, soft="q", share_proofs=share)
        assert soft[kind] == sorted(json.dumps([r["completions"], r["soft_labels"]]) for r in want)
    assert soft["q"] != soft["mc"]  # the Q values are not the leaves' success shares
    with pytest.raises(ValueError, match="set prm_soft: q"):
        LoopConfig(env="game24", prm_share_proofs=True, out=str(tmp_path / "x")).check()


def test_the_search_stage_records_host_and_dtype(tmp_path):
    from omrl_search.host import host_info
    from train.loop import LoopConfig
    from train.loop_stages import TaskSets, search_stage

    cfg = LoopConfig(env="countdown", policy="scripted:oracle:p=0.3", agent="act", train_limit=2,
                     dev_limit=5, prm=False, progress=False, out=str(tmp_path), search_strategy="best_of_n:n=2")
    info = search_stage(cfg, TaskSets(cfg), 1, cfg.policy, None)(tmp_path)
    assert info["host"] == host_info() and info["dtype"] is None


def test_prm_demos_false_labels_the_search_trees_without_the_solver_demonstrations(tmp_path):
    """``prm_demos: false``: the PRM's label rows come from the round's own search trees only;
    by default the solver demonstrations are labelled too."""
    from reward_models.label_files import load_label_dir
    from train.loop import LoopConfig
    from train.loop_stages import TaskSets, cfg_path, labels_stage, search_stage

    counts = {}
    for demos in (True, False):
        out = tmp_path / str(demos)
        cfg = LoopConfig(env="countdown", policy="scripted:oracle:p=0.3", agent="act", train_limit=2,
                         expert_demos=3, dev_limit=5, progress=False, out=str(out),
                         search_strategy="best_of_n:n=2", prm_demos=demos)
        d = cfg_path(cfg, 1, "search")
        d.mkdir(parents=True)
        search_stage(cfg, TaskSets(cfg), 1, cfg.policy, None)(d)
        labels = out / "labels"
        labels.mkdir()
        labels_stage(cfg, 1, cfg.policy)(labels)
        rows = load_label_dir(str(labels))
        counts[demos] = sum(r["strategy"].startswith("react") for r in rows), len(rows)
    assert counts[True][0] == 3 and counts[False][0] == 0  # the demos: three react rows, or none
    assert counts[True][1] - 3 == counts[False][1] > 0     # the search's own rows either way


def test_online_grpo_samples_the_chosen_levels_and_never_a_dev_puzzle(tiny_agent_model, tmp_path,
                                                                       monkeypatch):
    """``trainer_settings.grpo.online``: the loop's GRPO samples its own groups with the policy
    it trains, from the curriculum's chosen levels without the dev slice's puzzles, in the run's
    agent format; the exported groups are not read."""
    import omrl_search as om
    from train.loop import LoopConfig
    from train.loop_select import puzzle_key
    from train.loop_stages import TaskSets, online_grpo, online_settings, train_stage, train_tasks

    online = {"strategy": "best_of_n:n=2", "tasks_per_round": 2, "constrain": "none", "max_depth": 1,
              "max_tokens": 6}
    cfg = LoopConfig(env="countdown", policy=tiny_agent_model, agent="act", dev_limit=50, prm=False,
                     progress=False, out=str(tmp_path), max_tokens=16, temperature=0.7,
                     curriculum={"levels": [1, 2, 3]},
                     trainer_settings={"grpo": {"max_steps": 2, "lr": 1e-3, "save_every": 0,
                                                "dynamic_sampling": False, "online": online}})
    assert online_grpo(cfg) and not online_grpo(LoopConfig())
    sets = TaskSets(cfg)
    tasks = train_tasks(cfg, sets, {"chosen": ["2"]})
    dev = {puzzle_key(t) for t in sets.dev}
    assert tasks and {t.data["level"] for t in tasks} == {2} and not dev & {puzzle_key(t) for t in tasks}
    assert train_tasks(cfg, sets, None) == list(sets.pool)
    settings = online_settings(cfg, tasks)
    assert (settings["env"], settings["agent"], settings["temperature"], settings["max_tokens"]) == \
        ("countdown", "act", 0.7, 6)  # the run's format and temperature; the stage's own token cap
    sampled = []
    search_many = om.search_many

    def recording(tasks, **kw):
        sampled.extend(tasks)
        assert kw["agent"] == "act"
        return search_many(tasks, **kw)

    monkeypatch.setattr(om, "search_many", recording)
    d = tmp_path / "train_grpo.partial"
    d.mkdir()
    info = train_stage(cfg, 3, "grpo", tiny_agent_model, sets, {"chosen": ["2"]})(d)  # no data stage
    assert info["step"] == 2 and "skipped" not in info, info
    assert len(sampled) == 4 and {t.task_id for t in sampled} <= {t.task_id for t in tasks}
    assert "rollout_rows" in (d / "model" / "metrics.jsonl").read_text()
    assert train_stage(cfg, 3, "grpo", tiny_agent_model, sets, {"chosen": []})(tmp_path / "x")["skipped"]


def test_online_grpo_gets_its_process_reward_model_from_the_loop(tmp_path, monkeypatch):
    """``process_rewards: prm|implicit``: online GRPO's settings name the round's PRM, or the
    implicit PRM of the policy being trained against the run's start; bad combinations fail
    before anything runs."""
    import omrl_search as om
    import train.loop_stages as st
    from train.loop import LoopConfig

    online = {"grpo": {"max_steps": 1, "online": {"strategy": "best_of_n:n=2"}}}
    seen = []
    monkeypatch.setattr(st, "run_trainer", lambda kind, settings: seen.append(settings) or settings["out"])
    sets = SimpleNamespace(pool=om.load_tasks("countdown", "train", limit=3), dev=[])
    for mode, prm, want in [("prm", "runs/r1/prm/model", "prm:runs/r1/prm/model"),
                            ("implicit", None, "implicit:hf:runs/r2/model,ref=smollm2"),
                            ("none", "runs/r1/prm/model", None)]:
        cfg = LoopConfig(env="countdown", process_rewards=mode, process_coef=0.25, out=str(tmp_path),
                         trainer_settings=online, progress=False)
        cfg.check()
        d = tmp_path / mode
        d.mkdir()
        info = st.train_stage(cfg, 2, "grpo", "runs/r2/model", sets, None, prm)(d)
        assert "skipped" not in info
        got = seen.pop().get("process_rewards")
        assert got == ({"model": want, "coef": 0.25} if want else None)
    cfg = LoopConfig(env="countdown", process_rewards="prm", out=str(tmp_path), trainer_settings=online)
    assert "no PRM" in st.train_stage(cfg, 1, "grpo", "m", sets, None, None)(tmp_path / "x")["skipped"]
    with pytest.raises(ValueError, match="scores online GRPO's samples"):
        LoopConfig(env="countdown", process_rewards="implicit").check()
    with pytest.raises(ValueError, match="needs the loop's PRM"):
        LoopConfig(env="countdown", process_rewards="prm", prm=False, trainer_settings=online).check()


@pytest.mark.parametrize("history, rounds", [(None, [1, 2, 3]), (1, [2, 3]), (0, [3])])
def test_rs_sft_mixes_the_earlier_rounds_successes_deduplicated(tmp_path, history, rounds):
    """Round r's RS-SFT data: the successes of round r's search and of the `rs_history` rounds
    before it, deduplicated together by state path (a task solved the same way twice is one
    row), so the policy keeps what it solved before."""
    import pandas as pd

    import omrl_search as om
    from train.loop import LoopConfig
    from train.loop_stages import data_stage, search_files

    cfg = LoopConfig(env="game24", policy="scripted:oracle", out=str(tmp_path), rs_cap=100, rs_history=history)
    tasks = om.load_tasks("game24", "train", limit=6)
    per_round = {1: tasks[:2], 2: tasks[1:3], 3: tasks[3:5]}  # task 1 in rounds 1 and 2
    for r, some in per_round.items():
        d = search_files(cfg, r)[0].parent
        d.mkdir(parents=True)
        om.write_results(d / "results.jsonl", om.search_many(some, strategy="best_of_n:n=2",
                                                             policy="scripted:oracle:p=0", seed=r))
    out = tmp_path / "round_3" / "data"
    out.mkdir(parents=True)
    info = data_stage(cfg, 3)(out)
    assert info["rows"]["rs_sft_rounds"] == rounds
    got = pd.read_parquet(out / "rs_sft.parquet")
    # the oracle at p=0 solves each task one way: one row per task seen in the rounds mixed
    seen = {t.task_id for r in rounds for t in per_round[r]}
    assert sorted(got["task_id"]) == sorted(seen) and info["rows"]["rs_sft"] == len(seen)


def test_the_rounds_dpo_pairs_follow_dpo_pairs(tmp_path):
    """`dpo_pairs: qgap` makes the round's DPO data the Q-gap pairs of its MCTS trees (with
    `dpo_margin` and `dpo_min_visits`), not the default branch-point pairs."""
    import omrl_search as om
    from omrl_search.exports import dpo_rows
    from train.loop import LoopConfig
    from train.loop_stages import data_stage, search_files

    tasks = om.load_tasks("game24", "train", limit=6)
    results = [r for policy, some in (("scripted:oracle:p=0.4", tasks[:3]), ("scripted:random", tasks[3:]))
               for r in om.search_many(some, strategy="mcts:simulations=60,k=3,solver=true", policy=policy, seed=0)]
    counts = {}
    for pairs in ("branch", "qgap"):
        cfg = LoopConfig(env="game24", policy="scripted:oracle", out=str(tmp_path / pairs), dpo_pairs=pairs,
                         dpo_margin=0.3, dpo_min_visits=2)
        d = search_files(cfg, 1)[0].parent
        d.mkdir(parents=True)
        om.write_results(d / "results.jsonl", results)
        (d.parent / "data").mkdir()
        counts[pairs] = data_stage(cfg, 1)(d.parent / "data")["rows"]["dpo"]
        assert counts[pairs] == len(dpo_rows(results, pairs=pairs, margin=0.3, min_visits=2))
    assert counts["branch"] != counts["qgap"]


def test_curve_points_are_each_rounds_success_and_tokens_per_solved_task():
    from train.loop_report import curve_points

    def row(successes, tokens):
        return {"tasks": 10, "successes": successes, "success_rate": successes / 10, "ci_low": 0.0,
                "ci_high": 1.0, "prompt_tokens": tokens - 100, "completion_tokens": 100}

    history = [{"round": r, "eval": {"rows": {"react": {"tokens=2000": row(s, t)}}}}
               for r, (s, t) in enumerate([(0, 5000), (2, 6000), (4, 6000)])]
    pts = curve_points(history)["react@tokens=2000"]
    assert [p["round"] for p in pts] == [0, 1, 2] and [p["success_rate"] for p in pts] == [0.0, 0.2, 0.4]
    assert [p["tokens_per_solved"] for p in pts] == [None, 3000, 1500]


def test_the_recorded_commit_is_marked_dirty_when_tracked_files_differ_from_it(tmp_path):
    from train.loop import git_commit

    assert git_commit(tmp_path) is None  # not a checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run(git + ["add", "code.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], check=True, capture_output=True,
                          text=True).stdout.strip()
    assert git_commit(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not change the code that ran\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "-dirty"


def test_set_overrides_a_flag_and_a_config_file(tmp_path):
    """The documented precedence: defaults < --config < flags < --set."""
    import argparse

    from train.loop import config_from_args, configure

    (tmp_path / "loop.yaml").write_text("env: countdown\ntrain_limit: 7\nrs_cap: 3\n")
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--config", str(tmp_path / "loop.yaml"), "--train-limit", "4", "--out", "x",
                         "--set", "train_limit=5", "--set", "trainer_settings.sft.max_steps=9"])
    cfg = config_from_args(args)
    assert (cfg.env, cfg.train_limit, cfg.rs_cap) == ("countdown", 5, 3)
    assert cfg.trainer_settings["sft"]["max_steps"] == 9
    cfg = config_from_args(p.parse_args(["--config", str(tmp_path / "loop.yaml"), "--train-limit", "4",
                                         "--out", "x"]))
    assert cfg.train_limit == 4
