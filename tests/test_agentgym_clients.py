"""AgentGym's clients against ``omrl env serve``, on loopback: stand-ins written here from the
shapes of AgentGym's clients (``agentenv/envs/{babyai,sciworld,textcraft,webshop}.py``: the calls
they make, the fields they read, a missing one failing as it would there, and the BabyAI and
TextCraft clients' character filter on actions), so CI needs none of AgentGym's code. Their real
clients and servers were run once against ours (benchmarks/agentgym_real.py; docs/env_server.md
reports the run); tests/test_agentgym_interop.py has the other direction, RemoteEnv against
AgentGym-style servers.
"""
from __future__ import annotations

import json
import re

import httpx
import pytest
from test_env_server import serving  # noqa: E402 - the uvicorn-in-a-thread helper

import omrl_search as om
from envs.babyai import BabyAIEnv
from envs.server import create_app


# === AgentGym-style clients (stand-ins of agentenv.envs.*EnvClient) ============================
def agentgym_filter(action: str) -> str:
    """What AgentGym's BabyAI and TextCraft clients send of an action: every character but
    letters, digits, commas and spaces stripped, runs of spaces made one."""
    return " ".join(re.sub(r"[^A-Za-z0-9, ]+", "", action).split()).strip()


class IdClient:
    """The ``id`` clients' transport: POST /create, then bodies with ``id``; any status but 200
    fails (the real ones ``assert res.status_code == 200``)."""

    def __init__(self, base: str, create_body: dict | None = None):
        self.base = base
        ok = httpx.post(f"{base}/create", json=create_body, timeout=60)
        assert ok.status_code == 200, ok.text
        self.created = ok.json()
        self.env_id = self.created["id"]

    def _post(self, path: str, data: dict) -> dict:
        data["id"] = self.env_id
        res = httpx.post(f"{self.base}/{path}", json=data, timeout=60)
        assert res.status_code == 200, res.text
        return res.json()


