"""Structured decoding through the engine (``constrain``) and policy priors (``score_actions``).

Grammar-aware test policies are the scripted oracle with ``supports_grammar`` set: they pick the
env's expert action (or another valid one) and ignore the grammar, so every tree can be checked
against the same search with ``constrain=none``. A tiny random hf model (built locally, see
conftest.tiny_hf_model) checks that a constrained search records the logprobs of the masked,
renormalised distribution: recomputed under the same grammar they agree, so PPO's first ratio is 1.
"""
from __future__ import annotations

import math

import pytest

import omrl_search as om
import omrl_search.env as env_module
from omrl_search.agent import ReActFormat
from omrl_search.backends.scripted import OraclePolicy
from omrl_search.constrain import Grammar
from omrl_search.budget import Budget
from omrl_search.engine import Engine
from omrl_search.executors import search_here
from omrl_search.env import Env, ValueSnapshots, make_env, register_env
from omrl_search.prompts import ConstraintError
from omrl_search.result import SearchResult, constraint_totals
from omrl_search.types import Generation, StepResult, Task

pytest.importorskip("xgrammar")


# --- a line world: positions 0..6, goal 4; position 2 is a ledge where nothing is listed -------
class LineEnv(ValueSnapshots, Env):
    name = "h2b_line"
    action_help = "Actions: `left` or `right`."
    max_steps = 12
    ledge = 2

    def reset(self, task: Task) -> str:
        self.state = (0, 0)
        return self.observe()

    def observe(self) -> str:
        return f"You are at {self.state[0]}; the goal is at 4."

    def step(self, action: str) -> StepResult:
        pos, steps = self.state
        move = {"left": -1, "right": 1}.get(action.strip())
        pos, steps = max(0, min(6, pos + (move or 0))), steps + 1
        self.state = (pos, steps)
        won = pos == 4
        return StepResult(self.observe(), float(won), terminated=won, success=won,
                          valid=move is not None, truncated=not won and steps >= self.max_steps,
                          info={"answer": str(pos)} if won else {})

    def valid_actions(self) -> list[str] | None:
        return [] if self.state[0] == self.ledge else ["left", "right"]

    def expert_action(self) -> str | None:
        return "right"

    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        return [Task(cls.name, f"{cls.name}-{i}", split, i, "Walk to 4.") for i in range(limit or 3)]


class FreeLineEnv(LineEnv):
    name, ledge = "h2b_line_free", -1


class RulesLineEnv(LineEnv):
    """A syntax wider than a list: ``right`` or ``go N`` (N one of 1..3)."""

    name, ledge = "h2b_line_rules", -1

    def action_grammar(self) -> str | None:
        return 'action ::= "right" | "go " [1-3]'


class BadRulesLineEnv(LineEnv):
    name, ledge = "h2b_line_badrules", -1

    def action_grammar(self) -> str | None:
        return 'action ::= "go " dir'  # ``dir`` is not defined


class OpenLineEnv(LineEnv):
    name, ledge = "h2b_line_open", -1

    def valid_actions(self) -> list[str] | None:
        return None


def tasks(env: str, n: int = 3) -> list[Task]:
    return om.load_tasks(env, "test", limit=n)


@pytest.fixture(autouse=True, scope="module")
def _line_envs():
    """The line worlds are registered for this module only: other test modules parametrize over
    every registered env at collection, and these are not bundled envs."""
    classes = (LineEnv, FreeLineEnv, RulesLineEnv, BadRulesLineEnv, OpenLineEnv)
    for cls in classes:
        register_env(cls.name)(cls)
    yield
    for cls in classes:
        env_module._ENVS.registered.pop(cls.name, None)


class GrammarOracle(OraclePolicy):
    """The oracle, declaring structured decoding and recording each request's grammar."""

    supports_grammar = True

    def __init__(self, p: float = 0.3, **kw):
        super().__init__(p, **kw)
        self.requests = []

    def generate(self, requests):
        self.requests += requests
        return super().generate(requests)


