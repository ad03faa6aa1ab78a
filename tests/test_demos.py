"""Demonstrations that teach: ``env.explain(action, rng)`` and the oracle's ``Think:`` line.

The expert's thought is the reasoning its move follows from, in the state before the move
(Game24 / Countdown: the arithmetic, what is left and how the target is still reached; Sokoban:
which box goes to which target), one line, worded by one of a few templates the caller's rng
picks (deterministic for a seed). The scripted oracle writes it for the expert's action and
"Trying another step." for its deviations; oracle demos survive an OpenManus-RL round trip.
"""
from __future__ import annotations

import json
import random
import re
from fractions import Fraction

import pytest

import omrl_search as om
from envs._arith_lang import spell
from envs.arith import fmt, read_action, solvable, solve
from omrl_search.backends.scripted import OraclePolicy
from omrl_search.env import env_class, list_envs, make_env, winning_actions
from omrl_search.policy import PolicyError, make_policy
from omrl_search.exports import openmanus_rows, sft_rows


def _rollout(name: str, task, seed: int = 0):
    """``(env state before, expert action, explanation)`` along the expert's path."""
    env, rng, out = make_env(name), random.Random(seed), []
    env.reset(task)
    while (action := env.expert_action()) is not None:
        out.append((env.state, action, env.explain(action, rng)))
        env.step(action)
    env.close()
    return out


def _value(expression: str) -> Fraction:
    """An expression of the thoughts (exact; negative numbers in parentheses allowed)."""
    assert re.fullmatch(r"[-\d/()+* ]+", expression), expression
    return eval(re.sub(r"(\d+)", r"Fraction(\1)", expression))  # noqa: S307 - digits and operators only


def _one_line(text) -> bool:
    return isinstance(text, str) and text.strip() == text and text and "\n" not in text


@pytest.mark.parametrize("name", ["game24", "countdown"])
def test_arith_thoughts_say_the_arithmetic_and_the_rest(name):
    wordings = set()
    for i, task in enumerate(om.load_tasks(name, "test", limit=15)):
        for state, action, why in _rollout(name, task, seed=i):
            assert _one_line(why), why
            _, a, op, b, value, rest = read_action(action, state.numbers)
            assert all(fmt(x) in why for x in (a, b, value, state.target)), (action, why)
            if len(rest) > 1:  # what is left, and a way from there to the target
                plan = spell(solve(rest, state.target))
                assert plan in why and _value(plan) == state.target, why
                assert all(fmt(x) in why for x in rest), why
            else:
                assert value == state.target
            wordings.add(re.sub(r"[-\d/()+* ]+", " ", why)[:25])
    assert len(wordings) >= 3  # the wording varies


def test_game24_thought_example():
    env = make_env("game24")
    env.reset(env.task_from_dict({"numbers": [1, 1, 3, 8]}))
    assert env.explain("8 * 3") == "8 * 3 = 24, leaving 1, 1 and 24; (1 + 24) - 1 = 24 finishes it."
    assert env.explain("1 + 1") == "1 + 1 = 2, leaving 2, 3 and 8; I still need 24 from them."
    env.step("1 * 1")
    env.step("8 * 3")
    assert env.explain("24 * 1") == "24 * 1 = 24, the target, using the last two numbers."
    assert env.explain("24 + 1") == "24 + 1 = 25, the last number, though the target is 24."
    assert env.explain("gibberish") is None and env.explain("5 + 5") is None  # refused moves


def test_sokoban_thoughts_name_a_box_and_its_target():
    for task in om.load_tasks("sokoban", "test", limit=15):
        for state, action, why in _rollout("sokoban", task):
            assert _one_line(why), why
            cell = lambda what: tuple(map(int, re.search(what + r" (?:is )?at row (\d+), column (\d+)", why).groups()))  # noqa: E731
            box, target = cell("box"), cell("target")
            assert box in state.boxes, (why, state.boxes)
            assert state.layout[target[0]][target[1]] == "O", why
            assert action in why


@pytest.mark.parametrize("name", ["game24", "sokoban", "countdown"])
def test_wording_is_deterministic_for_a_seed(name):
    task = om.load_tasks(name, "test", limit=3)[2]
    assert _rollout(name, task, seed=5) == _rollout(name, task, seed=5)
    texts = {tuple(w for _, _, w in _rollout(name, task, seed=s)) for s in range(8)}
    assert len(texts) > 1


