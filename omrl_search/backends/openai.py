"""The ``openai`` backend: any OpenAI-compatible server (vLLM, SGLang, llama.cpp's server...).

Spec: ``openai:BASE_URL#MODEL`` then ``:key=value,...`` options, e.g.
``openai:http://127.0.0.1:8000/v1#smollm2`` or
``openai:http://gpu1:8000/v1#Qwen/Qwen2.5-7B-Instruct:tokenizer=/models/qwen,max_in_flight=64``.
Without ``#MODEL`` the first model the server lists (``GET /models``) is used; that also checks
the server is up when the policy is built.

Which endpoint (``endpoint=auto|chat|completions``, default ``auto``):

* **chat** (``/chat/completions``, the default without a tokenizer): the request's messages go
  to the server, which applies its own chat template. ``token_ids`` are then empty (OpenAI
  servers return token *strings*, not ids) and the policy has no ``tokenizer``: the engine
  builds prompts from messages, and trees carry no token segments (nothing for the RL trainers;
  SFT exports re-encode text with ``--tokenizer``). ``logprobs`` are the server's per token
  when it gives them (llama-cpp-python's chat endpoint gives none).
* **completions** (``/completions``, the default with ``tokenizer=``): the policy exposes that
  tokenizer, so the engine builds prompts as token ids turn by turn (as for ``hf``/``llamacpp``);
  the prompt is sent as their text (``decode``), or as the ids themselves with ``send_ids=true``
  (vLLM: the prompt is then exactly the engine's ids and completion tokens come back as ids,
  ``return_tokens_as_token_ids``). Otherwise completion ids are recovered from the server's
  token strings (each must be one token of the local tokenizer), else by encoding the text (then
  logprobs are kept only if the counts agree). ``tokenizer`` is ``smollm2``, an HF folder or a
  ``.gguf`` file (the tokenizer must be the served model's).

Servers drop the end-of-turn token from the text and the tokens: ``token_ids`` never end with
it (``ended_with_eos`` is False), and the engine's next observation turn starts with the
end-of-turn marker, which is what the served model saw.

``n``, ``stop``, ``temperature``, ``top_p``, ``max_tokens`` and ``seed`` are sent as given (the
seed folded to 31 bits). A server that returns fewer choices than ``n`` (llama-cpp-python
ignores ``n``) is asked again for the rest, with seeds ``seed + i``, and from then on each
request is split into calls of as many samples as it gave.

Up to ``max_in_flight`` HTTP calls run at once (a thread pool over one ``httpx.Client``), each
with ``timeout`` seconds (``connect_timeout`` to connect). Batching servers (vLLM, SGLang) want
many (64-256); llama-cpp-python's server runs one sequence at a time and reuses the previous
call's prompt prefix, so ``max_in_flight=1`` keeps calls that share a prompt together. Connection errors, timeouts, 429 and
5xx answers are retried ``retries`` times, waiting ``backoff * 2**attempt`` seconds (or the
server's ``Retry-After``, up to 30 s); other errors are not retried. A request that still fails
makes :meth:`OpenAIPolicy.generate` raise one :class:`PolicyError` line naming it, after every
other request of the batch has finished; the engine then asks again one request at a time and
those calls are answered from what this batch already got (no second HTTP call), so only the
failing request becomes a fault of its own node.

The backend streams (``stream=true``, the default): under the engine's continuous schedule each
request goes to the server as soon as its tree makes it, on a pool of ``max_in_flight`` request
threads, and the engine takes answers as they arrive; a continuously batching server (vLLM,
SGLang) then adds new requests to the sequences it is decoding. A request that fails after its
retries is a fault of its own node only. ``stream=false`` (or the ``lockstep`` schedule) uses
batched ``generate`` calls as above.

Structured decoding: a request's grammar (``GenRequest.grammar``, see
:mod:`omrl_search.constrain`) is sent in the body fields named by ``grammar_fields`` (default
``grammar,structured_outputs``), as the grammar text every backend gets (GBNF / xgrammar EBNF):

=====================  ==============================================================
field                  servers that accept it
=====================  ==============================================================
``grammar``            llama.cpp's ``llama-server`` and llama-cpp-python's server (GBNF)
``structured_outputs`` vLLM >= 0.10.2 (``{"grammar": text}``; the only one since 0.12)
``guided_grammar``     vLLM < 0.12 (removed in 0.12)
``ebnf``               SGLang
=====================  ==============================================================

Servers ignore fields they do not know, so the defaults cover llama.cpp and current vLLM; name
``guided_grammar`` or ``ebnf`` for the others. Every returned text is checked against the grammar
on the client (:func:`omrl_search.constrain.check`, needs xgrammar): a text outside the language
(a server that ignored the field) gets ``constraint="none"``, ``constraint_check="violated"``
and is counted in :attr:`OpenAIPolicy.grammar_violations`, never reported as constrained.
Logprobs under a grammar are what the server reports (vLLM: from the masked logits).

``reload(path)`` is not possible: the server holds the weights; restart it on the new checkpoint.
An API key is read from the environment variable named by ``api_key_env`` (``OPENAI_API_KEY``).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any

from ..constrain import GrammarError, stamp, validate
from ..policy import Policy, PolicyError, from_path_spec, register_policy, require
from ..types import GenRequest, Generation
from ..specs import error_line

_SEED_MOD = 2**31
#: request fields a grammar can go in (see the module docstring)
GRAMMAR_FIELDS = ("grammar", "structured_outputs", "guided_grammar", "ebnf")
_MAX_WAIT = 30.0


class _Retryable(Exception):
    """A failure worth another try (connection, timeout, 429, 5xx); ``wait``: the server's
    Retry-After, if it gave one."""

    def __init__(self, message: str, wait: float | None = None) -> None:
        super().__init__(message)
        self.wait = wait


class OpenAIPolicy(Policy):
    """A model behind an OpenAI-compatible HTTP server (see the module docstring).

    ``tokenizer``: a spec (``smollm2``, an HF folder, a ``.gguf``) or a ChatTokenizer object.
    """

    name = "openai"
    #: sends grammars to the server and checks the answers (see the module docstring)
    supports_grammar = True

    def __init__(self, url: str, tokenizer: Any = None, endpoint: str = "auto",
                 send_ids: bool = False, max_in_flight: int = 16, timeout: float = 60.0,
                 connect_timeout: float = 10.0, retries: int = 3, backoff: float = 0.5,
                 logprobs: bool = True, max_batch: int = 64, stream: bool = True,
                 api_key_env: str = "OPENAI_API_KEY",
                 grammar_fields: str = "grammar,structured_outputs") -> None:
        self._httpx = require("httpx", "openai")
        base, _, model = str(url).partition("#")
        if not base.startswith(("http://", "https://")):
            raise PolicyError(f"openai: expected openai:http://HOST:PORT/v1#MODEL, got {url!r}")
        if endpoint not in ("auto", "chat", "completions"):
            raise PolicyError(f"openai: endpoint must be auto, chat or completions, not {endpoint!r}")
        if min(max_in_flight, max_batch) < 1 or retries < 0 or timeout <= 0 or backoff < 0:
            raise PolicyError("openai: max_in_flight, max_batch >= 1, retries >= 0, timeout > 0, backoff >= 0")
        fields = [f for f in str(grammar_fields).replace("+", ",").split(",") if f]
        unknown = [f for f in fields if f not in GRAMMAR_FIELDS]
        if unknown or not fields:
            raise PolicyError(f"openai: grammar_fields takes {', '.join(GRAMMAR_FIELDS)} "
                              f"(comma separated), not {grammar_fields!r}")
        self.grammar_fields = tuple(fields)
        #: generations whose text violated the grammar they were asked under
        self.grammar_violations = 0
        self._lock = threading.Lock()
        self.base = base.rstrip("/")
        self.max_in_flight, self.max_batch = int(max_in_flight), int(max_batch)
        self.retries, self.backoff, self.want_logprobs = int(retries), float(backoff), bool(logprobs)
        self.send_ids = bool(send_ids)
        self._server_n: int | None = None  # most choices one call returned, once seen short
        self._memo: dict[int, tuple[GenRequest, Any]] = {}  # a failed batch's answers, see generate
        self._pools: dict[str, Any] = {}  # thread pools by use, see _threads
        self.streams = bool(stream)
        self._futures: dict[Any, int] = {}  # submitted request -> ticket
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(api_key_env or "")
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._client = self._httpx.Client(
            headers=headers, timeout=self._httpx.Timeout(float(timeout), connect=float(connect_timeout)),
            limits=self._httpx.Limits(max_connections=self.max_in_flight))
        self.tokenizer = _load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.endpoint = endpoint if endpoint != "auto" else (
            "completions" if self.tokenizer is not None else "chat")
        if self.endpoint == "completions" and self.tokenizer is None:
            raise PolicyError("openai: endpoint=completions needs tokenizer=... (smollm2, an HF folder "
                              "or a .gguf) to render the chat template")
        self.model = model or self._first_model()
        self.name = f"openai:{self.model}"

    # --- HTTP -----------------------------------------------------------------------------
    def _first_model(self) -> str:
        data = self._request("GET", "/models", None)
        try:
            return str(data["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise PolicyError(f"openai: {self.base}/models lists no model; name one: "
                              f"openai:{self.base}#MODEL") from None

    def _request(self, method: str, path: str, body: dict | None) -> Any:
        """One call with retries; the decoded JSON or a one-line PolicyError."""
        url = self.base + path
        for attempt in range(self.retries + 1):
            try:
                return self._once(method, url, body)
            except _Retryable as exc:
                if attempt == self.retries:
                    tries = f" (after {self.retries} retries)" if self.retries else ""
                    raise PolicyError(f"openai: {url}: {exc}{tries}") from None
                wait = exc.wait if exc.wait is not None else self.backoff * 2**attempt
                time.sleep(min(wait, _MAX_WAIT))
        raise AssertionError("unreachable")  # pragma: no cover

    def _once(self, method: str, url: str, body: dict | None) -> Any:
        httpx = self._httpx
        try:
            resp = self._client.request(method, url, json=body)
        except httpx.TimeoutException as exc:
            raise _Retryable(f"timed out ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise _Retryable(error_line(exc)) from None
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _Retryable(f"HTTP {resp.status_code}: {_error_text(resp)}", _retry_after(resp))
        if resp.status_code >= 400:
            raise PolicyError(f"openai: {url}: HTTP {resp.status_code}: {_error_text(resp)}")
        try:
            return resp.json()
        except ValueError:
            raise PolicyError(f"openai: {url} answered with no JSON: {resp.text[:80]!r}") from None

    # --- generation -----------------------------------------------------------------------
    def generate(self, requests: list[GenRequest]) -> list[list[Generation]]:
        """All requests' calls in flight together (at most ``max_in_flight``); one failing
        request fails the call only after the others are done (see the module docstring)."""
        answers: list[Any] = [None] * len(requests)
        todo = []
        for i, req in enumerate(requests):
            hit = self._memo.pop(id(req), None)
            if hit is not None and hit[0] is req:
                answers[i] = hit[1]
            else:
                todo.append(i)
        if len(todo) == len(requests):
            self._memo = {}  # a new batch: forget an old failed one
        for i, res in zip(todo, self._generate_all([requests[i] for i in todo])):
            answers[i] = res
        failed = [i for i, a in enumerate(answers) if isinstance(a, Exception)]
        if failed:
            if len(requests) > 1:
                self._memo.update({id(r): (r, a) for r, a in zip(requests, answers)})
            first = answers[failed[0]]
            more = f" ({len(failed)} of {len(requests)} requests failed)" if len(requests) > 1 else ""
            raise PolicyError(f"{first}{more}")
        return answers

    def _generate_all(self, requests: list[GenRequest]) -> list[list[Generation] | Exception]:
        """Each request's ``n`` choices, by as many calls as the server needs."""
        got: list[list[tuple[int, list[Generation]]]] = [[] for _ in requests]  # (offset, choices)
        errors: list[Exception | None] = [None] * len(requests)
        calls = [(i, 0, r.params.n) for i, r in enumerate(requests) if r.params.n > 0]
        while calls:
            split = []
            for i, start, count in calls:
                step = self._server_n or count
                split += [(i, s, min(step, start + count - s)) for s in range(start, start + count, step)]
            results = self._map(lambda c: self._call(requests[c[0]], c[1], c[2]), split)
            calls = []
            for (i, start, count), res in zip(split, results):
                if errors[i] is not None:
                    continue
                if isinstance(res, Exception):
                    errors[i] = res
                    continue
                got[i].append((start, res))
                if len(res) < count:  # the server gave fewer choices than asked: ask again
                    self._server_n = min(self._server_n or len(res), len(res))
                    calls.append((i, start + len(res), count - len(res)))
            calls.sort()
        return [e if e is not None else [g for _, part in sorted(parts, key=lambda p: p[0]) for g in part]
                for parts, e in zip(got, errors)]

    # --- streaming ------------------------------------------------------------------------
    def submit(self, tickets: list[tuple[int, GenRequest]]) -> None:
        pool = self._threads("requests")  # not the HTTP calls' pool: a request may make several
        for ticket, req in tickets:
            self._futures[pool.submit(self._generate_all, [req])] = ticket

    def collect(self) -> list[tuple[int, Any]]:
        """The requests answered so far (waiting for the first if none is)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        if not self._futures:
            return []
        done, _ = wait(list(self._futures), return_when=FIRST_COMPLETED)
        out = []
        for fut in done:
            ticket = self._futures.pop(fut)
            try:
                out.append((ticket, fut.result()[0]))
            except Exception as exc:  # noqa: BLE001 - _generate_all catches; this is a last guard
                out.append((ticket, PolicyError(f"openai: {error_line(exc)}")))
        return sorted(out, key=lambda item: item[0])

    def _map(self, fn: Any, items: list) -> list[Any]:
        """``fn`` over ``items`` on the pool, each result or the exception it raised."""
        def safe(item: Any) -> Any:
            try:
                return fn(item)
            except Exception as exc:  # noqa: BLE001 - collected, raised by generate
                return exc if isinstance(exc, PolicyError) else PolicyError(f"openai: {error_line(exc)}")

        if len(items) <= 1:
            return [safe(x) for x in items]
        return list(self._threads("calls").map(safe, items))

    def _threads(self, name: str) -> Any:
        """A pool of ``max_in_flight`` threads, made on first use."""
        if name not in self._pools:
            from concurrent.futures import ThreadPoolExecutor

            self._pools[name] = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix=f"omrl-openai-{name}")
        return self._pools[name]

    def _call(self, req: GenRequest, offset: int, count: int) -> list[Generation]:
        """One HTTP call for ``count`` choices of ``req`` (the ``offset``-th sample onwards)."""
        p = req.params
        if p.max_tokens <= 0:
            return [stamp(Generation("", [], [], len(req.prompt_ids or ()), 0, "length", False),
                          req.grammar, "partial") for _ in range(count)]
        body: dict[str, Any] = {"model": self.model, "max_tokens": p.max_tokens, "n": count,
                                "temperature": p.temperature, "top_p": p.top_p}
        if p.stop:
            body["stop"] = list(p.stop)
        if p.seed is not None:
            body["seed"] = (p.seed + offset) % _SEED_MOD
        if self.endpoint == "chat":
            body["messages"] = req.messages
            if self.want_logprobs:
                body["logprobs"] = True
        else:
            ids = req.prompt_ids
            if ids is None:
                ids = self.tokenizer.encode(self.tokenizer.render(req.messages, add_generation_prompt=True))
            body["prompt"] = list(ids) if self.send_ids else self.tokenizer.decode(ids)
            if self.want_logprobs:
                body["logprobs"] = 0
        if self.send_ids:
            body["return_tokens_as_token_ids"] = True
        if req.grammar is not None:
            body.update(self._grammar_body(req.grammar))
        data = self._request("POST", f"/{self.endpoint.replace('chat', 'chat/completions')}", body)
        return self._parse(data, req, count)

    def _grammar_body(self, grammar: Any) -> dict[str, Any]:
        try:
            text = validate(grammar).text
        except GrammarError as exc:
            raise PolicyError(f"openai: {exc}") from None
        wrap = {"structured_outputs": lambda t: {"grammar": t}}
        return {f: wrap.get(f, str)(text) for f in self.grammar_fields}

    def _stamp(self, gen: Generation, grammar: Any) -> Generation:
        """Check a returned text against the grammar it was asked under (see the module docstring)."""
        stamp(gen, grammar)
        if gen.constraint_check == "violated":
            with self._lock:
                self.grammar_violations += 1
        return gen

    def _parse(self, data: Any, req: GenRequest, count: int) -> list[Generation]:
        try:
            choices = sorted(data["choices"], key=lambda c: c.get("index", 0))[:count]
            usage = data.get("usage") or {}
            rows = [self._choice(c) for c in choices]
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise PolicyError(f"openai: malformed answer from {self.base} "
                              f"({type(exc).__name__}: {exc}): {str(data)[:80]!r}") from None
        if not rows:
            raise PolicyError(f"openai: {self.base} returned no choices")
        prompt_tokens = int(usage.get("prompt_tokens") or len(req.prompt_ids or ()))
        total = int(usage.get("completion_tokens") or 0)
        out = []
        for k, (text, ids, lps, n_tok, reason) in enumerate(rows):
            if n_tok is None:  # no per-token answer: share the usage out
                n_tok = total // len(rows) + (k < total % len(rows))
            gen = Generation(_cut(text, req.params.stop), ids, lps, prompt_tokens, n_tok, reason, False)
            out.append(self._stamp(gen, req.grammar) if req.grammar is not None else gen)
        return out

    def _choice(self, c: dict) -> tuple[str, list[int], list[float] | None, int | None, str]:
        """(text, token ids, logprobs, completion tokens if known, finish reason) of a choice."""
        lp = c.get("logprobs") or {}
        if "message" in c:
            text = c["message"].get("content") or ""
            entries = lp.get("content") or []
            pieces = [e["token"] for e in entries] or None
            lps = [e["logprob"] for e in entries] or None
        else:
            text = c["text"]
            pieces, lps = lp.get("tokens"), lp.get("token_logprobs")
        if not isinstance(text, str):
            raise ValueError("choice text is not a string")
        if lps is not None and (pieces is None or len(lps) != len(pieces) or None in lps):
            lps = None
        else:
            lps = [float(x) for x in lps] if lps is not None else None
        ids, lps = self._ids(text, pieces, lps)
        reason = "length" if c.get("finish_reason") == "length" else "stop"
        return text, ids, lps, len(pieces) if pieces is not None else None, reason

    def _ids(self, text: str, pieces: list[str] | None,
             lps: list[float] | None) -> tuple[list[int], list[float] | None]:
        """Completion token ids: the server's (``token_id:N``), else the local tokenizer's."""
        if pieces and all(isinstance(p, str) and p.startswith("token_id:") for p in pieces):
            return [int(p[9:]) for p in pieces], lps
        tok = self.tokenizer
        if tok is None:
            return [], lps
        if pieces:
            each = [tok.encode(p) for p in pieces]
            if all(len(e) == 1 for e in each):
                return [e[0] for e in each], lps
        ids = tok.encode(text)
        return ids, lps if lps is not None and len(lps) == len(ids) else None

    def reload(self, path: str) -> None:
        raise PolicyError("openai: the server holds the weights; restart it on the new checkpoint "
                          f"({path}) and keep the same spec")

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools = {}
        self._client.close()


def _cut(text: str, stops: tuple[str, ...]) -> str:
    """Text before the first stop string (for servers that return it)."""
    hits = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(hits)] if hits else text


def _error_text(resp: Any) -> str:
    try:
        data = resp.json()
        err = data.get("error", data) if isinstance(data, dict) else data
        msg = err.get("message", err) if isinstance(err, dict) else err
    except ValueError:
        msg = resp.text
    lines = str(msg).strip().splitlines()
    return lines[0][:200] if lines else resp.reason_phrase


def _retry_after(resp: Any) -> float | None:
    try:
        return max(0.0, float(resp.headers.get("retry-after", "")))
    except ValueError:
        return None


def _load_tokenizer(spec: str) -> Any:
    """``smollm2``, an HF folder or a ``.gguf`` file -> a ChatTokenizer (see exports.load_encoder)."""
    from ..exports import load_encoder

    try:
        return load_encoder(str(spec)).tok
    except Exception as exc:  # noqa: BLE001 - one line for any loading failure
        raise PolicyError(f"openai: cannot load tokenizer {spec!r}: {error_line(exc)}") from None


@register_policy("openai")
def _make_openai(arg: str) -> Policy:
    return from_path_spec("openai", OpenAIPolicy, arg,
                          "a server URL, e.g. openai:http://127.0.0.1:8000/v1#MODEL")