class ScoringOracle(GrammarOracle):
    """...that also scores completions by its own rule: log(1 - p) for the expert's action,
    log(p / others) for another listed action (what it samples them with)."""

    def __init__(self, p: float = 0.3):
        super().__init__(p)
        self.score_calls = []

    def score(self, requests, completions):
        self.score_calls.append([len(c) for c in completions])
        fmt, out = ReActFormat(), []
        for req, comps in zip(requests, completions):
            env = self._env_for(req.meta)
            expert = env.expert_action()
            acts = [fmt.parse(c).action for c in comps]
            others = max(1, sum(a != expert for a in acts))
            out.append([math.log(1 - self.p) if a == expert else math.log(self.p / others) for a in acts])
        return out


def search(ts, *, strategy, policy, budget=None, reward_model=None, **kw):
    """``search_many`` in this process, with the engine options it forwards (``constrain``)."""
    return search_here(ts, strategy=om.make_strategy(strategy), policy=policy, reward_model=reward_model,
                       budget=Budget.parse(budget), **kw)


def trees(results, keep_grammar=False):
    """The trees as dicts; without ``keep_grammar`` each step's record of the grammar it was
    asked under (None under constrain=none) is left out, so trees compare on what was done."""
    out = [r.to_dict()["tree"] for r in results]
    if not keep_grammar:
        for tree in out:
            for node in tree["nodes"]:
                if node.get("step"):
                    node["step"].pop("grammar", None)
    return out


STRATEGIES = ["react", "best_of_n:n=3", "beam:width=2,k=2", "tot", "dfsdt",
              "mcts:simulations=8,leaves=2,k=2", "got"]


# --- modes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_actions_grammar_is_the_valid_actions_and_trees_equal_unconstrained(strategy):
    """Sokoban lists its moves: under auto every expansion asks for one of them at that node's
    state; the oracle ignores grammars, so the trees are those of constrain=none."""
    ts = tasks("sokoban", 3)
    pol = GrammarOracle(0.4)
    got = search(ts, strategy=strategy, policy=pol, budget={"env_steps": 40}, seed=2)
    ref = search(ts, strategy=strategy, policy=GrammarOracle(0.4), budget={"env_steps": 40},
                         seed=2, constrain="none")
    assert trees(got) == trees(ref)
    env = make_env("sokoban")
    for req in pol.requests:
        env.restore(req.meta["snapshot"])
        assert req.grammar == Grammar.one_of(env.valid_actions(), "sokoban")
    for r in got:
        c = r.constraint
        assert (c["asked"], c["mode"], c["violations"], c["none"]) == ("auto", "actions", 0, 0)
        assert c["actions"] == c["generations"] > 0
    assert all(r.constraint["mode"] == "none" and r.constraint["none"] > 0 for r in ref)


def test_ask_prompts_carry_no_grammar():
    class Talker(GrammarOracle):
        answers_prompts = True

        def generate(self, requests):
            asks = [r for r in requests if r.meta.get("ask")]
            assert all(r.grammar is None for r in asks)
            acts = iter(super().generate([r for r in requests if not r.meta.get("ask")]))
            return [[Generation("likely", [1], [-0.1], 3, 1)] * r.params.n if r.meta.get("ask")
                    else next(acts) for r in requests]

    pol = Talker(0.3)
    [r] = search(tasks("sokoban", 1), strategy="tot:evaluator=lm", policy=pol,
                         budget={"env_steps": 20})
    assert r.constraint["actions"] > 0 and not r.faults
    assert all(req.grammar is not None for req in pol.requests if not req.meta.get("ask"))


def test_format_mode_is_the_frame_with_any_action():
    pol = GrammarOracle(0.3)
    [r] = search(tasks("sokoban", 1), strategy="react", policy=pol, constrain="format")
    assert {req.grammar for req in pol.requests} == {Grammar.any_line("sokoban")}
    assert r.constraint["mode"] == "format" and r.constraint["format"] == r.constraint["generations"]


