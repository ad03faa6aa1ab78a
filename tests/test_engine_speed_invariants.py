"""The fast paths of the search's hot loop give exactly what the plain code gave.

Pins the equivalences the speed-ups rely on: the arithmetic env's number parsing and printing,
its cached observation, the engine's prompt ids, MCTS's backup along parent links and the
value sources' ``last`` shortcut.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction
from types import SimpleNamespace

import pytest

import omrl_search as om
from envs.arith import fmt, parse_number
from helpers import Recording, fake_ctx
from omrl_search.env import make_env, stable_hash
from omrl_search.reward import aggregate
from strategies.values import LogprobValue, step_prob


@pytest.mark.parametrize("token", ["0", "7", "-5", "13", "8/3", "-8/3", "4/2", "-0/5", "10/4",
                                   "0/7", "123456789/3", "\u0663"])
def test_number_tokens_read_like_fraction(token):
    assert parse_number(token) == Fraction(token) and type(parse_number(token)) is Fraction


@pytest.mark.parametrize("token", ["1/0", "-3/0"])
def test_zero_denominator_raises_like_fraction(token):
    with pytest.raises(ZeroDivisionError):
        Fraction(token)
    with pytest.raises(ZeroDivisionError):
        parse_number(token)


@pytest.mark.parametrize("x", [0, 24, -5, Fraction(8, 3), Fraction(-1, 3), Fraction(6, 2), True, 0.5])
def test_fmt_prints_like_a_fraction(x):
    assert fmt(x) == str(Fraction(x))


@pytest.mark.parametrize("name", ["game24", "countdown"])
def test_cached_observations_match_a_fresh_env(name):
    """Random play with restores: every observation (step, snapshot, observe) equals what an
    env that never saw the state before shows, and state keys are the plain hash."""
    rng = random.Random(0)
    env, fresh = make_env(name), make_env(name)
    for task in om.load_tasks(name, "test", limit=5):
        env.reset(task)
        snaps = [env.snapshot()]
        for _ in range(40):
            start = rng.choice(snaps)
            env.restore(start)
            assert env.observe() == start.observation
            actions = env.valid_actions() or ["answer 1 + 2"]
            res = env.step(rng.choice(actions + ["1 / 0", "99 * 99", "answer (1 + 2"]))
            snap = env.snapshot()
            fresh.restore(snap)
            assert snap.observation == env.observe() == fresh.observe()
            assert res.observation == snap.observation or start.payload.done
            assert snap.state_key == stable_hash(fresh.position())
            snaps.append(snap)


def test_prompt_ids_are_the_path_concatenation():
    """Each request's prompt is the ids recorded along its node's path plus the new turn."""
    policy = Recording(p=0.5)
    results = om.search_many(om.load_tasks("game24", "test", limit=3), policy=policy,
                             strategy="mcts:simulations=12,leaves=2,k=2,value=rollout")
    for r in results:
        expected = set()
        for node in r.tree.nodes:
            path = [t for n in r.tree.path(node)[1:] for t in n.step.context_ids + n.step.completion_ids]
            expected |= {tuple(path + r.tree.nodes[c].step.context_ids) for c in node.children}
        sent = [tuple(req.prompt_ids) for batch in policy.batches for req in batch
                if req.meta["task"] is r.task]
        assert sent and set(sent) <= expected


def test_mcts_backup_counts_every_simulation_at_the_root():
    results = om.search_many(om.load_tasks("game24", "test", limit=4), policy="scripted:oracle:p=0.5",
                             strategy="mcts:simulations=30,leaves=3,k=2,value=rollout", seed=1)
    for r in results:
        root = r.tree.root
        assert root.visits == sum(r.tree.nodes[c].visits for c in root.children) > 0
        for n in r.tree.nodes:
            assert 0.0 <= n.value_sum <= n.visits


@pytest.mark.parametrize("agg", ["last", "min", "mean", "prod"])
def test_value_sources_reduce_each_path_by_agg(agg):
    (result,) = om.search_many(om.load_tasks("game24", "test", limit=1), policy="scripted:oracle:p=0.5",
                               strategy="beam:width=2,k=2")
    nodes = result.tree.nodes
    ctx = fake_ctx(tree=result.tree)
    coro = LogprobValue(agg)(ctx, nodes)
    with pytest.raises(StopIteration) as done:  # logprob values never wait on the engine
        coro.send(None)
    want = [step_prob(n) if agg == "last" else
            aggregate([step_prob(m) for m in result.tree.path(n)[1:]], agg) for n in nodes]
    assert done.value.value == want


def test_logprob_values_of_failed_and_repeated_nodes():
    """``logprob`` with ``agg=last`` (computed, not cached): a failed node is 0, a node met twice
    in one call gets the same value, a node without logprobs (the root) 1."""
    from omrl_search.tree import FAILED, Node
    from omrl_search.types import Step

    def node(i, lps, status="open"):
        return Node(i, 0, 1, "", Step("c", "", "a", "", logprobs=lps), status=status)

    a, b, bad = node(1, [-0.5, -0.25]), node(2, None), node(3, [-0.1], FAILED)
    root = Node(0, None, 0, "")
    coro = LogprobValue("last")(fake_ctx(), [a, bad, a, b, root])
    with pytest.raises(StopIteration) as done:
        coro.send(None)
    assert done.value.value == [math.exp(-0.75), 0.0, math.exp(-0.75), 1.0, 1.0]


def test_a_value_source_values_each_key_once_in_first_seen_order():
    """``agg=last``: one ``step_values`` call per batch with the first node of each key not yet
    cached, in the order met; repeats read the cache; a failed node is 0 and never asked."""
    from omrl_search.tree import FAILED, Node
    from strategies.values import ValueSource

    asked = []

    class ByState(ValueSource):
        name, by_state = "probe", True

        async def step_values(self, ctx, nodes):
            asked.append([n.id for n in nodes])
            return [float(n.id) for n in nodes]

    def node(i, key, status="open"):
        return Node(i, 0, 1, "", state_key=key, status=status)

    def run(source, ctx, nodes):
        with pytest.raises(StopIteration) as done:
            source(ctx, nodes).send(None)
        return done.value.value

    ctx, source = fake_ctx(), ByState()
    first = [node(1, "x"), node(2, "y"), node(3, "x"), node(4, "z", FAILED), node(5, "y")]
    assert run(source, ctx, first) == [1.0, 2.0, 1.0, 0.0, 2.0]
    assert asked == [[1, 2]]
    assert run(source, ctx, [node(6, "w"), node(7, "x"), node(8, "w")]) == [6.0, 1.0, 6.0]
    assert asked == [[1, 2], [6]]


# --- the engine's per-node fast paths (issue 18) --------------------------------------------------
def test_every_completion_is_parsed_by_its_format(monkeypatch):
    """``Prompts.parse`` has one path: the format's own ``parse``, asked for every completion
    (ReAct's rendered form included), and the step carries the generation's ids and logprobs."""
    import omrl_search.agent as agent

    env = make_env("game24")
    task, tree = om.load_tasks("game24", "test", limit=1)[0], SimpleNamespace()
    texts = ["Think: try.\nAct: 3 + 4", " Think:  x y \nAct: 1 * 2 ", "Act: 3 + 4", "nothing"]

    def step_of(prompts, text):
        step, error = prompts.parse(om.Generation(text, [1, 2], [-0.5, -0.1], 3, 2), [7])
        assert (step.context_ids, step.completion_ids, step.logprobs) == ([7], [1, 2], [-0.5, -0.1])
        return step.completion, step.thought, step.action, error

    fmt = agent.ReActFormat()
    want = {t: (t, *(lambda p: (p.thought, p.action, p.error))(fmt.parse(t, env.action_help)))
            for t in texts}
    asked = []
    real = agent.ReActFormat.parse
    monkeypatch.setattr(agent.ReActFormat, "parse",
                        lambda self, text, help="": asked.append(text) or real(self, text, help))
    prompts = agent.ReActFormat().prompts(env, task, tree, None)
    assert [step_of(prompts, t) for t in texts] == [want[t] for t in texts]
    assert asked == texts


def test_request_seeds_are_the_plain_mix():
    from omrl_search.engine import mix_seed as _mix
    from omrl_search.ops import Seeds

    rng = random.Random(1)
    for _ in range(500):
        seed, node, call = rng.getrandbits(63), rng.randrange(10**6), rng.randrange(10**6)
        seeds = Seeds(seed)
        assert seeds.step(node, call) == _mix(seed, node, call)
        assert seeds.ask(node, call) == _mix(seed, "ask", node, call)


def test_a_run_leaves_the_garbage_collector_as_it_found_it():
    """The engine tunes no collector thresholds (issue 40: no per-node speed trick without a
    user-visible gain); a policy call sees the process's own settings."""
    import gc

    before = gc.get_threshold()
    seen = []
    policy = Recording()
    generate = policy.generate
    policy.generate = lambda reqs: (seen.append(gc.get_threshold()), generate(reqs))[1]
    om.search_many(om.load_tasks("game24", "test", limit=2), strategy="react", policy=policy)
    assert seen and all(t == before for t in seen) and gc.get_threshold() == before


def test_prompts_are_sorted_only_for_policies_that_share_prefixes():
    from omrl_search.engine import Engine

    class NoPrefix(Recording):
        shares_prefixes = False

    assert Engine(Recording()).prefix_order and not Engine(NoPrefix()).prefix_order
    assert not Engine(Recording(), prefix_order=False).prefix_order


def test_mcts_backup_of_sibling_runs_equals_one_walk_per_node():
    """The batched backup adds each value at each ancestor in the same order as one walk per
    node, so the floating-point sums are equal to the last bit."""
    from strategies.mcts import MCTS, MCTSState

    rng = random.Random(2)
    results = om.search_many(om.load_tasks("game24", "test", limit=3), policy="scripted:oracle:p=0.5",
                             strategy="beam:width=3,k=3")
    for r in results:
        nodes = r.tree.nodes
        pairs = [(rng.choice(nodes), rng.random() / 3) for _ in range(40)]
        pairs.sort(key=lambda p: p[0].parent if p[0].parent is not None else -1)  # sibling runs
        for n in nodes:
            n.visits, n.value_sum = 0, 0.0
        MCTS()._backup(fake_ctx(state=MCTSState(), tree=r.tree), pairs)
        got = [(n.visits, n.value_sum) for n in nodes]
        for n in nodes:
            n.visits, n.value_sum = 0, 0.0
        for node, v in pairs:
            while node is not None:
                node.visits += 1
                node.value_sum += v
                node = nodes[node.parent] if node.parent is not None else None
        assert got == [(n.visits, n.value_sum) for n in nodes]


def test_mcts_values_a_finished_leaf_once():
    """A finished leaf chosen again is backed up with its first value, not valued again."""
    from omrl_search.engine import Engine
    from omrl_search.backends.scripted import OraclePolicy
    from strategies.mcts import MCTS

    class Counting:
        name = "counting"

        def __init__(self):
            self.asked = []

        async def __call__(self, ctx, nodes):
            self.asked += [(ctx.task.task_id, n.id) for n in nodes]
            return [1.0 if n.success else 0.25 for n in nodes]

    value = Counting()
    results = Engine(OraclePolicy(0.5), seed=0).run(
        MCTS(simulations=150, leaves=3, k=2, value=value), om.load_tasks("game24", "test", limit=4))
    assert len(value.asked) == len(set(value.asked))  # no node valued twice
    for r in results:
        finished = [n for n in r.tree.nodes if n.terminal and n.visits > 1]
        assert finished  # chosen again (backed up more than once)...
        assert r.tree.root.visits == sum(r.tree.nodes[c].visits for c in r.tree.root.children)


@pytest.mark.parametrize("strategy", ["mcts:simulations=12,leaves=2,k=2,value=rollout,reflect=true",
                                      "tot:b=2,k=2", "dfsdt"])
def test_a_policy_that_reads_ids_only_gets_the_same_prompt_ids_and_trees(strategy):
    """``reads_messages = False``: step requests carry no chat messages (ask prompts still do),
    and the prompt ids, the recorded context ids and the trees are those of a chat reader."""

    class IdsOnly(Recording):
        reads_messages = False

    tasks = om.load_tasks("game24", "test", limit=3)
    chat, ids = Recording(p=0.5), IdsOnly(p=0.5)
    a = om.search_many(tasks, policy=chat, strategy=strategy, seed=2)
    b = om.search_many(tasks, policy=ids, strategy=strategy, seed=2)
    assert [r.to_dict()["tree"] for r in a] == [r.to_dict()["tree"] for r in b]
    sent = [[(q.prompt_ids, q.params.seed) for q in batch] for batch in chat.batches]
    assert sent == [[(q.prompt_ids, q.params.seed) for q in batch] for batch in ids.batches]
    steps = [q for batch in ids.batches for q in batch if not q.meta.get("ask")]
    roots = {id(r.tree.root.snapshot) for r in b}
    later = [q for q in steps if id(q.meta["snapshot"]) not in roots]
    assert later and all(q.messages == [] for q in later)  # only a root's request has its chat
    assert all(q.messages for batch in chat.batches for q in batch)


def test_the_overhead_benchmarks_timed_env_changes_no_search():
    """``benchmarks/engine_overhead.py``'s in-search env timing (``TimedGame24Env``) grows the
    same trees as the plain env and charges the env a positive share of the run."""
    from envs.game24 import Game24Env
    from helpers import load_script
    from omrl_search.engine import Engine

    eo = load_script("benchmarks/engine_overhead.py")
    tasks = om.load_tasks("game24", "test", limit=4)
    strategy = "tot:method=dfs,k=3,evaluator=logprob"

    def trees(env_cls):
        results = Engine(eo.ZeroCostPolicy(), seed=0, env_factory=lambda _: env_cls()).run(
            om.make_strategy(strategy), tasks)
        return [[(n.parent, n.step.action if n.step else None, n.state_key, n.status)
                 for n in r.tree.nodes] for r in results]

    eo.TimedGame24Env.seconds = 0.0
    assert trees(eo.TimedGame24Env) == trees(Game24Env)
    assert eo.TimedGame24Env.seconds > 0
    row = eo.measure("dfs", strategy, tasks, profile=False)
    assert row["env_in_search_s"] > 0 and "engine_us_per_node_in_search" in row


def test_well_formed_keeps_exactly_the_generations_with_sound_fields():
    """``well_formed`` checks every field of every generation (one path, no fast check): numpy
    scalars count as numbers, bools and negatives do not; what it drops it says why."""
    import numpy as np

    import omrl_search.batching as batching
    from omrl_search.types import Generation

    fields = {  # each field's variants: (value, sound)
        "text": [("Act: x", True), (b"Act: x", False), (None, False)],
        "token_ids": [([1, 2], True), ([], True), (None, True), ((1, 2), True), ([1, True], False),
                      ([1, -2], False), ([np.int64(3)], True), ([1.0], False), ("12", False)],
        "logprobs": [([-0.5, -1], True), ([], True), (None, True), ((-0.5,), True),
                     ([np.float32(-1)], True), ([None], False), (["x"], False), ([True], False),
                     ([float("nan")], False), ([float("inf")], False), ([float("-inf")], True)],
        "prompt_tokens": [(3, True), (0, True), (-1, False), (2.0, False), (True, False),
                          (np.int64(4), True)],
        "completion_tokens": [(2, True), (0, True), (-3, False), (None, False)],
    }
    base = {"text": "Act: x", "token_ids": [1, 2], "logprobs": [-0.5, -1.0],
            "prompt_tokens": 3, "completion_tokens": 2}
    cases = [(Generation(**{**base, name: value}), sound)
             for name, values in fields.items() for value, sound in values]
    cases += [(SimpleNamespace(**base), False), ("Act: x", False)]
    kept, why = batching.well_formed([g for g, _ in cases], len(cases))
    assert [any(k is g for k in kept) for g, _ in cases] == [sound for _, sound in cases]
    assert len(why) == sum(not sound for _, sound in cases) and all(why)


def test_a_search_rng_made_on_first_use_draws_from_the_search_seed():
    """``SearchContext.rng`` is made when a strategy first reads it: ``random.Random`` of the
    search's seed, one per search, so two runs with one engine seed draw alike and two tasks
    draw apart; the result names the strategy's spec as before."""
    from omrl_search.engine import Engine
    from omrl_search.strategy import Strategy

    class Draws(Strategy):
        name = "draws"

        async def run(self, ctx):
            ctx.scratch["draws"] = [ctx.rng.random() for _ in range(3)]
            assert ctx.rng is ctx.rng
            ctx.scratch["want"] = [random.Random(ctx.seed).random() for _ in range(1)]
            await ctx.expand([ctx.root], 1)

        def select(self, ctx):
            assert ctx.scratch["draws"][0] == ctx.scratch["want"][0]
            draws.append(ctx.scratch["draws"])
            return ctx.root

        def spec(self):
            return "draws"

    draws: list = []
    tasks = om.load_tasks("game24", "test", limit=2)
    for _ in range(2):
        results = Engine(om.make_policy("scripted:random"), seed=5).run(Draws(), tasks)
        assert [r.strategy for r in results] == ["draws", "draws"] and not results[0].faults
    assert draws[:2] == draws[2:] and draws[0] != draws[1]
