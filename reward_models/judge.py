"""An LLM judge: a prompted policy grades each prefix, ``Score: N`` on a 0–10 scale.

Any :mod:`omrl_search.policy` spec can judge (``smollm2``, ``hf:PATH``, ``openai:...``); the
policy must answer free-form prompts (scripted policies only pick env actions). Spec:
``judge:POLICY`` with judge options after a semicolon, e.g.
``judge:smollm2;samples=3,temperature=0.7,per_step=all``.

* ``samples`` answers are drawn per prompt and the parsed scores averaged; answers without a
  ``Score:`` line are dropped. When *none* of a prefix's answers parses, that prefix's entry in
  :meth:`LLMJudge.score` is a :class:`JudgeParseError` instead of a score list (and
  :meth:`LLMJudge.value` returns it instead of a float): the engine records it as a fault of that
  prefix and scores it 0. ``strict=true`` raises instead (the whole batch becomes faults).
* ``per_step=last`` (default) grades the prefix once and gives every step that grade;
  ``per_step=all`` grades every step's own prefix (cached by prompt text across calls).
* All prompts of one ``score`` call go to the policy in one ``generate`` call. The judge's own
  tokens are counted in :attr:`LLMJudge.usage`; the search budget charges one ``rm_call`` per
  prefix, as for every reward model.
"""
from __future__ import annotations

import hashlib
import re
from typing import Any

from omrl_search.reward import AGGREGATIONS, RewardModel, register_reward_model
from omrl_search.specs import parse_kv
from omrl_search.tree import Trajectory
from omrl_search.types import VERDICT_MAX_TOKENS, GenRequest, SamplingParams

JUDGE_PROMPT = (
    "You grade an agent's progress on a task.\n\nTask: {task}\n\nStart: {start}\n\n"
    "Steps so far:\n{steps}\n\nHow likely is it that the agent completes the task from here? "
    "Answer with one line 'Score: N' where N is a number from 0 (certainly not) to 10 (certainly)."
)
_SCORE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)


class JudgeParseError(ValueError):
    """No answer of the judge for a prefix had a readable ``Score: N``."""


def parse_score(text: str, scale: float = 10.0) -> float | None:
    """The last ``Score: N`` in ``text`` divided by ``scale`` and clipped to [0, 1]; None if none."""
    found = _SCORE.findall(text)
    if not found:
        return None
    return min(max(float(found[-1]) / scale, 0.0), 1.0)


def answers_prompts(policy: Any) -> bool:
    """The engine's rule: ``policy.answers_prompts`` if set, else not a scripted policy."""
    flag = getattr(policy, "answers_prompts", None)
    if flag is None:
        from omrl_search.backends.scripted import ScriptedPolicy

        flag = not isinstance(policy, ScriptedPolicy)
    return bool(flag)


def render_steps(traj: Trajectory, upto: int | None = None) -> str:
    steps = traj.steps[:upto]
    return "\n".join(f"{i}. {s.completion.strip()}\n   Observation: {s.observation.strip()}"
                     for i, s in enumerate(steps, 1)) or "(none)"


class LLMJudge(RewardModel):
    """A prompted policy as a reward model (see the module docstring)."""

    def __init__(self, policy: Any, *, samples: int = 1, temperature: float = 0.0,
                 max_tokens: int = VERDICT_MAX_TOKENS, per_step: str = "last", aggregation: str = "last",
                 scale: float = 10.0, strict: bool = False, prompt: str = JUDGE_PROMPT):
        from omrl_search.policy import make_policy

        if samples < 1 or max_tokens < 1 or scale <= 0:
            raise ValueError("judge needs samples >= 1, max_tokens >= 1 and scale > 0")
        if per_step not in ("last", "all"):
            raise ValueError(f"judge per_step must be last or all, got {per_step!r}")
        if aggregation not in AGGREGATIONS:
            raise ValueError(f"unknown aggregation {aggregation!r} (known: {', '.join(AGGREGATIONS)})")
        self.policy = make_policy(policy)
        if not answers_prompts(self.policy):
            raise ValueError(f"judge: policy {self.policy.name!r} does not answer free-form prompts")
        self.samples, self.temperature, self.max_tokens = int(samples), float(temperature), int(max_tokens)
        self.per_step, self.aggregation, self.scale, self.strict = per_step, aggregation, float(scale), strict
        self.prompt = prompt
        self.name = f"judge:{self.policy.name}"
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "calls": 0, "unparsed": 0}
        self._cache: dict[str, float | JudgeParseError] = {}

    def render(self, traj: Trajectory, upto: int | None = None) -> str:
        return self.prompt.format(task=traj.task.instruction.strip(), start=traj.nodes[0].observation.strip(),
                                  steps=render_steps(traj, upto))

    def _grade(self, prompts: list[str]) -> None:
        """Fill the cache for prompts not graded yet, in one policy call."""
        todo = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        if not todo:
            return
        reqs = []
        for p in todo:
            seed = int.from_bytes(hashlib.blake2b(p.encode(), digest_size=8).digest(), "big") >> 1
            params = SamplingParams(self.temperature, 1.0, self.max_tokens, (), self.samples, seed)
            reqs.append(GenRequest([{"role": "user", "content": p}], params, None, {"ask": True}))
        gens = self.policy.generate(reqs)
        self.usage["calls"] += 1
        for p, gs in zip(todo, gens):
            vals = [v for v in (parse_score(g.text, self.scale) for g in gs) if v is not None]
            self.usage["prompt_tokens"] += gs[0].prompt_tokens if gs else 0
            self.usage["completion_tokens"] += sum(g.completion_tokens for g in gs)
            self.usage["unparsed"] += len(gs) - len(vals)
            if vals:
                self._cache[p] = sum(vals) / len(vals)
            else:
                shown = " | ".join(g.text.strip()[:60] for g in gs)
                self._cache[p] = JudgeParseError(f"judge answer has no 'Score: N': {shown!r}")

    def score(self, prefixes: list[Trajectory]) -> list[Any]:
        plans = []
        for t in prefixes:
            n = len(t.steps)
            if not n:
                plans.append([])
            elif self.per_step == "all":
                plans.append([self.render(t, i) for i in range(1, n + 1)])
            else:
                plans.append([self.render(t)] * n)
        self._grade([p for plan in plans for p in plan])
        out: list[Any] = []
        for plan in plans:
            vals = [self._cache[p] for p in plan]
            bad = next((v for v in vals if isinstance(v, Exception)), None)
            out.append(bad if bad is not None else vals)
        if self.strict and any(isinstance(v, Exception) for v in out):
            raise next(v for v in out if isinstance(v, Exception))
        if len(self._cache) > 100_000:
            self._cache.clear()
        return out


@register_reward_model("judge")
def _judge(arg: str) -> LLMJudge:
    spec, _, rest = arg.partition(";")
    if not spec:
        raise ValueError("judge: give a policy spec, e.g. judge:smollm2;samples=3")
    opts = parse_kv(rest, "judge options")
    known = {"samples", "temperature", "max_tokens", "per_step", "aggregation", "scale", "strict"}
    bad = sorted(set(opts) - known)
    if bad:
        raise ValueError(f"judge: unknown option(s) {', '.join(bad)} (known: {', '.join(sorted(known))})")
    return LLMJudge(spec, **opts)
