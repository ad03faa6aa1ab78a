"""Each search strategy's defining behaviour, pinned with scripted policies on Game24."""
from __future__ import annotations

import re
from fractions import Fraction

import networkx as nx

import omrl_search as om
from envs.arith import solvable
from omrl_search.backends.scripted import OraclePolicy
from helpers import Recording
from omrl_search.types import Generation
from strategies.tot import TreeOfThoughts
from strategies.values import step_prob

TASKS = om.load_tasks("game24", "test", limit=20)


def _numbers(node) -> list[Fraction]:
    m = re.search(r"Numbers left: ([^|]*)\|", node.observation)
    return [Fraction(x) for x in m.group(1).split()] if m else []


def _solvable(node) -> bool:
    nums = _numbers(node)
    return bool(nums) and not (node.terminal and not node.success) and solvable(nums, 24)


class TrapPolicy(Recording):
    """The exact oracle, except that the very first step it writes for each task leads to a
    state from which 24 can no longer be made."""

    def __init__(self):
        super().__init__(0.0)
        self.trapped: set[str] = set()

    def generate(self, requests):
        out = super().generate(requests)
        for req, gens in zip(requests, out):
            tid = req.meta["task"].task_id
            if tid not in self.trapped and not req.meta.get("ask"):
                self.trapped.add(tid)
                env = self._env_for(req.meta)
                bad = next(a for a in env.valid_actions() if not self._ok_after(env, req, a))
                text = self.completion("A tempting first step.", bad)
                ids = self.tokenizer.encode(text) + [256]
                gens[0] = Generation(text, ids, [-0.01] * len(ids), gens[0].prompt_tokens, len(ids))
        return out

    def _ok_after(self, env, req, action):
        env.restore(req.meta["snapshot"])
        env.step(action)
        ok = env.expert_action() is not None
        env.restore(req.meta["snapshot"])
        return ok


class Judge(Recording):
    """The oracle that also answers ToT value prompts: 'sure' where 24 is still reachable."""

    answers_prompts = True

    def generate(self, requests):
        self.batches.append(requests)
        out = []
        for req in requests:
            if not req.meta.get("ask"):
                out += OraclePolicy.generate(self, [req])
                continue
            env = self._env_for(req.meta)
            s = env.state
            if "List " in req.messages[-1]["content"]:  # a ToT proposal prompt
                acts = [env.expert_action()] + [a for a in env.valid_actions() if a != env.expert_action()][:3]
                text = "Here are options:\n" + "\n".join(f"{i}. Act: {a}" for i, a in enumerate(acts, 1))
            else:
                word = "sure" if s.success or (not s.done and env.expert_action()) else "impossible"
                text = f"Judgement: {word}"
            ids = self.tokenizer.encode(text)
            out.append([Generation(text, ids, None, 50, len(ids))] * req.params.n)
        return out


class SolvableValue:
    """A test evaluator: 1 where 24 is still reachable; the first root child (a trap) looks
    good too, so a depth-first search goes there first and must back out."""

    name = "solvable"

    async def __call__(self, ctx, nodes):
        return [1.0 if n.id == 1 or _solvable(n) else 0.0 for n in nodes]


# --- ToT ----------------------------------------------------------------------------------------
def test_tot_bfs_keeps_exactly_b_states_per_depth():
    results = om.search_many(TASKS, strategy="tot:b=2,k=4,dedup=state,zero_repeats=false",
                             policy="scripted:oracle:p=0.6")
    checked = 0
    for r in results:
        for depth in range(1, max(n.depth for n in r.tree.nodes) + 1):
            level = [n for n in r.tree.nodes if n.depth == depth and n.error != "duplicate state"]
            kept = [n for n in level if n.status != "pruned"]
            dropped = [n for n in level if n.error == "not in the b best"]
            assert len(kept) == min(2, len(kept) + len(dropped))
            if dropped:  # the kept ones are the best by the evaluator (here: the step's probability)
                assert min(map(step_prob, kept)) >= max(map(step_prob, dropped))
            checked += bool(dropped)
    assert checked >= 10  # the breadth really cut candidates


def test_tot_dfs_backtracks_out_of_a_failed_first_branch():
    policy = TrapPolicy()
    strat = TreeOfThoughts(method="dfs", k=3, evaluator=SolvableValue())
    results = om.search_many(TASKS[:8], strategy=strat, policy=policy)
    for r in results:
        trap = r.tree.nodes[1]
        assert not _solvable(trap) and trap.children  # it went down the trap first ...
        assert all(r.tree.nodes[c].status == "pruned" for c in trap.children)
        assert r.success and 1 not in r.best_trajectory.to_dict()["node_ids"]  # ... and out


