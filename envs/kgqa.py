"""Multi-hop questions over a generated knowledge graph, answered through tool actions.

Each seed makes one small fictional world as a ``networkx.MultiDiGraph`` (people, cities,
countries, companies, universities, films; relations such as ``born_in`` or ``works_for``, each
also walkable backwards under its inverse name, e.g. ``birthplace_of``) and up to five questions
on it, each with a *program* in the env's own action syntax (``neighbors: Calder, birthplace_of``
→ ``intersect: #1, #2`` → ``count: #3`` → ``answer: #4``). Running the program gives the
reference answer; the expert follows it from any state, reusing results the agent already has.
Answers are checked by exact match of the normalised entity set (or number). A stable hash of
the seed picks the split, so train and test never share a graph.

The state is plain data (value snapshots): the results so far as a tuple of sorted name tuples
or counts, the step count and the last message; the graph is shared, read-only, by the task.
"""
from __future__ import annotations

import difflib
import json
import random
import re
import string
from collections import Counter
from functools import lru_cache
from typing import Any, NamedTuple

import networkx as nx

from omrl_search.env import ValueSnapshots, register_env, stable_hash
from omrl_search.types import Task

from ._textactions import (ActionEnv, ActionError, Outcome, SeededTasks, norm_cell, parse_action,
                           split_args, task_id_of, text_field)

SHOWN = 10  # entities a result shows
INVERSE = {"born_in": "birthplace_of", "works_for": "employs", "studied_at": "alumni",
           "acted_in": "cast", "directed": "directed_by", "founded": "founded_by",
           "headquartered_in": "headquarters_of", "located_in": "location_of"}
QUESTIONS_PER_GRAPH = 5
_POOLS = {
    "country": "Norvale Ardenia Kestria Valdoria Brenmark Solvia Tarnis Elyria",
    "city": "Calder Dunmore Essing Farrow Glenholt Harwick Ivel Jarrow Kelby Larch Marrow Norwick Orrin Pellam",
    "first": "Alba Bruno Celia Dario Elin Felix Greta Hanno Irma Jonas Karla Linus Mira Nils Olga Paco Runa "
             "Silas Tilda Ugo",
    "last": "Arden Birch Castell Dorn Eske Fallow Grange Hollis Ingram Jessop Kerr Lomax Mercer Northam",
    "brand": "Amber Basalt Cedar Drift Ember Flint Garnet Harbor Indigo Jade Kestrel Lumen",
    "suffix": "Labs Works Group Systems Foods Motors",
    "adj": "Silent Crimson Hollow Last Golden Northern Broken Quiet",
    "noun": "Harbor Orchard Signal Voyage Lantern Meridian Tide Garden",
}
# (question, program); {placeholders} name entity pools, a trailing digit draws another one
TEMPLATES = (
    ("In which country was the founder of {company} born?",
     ["neighbors: {company}, founded_by", "neighbors: #1, born_in", "neighbors: #2, located_in", "answer: #3"]),
    ("Which companies employ alumni of {university}?",
     ["neighbors: {university}, alumni", "neighbors: #1, works_for", "answer: #2"]),
    ("Which people born in {city} work for {company}?",
     ["neighbors: {city}, birthplace_of", "neighbors: {company}, employs", "intersect: #1, #2", "answer: #3"]),
    ("How many people who acted in films directed by {director} were born in {country}?",
     ["neighbors: {director}, directed", "neighbors: #1, cast", "neighbors: {country}, location_of",
      "neighbors: #3, birthplace_of", "intersect: #2, #4", "count: #5", "answer: #6"]),
    ("How many people work for companies headquartered in {country}?",
     ["neighbors: {country}, location_of", "neighbors: #1, headquarters_of", "neighbors: #2, employs",
      "count: #3", "answer: #4"]),
    ("Which films feature both {actor} and {actor2}?",
     ["neighbors: {actor}, acted_in", "neighbors: {actor2}, acted_in", "intersect: #1, #2", "answer: #3"]),
    ("In which city is the university where the director of {film} studied?",
     ["neighbors: {film}, directed_by", "neighbors: #1, studied_at", "neighbors: #2, located_in", "answer: #3"]),
    ("Who founded the company that {person} works for?",
     ["neighbors: {person}, works_for", "neighbors: #1, founded_by", "answer: #2"]),
)

Value = tuple[str, ...] | int  # a set of entity names (sorted) or a count


