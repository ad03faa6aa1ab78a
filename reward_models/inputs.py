"""What a learned reward model reads: an agent episode as token ids plus one read position per step.

An :class:`Episode` is the model-independent form of a trajectory prefix (from a live
:class:`~omrl_search.tree.Trajectory` or from a row of a label file): the task prompt, each step's
completion (thought + action) and the observation that came back, and — when the policy had a
tokenizer — the exact ids the policy saw (context ids and completion ids per step).

:class:`StepEncoder` turns an episode into ``(ids, positions)`` for one reward-model tokenizer:

* ``input="segments"``: the policy's own ids, exactly as it saw them (system prompt, action help,
  chat template). Only sound when the policy's tokenizer *is* the reward model's.
* ``input="text"``: the episode rendered turn by turn with the reward model's tokenizer
  (:class:`~omrl_search.agent.TurnEncoder`): the engine's own first prompt (system prompt, task,
  action help, example, first observation — :func:`omrl_search.exports.prompt_messages`, the
  function label files' ``prompt`` comes from) closed by the template's generation prompt, each
  completion closed by the end-of-turn token, each observation as a user turn
  ``Observation: ...``. For a policy with the reward model's tokenizer these are the ids the
  policy saw (tested). Used for policies with another tokenizer (scripted policies' byte ids, a
  different model).
* ``input="auto"`` (default): segments when the episode has them and they decode, with the reward
  model's tokenizer, to the recorded completion texts; text otherwise.
* ``input="observations"``: only what the env showed after each step, one line per step, as plain
  text (no prompt, no thoughts or actions, no chat template); step ``i`` reads at the end of its
  observation. A value function over env states, as a game engine's value net reads the board:
  where the observation shows the whole state (Game24, Countdown: the numbers left and the
  target) it judges the state, not how the policy wrote its way there, and it costs tens of tokens
  a step where the text input costs hundreds. It sees the earlier observations too (one causal
  pass per episode). Only with ``read="observation"``: before the env answers there is nothing of
  the step to read.

``read="observation"`` (default) reads a step's score at the end of the observation turn that
followed it (the step's result is part of what is judged, which is what a search needs to compare
children); ``read="step"`` reads it at the last token of the assistant completion itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from omrl_search.agent import ReActFormat, TurnEncoder, make_format
from omrl_search.exports import prompt_messages
from omrl_search.tree import Trajectory

INPUTS = ("auto", "segments", "text", "observations")
READS = ("observation", "step")
_FORMAT = ReActFormat()


@dataclass(slots=True)
class Episode:
    """A trajectory prefix as plain data (see the module docstring)."""

    prompt: str | list[dict[str, str]]  # the first messages (a string: one user turn, older files)
    completions: list[str]
    observations: list[str]
    context_ids: list[list[int]] | None = None  # per step: ids added before its completion
    completion_ids: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.completions)


def first_messages(ep: Episode) -> list[dict[str, str]]:
    """The messages before an episode's first step."""
    return [{"role": "user", "content": ep.prompt}] if isinstance(ep.prompt, str) else list(ep.prompt)


def episode_from_trajectory(traj: Trajectory) -> Episode:
    steps = traj.steps
    ctx = [s.context_ids for s in steps]
    comp = [s.completion_ids for s in steps]
    has_ids = bool(steps) and all(c is not None for c in ctx) and all(c is not None for c in comp)
    return Episode(prompt_messages(traj.task, traj.nodes[0].observation, make_format(traj.agent)),
                   [s.completion for s in steps], [s.observation for s in steps],
                   [list(c) for c in ctx] if has_ids else None,  # type: ignore[arg-type]
                   [list(c) for c in comp] if has_ids else None)  # type: ignore[arg-type]


def episode_from_row(row: dict[str, Any]) -> Episode:
    """An episode from a label-file row (see :mod:`reward_models.label_files`)."""
    split = split_segments(row.get("segments") or [])
    n = len(row["completions"])
    if split is not None and len(split[1]) != n:
        split = None  # segments that do not line up with the steps are not used
    prompt = row["prompt"]
    return Episode(prompt if isinstance(prompt, str) else [dict(m) for m in prompt],
                   list(row["completions"]), list(row["observations"]),
                   split[0] if split else None, split[1] if split else None)


def truncate(ep: Episode, n: int) -> Episode:
    """The episode's first ``n`` steps."""
    return Episode(ep.prompt, ep.completions[:n], ep.observations[:n],
                   ep.context_ids[:n] if ep.context_ids is not None else None,
                   ep.completion_ids[:n] if ep.completion_ids is not None else None)


