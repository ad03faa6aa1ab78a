"""Structured decoding (see docs/design.md §4): the grammar a policy is asked to generate under.

A :class:`Grammar` is the agent format's frame, ``Think: <one line>`` then ``Act: <action>``,
with the action part either

* one of a list of strings (``env.valid_actions()``): :meth:`Grammar.one_of`;
* a language an env writes as grammar rules defining ``action`` (Game24's ``<a> <op> <b>``
  over the numbers left, or ``answer <expression>``): :meth:`Grammar.from_rules`;
* any single line (the frame alone): :meth:`Grammar.any_line`.

:attr:`Grammar.text` is one grammar text in the common subset of llama.cpp's GBNF and
xgrammar's EBNF (rules ``name ::= ...``, double-quoted literals, character classes, ``* + ?``,
groups), so every backend is handed the same accepted language: ``hf`` masks logits with
xgrammar's token bitmask in its own decode loop, ``llamacpp`` with xgrammar's bitmask or
llama.cpp's own GBNF sampler, ``vllm`` through its structured-outputs parameters, ``openai``
through the server's grammar fields. Env rules should stay within that subset; bounded
repetition ``{m,n}`` is valid in both but makes xgrammar's compilation slow (seconds for
``{0,200}`` over a 49k vocabulary).

:func:`check` tests a finished text against the grammar on the client ("ok", "partial": a
prefix of the language, cut by ``max_tokens``, or "violated"), so a server that ignores the
grammar is caught; each :class:`~omrl_search.types.Generation` records ``constraint`` (the
grammar's kind when it was in force, else "none") and ``constraint_check``.

:class:`TokenMasker` is the xgrammar side the in-process backends share: grammars compiled
once per (tokenizer, grammar text) and a bitmask applied to a batch of logits.

xgrammar (``pip install xgrammar``) is imported only when a grammar is compiled or checked.
"""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Sequence

#: ``Grammar.kind`` values: the frame with any one-line action, or the frame with the env's
#: action language (a list or rules); "none" on a Generation means no grammar was in force
KINDS = ("format", "actions")
#: rule names the frame defines; env rules must not define them
RESERVED = ("root", "omrl-thought")

_RULE_DEF = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_-]*)\s*::=", re.MULTILINE)
_INSTALL = "pip install xgrammar (or 'omrl-search[hf]')"


class GrammarError(ValueError):
    """A grammar that cannot be built, compiled or checked; the message is one line naming it."""


