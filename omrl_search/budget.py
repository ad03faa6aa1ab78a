"""The compute budget charged at every call (see docs/design.md §4).

Kinds: ``prompt_tokens``, ``completion_tokens``, ``tokens`` (both together), ``lm_calls`` (one per
request sent to the policy, whatever its ``n``), ``rm_calls`` (one per prefix scored),
``rm_tokens`` (tokens a learned reward model ran through its network to score them, after its
prefix cache: what the scores cost in compute; 0 for reward models that report none),
``env_steps`` and ``seconds`` (wall time). A strategy checks the budget *before* each batched
call, so a search overshoots a limit by at most the one batch in flight.

Prompt tokens split in two, for backends with a prefix cache (``Generation.cached_tokens``):
``cached_tokens``, the prompt tokens the backend served from its cache (KV it already held), and
``prefill_tokens`` = ``prompt_tokens - cached_tokens``, the prompt tokens it actually computed.
``prompt_tokens`` (and so ``tokens``) still counts every prompt token, cached or not, so a token
budget means the same whatever the backend caches; a ``prefill_tokens`` limit budgets the compute
spent reading prompts instead. A backend without a cache reports 0 cached tokens (every prompt
token is prefill).

One door: a budget is parsed in one place (:meth:`Budget.parse`, which refuses unknown kinds and
limits that are not finite positive numbers) and charged through one named operation per kind
of cost, each adding through :meth:`Budget.charge`: :meth:`~Budget.charge_lm` (a policy
request's usage, from its generations), :meth:`~Budget.charge_scoring` (a ``Policy.score``
request: its prompt and completions read, the cached part from the backend's
``last_score_cached``), :meth:`~Budget.charge_rm` (one prefix scored by the reward model, with
the tokens it ran) and :meth:`~Budget.charge_env_step`.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from .specs import SpecError, parse_kv

if TYPE_CHECKING:  # pragma: no cover
    from .types import Generation

KINDS = ("tokens", "prompt_tokens", "completion_tokens", "prefill_tokens", "cached_tokens", "lm_calls",
         "rm_calls", "rm_tokens", "env_steps", "seconds")


class BudgetExhausted(Exception):
    """Raised by an engine primitive when the search's budget is spent."""

    @property
    def stop_reason(self) -> str:
        """What the result's ``stop_reason`` says: ``budget:KIND``."""
        return f"budget:{self.args[0]}"


class CapReached(BudgetExhausted):
    """Raised by an engine primitive when a search reaches one of the engine's safety caps
    (nodes per tree, faults per search) that hold whatever the budget says; the stop reason
    names the cap and its value, e.g. ``cap:nodes=20000``."""

    @property
    def stop_reason(self) -> str:
        return f"cap:{self.args[0]}"


def _cached(cached_tokens: int, prompt_tokens: int) -> int:
    """The cached tokens a charge counts: part of its prompt tokens, so at most all of them."""
    return min(max(int(cached_tokens), 0), max(int(prompt_tokens), 0))


