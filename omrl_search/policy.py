"""The policy contract (docs/design.md §4): a batched LM backend.

``generate(requests)`` takes a list of :class:`GenRequest` and returns, per request, its ``n``
:class:`Generation` s, each with text, exact token ids, logprobs and usage. A backend that has a
tokenizer exposes it as :attr:`Policy.tokenizer` (a :class:`ChatTokenizer`); the engine then
builds prompts as token ids turn by turn, so the ids a trainer sees are the ids the policy saw.

Backends are factories under a spec name, listed as ``omrl_search.policies`` entry points
(docs/design.md §7): ``make_policy("scripted:oracle:p=0.3")``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Protocol, Sequence

from .plugins import Registry
from .types import GenRequest, Generation


class PolicyError(Exception):
    """A backend could not be built or could not generate (bad spec, missing model file...)."""


class ChatTokenizer(Protocol):
    """What the engine needs from a backend's tokenizer."""

    eos_token_ids: frozenset[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat template applied to ``messages`` as text."""
        ...


class Policy(ABC):
    """A batched LM backend."""

    name: str = "policy"
    tokenizer: ChatTokenizer | None = None
    #: how many sequences one backend call may hold; the engine splits larger rounds.
    max_batch: int = 64
    #: whether free-form prompts (self-evaluation, proposals, reflections) get real answers;
    #: scripted policies only pick env actions and say no.
    answers_prompts: bool = True

    @abstractmethod
    def generate(self, requests: list[GenRequest]) -> list[list[Generation]]:
        """Return ``requests[i].params.n`` generations for each request, in order."""

    #: a backend with a continuously batching scheduler of its own (vLLM's engine, an
    #: OpenAI-compatible server) sets this and implements :meth:`submit` / :meth:`collect`:
    #: the engine then hands it each request as soon as a tree makes it, and new requests
    #: join sequences already decoding instead of waiting for the slowest one of a call.
    streams: bool = False

    def submit(self, tickets: list[tuple[int, GenRequest]]) -> None:
        """Start ``(ticket, request)`` pairs (streaming backends); answers come from :meth:`collect`."""
        raise PolicyError(f"backend {self.name!r} does not stream")

    def collect(self) -> list[tuple[int, "list[Generation] | Exception"]]:
        """Wait until at least one submitted request is done; its ``(ticket, generations)``
        (or the exception that request alone failed with), for every request done by now."""
        raise PolicyError(f"backend {self.name!r} does not stream")

    @property
    def can_score(self) -> bool:
        """Whether :meth:`score` is implemented (``mcts:priors=policy`` and
        ``beam:propose=policy`` need it): true when a subclass overrides it; a backend whose
        ``score`` cannot serve sets ``can_score = False``."""
        return type(self).score is not Policy.score

    #: per request of the last :meth:`score` call, how many of its prompt tokens a prefix cache
    #: served (backends with one set it; the engine charges them as ``cached_tokens``, not prefill)
    last_score_cached: list[int] | None = None

    def score(self, requests: list[GenRequest], completions: list[list[str]]) -> list[list[float]]:
        """Per request, the total logprob of each of ``completions[i]`` (texts) as the next
        step after ``requests[i]``'s prompt: the sum of the logprobs of the completion's
        tokens, read in one batched call over the shared prompt (policy priors over a node's
        valid actions, see docs/design.md §4)."""
        raise PolicyError(f"backend {self.name!r} does not score completions (Policy.score)")

    def stats(self) -> dict[str, Any]:
        """Backend counters worth reporting (e.g. the ``hf`` prefix cache's hit rate); {} if none."""
        return {}

    def clear_cache(self) -> None:
        """Forget the KV a backend keeps across calls (``hf``'s prefix cache, ``llamacpp``'s
        streams and saved states): after its weights change in place, or to time a cold start.
        Nothing to do for a backend that keeps none."""

    def reload(self, path: str) -> None:
        """Pick up new weights (after training). Backends that can, override this."""
        raise PolicyError(f"backend {self.name!r} cannot reload weights")

    def close(self) -> None:
        """Free the model."""


class ByteChatTokenizer:
    """A tiny deterministic tokenizer (UTF-8 bytes, ids 0–255, EOS = 256) with a plain chat
    template; gives scripted policies real token ids and segments without any model."""

    eos_token_ids = frozenset({256})

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        out = "".join(f"<{m['role']}>\n{m['content']}\n</{m['role']}>\n" for m in messages)
        return out + ("<assistant>\n" if add_generation_prompt else "")


# --- registry (see docs/design.md §7) ---------------------------------------------------------
_POLICIES = Registry("omrl_search.policies", "a policy factory f(arg) -> Policy", callable)


def register_policy(name: str) -> Callable[[Callable[[str], Policy]], Callable[[str], Policy]]:
    """Register a factory that builds a policy from the text after ``name:`` in a spec (code
    and tests); installed backends are found through ``omrl_search.policies`` entry points."""

    def deco(factory: Callable[[str], Policy]) -> Callable[[str], Policy]:
        return _POLICIES.register(name, factory)

    return deco


def list_policies() -> list[str]:
    return _POLICIES.names()


def make_policy(spec: str | Policy) -> Policy:
    """Build a policy from a spec: ``smollm2``, ``hf:PATH``, ``llamacpp:FILE.gguf``,
    ``scripted:oracle:p=0.3``, ``scripted:random``; a :class:`Policy` passes through."""
    if isinstance(spec, Policy):
        return spec
    name, _, arg = spec.partition(":")
    factory = _POLICIES.get(name)
    if factory is None:
        raise PolicyError(f"unknown policy {spec!r} (known: {', '.join(_POLICIES.names())})")
    return factory(arg)


def require(module: str, extra: str) -> Any:
    """Import an optional dependency or fail with one line naming the extra to install."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PolicyError(
            f"this backend needs {module!r}: pip install 'omrl-search[{extra}]'"
        ) from None


def from_path_spec(backend: str, cls: Callable[..., Policy], arg: str, example: str) -> Policy:
    """``cls(PATH, **options)`` from a ``PATH`` or ``PATH:key=value,...`` spec argument, with
    one-line :class:`PolicyError` for a missing path, bad options or unknown keywords."""
    from .specs import SpecError, split_path_spec

    try:
        path, opts = split_path_spec(arg, "backend options")
    except SpecError as exc:
        raise PolicyError(str(exc)) from None
    if not path:
        raise PolicyError(f"{backend}: give {example}")
    try:
        return cls(path, **opts)
    except TypeError as exc:
        raise PolicyError(f"{backend}: {exc}") from None


def request_prompt_ids(backend: str, req: GenRequest, tokenizer: ChatTokenizer, vocab_size: int,
                       limit: int, limit_name: str) -> list[int]:
    """The request's prompt ids (its exact ``prompt_ids``, else its messages rendered and
    encoded), checked before a backend runs them: not empty, inside the vocabulary, shorter
    than ``limit`` positions. A bad prompt is a :class:`PolicyError` of that request alone."""
    if req.prompt_ids is not None:
        ids = [int(i) for i in req.prompt_ids]
    else:
        ids = tokenizer.encode(tokenizer.render(req.messages, add_generation_prompt=True))
    if not ids:
        raise PolicyError(f"{backend}: empty prompt")
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise PolicyError(f"{backend}: prompt holds token id {bad} outside the vocabulary ({vocab_size})")
    if len(ids) >= limit:
        raise PolicyError(f"{backend}: prompt of {len(ids)} tokens does not fit {limit_name}={limit}")
    return ids
