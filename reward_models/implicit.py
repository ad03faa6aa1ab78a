"""The implicit PRM: process rewards read off a policy trained on outcomes (PRIME's idea).

A policy ``pi`` trained from a reference ``pi_ref`` with an outcome reward (DPO, GRPO, SFT on
successes) implicitly defines a dense reward: the step reward of step ``t`` is
``r_t = beta * log pi(step_t | prefix) / pi_ref(step_t | prefix)``, the log-ratio summed over the
step's tokens, and the running sum ``sum_{s <= t} r_s`` plays the value of the path so far. No PRM
is trained and no step labels are needed; the cost is two scoring passes (policy and reference)
per new step.

Spec: ``implicit:POLICY[,ref=REF][,beta=B][,squash=sigmoid|none]`` — any policy spec that can
score completions (``Policy.score``: ``hf:FOLDER``, ``smollm2``); ``ref`` defaults to the base
model recorded in ``FOLDER/omrl-train.json`` by ``omrl train`` (the model the policy was trained
from); ``beta`` defaults to 0.05. :meth:`ImplicitPRM.score` gives, per step, the squashed running
sum (``sigmoid``, default, maps it into (0, 1) like every other reward model's scores, so
``value=rm`` and MCTS backups read it unchanged; ``none`` keeps the raw sum), so the default
aggregation ``last`` is the value of the path. :meth:`ImplicitPRM.step_rewards` gives the raw
``r_t``.

Scoring goes through the policy backend's :meth:`~omrl_search.policy.Policy.score`: the steps
that follow the same prefix (siblings, the children of one expansion) are one request, whose
prompt the backend prefills once (``hf``: through its prefix cache, which also keeps the prompts
of earlier calls); a step scored before (the shared ancestors of every prefix of a search) is
not scored again (memoised by prefix and completion). :meth:`scored`'s usage records (what the
engine charges as ``rm_tokens``) count, per prefix, the prompt and completion tokens both models ran for the
steps it was the first to need, less the prompt tokens their prefix caches served; a memoised
step costs nothing. The prompt of a step is the engine's own
(:func:`omrl_search.exports.prompt_messages`, then the completions and observation turns of the
format the search used).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omrl_search.agent import make_format
from omrl_search.reward import RewardModel, Scored, register_reward_model
from omrl_search.specs import SpecError, coerce
from omrl_search.tree import Trajectory
from omrl_search.types import GenRequest, SamplingParams, Usage

from .inputs import Episode, episode_from_trajectory, first_messages

OPTIONS = ("ref", "beta", "squash")
SQUASHES = ("sigmoid", "none")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class ImplicitPRM(RewardModel):
    """Step rewards ``beta * log pi / pi_ref`` over each step's tokens (see the module doc)."""

    name = "implicit"
    aggregation = "last"

    def __init__(self, policy: Any, ref: Any, beta: float = 0.05, squash: str = "sigmoid"):
        if not beta > 0:
            raise ValueError(f"implicit: beta must be > 0, got {beta!r}")
        if squash not in SQUASHES:
            raise ValueError(f"implicit: squash must be one of {', '.join(SQUASHES)}, got {squash!r}")
        for role, p in (("policy", policy), ("ref", ref)):
            if not getattr(p, "can_score", False):
                raise ValueError(f"implicit: the {role} {getattr(p, 'name', p)!r} cannot score "
                                 "completions (Policy.score); use hf:FOLDER or smollm2")
        self.policy, self.ref, self.beta, self.squash = policy, ref, float(beta), squash
        self._memo: dict[tuple, float] = {}  # (prefix key, completion) -> step reward
        self.steps_scored = 0  # steps scored (each by both models); memo hits are not counted

    def step_rewards(self, prefixes: list[Trajectory]) -> list[list[float]]:
        """Per prefix, the raw step rewards ``r_t``."""
        return self.rewards_and_usage(prefixes)[0]

    def rewards_and_usage(self, prefixes: list[Trajectory]) -> tuple[list[list[float]], list[Usage]]:
        """Per prefix, the raw step rewards ``r_t`` and the tokens both models ran for them
        (as ``prompt_tokens``; memoised steps run none). Every step not scored before is scored
        in one call per model, steps after the same prefix in one request."""
        return self._rewards([(traj.task.task_id, episode_from_trajectory(traj), make_format(traj.agent),
                               {"task": traj.task}) for traj in prefixes])

    def score_episodes(self, episodes: list[Episode]) -> list[list[float]]:
        """Per episode (a label-file row's: :func:`reward_models.inputs.episode_from_row`), the
        squashed running sum at each step, the way a trained PRM's ``score_episodes`` scores a
        row; so held-out yardsticks (``benchmarks/prm_heldout.py``) score both alike."""
        steps, _ = self._rewards([(json.dumps(first_messages(ep)), ep, make_format("react"), {})
                                  for ep in episodes])  # the observation turn is one for every format
        return [self._values(rewards) for rewards in steps]

    def _rewards(self, episodes: list[tuple[str, Episode, Any, dict[str, Any]]]
                 ) -> tuple[list[list[float]], list[Usage]]:
        """:meth:`rewards_and_usage` of ``(key, episode, format, request meta)`` items, where
        ``key`` names the episode's start (its task) for the memo."""
        plans, requests, groups = [], {}, {}
        for start, ep, fmt, meta in episodes:
            messages = first_messages(ep)
            keys = []
            for i, completion in enumerate(ep.completions):
                prefix = (start, tuple(ep.completions[:i]), tuple(ep.observations[:i]))
                keys.append((prefix, completion))
                if (prefix, completion) not in self._memo:
                    if prefix not in requests:
                        requests[prefix] = GenRequest(list(messages), SamplingParams(), None, meta)
                        groups[prefix] = []
                    if completion not in groups[prefix]:
                        groups[prefix].append(completion)
                messages += [{"role": "assistant", "content": completion},
                             fmt.observation_message(ep.observations[i])]
            plans.append(keys)
        cost: dict[tuple, int] = {}
        if requests:
            order = list(requests)
            reqs, comps = [requests[k] for k in order], [groups[k] for k in order]
            for model in dict.fromkeys((self.policy, self.ref)):  # the same model once
                for k, n in zip(order, self._tokens_run(model, reqs, comps)):
                    cost[k] = cost.get(k, 0) + n
            mine = self.policy.score(reqs, comps)
            self._tokens_after(self.policy, order, cost)
            theirs = mine if self.ref is self.policy else self.ref.score(reqs, comps)
            if self.ref is not self.policy:
                self._tokens_after(self.ref, order, cost)
            for k, cs, lp, lr in zip(order, comps, mine, theirs):
                for c, a, b in zip(cs, lp, lr):
                    self._memo[(k, c)] = self.beta * (a - b)
                self.steps_scored += len(cs)
        # each request's tokens go to the first prefix of the call that needed it
        usage = [Usage(prompt_tokens=sum(cost.pop(prefix, 0) for prefix, _ in keys)) for keys in plans]
        return [[self._memo[key] for key in keys] for keys in plans], usage

    @staticmethod
    def _tokens_run(model: Any, reqs: list[GenRequest], comps: list[list[str]]) -> list[int]:
        """Per request, the tokens ``model`` runs to score it: its prompt (rendered with the
        model's chat template) and every completion; 0 for a model without a tokenizer (the
        prompt tokens its prefix cache serves are taken off by :meth:`_tokens_after`)."""
        tok = getattr(model, "tokenizer", None)
        if tok is None or not hasattr(tok, "render"):
            return [0] * len(reqs)
        return [len(tok.encode(tok.render(r.messages, True))) + sum(len(tok.encode(c)) for c in cs)
                for r, cs in zip(reqs, comps)]

    @staticmethod
    def _tokens_after(model: Any, order: list[tuple], cost: dict[tuple, int]) -> None:
        """``cost`` less the prompt tokens ``model``'s prefix cache served in its last
        :meth:`~omrl_search.policy.Policy.score` call (``last_score_cached``)."""
        served = getattr(model, "last_score_cached", None)
        if isinstance(served, list) and len(served) == len(order):
            for k, n in zip(order, served):
                cost[k] = max(cost[k] - int(n), 0)

    def scored(self, prefixes: list[Trajectory]) -> Scored:
        """Per step, the (squashed) running sum of the step rewards up to it, with the tokens
        run for each prefix."""
        steps, usage = self.rewards_and_usage(prefixes)
        return Scored([self._values(rewards) for rewards in steps], usage)

    def _values(self, rewards: list[float]) -> list[float]:
        """The (squashed) running sums of step rewards."""
        total, values = 0.0, []
        for r in rewards:
            total += r
            values.append(sigmoid(total) if self.squash == "sigmoid" else total)
        return values

    def score(self, prefixes: list[Trajectory]) -> list[list[float]]:
        return self.scored(prefixes).steps

    def clear_cache(self) -> None:
        """Forget memoised step rewards (after the policy's weights change)."""
        self._memo.clear()


