"""``Step.grammar``: each step records the grammar its completion was sampled under, as a plain
dict of the Grammar's fields, so a trainer can rebuild the masks (None when unconstrained)."""
from __future__ import annotations

import omrl_search as om
from omrl_search.backends.scripted import OraclePolicy
from omrl_search.constrain import Grammar
from omrl_search.engine import Engine
from omrl_search.result import SearchResult

TASKS = om.load_tasks("sokoban", "test", limit=3)


class Constraining(OraclePolicy):
    """The oracle, declaring structured decoding and stamping its generations as made under
    each request's grammar (as a real backend does), except generation number ``ignored``: a
    server that dropped the grammar and wrote a text outside it (the client's check finds the
    violation, so the step was not sampled under the grammar)."""

    supports_grammar = True

    def __init__(self, ignored: int = -1):
        super().__init__(0.3)
        self.grammars: list[Grammar | None] = []
        self.ignored, self.made = ignored, 0

    def generate(self, requests):
        out = super().generate(requests)
        for req, gens in zip(requests, out):
            self.grammars.append(req.grammar)
            for g in gens:
                if self.made == self.ignored:
                    g.text = "I wander off the grammar."
                elif req.grammar is not None:
                    g.constraint, g.constraint_check = req.grammar.kind, "ok"
                self.made += 1
        return out


def steps(results):
    return [n.step for r in results for n in r.tree.nodes[1:]]


def test_constrained_steps_record_their_grammar_and_round_trip():
    policy = Constraining()
    results = Engine(policy, seed=1, constrain="actions").run(om.make_strategy("best_of_n:n=3"), TASKS)
    asked = {g for g in policy.grammars if g is not None}
    got = steps(results)
    assert got and asked
    for step in got:
        assert isinstance(step.grammar, dict)
        assert set(step.grammar) == {"kind", "rules", "source", "think", "act"}
        assert step.grammar["kind"] == "actions" and step.grammar["rules"]
        assert Grammar(**step.grammar) in asked  # rebuilds the grammar the request carried
    assert len({id(s.grammar) for s in got}) == len(got)  # one dict per step, never shared
    for r in results:
        back = SearchResult.from_json(r.to_json())
        assert [n.step.grammar for n in back.tree.nodes[1:]] == [n.step.grammar for n in r.tree.nodes[1:]]


def test_unconstrained_and_ignored_grammars_record_none():
    results = Engine(Constraining(), seed=1, constrain="none").run(om.make_strategy("best_of_n:n=3"), TASKS)
    assert steps(results) and all(s.grammar is None for s in steps(results))
    policy = Constraining(ignored=0)  # the first generation came back without the grammar
    results = Engine(policy, seed=1, constrain="actions").run(om.make_strategy("best_of_n:n=3"), TASKS)
    recorded = [s.grammar for s in steps(results)]
    assert recorded.count(None) == 1 and recorded[0] is None


def test_grammar_fields_rebuild_the_grammar():
    g = Grammar.one_of(["up", "down"], "demo", think=None, act="Act: ")
    assert Grammar(**g.to_record()) == g
    assert g.to_record()["think"] is None and g.to_record()["source"] == "demo"
