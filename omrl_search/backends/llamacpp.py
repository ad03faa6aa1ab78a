"""The ``llamacpp`` backend: a GGUF model in-process through llama-cpp-python's low-level API.

Spec: ``llamacpp:FILE.gguf``, optionally followed by ``:key=value,...`` options, e.g.
``llamacpp:/models/smol.gguf:max_batch=4,n_ctx=2048``.

How it runs:

* the context holds ``max_batch`` sequences, each in its own KV stream of ``n_ctx`` cells
  (``kv_unified=False``: in a unified cache every token attends over all sequences' cells, which
  made batched decoding 2-4x slower here);
* the prefix cache (``prefix_cache``, on by default): the KV cache is kept between calls, with
  the exact token ids each stream holds. A new prompt starts from the stream that shares its
  longest prefix (taken over in place, or copied) and only the rest is evaluated, so the engine's
  next turn (prompt + completion + observation) or a search-tree child evaluates only its new
  tokens. A stream about to be overwritten is first saved (``llama_state_seq_get_data``) into an
  LRU store of at most ``prefix_cache_mb`` MB, and a prompt that shares a longer prefix with a
  saved state than with any live stream gets it copied back
  (:mod:`~omrl_search.backends._llamacpp_cache`). Each Generation's ``cached_tokens`` counts
  the prompt tokens its request did not evaluate. ``prefix_cache=off`` clears the KV cache at
  the start of every call: each call prefills its prompts in full;
* within a call (cache on or off), ``n`` samples of one prompt evaluate it once, and a prefix
  that all prompts or a group of them share is evaluated once and copied
  (:func:`~omrl_search.backends._decode.prefix_groups`); the request whose stream evaluated it
  is charged for it, the others count it as cached;
* flash attention is on by default: without it, decoding with ``n_ctx``-cell streams was 10-50x
  slower on the development VM;
* all live sequences decode together, one ``llama_decode`` per step; sampling is done here from
  the raw logits (temperature, top-p; each row draws from its own stream, seeded from its
  request's ``seed`` and its sample index), and the logprob recorded is the raw ``log_softmax``
  of the chosen token;
* under a grammar (``GenRequest.grammar``) the logits are masked first, so the token is
  sampled from, and its logprob is the ``log_softmax`` of, the masked distribution:
  ``grammar_engine=gbnf`` uses llama.cpp's own GBNF sampler, ``xgrammar`` the token bitmask
  the ``hf`` backend uses; ``auto`` (default) picks xgrammar when it is installed, being
  far cheaper per step (see :mod:`~omrl_search.backends.llamacpp_grammar` and
  ``benchmarks/constrained_decoding.py``).

The tokenizer is llama.cpp's own (``parse_special`` so chat markers become their ids, no BOS
added) and the chat template is the GGUF's ``tokenizer.chat_template`` rendered with jinja2, so the
ids are exactly the ones the model was trained with.

``extra_bufts`` is off by default: llama.cpp's AMX kernels (picked for Q4_1 weights on CPUs with
AMX, like the development VM) crash with a segfault in ``ggml_backend_amx_mul_mat`` here.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

from ..policy import (Policy, PolicyError, from_path_spec, register_policy, request_prompt_ids,
                      require)
from ..types import GenRequest
from ..prefix_cache import common_prefix
from ._decode import ChunkedDecoder, Row, prefix_groups
from ._llamacpp_cache import SeqStateStore
from .llamacpp_tokenizer import LlamaCppTokenizer

_BACKEND_READY = False


def _import_llama_cpp() -> Any:
    """Import llama_cpp, by default with ``OMP_WAIT_POLICY=PASSIVE`` for its OpenMP threads.

    ggml's OpenMP workers spin between the hundreds of ops of each token; on a machine where
    other processes compete for the cores (a shared dev box, tests in parallel) spinning made a
    2-thread generation 8-10x slower than one thread, while PASSIVE waiting kept it at the
    one-thread speed. The variable is read when libgomp is loaded, so it is set (unless the user
    set it) just before the first import; llama.cpp links the system libgomp, not torch's copy.
    """
    import sys

    if "llama_cpp" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return require("llama_cpp", "llamacpp")


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class LlamaCppPolicy(ChunkedDecoder, Policy):
    """A GGUF model run by llama.cpp (CPU by default; ``n_gpu_layers`` for a GPU build).

    ``n_ctx``: the most tokens (prompt + completion) one sequence may hold (capped at the model's
    training context). ``max_batch``: sequences decoded together; the KV cache holds
    ``n_ctx * max_batch`` cells (about 23 KB each for SmolLM2-135M). ``seed``: the sampling
    generator used when a request gives no seed. ``prefix_cache``: keep the KV cache between
    calls (default on; ``off``: every call prefills its prompts in full). ``prefix_cache_mb``:
    the most memory the store of saved sequence states may hold (0: only the live streams are
    reused).
    """

    name = "llamacpp"
    #: evaluate a prefix shared by all prompts of a chunk once (then copy the KV stream) when it
    #: is at least this long
    min_shared_prefix = 16
    #: also evaluate once a prefix that a group of the chunk's prompts shares beyond that
    group_prefixes = True

    def __init__(
        self,
        model_path: str,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        n_batch: int = 512,
        seed: int = 0,
        max_batch: int = 8,
        n_gpu_layers: int = 0,
        flash_attn: bool = True,
        extra_bufts: bool = False,
        grammar_engine: str = "auto",
        prefix_cache: bool = True,
        prefix_cache_mb: float = 256,
        verbose: bool = False,
    ) -> None:
        self._ll = _import_llama_cpp()
        self._np = require("numpy", "llamacpp")
        logging.getLogger("llama-cpp-python").setLevel(logging.DEBUG if verbose else logging.ERROR)
        self.n_ctx_req = int(n_ctx)
        self.n_threads = int(n_threads or _cpu_count())
        self.n_batch = max(1, int(n_batch))
        self.max_batch = max(1, int(max_batch))
        self.n_gpu_layers = int(n_gpu_layers)
        self.flash_attn = bool(flash_attn)
        self.extra_bufts = bool(extra_bufts)
        self._rng = self._np.random.default_rng(seed)
        if grammar_engine not in ("auto", "xgrammar", "gbnf"):
            raise PolicyError(f"llamacpp: grammar_engine must be auto, xgrammar or gbnf, not {grammar_engine!r}")
        self.grammar_engine = grammar_engine
        if not isinstance(prefix_cache, bool):
            raise PolicyError(f"llamacpp: prefix_cache must be on or off, not {prefix_cache!r}")
        if isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, (int, float)) \
                or not prefix_cache_mb >= 0:
            raise PolicyError(f"llamacpp: prefix_cache_mb must be a number of MB >= 0, not {prefix_cache_mb!r}")
        self.prefix_cache = prefix_cache
        self.prefix_cache_mb = float(prefix_cache_mb)
        #: counters of the prefix cache since the model was loaded (see :meth:`cache_stats`)
        self._stats = {"prompt_tokens": 0, "cached_tokens": 0}
        self._cached: dict[int, int] = {}  # request index -> prompt tokens not evaluated (chunk)
        self._grammar: Any = None  # the engine masking logits, made on the first grammar
        self._model = self._ctx = self._batch = None
        self._load(model_path)
        _OPEN.add(self)

    # --- loading ------------------------------------------------------------------------
    def _load(self, model_path: str) -> None:
        global _BACKEND_READY
        ll = self._ll
        path = os.path.expanduser(str(model_path))
        if not os.path.isfile(path):
            raise PolicyError(f"llamacpp: model file {path!r} does not exist")
        if not _BACKEND_READY:
            ll.llama_backend_init()
            _BACKEND_READY = True
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = self.n_gpu_layers
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = self.extra_bufts
        model = ll.llama_model_load_from_file(path.encode(), mp)
        if not model:
            raise PolicyError(f"llamacpp: cannot load a GGUF model from {path!r}")
        n_train = int(ll.llama_model_n_ctx_train(model)) or self.n_ctx_req
        n_ctx = min(self.n_ctx_req, n_train)
        cp = ll.llama_context_default_params()
        cp.n_ctx = n_ctx * self.max_batch
        cp.n_batch = self.n_batch
        cp.n_ubatch = min(self.n_batch, 512)
        cp.n_seq_max = self.max_batch
        cp.n_threads = cp.n_threads_batch = self.n_threads
        cp.kv_unified = False
        cp.flash_attn_type = (ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attn
                              else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        cp.no_perf = True
        ctx = ll.llama_init_from_model(model, cp)
        if not ctx:
            ll.llama_model_free(model)
            raise PolicyError(f"llamacpp: cannot create a context for {path!r} "
                              f"(n_ctx={n_ctx} x max_batch={self.max_batch})")
        self.close()
        self._model, self._ctx = model, ctx
        self._mem = ll.llama_get_memory(ctx)
        self._batch = ll.llama_batch_init(self.n_batch, 0, 1)
        self.n_ctx = int(ll.llama_n_ctx_seq(ctx)) if hasattr(ll, "llama_n_ctx_seq") else n_ctx
        self.n_ctx = min(self.n_ctx, n_ctx)
        self.tokenizer = LlamaCppTokenizer(ll, model)
        self.n_vocab = self.tokenizer.n_vocab
        self.model_path = path
        self._kv: list[list[int]] = [[] for _ in range(self.max_batch)]  # ids each stream holds
        limit = int(self.prefix_cache_mb * 2**20) if self.prefix_cache else 0
        self._store = SeqStateStore(ll, ctx, limit) if limit > 0 else None

    def reload(self, path: str) -> None:
        """Load another GGUF file (e.g. after training and converting); same vocabulary expected."""
        old_vocab = self.n_vocab
        self._load(path)
        if self.n_vocab != old_vocab:
            raise PolicyError(f"llamacpp: {path!r} has a different vocabulary size than the loaded model")

    def close(self) -> None:
        ll = self._ll
        if getattr(self, "_store", None) is not None:
            self._store.clear()  # the saved states belong to this context
            self._store = None
        if getattr(self, "_grammar", None) is not None:
            self._grammar.close()  # its samplers point into the model's vocabulary
            self._grammar = None
        if self._batch is not None:
            ll.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            ll.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            ll.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # pragma: no cover - best effort
        if sys.is_finalizing():
            return  # see close_open_policies: the process is ending, the OS frees the memory
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # --- generation ---------------------------------------------------------------------
    def prompt_ids_of(self, req: GenRequest) -> list[int]:
        return request_prompt_ids("llamacpp", req, self.tokenizer, self.n_vocab, self.n_ctx, "n_ctx")

    @property
    def is_open(self) -> bool:
        """Whether a model is loaded (not yet :meth:`close` d)."""
        return self._ctx is not None or self._model is not None

    def _check_open(self) -> None:
        if self._ctx is None:
            raise PolicyError("llamacpp: policy is closed")

    def _new_seed(self) -> int:
        return int(self._rng.integers(2**63))

    def _context_len(self) -> int:
        return self.n_ctx

    def _order_key(self, prompt: list[int]) -> list[int]:
        return prompt  # lexicographic order puts prompts that share prefixes in the same chunk

    @contextlib.contextmanager
    def _decoding(self) -> Any:
        if not self.prefix_cache:
            self._reset_kv()  # nothing from an earlier call is reused
        try:
            yield
        except BaseException:
            self._reset_kv()  # the streams' contents are unknown now
            raise

    # --- structured decoding ------------------------------------------------------------
    def _grammar_engine(self) -> Any:
        if self._grammar is None:
            from . import llamacpp_grammar as lg

            engine = self.grammar_engine
            if engine == "auto":
                import importlib.util

                engine = "xgrammar" if importlib.util.find_spec("xgrammar") else "gbnf"
            args = (self._ll, self.tokenizer.vocab, self.n_vocab)
            eos = sorted(self.tokenizer.eos_token_ids)
            self._grammar = (lg.XGrammarEngine(*args, eos) if engine == "xgrammar"
                             else lg.GBNFEngine(*args, eos, self._np))
        return self._grammar

    def guide_for(self, grammar: Any) -> Any:
        return self._grammar_engine().guide(grammar)

    def mask_logits(self, state: Any, logits: Any, guides: list[Any]) -> Any:
        return self._grammar_engine().mask(logits, guides)

    def clear_cache(self) -> None:
        self._reset_kv()

    def _reset_kv(self) -> None:
        """Forget every cached prefix: the live streams and the saved states."""
        self._ll.llama_memory_clear(self._mem, True)
        self._kv = [[] for _ in range(self.max_batch)]
        if self._store is not None:
            self._store.clear()

    def cache_stats(self) -> dict[str, Any]:
        """Prompt tokens asked for and served by the prefix cache since loading (each distinct
        prompt of a chunk once), the hit rate, and the saved-state store's counters."""
        s = dict(self._stats)
        s["hit_rate"] = round(s["cached_tokens"] / s["prompt_tokens"], 4) if s["prompt_tokens"] else 0.0
        st = self._store
        s.update(saved_states=len(st) if st else 0, saved_mb=round(st.bytes / 2**20, 1) if st else 0.0,
                 saves=st.saves if st else 0, restores=st.restores if st else 0,
                 evictions=st.evictions if st else 0)
        return s

    def _run_chunk(self, chunk: list[tuple[int, int]], requests: list[GenRequest],
                   prompts: list[list[int]], seeds: list[int]) -> list[Any]:
        self._cached = {}
        gens = super()._run_chunk(chunk, requests, prompts, seeds)
        for (ri, _), g in zip(chunk, gens):
            g.cached_tokens = self._cached.get(ri, 0)
        return gens

    def _plan(self, chunk: list[tuple[int, int]], prompts: list[list[int]]) -> tuple[dict, dict, list]:
        """Give each row a stream. Returns (leader stream of each request, {stream: (source
        stream or None, reused prefix length, saved-state key or None)} for leaders,
        [(follower stream, ri)])."""
        kv, store = self._kv, self._store
        order: list[int] = []
        for ri, _ in chunk:
            if ri not in order:
                order.append(ri)
        best: dict[int, tuple[int, int]] = {}  # ri -> (reusable prefix length, source stream)
        saved: dict[int, tuple[int, tuple[int, ...]]] = {}  # ri -> (length, key) from the store
        for ri in order:
            p = prompts[ri]
            cap = len(p) - 1  # the last prompt token is always evaluated, for its logits
            top = (0, -1)
            for s, held in enumerate(kv):
                n = common_prefix(p, held, cap)
                if n > top[0]:
                    top = (n, s)
            best[ri] = top
            if store is not None and len(store):
                n, key = store.best(p, cap)
                if key is not None and n >= top[0] + store.min_tokens:
                    saved[ri] = (n, key)
        claimed: dict[int, int] = {}  # stream -> ri taking it over in place
        for ri in sorted(order, key=lambda r: -best[r][0]):
            n, s = best[ri]
            if n > 0 and s not in claimed and ri not in saved:
                claimed[s] = ri
        free = [s for s in range(len(kv)) if s not in claimed]
        # streams that nobody reuses go last, so later calls may still find their contents
        free.sort(key=lambda s: len(kv[s]) > 0)
        leader: dict[int, int] = {ri: s for s, ri in claimed.items()}
        plan: dict[int, tuple[int | None, int, Any]] = {s: (None, best[ri][0], None)
                                                        for s, ri in claimed.items()}
        for ri in order:
            if ri not in leader:
                s = free.pop(0)
                leader[ri] = s
                if ri in saved:
                    plan[s] = (None, *saved[ri])
                else:
                    n, src = best[ri]
                    plan[s] = (src if n > 0 else None, n, None)
        followers: list[tuple[int, int]] = []
        seen: set[int] = set()
        for ri, _ in chunk:
            if ri in seen:
                followers.append((free.pop(0), ri))
            seen.add(ri)
        return leader, plan, followers

    def _save_overwritten(self, plan: dict, followers: list[tuple[int, int]]) -> None:
        """Before the plan changes the streams, save those that lose at least the store's
        ``min_tokens`` tokens (a stream taken over in place keeps its first ``n``)."""
        store, kv = self._store, self._kv
        if store is None:
            return
        keeps = {s: (n if src is None and key is None else 0) for s, (src, n, key) in plan.items()}
        keeps.update((s, 0) for s, _ in followers)
        for s, keep in keeps.items():
            if len(kv[s]) - keep >= store.min_tokens:
                store.save(s, kv[s])

    def prefill_chunk(self, chunk: list[tuple[int, int]], prompts: list[list[int]],
                 rows: list[Row]) -> tuple[list[int], Any]:
        """Evaluate the chunk's prompts, reusing and sharing KV streams; the decoding state is
        the stream of each chunk row. Records in ``_cached`` each request's prompt tokens that
        were not evaluated for it."""
        ll = self._ll
        mem, kv = self._mem, self._kv
        leader, plan, followers = self._plan(chunk, prompts)
        self._save_overwritten(plan, followers)
        # 1. copies and restores first (copies read the source streams as they are now), then
        #    truncations
        for s, (src, n, key) in plan.items():
            if src is not None and src != s:
                ll.llama_memory_seq_cp(mem, src, s, -1, -1)
                kv[s] = list(kv[src])
            elif key is not None:
                ll.llama_memory_seq_rm(mem, s, -1, -1)
                kv[s] = list(key) if self._store.restore(key, s) else []
        for s, (_, n, _) in plan.items():
            ll.llama_memory_seq_rm(mem, s, n if n > 0 else -1, -1)
            del kv[s][n:]
        for s, _ in followers:
            ll.llama_memory_seq_rm(mem, s, -1, -1)
            kv[s] = []
        computed = {ri: 0 for ri in leader}  # prompt tokens evaluated for each request
        # 2. a prefix all distinct prompts share (the system prompt...), then a prefix that a
        #    group of them shares beyond it (one task's prompt and path), is evaluated in one
        #    stream and copied to the others
        ris = list(leader)
        base, groups = prefix_groups([prompts[ri] for ri in ris], self.min_shared_prefix)
        shares = ([(ris, base)] if base else []) + [([ris[m] for m in members], q)
                                                     for members, q in groups
                                                     if len(members) > 1 and self.group_prefixes]
        for members, P in shares:
            root_ri = max(members, key=lambda r: len(kv[leader[r]]))
            root = leader[root_ri]
            if len(kv[root]) < P:
                have = len(kv[root])
                self.evaluate_tokens([(root, pos, prompts[root_ri][pos], None) for pos in range(have, P)])
                computed[root_ri] += P - have
                kv[root] = list(prompts[root_ri][:P])
            for ri in members:
                st = leader[ri]
                if st != root and len(kv[st]) < P:
                    ll.llama_memory_seq_cp(mem, root, st, -1, -1)
                    ll.llama_memory_seq_rm(mem, st, P, -1)
                    kv[st] = list(prompts[ri][:P])
        # 3. evaluate the rest of each distinct prompt, keeping the logits of its last token
        pending: list[tuple[int, int, int, Any]] = []
        for ri, st in leader.items():
            p = prompts[ri]
            computed[ri] += len(p) - len(kv[st])
            pending.extend((st, pos, p[pos], ri if pos == len(p) - 1 else None)
                           for pos in range(len(kv[st]), len(p)))
        first_logits = self.evaluate_tokens(pending)
        for ri, st in leader.items():
            kv[st] = list(prompts[ri])
        self._cached = {ri: len(prompts[ri]) - c for ri, c in computed.items()}
        self._stats["prompt_tokens"] += sum(len(prompts[ri]) for ri in leader)
        self._stats["cached_tokens"] += sum(self._cached.values())
        # 4. other samples of a prompt start from a copy of its leader's stream
        for s, ri in followers:
            ll.llama_memory_seq_cp(mem, leader[ri], s, -1, -1)
            kv[s] = list(prompts[ri])

        # 5. the stream each chunk row decodes in
        stream_of: list[int] = []
        taken: set[int] = set()
        fol = iter(followers)
        for ri, _ in chunk:
            if ri not in taken:
                stream_of.append(leader[ri])
                taken.add(ri)
            else:
                stream_of.append(next(fol)[0])
        return stream_of, self._np.stack([first_logits[ri] for ri, _ in chunk])

    def _sample_rows(self, state: list[int], logits: Any,
                     rows: list[Row]) -> tuple[list[int], list[float]]:
        tokens, lps = sample_tokens(self._np, logits, [r.params for r in rows], [r.rng for r in rows])
        return tokens.tolist(), lps.tolist()

    def _step(self, stream_of: list[int], tokens: list[int], active: list[int],
              keep: list[int]) -> tuple[list[int], Any]:
        kv = self._kv
        for j, k in enumerate(keep):  # finished rows leave the batch at once
            s = stream_of[active[k]]
            self._set(j, tokens[k], len(kv[s]), s, True)
            kv[s].append(tokens[k])
        self._decode(len(keep))
        return keep, self._logits(range(len(keep)))

    def evaluate_tokens(self, tokens: list[tuple[int, int, int, Any]]) -> dict[Any, Any]:
        """Evaluate ``(stream, position, token, key)`` in batches of ``n_batch``; return the
        logits of the tokens whose key is not None, by key."""
        out: dict[Any, Any] = {}
        for i in range(0, len(tokens), self.n_batch):
            part = tokens[i:i + self.n_batch]
            want = []
            for j, (st, pos, t, key) in enumerate(part):
                self._set(j, t, pos, st, key is not None)
                if key is not None:
                    want.append((key, j))
            self._decode(len(part))
            if want:
                rows = self._logits([j for _, j in want])
                for (key, _), row in zip(want, rows):
                    out[key] = row
        return out

    def _set(self, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
        b = self._batch
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits

    def _decode(self, n: int) -> None:
        self._batch.n_tokens = n
        rc = self._ll.llama_decode(self._ctx, self._batch)
        if rc != 0:
            raise PolicyError(f"llamacpp: llama_decode failed (code {rc})")

    def _logits(self, idx: Any) -> Any:
        np, ll, V = self._np, self._ll, self.n_vocab
        return np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(self._ctx, i), shape=(V,))
                         for i in idx])


