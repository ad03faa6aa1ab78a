"""What every export kind shares: segments (exact token ids, or a chat re-encoded turn by turn),
node values, the engine's prompts, and walking a search tree's branch points.

Split out of :mod:`omrl_search.exports` (which holds the column conventions and the writer);
each kind's rows live in ``export_<kind>.py``. No torch, never ``train``.
"""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

from .agent import ReActFormat, TurnEncoder, make_format
from .tree import FAILED, Node, SearchTree, Trajectory
from .types import Segment, Task

VALUES = ("mc", "search", "score")
_FORMAT = ReActFormat()

class ExportError(ValueError):
    """Bad input to an export; the message is one line (``file:row: reason`` where it can)."""


# --- segments ---------------------------------------------------------------------------------
def seg_dict(seg: Segment, trainable: bool | None = None) -> dict[str, Any]:
    return {"role": seg.role, "token_ids": list(seg.token_ids),
            "logprobs": list(seg.logprobs) if seg.logprobs is not None else None,
            "trainable": seg.trainable if trainable is None else trainable}


def segments_from_messages(messages: Sequence[dict[str, Any]], encoder: TurnEncoder, *,
                           train_from: int = 0, trainable: Sequence[bool] | None = None
                           ) -> list[dict[str, Any]]:
    """Segments of a chat encoded turn by turn as the engine does: the messages before the first
    assistant turn as one prompt, each assistant turn as its text plus the end-of-turn token, each
    later user/tool turn as :meth:`TurnEncoder.observation_turn`. Assistant turns at message
    index ``>= train_from`` are trainable unless ``trainable[i]`` (for the i-th assistant turn)
    or the message's own ``trainable`` key is false. A trailing user turn is dropped. Raises ValueError
    on a chat that has no assistant turn or two non-assistant turns in a row after it."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("no assistant turn after a prompt" if first is None else
                         "the chat starts with an assistant turn (no prompt)")
    segs = [{"role": "context", "token_ids": encoder.first_prompt(list(messages[:first])),
             "logprobs": None, "trainable": False}]
    close = encoder.close_ids
    last_ids: list[int] = []
    k = 0
    prev = "assistant"
    for i in range(first, len(messages)):
        m = messages[i]
        if m["role"] == "assistant":
            last_ids = encoder.tok.encode(m["content"]) + close
            flag = trainable[k] if trainable is not None else m.get("trainable") is not False
            train = i >= train_from and bool(flag)
            segs.append({"role": "assistant", "token_ids": last_ids, "logprobs": None,
                         "trainable": train})
            k += 1
        elif prev != "assistant":
            raise ValueError(f"message {i}: two {m['role']!r}/{prev!r} turns in a row")
        elif i + 1 < len(messages):  # an observation turn followed by another assistant turn
            segs.append({"role": "context", "logprobs": None, "trainable": False,
                         "token_ids": encoder.observation_turn(m["content"], last_ids)})
        prev = m["role"]
    return segs


def load_encoder(spec: str) -> TurnEncoder:
    """A TurnEncoder for ``smollm2``, an HF folder, or ``DIR/model.gguf``."""
    from transformers import AutoTokenizer

    from .backends.hf_tokenizer import HFChatTokenizer

    kw: dict[str, Any] = {}
    if spec == "smollm2":
        from .backends.smollm2 import hf_folder

        path = hf_folder()
    elif spec.endswith(".gguf"):
        path, kw["gguf_file"] = os.path.split(os.path.abspath(spec))
    else:
        path = spec
    if not os.path.exists(path):
        raise ExportError(f"tokenizer {spec!r} does not exist")
    return TurnEncoder(HFChatTokenizer(AutoTokenizer.from_pretrained(path, **kw)))


# --- values and rendering -----------------------------------------------------------------------
def outcome(node: Node) -> float:
    return 1.0 if node.success else 0.0


def node_values(tree: SearchTree, value: str = "mc") -> list[float | None]:
    """Each node's value (see the module docstring), indexed by node id."""
    if value not in VALUES:
        raise ExportError(f"unknown value {value!r} (one of {', '.join(VALUES)})")
    nodes = tree.nodes
    if value == "search":
        return [n.value if n.visits else (outcome(n) if n.terminal else None) for n in nodes]
    if value == "score":
        return [n.score for n in nodes]
    total, count = [0.0] * len(nodes), [0] * len(nodes)
    for leaf in tree.terminals():
        o = outcome(leaf)
        cur: Node | None = leaf
        while cur is not None:
            total[cur.id] += o
            count[cur.id] += 1
            cur = nodes[cur.parent] if cur.parent is not None else None
    return [t / c if c else None for t, c in zip(total, count)]


def prompt_messages(task: Task, observation: str, agent_format: ReActFormat | None = None
                    ) -> list[dict[str, str]]:
    """The system and first user turn the engine shows the policy for ``task`` (task, the env's
    action help and example, ``observation``): the prompt of every export and of PRM labels, and
    what the learned PRM reads in text mode (one function, so the three cannot drift apart).
    An env not registered here gets no action help."""
    from .env import env_class

    try:
        env: Any = env_class(task.env)  # action_help and examples are class attributes
    except KeyError:
        env = None
    return (agent_format or _FORMAT).first_messages(env, task, observation)


