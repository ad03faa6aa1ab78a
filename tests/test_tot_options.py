"""ToT as published (Yao et al. 2023, BFS for Game of 24), option by option: each test runs a
seeded search with a scripted policy that writes given steps, proposal lists and verdicts, and
pins the frontier ToT selects and the order it expands it in (docs/strategies.md, ``tot``)."""
from __future__ import annotations

import asyncio
import random
import re

import pytest

import omrl_search as om
from omrl_search.backends.scripted import ScriptedPolicy
from omrl_search.tree import DUPLICATE, Node
from omrl_search.types import Generation
from helpers import fake_ctx
from strategies.tot import TreeOfThoughts
from strategies.values import (PAPER_MAPPING, LMValue, dedup_nodes, keep_best, parse_mapping,
                               text_key)

TASK = om.Task("game24", "tot-1234", instruction="Use the numbers 1 2 3 4 and + - * / to make 24, "
               "each number once.", data={"numbers": [1, 2, 3, 4], "target": 24})


def left(observation: str) -> str:
    m = re.search(r"Numbers left: ([^|]*)\|", observation)
    return m.group(1).strip() if m else ""


class Script(ScriptedPolicy):
    """Writes scripted steps and answers: ``moves[numbers left]`` are the sampled steps (the
    i-th sample of a request is the i-th move, cycling), ``proposals[...]`` the lines of a
    proposal answer, ``verdicts[...]`` the words of the value samples (cycling) and
    ``judge[answer text]`` the verdict on a final answer. Records every prompt."""

    answers_prompts = True

    def __init__(self, moves=None, proposals=None, verdicts=None, judge=None):
        super().__init__()
        self.moves, self.proposals = moves or {}, proposals or {}
        self.verdicts, self.judge = verdicts or {}, judge or {}
        self.asked: list[tuple[str, int]] = []  # (prompt, n) of every ask

    def _gen(self, text: str) -> Generation:
        ids = self.tokenizer.encode(text) + [256]
        return Generation(text, ids, [-0.1] * len(ids), 10, len(ids))

    def generate(self, requests):
        out = []
        for req in requests:
            env = self._env_for(req.meta)
            state, n = left(env.observe()), req.params.n
            prompt = req.messages[-1]["content"]
            if not req.meta.get("ask"):
                moves = self.moves.get(state) or env.valid_actions()[:1]
                texts = [self.completion("scripted", moves[i % len(moves)]) for i in range(n)]
            else:
                self.asked.append((prompt, n))
                if prompt.startswith("Judge a final answer"):
                    answer = re.search(r"Final answer: (.*)", prompt).group(1).strip()
                    texts = [f"Verdict: {self.judge.get(answer, 'impossible')}"] * n
                elif "List " in prompt:
                    acts = self.proposals.get(state, [])
                    texts = ["\n".join(f"{i}. Act: {a}" for i, a in enumerate(acts, 1))] * n
                else:
                    words = self.verdicts.get(state, ["impossible"])
                    texts = [f"Verdict: {words[i % len(words)]}" for i in range(n)]
            out.append([self._gen(t) for t in texts])
        return out


def search(strategy: str | TreeOfThoughts, policy: Script, **kw):
    (result,) = om.search_many([TASK], strategy=strategy, policy=policy, seed=0, **kw)
    assert not result.faults, result.faults
    return result


def expanded(result, depth: int) -> list[Node]:
    """The nodes at ``depth`` that were expanded, in the order they were expanded (children
    are numbered as they are made, so by their first child's id)."""
    nodes = [n for n in result.tree.nodes if n.depth == depth and n.children]
    return sorted(nodes, key=lambda n: n.children[0])


def actions(nodes) -> list[str]:
    return [n.step.action for n in nodes]


def candidates(result, depth: int) -> list[Node]:
    return [n for n in result.tree.nodes if n.depth == depth and n.error != DUPLICATE]


# --- the defaults are the paper's ---------------------------------------------------------------
def test_defaults_are_the_papers():
    tot = om.make_strategy("tot")
    assert (tot.method, tot.b, tot.k, tot.n_evaluate) == ("bfs", 5, None, 3)
    assert (tot.order, tot.dedup, tot.zero_repeats, tot.last_step) == ("value", "none", True, "answer")
    assert parse_mapping(tot.value_map) == PAPER_MAPPING and tot.value_agg == "sum"
    spec = om.make_strategy("tot:value_map=sure:3/likely:2/impossible:0,value_agg=mean,dedup=text")
    assert parse_mapping(spec.value_map) == {"sure": 3, "likely": 2, "impossible": 0}
    for bad in ("tot:order=random", "tot:dedup=yes", "tot:value_agg=max", "tot:last_step=x",
                "tot:value_map=sure", "tot:k=0"):
        with pytest.raises(ValueError):
            om.make_strategy(bad)


