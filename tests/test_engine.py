"""The batched engine: determinism, lockstep batching, budgets, faults and exact token ids."""
from __future__ import annotations

import pytest

import omrl_search as om
from omrl_search.backends.scripted import OraclePolicy
from helpers import Recording
from omrl_search.env import ValueSnapshots, env_class
from omrl_search.types import StepResult

TASKS = om.load_tasks("game24", "test", limit=50)


def _summary(results):
    s = om.summarize(results)
    s.pop("seconds")
    return s


def test_seeded_scripted_runs_are_identical():
    a = om.search_many(TASKS, strategy="best_of_n:n=4", policy="scripted:oracle:p=0.3", seed=7)
    b = om.search_many(TASKS, strategy="best_of_n:n=4", policy="scripted:oracle:p=0.3", seed=7)
    assert _summary(a) == _summary(b)
    assert [r.to_dict()["tree"] for r in a] == [r.to_dict()["tree"] for r in b]
    c = om.search_many(TASKS, strategy="best_of_n:n=4", policy="scripted:oracle:p=0.3", seed=8)
    assert [r.to_dict()["tree"] for r in a] != [r.to_dict()["tree"] for r in c]


def test_best_of_n_at_least_react_on_50_game24_tasks():
    react = om.summarize(om.search_many(TASKS, strategy="react", policy="scripted:oracle:p=0.3"))
    bon = om.summarize(om.search_many(TASKS, strategy="best_of_n:n=8", policy="scripted:oracle:p=0.3"))
    assert react["tasks"] == bon["tasks"] == 50
    assert bon["success_rate"] >= react["success_rate"]
    assert 0 < react["success_rate"] < 1  # p=0.3 really errs, and really succeeds
    assert not bon["verifier_in_loop"]


def test_verifier_selection_is_flagged():
    results = om.search_many(TASKS[:5], strategy="best_of_n:n=4,select_by=verifier",
                             policy="scripted:oracle:p=0.3")
    assert all(r.verifier_in_loop for r in results)


def test_lockstep_one_policy_call_per_round():
    policy = Recording()
    results = om.search_many(TASKS[:20], strategy="react", policy=policy)
    depth = max(max(n.depth for n in r.tree.nodes) for r in results)
    assert len(policy.batches) == depth  # one call per depth for all 20 trees
    assert len(policy.batches[0]) == 20


def test_concurrency_window_gives_same_results():
    full = om.search_many(TASKS[:12], strategy="best_of_n:n=3", policy="scripted:oracle:p=0.3")
    windowed = om.search_many(TASKS[:12], strategy="best_of_n:n=3", policy="scripted:oracle:p=0.3",
                              concurrency=5)
    assert [r.to_dict()["tree"] for r in full] == [r.to_dict()["tree"] for r in windowed]


@pytest.mark.parametrize("strategy", ["react", "best_of_n:n=8"])
@pytest.mark.parametrize("kind,limit", [("tokens", 1000), ("lm_calls", 2), ("env_steps", 2),
                                        ("completion_tokens", 60), ("prompt_tokens", 900)])
def test_budget_overshoots_by_at_most_one_batch(strategy, kind, limit):
    policy = Recording(p=0.5)
    results = om.search_many(TASKS[:10], strategy=strategy, policy=policy,
                             budget={kind: limit}, max_depth=20)
    for r in results:
        spent = r.spent[kind]
        if spent < limit:
            assert r.stop_reason == "done"
            continue
        if r.stop_reason == "done":  # the batch that reached the limit also ended every branch
            assert all(n.terminal or n.status == "failed" for n in r.tree.leaves())
        else:
            assert r.stop_reason == f"budget:{kind}"
        # undo the last batch this tree took part in: it must have started under the limit
        last_depth = max(n.depth for n in r.tree.nodes)
        last = [n for n in r.tree.nodes if n.depth == last_depth]
        one_per_request = {n.parent: n for n in last}.values()
        prompt = sum(len(_prompt_ids(r, n)) for n in one_per_request)
        completion = sum(len(n.step.completion_ids) for n in last)
        batch = {"lm_calls": len(one_per_request), "env_steps": sum(n.step.valid for n in last),
                 "completion_tokens": completion, "prompt_tokens": prompt,
                 "tokens": prompt + completion}
        assert spent - batch[kind] < limit
    assert any(r.stop_reason == f"budget:{kind}" for r in results)  # the limit really bit


