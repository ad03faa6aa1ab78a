"""Export search trees as training data: SFT rows, DPO pairs, GRPO groups, PRM step labels (parquet).

Every row keeps TRL's conversational columns (``messages``; ``prompt``/``chosen``/``rejected``;
``prompt``/``completion``) so HF ``datasets`` and TRL read it, plus our **segment** columns:
lists of ``{role, token_ids, logprobs, trainable}`` holding the exact token ids the policy saw and
produced (never re-rendered), from which trainers derive every loss mask. Each sequence is stored
whole (shared prefix first, with ``trainable: false``). TRL 1.16 with each kind: docs/interop.md.

* **SFT** (:func:`sft_rows`, rejection sampling): per task, the finished successful trajectories
  (fewer steps first), deduplicated, the top ``top_k`` kept. Invalid steps on a kept path carry
  no loss (``trainable: false`` on the segment and on the assistant message).
* **DPO** (:func:`dpo_rows`): siblings from the same prompt ids whose values differ by at least
  ``margin`` become (chosen, rejected) pairs — the prefix is identical by construction.
* **GRPO** (:func:`grpo_rows`): siblings expanded from one snapshot form a group (any size).
* **PRM** (:func:`prm_rows`): per root-to-leaf path, each step's Monte-Carlo value, MCTS Q-value
  and label (:mod:`reward_models.label_files`; ``omrl label`` adds fresh policy rollouts).
* :func:`openmanus_rows` imports the OpenManus-RL SFT format
  (``{id, conversations: [{role, content}]}`` with ``Think:``/``Act:`` turns).

Columns that could be misread mean one thing in every kind: ``reward`` is the **env's reward**
summed over the steps the row trains on (one step: that step's reward); ``value`` /
``chosen_value`` / ``soft_labels`` are **node values** (below); ``success`` is whether the row's
last step **ended a solved episode**; ``terminal`` whether it ended the episode at all.

A node's **value** (``value=``): ``mc`` — the mean outcome (1 success, 0 failure) of the finished
trajectories below it (Monte-Carlo); ``search`` — the search's own statistic (``visits``,
``value_sum``: MCTS); ``score`` — the reward model's score. Nodes without one are skipped.

Prompts are the engine's own (:func:`prompt_messages`), as is the learned PRM's text input.
Trees from policies without a real tokenizer (scripted: byte ids) or demonstrations can be
re-encoded with a real tokenizer (``tokenizer=``): the chat is encoded turn by turn with
:class:`~omrl_search.agent.TurnEncoder`, so ids match what the search would feed that model.
Such rows have no logprobs (not behaviour-policy samples).

This module imports no torch and never imports ``train``; pyarrow is imported when writing.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from .agent import ReActFormat, TurnEncoder
from .result import SearchResult, read_results
from .tree import FAILED, Node, SearchTree, Trajectory
from .types import Segment, Task

KINDS = ("sft", "dpo", "grpo", "prm", "openmanus")
VALUES = ("mc", "search", "score")
SOFT = ("mc", "q", "mean")  # what a PRM row's soft_labels hold
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


class _Renderer:
    """Chat messages exactly as the engine prompts, and segments: the recorded ids, or ids
    re-encoded with ``encoder``."""

    def __init__(self, encoder: TurnEncoder | None = None, agent_format: ReActFormat | None = None):
        self.encoder, self.format = encoder, agent_format or _FORMAT

    def messages(self, tree: SearchTree, path: list[Node], flags: Sequence[bool] | None = None
                 ) -> list[dict[str, Any]]:
        """The chat from the system prompt to the last step's completion (its observation is
        not part of what is trained). With ``flags`` (per step), every message carries a
        ``trainable`` key: the step's flag on assistant turns, false elsewhere."""
        msgs: list[dict[str, Any]] = prompt_messages(tree.task, path[0].observation, self.format)
        for i, node in enumerate(path[1:]):
            if i:
                msgs.append(self.format.observation_message(path[i].step.observation))
            msgs.append({"role": "assistant", "content": node.step.completion})
        if flags is not None:
            k = iter(flags)
            msgs = [{**m, "trainable": bool(next(k)) if m["role"] == "assistant" else False} for m in msgs]
        return msgs

    def segments(self, tree: SearchTree, path: list[Node], train_from: int,
                 mask_invalid: bool = True) -> list[dict[str, Any]]:
        """Segments of root..path[-1]; steps at depth >= ``train_from`` are trainable (invalid
        steps not, with ``mask_invalid``: SFT must not imitate them, while DPO and GRPO learn
        from them). Empty when the ids were not recorded."""
        keep = self.flags(path, train_from, mask_invalid)
        if self.encoder is not None:
            return segments_from_messages(self.messages(tree, path), self.encoder, trainable=keep)
        out, k = [], 0
        for seg in Trajectory(tree.task, path).segments():
            if seg.role == "assistant":
                out.append(seg_dict(seg, keep[k]))
                k += 1
            else:
                out.append(seg_dict(seg, False))
        return out

    @staticmethod
    def flags(path: list[Node], train_from: int, mask_invalid: bool) -> list[bool]:
        """Per step of ``path``: whether it carries loss."""
        return [n.depth >= train_from and (n.step.valid or not mask_invalid) for n in path[1:]]


