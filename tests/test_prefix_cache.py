"""The prefix cache across calls (backends/_prefix_cache.py) and the hf backend using it: the
radix tree's lookups, splits, LRU eviction under its memory limit and counters; and the hf
backend giving the same tokens and logprobs with and without it."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from omrl_search.prefix_cache import RadixCache  # noqa: E402
from omrl_search.backends.hf import HFPolicy  # noqa: E402
from omrl_search.policy import PolicyError, make_policy  # noqa: E402
from omrl_search.types import GenRequest, SamplingParams  # noqa: E402

L, H, D = 2, 1, 4  # layers, kv heads, head dim of the fake KV below
TOKEN_BYTES = L * 2 * H * D * 4  # float32


def fake_kv(tokens: list[int]):
    """A KV whose every entry says which token it belongs to (so slices can be checked)."""
    t = torch.tensor(tokens, dtype=torch.float32)
    return t[None, None, None, :, None].expand(L, 2, H, len(tokens), D).clone()


def put(cache: RadixCache, tokens: list[int]) -> int:
    full = fake_kv(tokens)
    asked = []

    def kv_of(s, e):
        asked.append((s, e))
        return full[..., s:e, :]

    added = cache.insert(tokens, kv_of)
    assert asked == ([(len(tokens) - added, len(tokens))] if added else [])
    return added


def got(cache: RadixCache, tokens: list[int], max_len=None) -> tuple[int, list[float]]:
    n, parts = cache.lookup(tokens, max_len)
    if not n:
        return 0, []
    kv = torch.cat(parts, dim=-2)
    assert kv.shape == (L, 2, H, n, D)
    return n, kv[0, 0, 0, :, 0].tolist()


# --- the radix tree -------------------------------------------------------------------------
def test_lookup_longest_prefix_and_split():
    c = RadixCache(1)
    assert put(c, [1, 2, 3, 4, 5]) == 5
    assert got(c, [1, 2, 3, 4, 5, 6, 7]) == (5, [1, 2, 3, 4, 5])
    # a prompt that is a prefix of the cached one
    assert got(c, [1, 2, 3]) == (3, [1, 2, 3])
    assert got(c, [1, 2, 3, 4, 5], max_len=4) == (4, [1, 2, 3, 4])
    # one that diverges mid-way: only the new tail is stored, the node splits
    assert put(c, [1, 2, 3, 9, 9]) == 2
    assert c.nodes() == 3
    assert got(c, [1, 2, 3, 9, 9, 1]) == (5, [1, 2, 3, 9, 9])
    assert got(c, [1, 2, 3, 4, 8]) == (4, [1, 2, 3, 4])
    assert got(c, [7, 1, 2]) == (0, [])
    assert put(c, [1, 2, 3]) == 0  # already held
    assert c.bytes == 7 * TOKEN_BYTES  # 1 2 3 | 4 5 | 9 9


def test_hit_counts():
    c = RadixCache(1)
    put(c, [1, 2, 3, 4])
    got(c, [1, 2, 3, 4, 5, 6])  # 4 of 6
    got(c, [5, 6])  # 0 of 2
    c.lookup([1, 2, 9, 9], min_len=3)  # 2 tokens match, under min_len: no hit
    s = c.stats()
    assert (s["lookups"], s["hits"], s["queried_tokens"], s["hit_tokens"]) == (3, 1, 12, 4)
    assert s["hit_rate"] == pytest.approx(4 / 12, abs=1e-4)
    assert s["inserted_tokens"] == 4 and s["bytes"] == 4 * TOKEN_BYTES


def test_eviction_keeps_memory_under_the_limit():
    limit_mb = 40 * TOKEN_BYTES / (1 << 20)  # room for 40 tokens
    c = RadixCache(limit_mb)
    for k in range(30):
        put(c, [1000 + k] + list(range(k * 10, k * 10 + 9)))  # 10 new tokens each
        assert c.bytes <= c.limit
    assert c.stats()["evicted_tokens"] == 26 * 10
    assert c.nodes() == 4
    # the newest are kept, the oldest are gone
    assert got(c, [1029] + list(range(290, 299)))[0] == 10
    assert got(c, [1000] + list(range(0, 9)))[0] == 0


def test_lru_order_and_leaves_first():
    c = RadixCache(30 * TOKEN_BYTES / (1 << 20))  # 30 tokens
    put(c, list(range(10)))  # A
    put(c, list(range(100, 110)))  # B
    put(c, list(range(200, 210)))  # C
    got(c, list(range(10)))  # A used again: B is now the least recently used
    put(c, list(range(300, 310)))  # D: over the limit by one leaf
    assert got(c, list(range(100, 110)))[0] == 0
    assert got(c, list(range(10)))[0] == 10 and got(c, list(range(200, 210)))[0] == 10
    # leaves first: a shared prefix outlives its older leaves while a leaf under it is in use
    c = RadixCache(30 * TOKEN_BYTES / (1 << 20))
    put(c, list(range(10)) + [50, 51, 52, 53, 54])  # prefix P (10) + leaf X (5)
    put(c, list(range(10)) + [60, 61, 62, 63, 64])  # leaf Y under P
    put(c, list(range(500, 510)))  # Z: 30 tokens in all
    got(c, list(range(10)) + [60])  # Y (and P) used
    put(c, [700, 701, 702, 703, 704])  # over by 5: the oldest leaf X goes, P stays
    assert got(c, list(range(10)) + [50, 51])[0] == 10
    assert got(c, list(range(10)) + [60, 61, 62, 63, 64])[0] == 15
    assert c.bytes <= c.limit


def test_limit_must_be_positive():
    with pytest.raises(ValueError):
        RadixCache(0)


# --- the hf backend with and without it -------------------------------------------------------
@pytest.fixture(scope="module")
def pair(tiny_hf_model: str) -> tuple[HFPolicy, HFPolicy]:
    on = HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8)
    off = HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8, prefix_cache=False)
    return on, off


SYSTEM = {"role": "system", "content": "You are an agent that solves tasks step by step in a kitchen."}


def ids_of(policy: HFPolicy, msgs) -> list[int]:
    tok = policy.tokenizer
    return tok.encode(tok.render(msgs, add_generation_prompt=True))


def req(ids: list[int], **params) -> GenRequest:
    return GenRequest([], SamplingParams(**params), prompt_ids=list(ids))


def same(a, b) -> None:
    assert [[g.token_ids for g in gs] for gs in a] == [[g.token_ids for g in gs] for gs in b]
    for ga, gb in zip(a, b):
        for x, y in zip(ga, gb):
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
            assert x.text == y.text and x.prompt_tokens == y.prompt_tokens


def search_like(policy: HFPolicy, temperature: float) -> list:
    """Three rounds of a small tree search: each round's prompts extend the last round's
    prompts with their completions and an observation turn."""
    tok = policy.tokenizer
    roots = [ids_of(policy, [SYSTEM, {"role": "user", "content": u}])
             for u in ("Observation: a table and a fridge.", "Observation: a door.")]
    prompts, rounds = roots, []
    for depth in range(3):
        reqs = [req(p, temperature=temperature, top_p=0.9, max_tokens=6, n=2, seed=10 * depth + i)
                for i, p in enumerate(prompts)]
        out = policy.generate(reqs)
        rounds.append(out)
        turn = tok.encode(f"\n<|im_start|>user\nObservation: step {depth}<|im_end|>\n<|im_start|>assistant\n")
        prompts = [p + g.token_ids + turn for p, gs in zip(prompts, out) for g in gs][:4]
    return rounds


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_same_outputs_with_and_without_the_cache(pair, temperature):
    on, off = pair
    on.prefix_cache.clear()
    with_cache, without = search_like(on, temperature), search_like(off, temperature)
    for a, b in zip(with_cache, without):
        same(a, b)
    # rounds after the first prefill only their new tokens
    assert all(g.cached_tokens == 0 for gs in without[2] for g in gs)
    later = [g for r in with_cache[1:] for gs in r for g in gs]
    assert all(0 < g.cached_tokens < g.prompt_tokens for g in later)
    s = on.stats()["prefix_cache"]
    assert s["hits"] > 0 and 0 < s["hit_rate"] < 1
    assert off.stats() == {}


def test_prefix_of_cached_prompt_and_divergence(pair):
    on, off = pair
    on.prefix_cache.clear()
    long = ids_of(on, [SYSTEM, {"role": "user", "content": "Observation: a long corridor with doors."}])
    short = long[:len(long) - 5]  # a prefix of the cached prompt
    diverged = long[:len(long) // 2] + ids_of(on, [{"role": "user", "content": "open the fridge"}])
    on.generate([req(long, temperature=0.0, max_tokens=4)])
    for prompt, cached in ((short, len(short) - 1), (diverged, len(long) // 2)):
        a = on.generate([req(prompt, temperature=0.7, max_tokens=6, seed=3, n=2)])
        b = off.generate([req(prompt, temperature=0.7, max_tokens=6, seed=3, n=2)])
        same(a, b)
        assert a[0][0].cached_tokens >= cached


def test_mixed_hits_and_misses_in_one_call(pair):
    on, off = pair
    on.prefix_cache.clear()
    p1 = ids_of(on, [SYSTEM, {"role": "user", "content": "Observation: a table."}])
    on.generate([req(p1, temperature=0.0, max_tokens=3)])
    fresh = ids_of(on, [{"role": "user", "content": "take the key and open the door please"}])
    reqs = [req(p1 + [5, 6, 7], temperature=1.0, max_tokens=5, seed=1), req(fresh, temperature=1.0, max_tokens=5, seed=2)]
    a, b = on.generate(reqs), off.generate(reqs)
    same(a, b)
    assert a[0][0].cached_tokens > 0 and a[1][0].cached_tokens == 0


def test_memory_limit_in_the_backend(tiny_hf_model):
    p = HFPolicy(tiny_hf_model, dtype="float32", prefix_cache_mb=0.05)
    per_token = 2 * 2 * 2 * 8 * 4  # layers x (k, v) x kv heads x head dim x float32
    for k in range(12):
        prompt = ids_of(p, [{"role": "user", "content": f"Observation {k}: a room with {k} doors."}])
        p.generate([req(prompt, temperature=0.0, max_tokens=8)])
        assert p.prefix_cache.bytes <= p.prefix_cache.limit
    s = p.stats()["prefix_cache"]
    assert s["evicted_tokens"] > 0 and s["limit_bytes"] == int(0.05 * (1 << 20))
    assert s["inserted_tokens"] * per_token > s["limit_bytes"]


def test_prefix_cache_option(tiny_hf_model):
    assert make_policy(f"hf:{tiny_hf_model}:prefix_cache=off").prefix_cache is None
    p = make_policy(f"hf:{tiny_hf_model}:prefix_cache=on,prefix_cache_mb=64")
    assert p.prefix_cache is not None and p.prefix_cache.limit == 64 << 20
    assert make_policy(f"hf:{tiny_hf_model}").prefix_cache is not None  # on by default
    for bad in ("prefix_cache=maybe", "prefix_cache_mb=0", "prefix_cache_mb=lots"):
        with pytest.raises(PolicyError) as e:
            make_policy(f"hf:{tiny_hf_model}:{bad}")
        assert "prefix_cache" in str(e.value) and "\n" not in str(e.value)


def test_reload_clears_the_cache(tiny_hf_model):
    p = HFPolicy(tiny_hf_model, dtype="float32")
    p.generate([req(ids_of(p, [SYSTEM]), temperature=0.0, max_tokens=4)])
    assert p.prefix_cache.bytes > 0
    p.reload(tiny_hf_model)
    assert p.prefix_cache.bytes == 0


def test_clear_cache_makes_the_next_call_cold(pair):
    """Policy.clear_cache (what benchmarks and weight pushes call) empties the prefix cache: the
    same prompt again is prefilled in full; a policy with the cache off has nothing to clear."""
    on, off = pair
    ids = ids_of(on, [SYSTEM, {"role": "user", "content": "Observation: a door."}])
    on.generate([req(ids, temperature=0.0, max_tokens=3)])
    assert on.generate([req(ids, temperature=0.0, max_tokens=3)])[0][0].cached_tokens > 0
    on.clear_cache()
    assert on.generate([req(ids, temperature=0.0, max_tokens=3)])[0][0].cached_tokens == 0
    off.clear_cache()
