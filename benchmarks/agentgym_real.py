"""AgentGym's own clients and servers against ours, both ways: a check run by hand, not in CI.

Needs a copy of AgentGym's public repository (kept outside this one, never vendored) and a venv
holding its client package and its BabyAI, TextCraft and SciWorld servers::

    python3.11 -m venv /work/agv
    /work/agv/bin/pip install --no-deps -e AGENTGYM/agentenv
    /work/agv/bin/pip install requests numpy openai torch==2.13.0 transformers   # its clients import torch
    /work/agv/bin/pip install -e AGENTGYM/agentenv-babyai -e AGENTGYM/agentenv-textcraft \\
        -e AGENTGYM/agentenv-sciworld
    python benchmarks/agentgym_real.py --agentgym AGENTGYM --python /work/agv/bin/python

It starts AgentGym's three servers and four ``omrl env serve`` (babyai, sciworld, household and
game24; the last two in the generic ``id`` dialect that AgentGym's TextCraft client speaks), then:

* **their clients -> our servers**: ``BabyAIEnvClient``, ``SciworldEnvClient`` and
  ``TextCraftEnvClient`` (run in AgentGym's venv) play ``--episodes`` episodes each, the agent
  being our server's ``/expert_action`` written in their ``Thought: ... Action: ...`` format;
  success counted by AgentGym's rule (final reward 1 or 100) and by the env's own;
* **our RemoteEnv -> their servers**: on BabyAI, greedy ReAct with ``scripted:oracle`` over our
  babyai test tasks of the two levels both sides have (identity-matched by level and seed); on
  SciWorld, the gold path of our sciworld test tasks played step by step through ``RemoteEnv``;
  on TextCraft, tasks by index played by a plan built from the recipes the first observation
  lists (``craft_plan``).

Prints a table, then as its last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

# runs in AgentGym's venv: its clients, our server's expert as the agent
CLIENT_SIDE = r'''
import json, sys, requests
from agentenv.envs import BabyAIEnvClient, SciworldEnvClient, TextCraftEnvClient
plan, episodes = json.loads(sys.argv[1]), int(sys.argv[2])
classes = {"babyai": BabyAIEnvClient, "sciworld": SciworldEnvClient, "textcraft": TextCraftEnvClient}
out = {}
for name, (kind, base) in plan.items():
    rows = []
    client = classes[kind](base, data_len=episodes)
    for idx in range(episodes):
        client.reset(idx)
        reward, done, steps = 0.0, False, 0
        while not done and steps < 60:
            expert = requests.get(f"{base}/expert_action", params={"id": client.env_id}, timeout=60).json()
            step = client.step(f"Thought:\nfollow the plan\n\nAction:\n{expert}")
            reward, done, steps = step.reward, step.done, steps + 1
        rows.append({"idx": idx, "reward": reward, "done": done, "steps": steps,
                     "agentgym_success": done and reward in (1, 100)})
    out[name] = rows
print(json.dumps(out))
'''

SERVERS = {  # AgentGym's env servers: (module, folder to run in)
    "BabyAI": ("agentenv_babyai", "agentenv-babyai"),
    "TextCraft": ("agentenv_textcraft", "agentenv-textcraft"),
    "SciWorld": ("agentenv_sciworld", "agentenv-sciworld"),
}
OURS = {"babyai": "babyai", "sciworld": "sciworld", "textcraft-household": "household",
        "textcraft-game24": "game24"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_up(url: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"agentgym_real: error: the server for {url} exited ({proc.returncode})")
        try:
            httpx.get(url + "/", timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit(f"agentgym_real: error: {url} did not come up in {seconds:g} s")


def start(stack: ExitStack, argv: list[str], cwd: str | None, log: Path) -> tuple[str, subprocess.Popen]:
    port = free_port()
    out = open(log, "w")
    stack.callback(out.close)
    proc = subprocess.Popen(argv + ["--port", str(port)], cwd=cwd, stdout=out, stderr=subprocess.STDOUT)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    stack.callback(stop)
    url = f"http://127.0.0.1:{port}"
    wait_up(url, proc)
    return url, proc


def their_clients(python: str, ours: dict[str, str], episodes: int) -> dict:
    plan = {"babyai": ("babyai", ours["babyai"]), "sciworld": ("sciworld", ours["sciworld"]),
            "textcraft-household": ("textcraft", ours["textcraft-household"]),
            "textcraft-game24": ("textcraft", ours["textcraft-game24"])}
    done = subprocess.run([python, "-c", CLIENT_SIDE, json.dumps(plan), str(episodes)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def babyai_remote(url: str) -> dict:
    import omrl_search as om
    from envs.remote import remote_factory

    tasks = [t for t in om.load_tasks("babyai", "test")
             if t.data.get("level") in ("BabyAI-GoToRedBallNoDists-v0", "BabyAI-PickupLoc-v0")]
    out = {}
    for rule in ("env", "agentgym"):
        factory = remote_factory(f"agentgym+{url}", "babyai", success_rule=rule)
        res = om.search_many(tasks, strategy="react", policy="scripted:oracle", env_factory=factory, seed=0)
        out[rule] = sum(r.success for r in res)
    return {"tasks": len(tasks), "successes_env_rule": out["env"], "successes_agentgym_rule": out["agentgym"],
            "faults": sum(len(r.faults) for r in res)}


def sciworld_remote(url: str, limit: int) -> dict:
    import omrl_search as om
    from envs.remote import remote_factory

    factory = remote_factory(f"agentgym+{url}", "sciworld")
    rows = []
    for task in om.load_tasks("sciworld", "test", limit=limit):
        local, gold = om.make_env("sciworld"), []
        local.reset(task)
        while (action := local.expert_action()) is not None and len(gold) < 100:
            gold.append(action)
            if local.step(action).done:
                break
        local.close()
        env = factory("sciworld")
        try:
            env.reset(task)
            res = None
            for action in gold:
                res = env.step(action)
                if res.done:
                    break
            rows.append({"task": task.task_id, "steps": len(gold), "score": (res.info.get("score") if res else None),
                         "success": bool(res and res.success)})
        except Exception as exc:  # one task's failure is a row, not the end of the run
            rows.append({"task": task.task_id, "error": f"{type(exc).__name__}: {exc}"[:200]})
        finally:
            env.close()
    return {"tasks": len(rows), "successes": sum(r.get("success", False) for r in rows), "rows": rows}


def craft_plan(observation: str) -> list[str]:
    """A TextCraft plan from the crafting commands its first observation lists: each
    ingredient with a recipe crafted first (recursively), the others fetched with ``get``."""
    recipes = {}
    for m in re.finditer(r"craft (\d+) (.+?) using (.+)", observation):
        recipes[m.group(2).strip()] = (int(m.group(1)), [(int(c), n.strip())
                                                         for c, n in re.findall(r"(\d+) ([^,]+)", m.group(3))])
    goal = re.search(r"Goal: craft (.+?)\.", observation)
    plan: list[str] = []

    def make(count: int, item: str, depth: int = 0) -> None:
        if item not in recipes or depth > 8:
            plan.append(f"get {count} {item}")
            return
        made, parts = recipes[item]
        for _ in range(math.ceil(count / made)):
            for c, part in parts:
                make(c, part, depth + 1)
            plan.append(f"craft {made} {item} using " + ", ".join(f"{c} {p}" for c, p in parts))

    if goal:
        make(1, goal.group(1).strip())
    return plan


def textcraft_remote(url: str, episodes: int) -> dict:
    """Their TextCraft tasks by index through RemoteEnv, played by :func:`craft_plan`."""
    from envs.remote import agentgym_tasks, remote_factory

    factory = remote_factory(f"agentgym+{url}", None)
    rows = []
    for task in agentgym_tasks("textcraft", range(episodes)):
        env = factory("textcraft")
        try:
            res = None
            for action in craft_plan(env.reset(task)):
                res = env.step(action)
                if res.done:
                    break
            info = res.info if res else {}
            rows.append({"idx": task.data["data_idx"],
                         "success_env": info.get("success_env"), "success_agentgym": info.get("success_agentgym")})
        finally:
            env.close()
    return {"episodes": len(rows), "successes_env_rule": sum(bool(r["success_env"]) for r in rows),
            "successes_agentgym_rule": sum(bool(r["success_agentgym"]) for r in rows), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agentgym", required=True, type=Path, help="a copy of AgentGym's repository")
    ap.add_argument("--python", required=True, help="the python of a venv with AgentGym's packages")
    ap.add_argument("--episodes", type=int, default=4, help="episodes per client and env")
    ap.add_argument("--sciworld-tasks", type=int, default=3)
    ap.add_argument("--logs", type=Path, default=Path("agentgym-logs"))
    args = ap.parse_args(argv)
    if not (args.agentgym / "agentenv").is_dir():
        print(f"agentgym_real: error: {args.agentgym}: not a copy of AgentGym (no agentenv/)", file=sys.stderr)
        return 2
    args.logs.mkdir(parents=True, exist_ok=True)
    omrl = [sys.executable, "-m", "omrl_search.cli", "env", "serve"]
    report: dict = {}
    with ExitStack() as stack:
        theirs = {}
        for name, (module, folder) in SERVERS.items():
            code = f"import sys; sys.argv[0] = {module!r}; from {module} import launch; launch()"
            theirs[name], _ = start(stack, [args.python, "-c", code], str(args.agentgym / folder),
                                    args.logs / f"agentgym-{name}.log")
        ours = {name: start(stack, omrl + ["--env", env], None, args.logs / f"omrl-{name}.log")[0]
                for name, env in OURS.items()}
        report["their_clients_on_our_servers"] = their_clients(args.python, ours, args.episodes)
        report["remote_env_on_their_babyai"] = babyai_remote(theirs["BabyAI"])
        report["remote_env_on_their_sciworld"] = sciworld_remote(theirs["SciWorld"], args.sciworld_tasks)
        report["remote_env_on_their_textcraft"] = textcraft_remote(theirs["TextCraft"], args.episodes)
    clients = report["their_clients_on_our_servers"]
    for name, rows in clients.items():
        if isinstance(rows, list):
            ok = sum(r["agentgym_success"] for r in rows)
            print(f"their {name:20} client on ours: {ok}/{len(rows)} by AgentGym's rule, "
                  f"final rewards {[r['reward'] for r in rows]}")
    b = report["remote_env_on_their_babyai"]
    print(f"RemoteEnv on their BabyAI: {b['successes_env_rule']}/{b['tasks']} by BabyAI's rule, "
          f"{b['successes_agentgym_rule']}/{b['tasks']} by AgentGym's")
    s = report["remote_env_on_their_sciworld"]
    print(f"RemoteEnv on their SciWorld (gold paths): {s['successes']}/{s['tasks']}")
    t = report["remote_env_on_their_textcraft"]
    print(f"RemoteEnv on their TextCraft (a plan from the listed recipes): {t['successes_env_rule']}/"
          f"{t['episodes']} by TextCraft's rule, {t['successes_agentgym_rule']}/{t['episodes']} by AgentGym's")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
