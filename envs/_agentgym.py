"""AgentGym's env servers as their clients see them, for both directions of interop.

Written from the request/response shapes of AgentGym's servers and clients for BabyAI,
SciWorld, TextCraft and WebShop (what each endpoint takes and answers, how its data index picks a
task, how its evaluation counts a success); no AgentGym code is used. docs/env_server.md says per
env what is served and how it was checked.

* Server side (:mod:`envs.server`): :func:`served` names the AgentGym env a bundled env is served
  as; :func:`worded` gives a reset answer the observation and fields that env's AgentGym client
  reads; :func:`scorer` the episode score on that env's AgentGym scale.
* Client side (:mod:`envs.remote`): :func:`identify` tells from a server's ``GET /`` which
  AgentGym env it serves; the :class:`Profile` of that env decides success (by the env's own
  rule or by AgentGym's evaluation), normalises observations for state keys, lists the actions
  the server names, finds the server's index of a local task and checks that the server started
  that task.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

from omrl_search.types import StepResult, Task

#: AgentGym's BabyAI server resets data_idx ``i`` to level ``BABYAI_LEVELS[i % 40]`` with seed
#: ``i // 40`` (any index is a task)
BABYAI_LEVELS = tuple(f"BabyAI-{name}-v0" for name in (
    "GoToRedBallGrey GoToRedBall GoToRedBallNoDists GoToObjS6 GoToLocalS8N7 GoToObjMazeS7 "
    "GoToImpUnlock GoToSeqS5R2 GoToRedBlueBall GoToDoor GoToObjDoor Open OpenRedDoor OpenDoorLoc "
    "OpenRedBlueDoorsDebug OpenDoorsOrderN4Debug Pickup UnblockPickup PickupLoc PickupDistDebug "
    "PickupAbove PutNextLocalS6N4 PutNextS7N4Carrying Unlock UnlockLocalDist KeyInBox "
    "UnlockPickupDist BlockedUnlockPickup UnlockToUnlock ActionObjDoor FindObjS7 KeyCorridorS6R3 "
    "OneRoomS20 MoveTwoAcrossS8N9 SynthS5R2 SynthLoc SynthSeq MiniBossLevel BossLevel "
    "BossLevelNoUnlock").split())
#: ScienceWorld task ids AgentGym's SciWorld server leaves out of its index
SCIWORLD_SKIPPED = frozenset({"5-1", "5-2", "9-1", "9-2", "9-3", "10-1", "10-2"})
GOAL = "Your goal: "  # how AgentGym's BabyAI server puts the mission into the first observation
OMRL_HELLO = "(omrl env serve: see /info)"  # what tells our server's GET / from AgentGym's
#: how an AgentGym episode's success can be decided: the env's own rule, or AgentGym's evaluation
SUCCESS_RULES = ("env", "agentgym")


# --- server side ---------------------------------------------------------------------------
#: bundled env -> the AgentGym env it is served as (any other env: the generic id dialect)
SERVED = {"babyai": "BabyAI", "sciworld": "SciWorld", "webshop": "WebShop"}


def served(env: str) -> str | None:
    return SERVED.get(env)


#: actions that only look, per AgentGym env: answered with the current observation, no step
#: (AgentGym's BabyAI lists ``check available actions`` in every observation; ours end with the
#: available actions already)
LOOKS = {"BabyAI": "check available actions"}


def only_looks(env: str, action: str) -> bool:
    """Whether ``action`` on bundled ``env`` served in AgentGym's dialect only looks."""
    look = LOOKS.get(served(env) or "")
    return look is not None and " ".join(action.lower().split()) == look


def hello(env: str) -> str:
    """What ``GET /`` answers, in the words of AgentGym's servers, plus a mark of our own."""
    return f"This is environment {served(env) or env}. {OMRL_HELLO}"