def test_env_rules_give_the_grammar():
    pol = GrammarOracle(0.0)
    [r] = search(tasks("h2b_line_rules", 1), strategy="react", policy=pol)
    assert r.success and r.constraint["mode"] == "actions"
    assert {req.grammar for req in pol.requests} == {
        Grammar.from_rules('action ::= "right" | "go " [1-3]', "h2b_line_rules")}


def test_rules_that_do_not_compile():
    """auto: the format instead, noted; an explicit actions: one error naming the env's grammar."""
    pol = GrammarOracle(0.0)
    [r] = search(tasks("h2b_line_badrules", 1), strategy="react", policy=pol)
    assert r.success and r.constraint["fallbacks"] == r.constraint["requests"] > 0
    assert any("grammar from h2b_line_badrules does not compile" in n for n in r.constraint["notes"])
    assert {req.grammar.kind for req in pol.requests} == {"format"}
    with pytest.raises(ConstraintError) as e:
        search(tasks("h2b_line_badrules", 1), strategy="react", policy=GrammarOracle(0.0),
                       constrain="actions")
    assert str(e.value).startswith("constrain=actions: grammar from h2b_line_badrules does not compile")


def test_env_without_an_action_language():
    """auto: the format alone; actions: one line naming the env and the setting."""
    [r] = search(tasks("h2b_line_open", 1), strategy="react", policy=GrammarOracle(0.0))
    assert r.success and r.constraint["mode"] == "format"
    assert r.constraint["notes"] == ["env 'h2b_line_open' offers no action language: the format alone"]
    with pytest.raises(ConstraintError) as e:
        search(tasks("h2b_line_open", 1), strategy="react", policy=GrammarOracle(0.0),
                       constrain="actions")
    assert str(e.value) == ("constrain=actions: env 'h2b_line_open' offers neither valid_actions() "
                            "nor action_grammar(); use constrain=format or auto")


def test_no_valid_action_at_a_live_state():
    """The ledge (position 2) lists nothing: under actions that node is a fault and the policy
    is never asked there; under auto it is expanded under the format, and the fallback noted."""
    pol = GrammarOracle(0.0)
    [r] = search(tasks("h2b_line", 1), strategy="react", policy=pol, constrain="actions")
    ledge = [n for n in r.tree.nodes if n.observation.startswith("You are at 2")]
    assert ledge and all(n.status == "failed" for n in ledge) and not r.success
    assert all(req.meta["snapshot"].payload[0] != 2 for req in pol.requests)
    assert r.faults == [f"constrain: constrain=actions: no valid action at node {ledge[0].id}"]
    assert r.constraint["skipped"] == 1
    pol = GrammarOracle(0.0)
    [r] = search(tasks("h2b_line", 1), strategy="react", policy=pol)
    assert r.success and not r.faults
    assert r.constraint["fallbacks"] == 1 and r.constraint["format"] == 1
    kinds = [(req.meta["snapshot"].payload[0], req.grammar.kind) for req in pol.requests]
    assert kinds == [(0, "actions"), (1, "actions"), (2, "format"), (3, "actions")]
    assert "listed no valid action" in r.constraint["notes"][0]


def test_a_policy_that_cannot_constrain():
    """Scripted policies have no structured decoding: auto runs unconstrained (noted, trees as
    with none); an explicit format or actions is one error naming the policy and setting."""
    ts = tasks("game24", 4)
    auto = search(ts, strategy="beam", policy="scripted:oracle:p=0.5", seed=1)
    none = search(ts, strategy="beam", policy="scripted:oracle:p=0.5", seed=1, constrain="none")
    assert trees(auto) == trees(none)
    c = auto[0].constraint
    assert (c["asked"], c["mode"]) == ("auto", "none")
    assert c["notes"] == ["policy 'scripted:oracle:p=0.5' cannot generate under a grammar: unconstrained"]
    for mode in ("format", "actions"):
        with pytest.raises(ConstraintError) as e:
            Engine(OraclePolicy(0.5), constrain=mode)
        assert str(e.value).startswith(f"constrain={mode}: policy 'scripted:oracle:p=0.5' cannot "
                                       "generate under a grammar")
    with pytest.raises(ConstraintError, match="constrain must be one of auto, none, format, actions"):
        Engine(OraclePolicy(), constrain="json")