def make_graph(seed: int) -> nx.MultiDiGraph:
    """The world of ``seed``: ~55 entities, ~130 facts, every relation used; nodes carry
    their ``type`` (what question placeholders draw from)."""
    rng = random.Random(f"kgqa-graph:{seed}")
    pool = {k: v.split() for k, v in _POOLS.items()}
    triples = []
    countries, cities = rng.sample(pool["country"], 3), rng.sample(pool["city"], 8)
    triples += [(c, "located_in", countries[i % 3]) for i, c in enumerate(cities)]
    universities = [f"University of {c}" for c in cities[:3]]
    triples += [(u, "located_in", c) for u, c in zip(universities, cities)]
    names = rng.sample([f"{b} {s}" for b in pool["brand"] for s in pool["suffix"]], 6)
    people = rng.sample([f"{f} {last}" for f in pool["first"] for last in pool["last"]], 28)
    films = rng.sample([f"The {a} {n}" for a in pool["adj"] for n in pool["noun"]], 8)
    for p in people:
        triples.append((p, "born_in", rng.choice(cities)))
        triples.append((p, "works_for", rng.choice(names)))
        if rng.random() < 0.7:
            triples.append((p, "studied_at", rng.choice(universities)))
    for company, founder in zip(names, rng.sample(people, len(names))):
        triples += [(founder, "founded", company), (company, "headquartered_in", rng.choice(cities))]
    directors = rng.sample(people, 4)
    for film in films:
        triples.append((rng.choice(directors), "directed", film))
        triples += [(a, "acted_in", film) for a in rng.sample(people, rng.randint(3, 5))]
    g = graph_of(triples)
    for kind, members in (("country", countries), ("city", cities), ("university", universities),
                          ("company", names), ("person", people), ("film", films)):
        for m in members:
            g.nodes[m]["type"] = kind
    return g


def _pools(g: nx.MultiDiGraph) -> dict[str, list[str]]:
    """Entities a template placeholder draws from, by type or by a relation they have."""
    pools: dict[str, list[str]] = {}
    for n, kind in sorted(g.nodes(data="type")):
        pools.setdefault(kind, []).append(n)
    for name, rel in (("director", "directed"), ("actor", "acted_in"), ("person", "works_for")):
        pools[name] = sorted({u for u, _, k in g.edges(keys=True) if k == rel})
    return pools


def graph_of(triples: list) -> nx.MultiDiGraph:
    """A graph from ``[head, relation, tail]`` triples; raise ``ValueError`` when malformed."""
    if not isinstance(triples, list) or not triples:
        raise ValueError("triples must be a non-empty list of [head, relation, tail]")
    g = nx.MultiDiGraph()
    for t in triples:
        if not (isinstance(t, (list, tuple)) and len(t) == 3 and all(isinstance(x, str) and x.strip() for x in t)):
            raise ValueError(f"each triple must be [head, relation, tail] strings, got {t!r}")
        head, rel, tail = (x.strip() for x in t)
        if any(ch in head + tail for ch in ",#") or not rel.replace("_", "").isalnum():
            raise ValueError(f"entity names cannot contain ',' or '#', relations are words: {t!r}")
        g.add_edge(head, tail, key=rel)
    g.graph["index"] = {n.lower(): n for n in g.nodes}  # entity names, case-insensitive
    rels = {k for _, _, k in g.edges(keys=True)}
    g.graph["relations"] = rels | {inverse(r) for r in rels}
    pairs = ", ".join(f"{r} ({inverse(r)})" for r in sorted(rels))
    g.graph["intro"] = (f"Knowledge graph: {g.number_of_nodes()} entities, {g.number_of_edges()} facts. "
                        f"Relations (and their inverses): {pairs}.")
    return g


def inverse(rel: str) -> str:
    return INVERSE.get(rel, f"{rel}_of")


def relations_of(g: nx.MultiDiGraph, entities: tuple[str, ...]) -> Counter:
    out: Counter = Counter()
    for e in entities:
        out.update(k for _, _, k in g.out_edges(e, keys=True))
        out.update(inverse(k) for _, _, k in g.in_edges(e, keys=True))
    return out


def _show(value: Value) -> str:
    if isinstance(value, int):
        return str(value)
    names = ", ".join(value[:SHOWN])
    more = f", ... and {len(value) - SHOWN} more" if len(value) > SHOWN else ""
    return f"{{{names}{more}}} ({len(value)} entit{'y' if len(value) == 1 else 'ies'})"


