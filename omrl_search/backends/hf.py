"""The ``hf`` backend: a transformers causal LM, batched generation on CPU or one GPU.

Spec: ``hf:PATH`` (an HF model folder), optionally followed by ``:key=value,...`` options, e.g.
``hf:/models/smol:dtype=bfloat16,max_batch=16``.

How one :meth:`HFPolicy.generate` call runs:

* every request becomes ``params.n`` rows; rows are sorted by the prompt tokens left to prefill
  and cut into chunks of at most ``max_batch`` rows (less padding);
* in a chunk each distinct prompt is prefilled **once** (left padded, explicit position ids) and its
  KV cache is then fanned out to its ``n`` rows, so ``n`` samples cost one prefill; a prefix that
  all the chunk's prompts share (the system prompt) is prefilled once before that, and so is a
  prefix that a group of them shares beyond it (one task's prompt and path: siblings in a
  search) when that saves tokens (:func:`prefill_levels`);
* the decode loop samples every row with its own temperature / top-p and its own random stream
  (seeded from its request's ``seed`` and its sample index, so a row's samples do not depend on
  which other requests share the call), records the raw log-probability of the chosen
  token (``log_softmax`` of the unscaled logits: what a trainer recomputes), and drops finished
  rows (EOS, a stop string, ``max_tokens``) from the batch and its KV cache once they are a
  quarter of it;
* under a grammar (``GenRequest.grammar``, see :mod:`omrl_search.constrain`) each row has an
  xgrammar matcher; before sampling, the batch's next-token bitmask sets the logits of tokens
  the grammar does not allow to ``-inf``, so the token is sampled from, and its logprob is the
  ``log_softmax`` of, the masked distribution (renormalised over the allowed tokens); grammars
  are compiled once per text for this tokenizer;
* a **prefix cache across calls** (on by default; ``prefix_cache=off``, ``prefix_cache_mb=N``;
  :mod:`omrl_search.prefix_cache`): a radix tree over token ids holding KV tensors. Each prompt's longest
  cached prefix is copied into the batch and only the rest is prefilled; each prompt, and each
  row's prompt plus its generated tokens when it ends, is stored (only what the tree lacks).
  Rows are ordered by the tokens left to prefill; ``Generation.cached_tokens`` counts the
  tokens served; :meth:`HFPolicy.stats` reports the hit rate;
* :meth:`HFPolicy.score` (``Policy.score``) reads given completions' logprobs in one forward
  over the candidates on top of their prompts;
* the KV cache appends into preallocated buffers (transformers' ``DynamicCache`` concatenates,
  copying the whole cache every step: most of a CPU decode step at batch 32).

Nothing heavy is imported at module level.
"""
from __future__ import annotations

import os
from typing import Any

from ..host import bf16_native
from ..kv_rows import kv_of_row, load_cached, make_cache, with_cache
from ..policy import (Policy, PolicyError, from_path_spec, register_policy, request_prompt_ids,
                      require)
from ..prefix_cache import RadixCache, cache_limit
from ..specs import error_line
from ..types import GenRequest
from ._decode import ChunkedDecoder, Row, prefix_groups
from .hf_tokenizer import HFChatTokenizer

#: the CPU dtype used when ``dtype="auto"`` (on CPUs with native bfloat16, see
#: :func:`_cpu_auto_dtype`). Measured with benchmarks/backend_throughput.py on the 2-core
#: development VM (Sapphire Rapids, AMX): bfloat16 generates 1.2-1.8x more tokens per second than
#: float32 under batched load. Logprobs then come from bfloat16 logits (like vLLM's); pass
#: ``dtype="float32"`` when they must match a float32 trainer's recomputation closely.
CPU_DEFAULT_DTYPE = "bfloat16"

#: memory bound of the prefix cache (``prefix_cache_mb``), in MiB of KV tensors
DEFAULT_PREFIX_CACHE_MB = 1024


def _cpu_auto_dtype(torch: Any) -> str:
    """:data:`CPU_DEFAULT_DTYPE`, but float32 on CPUs without native bfloat16 (AMX or
    AVX512-BF16), where bfloat16 matmuls are emulated and slower than float32."""
    if CPU_DEFAULT_DTYPE != "bfloat16":
        return CPU_DEFAULT_DTYPE
    return "bfloat16" if bf16_native() else "float32"


