"""ScienceWorld (Wang et al., 2022): elementary-science tasks in a text world simulated in a JVM.

This wraps the ``scienceworld`` package (``pip install 'omrl-search[envs]'``, Java 11+). One
:class:`SciWorldSim` owns one JVM (250-500 MB, heap capped), started at its first ``reset``
(1-2 s on an idle machine) and reused for every later task through ScienceWorld's ``load``
(0.02-0.3 s); ``close()`` ends it. A search holds one per tree, plus one in a scripted policy.

Tasks are ScienceWorld's task families and variations; ``test`` and ``train`` are ScienceWorld's
own test and train variations (disjoint), and the instruction is its task description. The
default split is five short-horizon families x the first few variations; the task catalogue
and gold paths live in :mod:`envs._sciworld_tasks`.

Snapshots are *replay* (:class:`SciWorldEnv` is a :class:`ReplayEnv`): the JVM has no save or
state export to load back (``load``/``reset`` only rebuild a task from scratch), and its
simulation is not fully deterministic (thermometer readings and electrical updates can land a
tick apart from one run to the next), so the state key checks every replay. A divergent replay
is retried from a reload (``retries``, default 3); if none reaches the recorded state the next
step raises :class:`ReplayDivergence`, which the engine records as a failed node and a fault.
Listing order is made canonical (:func:`tidy`) so it never counts as divergence;
``benchmarks/sciworld_divergence.py`` measures how often the rest happens.

* ``state_key`` hashes the task, the step count, the last observation and the world as
  ScienceWorld's side-effect-free calls show it: ``look``, ``inventory``, goal progress (which
  records the focus), score, completion and the move counter;
* reward: the normalised score change (score/100), except that the step solving the task
  returns 1.0 like every env; ``info["score"]`` is ScienceWorld's 0-100 score;
* ``expert_action`` follows ScienceWorld's gold action sequence while the agent's actions that
  changed the world match it (no-ops such as ``look around`` or invalid input are skipped), and
  is None once the agent left it: there is no planner to recompute a path from elsewhere;
* ``valid_actions`` is None: ScienceWorld's valid action/object list holds 400-3000 mostly
  absurd strings (``connect agent to air``) and costs up to 0.35 s per call.
"""
from __future__ import annotations

from typing import Any

from omrl_search.env import Env, EnvError, ReplayDivergence, ReplayEnv, register_env, stable_hash
from omrl_search.types import Snapshot, StepResult, Task

from ._sciworld_tasks import cached, save_cache, split_tasks, start_jvm, stop_jvm, task_from_row
from ._text_env import episode_over, step_result

MAX_STEPS = 30
RETRIES = 3  # replays tried again after a divergence, before a restore fails
SYNTAX = ("Actions look like `open door to kitchen`, `go to kitchen`, `pick up thermometer`, "
          "`focus on OBJ` or `move OBJ to OBJ`, naming things as `look around` shows them.")
#: what ScienceWorld answers to input it cannot parse (the second after an ambiguity prompt)
_NOT_UNDERSTOOD = ("No known action matches that input.", "Unknown action.")


def tidy(text: str) -> str:
    """``text`` with its listings sorted: each block of tab-indented lines, and the items of a
    ``...: a, b, c.`` list (an item's ``, which is on`` stays with it).

    ScienceWorld orders listings by its internal object names, and objects sharing one (four
    ``giant tortoise`` at different life stages) in hash order, which changes from one load to
    the next; sorted, one state always reads the same, so replays and dedup compare states."""
    out: list[str] = []
    block: list[str] = []
    for line in text.split("\n") + [""]:
        if line.startswith("\t"):
            block.append(_tidy_items(line))
            continue
        out += sorted(block) + [_tidy_items(line)]
        block = []
    return "\n".join(out[:-1])


def _tidy_items(line: str) -> str:
    head, sep, rest = line.partition(": ")
    if not sep:
        return line
    end = "." if rest.endswith(".") else ""
    items: list[str] = []
    for item in _split_items(rest[:len(rest) - len(end)]):
        if items and item.startswith(("which ", "currently ")):
            items[-1] += ", " + item
        else:
            items.append(item)
    return head + sep + ", ".join(sorted(items)) + end