def worded(env: str, task: Task, observation: str, by_index: bool) -> tuple[str, dict[str, Any]]:
    """A reset's observation and extra answer fields as the AgentGym server of ``env`` gives
    them. A reset by index (AgentGym's clients) puts the goal into the observation the way
    BabyAI's server does ("Your goal: ..."), unless the env's own observation already holds it
    or the env's client reads it from a field (SciWorld's ``task_description``); a reset with a
    full task (``RemoteEnv``) keeps the env's observation, the instruction travelling apart."""
    extra: dict[str, Any] = {}
    if env == "sciworld":
        extra = {"task_name": task.data.get("task", ""), "var_num": task.data.get("variation", 0),
                 "task_description": task.instruction}
    elif by_index and task.instruction and task.instruction not in observation:
        observation = f"{GOAL}{task.instruction}\n{observation}"
    return observation, extra


def scorer(env: str) -> Callable[[StepResult, float], float]:
    """``score(result, score_so_far)``: the episode's score after a step, on the scale of the
    env's AgentGym server: ScienceWorld's own 0-100 for sciworld, else the summed reward."""
    if env == "sciworld":
        return lambda res, so_far: float(res.info["score"]) if "score" in res.info else so_far + res.reward
    return lambda res, so_far: so_far + res.reward


# --- client side ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Profile:
    """How one AgentGym env's server speaks and how AgentGym's evaluation reads it.

    ``name``: AgentGym's env name (None: a server of unknown kind); ``ours``: True for an
    ``omrl env serve`` speaking AgentGym's dialect (its data_idx is a position in the served
    env's own split); ``env``: the bundled env our server serves.
    """

    name: str | None
    ours: bool = False
    env: str | None = None

    # success, per env: the env's own rule, and AgentGym's evaluation
    def success(self, reward: float, score: float, done: bool, rule: str = "env") -> bool:
        """Whether an episode ending here succeeded, by ``rule``:

        * ``"env"`` (the default): the env's own rule. BabyAI: a positive reward at the end
          (minigrid's reward is 1 - 0.9 * steps / limit, never a fixed 1); SciWorld: score 100;
          TextCraft and WebShop: reward 1 at the end; a server of unknown kind: final reward 1.
        * ``"agentgym"``: AgentGym's own evaluation (``agentenv.controller.utils``): the final
          reward its client reports equals 1 or 100. BabyAI's and SciWorld's clients report the
          score, the others the step's reward. By this rule a BabyAI episode never succeeds.
        """
        if not done:
            return False
        if rule == "agentgym":
            final = score if self.name in ("BabyAI", "SciWorld") else reward
            return final in (1, 100)
        if rule != "env":
            raise ValueError(f"success rule must be env or agentgym, got {rule!r}")
        if self.name == "BabyAI":
            return reward > 0
        if self.name == "SciWorld":
            return score >= 100
        return reward >= 1

    def normalise(self, observation: str) -> str:
        """The observation as state keys see it: SciWorld's listings sorted (its server lists
        equal objects in a different order on each load); others as they are."""
        if self.name == "SciWorld" or self.env == "sciworld":
            from .sciworld import tidy

            return tidy(observation)
        return observation

    @staticmethod
    def listed_actions(observation: str) -> list[str] | None:
        """The actions an observation lists after ``Available actions:`` (BabyAI: AgentGym's
        JSON list ``["turn left", ...]`` or our ``turn left, turn right.``); None if none."""
        head, sep, rest = observation.rpartition("Available actions:")
        if not sep:
            return None
        rest = rest.strip()
        if rest.startswith("["):
            try:
                listed = json.loads(rest[:rest.index("]") + 1])
            except ValueError:
                return None
            return [a for a in listed if isinstance(a, str) and a]
        line = rest.split("\n", 1)[0].strip().rstrip(".")
        return [a.strip() for a in line.split(", ") if a.strip()] or None

    def instruction(self, answer: Any) -> str:
        """The task description a reset answer carries apart from the observation (SciWorld)."""
        if isinstance(answer, dict) and isinstance(answer.get("task_description"), str):
            return answer["task_description"].strip()
        return ""

    # which of the server's tasks a local task is
    def index(self, task: Task) -> int | None:
        """The server's data index of local ``task`` (None: it has none there): a recorded
        ``data["data_idx"]``; for AgentGym's BabyAI a bundled babyai task of one of its 40
        levels; for SciWorld a sciworld task's place in AgentGym's list of every variation."""
        idx = task.data.get("data_idx")
        if isinstance(idx, int) and not isinstance(idx, bool):
            return idx
        if self.ours and task.env == self.env:
            return _position(task.env, task.split, task.task_id)
        if self.name == "BabyAI" and task.env == "babyai":
            level, seed = task.data.get("level"), task.data.get("seed")
            if level in BABYAI_LEVELS and isinstance(seed, int) and seed >= 0:
                return seed * len(BABYAI_LEVELS) + BABYAI_LEVELS.index(level)
        if self.name == "SciWorld" and task.env == "sciworld" and not task.data.get("simplifications"):
            offset = sciworld_offsets().get(task.data.get("task"))
            variation = task.data.get("variation")
            if offset is not None and isinstance(variation, int):
                return offset + variation
        return None

    def matches(self, local_env: str) -> bool:
        """Whether local tasks of ``local_env`` can be told apart on this server by identity."""
        return ((self.ours and self.env == local_env)
                or (self.name, local_env) in {("BabyAI", "babyai"), ("SciWorld", "sciworld")})

    def check(self, task: Task, answer: Any, observation: str) -> str | None:
        """Why the server's reset answer is not ``task`` (None: it is, or cannot be told):
        SciWorld names the task and variation; BabyAI writes the mission into the observation."""
        if not isinstance(answer, dict):
            return None
        if self.name == "SciWorld" and "task" in task.data and "task_name" in answer:
            want = (task.data.get("task"), task.data.get("variation"))
            got = (answer.get("task_name"), answer.get("var_num"))
            return None if got == want else f"the server started {got[0]} variation {got[1]}, not {want[0]} variation {want[1]}"
        if self.name == "BabyAI" and task.env == "babyai" and task.instruction:
            goal = re.search(r"Your goal: (.*)", observation)
            want = task.instruction.replace("then", "and").replace("after you", "and")
            if goal and goal.group(1).strip() not in (task.instruction, want):
                return f"the server's goal is {goal.group(1).strip()!r}, not {task.instruction!r}"
        return None