def looks_local(path: str) -> bool:
    """A filesystem path (must exist here) rather than a hub id like ``org/name``."""
    return (
        os.path.isabs(path)
        or path.startswith((".", "~"))
        or path.count("/") > 1
        or path.endswith(".gguf")
        or os.sep != "/" and os.sep in path
    )


class HFPolicy(ChunkedDecoder, Policy):
    """A transformers ``AutoModelForCausalLM`` with its tokenizer.

    ``device``: ``"cpu"``, ``"cuda"`` (``"cuda:1"``...) or ``"auto"`` (cuda when available).
    ``dtype``: ``"auto"`` (bfloat16 on a GPU that supports it, :data:`CPU_DEFAULT_DTYPE` on CPU),
    ``"float32"``, ``"bfloat16"`` or ``"float16"``. ``gguf_file``: load (dequantised) from a GGUF
    file inside ``path``.
    """

    name = "hf"
    #: prefill a prefix shared by all prompts of a chunk once when it is at least this long
    min_shared_prefix = 16
    #: also prefill once a prefix that a group of the chunk's prompts shares beyond that
    group_prefixes = True

    def __init__(
        self,
        path: str,
        device: str = "auto",
        dtype: str = "auto",
        max_batch: int = 32,
        gguf_file: str | None = None,
        attn_implementation: str | None = None,
        prefix_cache: Any = True,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
    ) -> None:
        self._torch = require("torch", "hf")
        require("transformers", "hf")
        torch = self._torch
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        if dtype == "auto":
            if self.device.type == "cuda":
                dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
            else:
                dtype = _cpu_auto_dtype(torch)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise PolicyError(f"hf: unknown dtype {dtype!r} (float32, bfloat16, float16 or auto)")
        self.dtype = getattr(torch, dtype)
        self.max_batch = int(max_batch)
        self.attn_implementation = attn_implementation
        self.path = path
        self.model, self.tokenizer = self._load(path, gguf_file, load_tokenizer=True)
        self._gen = torch.Generator(device="cpu")
        self._gen.seed()
        self._token_masker: Any = None  # xgrammar for this tokenizer, made on the first grammar
        self.prefix_cache = _make_prefix_cache(prefix_cache, prefix_cache_mb)

    # --- loading ------------------------------------------------------------------------
    def _load(self, path: str, gguf_file: str | None, load_tokenizer: bool) -> tuple[Any, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = os.path.expanduser(str(path))
        if gguf_file is None and path.endswith(".gguf") and os.path.isfile(path):
            path, gguf_file = os.path.split(os.path.abspath(path))
        if looks_local(path) and not os.path.exists(path):
            raise PolicyError(f"hf: model path {path!r} does not exist")
        if gguf_file is not None and not os.path.exists(os.path.join(path, gguf_file)):
            raise PolicyError(f"hf: GGUF file {os.path.join(path, gguf_file)!r} does not exist")
        kw: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = None
        try:
            if load_tokenizer:
                tokenizer = AutoTokenizer.from_pretrained(path, **kw)
            mkw = dict(kw, dtype=self.dtype)
            if self.attn_implementation:
                mkw["attn_implementation"] = self.attn_implementation
            model = AutoModelForCausalLM.from_pretrained(path, **mkw)
        except PolicyError:
            raise
        except Exception as exc:  # noqa: BLE001 - one clear line for any loading failure
            raise PolicyError(f"hf: cannot load a causal LM from {path!r}: {error_line(exc)}") from None
        model.to(self.device).eval()
        if load_tokenizer:
            gen_eos = getattr(model.generation_config, "eos_token_id", None)
            extra = gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]
            tokenizer = HFChatTokenizer(tokenizer, extra_eos_ids=[i for i in extra if i is not None])
        self._max_positions = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)
        self._vocab_size = int(model.get_input_embeddings().weight.shape[0])
        return model, tokenizer

    def reload(self, path: str) -> None:
        """Load new weights from an HF folder (e.g. a training checkpoint); the tokenizer stays."""
        old_vocab = self.model.get_input_embeddings().weight.shape[0]
        model, _ = self._load(path, None, load_tokenizer=False)
        if model.get_input_embeddings().weight.shape[0] != old_vocab:
            raise PolicyError(f"hf: {path!r} has a different vocabulary size than the loaded model")
        self.model = model
        self.path = path
        self.clear_cache()  # KV of the old weights

    def close(self) -> None:
        self.model = None
        self.clear_cache()

    def clear_cache(self) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def stats(self) -> dict[str, Any]:
        """The prefix cache's counters (hit rate, tokens served, evictions), when it is on."""
        return {} if self.prefix_cache is None else {"prefix_cache": self.prefix_cache.stats()}

    # --- generation ---------------------------------------------------------------------
    def prompt_ids_of(self, req: GenRequest) -> list[int]:
        return request_prompt_ids("hf", req, self.tokenizer, self._vocab_size,
                                  self._max_positions, "max_position_embeddings")

    def _check_open(self) -> None:
        if self.model is None:
            raise PolicyError("hf: policy is closed")

    def _new_seed(self) -> int:
        return int(self._torch.randint(0, 2**62, (1,), generator=self._gen))

    def _context_len(self) -> int:
        return self._max_positions

    def _order_key(self, prompt: list[int]) -> int:
        # the tokens left to prefill: rows with as much new work share a chunk (less padding)
        pc = self.prefix_cache
        return len(prompt) - (pc.match_len(prompt[:-1]) if pc is not None else 0)

    def _decoding(self) -> Any:
        return self._torch.inference_mode()

    def prefill_chunk(self, chunk: list[tuple[int, int]], prompts: list[list[int]],
                 rows: list[Row]) -> tuple[dict[str, Any], Any]:
        torch = self._torch
        dev = self.device
        cache, mask, logits, cached = self._prefill_rows([ri for ri, _ in chunk], prompts,
                                                         max(r.limit for r in rows))
        for row, n in zip(rows, cached):
            row.cached = n
        params = [r.params for r in rows]
        state = {
            "cache": cache, "mask": mask, "rows": rows,
            "prompts": [prompts[ri] for ri, _ in chunk],
            "next_pos": torch.tensor([len(prompts[ri]) for ri, _ in chunk], device=dev),
            "temps": torch.tensor([max(p.temperature, 0.0) for p in params], device=dev),
            "top_ps": torch.tensor([p.top_p if 0.0 < p.top_p < 1.0 else 1.0 for p in params], device=dev),
        }
        return state, logits

    def _prefill_rows(self, keys: list[int], prompts: list[list[int]],
                      extra: int) -> tuple[Any, Any, Any, list[int]]:
        """:meth:`_prefill_prompts` for batch rows that ask for ``prompts[keys[j]]``: each
        distinct prompt is prefilled once, then its KV, mask and logits are fanned out to its
        rows (cached-token counts per row too)."""
        uniq: dict[int, int] = {}
        for k in keys:
            uniq.setdefault(k, len(uniq))
        cache, mask, logits, cached = self._prefill_prompts([prompts[k] for k in uniq], extra)
        sel = [uniq[k] for k in keys]
        if sel != list(range(len(uniq))):
            idx = self._torch.tensor(sel, device=self.device)
            cache.batch_select_indices(idx)
            logits, mask = logits[idx], mask[idx]
        return cache, mask, logits, [cached[u] for u in sel]

    def _prefill_prompts(self, prompts: list[list[int]], extra: int) -> tuple[Any, Any, Any, list[int]]:
        """Run distinct ``prompts`` through the model: a batched KV cache (one row per prompt,
        left padded, room for ``extra`` more tokens), its attention mask, the logits of each
        prompt's next token, and how many of each prompt's tokens came from the prefix cache.

        With the prefix cache on, each prompt's longest cached prefix (leaving it one token) is
        copied into the batch and only the rest is prefilled; with no hit in the chunk, shared
        prefixes are prefilled once each (:func:`prefill_levels`). Each prompt's KV then goes
        into the prefix cache."""
        torch = self._torch
        dev = self.device
        pc = self.prefix_cache
        U = len(prompts)
        hits = [pc.lookup(p, len(p) - 1, self.min_shared_prefix) if pc is not None else (0, [])
                for p in prompts]
        cached = [n for n, _ in hits]
        Wc = max(cached)
        if Wc:  # one level on top of the cached prefixes
            levels: list[Level] = [([(u, cached[u], len(p)) for u, p in enumerate(prompts)], None)]
        else:  # shared prefixes (the system prompt, one task's prompt...) prefilled once each
            levels = prefill_levels(prompts, self.min_shared_prefix, self.group_prefixes)
        widths = [max(e - s for _, s, e in lrows) for lrows, _ in levels]
        cache = make_cache(self.model.config, capacity=Wc + sum(widths) + extra)
        mask = None
        if Wc:
            mask = self._load_cached(cache, hits, Wc)
        for (lrows, parents), W in zip(levels, widths):
            if parents is not None:
                idx = torch.tensor(parents, device=dev)
                cache.batch_select_indices(idx)
                mask = mask[idx]
            ids = torch.full((len(lrows), W), self.tokenizer.pad_token_id, dtype=torch.long)
            seg = torch.zeros((len(lrows), W), dtype=torch.long)
            for r, (u, s, e) in enumerate(lrows):
                ids[r, W - (e - s):] = torch.tensor(prompts[u][s:e], dtype=torch.long)
                seg[r, W - (e - s):] = 1
            pos = torch.tensor([[s] for _, s, _ in lrows]) + (seg.cumsum(-1) - 1).clamp(min=0)
            seg = seg.to(dev)
            mask = seg if mask is None else torch.cat([mask, seg], dim=1)
            o = self.model(input_ids=ids.to(dev), attention_mask=mask, position_ids=pos.to(dev),
                           **with_cache(self.model, cache), logits_to_keep=1)
        if pc is not None:
            for u, p in enumerate(prompts):
                self._remember(cache, mask, u, p)
        return cache, mask, o.logits[:, -1, :].float(), cached

    def _load_cached(self, cache: Any, hits: list[tuple[int, list[Any]]], W: int) -> Any:
        try:
            return load_cached(cache, hits, W, self.device)
        except ValueError as exc:
            raise PolicyError(f"hf: {exc}; pass prefix_cache=off") from None

    def _remember(self, cache: Any, mask: Any, b: int, tokens: list[int]) -> None:
        """Store batch row ``b``'s KV for ``tokens`` (its first ``len(tokens)`` unmasked
        columns) in the prefix cache; only the part the cache lacks is gathered."""
        self.prefix_cache.insert(tokens, kv_of_row(cache, mask, b, len(tokens)))  # type: ignore[union-attr]

    def _remember_rows(self, state: dict[str, Any], batch_rows: list[int], active: list[int]) -> None:
        """Store the prompt and the generated tokens already fed (all but the last) of each
        ended ``batch_rows`` (chunk row ``active[j]``): the next step's prompt extends them."""
        for j in batch_rows:
            b = active[j]
            ids = state["rows"][b].ids
            if len(ids) > 1:
                self._remember(state["cache"], state["mask"], j, state["prompts"][b] + ids[:-1])

    def _end_chunk(self, state: dict[str, Any], active: list[int]) -> None:
        if self.prefix_cache is not None:
            self._remember_rows(state, list(range(len(active))), active)

    # --- scoring given completions (Policy.score) ----------------------------------------
    def score(self, requests: list[GenRequest], completions: list[list[str]]) -> list[list[float]]:
        """Per request, the total logprob of each completion text (its tokens encoded after
        the prompt) under the raw model distribution (no grammar mask, temperature 1). Each
        distinct prompt of a chunk is prefilled once (through the prefix cache), then the
        chunk's candidates run in one forward on top of their prompts, right padded."""
        self._check_open()
        if len(requests) != len(completions):
            raise PolicyError(f"hf: score got {len(requests)} requests and {len(completions)} "
                              "lists of completions")
        torch = self._torch
        prompts = [self.prompt_ids_of(r) for r in requests]
        cands = [[self.tokenizer.encode(c) for c in comps] for comps in completions]
        out = [[0.0] * len(c) for c in cands]
        served: dict[int, int] = {}  # per request, prompt tokens the cache served at its first prefill
        self.last_score_cached = None
        pairs = [(i, j) for i, cs in enumerate(cands) for j, ids in enumerate(cs) if ids]
        for i, j in pairs:
            if len(prompts[i]) + len(cands[i][j]) > self._max_positions:
                raise PolicyError(f"hf: prompt and completion of {len(prompts[i]) + len(cands[i][j])} "
                                  f"tokens do not fit max_position_embeddings={self._max_positions}")
        dev = self.device
        with torch.inference_mode():
            for start in range(0, len(pairs), self.max_batch):
                chunk = pairs[start:start + self.max_batch]
                W = max(len(cands[i][j]) for i, j in chunk)
                cache, mask, first, cached = self._prefill_rows([i for i, _ in chunk], prompts, W)
                for (i, _), n in zip(chunk, cached):
                    served.setdefault(i, n)  # a later chunk finds the prompt this one computed
                B = len(chunk)
                ids = torch.full((B, W), self.tokenizer.pad_token_id, dtype=torch.long)
                seg = torch.zeros((B, W), dtype=torch.long)
                for r, (i, j) in enumerate(chunk):
                    c = cands[i][j]
                    ids[r, :len(c)] = torch.tensor(c, dtype=torch.long)
                    seg[r, :len(c)] = 1
                pos = torch.tensor([[len(prompts[i])] for i, _ in chunk]) + torch.arange(W)[None]
                pos = pos.clamp(max=self._max_positions - 1)
                mask = torch.cat([mask, seg.to(dev)], dim=1)
                ids = ids.to(dev)
                o = self.model(input_ids=ids, attention_mask=mask, position_ids=pos.to(dev),
                               **with_cache(self.model, cache))
                # logits predicting token t of a candidate: the prompt's last, then the candidate's
                logits = torch.cat([first[:, None], o.logits[:, :-1].float()], dim=1)
                lp = torch.log_softmax(logits, dim=-1).gather(2, ids[:, :, None]).squeeze(2)
                totals = torch.where(seg.to(dev).bool(), lp, 0.0).sum(dim=1).tolist()
                for r, (i, j) in enumerate(chunk):
                    out[i][j] = totals[r]
                    if self.prefix_cache is not None:  # the chosen step's prompt extends this
                        self._remember(cache, mask, r, prompts[i] + cands[i][j])
        self.last_score_cached = [served.get(i, 0) for i in range(len(requests))]
        return out

    def _sample_rows(self, state: dict[str, Any], logits: Any,
                     rows: list[Row]) -> tuple[list[int], list[float]]:
        tokens, lps = self._sample(logits, state["temps"], state["top_ps"], [r.rng for r in rows])
        return tokens.tolist(), lps.tolist()

    def _masker(self) -> Any:
        if self._token_masker is None:
            from ..constrain import TokenMasker

            self._token_masker = TokenMasker.from_hf(self.tokenizer.hf, self._vocab_size,
                                                     self.tokenizer.eos_token_ids)
        return self._token_masker

    def guide_for(self, grammar: Any) -> Any:
        return self._masker().matcher(grammar)

    def mask_logits(self, state: dict[str, Any], logits: Any, guides: list[Any]) -> Any:
        return self._masker().mask(logits, guides)

    def _step(self, state: dict[str, Any], tokens: list[int], active: list[int],
              keep: list[int]) -> tuple[list[int], Any]:
        torch, st = self._torch, state
        ids = torch.tensor(tokens, device=self.device)
        kept = list(range(len(tokens)))
        # drop finished rows (a KV copy) once they are a quarter of the batch
        if len(tokens) - len(keep) >= max(1, len(tokens) // 4):
            if self.prefix_cache is not None:
                gone = set(keep)
                self._remember_rows(st, [j for j in range(len(tokens)) if j not in gone], active)
            kidx = torch.tensor(keep, device=self.device)
            st["cache"].batch_select_indices(kidx)
            for key in ("mask", "next_pos", "temps", "top_ps"):
                st[key] = st[key][kidx]
            ids, kept = ids[kidx], keep
        mask = st["mask"] = torch.cat([st["mask"], st["mask"].new_ones((len(kept), 1))], dim=1)
        o = self.model(input_ids=ids[:, None], attention_mask=mask,
                       position_ids=st["next_pos"][:, None], **with_cache(self.model, st["cache"]))
        st["next_pos"] = (st["next_pos"] + 1).clamp(max=self._max_positions - 1)
        return kept, o.logits[:, -1, :].float()

    def _sample(self, logits: Any, temps: Any, top_ps: Any, rngs: list[Any]) -> tuple[Any, Any]:
        """Pick one token per row (row ``j`` draws from ``rngs[j]``); return it and its raw
        (temperature-1, unfiltered) logprob."""
        torch = self._torch
        logp = torch.log_softmax(logits, dim=-1)
        greedy = temps <= 0
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
            probs = torch.softmax(scaled, dim=-1)
            order = None
            if bool((top_ps < 1.0).any()):
                probs, order = probs.sort(dim=-1, descending=True)
                cum = probs.cumsum(dim=-1)
                probs = probs.masked_fill(cum - probs > top_ps[:, None], 0.0)
            # inverse-CDF sampling (torch.multinomial is ~20 ms for 32 x 49k rows on CPU)
            cum = probs.cumsum(dim=-1)
            u = torch.tensor([[r.random()] for r in rngs], dtype=cum.dtype, device=cum.device)
            u = u * cum[:, -1:]
            choice = torch.searchsorted(cum, u, right=True).clamp(max=probs.shape[-1] - 1)
            sampled = (order.gather(1, choice) if order is not None else choice).squeeze(1)
            tokens = torch.where(greedy, tokens, sampled)
        return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def _make_prefix_cache(on: Any, mb: Any) -> RadixCache | None:
    """The ``prefix_cache`` / ``prefix_cache_mb`` options as a cache (None: off), or one line
    saying which value is wrong."""
    try:
        limit = cache_limit(on, mb)
    except ValueError as exc:
        raise PolicyError(f"hf: {exc}") from None
    return None if limit is None else RadixCache(limit)


Level = tuple[list[tuple[int, int, int]], "list[int] | None"]


def prefill_levels(prompts: list[list[int]], min_shared: int, use_groups: bool = True) -> list[Level]:
    """How to prefill distinct ``prompts`` computing each shared prefix once.

    Levels of ``(rows, parents)``: row ``j`` = ``(prompt index, start, end)`` prefills that
    prompt's tokens ``[start, end)`` on top of row ``parents[j]`` of the level before (``None``:
    the first level). The last level has one row per prompt, in order. Up to three levels (see
    :func:`prefix_groups`): the prefix all share, when there is one; each group's prefix (with
    ``use_groups``), when that prefills fewer tokens, padding included; the rest of each prompt."""
    U = len(prompts)
    base, found = prefix_groups(prompts, min_shared)
    groups = found if use_groups else [([u], base) for u in range(U)]
    levels: list[Level] = [([(0, 0, base)], None)] if base else []
    starts, parents = [base] * U, ([0] * U if base else None)
    if len(groups) < U:
        group_of = {u: g for g, (members, _) in enumerate(groups) for u in members}
        shared = [q for _, q in groups]
        flat = U * (max(map(len, prompts)) - base)
        grouped = (len(groups) * (max(shared) - base)
                   + U * max(len(p) - shared[group_of[u]] for u, p in enumerate(prompts)))
        if grouped < flat:
            levels.append(([(members[0], base, q) for members, q in groups],
                           [0] * len(groups) if base else None))
            starts = [shared[group_of[u]] for u in range(U)]
            parents = [group_of[u] for u in range(U)]
    levels.append(([(u, starts[u], len(p)) for u, p in enumerate(prompts)], parents))
    return levels


@register_policy("hf")
def _make_hf(arg: str) -> Policy:
    return from_path_spec("hf", HFPolicy, arg, "a model folder, e.g. hf:/path/to/model")