def test_violations_are_checked_on_the_client_and_counted():
    """A policy that says it constrains but ignores the grammar (a server that drops the field):
    its off-grammar texts are checked here, counted as violations, never as constrained."""
    pol = GrammarOracle(0.3, malformed=0.5)
    [r] = search(tasks("sokoban", 1), strategy="best_of_n:n=6", policy=pol)
    c = r.constraint
    assert c["violations"] > 0 and c["none"] == c["violations"]
    assert c["actions"] + c["none"] + c["format"] == c["generations"]
    totals = constraint_totals([r, r])
    assert totals["violations"] == 2 * c["violations"] and totals["modes"] == {"actions": 2}
    assert totals["asked"] == "auto"


def test_replay_snapshots_and_json_round_trip():
    factory = lambda name: make_env(name, snapshots="replay")  # noqa: E731
    pol = GrammarOracle(0.3)
    [r] = search(tasks("sokoban", 1), strategy="beam:width=2,k=2", policy=pol,
                         env_factory=factory, budget={"env_steps": 20})
    assert r.constraint["mode"] == "actions" and r.constraint["actions"] > 0 and not r.faults
    back = SearchResult.from_json(r.to_json())
    assert back.constraint == r.constraint
    old = r.to_dict()
    del old["constraint"]  # a results file written before the field existed
    assert SearchResult.from_dict(old).constraint == {}


def test_summarize_totals_helper_matches_the_results():
    results = search(tasks("sokoban", 3), strategy="best_of_n:n=2", policy=GrammarOracle(0.2))
    t = constraint_totals(results)
    assert t["generations"] == sum(r.constraint["generations"] for r in results) > 0
    assert t["actions"] == t["generations"] and t["requests"] == sum(r.spent["lm_calls"] for r in results)
    assert t["modes"] == {"actions": 3} and t["notes"] == []


# --- policy priors -------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ["mcts:simulations=10,leaves=2,priors=policy",
                                      "beam:width=2,k=2,propose=policy"])
def test_policy_priors_score_every_valid_action_in_one_call(strategy):
    ts = tasks("sokoban", 3)
    pol = ScoringOracle(0.3)
    results = search(ts, strategy=strategy, policy=pol, budget={"env_steps": 60}, seed=1)
    again = search(ts, strategy=strategy, policy=ScoringOracle(0.3), budget={"env_steps": 60},
                           seed=1)
    assert trees(results) == trees(again) and not any(r.faults for r in results)
    assert pol.score_calls and len(pol.score_calls[0]) > 1  # trees scored together
    env = make_env("sokoban")
    for r in results:
        root = r.tree.root
        env.restore(root.snapshot)
        acts = env.valid_actions()
        first = [r.tree.nodes[i] for i in root.children]
        if strategy.startswith("mcts"):
            assert sorted(c.step.action for c in first) == sorted(acts)  # one child per action
            expert = env.expert_action()
            others = len(acts) - 1
            want = {a: (0.7 if a == expert else 0.3 / others) for a in acts}
            z = sum(want.values())
            for c in first:
                if c.status not in ("pruned", "failed"):
                    assert c.prior == pytest.approx(want[c.step.action] / z)
        else:
            assert env.expert_action() in {c.step.action for c in first}  # the best-scored kept
            assert len(first) == min(2, len(acts))


def test_policy_priors_need_a_scoring_policy():
    class Declined(ScoringOracle):
        can_score = False  # a backend whose score() exists but cannot serve (its flag says so)

    # (the scripted oracle itself scores now, by the rule it samples with: see test_policy_score)
    for pol in (Declined(),):
        [r] = search(tasks("sokoban", 1), strategy="mcts:priors=policy", policy=pol)
        assert r.stop_reason == "error" and "needs a policy that scores completions" in r.faults[0]
        [r] = search(tasks("sokoban", 1), strategy="beam:propose=policy", policy=pol)
        assert r.stop_reason == "error" and "needs a policy that scores completions" in r.faults[0]