class KgSpec(NamedTuple):
    key: str
    graph: nx.MultiDiGraph
    program: tuple[str, ...]  # the reference actions, the last one ``answer: ...``
    values: tuple[Value, ...]  # the value of each program step before the answer
    gold: tuple[str, ...]  # the normalised answer set
    anchors: tuple[str, ...]  # entities the program starts from


class KgState(NamedTuple):
    spec: KgSpec
    vars: tuple[Value, ...] = ()  # results #1, #2, ... so far
    steps: int = 0
    limit: int = 12
    done: bool = False
    truncated: bool = False  # ended by the step limit
    success: bool = False
    answer: str = ""
    note: str = ""


@register_env("kgqa")
class KgqaEnv(ValueSnapshots, ActionEnv):
    """Answer a multi-hop question by walking a knowledge graph with tool actions."""

    description = "Knowledge-graph QA: answer multi-hop questions by following relations between entities."
    action_help = (
        "Actions: `relations: E` lists the relations of entity E (or of the entities in a result "
        "#N); `neighbors: E, RELATION` follows a relation from E or #N and stores the entities "
        "reached as a new result #N; `intersect: #A, #B` keeps the entities in both; `count: #N` "
        "counts them; `answer: #N` (or `answer: NAME, NAME` or `answer: NUMBER`) gives the answer."
    )
    examples = "Think: First I find who founded Amber Labs.\nAct: neighbors: Amber Labs, founded_by"
    verbs = {"relations": "relations: ENTITY", "neighbors": "neighbors: ENTITY, RELATION",
             "intersect": "intersect: #A, #B", "count": "count: #N", "answer": "answer: #N"}
    reasons = {
        "relations": ("I list the relations of {a0} to see which one leads toward the answer.",
                      "First I see which relations {a0} has."),
        "neighbors": ("Following {a1} from {a0} gives the entities the question is about next.",
                      "The question goes through the {a1} of {a0}, so I follow that relation.",
                      "I need the {a1} of {a0}."),
        "intersect": ("The answer must be in both {a0} and {a1}, so I keep the entities they share.",
                      "Only the entities in both {a0} and {a1} fit every condition: I intersect them."),
        "count": ("The question asks how many, so I count the entities in {a0}.",
                  "Counting {a0} gives the number asked for."),
        "answer": ("{arg} is what the question asks for, so I answer with it.", "That is the answer: {arg}."),
    }
    max_steps = 12

    def __init__(self) -> None:
        self.state: KgState | None = None

    def reset(self, task: Task) -> str:
        spec = spec_of(task.data)
        self.state = KgState(spec, limit=self.max_steps, note=spec.graph.graph["intro"])
        return self.observe()

    # --- actions --------------------------------------------------------------------------
    def do_relations(self, arg: str) -> Outcome:
        what, entities = self._operand(arg, sets_only=True)
        rels = relations_of(self.state.spec.graph, entities)
        listing = ", ".join(f"{r} ({n})" for r, n in sorted(rels.items())) or "none"
        return Outcome(f"Relations of {what}: {listing}")

    def do_neighbors(self, arg: str) -> Outcome:
        src, _, rel = arg.rpartition(",")
        if not src.strip():
            raise ActionError(f"expected an entity and a relation: `{self.verbs['neighbors']}`")
        what, entities = self._operand(src, sets_only=True)
        rel = "_".join(rel.lower().split())
        g = self.state.spec.graph
        if rel not in g.graph["relations"]:
            raise ActionError(f"unknown relation {rel!r}; `relations: {what}` lists its relations")
        found = set()
        for e in entities:
            found.update(v for _, v, k in g.out_edges(e, keys=True) if k == rel)
            found.update(u for u, _, k in g.in_edges(e, keys=True) if inverse(k) == rel)
        return self._store(tuple(sorted(found)), f"{rel} of {what}")

    def do_intersect(self, arg: str) -> Outcome:
        a, b = (self._var(x, sets_only=True) for x in split_args(arg, 2, 2, self.verbs["intersect"]))
        return self._store(tuple(sorted(set(a[1]) & set(b[1]))), f"{a[0]} and {b[0]}")

    def do_count(self, arg: str) -> Outcome:
        what, value = self._var(arg, sets_only=True)
        return self._store(len(value), f"count of {what}")

    def do_answer(self, arg: str) -> Outcome:
        if arg.startswith("#"):
            value = self._var(arg)[1]
            got = (norm_cell(value),) if isinstance(value, int) else tuple(norm_cell(v) for v in value)
        else:
            got = tuple(norm_cell(v) for v in arg.split(",") if v.strip())
        got = tuple(sorted(set(got)))
        ok = got == self.state.spec.gold
        answer = ", ".join(got)
        return Outcome(f"Answered: {answer[:200]}. {'Correct.' if ok else 'Wrong.'}", final=(ok, answer))

    # --- helpers --------------------------------------------------------------------------
    def _store(self, value: Value, how: str) -> Outcome:
        n = len(self.state.vars) + 1
        return Outcome(f"#{n} = {_show(value)}  [{how}]", changes={"vars": self.state.vars + (value,)})

    def _var(self, ref: str, sets_only: bool = False) -> tuple[str, Value]:
        ref = ref.strip()
        n = ref[1:] if ref.startswith("#") else ""
        if not n.isdigit() or not 1 <= int(n) <= len(self.state.vars):
            have = f"#1 to #{len(self.state.vars)}" if self.state.vars else "none yet"
            raise ActionError(f"{ref!r} is not a result (results: {have})")
        value = self.state.vars[int(n) - 1]
        if sets_only and isinstance(value, int):
            raise ActionError(f"{ref} is a number, not a set of entities")
        return ref, value

    def _operand(self, text: str, sets_only: bool = False) -> tuple[str, tuple[str, ...]]:
        """``(label, entities)`` of an entity name or a result reference."""
        text = text.strip().strip("'\"")
        if text.startswith("#"):
            return self._var(text, sets_only)
        index = self.state.spec.graph.graph["index"]
        name = index.get(" ".join(text.lower().split()))
        if name is None:
            close = difflib.get_close_matches(text.lower(), list(index), n=3)
            hint = f" (did you mean {', '.join(index[c] for c in close)}?)" if close else ""
            raise ActionError(f"no entity named {text[:60]!r}{hint}")
        return name, (name,)

    # --- expert and exploration ---------------------------------------------------------
    def expert_action(self) -> str | None:
        """The first program step whose result the agent does not have yet (matched by value,
        so exploration the agent did counts), with the program's ``#j`` mapped to the agent's
        results; then the answer."""
        s = self._require()
        if s.done:
            return None
        spec, have, need = s.spec, list(s.vars), Counter()
        where = lambda v: f"#{len(have) - have[::-1].index(v)}"  # noqa: E731  (the latest copy)
        for i, step in enumerate(spec.program):
            if i < len(spec.values):
                need[spec.values[i]] += 1  # steps with equal results need one copy each
                if have.count(spec.values[i]) >= need[spec.values[i]]:
                    continue
            return _renumber(step, lambda j: where(spec.values[j - 1]))
        return None  # pragma: no cover - the program always ends with an answer

    def valid_actions(self) -> list[str]:
        """Relations and one-hop neighbours of the question's entities and of the results, and
        answering with each result."""
        s = self._require()
        if s.done:
            return []
        g = s.spec.graph
        out = []
        anchors = [(a, (a,)) for a in s.spec.anchors]
        anchors += [(f"#{i}", v) for i, v in enumerate(s.vars, 1) if not isinstance(v, int) and v]
        for label, entities in anchors:
            out.append(f"relations: {label}")
            out += [f"neighbors: {label}, {r}" for r in sorted(relations_of(g, entities))]
        return out[:40] + [f"answer: #{i}" for i in range(1, len(s.vars) + 1)]

    # --- task sets ------------------------------------------------------------------------
    @staticmethod
    def make_task(data: dict[str, Any], split: str, task_id: str) -> Task:
        spec_of(data)
        return Task(env="kgqa", task_id=task_id, split=split, seed=0, data=data, instruction=(
            f"Answer this question using the knowledge graph: {data['question']} Explore it with "
            "`relations: ENTITY` and `neighbors: ENTITY, RELATION` (results are stored as #1, #2, "
            "...), combine results with `intersect` and `count`, and finish with `answer: #N`."))

    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        return _TASKS.take(split, limit)

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        data: dict[str, Any] = {"question": text_field(row, "question")}
        for key in ("graph_seed", "triples", "program", "answer"):
            if key in row:
                data[key] = row[key]
        spec = spec_of(data)
        return cls.make_task(data, row.get("split", "test"), task_id_of(row, f"kgqa-{spec.key}"))