# --- (a) frontier order --------------------------------------------------------------------------
ORDER_MOVES = {"1 2 3 4": ["1 + 2", "3 * 4", "2 * 3"]}  # -> 3 3 4 | 1 2 12 | 1 4 6
ORDER_VERDICTS = {"3 3 4": ["likely"], "1 2 12": ["sure"], "1 4 6": ["likely"]}


@pytest.mark.parametrize("order,first", [("value", ["3 * 4", "1 + 2"]), ("proposal", ["1 + 2", "3 * 4"])])
def test_frontier_in_value_order_ties_in_proposal_order(order, first):
    policy = Script(ORDER_MOVES, verdicts=ORDER_VERDICTS)
    r = search(f"tot:k=3,b=2,evaluator=lm,n_evaluate=1,order={order}", policy)
    assert [n.status for n in candidates(r, 1)] == ["expanded", "expanded", "pruned"]  # 1 / 20 / 1
    assert actions(expanded(r, 1)) == first  # value: 20 first, then the first of the two 1s


def test_keep_best_orders_and_prunes():
    Ctx = fake_ctx

    nodes = [Node(i, 0, 1, "") for i in range(5)]
    values = [0.5, 0.9, 0.5, 0.1, 0.9]
    by_value = keep_best(Ctx(), nodes, values, 4, "cut", order="value")
    assert [n.id for n in by_value] == [1, 4, 0, 2] and nodes[3].error == "cut"
    nodes = [Node(i, 0, 1, "") for i in range(5)]
    assert [n.id for n in keep_best(Ctx(), nodes, values, 4, "cut")] == [0, 1, 2, 4]  # beam's


# --- (b) dedup none | state | text --------------------------------------------------------------
DUP_MOVES = {"1 2 3 4": ["1 + 2", "2 + 1", "1 + 2"]}  # two texts, the first one twice


@pytest.mark.parametrize("mode", ["none", "state", "text"])
@pytest.mark.parametrize("proposer", ["sample", "propose"])
def test_dedup_modes(mode, proposer):
    policy = Script(DUP_MOVES, proposals=DUP_MOVES, verdicts={"3 3 4": ["likely"]})
    r = search(f"tot:b=5,k=3,evaluator=lm,n_evaluate=1,dedup={mode},proposer={proposer}", policy)
    level = [n for n in r.tree.nodes if n.depth == 1]
    assert actions(level) == ["1 + 2", "2 + 1", "1 + 2"]  # every step is in the tree ...
    kept = candidates(r, 1)  # ... the repeats are pruned as duplicates by the mode's rule
    if mode == "none":
        assert kept == level and not any(n.error == DUPLICATE for n in r.tree.nodes)
    elif mode == "text":
        assert actions(kept) == ["1 + 2", "2 + 1"] and level[2].error == DUPLICATE
    else:  # one node per state key: the same text surely is the same state
        assert len(kept) == len({n.state_key for n in level}) and level[2].error == DUPLICATE
        assert kept[0] is level[0]


def test_text_key_is_the_action_texts_from_the_root():
    r = search("tot:b=5,k=3,evaluator=lm,n_evaluate=1,dedup=none",
               Script(DUP_MOVES, verdicts={"3 3 4": ["likely"]}))

    def Ctx():
        return fake_ctx(tree=r.tree)

    a, b, c = [n for n in r.tree.nodes if n.depth == 1]
    ctx = Ctx()
    assert text_key(ctx, a) == text_key(ctx, c) != text_key(ctx, b)
    grand = [n for n in r.tree.nodes if n.depth == 2]
    assert grand and all(text_key(ctx, g) not in {text_key(ctx, a), text_key(ctx, b)} for g in grand)
    fresh = [Node(9, 0, 1, "")]
    assert dedup_nodes(ctx, fresh, "none") == fresh


# --- (c) proposals not truncated unless k is given ----------------------------------------------
PROPOSALS = {"1 2 3 4": ["1 + 2", "3 * 4", "2 * 3", "4 - 1", "2 + 4"]}


