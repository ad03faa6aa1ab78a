"""Rule rewards, the LLM judge, step metrics and the reward-model registry (no torch needed)."""
from __future__ import annotations

import subprocess
import sys

import pytest

import omrl_search as om
from omrl_search.policy import Policy
from omrl_search.reward import make_reward_model
from omrl_search.tree import SearchTree, Trajectory
from omrl_search.types import Generation, Step, Task
from reward_models.judge import JudgeParseError, LLMJudge, parse_score
from reward_models.metrics import roc_auc, step_metrics
from reward_models.rules import RuleReward


def _traj(*steps: Step) -> Trajectory:
    tree = SearchTree(Task("game24", "t1", instruction="make 24"), "Numbers left: 1 2 3 4", None)
    node = tree.root
    for s in steps:
        node = tree.add_child(node, s, None, "")
    return tree.trajectory(node)


GOOD = Step("Think: add.\nAct: 1 + 2", "add.", "1 + 2", "Numbers left: 3 3 4", reward=0.0)
BAD = Step("I am not sure", "", "", "Invalid format", valid=False)
WIN = Step("Think: done.\nAct: 6 * 4", "done.", "6 * 4", "Solved", reward=1.0, done=True,
           success=True)
DOUBLE = Step("Think: a\nThink: b\nAct: 1 + 2", "a", "1 + 2", "ok")


# --- rules ----------------------------------------------------------------------------------------
def test_each_rule_scores_what_it_names():
    t = _traj(GOOD, BAD, DOUBLE, WIN)
    assert RuleReward({"format": 1}).score([t]) == [[1.0, 0.0, 1.0, 1.0]]
    assert RuleReward({"outcome": 1}).score([t]) == [[0.0, 0.0, 0.0, 1.0]]
    assert RuleReward({"tag_count": 1}).score([t]) == [[1.0, 0.0, 0.0, 1.0]]
    assert RuleReward({"env": 1}).score([t]) == [[0.0, 0.0, 0.0, 1.0]]


def test_rules_compose_by_weights_and_aggregate():
    rm = make_reward_model("rules:format=0.2,outcome=1,tag_count=0.5,aggregation=min")
    t = _traj(GOOD, WIN)
    assert rm.score([t]) == [[pytest.approx(0.7), pytest.approx(1.7)]]
    assert rm.value([t]) == [pytest.approx(0.7)]
    assert rm.value([_traj()]) == [0.0]  # no steps


@pytest.mark.parametrize("spec, msg", [("rules:bogus=1", "unknown rule"),
                                       ("rules:format=high", "must be numbers"),
                                       ("rules:format=1,aggregation=max", "unknown aggregation")])
def test_bad_rule_specs_fail_with_one_message(spec, msg):
    with pytest.raises(ValueError, match=msg):
        make_reward_model(spec)


def test_registry_lists_every_kind_without_importing_torch():
    code = ("import sys, omrl_search as om; names = om.reward.list_reward_models(); "
            "import reward_models.labels, train.prm; "
            "print(names, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['implicit', 'judge', 'orm', 'prm', 'rules'] False"


# --- metrics --------------------------------------------------------------------------------------
def test_auc_counts_pairs_and_ties():
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [False, False, True, True]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [False, False, True, True]) == 0.0
    assert roc_auc([0.5, 0.5], [False, True]) == 0.5
    assert roc_auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == 0.75
    assert roc_auc([0.1, 0.2], [True, True]) is None


def test_step_metrics_use_the_threshold_on_soft_labels():
    m = step_metrics([0.9, 0.2, 0.6, 0.4], [1.0, 0.0, 0.75, 0.5])
    assert m["positives"] == 3 and m["steps"] == 4
    assert m["accuracy"] == 0.75  # 0.4 vs label 0.5 is on the wrong side
    assert m["auc"] == 1.0
    assert 0 < m["bce"] < 1


# --- judge ----------------------------------------------------------------------------------------
class TextPolicy(Policy):
    """Answers every prompt with the next canned text (records the prompts)."""

    name = "canned"

    def __init__(self, answers):
        self.answers, self.prompts, self.calls = list(answers), [], 0

    def generate(self, requests):
        self.calls += 1
        out = []
        for r in requests:
            self.prompts.append(r.messages[-1]["content"])
            text = self.answers.pop(0) if self.answers else "Score: 5"
            out.append([Generation(text, [1, 2], None, 10, 2) for _ in range(r.params.n)])
        return out


def test_parse_score_reads_the_last_score_line_and_clips():
    assert parse_score("Reasoning... Score: 7") == 0.7
    assert parse_score("score = 3.5\nScore: **9**") == 0.9
    assert parse_score("Score: 12") == 1.0
    assert parse_score("I think it is good") is None


def test_judge_scores_prefixes_in_one_policy_call():
    pol = TextPolicy(["Score: 8", "Score: 2"])
    judge = LLMJudge(pol)
    scores = judge.score([_traj(GOOD), _traj(GOOD, BAD)])
    assert scores == [[0.8], [0.2, 0.2]] and pol.calls == 1
    assert "Task: make 24" in pol.prompts[0] and "Act: 1 + 2" in pol.prompts[1]
    assert judge.usage["completion_tokens"] == 4