def _renumber(action: str, ref) -> str:
    """``action`` with each ``#j`` replaced by ``ref(j)``."""
    return re.sub(r"#(\d+)", lambda m: ref(int(m.group(1))), action)


def spec_of(data: dict[str, Any]) -> KgSpec:
    """The prepared task of ``data``; raise ``ValueError(reason)`` when it is unusable."""
    return _spec(json.dumps(data, sort_keys=True))


@lru_cache(maxsize=64)
def _graph(seed: int) -> nx.MultiDiGraph:
    return make_graph(seed)


@lru_cache(maxsize=4096)
def _spec(data_json: str) -> KgSpec:
    data = json.loads(data_json)
    if "triples" in data:
        g = graph_of(data["triples"])
    elif type(data.get("graph_seed")) is int and data["graph_seed"] >= 0:
        g = _graph(data["graph_seed"])
    else:
        raise ValueError("give triples ([head, relation, tail] lists) or graph_seed (an integer >= 0)")
    program = data.get("program")
    if program is None:
        answer = data.get("answer")
        if not (isinstance(answer, list) and answer and all(isinstance(a, (str, int)) for a in answer)):
            raise ValueError("give program (a list of actions ending with answer) or answer (a list of names)")
        program = [f"answer: {', '.join(map(str, answer))}"]
    if not (isinstance(program, list) and program and all(isinstance(p, str) for p in program)):
        raise ValueError("program must be a non-empty list of actions (strings)")
    env = KgqaEnv()
    base = KgSpec(stable_hash(data_json), g, tuple(program), (), (), ())
    env.state = KgState(base, limit=len(program) + 1)
    for i, step in enumerate(program, 1):
        verb = parse_action(step, KgqaEnv.verbs)[0] if step.strip() else ""
        if (verb == "answer") != (i == len(program)):
            raise ValueError("program must end with its only `answer: ...` step")
        result = env.step(step)
        if not result.valid:
            raise ValueError(f"program step {i} ({step!r}) fails: {result.observation.splitlines()[0]}")
    s = env.state
    if not s.answer or (len(s.answer.split(", ")) > 8) or s.answer == "0":
        raise ValueError(f"the answer must be 1 to 8 entities or a positive count, got {s.answer!r}")
    if "answer" in data and "program" in data:
        expected = tuple(sorted({norm_cell(a) for a in data["answer"]}))
        if ", ".join(expected) != s.answer:
            raise ValueError(f"answer {data['answer']!r} is not what the program gives ({s.answer})")
    anchors = tuple(dict.fromkeys(g.graph["index"][e.lower()] for step in program[:-1]
                                  for e in _entities(step)))
    return base._replace(values=s.vars, gold=tuple(s.answer.split(", ")), anchors=anchors)


