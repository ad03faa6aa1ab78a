"""RemoteEnv maps each server's ``/step`` answer onto StepResult's typed fields.

An omrl server sends ``terminated``/``truncated``/``success``/``valid``; an older one sent
``done`` with ``success``/``valid`` in ``info``; AgentGym servers send ``done`` and a reward
(success by the env's own rule or AgentGym's evaluation, both reported, or by ``success_score``). Answers come from a scripted HTTP stand-in, so
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


def _verdicts(score, env, agentgym):
    return {"score": score, "success_env": env, "success_agentgym": agentgym}


@pytest.mark.parametrize("reward, done, expected", [
    (1.0, True, (True, False, True, True, True, _verdicts(1.0, True, True))),
    (0.0, True, (True, False, False, True, True, _verdicts(0.0, False, False))),
    (1.0, False, (False, False, False, True, False, _verdicts(1.0, False, False))),  # not over yet
])
def test_agentgym_done_is_terminated_and_success_is_the_score(reward, done, expected):
    http = ScriptedHttp({"observation": "start"}, {"observation": "after", "reward": reward, "done": done})
    env = RemoteEnv(http.url, "walk", dialect="agentgym", http=http, profile=Profile(None), _env_id=1)
    assert fields(_stepped(env, http, Task("walk", "b0", data={"data_idx": 0}))) == expected


# --- success per AgentGym env: the env's own rule (default) and AgentGym's evaluation ------------
@pytest.mark.parametrize("name, answer, env_rule, agentgym_rule", [
    # BabyAI's reward is 1 - 0.9 * steps / limit: a success by BabyAI's rule, never by AgentGym's
    # (its evaluation counts a final reward of exactly 1 or 100; BabyAI's client reports the score)
    ("BabyAI", {"reward": 0.8875, "score": 0.8875, "done": True}, True, False),
    ("BabyAI", {"reward": 0.0, "score": 0.0, "done": True}, False, False),
    ("BabyAI", {"reward": 0.9, "score": 0.9, "done": False}, False, False),
    ("SciWorld", {"reward": 25, "score": 100, "done": True}, True, True),
    ("SciWorld", {"reward": 8, "score": 83, "done": True}, False, False),
    ("TextCraft", {"reward": 1, "done": True}, True, True),
    ("TextCraft", {"reward": 0, "done": True}, False, False),
    ("WebShop", {"reward": 1.0, "done": True}, True, True),
    ("WebShop", {"reward": 0.75, "done": True}, False, False),
])
def test_success_by_the_envs_rule_and_by_agentgyms_evaluation(name, answer, env_rule, agentgym_rule):
    task = Task("x", "t", instruction="do it", data={"data_idx": 0})  # no instruction to fetch
    got = {}
    for rule in ("env", "agentgym"):
        http = ScriptedHttp({"observation": "start"}, {"observation": "after", **answer})
        env = RemoteEnv(http.url, "x", dialect="agentgym", http=http, profile=Profile(name),
                        success_rule=rule, _env_id=1)
        res = _stepped(env, http, task)
        assert (res.info["success_env"], res.info["success_agentgym"]) == (env_rule, agentgym_rule)
        got[rule] = res.success
    assert got == {"env": env_rule, "agentgym": agentgym_rule}


def test_an_unknown_success_rule_is_refused():
    with pytest.raises(ValueError, match="success_rule must be one of env, agentgym"):
        RemoteEnv("http://scripted", "x", dialect="agentgym", http=ScriptedHttp(), profile=Profile("BabyAI"),
                  success_rule="reward>0", _env_id=1)


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