@pytest.mark.parametrize("k,kept", [(None, 5), (2, 2)])
def test_propose_keeps_every_listed_step_unless_k(k, kept):
    policy = Script(proposals=PROPOSALS)
    spec = "tot:proposer=propose,evaluator=lm,n_evaluate=1,b=1" + (f",k={k}" if k else "")
    r = search(spec, policy)
    assert actions(r.tree.nodes[n] for n in r.tree.nodes[0].children) == PROPOSALS["1 2 3 4"][:kept]
    first = next(p for p, _ in policy.asked if "List " in p)
    if k is None:
        assert "List the possible next actions" in first and not re.search(r"List \d", first)
    else:
        assert f"List {k} different possible next actions" in first


def test_a_prompt_that_writes_k_needs_k():
    from strategies.tot import ProposePrompt

    class Ctx:
        task, env = TASK, None

    with pytest.raises(ValueError, match="no k was given"):
        ProposePrompt(prompt="List {k} steps for {state}").render(Ctx(), Node(0, None, 0, ""), None)


# --- (d) a repeat within one step is valued 0 ---------------------------------------------------
REPEAT_MOVES = {"1 2 3 4": ["1 + 2", "1 + 2", "3 * 4"]}  # -> 3 3 4 (sure) twice, 1 2 12 (likely)


@pytest.mark.parametrize("zero,kept", [(True, ["1 + 2", "3 * 4"]), (False, ["1 + 2", "1 + 2"])])
def test_a_repeat_in_one_step_is_valued_zero(zero, kept):
    policy = Script(REPEAT_MOVES, verdicts={"3 3 4": ["sure"], "1 2 12": ["likely"]})
    r = search(f"tot:k=3,b=2,evaluator=lm,n_evaluate=1,zero_repeats={zero}", policy)
    level = candidates(r, 1)
    assert len(level) == 3  # dedup=none: the copy is a candidate ...
    assert actions(expanded(r, 1)) == kept  # ... that loses its slot under ToT's rule
    # the repeat was not asked about again: the value cache is keyed by the prompt
    assert sum("Evaluate a partial" in p for p, _ in policy.asked if "3 3 4" in p) == 1


# --- (e) value samples: label map, sum | mean, n ------------------------------------------------
def test_value_map_decides_the_frontier():
    verdicts = {"3 3 4": ["sure", "impossible", "impossible"], "1 2 12": ["likely"] * 3,
                "1 4 6": ["impossible"] * 3}
    paper = search("tot:k=3,b=3,evaluator=lm", Script(ORDER_MOVES, verdicts=verdicts))
    assert actions(expanded(paper, 1)) == ["1 + 2", "3 * 4", "2 * 3"]  # 20.002 > 3 > 0.003
    other = search("tot:k=3,b=3,evaluator=lm,value_map=sure:1/likely:5/impossible:0",
                   Script(ORDER_MOVES, verdicts=verdicts))
    assert actions(expanded(other, 1)) == ["3 * 4", "1 + 2", "2 * 3"]  # 15 > 1 > 0
    policy = Script(ORDER_MOVES, verdicts=verdicts)
    search("tot:k=3,b=3,evaluator=lm,n_evaluate=5", policy)
    assert {n for p, n in policy.asked if "Evaluate a partial" in p} == {5}


def test_value_samples_are_summed_or_averaged():
    class Ctx:
        def __init__(self):
            self.asks = []
            self.values, self.value_caches, self.text_keys = {}, {}, None

        async def ask(self, nodes, prompts, n, temperature=None, max_tokens=None):
            self.asks.append(n)
            return [["x: sure", "x: likely", "nothing", "x: impossible"][:n] for _ in nodes]

    nodes = [Node(1, 0, 1, "", state_key="a"), Node(2, 0, 1, "", state_key="b")]
    paper = dict(mapping=PAPER_MAPPING, prompt=lambda ctx, node: node.state_key)
    ctx = Ctx()
    assert asyncio.run(LMValue(n=4, reduce="sum", **paper)(ctx, nodes)) == [21.001, 21.001]
    assert asyncio.run(LMValue(n=4, reduce="mean", **paper)(Ctx(), nodes)) == [21.001 / 4] * 2
    assert asyncio.run(LMValue(n=2, reduce="sum", **paper)(Ctx(), nodes[:1])) == [21.0]
    assert asyncio.run(LMValue(n=1, prompt=paper["prompt"])(Ctx(), nodes[:1])) == [1.0]  # [0, 1]
    assert asyncio.run(LMValue(n=4, reduce="sum", **paper)(ctx, nodes)) == [21.001] * 2
    assert ctx.asks == [4]  # cached: the second call asked nothing