def _prompt_ids(result, node):
    """The prompt the policy saw when it produced ``node``'s step."""
    steps = result.tree.trajectory(node).steps
    ids = [t for s in steps for t in s.context_ids + s.completion_ids]
    return ids[:len(ids) - len(node.step.completion_ids)]


@pytest.fixture
def flaky_game24(monkeypatch):
    cls = env_class("game24")
    original = cls.step

    def step(self, action):
        if "-" in action:
            raise RuntimeError("simulated env crash")
        return original(self, action)

    monkeypatch.setattr(cls, "step", step)
    yield


def test_env_exception_marks_node_failed_and_search_goes_on(flaky_game24):
    results = om.search_many(TASKS[:20], strategy="best_of_n:n=4", policy="scripted:oracle:p=0.3")
    failed = [n for r in results for n in r.tree.nodes if n.status == "failed"]
    assert failed and all("simulated env crash" in n.error for n in failed)
    assert sum(len(r.faults) for r in results) == len(failed)
    assert om.summarize(results)["tasks"] == 20


class FlakyPolicy(OraclePolicy):
    """Fails every request whose task id is in ``bad`` (the batch call fails as a whole)."""

    def __init__(self, bad):
        super().__init__(0.0)
        self.bad = bad

    def generate(self, requests):
        if any(r.meta["task"].task_id in self.bad for r in requests):
            raise ConnectionError("simulated LM failure")
        return super().generate(requests)


def test_lm_failure_isolated_to_its_request():
    bad = {TASKS[1].task_id}
    results = om.search_many(TASKS[:6], strategy="react", policy=FlakyPolicy(bad))
    by_id = {r.task.task_id: r for r in results}
    assert by_id[TASKS[1].task_id].faults and not by_id[TASKS[1].task_id].success
    for t in TASKS[:6]:
        if t.task_id not in bad:
            assert by_id[t.task_id].success and not by_id[t.task_id].faults


def test_malformed_completion_becomes_invalid_step():
    results = om.search_many(TASKS[:10], strategy="react",
                             policy=OraclePolicy(0.0, malformed=0.5), max_depth=6)
    bad = [n.step for r in results for n in r.tree.nodes[1:] if not n.step.valid]
    assert bad and all(s.observation.startswith("Invalid format") for s in bad)
    assert all(not r.faults for r in results)


def test_segments_are_exactly_what_the_policy_saw():
    policy = Recording(p=0.3)
    results = om.search_many(TASKS[:5], strategy="react", policy=policy)
    seen = {}
    for batch in policy.batches:
        for req in batch:
            seen.setdefault(req.meta["task"].task_id, []).append(req.prompt_ids)
    for r in results:
        traj = r.best_trajectory
        segs = traj.segments()
        assert [s.role for s in segs][:2] == ["context", "assistant"]
        flat = [t for s in segs for t in s.token_ids]
        last_prompt = seen[r.task.task_id][-1]
        assert flat[:len(last_prompt)] == last_prompt
        assert flat[len(last_prompt):] == traj.steps[-1].completion_ids
        assert all(not s.trainable for s in segs if s.role == "context")
        assert all(s.logprobs is not None and len(s.logprobs) == len(s.token_ids)
                   for s in segs if s.trainable)


def test_rm_selection_uses_reward_model():
    results = om.search_many(TASKS[:10], strategy="best_of_n:n=4",
                             policy="scripted:oracle:p=0.3", reward_model="rules:outcome=1")
    for r in results:
        assert r.spent["rm_calls"] == 4
        scored = [n for n in r.tree.nodes if n.score is not None]
        assert len(scored) == 4
        assert r.success == any(n.success for n in scored)  # outcome RM picks a winner if any


