"""Scripted policies: deterministic stand-ins for an LM, for tests and engine benchmarks.

* ``scripted:oracle:p=0.3`` follows the env's expert solver and, with probability ``p``, takes a
  different valid action instead (or writes a malformed completion when ``malformed=q``); its
  thought for the expert's action is the env's ``explain`` of it (why the move), when the env
  has one, and "Trying another step." for the other actions. ``expert=any`` makes every
  winning action an expert one (:func:`omrl_search.env.winning_actions`: the valid actions
  after which the task can still be won, on an env with ``exact_value``), one drawn uniformly,
  instead of the solver's first move: demonstrations that show the many ways on, not one
  fixed choice among them;
* ``scripted:random`` picks uniformly among the valid actions.

They read the state from the request's snapshot, restored into their own env instance, so they
never touch the search's env. Randomness comes only from the request's seed: the same search with
the same seed gives the same tree. Token ids come from :class:`ByteChatTokenizer`, and the
logprob of each completion is the log-probability of the chosen action under the policy's own
distribution, spread over its tokens, so trainers get consistent behaviour-policy logprobs.
:meth:`ScriptedPolicy.score` gives a completion the log-probability of its action under that
same distribution (``mcts:priors=policy``, ``beam:propose=policy``).
"""
from __future__ import annotations

import math
import random
from typing import Any

from ..env import Env, make_env, offers_exact_value, winning_actions
from ..policy import ByteChatTokenizer, Policy, PolicyError, register_policy
from ..specs import SpecError, parse_kv
from ..types import GenRequest, Generation


class ScriptedPolicy(Policy):
    """Base: subclasses choose an action (and its probability) from an env in the right state."""

    max_batch = 1 << 30
    answers_prompts = False

    def __init__(self) -> None:
        self.tokenizer = ByteChatTokenizer()
        self._envs: dict[Any, Env] = {}  # by env name, or a remote env's origin key

    def generate(self, requests: list[GenRequest]) -> list[list[Generation]]:
        out = []
        for req in requests:
            env = self._env_for(req.meta)
            rng = random.Random(req.params.seed)
            prompt_tokens = len(req.prompt_ids) if req.prompt_ids is not None else sum(
                len(m["content"]) for m in req.messages)
            gens = []
            for _ in range(req.params.n):
                text, prob = self.choose(env, rng, req.meta)
                text = self.in_format(text, req.meta.get("agent"))
                ids = self.tokenizer.encode(text) + [256]
                lp = math.log(max(prob, 1e-12)) / len(ids)
                gens.append(Generation(text, ids, [lp] * len(ids), prompt_tokens, len(ids),
                                       "stop", True))
            out.append(gens)
        return out

    def score(self, requests: list[GenRequest], completions: list[list[str]]) -> list[list[float]]:
        """Per request, each completion's log-probability under the distribution the policy
        samples from at the request's state: that of its parsed action (:meth:`action_prob`),
        floored at 1e-12 like the logprobs of :meth:`generate`. Deterministic, no draws."""
        from ..agent import ReActFormat

        fmt, out = ReActFormat(), []
        for req, comps in zip(requests, completions, strict=True):
            env = self._env_for(req.meta)
            out.append([math.log(max(self.action_prob(env, fmt.parse(c).action), 1e-12))
                        for c in comps])
        return out

    def action_prob(self, env: Env, action: str) -> float:
        """The probability that :meth:`choose` takes ``action`` in ``env``'s state."""
        raise NotImplementedError

    def _env_for(self, meta: dict[str, Any]) -> Env:
        """An env of the policy's own in the request's state. A remote env's snapshot names
        where it lives (its payload's ``origin``, see docs/env_server.md): when only an env there
        can hold its states (an AgentGym server's, or an env not registered here), the policy
        opens one on that server and reads the actions the server lists; otherwise a local
        copy of the env replays the snapshot."""
        snap = meta.get("snapshot")
        name = meta.get("env")
        if snap is None or name is None:
            raise PolicyError("scripted policies need the env snapshot in the request meta")
        origin = getattr(snap.payload, "origin", None)
        remote = origin is not None and origin.remote_only
        key = origin.key if remote else name
        env = self._envs.get(key)
        if env is None:
            env = self._envs[key] = origin.open() if remote else make_env(name, snapshots=snap.kind)
        env.restore(snap)
        if remote and not getattr(env, "lists_actions", True):
            raise PolicyError(f"{self.name} cannot act on env {name!r} at {origin.url}: that server "
                              "lists no actions and has no expert")
        return env

    def choose(self, env: Env, rng: random.Random, meta: dict[str, Any]) -> tuple[str, float]:
        raise NotImplementedError

    @staticmethod
    def completion(thought: str, action: str) -> str:
        return f"Think: {thought}\nAct: {action}"

    @staticmethod
    def in_format(text: str, fmt: Any) -> str:
        """``text`` (a :meth:`completion`, written as ReAct writes it) re-rendered by the search's
        agent format ``fmt`` (e.g. ``act``: the ``Act:`` line alone); unchanged under a format
        that renders as ReAct does, and when it does not parse (a malformed completion)."""
        from ..agent import ReActFormat

        if fmt is None or type(fmt).render is ReActFormat.render:
            return text
        parsed = ReActFormat().parse(text)
        return text if parsed.error else fmt.render(parsed.thought, parsed.action)

    def close(self) -> None:
        for env in self._envs.values():
            env.close()
        self._envs.clear()