# --- (f) the last step: answers are judged, a cut-off state is worth 0 --------------------------
LAST_MOVES = {"1 2 3 4": ["1 + 2"], "3 3 4": ["3 + 3", "answer (1 + 2 + 3) * 4"]}
LAST_VERDICTS = {"3 3 4": ["likely"], "4 6": ["sure"]}


@pytest.mark.parametrize("rule,winner", [("answer", "answer (1 + 2 + 3) * 4"), ("value", "3 + 3")])
def test_last_step_rule(rule, winner):
    policy = Script(LAST_MOVES, verdicts=LAST_VERDICTS, judge={"answer (1 + 2 + 3) * 4": "sure"})
    r = search(f"tot:k=2,b=1,evaluator=lm,n_evaluate=1,last_step={rule}", policy, max_depth=2)
    cut, answer = [n for n in r.tree.nodes if n.depth == 2]
    assert cut.terminal and not cut.step.done  # cut by the depth limit ...
    assert answer.terminal and answer.step.done and answer.success  # ... and an answer
    kept = [n for n in (cut, answer) if n.status != "pruned"]
    assert actions(kept) == [winner]
    judged = [p for p, _ in policy.asked if p.startswith("Judge a final answer")]
    assert len(judged) == (rule == "answer")
    if judged:  # the LM judges the answer it wrote, not the env's verdict
        assert "Final answer: answer (1 + 2 + 3) * 4" in judged[0] and "Solved" not in judged[0]
    assert r.best_trajectory.nodes[-1] is answer or rule == "value"


def test_seeded_scripted_searches_are_deterministic():
    def tree(spec):
        r = search(spec, Script(ORDER_MOVES, verdicts=ORDER_VERDICTS))
        return r.to_dict()["tree"]

    for spec in ("tot:k=3,b=2,evaluator=lm", "tot:k=3,b=2,evaluator=lm,dedup=text,method=dfs"):
        assert tree(spec) == tree(spec)


def test_dfs_expands_children_best_first_ties_in_proposal_order():
    """ToT-DFS pushes a state's children so that the best is expanded first and, of equal
    values, the earlier proposed (every grandchild here is impossible, so each is a dead end)."""
    moves = {"1 2 3 4": ["1 + 2", "3 * 4", "1 * 2"]}
    verdicts = {"3 3 4": ["likely"], "1 2 12": ["likely"], "2 3 4": ["sure"]}
    r = search("tot:method=dfs,k=3,evaluator=lm,n_evaluate=1", Script(moves, verdicts=verdicts))
    assert actions(expanded(r, 1)) == ["1 * 2", "1 + 2", "3 * 4"]


def test_zero_repeats_of_siblings_reads_the_last_step_as_text_keys_do():
    """``zero_repeats`` keys a candidate by its parent's text key and its own step's text (the
    pair its text key interns): it zeroes what comparing text keys zeroes, among one parent's
    children and in a mixed set."""
    from strategies.values import zero_repeats

    r = search("tot:b=5,k=3,evaluator=lm,n_evaluate=1,dedup=none",
               Script(DUP_MOVES, verdicts={"3 3 4": ["likely"]}))

    def Ctx():
        return fake_ctx(tree=r.tree)

    ctx = Ctx()
    nodes = r.tree.nodes[1:]
    families = [[n for n in nodes if n.parent == p] for p in {n.parent for n in nodes}]
    shuffled = list(nodes)
    random.Random(0).shuffle(shuffled)  # siblings apart: each parent's key met more than once
    groups = [f for f in families if len(f) > 1] + [nodes, shuffled]  # siblings, then all mixed
    assert any(len({text_key(ctx, n) for n in f}) < len(f) for f in groups[:-1])  # a repeat in one
    for group in groups:
        values = [1.0] * len(group)
        seen, want = set(), []
        for n in group:
            want.append(0.0 if text_key(ctx, n) in seen else 1.0)
            seen.add(text_key(ctx, n))
        assert zero_repeats(Ctx(), group, values) == want