def _branch_groups(tree: SearchTree) -> Iterable[tuple[Node, list[Node]]]:
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


def _terminals_below(tree: SearchTree, node: Node) -> list[Node]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.terminal and not n.children:
            out.append(n)
        stack.extend(tree.nodes[c] for c in reversed(n.children))
    return out


# --- SFT ------------------------------------------------------------------------------------------
def env_reward(path: list[Node], start: int = 1) -> float:
    """The env's reward summed over the steps of ``path`` at depth >= ``start``."""
    return float(sum(n.step.reward for n in path[1:] if n.depth >= start))


def sft_rows(results: Iterable[SearchResult], *, top_k: int = 1, include_failures: bool = False,
             tokenizer: TurnEncoder | None = None, mask_invalid: bool = True) -> list[dict[str, Any]]:
    """Rejection sampling: per task, up to ``top_k`` distinct finished trajectories, successful
    ones (``include_failures``: failed ones too, after them), fewer steps first."""
    r = _Renderer(tokenizer)
    rows = []
    for res in results:
        tree = res.tree
        leaves = [n for n in tree.terminals() if n.parent is not None and (n.success or include_failures)]
        leaves.sort(key=lambda n: (-outcome(n), n.depth, n.id))
        seen: set[tuple[str, ...]] = set()
        for leaf in leaves:
            path = tree.path(leaf)
            key = tuple(n.step.completion for n in path[1:])
            if key in seen:
                continue
            seen.add(key)
            rows.append({"task_id": tree.task.task_id, "env": tree.task.env,
                         "messages": r.messages(tree, path, r.flags(path, 1, mask_invalid)),
                         "segments": r.segments(tree, path, 1, mask_invalid),
                         "success": bool(leaf.success), "reward": env_reward(path),
                         "steps": len(path) - 1})
            if len(seen) >= top_k:
                break
    return rows


def _check_unit(unit: str) -> None:
    if unit not in ("step", "trajectory"):
        raise ExportError(f"unknown unit {unit!r} (step or trajectory)")