def sample_tokens(np: Any, logits: Any, params: list[Any], rng: Any) -> tuple[Any, Any]:
    """One token per row (temperature 0 = greedy; else temperature + top-p); returns the tokens
    and their raw log-probabilities (``log_softmax`` of the unscaled logits). ``rng``: one
    generator (anything with ``random()``) for all rows, or a list of one per row."""
    rngs = rng if isinstance(rng, (list, tuple)) else [rng] * len(params)
    z = logits - logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    tokens = np.empty(len(params), dtype=np.int64)
    for b, p in enumerate(params):
        row = z[b]
        if p.temperature <= 0:
            tokens[b] = int(row.argmax())
            continue
        w = np.exp(row / p.temperature)
        cand = None
        if 0.0 < p.top_p < 1.0:
            total = w.sum()
            k = min(len(w) - 1, 512)
            cand = np.argpartition(-w, k)[:k]
            cand = cand[np.argsort(-w[cand], kind="stable")]
            cw = np.cumsum(w[cand])
            if cw[-1] < p.top_p * total:  # the nucleus is wider than 512 tokens
                cand = np.argsort(-w, kind="stable")
                cw = np.cumsum(w[cand])
            keep = int(np.searchsorted(cw, p.top_p * total, side="left")) + 1
            cand, cw = cand[:keep], cw[:keep]
        else:
            cw = np.cumsum(w)
        i = int(np.searchsorted(cw, rngs[b].random() * cw[-1], side="right"))
        i = min(i, len(cw) - 1)
        tokens[b] = int(cand[i]) if cand is not None else i
    lps = z[np.arange(len(params)), tokens] - lse
    return tokens, lps


