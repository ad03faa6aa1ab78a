"""Engine guards: malformed policy answers, hung LM calls, caps on nodes and faults, and a
MemoryError in one task are faults of that node or search, never an exception out of the run."""
from __future__ import annotations

import threading
import time

import pytest

import omrl_search as om
from omrl_search.agent import ReActFormat
from omrl_search.backends.scripted import OraclePolicy
from omrl_search.batching import LMTimeout, well_formed
from omrl_search.budget import Budget
from omrl_search.engine import DEFAULT_MAX_FAULTS, DEFAULT_MAX_NODES, Engine
from omrl_search.prompts import Prompts
from omrl_search.types import Generation

TASKS = om.load_tasks("game24", "test", limit=4)
STRATEGIES = ["react", "best_of_n:n=3", "beam:width=2,k=2", "tot", "tot:method=dfs", "got", "dfsdt",
              "mcts:simulations=8,leaves=2,k=2", "mcts:widen=0.5,reflect=true,simulations=6"]


def _gen(**kw):
    base = dict(text="Think: x\nAct: 1 + 2", token_ids=[1, 2], logprobs=[-0.1, -0.2],
                prompt_tokens=5, completion_tokens=2)
    base.update(kw)
    return Generation(**base)


#: one malformed answer per kind the guards name, and the fault text each gives
BROKEN = [
    (lambda n: None, "not a list of generations"),
    (lambda n: [None] * n, "a NoneType instead of a Generation"),
    (lambda n: [_gen(text=None)] * n, "generation text is NoneType, not str"),
    (lambda n: [_gen(text=b"Act: 1 + 2")] * n, "generation text is bytes, not str"),
    (lambda n: [_gen(prompt_tokens="5")] * n, "generation usage is not token counts"),
    (lambda n: [_gen(completion_tokens=2.5)] * n, "generation usage is not token counts"),
    (lambda n: [_gen(token_ids=["a", "b"])] * n, "generation token_ids are not a list of token ids"),
    (lambda n: [_gen(logprobs=["x"])] * n, "generation logprobs are not a list of numbers"),
    (lambda n: [], "policy gave 0 generations for n="),
]