# --- DPO ------------------------------------------------------------------------------------------
def dpo_rows(results: Iterable[SearchResult], *, margin: float = 0.5, value: str = "mc",
             unit: str = "step", max_pairs: int = 4, tokenizer: TurnEncoder | None = None
             ) -> list[dict[str, Any]]:
    """Pairs of siblings from one prompt whose values differ by ``>= margin``. ``unit="step"``:
    chosen/rejected are the siblings' single turns (step-level DPO); ``"trajectory"``: each
    continues to its best (chosen) / worst (rejected) finished trajectory. At most ``max_pairs``
    per branch point, widest value gaps first."""
    _check_unit(unit)
    r = _Renderer(tokenizer)
    rows = []
    for res in results:
        tree = res.tree
        vals = node_values(tree, value)
        for parent, kids in _branch_groups(tree):
            scored = sorted((k for k in kids if vals[k.id] is not None), key=lambda k: -vals[k.id])
            pairs = [(a, b) for i, a in enumerate(scored) for b in scored[i + 1:]
                     if vals[a.id] - vals[b.id] >= margin and a.step.completion != b.step.completion]
            pairs.sort(key=lambda p: -(vals[p[0].id] - vals[p[1].id]))
            depth = parent.depth + 1
            for n, (a, b) in enumerate(pairs[:max_pairs]):
                ca, cb = _continuation(tree, a, unit, best=True), _continuation(tree, b, unit, best=False)
                msgs_a, msgs_b = r.messages(tree, ca), r.messages(tree, cb)
                cut = _cut(msgs_a, depth)
                rows.append({
                    "task_id": tree.task.task_id, "env": tree.task.env,
                    "pair_id": f"{tree.task.task_id}/{parent.id}/{n}",
                    "prompt": msgs_a[:cut], "chosen": msgs_a[cut:], "rejected": msgs_b[cut:],
                    "chosen_segments": r.segments(tree, ca, depth, mask_invalid=False),
                    "rejected_segments": r.segments(tree, cb, depth, mask_invalid=False),
                    "chosen_value": vals[a.id], "rejected_value": vals[b.id]})
    return rows