@register_policy("llamacpp")
def _make_llamacpp(arg: str) -> Policy:
    return from_path_spec("llamacpp", LlamaCppPolicy, arg,
                          "a GGUF file, e.g. llamacpp:/path/to/model.gguf")


#: policies with a model loaded, closed at interpreter exit by :func:`close_open_policies`
_OPEN: "weakref.WeakSet[LlamaCppPolicy]" = weakref.WeakSet()


@atexit.register
def close_open_policies(wait: float = 30.0) -> int:
    """Free every llama.cpp model still open, while the interpreter is whole; how many.

    Freeing a context makes llama.cpp log through llama_cpp's Python log callback. Left to
    ``__del__`` during interpreter teardown, the free can run after that callback's module was
    cleared and its C trampoline released: a call into unmapped memory, a segfault after every
    test had passed (docs/reliability.md, "Exit"). So models are freed here, at exit, first;
    ``__del__`` does nothing once the interpreter is finalizing. An LM call abandoned at its
    deadline may still be decoding on a background thread: it is waited for (``wait`` seconds
    in all); if it has not finished, nothing is freed under it and the OS reclaims the memory.
    """
    busy = [t for t in threading.enumerate() if t.name == "omrl-lm-call" and t.is_alive()]
    until = time.monotonic() + wait
    for t in busy:
        t.join(max(0.0, until - time.monotonic()))
    if any(t.is_alive() for t in busy):
        return 0
    closed = 0
    for policy in list(_OPEN):
        if policy.is_open:
            policy.close()
            closed += 1
    _OPEN.clear()
    return closed