def identify(hello_answer: Any) -> Profile:
    """The profile of the server whose ``GET /`` answered ``hello_answer``: AgentGym's servers
    say "This is environment BabyAI." (ScienceWorld, TextCraft, ...), WebShop's "ok"."""
    text = hello_answer if isinstance(hello_answer, str) else ""
    m = re.search(r"This is environment (\S+?)\.(?:\s|$)", text)
    name = m.group(1) if m else ("WebShop" if text.strip() == "ok" else None)
    name = {"ScienceWorld": "SciWorld"}.get(name, name)
    if OMRL_HELLO in text and name is not None:
        env = {v: k for k, v in SERVED.items()}.get(name, name)
        return Profile(name, ours=True, env=env)
    return Profile(name)


def _position(env: str, split: str, task_id: str) -> int | None:
    return _positions(env, split).get(task_id)


@lru_cache(maxsize=16)
def _positions(env: str, split: str) -> dict[str, int]:
    from omrl_search.env import env_class

    try:
        return {t.task_id: i for i, t in enumerate(env_class(env).tasks(split))}
    except (KeyError, NotImplementedError, ValueError):
        return {}


@lru_cache(maxsize=1)
def sciworld_offsets() -> dict[str, int]:
    """Each ScienceWorld family's first index in AgentGym's SciWorld list (every variation of
    every task, in ScienceWorld's task order, :data:`SCIWORLD_SKIPPED` left out). A family's
    variation count is the size of its train, dev and test splits (ScienceWorld's cached
    catalogue; a JVM the first time)."""
    from scienceworld.constants import ID2TASK

    from ._sciworld_tasks import Catalog

    out, at = {}, 0
    with Catalog() as catalog:
        for task_id, family in ID2TASK.items():
            if task_id in SCIWORLD_SKIPPED:
                continue
            out[family] = at
            at += sum(len(v) for v in catalog.splits(family).values())
    return out