def _cut(msgs: list[dict[str, str]], depth: int) -> int:
    """Index of the assistant turn of step ``depth`` (1-based) in an engine-rendered chat."""
    first = next(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    return first + 2 * (depth - 1)


def _continuation(tree: SearchTree, child: Node, unit: str, best: bool) -> list[Node]:
    if unit == "step":
        return tree.path(child)
    leaves = _terminals_below(tree, child)
    if not leaves:
        return tree.path(child)
    leaf = (max if best else min)(leaves, key=lambda n: (outcome(n), -n.depth if best else n.depth))
    return tree.path(leaf)


# --- GRPO -----------------------------------------------------------------------------------------
def grpo_rows(results: Iterable[SearchResult], *, unit: str = "trajectory", value: str = "mc",
              min_group: int = 2, tokenizer: TurnEncoder | None = None) -> list[dict[str, Any]]:
    """Groups of continuations from one snapshot. ``unit="trajectory"``: every finished
    trajectory below a branch point is a member, its ``value`` the outcome (1 success, 0
    failure; best-of-N gives the classic GRPO group at the root); ``"step"``: each sibling's
    single turn, its ``value`` the sibling's node value. ``reward`` is the env's reward over the
    member's steps, ``success``/``terminal`` whether the member ended a solved / any episode.
    Rows carry the behaviour policy's logprobs in their segments."""
    _check_unit(unit)
    r = _Renderer(tokenizer)
    rows = []
    for res in results:
        tree = res.tree
        vals = node_values(tree, value) if unit == "step" else None
        for g, (parent, kids) in enumerate(_branch_groups(tree)):
            if unit == "step":
                members = [(tree.path(k), vals[k.id]) for k in kids if vals[k.id] is not None]
            else:
                members = [(tree.path(leaf), outcome(leaf)) for k in kids
                           for leaf in _terminals_below(tree, k)]
            if len(members) < min_group:
                continue
            depth = parent.depth + 1
            gid = f"{tree.task.task_id}/{parent.id}/{g}"
            for path, target in members:
                msgs = r.messages(tree, path)
                cut = _cut(msgs, depth)
                last = path[-1]
                rows.append({"task_id": tree.task.task_id, "env": tree.task.env, "group_id": gid,
                             "prompt": msgs[:cut], "completion": msgs[cut:],
                             "segments": r.segments(tree, path, depth, mask_invalid=False),
                             "value": float(target), "reward": env_reward(path, depth),
                             "success": bool(last.terminal and last.success),
                             "terminal": bool(last.terminal)})
    return rows


# --- PRM step labels -----------------------------------------------------------------------------
def label_paths(tree: SearchTree) -> list[list[Node]]:
    """Root-to-leaf paths (root excluded) worth labelling: no failed node, no duplicate-state
    prune at the end."""
    paths = []
    for leaf in tree.leaves():
        if leaf.parent is None or leaf.status == FAILED or leaf.error == "duplicate state":
            continue
        path = tree.path(leaf)[1:]
        if all(n.step is not None and n.status != FAILED for n in path):
            paths.append(path)
    return paths


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


def _soft(mc: float | None, q: float | None, how: str) -> float | None:
    if how != "mean":
        return q if how == "q" and q is not None else mc
    have = [v for v in (mc, q) if v is not None]
    return sum(have) / len(have) if have else None


def prm_rows(results: Iterable[SearchResult], *, soft: str = "mc", threshold: float = 0.5,
             tree_leaves: bool = True, extra: dict[tuple[int, int], tuple[int, int]] | None = None,
             segments: bool = True, tokenizer: TurnEncoder | None = None) -> list[dict[str, Any]]:
    """PRM label rows, one per labelled root-to-leaf path. A step's Monte-Carlo value is the
    share of successful finished leaves below its node (``tree_leaves``) plus ``extra`` rollouts
    (``{(result index, node id): (successes, rollouts)}``, what ``omrl label`` samples); a
    terminal step's value is its own success. ``soft_labels`` per ``soft``, ``labels`` =
    ``soft_labels >= threshold``; a path is cut before its first step without a value."""
    if soft not in SOFT:
        raise ExportError(f"soft must be one of {', '.join(SOFT)}, got {soft!r}")
    if not 0.0 < threshold <= 1.0:
        raise ExportError(f"need 0 < threshold <= 1, got {threshold}")
    r, extra = _Renderer(tokenizer), extra or {}
    rows = []
    for i, res in enumerate(results):
        tree = res.tree
        below = finished_below(tree) if tree_leaves else {}
        for path in label_paths(tree):
            mc, n_mc, q, visits = [], [], [], []
            for node in path:
                wins, count = (int(node.success), 1) if node.terminal else [
                    a + b for a, b in zip(below.get(node.id, (0, 0)), extra.get((i, node.id), (0, 0)))]
                mc.append(wins / count if count else None)
                n_mc.append(count)
                q.append(min(max(node.value_sum / node.visits, 0.0), 1.0) if node.visits else None)
                visits.append(node.visits)
            target = [_soft(m, qv, soft) for m, qv in zip(mc, q)]
            cut = target.index(None) if None in target else len(target)
            if cut == 0:
                continue
            path, mc, n_mc, q, visits, target = (x[:cut] for x in (path, mc, n_mc, q, visits, target))
            rows.append({
                "prompt": prompt_messages(tree.task, tree.root.observation, r.format),
                "completions": [n.step.completion for n in path],
                "labels": [t >= threshold for t in target], "soft_labels": target,
                "mc_values": mc, "mc_rollouts": n_mc, "q_values": q, "visits": visits,
                "observations": [n.step.observation for n in path],
                "segments": r.segments(tree, [tree.root] + path, 1, False) if segments else [],
                "env": tree.task.env, "task_id": tree.task.task_id, "split": tree.task.split,
                "strategy": res.strategy, "success": bool(path[-1].terminal and path[-1].success),
                "terminal": bool(path[-1].terminal)})
    return rows


# --- OpenManus-RL import ----------------------------------------------------------------------------
_ROLES = {"user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
          "system": "system", "tool": "user", "observation": "user"}


def openmanus_rows(path: str | Path, tokenizer: TurnEncoder | None = None) -> list[dict[str, Any]]:
    """SFT rows from the OpenManus-RL format (JSON list or JSONL of
    ``{id, conversations: [{role, content}]}``; ShareGPT's ``from``/``value`` also accepted).
    Segments are filled when ``tokenizer`` is given, else left empty (the trainer encodes)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ExportError(f"{path}: {exc.strerror}") from None
    stripped = text.lstrip()
    try:
        if stripped.startswith("["):
            records = list(enumerate(json.loads(text), 1))
        else:
            records = [(i, json.loads(ln)) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    except json.JSONDecodeError as exc:
        raise ExportError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    rows = []
    for i, rec in records:
        where = f"{path}:{i}"
        if not isinstance(rec, dict) or not isinstance(rec.get("conversations"), list):
            raise ExportError(f"{where}: missing 'conversations' list")
        msgs = []
        for j, turn in enumerate(rec["conversations"]):
            role = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
            content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
            if role not in _ROLES or not isinstance(content, str):
                raise ExportError(f"{where}: turn {j}: needs a known role and string content")
            msgs.append({"role": _ROLES[role], "content": content})
        if not any(m["role"] == "assistant" for m in msgs):
            raise ExportError(f"{where}: empty trajectory (no assistant turn)")
        segs: list[dict[str, Any]] = []
        if tokenizer is not None:
            try:
                segs = segments_from_messages(msgs, tokenizer)
            except ValueError as exc:
                raise ExportError(f"{where}: {exc}") from None
        rows.append({"task_id": str(rec.get("id", i)), "env": "openmanus", "messages": msgs,
                     "segments": segs, "success": True, "reward": None,  # demonstrations: no env reward
                     "steps": sum(m["role"] == "assistant" for m in msgs)})
    return rows


# --- parquet ---------------------------------------------------------------------------------------
def schema(kind: str) -> Any:
    """The pyarrow schema of ``kind`` rows (``prm``: the label-file layout)."""
    import pyarrow as pa

    pairs = [("role", pa.string()), ("content", pa.string())]
    msg = pa.list_(pa.struct(pairs))
    seg = pa.list_(pa.struct([("role", pa.string()), ("token_ids", pa.list_(pa.int64())),
                              ("logprobs", pa.list_(pa.float64())), ("trainable", pa.bool_())]))
    base = [("task_id", pa.string()), ("env", pa.string())]
    floats, ints = pa.list_(pa.float64()), pa.list_(pa.int64())
    fields = {
        "sft": base + [("messages", pa.list_(pa.struct(pairs + [("trainable", pa.bool_())]))),
                       ("segments", seg), ("success", pa.bool_()), ("reward", pa.float64()),
                       ("steps", pa.int64())],
        "dpo": base + [("pair_id", pa.string()), ("prompt", msg), ("chosen", msg),
                       ("rejected", msg), ("chosen_segments", seg), ("rejected_segments", seg),
                       ("chosen_value", pa.float64()), ("rejected_value", pa.float64())],
        "grpo": base + [("group_id", pa.string()), ("prompt", msg), ("completion", msg),
                        ("segments", seg), ("value", pa.float64()), ("reward", pa.float64()),
                        ("success", pa.bool_()), ("terminal", pa.bool_())],
        "prm": [("prompt", msg), ("completions", pa.list_(pa.string())),
                ("labels", pa.list_(pa.bool_())), ("soft_labels", floats), ("mc_values", floats),
                ("mc_rollouts", ints), ("q_values", floats), ("visits", ints),
                ("observations", pa.list_(pa.string())), ("segments", seg)] + base
               + [("split", pa.string()), ("strategy", pa.string()), ("success", pa.bool_()),
                  ("terminal", pa.bool_())],
    }[kind]
    return pa.schema(fields, metadata={b"omrl.kind": kind.encode()})


def write_parquet(rows: list[dict[str, Any]], path: str | Path, kind: str) -> Path:
    """Write rows atomically (temporary file renamed into place); ``openmanus`` rows are SFT."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind = "sft" if kind == "openmanus" else kind
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sch = schema(kind)
    table = pa.Table.from_pylist([{k: r.get(k) for k in sch.names} for r in rows], schema=sch)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def export(kind: str, sources: Sequence[str | Path], out: str | Path, *,
           tokenizer: str | TurnEncoder | None = None, **options: Any) -> tuple[Path, int]:
    """Read ``results.jsonl`` files (or an OpenManus file), build ``kind`` rows, write parquet.
    Returns (path, rows). Nothing is written when there are no rows or the input is bad."""
    if kind not in KINDS:
        raise ExportError(f"unknown export {kind!r} (one of {', '.join(KINDS)})")
    enc = load_encoder(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if kind == "openmanus":
        rows = [r for s in sources for r in openmanus_rows(s, enc)]
    else:
        results = []
        for s in sources:
            if not Path(s).is_file():
                raise ExportError(f"{s}: no such file")
            results += list(read_results(s))
        build = {"sft": sft_rows, "dpo": dpo_rows, "grpo": grpo_rows, "prm": prm_rows}[kind]
        rows = build(results, tokenizer=enc, **options)
    if not rows:
        raise ExportError(f"no {kind} rows in {', '.join(map(str, sources))} (nothing written)")
    return write_parquet(rows, out, kind), len(rows)


# --- ``omrl export`` ---------------------------------------------------------------------------------
def configure(parser: Any) -> None:
    """Export search results as SFT / DPO / GRPO / PRM-label parquet, or import OpenManus-RL data."""
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("sources", nargs="+", help="results.jsonl files (openmanus: a JSON/JSONL file)")
    parser.add_argument("--out", required=True, help="the parquet file to write")
    parser.add_argument("--tokenizer", default=None,
                        help="re-encode with this model's tokenizer (smollm2, an HF folder or a .gguf)")
    parser.add_argument("--top-k", type=int, default=1, help="sft: trajectories kept per task")
    parser.add_argument("--include-failures", action="store_true",
                        help="sft: keep failed trajectories too (after the successful ones)")
    parser.add_argument("--margin", type=float, default=0.5, help="dpo: least value gap of a pair")
    parser.add_argument("--max-pairs", type=int, default=4, help="dpo: pairs per branch point")
    parser.add_argument("--unit", choices=("step", "trajectory"), default=None,
                        help="dpo/grpo: single turns or whole continuations (dpo: step, grpo: trajectory)")
    parser.add_argument("--value", choices=VALUES, default="mc", help="dpo/grpo: node values")
    parser.add_argument("--min-group", type=int, default=2, help="grpo: smallest group kept")
    parser.add_argument("--soft", choices=SOFT, default="mc",
                        help="prm: what soft_labels hold (mc, q where there is one, their mean)")
    parser.add_argument("--threshold", type=float, default=0.5, help="prm: labels = soft_labels >= this")


def run(args: Any) -> int:
    import sys

    from .outdir import check_writable_file

    check_writable_file(args.out)  # before any input is read
    opts: dict[str, Any] = {}
    if args.kind == "sft":
        opts = {"top_k": args.top_k, "include_failures": args.include_failures}
    elif args.kind == "dpo":
        opts = {"margin": args.margin, "max_pairs": args.max_pairs, "value": args.value,
                "unit": args.unit or "step"}
    elif args.kind == "grpo":
        opts = {"min_group": args.min_group, "value": args.value, "unit": args.unit or "trajectory"}
    elif args.kind == "prm":
        opts = {"soft": args.soft, "threshold": args.threshold}
    try:
        path, n = export(args.kind, args.sources, args.out, tokenizer=args.tokenizer, **opts)
    except ExportError as exc:
        print(f"omrl export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} {args.kind} rows to {path}")
    return 0
