"""AgentGym interop, RemoteEnv side: RemoteEnv (with the scripted policies) against
AgentGym-style servers, and our own server through the AgentGym dialect, on loopback (AgentGym's
clients against ``omrl env serve``: tests/test_agentgym_clients.py).

Which counterparts are real: none of AgentGym's code is installable here. PyPI's ``agentenv``
0.0.1 is an empty placeholder (one ``__version__`` line, no ``agentenv.envs``), AgentGym's env
servers (agentenv-babyai, -sciworld, -textcraft, -webshop) are not on PyPI, and its repository
cannot be reached. So both sides are stand-ins written here from the documented shapes of
AgentGym's clients (``agentenv/envs/{babyai,sciworld,textcraft,webshop}.py``: the calls they make
and the fields they read, a missing one failing as it would there) and of its servers (what each
endpoint takes and answers, how ``data_idx`` picks a task, errors as status 200 with
``{"error"}``), backed by our envs; the SciWorld server stand-in (slow) drives the real
ScienceWorld simulator the way AgentGym's does. docs/env_server.md reports what was run.
"""
from __future__ import annotations

import json
import random

import pytest
from fastapi import FastAPI
from test_env_server import serving  # noqa: E402 - the uvicorn-in-a-thread helper

import omrl_search as om
from envs._agentgym import BABYAI_LEVELS, SCIWORLD_SKIPPED, Profile
from envs.babyai import BabyAIEnv
from envs.remote import RemoteEnv, agentgym_tasks, remote_factory
from envs.server import create_app
from omrl_search.backends.scripted import OraclePolicy, RandomPolicy
from omrl_search.env import EnvError, ReplayDivergence, make_env
from omrl_search.policy import PolicyError
from omrl_search.types import GenRequest, SamplingParams, Task


def _agentgym_app(name: str) -> tuple[FastAPI, dict]:
    """A FastAPI app answering errors as AgentGym's servers do: status 200 and {"error"}."""
    app, envs = FastAPI(), {}

    @app.get("/")
    def hello():
        return "ok" if name == "WebShop" else f"This is environment {name}."

    return app, envs


def guarded(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}