def parse_implicit_spec(arg: str) -> tuple[str, dict[str, str]]:
    """``"hf:/m,ref=hf:/base,beta=0.1"`` -> ``("hf:/m", {"ref": "hf:/base", "beta": "0.1"})``:
    a comma part that starts with a known option starts that option; any other part continues
    the policy spec or the option before it (policy specs may hold commas)."""
    policy, opts, current = [], {}, None
    for part in arg.split(","):
        key, eq, value = part.partition("=")
        if eq and key.strip() in OPTIONS:
            current = key.strip()
            if current in opts:
                raise SpecError(f"bad implicit spec {arg!r}: {current} given twice")
            opts[current] = value.strip()
        elif current is None:
            policy.append(part)
        else:
            opts[current] += "," + part
    spec = ",".join(policy).strip()
    if not spec:
        raise SpecError(f"bad implicit spec {arg!r}: expected implicit:POLICY[,ref=REF][,beta=B]")
    return spec, opts


def default_ref(policy_spec: str) -> str:
    """The model a policy folder was trained from (``omrl-train.json``'s ``base_model``), as a
    policy spec; one SpecError line when there is none."""
    name, _, path = policy_spec.partition(":")
    marker = Path(path) / "omrl-train.json" if name == "hf" and path else None
    base = None
    if marker is not None and marker.is_file():
        try:
            base = json.loads(marker.read_text()).get("base_model")
        except (OSError, ValueError):
            base = None
    if not base:
        raise SpecError(f"implicit: no ref given and {policy_spec!r} records no base model "
                        "(omrl-train.json); give ref=REF, the policy before outcome training")
    return f"hf:{base}" if Path(base).is_dir() else str(base)


@register_reward_model("implicit")
def _implicit(arg: str) -> ImplicitPRM:
    from omrl_search.policy import make_policy

    spec, opts = parse_implicit_spec(arg)
    beta = coerce(opts.get("beta", "0.05"))
    if isinstance(beta, bool) or not isinstance(beta, (int, float)):
        raise SpecError(f"implicit: beta must be a number, got {opts['beta']!r}")
    squash = opts.get("squash", "sigmoid")
    if squash not in SQUASHES:
        raise SpecError(f"implicit: squash must be one of {', '.join(SQUASHES)}, got {squash!r}")
    ref = opts.get("ref") or default_ref(spec)  # before any weights load
    policy = make_policy(spec)
    return ImplicitPRM(policy, policy if ref == spec else make_policy(ref), float(beta), squash)

