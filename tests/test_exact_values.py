"""Exact values (the optional Env capability) and the label kinds built on them: ``exact`` from
the env's solver, ``q`` from MCTS trees with solver-proven wins and losses."""
from __future__ import annotations

import random
from fractions import Fraction

import pytest

import omrl_search as om
from envs.arith import solvable
from omrl_search.env import ReplayEnv, make_env, offers_exact_value
from omrl_search.tree import SearchTree
from omrl_search.types import Step


def _searched(tmp_path, env: str, split: str, limit: int, strategy: str):
    """``omrl search`` with the half-wrong oracle into ``tmp_path/run``; the run folder."""
    from omrl_search.cli import main

    run = tmp_path / "run"
    assert main(["search", "--env", env, "--split", split, "--limit", str(limit), "--policy",
                 "scripted:oracle:p=0.5", "--strategy", strategy, "--out", str(run),
                 "--no-progress"]) == 0
    return run


def _heldout_script(*args):
    """``benchmarks/prm_heldout.py ARGS`` run as a user runs it, from the repository root."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(root / "benchmarks/prm_heldout.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=root)


def _random_walk(env, rng, steps):
    for _ in range(steps):
        acts = env.valid_actions()
        if not acts:
            break
        env.step(rng.choice(acts))


@pytest.mark.parametrize("name", ["game24", "countdown"])
def test_exact_value_is_solvable_on_random_states(name):
    env, rng = make_env(name), random.Random(7)
    seen = set()
    for task in om.load_tasks(name, "train", limit=25):
        for depth in range(3):
            env.reset(task)
            _random_walk(env, rng, depth)
            s = env.state
            want = float(s.success) if s.done else float(solvable(s.numbers, s.target))
            assert env.exact_value() == want
            seen.add(want)
    assert seen == {0.0, 1.0}  # both verdicts met


def test_a_finished_state_is_its_success():
    env = make_env("game24")
    env.reset(om.load_tasks("game24", "train", limit=1)[0])
    env.step(f"answer {'+'.join(str(x) for x in env.state.original)}")  # wrong unless it sums to 24
    assert env.state.done and env.exact_value() == float(env.state.success)


def test_only_envs_that_can_offer_it():
    assert offers_exact_value(make_env("game24")) and offers_exact_value(make_env("countdown"))
    assert offers_exact_value(ReplayEnv(make_env("game24")))
    assert not offers_exact_value(make_env("sokoban"))
    assert make_env("sokoban").exact_value() is None


@pytest.fixture(scope="module")
def trees():
    tasks = om.load_tasks("game24", "train", limit=6)
    return om.search_many(tasks, strategy="mcts:simulations=8,value=rollout,k=2",
                          policy="scripted:oracle:p=0.6", seed=3)


def _numbers_left(observation: str) -> list[Fraction]:
    board = observation.rsplit("Numbers left:", 1)[1].split("|")[0]
    return [Fraction(x) for x in board.split()]


def test_exact_labels_are_solvability_after_each_step(trees):
    from reward_models.labels import label_results

    rows = label_results(trees, soft="exact")
    checked = 0
    for row in rows:
        for i, (obs, y) in enumerate(zip(row["observations"], row["soft_labels"])):
            last = i == len(row["completions"]) - 1
            if last and row["terminal"]:
                assert y == float(row["success"])
                continue
            assert y == float(solvable(_numbers_left(obs), 24)), (row["completions"][:i + 1], obs)
            assert row["labels"][i] == (y >= 0.5)
            checked += 1
    assert checked > 20 and {0.0, 1.0} <= {y for r in rows for y in r["soft_labels"]}
    # every labelled path is whole: exact values never cut a path
    from omrl_search.exports import label_paths
    assert len(rows) == sum(len(label_paths(r.tree)) for r in trees)


def test_exact_labels_refuse_an_env_without_the_capability(tmp_path, capsys):
    from omrl_search.cli import main

    run = _searched(tmp_path, "sokoban", "test", 1, "react")
    out = tmp_path / "labels"
    assert main(["label", str(run), "--out", str(out), "--soft", "exact"]) == 2
    err = capsys.readouterr().err
    assert "'sokoban' cannot compute exact values" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_exact_label_command_marks_the_oracle(tmp_path, capsys):
    import json

    from omrl_search.cli import main

    run = _searched(tmp_path, "countdown", "test", 2, "beam:width=2,k=2")
    out = tmp_path / "labels"
    assert main(["label", str(run), "--out", str(out), "--soft", "exact", "--no-progress"]) == 0
    assert "ceiling experiment" in capsys.readouterr().err
    assert "oracle" in json.loads((out / "meta.json").read_text())


def _toy_tree():
    """root -> a (visited 4, value 1.0) -> a1 solved; root -> b (visited 4, value 1.2, clipped)
    -> b1 failed; root -> c (visited 2, value 0.5), open."""
    task = om.load_tasks("game24", "train", limit=1)[0]
    tree = SearchTree(task, "obs", None)
    def add(parent, text, visits, value, terminal=False, success=False):
        n = tree.add_child(parent, Step(text, "", text, "o"), None, text)
        n.visits, n.value_sum, n.terminal, n.success = visits, value, terminal, success
        return n
    a = add(tree.root, "a", 4, 1.0)
    a1 = add(a, "a1", 1, 1.0, terminal=True, success=True)
    b = add(tree.root, "b", 4, 1.2 * 4)
    b1 = add(b, "b1", 1, 0.0, terminal=True)
    c = add(tree.root, "c", 2, 1.0)
    d = add(tree.root, "d", 0, 0.0)
    return tree, (a, a1, b, b1, c, d)


def test_q_labels_on_a_toy_tree():
    from reward_models.labels import q_labels

    tree, (a, a1, b, b1, c, d) = _toy_tree()
    res = type("R", (), {"tree": tree})()
    q = q_labels([res])
    assert q[(0, a.id)] == 1.0  # a proven win (its mean return is 0.25)
    assert q[(0, a1.id)] == 1.0 and q[(0, b1.id)] == 0.0  # finished steps: proven
    assert q[(0, b.id)] == 1.0  # mean return 1.2, clipped
    assert q[(0, c.id)] == 0.5  # visit-weighted mean return
    assert (0, d.id) not in q and (0, 0) not in q  # no visits, no proof: no label


class _OraclePRM:
    """Scores each step by what its observation shows: the outcome when finished, else whether
    the numbers left can still make 24 (a PRM that is always right)."""

    kind = "prm"

    def score_episodes(self, episodes):
        out = []
        for ep in episodes:
            scores = []
            for obs in ep.observations:
                if "Solved" in obs:
                    scores.append(0.9)
                elif "Failed" in obs or "Out of steps" in obs:
                    scores.append(0.1)
                else:
                    scores.append(0.8 if solvable(_numbers_left(obs), 24) else 0.2)
            out.append(scores)
        return out


def test_heldout_against_exact_labels(tmp_path, monkeypatch):
    """``benchmarks/prm_heldout.py --labels exact``: a PRM that is always right ranks every step
    (AUC 1 before the end and over all steps); an env without exact values is one error."""
    from reward_models.prm import ProcessRewardModel
    from train.loop_prm import heldout

    results = om.search_many(om.load_tasks("game24", "test", 5), strategy="best_of_n:n=3",
                             policy="scripted:oracle:p=0.5", seed=0)
    f = tmp_path / "results.jsonl"
    om.write_results(f, results)
    monkeypatch.setattr(ProcessRewardModel, "from_pretrained",
                        classmethod(lambda cls, *a, **k: _OraclePRM()))
    out = heldout("unused", [f], labels="exact")
    assert out["before_end"]["auc"] == 1.0 and out["all"]["auc"] == 1.0
    assert 0 < out["before_end"]["steps"] < out["all"]["steps"]
    mc = heldout("unused", [f])  # the same steps against MC values of three leaves
    assert mc["all"]["steps"] <= out["all"]["steps"]

    sok = om.search_many(om.load_tasks("sokoban", "test", 1), strategy="react",
                         policy="scripted:oracle:p=0.5", seed=0)
    g = tmp_path / "sokoban.jsonl"
    om.write_results(g, sok)
    with pytest.raises(ValueError, match="'sokoban' cannot compute exact values"):
        heldout("unused", [g], labels="exact")


def test_mc_labels_scored_against_exact_labels(tmp_path, trees):
    """``prm_heldout.py --mc-vs-exact``: every distinct step with an MC value, its MC value as
    the prediction and its exact label as the truth."""
    from helpers import load_script
    from reward_models.labels import label_results
    from train.prm import unique_steps

    f = tmp_path / "results.jsonl"
    om.write_results(f, trees)
    out = load_script("benchmarks/prm_heldout.py").mc_vs_exact([f])
    steps = unique_steps(label_results(trees, rollouts=0))
    assert out["all"]["calibration"]["steps"] == len(steps)
    assert out["before_end"]["calibration"]["steps"] == sum(not end for *_, end in steps)
    assert out["before_end"]["auc"] > 0.7  # leaves of a half-right oracle: informative labels


def test_a_prm_trained_on_exact_labels_is_marked_a_ceiling(tmp_path, tiny_hf_model, capsys):
    import json

    from omrl_search.cli import main

    run = _searched(tmp_path, "game24", "train", 8, "beam:width=2,k=2")
    labels = tmp_path / "labels"
    assert main(["label", str(run), "--out", str(labels), "--soft", "exact", "--no-progress"]) == 0
    out = tmp_path / "prm"
    assert main(["train", "prm", "--data", str(labels), "--base", tiny_hf_model, "--out", str(out),
                 "--max-steps", "1", "--batch-size", "2", "--device", "cpu", "--no-progress"]) == 0
    assert "a ceiling experiment" in capsys.readouterr().err
    assert json.loads((out / "omrl-train.json").read_text())["oracle_labels"].endswith("meta.json")


def test_heldout_script_names_a_missing_results_file_in_one_line(tmp_path):
    """An unexpanded glob (a folder without trees) is one error line and exit 2, not a traceback."""
    done = _heldout_script("--mc-vs-exact", tmp_path / "trees/*.jsonl")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(f"no such results file: {tmp_path}/trees/*.jsonl")
    assert "Traceback" not in done.stderr


def test_paired_auc_resamples_whole_tasks():
    """The paired bootstrap: each scorer's point AUC is the plain (tie-aware) AUC; a scorer
    against itself differs by 0 with p = 1; a sharp scorer beats a coin with an interval
    clear of 0; mismatched inputs are an error."""
    from reward_models.metrics import paired_auc, roc_auc

    rng = random.Random(3)
    y = [rng.random() < 0.3 for _ in range(400)]
    coin = [rng.random() for _ in y]
    sharp = [round(0.6 * t + 0.5 * rng.random(), 1) for t in y]  # rounded: many ties
    groups = [f"t{i // 4}" for i in range(len(y))]
    out = paired_auc(coin, sharp, y, groups, resamples=500)
    assert out["auc_a"] == round(roc_auc(coin, y), 4) and out["auc_b"] == round(roc_auc(sharp, y), 4)
    assert out["tasks"] == 100 and out["steps"] == 400
    assert out["ci_low"] > 0.2 and out["p_value"] <= 1 / 500 * 2
    same = paired_auc(sharp, sharp, y, groups, resamples=200)
    assert same["diff"] == 0 and same["ci_low"] == same["ci_high"] == 0 and same["p_value"] == 1.0
    with pytest.raises(ValueError, match="one score of each scorer"):
        paired_auc(coin, sharp[:-1], y, groups)


class _CoinPRM:
    """Scores every step by a hash of its observation: no foresight."""

    kind = "prm"

    def score_episodes(self, episodes):
        import zlib

        return [[zlib.crc32(obs.encode()) % 1000 / 1000 for obs in ep.observations] for ep in episodes]


def test_heldout_on_some_tasks_writes_predictions_two_prms_compare(tmp_path, monkeypatch):
    """``prm_heldout.py --tasks N --predictions F``: only the first N tasks' trees are scored and
    every scored step is one line; ``--compare A B`` pairs two such files on their shared steps
    (the oracle beats a coin before the end); a malformed line names its file and line."""
    import json

    from reward_models.prm import ProcessRewardModel
    from train.loop_prm import compare_predictions, heldout

    results = om.search_many(om.load_tasks("game24", "test", 6), strategy="best_of_n:n=3",
                             policy="scripted:oracle:p=0.5", seed=0)
    f = tmp_path / "results.jsonl"
    om.write_results(f, results)
    for name, prm in (("oracle", _OraclePRM()), ("coin", _CoinPRM())):
        monkeypatch.setattr(ProcessRewardModel, "from_pretrained", classmethod(lambda cls, *a, p=prm, **k: p))
        out = heldout("unused", [f], labels="exact", tasks=4, predictions=tmp_path / f"{name}.jsonl")
        assert out["results"] == 4
        lines = [json.loads(x) for x in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        assert len(lines) == out["all"]["steps"] and len({(d["task_id"], d["path"]) for d in lines}) == len(lines)
        assert len({d["task_id"] for d in lines}) == 4
        assert sum(not d["end"] for d in lines) == out["before_end"]["steps"]
    cmp = compare_predictions(tmp_path / "coin.jsonl", tmp_path / "oracle.jsonl", resamples=300)
    assert cmp["only_a"] == cmp["only_b"] == 0 and cmp["before_end"]["auc_b"] == 1.0
    assert cmp["before_end"]["diff"] > 0 and cmp["before_end"]["tasks"] == 4

    flipped = tmp_path / "flipped.jsonl"
    flipped.write_text("".join(json.dumps({**d, "label": 1 - d["label"]}) + "\n" for d in lines))
    with pytest.raises(ValueError, match="same labels"):
        compare_predictions(tmp_path / "coin.jsonl", flipped)
    bad = tmp_path / "bad.jsonl"
    bad.write_text((tmp_path / "coin.jsonl").read_text() + "{not json\n")
    done = _heldout_script("--compare", tmp_path / "oracle.jsonl", bad)
    n = len(lines) + 1
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith(f"prm_heldout: error: {bad}:{n}:")


@pytest.mark.parametrize("name", ["game24", "countdown"])
def test_equal_value_keys_mean_equal_exact_values_across_tasks(name):
    env, rng = make_env(name), random.Random(11)
    value_of: dict[str, float] = {}
    boards: dict[str, set] = {}
    for task in om.load_tasks(name, "train", limit=20):
        for depth in (1,) * 5 + (2,) * 20:
            env.reset(task)
            _random_walk(env, rng, depth)
            if env.state.done:
                continue
            key = env.value_key()
            assert value_of.setdefault(key, env.exact_value()) == env.exact_value()
            boards.setdefault(key, set()).add((task.task_id, env.state.path))
    assert any(len(b) > 1 for b in boards.values())  # some key was met by two routes or tasks
    env.reset(om.load_tasks(name, "train", limit=1)[0])
    other = make_env(name)
    other.reset(om.load_tasks(name, "train", limit=2)[1])
    assert env.value_key() != other.value_key()  # other numbers, other key
    assert ReplayEnv(make_env(name)).value_key is not None


def test_shared_proofs_pass_wins_on_only_to_solvable_states(trees):
    from reward_models.labels import exact_labels, q_labels, shared_proofs

    shared, q, exact = shared_proofs(trees), q_labels(trees), exact_labels(trees)
    promoted = [k for k, v in shared.items() if v == 1.0 and q.get(k) != 1.0]
    assert promoted  # some step got a win proven at a transposition of its state
    assert all(exact[k] == 1.0 for k in promoted)  # and every such state can be solved
    assert all(shared[k] == v for k, v in q.items() if k not in promoted)  # the rest: Q as it was


def test_share_proofs_needs_q_labels_and_an_env_with_value_keys(tmp_path, capsys):
    from omrl_search.cli import main

    run = _searched(tmp_path, "sokoban", "test", 1, "mcts:simulations=4,k=2")
    out = tmp_path / "labels"
    assert main(["label", str(run), "--out", str(out), "--soft", "mc", "--share-proofs"]) == 2
    assert "needs soft=q" in capsys.readouterr().err
    assert main(["label", str(run), "--out", str(out), "--soft", "q", "--share-proofs",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "offers no value_key" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_heldout_scores_a_saved_prm_in_bfloat16(tmp_path, tiny_hf_model):
    """``prm_heldout.py --dtype bfloat16``: the saved PRM is loaded in bf16 and scores the same
    steps as in float32, each score within bf16's rounding of the float32 one; ``--dtype`` with
    an implicit PRM or with ``--mc-vs-exact`` is one error."""
    import json

    torch = pytest.importorskip("torch")
    from reward_models.prm import ProcessRewardModel
    from train.loop_prm import heldout, load_scorer

    ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32",
                                 seed=1).save_pretrained(str(tmp_path / "prm"))
    assert next(load_scorer(tmp_path / "prm", "bfloat16").model.parameters()).dtype == torch.bfloat16
    results = om.search_many(om.load_tasks("game24", "test", 3), strategy="best_of_n:n=2",
                             policy="scripted:oracle:p=0.5", seed=0)
    f = tmp_path / "results.jsonl"
    om.write_results(f, results)
    scores = {}
    for dtype in ("float32", "bfloat16"):
        out = heldout(tmp_path / "prm", [f], labels="exact", predictions=tmp_path / f"{dtype}.jsonl",
                      dtype=dtype)
        assert out["all"]["steps"] > 0
        lines = [json.loads(x) for x in (tmp_path / f"{dtype}.jsonl").read_text().splitlines()]
        scores[dtype] = {(d["task_id"], d["path"]): d["score"] for d in lines}
    assert scores["float32"].keys() == scores["bfloat16"].keys()
    diffs = [abs(scores["float32"][k] - scores["bfloat16"][k]) for k in scores["float32"]]
    assert max(diffs) < 0.05 and sum(diffs) / len(diffs) < 0.02
    with pytest.raises(ValueError, match="not an implicit"):
        load_scorer("implicit:unused", "bfloat16")
    done = _heldout_script("--mc-vs-exact", "--dtype", "bfloat16", f)
    assert done.returncode == 2 and "--dtype go with --prm" in done.stderr.strip().splitlines()[-1]
    done = _heldout_script("--prm", "implicit:unused", "--dtype", "bfloat16", f)
    assert done.returncode == 2 and "not an implicit" in done.stderr.strip().splitlines()[-1]