def test_rm_selection_scores_the_chains_a_spent_token_budget_left():
    results = om.search_many(TASKS[:5], strategy="best_of_n:n=4,select_by=rm",
                             policy="scripted:oracle:p=0.3", reward_model="rules:format=1",
                             budget="tokens=1200")
    for r in results:
        assert r.stop_reason == "budget:tokens"
        leaves = [n for n in r.tree.leaves() if n.parent is not None]
        assert leaves and all(n.score is not None for n in leaves)
        assert r.spent["rm_calls"] == len(leaves)


# --- the env driver: truncation, restores --------------------------------------------------------
def _counting_game24(truncate_at=None):
    """Game24 envs that count restores and (optionally) cut every episode after ``truncate_at``
    steps, claiming success on the cut step (which must not count)."""
    cls = env_class("game24")
    restores = []

    class Counting(cls):
        def restore(self, snapshot):
            restores.append(snapshot.state_key)
            return super().restore(snapshot)

        def step(self, action):
            res = super().step(action)
            if truncate_at is not None and self.state.steps >= truncate_at and not res.terminated:
                return StepResult(res.observation, res.reward, terminated=False, truncated=True,
                                  info=res.info, success=True, valid=res.valid)
            return res

    return Counting, restores


def test_a_truncated_step_ends_its_branch_without_success():
    cls, _ = _counting_game24(truncate_at=1)
    results = om.search_many(TASKS[:6], strategy="best_of_n:n=3", policy="scripted:oracle:p=0.5",
                             env_factory=lambda name: cls())
    cut = [n for r in results for n in r.tree.nodes if n.error == "truncated"]
    assert cut and all(n.terminal and n.status == "terminal" and not n.success and not n.children
                       and n.step.done for n in cut)
    assert all(not r.success for r in results) and all(n.depth == 1 for r in results for n in r.tree.nodes[1:])


def test_the_depth_limit_ends_a_branch_the_env_did_not_end():
    """A child at ``max_depth`` whose episode goes on is terminal with the error "max depth" and
    a step that is not done; no node is deeper."""
    results = om.search_many(TASKS[:6], strategy="best_of_n:n=3", policy="scripted:oracle:p=0.5",
                             max_depth=2)
    kids = [n for r in results for n in r.tree.nodes[1:]]
    capped = [n for n in kids if n.error == "max depth"]
    assert capped and all(n.depth == 2 and n.terminal and n.status == "terminal" and not n.success
                          and not n.step.done and not n.children for n in capped)
    assert all(n.depth <= 2 for n in kids) and all(n.error != "max depth" for n in kids if n.depth < 2)


def test_the_env_is_restored_only_when_it_holds_another_state():
    cls, restores = _counting_game24()
    results = om.search_many(TASKS[:5], strategy="react", policy="scripted:oracle:p=0.3",
                             env_factory=lambda name: cls())
    assert restores == [] and sum(r.spent["env_steps"] for r in results) > 5  # a chain never restores
    results = om.search_many(TASKS[:5], strategy="best_of_n:n=3", policy="scripted:oracle:p=0.3",
                             env_factory=lambda name: cls())
    siblings = sum(len(r.tree.root.children) - 1 for r in results)
    assert len(restores) >= siblings > 0  # each further first step starts from the root again


def test_a_strategy_awaiting_something_else_loses_only_its_own_task():
    class Wrong(om.Strategy):
        name = "wrong"

        async def run(self, ctx):
            if ctx.task.task_id == TASKS[0].task_id:
                from omrl_search.ops import Op

                class NotAnOp(Op):
                    __slots__ = ("ctx",)

                    def __init__(self, ctx):
                        self.ctx = ctx

                await NotAnOp(ctx)
            await ctx.rollout([ctx.root])

        def select(self, ctx):
            return ctx.tree.nodes[-1]

        def spec(self):
            return "wrong"

    results = om.Engine(OraclePolicy(0.0)).run(Wrong(), TASKS[:3])
    assert results[0].stop_reason == "error" and "not an engine op" in results[0].faults[0]
    assert all(r.success and not r.faults for r in results[1:])