def literal(text: str) -> str:
    """``text`` as a double-quoted grammar literal (GBNF and xgrammar escape alike)."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice(rule: str, options: Iterable[str]) -> str:
    """A rule ``rule ::= "a" | "b" | ...`` matching exactly one of ``options`` (deduplicated,
    order kept): what an env uses to spell its numbers, objects or commands."""
    opts = list(dict.fromkeys(options))
    if not opts:
        raise GrammarError(f"rule {rule!r} has no options")
    return f"{rule} ::= " + " | ".join(literal(o) for o in opts)


@dataclass(frozen=True)
class Grammar:
    """An immutable grammar request: the frame plus the rules defining ``action``.

    ``kind``: "format" (any one-line action) or "actions" (the env's action language).
    ``rules``: grammar rules, one per line, defining ``action`` (and any helper rules).
    ``source``: who made it (an env's name), named in every error. ``think`` / ``act``: the
    frame's literal text before the thought and before the action (the agent format's; no
    thought line when ``think`` is None). Build one with :meth:`one_of`, :meth:`from_rules` or
    :meth:`any_line`.
    """

    kind: str
    rules: str
    source: str = ""
    think: str | None = "Think: "
    act: str = "\nAct: "

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"{self._who()}: kind must be one of {', '.join(KINDS)}, not {self.kind!r}")
        names = _RULE_DEF.findall(self.rules)
        if "action" not in names:
            raise GrammarError(f"{self._who()}: the rules define no 'action ::= ...'")
        clash = sorted(set(names) & set(RESERVED))
        if clash:
            raise GrammarError(f"{self._who()}: the rules redefine {', '.join(clash)} (reserved for the frame)")

    def _who(self) -> str:
        return f"grammar from {self.source}" if self.source else "grammar"

    # --- constructors -----------------------------------------------------------------------
    @classmethod
    def one_of(cls, actions: Sequence[str], source: str = "", **frame: Any) -> "Grammar":
        """The frame with the action being exactly one of ``actions`` (non-empty)."""
        acts = [a for a in actions if a]
        if not acts:
            raise GrammarError(f"grammar from {source or 'a caller'}: the list of valid actions is empty")
        return cls("actions", choice("action", acts), source, **frame)

    @classmethod
    def from_rules(cls, rules: str, source: str = "", **frame: Any) -> "Grammar":
        """The frame with the action language given by ``rules`` (defining ``action``)."""
        return cls("actions", rules.strip(), source, **frame)

    @classmethod
    def any_line(cls, source: str = "", **frame: Any) -> "Grammar":
        """The frame alone: the action is any non-empty single line."""
        return cls("format", "action ::= [^\\n]+", source, **frame)

    # --- the text every backend gets ----------------------------------------------------------
    @cached_property
    def text(self) -> str:
        """The whole grammar (root rule first), in the GBNF / xgrammar-EBNF common subset."""
        head = f"{literal(self.think)} omrl-thought " if self.think is not None else ""
        act = f"{literal(self.act)} " if self.act else ""  # no literal: the action alone
        lines = [f"root ::= {head}{act}action"]
        if self.think is not None:
            lines.append("omrl-thought ::= [^\\n]*")
        lines.append(self.rules.strip())
        return "\n".join(lines) + "\n"

    def label(self) -> str:
        """Who made it, for messages."""
        return self._who()

    # --- as recorded on a Step (``Step.grammar``) ---------------------------------------------
    def to_record(self) -> dict[str, Any]:
        """The fields as a plain dict (what ``Step.grammar`` and GRPO exports hold)."""
        return {"kind": self.kind, "rules": self.rules, "source": self.source,
                "think": self.think, "act": self.act}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "Grammar":
        """The grammar a :meth:`to_record` dict describes (extra keys are refused)."""
        try:
            return cls(**record)
        except TypeError as exc:
            raise GrammarError(f"not a grammar record: {exc}") from None


# --- compiling and checking (xgrammar) ---------------------------------------------------------
def _xgr() -> Any:
    try:
        import xgrammar
    except ImportError:
        raise GrammarError(f"structured decoding needs xgrammar: {_INSTALL}") from None
    return xgrammar


def _first_line(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    # xgrammar prefixes its messages with "[time] file:line: "; keep what follows
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[-1] if lines else type(exc).__name__)


class LRU(OrderedDict):
    """A dict that keeps its ``size`` most recently put entries."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size

    def put(self, key: Any, value: Any) -> Any:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.size:
            self.popitem(last=False)
        return value


def _compile(compiler: Any, grammar: Grammar) -> Any:
    try:
        return compiler.compile_grammar(grammar.text)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError for bad rules
        raise GrammarError(f"{grammar.label()} does not compile: {_first_line(exc)}") from None


class TokenMasker:
    """xgrammar for one tokenizer: grammars compiled once per text (LRU of ``cache_size``),
    a matcher per generated row, and the batch's next-token bitmask applied to logits.

    ``info`` is an ``xgrammar.TokenizerInfo`` (see :meth:`from_hf` and :meth:`from_pieces`)."""

    def __init__(self, info: Any, cache_size: int = 512, threads: int = 2) -> None:
        xgr = self._xgr = _xgr()
        self.info = info
        self.vocab_size = int(info.vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, int(threads)))
        self._compiled = LRU(cache_size)
        self._bitmask: Any = None

    @classmethod
    def from_hf(cls, hf_tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> "TokenMasker":
        """For a transformers tokenizer whose model has ``vocab_size`` logits. Its special
        tokens (``<|im_start|>``, ``<|endoftext|>``...) are never allowed, EOS (``stop_ids``)
        only where the grammar may end: xgrammar's own ``from_huggingface`` would let them
        appear as literal text inside a free-text rule such as the thought line."""
        xgr = _xgr()
        stops = sorted(stop_ids)
        base = xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=int(vocab_size),
                                                  stop_token_ids=stops)
        special = set(getattr(hf_tokenizer, "all_special_ids", ()))
        special |= {i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items()
                    if getattr(t, "special", False)}
        pieces = [b"" if i in special else p for i, p in enumerate(base.decoded_vocab)]
        return cls.from_pieces(pieces, stops, int(vocab_size))

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes], stop_ids: Iterable[int],
                    vocab_size: int | None = None) -> "TokenMasker":
        """For a vocabulary given as each token's raw bytes (empty for control tokens, which
        are then never allowed; stop tokens are allowed where the grammar may end). A token
        starting with a NUL byte is never allowed either, as in llama.cpp's grammar sampler."""
        xgr = _xgr()
        pieces = [b"" if p[:1] == b"\x00" else p for p in pieces]
        info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=vocab_size or len(pieces),
                                 stop_token_ids=sorted(stop_ids))
        return cls(info)

    def compiled(self, grammar: Grammar) -> Any:
        hit = self._compiled.get(grammar.text)
        if hit is not None:
            self._compiled.move_to_end(grammar.text)
            return hit
        return self._compiled.put(grammar.text, _compile(self._compiler, grammar))

    def matcher(self, grammar: Grammar) -> "XGrammarGuide":
        """A fresh matcher for one row (compiles ``grammar`` on first use)."""
        return XGrammarGuide(self._xgr.GrammarMatcher(self.compiled(grammar)))

    def mask(self, logits: Any, guides: Sequence["XGrammarGuide | None"]) -> Any:
        """Set the logits of tokens that ``guides[j]`` does not allow next to ``-inf`` in row
        ``j`` of the torch tensor ``logits`` (in place; rows without a guide are left alone).
        A row whose grammar allows nothing (it cannot happen with a grammar every token
        path can finish) gets its stop tokens back so it ends instead of sampling from nothing."""
        xgr = self._xgr
        n = len(guides)
        if self._bitmask is None or self._bitmask.shape[0] < n:
            self._bitmask = xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
        bitmask = self._bitmask
        rows = []
        for j, g in enumerate(guides):
            if g is not None:
                g.matcher.fill_next_token_bitmask(bitmask, j)
                rows.append(j)
        if not rows:
            return logits
        bm = bitmask[:n] if logits.device.type == "cpu" else bitmask[:n].to(logits.device)
        xgr.apply_token_bitmask_inplace(logits, bm, vocab_size=self.vocab_size, indices=rows)
        best = logits[rows].amax(dim=-1)
        if not bool((best > float("-inf")).all()):
            stops = list(self.info.stop_token_ids)
            for j, b in zip(rows, best.tolist()):
                if b == float("-inf") and stops:
                    logits[j, stops] = 0.0
        return logits

    def masks_along(self, grammar: Grammar, token_ids: Sequence[int]) -> tuple[Any, int]:
        """The bitmask the sampler applied before each of ``token_ids`` (a completion sampled
        under ``grammar`` from its start): ``(int32 [n, ceil(vocab / 32)] torch tensor, n)``,
        where ``n`` counts the leading tokens the grammar allowed (a token it does not allow
        ends the walk: later positions have no known mask). A position where the grammar allows
        nothing gets the stop tokens, as in :meth:`mask`. For a trainer that recomputes the
        masked logprobs the sampler recorded."""
        m = self.matcher(grammar).matcher
        out = self._xgr.allocate_token_bitmask(max(len(token_ids), 1), self.vocab_size)
        n = 0
        for j, tok in enumerate(token_ids):
            if m.is_terminated():
                break
            m.fill_next_token_bitmask(out, j)
            if not bool(out[j].any()):
                for t in self.info.stop_token_ids:
                    _set_bit(out[j], t)
            if not _has_bit(out[j], int(tok)):
                break
            n = j + 1
            if not m.accept_token(int(tok)):
                break  # a stop token given back where the grammar allowed nothing
        return out[:n], n


