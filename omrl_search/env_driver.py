"""One search's env behind one small object: restore, step, snapshot, heuristic, faults.

Every env step happens after ``restore`` of the parent's snapshot, skipped when the env is known
to hold that state already (``at``: the node whose state the live env holds; unknown after an
error). An exception in the env marks that node failed and is counted as a fault; the search
goes on. A step's result ends its branch when the env says ``terminated`` (solved or lost: the
node's ``success`` is the env's) or ``truncated`` (cut short: never a success), or when the node
reaches the search's depth limit (see docs/design.md §4).

For structured decoding the driver also says what the env offers as an action language at a
node's state (:meth:`EnvDriver.actions`): the env's ``action_grammar()`` rules, else its
``valid_actions()`` list, else nothing; asked once per node.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .env import ReplayEnv
from .tree import FAILED, TERMINAL, Node, SearchTree
from .types import Step, Task

#: what :meth:`EnvDriver.actions` returns: ("rules", text), ("list", actions) or ("", None)
ActionSpace = tuple[str, Any]
NO_ACTIONS: ActionSpace = ("", None)

if TYPE_CHECKING:  # pragma: no cover
    from .budget import Budget
    from .env import Env


class EnvDriver:
    """The env of one search, stepping and restoring it for the tree's nodes."""

    __slots__ = ("env", "tree", "budget", "faults", "max_depth", "at", "_spaces", "_lists")

    def __init__(self, env: "Env", tree: SearchTree, budget: "Budget", faults: list[str],
                 max_depth: int):
        self.env, self.tree, self.budget, self.faults = env, tree, budget, faults
        self.max_depth = max_depth
        self.at: int | None = 0  # the node whose state the live env holds (None: unknown)
        self._spaces: dict[int, ActionSpace] = {}
        self._lists: dict[int, list[str] | None] = {}

    @staticmethod
    def open(env_factory: Callable[[str], "Env"], task: Task) -> tuple["Env", str, Any]:
        """A new env reset to ``task``: the env, its first observation and snapshot (raises
        what the env raised; the engine turns it into a failed search)."""
        env = env_factory(task.env)
        obs = env.reset(task)
        return env, obs, env.snapshot()

    def _restore(self, node: Node) -> None:
        """The env at ``node``'s state (``env.restore`` of its snapshot, unless it is there)."""
        if self.at != node.id:
            self.at = None
            self.env.restore(node.snapshot)
            self.at = node.id

    def step(self, node: Node, step: Step) -> Node:
        """``node``'s child by ``step.action``, stepped in the env from ``node``'s state."""
        env, tree = self.env, self.tree
        try:
            self._restore(node)
            res = env.step(step.action)
            self.budget.charge_env_step()
            snap = env.snapshot()
        except Exception as exc:
            self.at = None
            err = f"{type(exc).__name__}: {exc}"
            self.faults.append(f"env: {err}")
            step.observation = f"Environment error: {err}"
            child = tree.add_child(node, step, None, "")
            child.status, child.error = FAILED, err
            return child
        step.observation, step.reward, step.done, step.info = (
            res.observation, res.reward, res.done, res.info)
        step.valid, step.success = res.valid, res.success
        child = tree.add_child(node, step, snap, snap.state_key)
        self.at = child.id
        if res.terminated:
            child.terminal, child.status = True, TERMINAL
            child.success = res.success
        elif res.truncated:
            child.terminal, child.status, child.error = True, TERMINAL, "truncated"
        else:
            self.depth_limit(child)
        return child

    def invalid(self, node: Node, step: Step, error: str) -> Node:
        """A child for a malformed step: it never reaches the env and keeps ``node``'s state;
        ``error`` is its observation."""
        step.observation, step.valid = error, False
        return self.depth_limit(self.tree.add_child(node, step, node.snapshot, node.state_key))

    def depth_limit(self, child: Node) -> Node:
        """End ``child``'s branch if it reached the depth limit."""
        if child.depth >= self.max_depth:
            child.terminal, child.status, child.error = True, TERMINAL, "max depth"
        return child

    def heuristic(self, nodes: list[Node]) -> list[float]:
        """``env.heuristic()`` at each node's state (restored first); a crash scores 0."""
        out = []
        for node in nodes:
            try:
                self._restore(node)
                out.append(float(self.env.heuristic()))
            except Exception as exc:
                self.at = None
                self.faults.append(f"env heuristic: {type(exc).__name__}: {exc}")
                out.append(0.0)
        return out

    def actions(self, node: Node) -> ActionSpace:
        """The action language the env offers at ``node``'s state (restored first), asked once
        per node: ``("rules", text)`` when ``action_grammar()`` gives rules defining ``action``
        (a language wider than a list: Game24's ``answer EXPR``, SQL, shell), else
        ``("list", actions)`` from :meth:`valid_actions` (possibly empty), else ``("", None)``.
        An env error is a fault and reads as ``("list", [])``."""
        space = self._spaces.get(node.id)
        if space is None:
            grammar_fn = getattr(self._target, "action_grammar", None)
            rules = self._ask(node, grammar_fn, None) if callable(grammar_fn) else None
            if rules:
                space = ("rules", rules)
            else:
                listed = self.valid_actions(node)
                space = NO_ACTIONS if listed is None else ("list", listed)
            self._spaces[node.id] = space
        return space

    def valid_actions(self, node: Node) -> list[str] | None:
        """``valid_actions()`` at ``node``'s state (restored first), asked once per node; None
        when the env does not list them, ``[]`` after an env error (a fault)."""
        if node.id not in self._lists:
            listed = self._ask(node, self._target.valid_actions, [])
            self._lists[node.id] = None if listed is None else [str(a) for a in listed]
        return self._lists[node.id]

    @property
    def _target(self) -> Any:
        """The env whose methods answer (a replay wrapper's inner env)."""
        return self.env.inner if isinstance(self.env, ReplayEnv) else self.env

    def _ask(self, node: Node, method: Callable[[], Any], on_error: Any) -> Any:
        try:
            self._restore(node)
            return method()
        except Exception as exc:
            self.at = None
            self.faults.append(f"env actions: {type(exc).__name__}: {exc}")
            return on_error

    def close(self) -> None:
        self.env.close()