class Broken(OraclePolicy):
    """The oracle, except that every third request gets a malformed answer (cycling through
    :data:`BROKEN`) and every seventh raises."""

    def __init__(self, p=0.3):
        super().__init__(p)
        self.count = 0

    def generate(self, requests):
        good = iter(super().generate(requests))
        out = []
        for req in requests:
            mine = next(good)
            self.count += 1
            if req.params.seed % 7 == 0:
                raise RuntimeError("the backend fell over")
            if self.count % 3 == 0:
                make, _ = BROKEN[(self.count // 3) % len(BROKEN)]
                mine = make(req.params.n)
            out.append(mine)
        return out


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_malformed_answers_are_faults_of_their_node_in_every_strategy(strategy):
    results = om.search_many(TASKS, strategy=strategy, policy=Broken(), budget={"env_steps": 40},
                             seed=1, reward_model="rules:format=0.2,outcome=1")
    assert len(results) == len(TASKS)
    faults = [f for r in results for f in r.faults]
    assert faults and all(f.startswith("lm: ") for f in faults), faults
    assert all(r.stop_reason != "error" for r in results)
    assert sum(len(r.tree.nodes) for r in results) > len(TASKS)  # the searches went on


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_policy_that_only_fails_ends_every_strategy_without_a_budget(strategy):
    class Dead(OraclePolicy):
        def generate(self, requests):
            return [None for _ in requests]

    results = Engine(Dead(), max_faults=50).run(om.make_strategy(strategy), TASKS[:2])
    for r in results:
        assert r.stop_reason in ("done", "cap:faults=50")
        assert 0 < len(r.faults) <= 50 + 8  # at most one batch past the cap
        assert r.faults[0] == "lm: policy answered a request with NoneType, not a list of generations"


@pytest.mark.parametrize("make, why", BROKEN)
def test_well_formed_names_what_is_wrong(make, why):
    good, problems = well_formed(make(2), 2)
    assert good == [] and any(why in p for p in problems), problems
    ok = [_gen(), _gen(token_ids=None, logprobs=None)]
    assert well_formed(ok, 2) == (ok, [])
    assert well_formed(ok, 3) == (ok, ["policy gave 2 generations for n=3"])
    assert well_formed(ok + ok, 3) == (ok + ok[:1], ["policy gave 4 generations for n=3"])


def test_short_answers_keep_the_good_generations_and_count_a_fault():
    class Short(OraclePolicy):
        def generate(self, requests):
            return [gens[:1] for gens in super().generate(requests)]

    [r] = om.search_many(TASKS[:1], strategy="best_of_n:n=4", policy=Short(), seed=0)
    assert r.faults[0] == "lm: policy gave 1 generations for n=4"
    assert len(r.tree.root.children) == 1


def test_wrong_number_of_results_fails_each_request_alone():
    class Skewed(OraclePolicy):
        max_batch = 8

        def generate(self, requests):
            out = super().generate(requests)
            return out[:-1] if len(requests) > 1 else out

    results = om.search_many(TASKS, strategy="beam:width=2,k=2", policy=Skewed(), seed=0,
                             budget={"env_steps": 20})
    assert all(not r.faults for r in results)  # retried one by one, each answered


# --- hung LM calls -------------------------------------------------------------------------------
class Hanging(OraclePolicy):
    """Hangs (until released) on the requests ``hang(request)`` picks."""

    def __init__(self, hang, p=0.3):
        super().__init__(p)
        self.hang, self.release, self.calls = hang, threading.Event(), 0

    def generate(self, requests):
        self.calls += 1
        if any(self.hang(r) for r in requests):
            self.release.wait(30)
        return super().generate(requests)


def test_a_hung_call_ends_the_search_on_time():
    pol = Hanging(lambda r: True)
    try:
        t0 = time.perf_counter()
        [r] = om.search_many(TASKS[:1], strategy="react", policy=pol, budget={"seconds": 0.5})
        took = time.perf_counter() - t0
    finally:
        pol.release.set()
    assert took < 2.0 and r.stop_reason in ("done", "budget:seconds")
    assert r.faults and r.faults[0].startswith("lm: LMTimeout: LM call abandoned after")
    assert r.spent["lm_calls"] == 1


def test_lm_timeout_abandons_one_call_and_the_search_goes_on():
    hung = []

    def hang(req):  # the first request of the second task's root hangs once
        if req.meta["task"].task_id == TASKS[1].task_id and not hung:
            hung.append(req)
            return True
        return False

    pol = Hanging(hang, p=0.0)
    try:
        t0 = time.perf_counter()
        results = Engine(pol, lm_timeout=0.3, seed=0).run(om.make_strategy("react"), TASKS[:3],
                                                           concurrency=1)
        took = time.perf_counter() - t0
    finally:
        pol.release.set()
    assert took < 5.0
    assert [len(r.faults) for r in results] == [0, 1, 0]
    assert results[1].faults[0].startswith("lm: LMTimeout")
    assert results[0].success and results[2].success  # the others are untouched


def test_only_the_searches_past_their_deadline_lose_a_shared_call(monkeypatch):
    """Two trees share one call that runs 0.6 s: the one with seconds=0.3 gives up on it at its
    deadline, the unlimited one waits and gets its answer."""
    class Slow(OraclePolicy):
        def generate(self, requests):
            time.sleep(0.6)
            return super().generate(requests)

    budgets = iter([Budget({"seconds": 0.3}), Budget()])  # the first task's, the second's
    monkeypatch.setattr(Budget, "fresh", lambda self: next(budgets))
    t0 = time.perf_counter()
    results = Engine(Slow(0.0), schedule="lockstep", seed=0).run(om.make_strategy("react"), TASKS[:2])
    fault = results[0].faults[0]  # abandoned after what was left of its 0.3 s (less under load)
    assert fault.startswith("lm: LMTimeout: LM call abandoned after ")
    assert 0.0 < float(fault.split("after ")[1].split("s:")[0]) <= 0.3
    assert results[0].seconds < 0.5
    assert not results[1].faults and results[1].success and results[1].spent["lm_calls"] >= 2
    assert time.perf_counter() - t0 >= 0.6 * results[1].spent["lm_calls"]


def test_streaming_collect_that_hangs_is_abandoned():
    class Stream(OraclePolicy):
        streams = True

        def __init__(self):
            super().__init__(0.0)
            self.queue, self.release = [], threading.Event()

        def submit(self, tickets):
            self.queue += tickets

        def collect(self):
            self.release.wait(30)
            take, self.queue = self.queue, []
            return [(t, self.generate([r])[0]) for t, r in take]

    pol = Stream()
    try:
        t0 = time.perf_counter()
        [r] = om.search_many(TASKS[:1], strategy="react", policy=pol, budget={"seconds": 0.4})
        took = time.perf_counter() - t0
    finally:
        pol.release.set()
    assert took < 2.0 and r.faults[0].startswith("lm: LMTimeout")


def test_lm_timeout_is_checked():
    for bad in (0, -1, float("nan"), float("inf"), "3", True):
        with pytest.raises(ValueError, match="lm_timeout must be a positive number"):
            Engine(OraclePolicy(), lm_timeout=bad)
    assert issubclass(LMTimeout, Exception)


# --- caps ----------------------------------------------------------------------------------------
def test_default_caps_and_a_node_cap_as_stop_reason():
    eng = Engine(OraclePolicy())
    assert (eng.max_nodes, eng.max_faults) == (DEFAULT_MAX_NODES, DEFAULT_MAX_FAULTS) == (20_000, 1_000)
    tasks = om.load_tasks("sokoban", "test", limit=2)
    results = Engine(OraclePolicy(0.9), max_nodes=40, seed=0).run(
        om.make_strategy("dfsdt:width=4"), tasks)  # no budget: dfsdt alone would run long
    for r in results:
        assert r.stop_reason == "cap:nodes=40" or r.success
        assert len(r.tree.nodes) <= 40 + 1
    assert any(r.stop_reason == "cap:nodes=40" for r in results)


# --- a MemoryError in one task -------------------------------------------------------------------
def test_a_memory_error_is_its_own_tasks_fault():
    """Building one task's children runs out of memory: that task ends with the fault."""
    class BombPrompts(Prompts):
        __slots__ = ()

        def parse(self, gen, context_ids):
            raise MemoryError("out of memory building children")

    class Bomb(ReActFormat):
        def prompts(self, env, task, tree, encoder):
            cls = BombPrompts if task.task_id == TASKS[1].task_id else Prompts
            return cls(self, encoder, env, task, tree)

    results = Engine(OraclePolicy(0.0), agent_format=Bomb(), seed=0).run(
        om.make_strategy("best_of_n:n=2"), TASKS[:3])
    assert results[1].stop_reason == "error"
    assert results[1].faults == ["engine: MemoryError: out of memory building children"]
    assert results[0].success and results[2].success and not results[0].faults


def test_a_memory_error_in_a_strategy_is_its_own_tasks_fault():
    from dataclasses import dataclass

    from omrl_search.strategy import Strategy

    @dataclass
    class Hog(Strategy):
        name = "hog"

        async def run(self, ctx):
            if ctx.task.task_id == TASKS[0].task_id:
                raise MemoryError
            await ctx.rollout([ctx.root], temperature=0.0)

    results = Engine(OraclePolicy(0.0)).run(Hog(), TASKS[:2])
    assert results[0].faults == ["strategy: MemoryError: "] and results[0].stop_reason == "error"
    assert results[1].success


def test_a_search_that_cannot_start_is_its_own_tasks_fault():
    class NoPrompts(ReActFormat):
        def prompts(self, env, task, tree, encoder):
            if task.task_id == TASKS[0].task_id:
                raise MemoryError("no room for prompts")
            return super().prompts(env, task, tree, encoder)

    results = Engine(OraclePolicy(0.0), agent_format=NoPrompts()).run(om.make_strategy("react"), TASKS[:2])
    assert results[0].faults == ["engine: MemoryError: no room for prompts"]
    assert results[0].stop_reason == "error" and results[1].success


@pytest.mark.slow
def test_unbudgeted_dfsdt_stops_at_the_default_node_cap_in_bounded_memory():
    """The run that once grew one Sokoban tree to 1.08 million nodes (~7.5 GB): with no budget,
    every tree now stops at the default cap, and the process stays far below that memory."""
    import resource

    tasks = om.load_tasks("sokoban", "test", limit=3)
    results = om.search_many(tasks, strategy="dfsdt", policy="scripted:random", seed=0)
    capped = [r for r in results if r.stop_reason == f"cap:nodes={DEFAULT_MAX_NODES}"]
    assert capped, [r.stop_reason for r in results]
    assert all(len(r.tree.nodes) <= DEFAULT_MAX_NODES + 1 for r in results)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert peak_mb < 2048, f"peak RSS {peak_mb:.0f} MB"
