"""Search trees: nodes (a step plus the env snapshot after it), root-to-leaf trajectories.

Node records live in a plain list (children as id lists) so the hot path never touches networkx;
``SearchTree.graph`` builds the ``networkx.DiGraph`` over node ids on demand, tree edges plus the
merge edges Graph-of-Thoughts adds (making it a DAG).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import networkx as nx

from .types import Segment, Snapshot, Step, Task

OPEN, EXPANDED, TERMINAL, FAILED, PRUNED = "open", "expanded", "terminal", "failed", "pruned"
DUPLICATE = "duplicate state"  # the error of a node pruned because its state was seen before


@dataclass(slots=True, eq=False)
class Node:
    """A search-tree node: the step that led here, the snapshot after it and search statistics."""

    id: int
    parent: int | None
    depth: int
    observation: str
    step: Step | None = None
    snapshot: Snapshot | None = None
    state_key: str = ""
    children: list[int] = field(default_factory=list)
    visits: int = 0
    value_sum: float = 0.0
    prior: float = 1.0
    score: float | None = None  # reward-model / value score of the path ending here
    terminal: bool = False
    success: bool = False
    status: str = OPEN
    error: str = ""

    @property
    def value(self) -> float:
        return self.value_sum / self.visits if self.visits else 0.0


class SearchTree:
    """All nodes of one search, root first; edges in ``graph`` (tree edges and merge edges)."""

    __slots__ = ("task", "nodes", "merges", "agent", "_graph", "_graph_size")

    def __init__(self, task: Task, observation: str, snapshot: Snapshot | None, agent: str = "react"):
        self.task = task
        self.agent = agent  # the agent format's name (omrl_search.agent): how its prompts were written
        root = Node(0, None, 0, observation, snapshot=snapshot,
                    state_key=snapshot.state_key if snapshot else "")
        self.nodes: list[Node] = [root]
        self.merges: list[tuple[int, int]] = []  # extra parent edges (source, target)
        self._graph: nx.DiGraph | None = None
        self._graph_size = (0, 0)

    @property
    def graph(self) -> nx.DiGraph:
        """The tree as a ``networkx.DiGraph``: tree edges, and merge edges marked ``merge=True``.
        Built on first use after a change (adding edges per node would cost the hot path)."""
        size = (len(self.nodes), len(self.merges))
        if self._graph is None or self._graph_size != size:
            g = nx.DiGraph()
            g.add_nodes_from(range(len(self.nodes)))
            g.add_edges_from((n.parent, n.id) for n in self.nodes if n.parent is not None)
            g.add_edges_from(self.merges, merge=True)
            self._graph, self._graph_size = g, size
        return self._graph

    @property
    def root(self) -> Node:
        return self.nodes[0]

    def add_child(self, parent: Node, step: Step, snapshot: Snapshot | None, state_key: str) -> Node:
        node = Node(len(self.nodes), parent.id, parent.depth + 1, step.observation, step,
                    snapshot, state_key)
        self.nodes.append(node)
        parent.children.append(node.id)
        return node

    def add_merge_edge(self, source: Node, target: Node) -> None:
        """An extra parent edge (Graph-of-Thoughts aggregation)."""
        self.merges.append((source.id, target.id))

    def path(self, node: Node) -> list[Node]:
        """Root-to-``node`` along tree (first-parent) edges."""
        out = []
        cur: Node | None = node
        while cur is not None:
            out.append(cur)
            cur = self.nodes[cur.parent] if cur.parent is not None else None
        out.reverse()
        return out

    def trajectory(self, node: Node) -> "Trajectory":
        return Trajectory(self.task, self.path(node), self.agent)

    def leaves(self) -> Iterator[Node]:
        return (n for n in self.nodes if not n.children)

    def terminals(self) -> Iterator[Node]:
        return (n for n in self.nodes if n.terminal)

    def __len__(self) -> int:
        return len(self.nodes)


def dedup_key(node: Node) -> str:
    """The key dedup merges ``node`` by: its snapshot's ``dedup_key`` where the env defines one
    (:meth:`~omrl_search.env.Env.dedup_key`, e.g. Game24's numbers left without the path), else
    its state key."""
    snap = node.snapshot
    return (snap.dedup_key if snap is not None else "") or node.state_key


def unique_states(nodes: Iterable[Node], seen: set | None = None, *,
                  keep_failed: bool = False, key: Callable[[Node], Any] | None = None) -> list[Node]:
    """``nodes`` without repeated states, in order: a node whose :func:`dedup_key` is in
    ``seen`` (or was met earlier in ``nodes``) is marked pruned (:data:`DUPLICATE`) and left
    out, so one state is expanded and scored once. Failed nodes have no state: left out, or
    kept with ``keep_failed``; nodes already pruned are left out. ``seen`` is updated in place.

    The one dedup rule of the engine (``expand(dedup=True)``, ``apply``: against a node's
    existing children) and of the strategies' frontiers. ``key`` replaces the dedup key (e.g.
    ToT's ``dedup=text``: the action texts from the root)."""
    if seen is None:
        seen = set()
    if key is None:
        key = dedup_key
    out = []
    for n in nodes:
        status = n.status
        if status == FAILED:
            if keep_failed:
                out.append(n)
            continue
        if status == PRUNED:
            continue
        k = key(n)
        if k in seen:
            n.status, n.error = PRUNED, DUPLICATE
            continue
        seen.add(k)
        out.append(n)
    return out


@dataclass(slots=True)
class Trajectory:
    """A root-to-node path: the task, the root observation and the steps taken."""

    task: Task
    nodes: list[Node]
    agent: str = "react"  # the agent format its prompts were written in (see SearchTree.agent)

    @property
    def steps(self) -> list[Step]:
        return [n.step for n in self.nodes[1:] if n.step is not None]

    @property
    def leaf(self) -> Node:
        return self.nodes[-1]

    @property
    def success(self) -> bool:
        return self.leaf.success

    @property
    def answer(self) -> str | None:
        step = self.leaf.step
        return None if step is None else step.info.get("answer")

    def messages(self, first_user: str) -> list[dict[str, str]]:
        """Chat messages: ``first_user`` (the rendered first prompt), then assistant completions
        and observation turns. Observation after the last step is included as a final user turn."""
        msgs = [{"role": "user", "content": first_user}]
        for step in self.steps:
            msgs.append({"role": "assistant", "content": step.completion})
            msgs.append({"role": "user", "content": step.observation})
        return msgs

    def segments(self) -> list[Segment]:
        """Token segments ``(role, token_ids, logprobs, trainable)`` from the exact ids recorded
        at generation time; trainers derive every loss mask from these. Empty if the policy
        had no tokenizer."""
        segs: list[Segment] = []
        for step in self.steps:
            if step.context_ids is None or step.completion_ids is None:
                return []
            if step.context_ids:
                segs.append(Segment("context", list(step.context_ids), None, False))
            segs.append(Segment("assistant", list(step.completion_ids),
                                list(step.logprobs) if step.logprobs is not None else None, True))
        return segs

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task.task_id, "node_ids": [n.id for n in self.nodes],
                "success": self.success}