class OraclePolicy(ScriptedPolicy):
    """The expert's action (the solver's first move; with ``expert="any"`` one drawn uniformly
    among the winning actions), another valid action with probability ``p``."""

    EXPERTS = ("solver", "any")

    def __init__(self, p: float = 0.0, malformed: float = 0.0, expert: str = "solver"):
        super().__init__()
        if not 0.0 <= p <= 1.0 or not 0.0 <= malformed <= 1.0:
            raise PolicyError(f"scripted:oracle needs 0 <= p, malformed <= 1 (got p={p}, malformed={malformed})")
        if expert not in self.EXPERTS:
            raise PolicyError(f"scripted:oracle: expert must be one of {', '.join(self.EXPERTS)}, "
                              f"got {expert!r}")
        self.p, self.malformed, self.expert = p, malformed, expert
        self.name = f"scripted:oracle:p={p}" + ("" if expert == "solver" else f",expert={expert}")

    def experts(self, env: Env) -> list[str]:
        """The actions the oracle follows in ``env``'s state (empty: none known)."""
        if self.expert == "any":
            if not offers_exact_value(env):
                raise PolicyError(f"scripted:oracle:expert=any: env {env.name!r} does not offer "
                                  "exact_value(), so its winning actions are unknown")
            return winning_actions(env)
        action = env.expert_action()
        return [] if action is None else [action]

    def choose(self, env, rng, meta):
        if self.malformed and rng.random() < self.malformed:
            return "I am not sure what to do.", self.malformed
        experts = self.experts(env)
        others = [a for a in (env.valid_actions() or []) if a not in experts]
        if not experts or (others and rng.random() < self.p):
            if not others:
                return self.completion("No idea, trying anything.", "noop"), 1.0
            action = others[rng.randrange(len(others))]
            return self.completion("Trying another step.", action), self.p / len(others)
        # one expert (the solver's): no draw, so its searches replay as before this option
        expert = experts[0] if len(experts) == 1 else experts[rng.randrange(len(experts))]
        prob = ((1 - self.p) if others else 1.0) / len(experts)
        return self.completion(self.reason(env, expert, rng), expert), prob

    def action_prob(self, env, action):
        experts = self.experts(env)
        valid = list(dict.fromkeys(env.valid_actions() or []))
        others = [a for a in valid if a not in experts]
        if not experts:
            prob = 1.0 / len(others) if action in others else 0.0
        elif action in experts:
            prob = ((1 - self.p) if others else 1.0) / len(experts)
        else:
            prob = self.p / len(others) if action in others else 0.0
        return (1 - self.malformed) * prob

    @staticmethod
    def reason(env: Env, action: str, rng: random.Random) -> str:
        """The expert's thought: the env's ``explain(action, rng)`` when it has one (the
        reasoning the move follows from, worded by a generator seeded from ``rng``'s state so
        the policy's own draws stay as they were), else "Following the plan."."""
        explain = getattr(env, "explain", None) or getattr(getattr(env, "inner", None), "explain", None)
        line = explain(action, random.Random(hash(rng.getstate()[1]))) if explain else None
        return " ".join(line.split()) if line else "Following the plan."


class RandomPolicy(ScriptedPolicy):
    """A uniformly random valid action."""

    name = "scripted:random"

    def choose(self, env, rng, meta):
        actions = env.valid_actions()
        if not actions:
            raise PolicyError(f"scripted:random needs valid_actions() from env {env.name!r}")
        return self.completion("Random choice.", actions[rng.randrange(len(actions))]), 1 / len(actions)

    def action_prob(self, env, action):
        actions = env.valid_actions() or []
        return actions.count(action) / len(actions) if actions else 0.0


@register_policy("scripted")
def _scripted(arg: str) -> Policy:
    kind, _, rest = arg.partition(":")
    try:
        opts = parse_kv(rest, "policy")
    except SpecError as exc:
        raise PolicyError(str(exc)) from None
    if kind == "oracle":
        unknown = set(opts) - {"p", "malformed", "expert"}
        if unknown:
            raise PolicyError(f"scripted:oracle: unknown option(s) {', '.join(sorted(unknown))}")
        return OraclePolicy(float(opts.get("p", 0.0)), float(opts.get("malformed", 0.0)),
                            str(opts.get("expert", "solver")))
    if kind == "random" and not opts:
        return RandomPolicy()
    raise PolicyError(f"unknown scripted policy {arg!r} (known: scripted:oracle[:p=P,expert=solver|any], scripted:random)")