def split_segments(segments: Sequence[Any]) -> tuple[list[list[int]], list[list[int]]] | None:
    """Per-step (context ids, completion ids) from a segment list (``Segment`` objects or dicts
    with ``role`` and ``token_ids``); None when there are none."""
    if not segments:
        return None
    ctx: list[list[int]] = []
    comp: list[list[int]] = []
    pending: list[int] = []
    for seg in segments:
        role = seg["role"] if isinstance(seg, dict) else seg.role
        ids = seg["token_ids"] if isinstance(seg, dict) else seg.token_ids
        if role == "assistant":
            ctx.append(pending)
            comp.append([int(i) for i in ids])
            pending = []
        else:
            pending = pending + [int(i) for i in ids]
    return ctx, comp


class StepEncoder:
    """Token ids and per-step read positions of episodes, for one HF chat tokenizer."""

    def __init__(self, tokenizer: Any, *, read: str = "observation", input: str = "auto",
                 max_length: int = 2048):
        if read not in READS:
            raise ValueError(f"read must be one of {', '.join(READS)}, got {read!r}")
        if input not in INPUTS:
            raise ValueError(f"input must be one of {', '.join(INPUTS)}, got {input!r}")
        if input == "observations" and read != "observation":
            raise ValueError("input=observations reads the env's answer to each step: it needs "
                             "read=observation")
        self.tok, self.read, self.input, self.max_length = tokenizer, read, input, int(max_length)
        self.turns = TurnEncoder(tokenizer)
        s = TurnEncoder.SENTINEL
        closed = tokenizer.render([{"role": "user", "content": "x"},
                                   {"role": "assistant", "content": s}], add_generation_prompt=False)
        close = closed[closed.rindex(s) + len(s):].rstrip("\n ")
        self.close_ids = tokenizer.encode(close) if close else []
        self.vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else None

    # --- choosing the input ---------------------------------------------------------------------
    def segments_match(self, ep: Episode) -> bool:
        """Whether the episode's recorded ids are this tokenizer's: in range and decoding to the
        recorded completions."""
        if ep.completion_ids is None or ep.context_ids is None or not ep.completions:
            return False
        vocab = self.vocab
        for ids, text in zip(ep.completion_ids, ep.completions):
            if vocab is not None and any(i < 0 or i >= vocab for i in ids):
                return False
            if not self.tok.decode(ids).startswith(text.rstrip()):
                return False
        return True

    def mode(self, ep: Episode) -> str:
        if self.input in ("text", "observations"):
            return self.input
        ok = self.segments_match(ep)
        if self.input == "segments" and not ok:
            raise ValueError("input=segments: the episode's token ids are not this reward "
                             "model's tokenizer's (or were not recorded)")
        return "segments" if ok else "text"

    # --- encoding -------------------------------------------------------------------------------
    def encode(self, ep: Episode, steps: int | None = None) -> tuple[list[int], list[int]]:
        """``(ids, positions)``: one read position per step (the first ``steps`` steps).

        Longer than ``max_length``: the oldest tokens are cut; steps whose position was cut read
        at the first kept token."""
        n = len(ep) if steps is None else min(steps, len(ep))
        ids, pos = {"segments": self._segments, "text": self._text,
                    "observations": self._observations}[self.mode(ep)](ep, n)
        cut = len(ids) - self.max_length
        if cut > 0:
            ids = ids[cut:]
            pos = [max(p - cut, 0) for p in pos]
        return ids, pos

    def _text(self, ep: Episode, n: int) -> tuple[list[int], list[int]]:
        enc, tok = self.turns, self.tok
        ids = enc.first_prompt(first_messages(ep))
        pos: list[int] = []
        for i in range(n):
            comp = tok.encode(ep.completions[i]) + self.close_ids
            ids += comp
            if self.read == "step":
                pos.append(len(ids) - 1)
            if self.read == "observation" or i + 1 < n:
                ids += enc.observation_turn(_FORMAT.observation_message(ep.observations[i])["content"], comp)
            if self.read == "observation":
                pos.append(len(ids) - 1)
        return ids, pos

    def _observations(self, ep: Episode, n: int) -> tuple[list[int], list[int]]:
        ids: list[int] = []
        pos: list[int] = []
        for obs in ep.observations[:n]:
            ids += self.tok.encode(obs.strip() + "\n")
            pos.append(len(ids) - 1)
        return ids, pos

    def _segments(self, ep: Episode, n: int) -> tuple[list[int], list[int]]:
        ctx, comp = ep.context_ids, ep.completion_ids
        assert ctx is not None and comp is not None
        ids: list[int] = []
        pos: list[int] = []
        for i in range(n):
            if i == 0 or self.read == "step":  # (in observation mode it came with step i - 1)
                ids += ctx[i]
            ids += comp[i]
            if self.read == "step":
                pos.append(len(ids) - 1)
                continue
            if i + 1 < len(ep):  # the observation turn the policy saw before its next step
                ids += ctx[i + 1]
            else:  # after the last step it was never sent: render it with this tokenizer
                ids += self.turns.observation_turn(
                    _FORMAT.observation_message(ep.observations[i])["content"], comp[i])
            pos.append(len(ids) - 1)
        return ids, pos