class Renderer:
    """Chat messages exactly as the engine prompts, and segments: the recorded ids, or ids
    re-encoded with ``encoder``."""

    def __init__(self, encoder: TurnEncoder | None = None, agent_format: ReActFormat | None = None):
        self.encoder, self._format = encoder, agent_format

    def format(self, tree: SearchTree) -> ReActFormat:
        """The agent format ``tree``'s prompts were written in (its ``agent``), unless this
        renderer was given one."""
        return self._format or make_format(tree.agent)

    def messages(self, tree: SearchTree, path: list[Node], flags: Sequence[bool] | None = None
                 ) -> list[dict[str, Any]]:
        """The chat from the system prompt to the last step's completion (its observation is
        not part of what is trained). With ``flags`` (per step), every message carries a
        ``trainable`` key: the step's flag on assistant turns, false elsewhere."""
        fmt = self.format(tree)
        msgs: list[dict[str, Any]] = prompt_messages(tree.task, path[0].observation, fmt)
        for i, node in enumerate(path[1:]):
            if i:
                msgs.append(fmt.observation_message(path[i].step.observation))
            msgs.append({"role": "assistant", "content": node.step.completion})
        if flags is not None:
            k = iter(flags)
            msgs = [{**m, "trainable": bool(next(k)) if m["role"] == "assistant" else False} for m in msgs]
        return msgs

    def segments(self, tree: SearchTree, path: list[Node], train_from: int,
                 mask_invalid: bool = True, grammar: bool = False) -> list[dict[str, Any]]:
        """Segments of root..path[-1]; steps at depth >= ``train_from`` are trainable (invalid
        steps not, with ``mask_invalid``: SFT must not imitate them, while DPO and GRPO learn
        from them). Empty when the ids were not recorded. With ``grammar`` each assistant
        segment also carries the grammar its step was sampled under (``Step.grammar``, None if
        unconstrained), so a trainer can recompute the masked logprobs the sampler recorded;
        re-encoded segments have no behaviour logprobs and get None."""
        keep = self.flags(path, train_from, mask_invalid)
        if self.encoder is not None:
            segs = segments_from_messages(self.messages(tree, path), self.encoder, trainable=keep)
            return [{**s, "grammar": None} for s in segs] if grammar else segs
        out, k = [], 0
        for seg in Trajectory(tree.task, path).segments():
            if seg.role == "assistant":
                out.append(seg_dict(seg, keep[k]))
                if grammar:
                    out[-1]["grammar"] = path[1 + k].step.grammar
                k += 1
            else:
                out.append(seg_dict(seg, False))
        return out

    @staticmethod
    def flags(path: list[Node], train_from: int, mask_invalid: bool) -> list[bool]:
        """Per step of ``path``: whether it carries loss."""
        return [n.depth >= train_from and (n.step.valid or not mask_invalid) for n in path[1:]]


def branch_groups(tree: SearchTree) -> Iterable[tuple[Node, list[Node]]]:
    """(parent, children) for every node whose children came from the same prompt ids
    (siblings expanded together share them; differently prompted calls form separate groups).
    Failed or pruned children are left out."""
    for node in tree.nodes:
        if len(node.children) < 2:
            continue
        groups: dict[tuple, list[Node]] = {}
        for cid in node.children:
            c = tree.nodes[cid]
            if c.step is None or c.status in ("failed", "pruned"):
                continue
            key = tuple(c.step.context_ids) if c.step.context_ids is not None else ()
            groups.setdefault(key, []).append(c)
        for kids in groups.values():
            if len(kids) >= 2:
                yield node, kids


def terminals_below(tree: SearchTree, node: Node) -> list[Node]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.terminal and not n.children:
            out.append(n)
        stack.extend(tree.nodes[c] for c in reversed(n.children))
    return out


def env_reward(path: list[Node], start: int = 1) -> float:
    """The env's reward summed over the steps of ``path`` at depth >= ``start``."""
    return float(sum(n.step.reward for n in path[1:] if n.depth >= start))


def check_unit(unit: str) -> None:
    if unit not in ("step", "trajectory"):
        raise ExportError(f"unknown unit {unit!r} (step or trajectory)")


def cut_at(msgs: list[dict[str, str]], depth: int) -> int:
    """Index of the assistant turn of step ``depth`` (1-based) in an engine-rendered chat."""
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return first + 2 * (depth - 1)


def finished_below(tree: SearchTree) -> dict[int, tuple[int, int]]:
    """Per node id: (successful, all) finished non-failed leaves in its subtree."""
    out: dict[int, tuple[int, int]] = {}
    for node in reversed(tree.nodes):  # children always come after their parent
        done = node.terminal and node.status != FAILED
        wins, count = (int(node.success), 1) if done else (0, 0)
        for c in node.children:
            w, n = out[c]
            wins, count = wins + w, count + n
        out[node.id] = (wins, count)
    return out


def q_values(tree: SearchTree) -> dict[int, tuple[float, bool]]:
    """Each node's ``(Q, proven)`` by id (the root left out): a finished step is its success (a
    proven win or loss), a node with a solved finished leaf below it is a proven win (1.0: the
    env is deterministic and single-player, so the way down is a way to win), any other node
    with MCTS visits its visit-weighted mean return (value sum / visits, clipped to [0, 1]; not
    proven). Nodes with neither are absent."""
    nodes = tree.nodes
    won: set[int] = set()
    for n in nodes:
        if n.terminal and n.success and n.status != FAILED:
            up: int | None = n.id
            while up is not None and up not in won:
                won.add(up)
                up = nodes[up].parent
    out: dict[int, tuple[float, bool]] = {}
    for n in nodes[1:]:
        if n.id in won:
            out[n.id] = (1.0, True)
        elif n.terminal:
            out[n.id] = (0.0, True)
        elif n.visits:
            out[n.id] = (min(max(n.value_sum / n.visits, 0.0), 1.0), False)
    return out