@dataclass(slots=True)
class Spent:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those a prefix cache served
    lm_calls: int = 0
    rm_calls: int = 0
    rm_tokens: int = 0  # tokens a learned reward model forwarded to score this search's prefixes
    env_steps: int = 0
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the backend computed (not served by its prefix cache)."""
        return self.prompt_tokens - self.cached_tokens

    def as_dict(self) -> dict[str, float]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "tokens": self.tokens, "prefill_tokens": self.prefill_tokens,
                "cached_tokens": self.cached_tokens, "lm_calls": self.lm_calls, "rm_calls": self.rm_calls,
                "rm_tokens": self.rm_tokens, "env_steps": self.env_steps, "seconds": round(self.seconds, 4)}


@dataclass(slots=True)
class Budget:
    """Limits on any budget kind plus what has been spent; ``None`` means unlimited."""

    limits: dict[str, float] = field(default_factory=dict)
    spent: Spent = field(default_factory=Spent)
    _start: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        for kind, value in self.limits.items():
            if kind not in KINDS:
                raise SpecError(f"unknown budget kind {kind!r} (known: {', '.join(KINDS)})")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise SpecError(f"budget {kind}={value!r} must be a positive number")
            if not math.isfinite(value):  # nan or inf would run unlimited
                raise SpecError(f"budget {kind}={value} must be a finite positive number "
                                "(leave the kind out for no limit)")

    @classmethod
    def parse(cls, spec: "str | dict[str, float] | Budget | None") -> "Budget":
        """``"tokens=20000,env_steps=500"``, a dict of limits, a Budget (its limits) or None:
        the one place a budget is read (a bad kind or limit: a SpecError naming it)."""
        if spec is None:
            return cls()
        if isinstance(spec, Budget):
            return cls(dict(spec.limits))
        if isinstance(spec, str):
            spec = parse_kv(spec, "budget")
        return cls(dict(spec))

    def fresh(self) -> "Budget":
        """Same limits, nothing spent (one per task in ``search_many``)."""
        return Budget(dict(self.limits))

    def value(self, kind: str) -> float:
        if kind == "seconds":
            return time.perf_counter() - self._start
        return getattr(self.spent, kind)

    def exhausted(self, kinds: tuple[str, ...] | None = None) -> str | None:
        """The first budget kind (of ``kinds``, default all) whose limit is reached, or None."""
        for kind, limit in self.limits.items():
            if (kinds is None or kind in kinds) and self.value(kind) >= limit:
                return kind
        return None

    def check(self, kinds: tuple[str, ...] | None = None) -> None:
        """Raise :class:`BudgetExhausted` if a limit (of ``kinds``, default all) is reached."""
        kind = self.exhausted(kinds)
        if kind is not None:
            raise BudgetExhausted(kind)

    def charge(self, *, prompt_tokens: int = 0, completion_tokens: int = 0, lm_calls: int = 0,
               rm_calls: int = 0, env_steps: int = 0, cached_tokens: int = 0, rm_tokens: int = 0) -> None:
        """Add to what has been spent; ``cached_tokens`` are part of ``prompt_tokens`` (counted
        in it, at most all of it), not on top of them."""
        s = self.spent
        s.prompt_tokens += prompt_tokens
        if cached_tokens:
            s.cached_tokens += _cached(cached_tokens, prompt_tokens)
        s.completion_tokens += completion_tokens
        s.lm_calls += lm_calls
        s.rm_calls += rm_calls
        s.rm_tokens += rm_tokens
        s.env_steps += env_steps

    def charge_lm(self, gens: "Sequence[Generation]" = ()) -> None:
        """LM tokens: one request answered by the policy (or failed: no ``gens``): one LM call,
        its prompt once (the ``n`` samples share it), of which ``cached_tokens`` as the first
        sample reports them, and every sample's completion tokens. Every request, expansion or
        ask, is charged here."""
        if not gens:
            self.charge(lm_calls=1)
            return
        first = gens[0]
        self.charge(lm_calls=1, prompt_tokens=first.prompt_tokens,
                    cached_tokens=getattr(first, "cached_tokens", 0),
                    completion_tokens=sum(g.completion_tokens for g in gens))

    def charge_scoring(self, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """LM tokens read to score given completions (``Policy.score``, one request): one LM
        call and every token read as prompt tokens, ``cached_tokens`` of them from the
        backend's prefix cache."""
        self.charge(lm_calls=1, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens)

    def charge_rm(self, tokens: int = 0) -> None:
        """PRM tokens: one prefix scored by the reward model, ``tokens`` run through its network
        to score it (0 for reward models that report none)."""
        self.charge(rm_calls=1, rm_tokens=tokens)

    def charge_env_step(self) -> None:
        """One env step."""
        self.charge(env_steps=1)

    def deadline(self) -> float | None:
        """The ``time.perf_counter()`` value at which the ``seconds`` limit is reached (None:
        no such limit); the engine abandons an LM call that runs past it."""
        limit = self.limits.get("seconds")
        return None if limit is None else self._start + limit

    def stop_clock(self) -> None:
        self.spent.seconds = time.perf_counter() - self._start