@pytest.mark.parametrize("name", [n for n in list_envs() if n != "sciworld"])
def test_every_expert_step_has_a_one_line_reason(name):
    env = make_env(name)
    if not hasattr(env, "explain"):
        pytest.skip(f"env {name!r} has no explain")
    rng = random.Random(1)
    for task in env_class(name).tasks("test", limit=2):
        env.reset(task)
        for _ in range(40):
            action = env.expert_action()
            if action is None:
                break
            why = env.explain(action, rng)
            assert _one_line(why), (action, why)
            assert not why.startswith(("I try", "Let me try", "Next I try")), (action, why)
            env.step(action)
    env.close()


# --- the oracle's Think: line -------------------------------------------------------------------
def _thoughts(results):
    return [n.step.thought for r in results for n in r.tree.nodes if n.step is not None]


def test_oracle_thinks_the_env_explanation():
    tasks = om.load_tasks("game24", "test", limit=6)
    results = om.search_many(tasks, strategy="react", policy="scripted:oracle:p=0")
    thoughts = _thoughts(results)
    assert all(r.success for r in results)
    assert "Following the plan." not in thoughts and len(set(thoughts)) > len(thoughts) // 2
    assert all("24" in t for t in thoughts)
    again = om.search_many(tasks, strategy="react", policy="scripted:oracle:p=0")
    assert _thoughts(again) == thoughts  # seeded: the same words
    mixed = om.search_many(tasks, strategy="best_of_n:n=4", policy="scripted:oracle:p=0.5")
    assert "Trying another step." in _thoughts(mixed)


def test_oracle_falls_back_without_explain():
    class Plain:  # an env without explain (nor an inner one)
        pass

    assert OraclePolicy.reason(Plain(), "up", random.Random(0)) == "Following the plan."


# --- expert=any: every winning action, one drawn -------------------------------------------------
def test_winning_actions_are_the_moves_that_keep_the_task_solvable():
    env, rng = make_env("countdown"), random.Random(3)
    sizes = set()
    for task in om.load_tasks("countdown", "test", limit=12):
        env.reset(task)
        while not env.state.done:
            before = env.state
            won = winning_actions(env)
            assert env.state == before  # every try undone
            for action in dict.fromkeys(env.valid_actions()):
                snap = env.snapshot()
                env.step(action)
                after = env.state  # the solver decides, independently of exact_value
                still = after.success if after.done else solvable(after.numbers, after.target)
                assert (action in won) == still, (before, action)
                env.restore(snap)
            assert env.expert_action() in won  # the solver's move is one of them
            sizes.add(len(won))
            env.step(won[rng.randrange(len(won))])
        assert env.state.success  # any winning move keeps a way to the target
    assert max(sizes) > 1  # states with several ways on were met
    sokoban = make_env("sokoban")
    with pytest.raises(TypeError, match="exact_value"):
        winning_actions(sokoban)
    env.close()
    sokoban.close()


def test_oracle_expert_any_draws_among_the_winning_actions():
    tasks = om.load_tasks("game24", "test", limit=8)
    solver = om.search_many(tasks, strategy="react", policy="scripted:oracle:p=0", agent="act")
    spec = "scripted:oracle:p=0,expert=any"
    anyone = om.search_many(tasks, strategy="react", policy=spec, agent="act")
    assert all(r.success for r in solver) and all(r.success for r in anyone)
    actions = lambda rs: [[n.step.action for n in r.tree.nodes if n.step] for r in rs]  # noqa: E731
    assert actions(anyone) != actions(solver)  # other ways than the solver's first move
    assert actions(om.search_many(tasks, strategy="react", policy=spec, agent="act")) == actions(anyone)
    # the probability it gives each action: uniform over the winning ones, 0 elsewhere
    policy, env = make_policy(spec), make_env("game24")
    env.reset(tasks[0])
    won = winning_actions(env)
    assert len(won) > 1
    probs = {a: policy.action_prob(env, a) for a in env.valid_actions()}
    assert probs == {a: (1 / len(won) if a in won else 0.0) for a in env.valid_actions()}
    assert OraclePolicy().action_prob(env, env.expert_action()) == 1.0  # the solver's alone
    with pytest.raises(PolicyError, match="expert must be one of solver, any"):
        make_policy("scripted:oracle:expert=best")
    sokoban = om.load_tasks("sokoban", "test", limit=1)
    with pytest.raises(PolicyError, match="expert=any: env 'sokoban' does not offer exact_value"):
        make_policy(spec).action_prob(_reset(make_env("sokoban"), sokoban[0]), "up")
    env.close()