def test_policy_priors_fall_back_to_sampling_when_actions_are_many():
    pol = ScoringOracle(0.3)
    [r] = search(tasks("sokoban", 1), strategy="mcts:simulations=6,priors=policy,max_actions=1",
                         policy=pol, budget={"env_steps": 30})
    assert not pol.score_calls and len(r.tree.nodes) > 1


def test_a_bad_score_answer_is_a_fault_with_uniform_priors():
    class Bad(ScoringOracle):
        def score(self, requests, completions):
            return [[float("nan")] * len(c) for c in completions]

    [r] = search(tasks("sokoban", 1), strategy="mcts:simulations=4,priors=policy", policy=Bad(),
                         budget={"env_steps": 30})
    assert any(f.startswith("lm score: RuntimeError") for f in r.faults)
    kids = [r.tree.nodes[i] for i in r.tree.root.children]
    assert len({round(c.prior, 9) for c in kids if c.status == "expanded" or c.visits}) <= 1


# --- logprobs under a grammar (tiny hf model) -----------------------------------------------------
class ActOnly(ReActFormat):
    """No thought line (a random model seldom writes a newline): completions are ``Act: x``."""

    think, act = None, "Act: "


def test_constrained_step_logprobs_are_the_masked_distribution(tiny_hf_model):
    """Recomputing each step's logprobs under the same grammar's mask gives Step.logprobs: the
    importance ratio of PPO's first step on constrained rollouts is 1. SFT rows keep ids/text."""
    torch = pytest.importorskip("torch")
    from omrl_search.backends.hf import HFPolicy
    from omrl_search.constrain import TokenMasker
    from omrl_search.types import SamplingParams

    policy = HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8)
    engine = Engine(policy, agent_format=ActOnly(), sampling=SamplingParams(1.0, 1.0, 12), seed=3,
                    constrain="actions", max_depth=3)
    results = engine.run(om.make_strategy("best_of_n:n=3"), tasks("h2b_line_free", 2))
    tok = policy.tokenizer
    masker = TokenMasker.from_hf(tok.hf, policy._vocab_size, tok.eos_token_ids)
    env = make_env("h2b_line_free")
    checked, moved = 0, 0.0
    for r in results:
        assert r.constraint["actions"] == r.constraint["generations"] > 0 and not r.faults
        for node in r.tree.nodes[1:]:
            parent = r.tree.nodes[node.parent]
            env.restore(parent.snapshot)
            listed = env.valid_actions()
            if not listed:
                continue
            grammar = Grammar.one_of(listed, "h2b_line_free", think=None, act="Act: ")
            path = r.tree.path(node)[1:]
            prompt = [t for n in path[:-1] for t in n.step.context_ids + n.step.completion_ids]
            prompt += node.step.context_ids
            ids = node.step.completion_ids
            with torch.no_grad():
                logits = policy.model(torch.tensor([prompt + ids])).logits[0].float()
            guide = masker.matcher(grammar)
            lps = []
            for i, t in enumerate(ids):
                row = logits[len(prompt) - 1 + i].clone()[None]
                masker.mask(row, [guide])
                lps.append(torch.log_softmax(row[0], -1)[t].item())
                moved += lps[-1] - torch.log_softmax(logits[len(prompt) - 1 + i], -1)[t].item()
                if i + 1 < len(ids):
                    guide.accept(t)
            assert node.step.logprobs == pytest.approx(lps, abs=1e-4)
            ratio = math.exp(sum(lps) - sum(node.step.logprobs))
            assert ratio == pytest.approx(1.0, abs=1e-3)
            checked += 1
    assert checked >= 4 and moved > 1.0  # the mask mattered: unmasked logprobs are lower
    from omrl_search.exports import dpo_rows, sft_rows

    reread = [SearchResult.from_json(r.to_json()) for r in results]  # constraint record included
    assert sft_rows(reread, include_failures=True, tokenizer=engine.encoder) == sft_rows(
        results, include_failures=True, tokenizer=engine.encoder)
    assert dpo_rows(reread, margin=0.0) == dpo_rows(results, margin=0.0)