def _split_items(text: str) -> list[str]:
    """Split at ``", "`` outside parentheses."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and text.startswith(", ", i):
            items.append(text[start:i])
            start = i + 2
    return items + [text[start:]]


def normalise(action: str) -> str:
    """One line, single spaces, without quotes or a final full stop (ScienceWorld rejects it)."""
    return " ".join(action.strip().strip("`'\"").rstrip(".!").split())


# --- one JVM, plain episodes -----------------------------------------------------------------
class SciWorldSim(Env):
    """One ScienceWorld JVM running one episode at a time; no snapshots (see SciWorldEnv).

    Steps go straight to the simulator (``server.step``): ScienceWorld's Python ``step`` also
    lists every valid action after each move, which costs 5-70x the step itself.
    """

    name = "sciworld"
    snapshot_kind = "none"
    description = "ScienceWorld: do an elementary-school science task in a simulated house."
    action_help = (
        "Actions: ScienceWorld commands, OBJ being something you can see or hold: look around, "
        "look at OBJ, look in OBJ, inventory, task, go to OBJ (a room), open OBJ, close OBJ, "
        "pick up OBJ, put down OBJ, move OBJ to OBJ, pour OBJ in OBJ, dunk OBJ in OBJ, mix OBJ, "
        "activate OBJ, deactivate OBJ, use OBJ on OBJ, connect OBJ to OBJ, disconnect OBJ, "
        "eat OBJ, flush OBJ, read OBJ, wait (10 ticks), wait1 (1 tick), reset task, and "
        "focus on OBJ (names the object the task is about; focusing on a wrong one fails the "
        "task). Answer an 'Ambiguous request' with the number of the option you meant."
    )
    examples = "Think: The thermometer is probably in the kitchen; the door is closed.\nAct: open door to kitchen"
    max_steps = MAX_STEPS

    def __init__(self) -> None:
        self.sw: Any = None  # the ScienceWorldEnv, started at the first reset
        self.loads = 0  # world loads so far (each costs 0.02-0.3 s)
        self.task: Task | None = None
        # (family, variation, simplifications) of the loaded task; SciWorldEnv keys its traces by it
        self.gold_key: tuple[str, int, str] = ("", 0, "")

    # --- episode ---------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        family, variation, simplifications = _task_args(task)
        if self.sw is None:
            self.sw = start_jvm()
        try:
            self.sw.load(family, variation, simplifications, False)
        except Exception as exc:
            raise EnvError(f"ScienceWorld cannot load {family} variation {variation}: {exc}") from None
        self.loads += 1
        self.task, self.gold_key = task, (family, variation, simplifications)
        # ScienceWorld updates its score and completion flag only when stepping: until the first
        # step they still hold the last episode's values, so the episode's own are kept here
        self.steps, self.score, self.completed, self.done, self.success = 0, 0, False, False, False
        self.truncated, self.answer = False, ""
        self.trace: list[tuple[str, bool]] = []  # (action, changed the world) per step
        self._world: tuple | None = None
        self.obs = tidy(self.sw.server.freeActionLook())
        return self.obs

    def step(self, action: str) -> StepResult:
        if self.task is None:
            raise EnvError("step() before reset()")
        if self.done:
            return episode_over(self)
        text = normalise(action)
        before, previous = self.world(), self.score
        self.steps += 1
        if not text:
            valid, self.obs = False, f"Invalid action: empty action. {SYNTAX}"
        else:
            raw = self.sw.server.step(text)
            valid = not raw.startswith(_NOT_UNDERSTOOD)
            self.obs = tidy(raw) if valid else (
                f"Invalid action: ScienceWorld did not understand {text[:80]!r} "
                f"({raw.strip()}). {SYNTAX}")
            self.score = round(100 * self.sw.server.getScore())
            self.completed = bool(self.sw.server.getCompleted())
            self.success = self.completed and self.score >= 100
            self.done = self.completed or self.score < 0
        self._world = None
        self.trace.append((text, self.world() != before))
        if self.success:
            self.obs += " (Task completed: score 100.)"
        elif self.done:
            self.obs += f" (The task failed: score {self.score}.)"
        elif self.steps >= self.max_steps:
            self.done = self.truncated = True
            self.obs += f" (Out of steps ({self.max_steps}); the task is not done: score {self.score}.)"
        if self.done:
            self.answer = text
        reward = 1.0 if self.success else (self.score - previous) / 100
        return step_result(self, self.obs, reward, valid=valid, score=self.score)

    def observe(self) -> str:
        if self.task is None:
            raise EnvError("observe() before reset()")
        return self.obs

    def world(self) -> tuple:
        """The world as ScienceWorld's side-effect-free calls show it, with the episode's score
        (cached per step)."""
        if self._world is None:
            s = self.sw.server
            self._world = (tidy(s.freeActionLook()), tidy(s.freeActionInventory()),
                           s.getGoalProgressStr(), self.score, self.completed,
                           int(s.getNumMoves()))
        return self._world

    def state_key(self) -> str:
        if self.task is None:
            raise EnvError("state_key() before reset()")
        return stable_hash((self.gold_key, self.steps, self.done, self.obs, self.world()))

    def snapshot(self) -> Snapshot:
        raise EnvError("SciWorldSim has no snapshots: use SciWorldEnv (replay)")

    def restore(self, snapshot: Snapshot) -> None:
        raise EnvError("SciWorldSim has no snapshots: use SciWorldEnv (replay)")

    # --- expert ----------------------------------------------------------------------------
    def gold(self) -> tuple[str, ...]:
        """ScienceWorld's gold action sequence for the current task, generated once and cached
        (generation is random: two runs can differ in length, so all instances share one)."""
        store, key = cached("gold"), _gold_id(self.gold_key)
        if key not in store:
            sw, before = self.sw, self.world()
            sw.load(*self.gold_key, True)
            seq = list(sw.get_gold_action_sequence())
            store[key] = [] if not seq or seq[0].startswith("ERROR") else seq
            save_cache()
            sw.load(*self.gold_key, False)  # back to the episode: reload and redo its steps
            self.loads += 1
            for action, _ in self.trace:
                if action:
                    sw.server.step(action)
            self._world = None
            if self.world() != before:
                raise ReplayDivergence(f"reloading {self.task.task_id} after generating its gold "
                                       f"path reached a different state")
        return tuple(store[key])

    def expert_action(self) -> str | None:
        if self.task is None or self.done:
            return None
        return follow_gold(self.gold(), self.trace)

    def close(self) -> None:
        if self.sw is not None:
            stop_jvm(self.sw)
            self.sw = None


def follow_gold(gold: tuple[str, ...] | list[str], trace) -> str | None:
    """The next gold action after ``trace`` ((action, changed the world) per step): actions
    matching the gold path advance along it, no-ops are skipped, anything else leaves it (None)."""
    i = 0
    for action, changed in trace:
        if i < len(gold) and action.lower() == gold[i].lower():
            i += 1
        elif changed:
            return None
    return gold[i] if i < len(gold) else None


def _gold_id(args: tuple[str, int, str]) -> str:
    return ":".join(map(str, args))


def _task_args(task: Task) -> tuple[str, int, str]:
    try:
        return task.data["task"], int(task.data["variation"]), task.data.get("simplifications", "")
    except (KeyError, TypeError, ValueError):
        raise EnvError(f"sciworld task {task.task_id!r} needs data 'task' and 'variation'") from None


# --- the registered env: replay snapshots ----------------------------------------------------
#: (task args, action prefix) -> (trace, done) of every state stepped to in this process: what
#: the expert needs, so a scripted policy's env can answer without replaying (see expert_action)
_TRACES: dict[tuple, tuple[tuple[tuple[str, bool], ...], bool]] = {}


@register_env("sciworld")
class SciWorldEnv(ReplayEnv):
    """ScienceWorld with replay snapshots (see the module docstring).

    ``restore`` is lazy: it records the snapshot, ``observe``/``state_key``/``snapshot`` answer
    from it, and the JVM catches up (:meth:`sync`) at the next ``step``. Catching up plays only
    the missing actions when the snapshot extends the env's current state (a ReAct chain costs
    one step per restore); otherwise it reloads the task and replays the whole prefix. A replay
    reaching another state is retried from a reload ``retries`` times (the simulator's random
    realisations often agree again), then the step raises :class:`ReplayDivergence`. The counters
    ``restores``, ``reloads``, ``replayed_steps``, ``divergences`` (replays that diverged) and
    ``failed_restores`` tell what that cost.
    """

    description = SciWorldSim.description
    action_help = SciWorldSim.action_help
    examples = SciWorldSim.examples
    max_steps = SciWorldSim.max_steps
    inner: SciWorldSim

    def __init__(self, retries: int = RETRIES) -> None:
        super().__init__(SciWorldSim())
        self.retries = retries
        self._pending: Snapshot | None = None  # restored, not yet replayed
        self._stale = False  # after a divergence: the next replay starts from scratch
        self.restores = self.reloads = self.replayed_steps = 0
        self.divergences = self.failed_restores = 0  # replays that diverged, restores given up

    def reset(self, task: Task) -> str:
        self._pending, self._stale = None, False
        obs = super().reset(task)
        _TRACES[_task_args(task), ()] = ((), False)
        return obs

    def step(self, action: str) -> StepResult:
        self.sync()
        result = super().step(action)
        if len(_TRACES) > 200_000:
            _TRACES.clear()
        _TRACES[self.inner.gold_key, self._actions] = (tuple(self.inner.trace), self.inner.done)
        return result

    def restore(self, snapshot: Snapshot) -> None:
        if snapshot.kind != "replay" or snapshot.env != self.name:
            super().restore(snapshot)  # refuses with an EnvError
        self._pending = snapshot

    def sync(self) -> None:
        """Replay a pending restore now. A replay that reaches another state is tried again
        from a reload, ``retries`` times, then raises :class:`ReplayDivergence`."""
        snap, self._pending = self._pending, None
        if snap is None:
            return
        task, actions = snap.payload
        self.restores += 1
        for _ in range(1 + self.retries):
            done = len(self._actions)
            if self._stale or task != self._task or actions[:done] != self._actions:
                self.reset(task)
                self.reloads += 1
                done = 0
            self.replayed_steps += len(actions) - done
            for action in actions[done:]:
                self.step(action)
            if self.inner.state_key() == snap.state_key:
                return
            self.divergences += 1
            self._stale = True
        self.failed_restores += 1
        raise ReplayDivergence(f"replaying {len(actions)} actions of task {task.task_id} reached "
                               f"a different state ({1 + self.retries} tries)")

    def observe(self) -> str:
        return self._pending.observation if self._pending else super().observe()

    def state_key(self) -> str:
        return self._pending.state_key if self._pending else super().state_key()

    def snapshot(self) -> Snapshot:
        return self._pending or super().snapshot()

    def expert_action(self) -> str | None:
        """From the gold path and the trace of the restored state when this process has stepped
        to it (no replay: what makes a scripted policy's env cheap), else after catching up."""
        if self._pending is not None:
            task, actions = self._pending.payload
            args = _task_args(task)
            known, gold = _TRACES.get((args, actions)), cached("gold").get(_gold_id(args))
            if known is not None and gold is not None:
                trace, done = known
                return None if done else follow_gold(gold, trace)
        self.sync()
        return super().expert_action()

    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        """ScienceWorld's ``split`` variations of the default families (see :func:`split_tasks`)."""
        return split_tasks(split, limit=limit)

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        """``{"task": family, "variation": n}`` (+ optional ``simplifications``, ``task_id``)."""
        return task_from_row(row)