def test_judge_per_step_grades_each_prefix_once():
    pol = TextPolicy(["Score: 10", "Score: 4"])
    judge = LLMJudge(pol, per_step="all", aggregation="min")
    assert judge.score([_traj(GOOD, BAD)]) == [[1.0, 0.4]]
    assert judge.value([_traj(GOOD)]) == [1.0] and len(pol.prompts) == 2  # cached


def test_judge_parse_failure_marks_only_that_prefix():
    judge = LLMJudge(TextPolicy(["no idea", "Score: 6"]))
    scores = judge.score([_traj(GOOD), _traj(WIN)])
    assert isinstance(scores[0], JudgeParseError) and scores[1] == [0.6]
    values = judge.value([_traj(GOOD), _traj(WIN)])  # cached: same answers
    assert isinstance(values[0], JudgeParseError) and values[1] == 0.6
    with pytest.raises(JudgeParseError):
        LLMJudge(TextPolicy(["no idea"]), strict=True).score([_traj(GOOD)])


def test_judge_faults_are_recorded_by_the_engine_and_search_goes_on():
    judge = LLMJudge(TextPolicy(["nonsense"] * 100))
    tasks = om.load_tasks("game24", "test", limit=2)
    results = om.search_many(tasks, strategy="best_of_n:n=2", policy="scripted:oracle:p=0.3",
                             reward_model=judge)
    for r in results:
        assert r.spent["rm_calls"] == 2
        assert any(f.startswith("rm:") for f in r.faults)
        assert r.best is not None


def test_judge_refuses_policies_that_only_pick_actions():
    with pytest.raises(ValueError, match="does not answer free-form prompts"):
        make_reward_model("judge:scripted:oracle")
    with pytest.raises(ValueError, match="unknown option"):
        make_reward_model("judge:scripted:oracle;bogus=1")


def test_one_unparsable_judge_answer_faults_only_its_prefix_under_explicit_aggregation():
    judge = LLMJudge(TextPolicy(["nonsense"] + ["Score: 7"] * 500))
    task = om.load_tasks("game24", "test", limit=1)
    (r,) = om.search_many(task, strategy="beam:value=rm,agg=min", policy="scripted:oracle:p=0.3",
                          reward_model=judge, budget="rm_calls=12")
    faults = [f for f in r.faults if f.startswith("rm:")]
    scored = [n.score for n in r.tree.nodes if n.score is not None]
    assert len(faults) == 1 and scored.count(0.0) == 1
    assert scored.count(0.7) == len(scored) - 1 >= 2


def test_rewards_that_read_the_env_success_flag_the_verifier():
    task = om.load_tasks("game24", "test", limit=2)
    kw = dict(strategy="best_of_n:n=2", policy="scripted:oracle:p=0.3")
    assert all(r.verifier_in_loop for r in om.search_many(task, reward_model="rules:outcome=1", **kw))
    assert all(r.verifier_in_loop for r in om.search_many(task, reward_model="rules:env=1", **kw))
    assert not any(r.verifier_in_loop for r in om.search_many(task, reward_model="rules:format=1", **kw))


# --- the reward model's cost: a typed usage record, charged as rm_tokens -------------------------
def test_reward_models_report_usage_through_scored_and_the_engine_charges_it():
    from omrl_search.reward import RewardModel, Scored
    from omrl_search.types import Usage

    class Counted(RewardModel):
        """Scores 0.5 per step; says it ran 10 tokens a prefix, 4 of them from a cache."""

        def score(self, prefixes):
            return self.scored(prefixes).steps

        def scored(self, prefixes):
            return Scored([[0.5] * len(t.steps) for t in prefixes],
                          [Usage(prompt_tokens=10, cached_tokens=4)] * len(prefixes))

    rules = om.make_reward_model("rules:format=1")
    task = om.load_tasks("game24", "test", limit=1)[0]
    plain = om.search(task, strategy="beam:width=2,k=2,value=rm", policy="scripted:oracle:p=0.5",
                      reward_model=rules, seed=3)
    assert plain.spent["rm_calls"] > 0 and plain.spent["rm_tokens"] == 0  # rules run no network
    counted = om.search(task, strategy="beam:width=2,k=2,value=rm", policy="scripted:oracle:p=0.5",
                        reward_model=Counted(), seed=3)
    assert counted.spent["rm_tokens"] == 6 * counted.spent["rm_calls"] > 0  # prefill: 10 - 4


def test_a_generation_reports_the_same_usage_record():
    from omrl_search.types import Generation, Usage

    g = Generation("Act: x", [1, 2], [-0.1, -0.2], prompt_tokens=7, completion_tokens=2, cached_tokens=5)
    assert g.usage == Usage(prompt_tokens=7, completion_tokens=2, cached_tokens=5)
    assert g.usage.prefill_tokens == 2