def _reset(env, task):
    env.reset(task)
    return env


def test_oracle_demos_round_trip_through_openmanus(tmp_path):
    results = om.search_many(om.load_tasks("countdown", "test", limit=4), policy="scripted:oracle:p=0")
    rows = sft_rows(results)
    assert len(rows) == 4
    src = tmp_path / "om.jsonl"
    turns = [[{"role": m["role"], "content": m["content"]} for m in r["messages"]] for r in rows]
    src.write_text("".join(json.dumps({"id": r["task_id"], "conversations": t}) + "\n"
                           for r, t in zip(rows, turns)))
    back = openmanus_rows(src)
    assert [b["messages"] for b in back] == turns
    replies = [m["content"] for b in back for m in b["messages"] if m["role"] == "assistant"]
    assert all(re.match(r"Think: [^\n]*\d[^\n]*\nAct: \S", c) for c in replies)
    assert not any("Following the plan." in c for c in replies)


# --- examples/tot_game24: ToT's Game24 propose / value pair through the public API -------------
def _tot_example():
    from helpers import load_script

    return load_script("examples/tot_game24/tot_game24.py", "tot_game24_example")


def test_tot_game24_example_parses_proposals_and_answers():
    ex = _tot_example()
    text = "3 + 5 = 8 (left: 7 8 13)\n7 / 3 = 7/3 (left: 7/3 5 13)\n8/3 * 9 = 24 (left: 24)\nnoise\n"
    assert ex.parse_proposals(text) == ["3 + 5", "7 / 3", "8/3 * 9"]
    assert ex.parse_proposals("Answer: (6 - 4) * (4 + 8) = 24") == ["answer (6 - 4) * (4 + 8)"]
    assert ex.numbers_left("7 / 3 = 7/3\nNumbers left: 5 7/3 13 | target: 24") == ["5", "7/3", "13"]


def test_tot_game24_example_runs_the_papers_protocol():
    ex = _tot_example()
    game24 = env_class("game24")
    tasks = [game24.task_from_dict({"numbers": n, "answer_step": True}) for n in ([1, 5, 5, 5], [3, 3, 8, 8])]
    tasks += om.load_tasks("game24", "test:answer=on", limit=4)
    policy, strat = ex.ScriptedToT(), ex.strategy()
    results = om.search_many(tasks, strategy=strat, policy=policy)
    kinds = [p.split("\n", 1)[0].split()[0] for p in policy.prompts]
    assert {"Use", "Rewrite", "Evaluate", "Judge"} == set(kinds)
    for r in results:
        steps = r.best_trajectory.steps
        assert r.success and len(steps) == 4 and steps[-1].action.startswith("answer ")
        assert all(s.valid for s in steps)
        root = r.tree.nodes[0]
        first = ex.parse_proposals(ex.ScriptedToT.answer(ex.propose_prompt(None, root)))
        assert len(root.children) == (len(first) if strat.k is None else min(strat.k, len(first)))
    fractions = [s.action for r in results[:2] for s in r.best_trajectory.steps]
    assert any(re.search(r"\d/\d", a) for a in fractions)  # 1 5 5 5 and 3 3 8 8 need fractions
    one = ex.ScriptedToT()
    om.search(tasks[0], strategy=ex.strategy(), policy=one)
    values = [p for p in one.prompts if p.startswith("Evaluate")]
    assert len(values) == len(set(values)) > 1  # cached by prompt: equal numbers left, one call
    again = om.search_many(tasks, strategy=ex.strategy(), policy=ex.ScriptedToT())
    assert [r.best_trajectory.to_dict()["node_ids"] for r in again] == \
        [r.best_trajectory.to_dict()["node_ids"] for r in results]
