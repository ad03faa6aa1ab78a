"""The plain records every part of omrl-search passes around (docs/design.md §3).

They are slotted dataclasses so the search's hot path stays cheap; validation happens at the
boundaries (files, CLI, HTTP) through pydantic ``TypeAdapter``s over these same classes
(see :mod:`omrl_search.result`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .constrain import Grammar


@dataclass(slots=True)
class Task:
    """One episode to solve: which env, which task, and what the env needs to reset to it."""

    env: str
    task_id: str
    split: str = "test"
    seed: int = 0
    instruction: str = ""
    data: dict[str, Any] = field(default_factory=dict)


#: completion tokens per step when nobody says otherwise (CLI, API, configs, the loop, online
#: GRPO and backends read this): the one default for an agent's step
DEFAULT_MAX_TOKENS = 96
#: completion tokens for a ToT proposal: one completion lists several next steps (the propose
#: prompt of Yao et al.), so it needs room for a few steps, not one
PROPOSAL_MAX_TOKENS = 160
#: completion tokens for a verdict: a ToT value prompt's "sure/likely/impossible" with a short
#: reason, or an LLM judge's score; short, so a verdict costs less than a step
VERDICT_MAX_TOKENS = 64


@dataclass(slots=True, init=False)
class StepResult:
    """What ``Env.step`` returns: Gymnasium's ``(observation, reward, terminated, truncated,
    info)``, text in and out, with the two facts every caller needs as typed fields.

    ``terminated``: the task reached an end state (solved or lost); ``truncated``: the episode
    was cut (a step limit) without reaching one. ``done`` is a read-only alias for "either".
    ``success`` says the task was solved (meaningful when terminated); ``valid`` is False when
    the action was malformed or not admissible. ``info`` carries the rest (``answer``,
    ``score``, env-specific detail). Envs written before these fields existed may still put
    ``success``/``valid`` in ``info`` and pass ``done=``; both are read as a fallback.
    """

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    success: bool
    valid: bool

    def __init__(self, observation: str, reward: float = 0.0, terminated: bool = False,
                 truncated: bool = False, info: dict[str, Any] | None = None, *,
                 success: bool | None = None, valid: bool | None = None,
                 done: bool | None = None):
        if isinstance(truncated, dict) and info is None:
            # the one-flag signature ``StepResult(obs, reward, done, info)`` of older envs
            info, truncated = truncated, False
        info = {} if info is None else info
        self.observation, self.reward = observation, reward
        self.terminated = bool(terminated or done)
        self.truncated = bool(truncated)
        self.info = info
        self.success = bool(info.get("success", False)) if success is None else bool(success)
        self.valid = bool(info.get("valid", True)) if valid is None else bool(valid)

    @property
    def done(self) -> bool:
        """``terminated or truncated`` (kept for code written against the one-flag contract)."""
        return self.terminated or self.truncated


@dataclass(slots=True)
class Snapshot:
    """A restorable env state.

    ``kind`` is ``value`` (plain data), ``native`` (the env's own save) or ``replay`` (task +
    action prefix). A snapshot restores into any instance of the env class that made it, which is
    what lets the engine pool env instances and the scripted oracle consult its own copy.
    ``dedup_key`` is the env's :meth:`~omrl_search.env.Env.dedup_key` when the env defines its
    own; empty means "same as ``state_key``" (no second hash for envs that don't).
    """

    kind: str
    payload: Any
    state_key: str
    observation: str
    env: str = ""  # the registered name of the env that made it
    dedup_key: str = ""  # the key searches that dedup merge states by; "" = state_key


@dataclass(slots=True)
class Segment:
    """A run of tokens in a trajectory: who produced them and whether they carry loss."""

    role: str  # "context" (prompt / observation turns) or "assistant"
    token_ids: list[int]
    logprobs: list[float] | None
    trainable: bool


@dataclass(slots=True)
class Step:
    """One agent turn.

    ``context_ids`` are the prompt tokens added before this turn (the whole first prompt for the
    first step, the observation turn after that); the full prompt the policy saw is the
    concatenation of ``context_ids`` and ``completion_ids`` along the path. Keeping the exact ids
    (never re-rendering the chat template) is what makes RL losses on these steps sound.
    """

    completion: str
    thought: str
    action: str
    observation: str
    reward: float = 0.0
    done: bool = False
    valid: bool = True
    success: bool = False
    context_ids: list[int] | None = None
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: the grammar the completion was sampled under, as a plain dict of the
    #: :class:`~omrl_search.constrain.Grammar` fields (kind, rules, source, think, act), so a
    #: trainer can rebuild the masks and compute the same masked logprobs; None: unconstrained
    grammar: dict[str, Any] | None = None


@dataclass(slots=True)
class SamplingParams:
    """Sampling parameters of one generation request (vLLM's names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None


@dataclass(slots=True)
class GenRequest:
    """A prompt for the policy: token ids when the engine has the policy's tokenizer, chat
    messages always. ``meta`` carries what scripted policies need (task, env snapshot).
    ``grammar``: generate under this :class:`~omrl_search.constrain.Grammar` (structured
    decoding, see docs/design.md §4); None: unconstrained."""

    messages: list[dict[str, str]]
    params: SamplingParams
    prompt_ids: list[int] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    grammar: Grammar | None = None


@dataclass(slots=True, frozen=True)
class Usage:
    """Tokens a model ran for one answer: a policy's generation (:attr:`Generation.usage`) or a
    reward model's scoring of one prefix (:meth:`omrl_search.reward.RewardModel.scored`).
    ``cached_tokens`` of ``prompt_tokens`` came from a prefix cache and were not run again."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens actually run through the model."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(slots=True)
class Generation:
    """One sampled completion with its exact token ids, their logprobs and its usage.

    Under a grammar, ``logprobs`` are those of the masked, renormalised distribution the
    tokens were sampled from. ``constraint``: the grammar's kind ("format", "actions") when it
    was in force, "none" otherwise (no grammar asked, or the text violates it: a server that
    ignored it). ``constraint_check``: the text checked against the requested grammar on the
    client, "" (no grammar), "ok", "partial" (a prefix of the language, cut short) or
    "violated"."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = "stop"  # "stop" (EOS or stop string) or "length"
    ended_with_eos: bool = False
    constraint: str = "none"
    constraint_check: str = ""
    #: of ``prompt_tokens``, how many came from a prefix cache and were not prefilled again
    #: (0 for backends without one); budgets can count ``prefill_tokens`` (the rest) apart
    cached_tokens: int = 0

    @property
    def usage(self) -> Usage:
        """This generation's tokens as the typed record reward models report too."""
        return Usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    @property
    def constrained(self) -> bool:
        """Generated under a grammar that its text satisfies (or would, had it not been cut)."""
        return self.constraint != "none"