def babyai_server() -> FastAPI:
    """AgentGym's BabyAI server: data_idx i is level ``BABYAI_LEVELS[i % 40]`` with seed i // 40;
    the goal opens the first observation; the listed actions close every observation as a JSON
    list; the reward of a solved level is minigrid's 1 - 0.9 * steps / limit (never 1), the
    score sums the rewards; a finished env refuses steps."""
    app, envs = _agentgym_app("BabyAI")

    def shown(env, obs: str) -> str:
        body = obs.split("\nAvailable actions:")[0]
        return body + "\nAvailable actions: " + json.dumps(env.valid_actions() + ["check available actions"])

    @app.post("/create")
    def create():
        envs[len(envs)] = {"env": make_env("babyai"), "done": False, "score": 0.0}
        return {"id": len(envs) - 1}

    @app.post("/reset")
    def reset(body: dict):
        def go():
            slot, i = envs[body["id"]], body["data_idx"]
            level = BABYAI_LEVELS[i % len(BABYAI_LEVELS)]
            task = BabyAIEnv.task_from_dict({"level": level, "seed": i // len(BABYAI_LEVELS)})
            obs = slot["env"].reset(task)
            slot.update(done=False, score=0.0, steps=0, limit=task.data["max_steps"])
            goal = task.instruction.replace("then", "and").replace("after you", "and")
            return {"observation": f"Your goal: {goal}\n" + shown(slot["env"], obs), "reward": 0,
                    "score": 0, "deleted": False, "done": False}
        return guarded(go)

    @app.post("/step")
    def step(body: dict):
        def go():
            slot = envs[body["id"]]
            if slot["done"]:
                raise ValueError(f"The task with environment {body['id']} has finished.")
            r = slot["env"].step(body["action"])
            slot["steps"] += 1
            reward = 1 - 0.9 * slot["steps"] / slot["limit"] if r.success else 0.0
            slot["score"] += reward
            slot["done"] = r.success
            return {"observation": shown(slot["env"], r.observation) if not r.done else r.observation,
                    "reward": reward, "score": slot["score"], "done": r.success}
        return guarded(go)

    return app


def textcraft_server(env_name: str = "game24") -> FastAPI:
    """AgentGym's TextCraft server's shapes (its crafting world replaced by one of our envs):
    /create takes {commands, goal} and answers the first observation of task ``id``; reset and
    step answer {observation, reward, done}; reward 1 when the goal is reached."""
    app, envs = _agentgym_app("TextCraft")
    tasks = om.load_tasks(env_name, "test")

    @app.post("/create")
    def create(body: dict):
        idx = len(envs)
        envs[idx] = make_env(env_name)
        return {"id": idx, "observation": envs[idx].reset(tasks[idx % len(tasks)]), "done": False, "reward": 0}

    @app.post("/reset")
    def reset(body: dict):
        return guarded(lambda: {"id": body["id"], "observation": envs[body["id"]].reset(tasks[body["data_idx"]]),
                                "done": False, "reward": 0})

    @app.post("/step")
    def step(body: dict):
        def go():
            r = envs[body["id"]].step(body["action"])
            return {"observation": r.observation, "reward": float(r.success), "done": r.done}
        return guarded(go)

    @app.post("/close")
    def close(body: dict):
        return guarded(lambda: envs.pop(body["id"]) and {"closed": True})

    return app


def webshop_server() -> FastAPI:
    """AgentGym's WebShop server: "ok" at /, /create answers a bare (random) index, bodies and
    queries carry env_idx, reset by session_id answers [observation, null], step answers
    {state, reward, done, info: null}, /available_actions {has_search_bar, clickables}."""
    app, envs = _agentgym_app("WebShop")
    tasks, ids = om.load_tasks("webshop", "test"), random.Random(7)

    @app.post("/create")
    def create():
        idx = ids.randrange(48950076)
        envs[idx] = make_env("webshop")
        return idx

    @app.post("/reset")
    def reset(body: dict):
        return [envs[body["env_idx"]].reset(tasks[body["session_id"]]), None]

    @app.get("/observation")
    def observation(env_idx: int):
        return envs[env_idx].observe()

    @app.get("/instruction_text")
    def instruction_text(env_idx: int):
        return "Instruction: " + envs[env_idx].observe().split("\n")[0].removeprefix("Instruction: ")

    @app.get("/available_actions")
    def available(env_idx: int):
        listed = envs[env_idx].valid_actions()
        search = any(a.startswith("search[") for a in listed)
        return {"has_search_bar": search,
                "clickables": ["search"] * search + [a[6:-1] for a in listed if a.startswith("click[")]}

    @app.post("/step")
    def step(body: dict):
        r = envs[body["env_idx"]].step(body["action"])
        return {"state": r.observation, "reward": r.reward if r.done else 0.0, "done": r.done, "info": None}

    @app.post("/close")
    def close(body: dict):
        return {"closed": envs.pop(body["env_idx"], None) is not None}

    return app


def sciworld_server(shuffle: bool) -> FastAPI:
    """AgentGym's SciWorld server's shapes over a small world of ours: reset answers
    task_name, var_num and task_description apart from the observation, score is 0-100, and
    (``shuffle``) each load lists the room's objects in another order, as ScienceWorld lists
    objects sharing a name in hash order."""
    app, envs = _agentgym_app("SciWorld")
    things = ["a seed jar", "a flower pot 1", "a flower pot 2", "a flower pot 3", "the agent"]
    loads = iter(range(10**6))

    def look(slot) -> str:
        listed = list(things)
        random.Random(slot["load"] if shuffle else 0).shuffle(listed)
        return "This room is called the greenhouse. In it, you see: \n" + "".join(f"\t{t}\n" for t in listed)

    @app.post("/create")
    def create():
        envs[len(envs)] = {}
        return {"id": len(envs) - 1}

    @app.post("/reset")
    def reset(body: dict):
        slot = envs[body["id"]]
        slot.update(load=next(loads), score=0, var=body["data_idx"] - 3536, done=False)
        return {"task_name": "find-plant", "var_num": slot["var"],
                "task_description": "Your task is to find a(n) plant. First, focus on the thing.",
                "observation": look(slot), "reward": 0, "score": 0, "deleted": False, "done": False}

    @app.post("/step")
    def step(body: dict):
        slot, action = envs[body["id"]], body["action"]
        before = slot["score"]
        if action == "focus on flower pot 2":
            slot["score"], slot["done"] = 100, True
        elif action == "look around":
            slot["score"] = max(slot["score"], 50)
        obs = look(slot) if action == "look around" else f"You do {action}."
        return {"observation": obs, "reward": slot["score"] - before, "score": slot["score"],
                "done": slot["done"]}

    return app


# --- RemoteEnv -> AgentGym's servers ---------------------------------------------------------
def _babyai_tasks(n: int) -> list[Task]:
    """Local babyai test tasks of the levels AgentGym's BabyAI server also has."""
    return [t for t in BabyAIEnv.tasks("test") if t.data["level"] in BABYAI_LEVELS][:n]


def test_remote_babyai_matches_tasks_by_identity_and_counts_successes_below_one():
    local = _babyai_tasks(4)
    with serving(babyai_server()) as url:
        factory = remote_factory(f"agentgym+{url}", "babyai")
        assert factory.profile.name == "BabyAI"
        factory.check_tasks(local)  # each a (level, seed) AgentGym's server also starts
        with pytest.raises(ValueError, match=r"40 of 60 tasks have no task .*BabyAI"):
            factory.check_tasks(BabyAIEnv.tasks("test"))  # 4 of our 6 levels are not AgentGym's
        env = factory("babyai")
        for task in local:  # the same goal as our env: the same task; solved with a reward < 1
            assert env.reset(task).startswith(f"Your goal: {task.instruction}\n")
            solver = make_env("babyai")
            solver.reset(task)
            while not (r := env.step(action := solver.expert_action())).done:
                solver.step(action)
            assert r.success and 0 < r.reward < 1
        wrong = Task("babyai", local[0].task_id, "test", 0, local[0].instruction, {"data_idx": 7})
        with pytest.raises(EnvError, match="is not data_idx 7.*the server's goal is"):
            env.reset(wrong)
        env.close()
        # the scripted policies act on the server's listed actions
        results = om.search_many(local[:2], strategy="best_of_n:n=2", policy="scripted:random",
                                 seed=3, env_factory=factory, max_depth=12)
        assert all(r.faults == [] for r in results)
        finished = [s for r in results for t in r.trajectories for s in t.steps[-1:] if s.done]
        assert all(s.success == (s.reward > 0) for s in finished)
        assert all(len(r.tree.nodes) > 2 for r in results)


def test_a_pairing_without_identity_is_refused_in_one_line():
    with serving(textcraft_server()) as url:
        with pytest.raises(ValueError, match="is TextCraft: local babyai tasks cannot be matched"):
            remote_factory(f"agentgym+{url}", "babyai")
        factory = remote_factory(f"agentgym+{url}")  # from Python, tasks carry their data_idx
        with pytest.raises(ValueError, match="1 of 1 tasks have no task"):
            factory.check_tasks(om.load_tasks("game24", "test", limit=1))
        env = factory("game24")
        with pytest.raises(EnvError, match="cannot tell which task"):
            env.reset(om.load_tasks("game24", "test", limit=1)[0])


def test_remote_textcraft_success_is_reward_one():
    tasks = agentgym_tasks("game24", range(3))
    local = om.load_tasks("game24", "test", limit=3)
    with serving(textcraft_server()) as url:
        factory = remote_factory(f"agentgym+{url}")
        for task, twin in zip(tasks, local):
            env, solver = factory("game24"), make_env("game24")
            assert env.reset(task) == solver.reset(twin)
            while True:
                action = solver.expert_action()
                solver.step(action)
                r = env.step(action)
                if r.done:
                    break
            assert r.success and r.reward == 1.0 and env.valid_actions() is None
            env.close()
        # TextCraft lists no actions: the scripted policies refuse in one line
        env = factory("game24")
        env.reset(tasks[0])
        request = GenRequest([{"role": "user", "content": "x"}], SamplingParams(n=1, seed=0), None,
                             {"task": tasks[0], "snapshot": env.snapshot(), "env": "game24"})
        for policy in (RandomPolicy(), OraclePolicy(0.3)):
            with pytest.raises(PolicyError, match=f"{policy.name} cannot act on env 'game24' at "
                                                  f"{url}: that server lists no actions"):
                policy.generate([request])


def test_remote_webshop_lists_clickables_and_success_is_a_full_reward():
    tasks = agentgym_tasks("webshop", range(4))
    with serving(webshop_server()) as url:
        factory = remote_factory(f"webshop+{url}")
        assert factory.profile.name == "WebShop"
        env = factory("webshop")
        env.reset(tasks[0])
        listed = env.valid_actions()
        assert listed and listed[0].startswith("search[")
        env.close()
        results = om.search_many(tasks[:2], strategy="best_of_n:n=2", policy="scripted:oracle:p=0.5",
                                 seed=1, env_factory=factory, max_depth=8)
        assert all(r.faults == [] for r in results)
        ends = [t.steps[-1] for r in results for t in r.trajectories if t.steps and t.steps[-1].done]
        assert all(s.success == (s.reward >= 1) for s in ends)
        assert all(len(r.tree.nodes) > 2 for r in results)
        # buying what the instruction asks is a success (reward 1)
        env = factory("webshop")
        solver = make_env("webshop")
        for task, twin in zip(tasks[:2], om.load_tasks("webshop", "test", limit=2)):
            env.reset(task)
            solver.reset(twin)
            while not (r := env.step(action := solver.expert_action())).done:
                solver.step(action)
            assert (r.reward, r.success) == (1.0, True)


def test_remote_sciworld_gets_its_task_description_score_100_and_stable_keys():
    with serving(sciworld_server(shuffle=True)) as url:
        factory = remote_factory(f"agentgym+{url}", "sciworld")
        env = factory("sciworld")
        task = Task("sciworld", "find-plant-4", "test", 4, "", {"data_idx": 3540})
        first = env.reset(task)
        assert task.instruction.startswith("Your task is to find")  # reached the policy's prompt
        root = env.snapshot()
        env.step("look around")
        mid = env.snapshot()
        assert not env.step("focus on flower pot 1").success
        env.restore(root)
        env.step("wait")
        env.restore(mid)  # a replay: the listing comes in another order, the state is the same
        assert env.observe() == mid.observation
        r = env.step("focus on flower pot 2")
        assert (r.success, env.replays, first != "") == (True, 2, True)
        raw = RemoteEnv(url, "sciworld", dialect="agentgym", profile=Profile("TextCraft"))
        raw.reset(task)
        raw.step("look around")
        snap = raw.snapshot()
        raw.step("wait")
        raw.restore(snap)
        with pytest.raises(ReplayDivergence):  # without the normaliser the same state diverges
            raw.step("wait")
        assert (env.divergences, raw.divergences) == (0, 1 + raw.retries)  # each retry reloads


@pytest.mark.slow
def test_remote_sciworld_on_the_real_simulator_with_agentgym_indexing():
    """A SciWorld server as AgentGym's: ScienceWorld itself, its task list built from every
    variation of every task but the seven AgentGym leaves out; our sciworld test tasks matched
    to it by identity and played along ScienceWorld's gold path."""
    sw_mod = pytest.importorskip("scienceworld")
    from envs._sciworld_tasks import start_jvm

    sw = start_jvm()
    games = [(name, v) for tid, name in sw_mod.constants.ID2TASK.items() if tid not in SCIWORLD_SKIPPED
             for v in range(sw.get_max_variations(name))]
    app, _ = _agentgym_app("ScienceWorld")

    @app.post("/create")
    def create():
        return {"id": 0}

    @app.post("/reset")
    def reset(body: dict):
        name, var = games[body["data_idx"]]
        sw.load(name, var)
        ob, reward, done, info = sw.step("look around")
        return {"task_name": name, "var_num": var, "task_description": sw.get_task_description(),
                "observation": ob, "reward": reward, "score": info["score"], "deleted": False, "done": done}

    @app.post("/step")
    def step(body: dict):
        ob, reward, done, info = sw.step(body["action"])
        return {"observation": ob, "reward": reward, "score": info["score"], "done": done}

    local = om.load_tasks("sciworld", "test", limit=2)
    try:
        with serving(app) as url:
            factory = remote_factory(f"agentgym+{url}", "sciworld")
            factory.check_tasks(local)
            for task in local:
                task = Task(task.env, task.task_id, task.split, task.seed, "", dict(task.data))
                env, solver = factory("sciworld"), make_env("sciworld")
                env.reset(task)
                assert task.instruction.startswith("Your task is")
                solver.reset(task)
                r = None
                for _ in range(40):
                    action = solver.expert_action()
                    if action is None:
                        break
                    solver.step(action)
                    r = env.step(action)
                    if r.done:
                        break
                assert r is not None and r.success and r.info["score"] == 100
                solver.close()
    finally:
        sw.close()


# --- the omrl server itself through the AgentGym dialect, and the bearer token ---------------
def test_agentgym_dialect_against_our_server_with_scripted_policies():
    tasks = om.load_tasks("babyai", "test", limit=3)
    with serving(create_app("babyai")) as url:
        factory = remote_factory(f"agentgym+{url}", "babyai")
        assert factory.profile.ours and factory.profile.env == "babyai"
        results = om.search_many(tasks, strategy="best_of_n:n=3", policy="scripted:random", seed=2,
                                 env_factory=factory, max_depth=12)
        assert all(r.faults == [] for r in results)
        assert all(r.task.instruction in r.tree.nodes[0].observation for r in results)


def test_remote_env_sends_the_bearer_token(monkeypatch):
    token = "a-token-of-24-characters"
    with serving(create_app("game24", token=token)) as url:
        with pytest.raises(ValueError, match="401"):
            remote_factory(url)
        env = remote_factory(url, token=token)("game24")
        task = om.load_tasks("game24", "test", limit=1)[0]
        assert env.reset(task)
        monkeypatch.setenv("OMRL_ENV_SERVER_TOKEN", token)
        assert remote_factory(url)("game24").reset(task) == env.reset(task)
        shown = repr(env.snapshot().payload.origin)
        assert shown.startswith("Origin(") and token not in shown