def test_tot_lm_evaluator_scores_each_state_once_in_the_expansion_batches():
    policy = Judge(p=0.5)
    results = om.search_many(TASKS, strategy="tot:evaluator=lm,n_evaluate=3,b=2", policy=policy)
    asks = [req for batch in policy.batches for req in batch if req.meta.get("ask")]
    assert asks and all(req.params.n == 3 for req in asks)
    keys = [(req.meta["task"].task_id, req.meta["snapshot"].state_key) for req in asks]
    assert len(keys) == len(set(keys))  # a duplicate state is never scored twice
    react = om.search_many(TASKS, strategy="react", policy=Judge(p=0.5))
    assert sum(r.success for r in results) >= sum(r.success for r in react) + 8  # it steers
    assert not any(r.verifier_in_loop for r in results)


def test_tot_propose_prompt_proposer_applies_the_listed_steps():
    policy = Judge(p=0.0)
    results = om.search_many(TASKS[:6], strategy="tot:proposer=propose,evaluator=lm,k=3,b=1", policy=policy)
    assert all(req.meta.get("ask") for batch in policy.batches for req in batch)  # no sampling
    for r in results:
        assert r.success and not r.faults
        assert len(r.tree.nodes[0].children) == 3  # k of the listed steps were applied
        assert r.spent["env_steps"] == sum(1 for n in r.tree.nodes[1:])


def test_lm_evaluator_falls_back_explicitly():
    auto = om.search_many(TASKS[:3], strategy="tot", policy=Recording())  # auto: logprob
    assert all(not r.faults for r in auto)
    explicit = om.search_many(TASKS[:3], strategy="tot:evaluator=lm", policy=Recording())
    assert all(r.stop_reason == "error" and "free-form prompts" in r.faults[0] for r in explicit)


# --- DFSDT --------------------------------------------------------------------------------------
def test_dfsdt_backtracks_and_shows_tried_siblings():
    policy = TrapPolicy()
    results = om.search_many(TASKS[:8], strategy="dfsdt:width=2", policy=policy)
    for r in results:
        assert r.success and r.verifier_in_loop
        root_kids = r.tree.nodes[0].children
        assert len(root_kids) == 2 and r.best_trajectory.nodes[1].id == root_kids[1]
        assert r.tree.nodes[root_kids[0]].children  # the first branch was explored to its end
    notes = [req for batch in policy.batches for req in batch
             if "earlier attempts did not succeed" in req.messages[-1]["content"]]
    assert len(notes) >= 8


def test_dfsdt_backs_up_two_levels_from_a_lost_ending():
    """ToolBench's prune_back_length: after a lost ending, its parent gets no second child."""
    for back, seconds in ((2, 0), (1, 8)):
        results = om.search_many(TASKS[:8], strategy=f"dfsdt:width=2,back={back}", policy=TrapPolicy())
        assert all(r.success for r in results)
        # how many first depth-2 nodes (under the trap) were given a second child
        firsts = [r.tree.nodes[r.tree.nodes[1].children[0]] for r in results]
        assert sum(len(n.children) > 1 for n in firsts) == seconds, back


def test_dfsdt_stop_answer_stops_at_the_first_answer_unchecked():
    """ToolBench stops at the model's first final answer, right or wrong; no verifier."""
    results = om.search_many(TASKS[:8], strategy="dfsdt:stop=answer", policy=TrapPolicy())
    for r in results:
        assert not r.success and not r.verifier_in_loop  # the trap's answer ends the search
        assert [n.depth for n in r.tree.nodes] == list(range(len(r.tree.nodes)))  # one chain
        assert r.best_trajectory.nodes[-1] is r.tree.nodes[-1] and r.tree.nodes[-1].terminal
    assert om.make_strategy("dfsdt").verifier_in_loop
    for bad in ("dfsdt:stop=first", "dfsdt:back=0", "dfsdt:dedup=all"):
        try:
            om.make_strategy(bad)
        except ValueError:
            continue
        raise AssertionError(bad)


