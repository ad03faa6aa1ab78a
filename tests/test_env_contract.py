"""The property test every registered env passes (docs/design.md §4), for each snapshot kind it
supports.

Snapshot -> step -> restore gives back the same observation and state key; branches from one
snapshot never leak into each other; snapshots restore into fresh instances; replay divergence
is detected; the expert solves the first test tasks (``terminated and success``); malformed
actions never raise (``valid is False``); the step limit truncates. Step results carry Gymnasium's
``terminated``/``truncated`` and the typed ``success``/``valid``, never ``success``/``valid``
keys in ``info``; a legacy env that still puts them there (and passes ``done=``) is read as before.
"""
from __future__ import annotations

import sys

import pytest

from omrl_search.env import (
    Env,
    EnvError,
    ReplayDivergence,
    ReplayEnv,
    ValueSnapshots,
    env_class,
    iter_valid_kinds,
    list_envs,
    make_env,
)
from omrl_search.types import StepResult, Task

ENVS = list_envs()
CASES = [(name, kind) for name in ENVS for kind in iter_valid_kinds(name)]
MALFORMED = ["", "gibberish", "answer (", "99 * 99", "   ", "up up up down", "4 ** 6", "answer __import__('os')"]


def _tasks(name: str, n: int = 3) -> list[Task]:
    try:
        return env_class(name).tasks("test", limit=n)
    except NotImplementedError:
        pytest.skip(f"env {name!r} has no built-in test tasks")


def _restorable(name: str) -> None:
    if not env_class(name).can_restore:
        pytest.skip(f"env {name!r} refuses to be restored")


def _has_expert(name: str) -> bool:
    return env_class(name).expert_action is not Env.expert_action


def _typed(result: StepResult) -> StepResult:
    """Check the typed fields of a bundled env's step result; return it."""
    assert isinstance(result, StepResult)
    assert all(type(getattr(result, f)) is bool for f in ("terminated", "truncated", "success", "valid"))
    assert result.done == (result.terminated or result.truncated)
    assert not (result.terminated and result.truncated)
    assert "success" not in result.info and "valid" not in result.info, result.info
    assert result.done or not result.success
    return result


def _two_actions(env: Env) -> tuple[str, str]:
    """Two different actions from the current state: the expert's (or an admissible one) and another."""
    candidates = [env.expert_action(), *(env.valid_actions() or []), "gibberish"]
    first = next(a for a in candidates if a is not None)
    return first, [a for a in candidates if a is not None and a != first][-1]


def test_builtin_envs_registered():
    assert {"game24", "countdown", "sokoban"} <= set(ENVS)


@pytest.mark.parametrize("name,kind", CASES)
def test_snapshot_step_restore_roundtrip(name, kind):
    _restorable(name)
    env = make_env(name, snapshots=kind)
    for task in _tasks(name):
        obs0 = env.reset(task)
        s0 = env.snapshot()
        assert s0.kind == kind and s0.observation == obs0 == env.observe()
        assert s0.state_key == env.state_key()
        for action in _two_actions(env) + ("gibberish",):
            result = _typed(env.step(action))
            assert result.observation == env.observe()
            env.restore(s0)
            assert env.observe() == obs0
            assert env.state_key() == s0.state_key


@pytest.mark.parametrize("name,kind", CASES)
def test_branches_do_not_leak(name, kind):
    _restorable(name)
    env = make_env(name, snapshots=kind)
    for task in _tasks(name):
        env.reset(task)
        s0 = env.snapshot()
        a, b = _two_actions(env)
        ra = _typed(env.step(a))
        sa = env.snapshot()
        obs_a, key_a = env.observe(), env.state_key()
        env.restore(s0)
        env.step(b)
        obs_b, key_b = env.observe(), env.state_key()
        if obs_b != obs_a:  # the key must tell apart states that look different
            assert key_b != key_a
        env.restore(sa)
        assert (env.observe(), env.state_key()) == (obs_a, key_a)
        env.restore(s0)
        ra2 = _typed(env.step(a))
        assert (ra2.observation, ra2.reward, ra2.terminated, ra2.truncated, ra2.success, ra2.valid) \
            == (ra.observation, ra.reward, ra.terminated, ra.truncated, ra.success, ra.valid)
        assert (env.observe(), env.state_key()) == (obs_a, key_a)
        env.restore(s0)  # and the b branch is still reachable unchanged
        env.step(b)
        assert (env.observe(), env.state_key()) == (obs_b, key_b)


