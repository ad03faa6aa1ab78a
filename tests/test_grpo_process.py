"""Dense process rewards for GRPO (PRIME-style): the advantage function against a hand
computation, the spread of step advantages over each turn's tokens, the ``process`` column the
grpo export fills from a reward model, and offline and online GRPO training with them."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

import omrl_search as om  # noqa: E402
from omrl_search.cli import main  # noqa: E402
from omrl_search.exports import grpo_rows  # noqa: E402
from omrl_search.reward import RewardModel  # noqa: E402
from train import grpo  # noqa: E402
from train.data import TokenRow, collate, token_advantages  # noqa: E402
from train.losses import process_advantages  # noqa: E402
from train.ppo import PPOConfig  # noqa: E402
from train.runtime import TrainError  # noqa: E402


class StepIndex(RewardModel):
    """Step k of any trajectory (1-based) scores k / 10: values a test can predict."""

    def score(self, prefixes):
        return [[(k + 1) / 10 for k in range(len(p.steps))] for p in prefixes]


def test_process_advantages_match_a_hand_computation():
    # group "a": two members from the root (no value before their first step); group "b": one
    # member from a snapshot valued 0.2; group "c": two members from a snapshot valued 0.6
    values = [[None, 0.5, 0.9], [None, 0.3], [0.2, 0.4, 0.1], [0.6, 1.0], [0.6, 0.0]]
    out = process_advantages([1.0, -1.0, 0.0, 0.5, -0.5], values, ["a", "a", "b", "c", "c"], coef=0.5)
    # a: the root is valued at the mean first-step value, 0.4; returns G_k = v_end - v_{k-1}:
    # member 0: G = [0.5, 0.4], member 1: G = [-0.1]; each baselined by the other's G_1
    assert out[0] == pytest.approx([1.0 + 0.5 * (0.5 + 0.1), 1.0 + 0.5 * (0.4 + 0.1)])
    assert out[1] == pytest.approx([-1.0 + 0.5 * (-0.1 - 0.5)])
    # b: a group of one is its own baseline (G = [-0.1, -0.3])
    assert out[2] == pytest.approx([0.0, 0.5 * (-0.3 + 0.1)])
    # c: G = [0.4] and [-0.6]
    assert out[3] == pytest.approx([0.5 + 0.5 * (0.4 + 0.6)])
    assert out[4] == pytest.approx([-0.5 + 0.5 * (-0.6 - 0.4)])
    # coef 0: the outcome advantage on every step
    assert process_advantages([1.0, -1.0], values[:2], [0, 0], coef=0.0) == [[1.0, 1.0], [-1.0]]


def test_outcome_scale_makes_coef_the_process_terms_weight_relative_to_the_outcome():
    values = [[None, 0.05, 0.09], [None, 0.03], [0.02, 0.04, 0.01]]  # a PRM spanning 0-0.1
    outcome, groups = [1.0, -1.0, 0.0], ["a", "a", "b"]
    raw = process_advantages(outcome, values, groups, coef=1.0)
    scaled = process_advantages(outcome, values, groups, coef=0.5, scale="outcome")
    raw_terms = [a - o for o, steps in zip(outcome, raw) for a in steps]
    terms = [a - o for o, steps in zip(outcome, scaled) for a in steps]
    # one factor for every term (directions and ratios kept) ...
    factor = terms[0] / raw_terms[0]
    assert factor > 1 and terms == pytest.approx([factor * t for t in raw_terms])
    # ... chosen so the terms' mean size is coef times the outcome advantages' over the steps
    outcome_size = (2 * 1.0 + 1 * 1.0 + 2 * 0.0) / 5
    assert sum(abs(t) for t in terms) / 5 == pytest.approx(0.5 * outcome_size)
    # a reward model that scores every step alike adds nothing, and a bad scale is refused
    flat = [[None, 0.1, 0.1], [None, 0.1]]
    assert process_advantages([1.0, -1.0], flat, [0, 0], coef=0.5, scale="outcome") == [[1.0, 1.0], [-1.0]]
    with pytest.raises(ValueError, match="scale must be 'raw' or 'outcome'"):
        process_advantages([1.0], [[None, 0.1]], [0], coef=0.5, scale="group")
    assert grpo.ProcessRewards().scale == "outcome"


def test_step_advantages_are_spread_over_each_turns_tokens():
    row = TokenRow(input_ids=list(range(9)), loss_mask=[0, 0, 1, 1, 0, 1, 1, 1, 0], logprobs=[0.0] * 9,
                   has_logprobs=False, advantage=9.0, step_advantages=[2.0, -1.0])
    assert token_advantages(row) == [0, 0, 2.0, 2.0, 0, -1.0, -1.0, -1.0, 0]
    plain = TokenRow(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0] * 3, has_logprobs=False,
                     advantage=0.5)
    assert collate([plain], 0)["advantages"].tolist() == [0.5]  # one per row without step advantages
    both = collate([row, plain], 0)["advantages"]
    assert both.shape == (2, 9)
    assert both[1].tolist() == [0.0, 0.5, 0.5] + [0.0] * 6
    row.step_advantages = [2.0]  # two turns, one advantage: refused
    with pytest.raises(ValueError, match="2 trainable turns but 1 step advantages"):
        token_advantages(row)


@pytest.mark.parametrize("strategy", ["best_of_n:n=3", "beam:width=2,k=2"])
def test_the_grpo_export_records_the_reward_models_step_values(strategy):
    results = om.search_many(om.load_tasks("game24", "train", limit=3), strategy=strategy,
                             policy="scripted:oracle:p=0.4", seed=0)
    rows = grpo_rows(results, reward_model=StepIndex())
    assert rows and all("process" not in r for r in grpo_rows(results))
    depths = set()
    for r in rows:
        depth = len(r["prompt"]) // 2  # system+user, then one assistant+observation pair per step before
        steps = sum(m["role"] == "assistant" for m in r["completion"])
        before = None if depth == 1 else (depth - 1) / 10
        assert r["process"] == pytest.approx([before] + [(depth + k) / 10 for k in range(steps)])
        depths.add(depth)
    assert depths == {1} if strategy.startswith("best") else max(depths) > 1  # beam: groups below the root


def _grpo_data(tmp_path, model, rm="rules:format=0.2,outcome=1"):
    results = om.search_many(om.load_tasks("game24", "train", limit=8), strategy="best_of_n:n=3",
                             policy="scripted:oracle:p=0.4", seed=0)
    om.write_results(tmp_path / "r.jsonl", results)
    args = ["export", "grpo", str(tmp_path / "r.jsonl"), "--out", str(tmp_path / "g.parquet"),
            "--tokenizer", model] + (["--process-rm", rm] if rm else [])
    assert main(args) == 0
    return str(tmp_path / "g.parquet")


def test_offline_grpo_trains_on_step_advantages(tiny_agent_model, tmp_path):
    data = _grpo_data(tmp_path, tiny_agent_model)
    cfg = grpo.GRPOConfig(model=tiny_agent_model, data=[data], out=str(tmp_path / "o"), lr=1e-3,
                          batch_size=2, max_steps=2, progress=False, process_rewards={"coef": 0.5})
    runner = grpo.build(cfg)
    rows = runner.source.examples
    assert rows and all(len(r.step_advantages) == len(r.process) - 1 for r in rows)
    assert any(r.step_advantages[0] != r.advantage for r in rows)  # the process part moved them
    runner.train()
    outcome_only = grpo.build(cfg.model_copy(update={"process_rewards": None, "out": str(tmp_path / "p")}))
    assert all(r.step_advantages is None for r in outcome_only.source.examples)


def test_process_rewards_without_process_values_is_one_clear_error(tiny_agent_model, tmp_path):
    data = _grpo_data(tmp_path, tiny_agent_model, rm=None)
    cfg = grpo.GRPOConfig(model=tiny_agent_model, data=[data], out=str(tmp_path / "o"), lr=1e-3,
                          batch_size=2, max_steps=1, progress=False, process_rewards={"coef": 0.5})
    with pytest.raises(TrainError, match=r"process_rewards: \d+ of \d+ GRPO rows have no process values"):
        grpo.build(cfg)
    with pytest.raises(ValueError, match="adds to a group estimator"):
        PPOConfig(model=tiny_agent_model, data=[data], out=str(tmp_path / "q"), process_rewards={"coef": 0.5})


def test_a_bad_process_rm_spec_is_one_error_line_and_writes_nothing(tmp_path, capsys):
    results = om.search_many(om.load_tasks("game24", "train", limit=2), strategy="best_of_n:n=2",
                             policy="scripted:oracle:p=0.4", seed=0)
    om.write_results(tmp_path / "r.jsonl", results)
    out = tmp_path / "g.parquet"
    assert main(["export", "grpo", str(tmp_path / "r.jsonl"), "--out", str(out), "--process-rm", "nope:x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown reward model 'nope:x'" in err[0] and not out.exists()


class ScriptedSource(grpo.RolloutSource):
    def search(self, runner, tasks, seed):
        return om.search_many(tasks, strategy=self.on.strategy, policy="scripted:oracle:p=0.4", seed=seed)


def test_online_grpo_scores_each_pass_with_the_process_model(tiny_agent_model, tmp_path):
    cfg = grpo.GRPOConfig(model=tiny_agent_model, out=str(tmp_path / "o"), lr=1e-3, max_steps=2, progress=False,
                          online={"env": "game24", "tasks_per_round": 2, "strategy": "best_of_n:n=3",
                                  "constrain": "none"},
                          process_rewards={"model": "rules:format=0.2,outcome=1", "coef": 0.5})
    runner = grpo.build(cfg)
    runner.source.__class__ = ScriptedSource
    runner.source.reencode = runner.source.builder.encoder
    rows, _ = runner.source.sample_pass(runner, offset=0)
    assert rows and all(r.process is not None and len(r.process) >= 2 for r in rows)
    assert runner.source.process_rm() is runner.source.process_rm()  # built once
    runner.train()
    assert all(r.step_advantages is not None for mb in runner.source.pending for r in mb)
    logged = [json.loads(line) for line in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in logged if "loss" in m]
    assert len(steps) == 2 and all(m["adv_process_abs"] > 0 and m["adv_outcome_abs"] > 0 for m in steps)
    # the default scale puts the process term at coef times the outcome's mean size
    assert all(m["adv_process_abs"] == pytest.approx(0.5 * m["adv_outcome_abs"]) for m in steps)


def test_process_shift_is_the_mean_distance_of_step_from_outcome_advantages():
    def row(advantage, steps=None):
        return TokenRow([1, 2], [0, 1], [0.0, 0.0], False, advantage=advantage, step_advantages=steps)

    a, b = row(1.0, [1.5, 0.5]), row(-1.0, [-1.2])
    shift = grpo.process_shift([a, b])
    assert shift["adv_outcome_abs"] == pytest.approx(1.0)
    assert shift["adv_process_abs"] == pytest.approx((0.5 + 0.5 + 0.2) / 3)
    assert grpo.process_shift([row(0.5)]) == {}  # outcome only: nothing to report