# --- GoT ----------------------------------------------------------------------------------------
def test_got_aggregates_have_several_parents_and_the_graph_is_a_dag():
    results = om.search_many(TASKS, strategy="got", policy="scripted:oracle:p=0.5")
    merged = 0
    for r in results:
        g = r.tree.graph
        assert nx.is_directed_acyclic_graph(g)
        for v in g.nodes:
            parents = list(g.predecessors(v))
            if len(parents) > 1:
                merged += 1
                assert r.tree.nodes[v].parent in parents
                assert all(g.edges[u, v].get("merge") for u in parents if u != r.tree.nodes[v].parent)
    assert merged >= len(results)


def test_got_refine_graph_runs_and_validates():
    results = om.search_many(TASKS[:5], strategy="got:graph=generate:2>score>keep_best:2>refine>score>keep_best:1",
                             policy="scripted:oracle:p=0.5")
    assert all(any(d.get("merge") for *_, d in r.tree.graph.edges(data=True)) for r in results)
    for bad in ("generate:0", "score>keep_best:2", "jump:3"):
        try:
            om.make_strategy(f"got:graph={bad}")
        except ValueError:
            continue
        raise AssertionError(bad)


def test_got_keep_best_hands_on_thoughts_best_first():
    """GoT's KeepBestN sorts by score, best first: the next generate expands in that order."""
    from strategies.got import GraphOfThoughts

    class ByPosition:
        name = "by_position"

        async def __call__(self, ctx, nodes):
            table = {1: 0.2, 2: 0.5, 3: 0.9}
            return [table.get(n.id, 0.0) for n in nodes]

    strat = GraphOfThoughts(graph="generate:3>score>keep_best:2", value=ByPosition(), dedup="none")
    (r,) = om.search_many(TASKS[:1], strategy=strat, policy="scripted:oracle:p=0.5")
    depth1 = sorted((n for n in r.tree.nodes if n.depth == 1 and n.children), key=lambda n: n.children[0])
    assert [n.id for n in depth1] == [3, 2] and r.tree.nodes[1].status == "pruned"


# --- MCTS ---------------------------------------------------------------------------------------
def test_mcts_visit_counts_add_up():
    results = om.search_many(TASKS, strategy="mcts:leaves=4,widen=0.5", policy="scripted:oracle:p=0.5")
    for r in results:
        nodes = r.tree.nodes
        own = {n.id: n.visits - sum(nodes[c].visits for c in n.children) for n in nodes}
        assert all(v >= 0 for v in own.values())  # no virtual loss left behind
        assert own[0] == 0 and sum(own.values()) == nodes[0].visits > 0
        assert all(0.0 <= n.value <= 1.0 for n in nodes)


def test_mcts_with_a_single_path_is_greedy():
    kw = dict(policy="scripted:oracle:p=0.3", reward_model="rules:outcome=1")
    react = om.search_many(TASKS, strategy="react", **kw)
    mcts = om.search_many(TASKS, strategy="mcts:k=1,value=rm", **kw)
    for a, b in zip(react, mcts):
        assert [(n.parent, n.step and n.step.completion) for n in a.tree.nodes] == \
               [(n.parent, n.step and n.step.completion) for n in b.tree.nodes]
        assert a.best == b.best and a.success == b.success


def test_mcts_virtual_loss_expands_many_leaves_in_one_call():
    def widest(leaves):
        policy = Recording(p=0.5)
        om.search_many(TASKS[:1], strategy=f"mcts:leaves={leaves},value=rm,priors=uniform", policy=policy,
                       reward_model="rules:format=0.2,outcome=1", budget="lm_calls=12")
        return max(len(batch) for batch in policy.batches)

    assert widest(1) == 1
    assert widest(4) >= 3


def test_mcts_reflections_reach_later_prompts():
    policy = Recording(p=0.6)
    results = om.search_many(TASKS[:5], strategy="mcts:reflect=true", policy=policy)
    prompts = [req.messages[-1]["content"] for batch in policy.batches for req in batch]
    assert any("Reflections on earlier failed attempts" in p for p in prompts)
    assert all(r.verifier_in_loop for r in results)


def test_mcts_priors_follow_policy_logprobs():
    results = om.search_many(TASKS[:10], strategy="mcts:k=4", policy="scripted:oracle:p=0.3")
    for r in results:
        kids = [r.tree.nodes[c] for c in r.tree.nodes[0].children if r.tree.nodes[c].status != "pruned"]
        assert abs(sum(k.prior for k in kids) - 1) < 1e-9
        expert = [k for k in kids if k.step.thought != "Trying another step."]  # the oracle explains its expert move
        if expert and len(kids) > 1:
            assert max(kids, key=lambda k: k.prior) is expert[0]