def _entities(step: str) -> list[str]:
    """The entity operands (not result references) of a program step."""
    verb, arg = parse_action(step, KgqaEnv.verbs)
    if verb == "neighbors":
        arg = arg.rpartition(",")[0]
    return [a.strip() for a in arg.split(",") if a.strip() and not a.strip().startswith("#")
            and verb in ("relations", "neighbors")]


def _make_tasks(seed: int, split: str) -> list[Task]:
    """Up to ``QUESTIONS_PER_GRAPH`` questions on the graph of ``seed`` (bad draws redrawn)."""
    rng, g = random.Random(f"kgqa:{seed}"), _graph(seed)
    pools = _pools(g)
    tasks = []
    for j, (text, program) in enumerate(rng.sample(TEMPLATES, QUESTIONS_PER_GRAPH)):
        for _ in range(20):
            picks: dict[str, str] = {}
            fields = {f for part in (text, *program) for _, f, _, _ in string.Formatter().parse(part) if f}
            for name in sorted(fields):
                choices = [e for e in pools[name.rstrip("0123456789")] if e not in picks.values()]
                picks[name] = rng.choice(choices)
            data = {"graph_seed": seed, "question": text.format(**picks),
                    "program": [p.format(**picks) for p in program]}
            try:
                tasks.append(KgqaEnv.make_task(data, split, f"kgqa-{seed}-{j}"))
                break
            except ValueError:
                continue
    return tasks


_TASKS = SeededTasks("kgqa", _make_tasks, {"train": 500, "test": 50})