def _has_bit(row: Any, token: int) -> bool:
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def _set_bit(row: Any, token: int) -> None:
    word = (int(row[token // 32]) & 0xFFFFFFFF) | (1 << (token % 32))
    row[token // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 two's complement


class XGrammarGuide:
    """One row's xgrammar matcher."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token: int) -> None:
        self.matcher.accept_token(int(token))

    def close(self) -> None:
        pass


_CHECKER: dict[str, Any] = {}


def check(grammar: Grammar, text: str) -> str:
    """``text`` against ``grammar``: "ok" (a complete sentence of the language), "partial"
    (a proper prefix of one: generation was cut, e.g. by ``max_tokens``) or "violated"."""
    xgr = _xgr()
    if "compiler" not in _CHECKER:
        _CHECKER["compiler"] = xgr.GrammarCompiler(xgr.TokenizerInfo([]), max_threads=1)
        _CHECKER["cache"] = LRU(1024)
    cache = _CHECKER["cache"]
    compiled = cache.get(grammar.text)
    if compiled is None:
        compiled = cache.put(grammar.text, _compile(_CHECKER["compiler"], grammar))
    m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    if not m.accept_string(text.encode("utf-8")):
        return "violated"
    return "ok" if m.is_completed() else "partial"


def accepts(grammar: Grammar, text: str) -> bool:
    """Whether ``text`` is a complete sentence of ``grammar``'s language."""
    return check(grammar, text) == "ok"


def validate(grammar: Grammar) -> Grammar:
    """Raise a one-line :class:`GrammarError` naming ``grammar``'s source unless its text
    parses; return it. Backends that hand the text to a server call this first."""
    xgr = _xgr()
    try:
        xgr.Grammar.from_ebnf(grammar.text)
    except Exception as exc:  # noqa: BLE001
        raise GrammarError(f"{grammar.label()} does not compile: {_first_line(exc)}") from None
    return grammar


def stamp(gen: Any, grammar: Grammar | None, status: str | None = None) -> Any:
    """Record on a Generation which constraint was in force: ``constraint`` = the grammar's
    kind unless the text violates it ("none" then: never reported as constrained), and
    ``constraint_check`` = :func:`check` of its text (or ``status`` when given)."""
    if grammar is None:
        return gen
    status = status or check(grammar, gen.text)
    gen.constraint = grammar.kind if status != "violated" else "none"
    gen.constraint_check = status
    return gen