class BabyAIClient(IdClient):
    """BabyAIEnvClient: the agent sees ``info["observation"]``; a step's reward is ``score``."""

    def reset(self, data_idx: int) -> dict:
        r = self._post("reset", {"data_idx": data_idx})
        self.info = {k: r[k] for k in ("observation", "reward", "score", "done")}
        return r

    def observe(self) -> str:
        return self.info["observation"]

    def step(self, action: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": agentgym_filter(action)})
        self.info = {k: r[k] for k in ("observation", "reward", "score", "done")}
        return r["observation"], r["score"], r["done"]


class SciworldClient(BabyAIClient):
    """SciworldEnvClient: the agent's first observation is ``task_description + "\\n" +
    observation`` of the reset answer."""

    def reset(self, data_idx: int) -> dict:
        r = self._post("reset", {"data_idx": data_idx})
        self.info = {"observation": r["task_description"] + "\n" + r["observation"],
                     "reward": 0, "score": 0, "done": False}
        return r


class TextCraftClient(IdClient):
    """TextCraftEnvClient: /create with a body, its answer's ``observation`` is the first one;
    a step's reward is ``reward``; it closes its env."""

    def __init__(self, base: str):
        super().__init__(base, {"minecraft_dir": "agentenv_textcraft/", "commands": None, "goal": None})
        self.info = {"observation": self.created["observation"], "reward": 0, "done": False}

    def reset(self, idx: int) -> dict:
        r = self._post("reset", {"data_idx": idx})
        self.info.update({"observation": r["observation"], "reward": 0, "done": False})
        return r

    def observe(self) -> str:
        return self.info["observation"]

    def step(self, action: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": agentgym_filter(action)})
        self.info = {"observation": r["observation"], "reward": r["reward"], "done": r["done"]}
        return r["observation"], r["reward"], r["done"]

    def close(self) -> dict:
        return self._post("close", {})


class WebshopClient:
    """WebshopEnvClient: /create answers the bare id; bodies and queries carry ``env_idx``; the
    reset answer's first item is replaced by GET /observation; a step answers ``state``."""

    def __init__(self, base: str):
        self.base = base
        ok = httpx.post(f"{base}/create", timeout=60)
        assert ok.status_code == 200, ok.text
        self.env_id = ok.json()

    def _post(self, path: str, data: dict):
        data["env_idx"] = self.env_id
        res = httpx.post(f"{self.base}/{path}", json=data, timeout=60)
        assert res.status_code == 200, res.text
        return res.json()

    def _get(self, path: str):
        res = httpx.get(f"{self.base}/{path}?env_idx={self.env_id}", timeout=60)
        assert res.status_code == 200, res.text
        return res.json()

    def observe(self) -> str:
        return self._get("observation")

    def reset(self, idx: int):
        response = self._post("reset", {"session_id": idx})
        response[0] = self.observe()
        return response

    def step(self, action: str) -> tuple[str, float, bool]:
        r = self._post("step", {"action": action})
        return r["state"], r["reward"], r["done"]


def _expert(base: str, key: str, env_id: int) -> str:
    """The test's agent: our server's expert (an extension AgentGym's clients do not know)."""
    return httpx.get(f"{base}/expert_action", params={key: env_id}, timeout=60).json()


def _play(client, base: str, key: str = "id", limit: int = 40) -> tuple[float, bool, int]:
    reward, done, steps = 0.0, False, 0
    while not done and steps < limit:
        _, reward, done = client.step(_expert(base, key, client.env_id))
        steps += 1
    return reward, done, steps


def _live(base: str) -> int:
    return httpx.get(f"{base}/health", timeout=10).json()["live_envs"]


# --- AgentGym's clients -> omrl env serve -------------------------------------------------------
def test_babyai_client_sees_its_goal_and_any_index_is_a_task():
    with serving(create_app("babyai")) as base:
        client = BabyAIClient(base)
        tasks = BabyAIEnv.tasks("test")
        for data_idx in (0, 1, 2, len(tasks) + 3):  # beyond the split: taken modulo its size
            out = client.reset(data_idx)
            task = tasks[data_idx % len(tasks)]
            assert out["task_id"] == task.task_id
            assert client.observe().startswith(f"Your goal: {task.instruction}\n")
            reward, done, _ = _play(client, base)
            assert done and reward > 0  # the client's reward is the server's score
        r = httpx.post(f"{base}/step", json={"id": client.env_id, "action": "turn left"})
        assert r.status_code == 409  # a finished episode refuses more steps


def test_babyai_clients_check_available_actions_only_looks():
    """AgentGym's BabyAI lists `check available actions` in every observation: on our server it
    answers the current observation (which ends with the actions) and steps nothing."""
    with serving(create_app("babyai")) as base:
        client = BabyAIClient(base)
        client.reset(0)
        before = httpx.get(f"{base}/observation", params={"id": client.env_id}, timeout=10).json()
        obs, reward, done = client.step("Check available actions")
        assert (obs, reward, done) == (before, 0.0, False) and "Available actions:" in obs
        reward, done, steps = _play(client, base)  # the episode goes on as if it had not been sent
        fresh = BabyAIClient(base)
        fresh.reset(0)
        assert (reward, done, steps) == _play(fresh, base)


def test_textcraft_client_gets_the_first_observation_from_create_and_leaves_nothing_open():
    # household: its actions are plain words, so they survive the client's character filter
    with serving(create_app("household")) as base:
        tasks = om.load_tasks("household", "test")
        for episode in range(4):
            client = TextCraftClient(base)
            first = tasks[client.env_id % len(tasks)]
            assert client.observe().startswith(f"Your goal: {first.instruction}\n")
            client.reset(episode)
            assert tasks[episode].instruction in client.observe()
            reward, done, _ = _play(client, base)
            assert (reward, done) == (1.0, True)
            assert client.close()["closed"] is True
        assert _live(base) == 0


@pytest.mark.parametrize("env", ["game24", "countdown"])
def test_arithmetic_actions_do_not_survive_the_textcraft_clients_filter(env):
    """The documented limit: `4 - 1` reaches the server as `4 1`, an invalid action, so Game24
    and Countdown cannot be played through AgentGym's TextCraft client (use RemoteEnv)."""
    with serving(create_app(env)) as base:
        client = TextCraftClient(base)
        client.reset(0)
        action = _expert(base, "id", client.env_id)
        assert agentgym_filter(action) != action
        obs, reward, done = client.step(action)
        state = httpx.get(f"{base}/observation", params={"id": client.env_id}, timeout=10).json()
        assert (reward, done) == (0.0, False) and "invalid" in obs.lower(), (obs, state)


def test_a_create_whose_first_reset_fails_leaves_no_env_open():
    from envs._env_pool import ApiError

    app = create_app("game24")
    with serving(app) as base:
        pool = app.state.pool

        def broken(*args, **kwargs):
            raise ApiError(500, "env reset raised RuntimeError: boom")

        pool.reset, real = broken, pool.reset
        r = httpx.post(f"{base}/create")
        assert r.status_code == 500 and "boom" in r.json()["error"]
        assert _live(base) == 0
        pool.reset = real
        assert httpx.post(f"{base}/create").status_code == 200 and _live(base) == 1


def test_webshop_client_speaks_env_idx_and_sees_the_instruction():
    with serving(create_app("webshop")) as base:
        client = WebshopClient(base)
        assert isinstance(client.env_id, int)
        tasks = om.load_tasks("webshop", "test")
        for idx in (0, 1, 2):
            first = client.reset(idx)
            assert isinstance(first, list) and first[1] is None
            assert first[0].startswith(f"Instruction: {tasks[idx].instruction}")
            actions = httpx.get(f"{base}/available_actions", params={"env_idx": client.env_id}).json()
            assert actions == {"has_search_bar": True, "clickables": ["search"]}
            assert httpx.get(f"{base}/instruction_text",
                             params={"env_idx": client.env_id}).json() == tasks[idx].instruction
            reward, done, _ = _play(client, base, key="env_idx")
            assert (reward, done) == (1.0, True)
        both = httpx.post(f"{base}/step", json={"id": client.env_id, "env_idx": client.env_id, "action": "x"})
        assert both.status_code == 422 and "give the env id as id" in both.json()["error"]
        by_id = httpx.get(f"{base}/observation", params={"id": client.env_id})  # the id dialect too
        assert by_id.status_code == 200 and by_id.json() == client.observe()


@pytest.mark.slow
def test_sciworld_client_gets_the_task_description_and_a_0_to_100_score():
    with serving(create_app("sciworld")) as base:
        client = SciworldClient(base, {"first_episode": False})
        tasks = om.load_tasks("sciworld", "test")
        for idx in (0, 1):
            out = client.reset(idx)
            task = tasks[idx]
            assert (out["task_name"], out["var_num"]) == (task.data["task"], task.data["variation"])
            assert client.observe() == f"{task.instruction}\n{out['observation']}"
            reward, done, _ = _play(client, base)
            assert done and reward == 100  # the client reads score: ScienceWorld's own


# === AgentGym-style servers (stand-ins of agentenv-*/server.py), backed by our envs ==========
