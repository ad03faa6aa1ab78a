"""RemoteEnv maps each server's ``/step`` answer onto StepResult's typed fields.

An omrl server sends ``terminated``/``truncated``/``success``/``valid``; an older one sent
``done`` with ``success``/``valid`` in ``info``; AgentGym servers send ``done`` and a reward
(success decided per AgentGym env, as its evaluation does, or by ``success_score``). Answers come from a scripted HTTP stand-in, so
no server runs here (tests/test_env_server.py runs real ones).
"""
from __future__ import annotations

import pytest

from envs._agentgym import Profile
from envs.remote import RemoteEnv
from omrl_search.types import Task


class ScriptedHttp:
    """Answers calls in order, recording them."""

    url = "http://scripted"

    def __init__(self, *answers):
        self.answers, self.calls = list(answers), []

    def call(self, method, path, body=None, **params):
        self.calls.append((method, path, body))
        return self.answers.pop(0)


def _stepped(env: RemoteEnv, http: ScriptedHttp, task: Task):
    env.reset(task)
    result = env.step("act")
    assert http.calls[-1][:2] == ("POST", "/step") and not http.answers
    return result


def _omrl(step_answer: dict):
    http = ScriptedHttp({"observation": "start", "state_key": "k0"},
                        {"observation": "after", "reward": 0.0, "state_key": "k1", **step_answer})
    env = RemoteEnv(http.url, "game24", http=http, info={"env": "game24"}, _env_id=1)
    return _stepped(env, http, Task("game24", "t0"))


def fields(r):
    return r.terminated, r.truncated, r.success, r.valid, r.done, r.info


@pytest.mark.parametrize("answer, expected", [
    ({"done": True, "terminated": True, "truncated": False, "success": True, "valid": True,
      "info": {"answer": "24"}}, (True, False, True, True, True, {"answer": "24"})),
    ({"done": True, "terminated": False, "truncated": True, "success": False, "valid": False,
      "info": {"answer": ""}}, (False, True, False, False, True, {"answer": ""})),
    ({"done": False, "terminated": False, "truncated": False, "success": False, "valid": False,
      "info": {}}, (False, False, False, False, False, {})),
    # a server from before the typed fields: done, and success/valid in info (taken out of it)
    ({"done": True, "info": {"success": True, "valid": True, "answer": "24"}},
     (True, False, True, True, True, {"answer": "24"})),
    ({"done": False, "info": {"valid": False}}, (False, False, False, False, False, {})),
])
def test_omrl_server_answers_map_onto_the_typed_fields(answer, expected):
    assert fields(_omrl(answer)) == expected


@pytest.mark.parametrize("reward, done, expected", [
    (1.0, True, (True, False, True, True, True, {"score": 1.0})),
    (0.0, True, (True, False, False, True, True, {"score": 0.0})),
    (1.0, False, (False, False, False, True, False, {"score": 1.0})),  # not over: no success yet
])
def test_agentgym_done_is_terminated_and_success_is_the_score(reward, done, expected):
    http = ScriptedHttp({"observation": "start"}, {"observation": "after", "reward": reward, "done": done})
    env = RemoteEnv(http.url, "walk", dialect="agentgym", http=http, profile=Profile(None), _env_id=1)
    assert fields(_stepped(env, http, Task("walk", "b0", data={"data_idx": 0}))) == expected


# --- success the way AgentGym's evaluation decides it, per env --------------------------------
@pytest.mark.parametrize("name, answer, success", [
    ("BabyAI", {"reward": 0.64, "score": 0.64, "done": True}, True),  # 1 - 0.9 * steps / limit
    ("BabyAI", {"reward": 0.0, "score": 0.0, "done": True}, False),
    ("BabyAI", {"reward": 0.9, "score": 0.9, "done": False}, False),
    ("SciWorld", {"reward": 25, "score": 100, "done": True}, True),
    ("SciWorld", {"reward": 8, "score": 83, "done": True}, False),
    ("TextCraft", {"reward": 1, "done": True}, True),
    ("TextCraft", {"reward": 0, "done": True}, False),
    ("WebShop", {"reward": 1.0, "done": True}, True),
    ("WebShop", {"reward": 0.75, "done": True}, False),
])
def test_success_is_decided_per_agentgym_env(name, answer, success):
    http = ScriptedHttp({"observation": "start"}, {"observation": "after", **answer})
    env = RemoteEnv(http.url, "x", dialect="agentgym", http=http, profile=Profile(name), _env_id=1)
    task = Task("x", "t", instruction="do it", data={"data_idx": 0})  # no instruction to fetch
    assert _stepped(env, http, task).success is success


def test_an_omrl_server_in_agentgym_dialect_says_success_itself():
    http = ScriptedHttp({"observation": "s"}, {"observation": "a", "reward": 1.0, "done": True,
                                               "success": False})
    env = RemoteEnv(http.url, "x", dialect="agentgym", http=http,
                    profile=Profile("game24", ours=True, env="game24"), _env_id=1)
    assert _stepped(env, http, Task("x", "t", instruction="i", data={"data_idx": 0})).success is False


def test_success_score_overrides_the_profile():
    http = ScriptedHttp({"observation": "s"}, {"observation": "a", "reward": 0.64, "score": 0.64, "done": True})
    env = RemoteEnv(http.url, "x", dialect="agentgym", http=http, profile=Profile("BabyAI"),
                    success_score=1.0, _env_id=1)
    assert _stepped(env, http, Task("x", "t", data={"data_idx": 0})).success is False