@pytest.mark.parametrize("name,kind", CASES)
def test_snapshot_restores_into_fresh_instance(name, kind):
    _restorable(name)
    env = make_env(name, snapshots=kind)
    task = _tasks(name, 1)[0]
    env.reset(task)
    env.step(_two_actions(env)[0])
    snap = env.snapshot()
    fresh = make_env(name, snapshots=kind)
    fresh.restore(snap)
    assert (fresh.observe(), fresh.state_key()) == (env.observe(), env.state_key())
    action = _two_actions(env)[0]
    assert _two_actions(fresh)[0] == action
    r1, r2 = _typed(env.step(action)), _typed(fresh.step(action))
    fields = lambda r: (r.observation, r.reward, r.terminated, r.truncated, r.success, r.valid, r.info)  # noqa: E731
    assert fields(r1) == fields(r2)
    assert fresh.state_key() == env.state_key()


@pytest.mark.parametrize("name", ENVS)
def test_snapshot_kinds_are_not_interchangeable(name):
    _restorable(name)
    if env_class(name).snapshot_kind == "replay":
        pytest.skip(f"env {name!r} snapshots by replay only: there is no second kind to mix up")
    task = _tasks(name, 1)[0]
    native, replay = make_env(name), make_env(name, snapshots="replay")
    native.reset(task)
    replay.reset(task)
    with pytest.raises(EnvError):
        replay.restore(native.snapshot())
    with pytest.raises(EnvError):
        native.restore(replay.snapshot())


@pytest.mark.parametrize("name", ENVS)
def test_expert_solves_first_test_tasks(name):
    if not _has_expert(name):
        pytest.skip(f"env {name!r} has no expert solver")
    env = make_env(name)
    tasks = _tasks(name, 20)
    assert len(tasks) == 20
    for task in tasks:
        env.reset(task)
        result = None
        while result is None or not result.done:
            action = env.expert_action()
            assert action is not None, f"expert gave up on {task.task_id}"
            result = _typed(env.step(action))
            assert result.valid is True
        assert result.terminated and result.success and result.reward == 1.0, task.task_id
        assert isinstance(result.info["answer"], str)
        assert env.expert_action() is None


@pytest.mark.parametrize("name,kind", CASES)
def test_malformed_actions_never_raise(name, kind):
    env = make_env(name, snapshots=kind)
    task = _tasks(name, 1)[0]
    for action in MALFORMED:
        env.reset(task)
        result = _typed(env.step(action))
        assert result.valid is False and result.reward == 0.0 and not result.done
        assert result.observation.startswith("Invalid action:")
        if _has_expert(name):  # the puzzle itself is untouched
            assert env.expert_action() is not None


@pytest.mark.parametrize("name", ENVS)
def test_episode_ends_after_its_step_limit(name):
    env = make_env(name)
    env.reset(_tasks(name, 1)[0])
    for n in range(1, env.max_steps + 1):
        result = _typed(env.step("gibberish"))
        assert result.valid is False
        if result.done:
            break
    assert result.truncated and not result.terminated  # cut by the limit, no end state reached
    assert result.success is False and result.reward == 0.0
    assert n <= env.max_steps
    after = _typed(env.step(env.valid_actions()[0] if env.valid_actions() else "gibberish"))
    assert after.valid is False and after.observation.startswith("Invalid action:")
    assert (after.terminated, after.truncated, after.success) == (False, True, False)  # still over


@pytest.mark.parametrize("name", ENVS)
def test_step_before_reset_raises_env_error(name):
    with pytest.raises(EnvError):
        make_env(name).step("anything")
    with pytest.raises(EnvError):
        make_env(name).snapshot()


@pytest.mark.parametrize("name", ENVS)
def test_task_sets_deterministic_and_disjoint(name):
    cls = env_class(name)
    _tasks(name, 1)  # skips envs without built-in tasks
    train, test = cls.tasks("train"), cls.tasks("test")
    assert train and test
    assert [t.task_id for t in cls.tasks("test", limit=5)] == [t.task_id for t in test[:5]]
    assert cls.tasks("test") == test  # same call, same list
    key = lambda t: repr(sorted(t.data.items()))  # noqa: E731
    assert not {key(t) for t in train} & {key(t) for t in test}
    assert not {t.task_id for t in train} & {t.task_id for t in test}
    assert all(t.split == "train" for t in train) and all(t.split == "test" for t in test)
    assert all(t.env == name and t.instruction for t in train + test)
    assert len({t.task_id for t in test}) == len(test)


# --- replay divergence, with a test-only env that is not deterministic ------------------------
BONUS = 0  # read by DriftEnv.step; changing it makes a replay reach another state


class DriftEnv(ValueSnapshots, Env):
    """A counter whose increment reads a module global (not registered)."""

    name = "drift"

    def reset(self, task: Task) -> str:
        self.state = 0
        return self.observe()

    def step(self, action: str) -> StepResult:
        self.state = self.state + 1 + BONUS
        return StepResult(self.observe(), 0.0, False, info={"valid": True})

    def observe(self) -> str:
        return f"count {self.state}"


def test_replay_divergence_is_detected(monkeypatch):
    env = ReplayEnv(DriftEnv())
    env.reset(Task(env="drift", task_id="drift-0"))
    env.step("tick")
    env.step("tick")
    snap = env.snapshot()
    env.restore(snap)  # deterministic so far: fine
    assert env.observe() == "count 2"
    monkeypatch.setattr(sys.modules[__name__], "BONUS", 1)
    with pytest.raises(ReplayDivergence):
        env.restore(snap)


# --- a third-party env written before the typed fields ----------------------------------------
class LegacyEnv(ValueSnapshots, Env):
    """Puts ``success``/``valid`` in ``info`` and passes ``done=`` (not registered)."""

    name = "legacy"

    def reset(self, task: Task) -> str:
        self.state = "Say win."
        return self.observe()

    def step(self, action: str) -> StepResult:
        if action != "win":
            return StepResult("Invalid action: say win.", 0.0, done=False, info={"valid": False})
        self.state = "You win."
        return StepResult(self.state, 1.0, done=True, info={"success": True, "valid": True, "answer": "won"})

    def observe(self) -> str:
        return self.state


@pytest.mark.parametrize("wrap", [False, True])
def test_legacy_info_keys_and_done_are_read_as_the_typed_fields(wrap):
    env = ReplayEnv(LegacyEnv()) if wrap else LegacyEnv()
    env.reset(Task(env="legacy", task_id="legacy-0"))
    bad = env.step("lose")
    assert (bad.valid, bad.success, bad.terminated, bad.truncated, bad.done) == (False, False, False, False, False)
    won = env.step("win")
    assert (won.valid, won.success, won.terminated, won.truncated, won.done) == (True, True, True, False, True)
    assert won.info["answer"] == "won"


def test_legacy_positional_one_flag_signature():
    """``StepResult(obs, reward, done, info)`` (the one-flag order) keeps its info and flags."""
    res = StepResult("Invalid action.", 0.0, False, {"valid": False})
    assert (res.valid, res.truncated, res.terminated, res.info) == (False, False, False, {"valid": False})
    res = StepResult("Solved.", 1.0, True, {"success": True, "answer": "24"})
    assert (res.success, res.terminated, res.done, res.info["answer"]) == (True, True, True, "24")
