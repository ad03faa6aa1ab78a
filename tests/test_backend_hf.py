"""The ``hf`` backend on a tiny random Llama built locally (see conftest.tiny_hf_model)."""
from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from omrl_search.backends.hf import HFPolicy  # noqa: E402
from omrl_search.policy import PolicyError, make_policy  # noqa: E402
from omrl_search.types import GenRequest, SamplingParams  # noqa: E402

MSGS = [
    [{"role": "user", "content": "take the key"}],
    [{"role": "system", "content": "You are a helpful agent."},
     {"role": "user", "content": "Observation: You are in a kitchen. There is a table and a fridge."}],
    [{"role": "user", "content": "open door"}],
]


@pytest.fixture(scope="module")
def policy(tiny_hf_model: str) -> HFPolicy:
    return HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8)


def ids_of(policy: HFPolicy, msgs: list[dict[str, str]]) -> list[int]:
    tok = policy.tokenizer
    return tok.encode(tok.render(msgs, add_generation_prompt=True))


def req(policy: HFPolicy, msgs, **params) -> GenRequest:
    return GenRequest(msgs, SamplingParams(**params), prompt_ids=ids_of(policy, msgs))


def test_tokenizer_render_and_encode(policy: HFPolicy) -> None:
    tok = policy.tokenizer
    text = tok.render(MSGS[0], add_generation_prompt=True)
    assert text == "<|im_start|>user\ntake the key<|im_end|>\n<|im_start|>assistant\n"
    assert tok.render(MSGS[0], add_generation_prompt=False).endswith("<|im_end|>\n")
    ids = tok.encode(text)
    hf = tok.hf
    assert ids[0] == hf.convert_tokens_to_ids("<|im_start|>")  # special markers parsed, no BOS added
    assert hf.convert_tokens_to_ids("<|im_end|>") in ids
    assert tok.decode(ids) == text
    assert hf.convert_tokens_to_ids("<|im_end|>") in tok.eos_token_ids


def test_spec_builds_policy(tiny_hf_model: str) -> None:
    p = make_policy(f"hf:{tiny_hf_model}:max_batch=4,dtype=float32")
    assert isinstance(p, HFPolicy) and p.max_batch == 4


def test_greedy_batched_equals_alone(policy: HFPolicy) -> None:
    reqs = [req(policy, m, temperature=0.0, max_tokens=12) for m in MSGS]
    assert len({len(r.prompt_ids) for r in reqs}) == 3  # different lengths: left padding matters
    batched = policy.generate(reqs)
    for r, gens in zip(reqs, batched):
        alone = policy.generate([r])[0][0]
        assert gens[0].token_ids == alone.token_ids
        assert gens[0].text == alone.text
        for a, b in zip(gens[0].logprobs, alone.logprobs):
            assert a == pytest.approx(b, abs=1e-4)


def test_shared_prefix_prefilled_once(policy: HFPolicy, monkeypatch) -> None:
    """Prompts sharing a system prompt: the shared prefix is prefilled once for the chunk and
    fanned out; results equal each prompt generated alone."""
    system = {"role": "system", "content": "You are a helpful agent. Solve the task step by step."}
    msgs = [[system, {"role": "user", "content": t}] for t in ("take key", "open the door now", "look")]
    reqs = [req(policy, m, temperature=0.0, max_tokens=10) for m in msgs]
    monkeypatch.setattr(policy, "min_shared_prefix", 1)
    policy.prefix_cache.clear()  # (else earlier tests' prompts serve the prefix from the cache)
    calls = []
    forward = policy.model.forward
    monkeypatch.setattr(policy.model, "forward", lambda *a, **k: calls.append(k["input_ids"].shape) or forward(*a, **k))
    batched = policy.generate(reqs)
    assert calls[0][0] == 1 and calls[0][1] >= 10  # the shared prefix, once
    for r, gens in zip(reqs, batched):
        alone = policy.generate([r])[0][0]
        assert gens[0].token_ids == alone.token_ids
        assert gens[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_cached_decoding_uses_the_installed_transformers_cache_keyword(policy: HFPolicy) -> None:
    """The KV cache reaches the model under the keyword its forward declares (transformers 5.2x
    renamed ``past_key_values`` to ``cache``, warning on the old name), so decoding a prompt and
    its continuation through the prefix cache raises no deprecation warning."""
    import inspect
    import warnings

    from omrl_search.kv_rows import with_cache

    declared = inspect.signature(type(policy.model).forward).parameters
    (keyword, _), = [(k, v) for k, v in with_cache(policy.model, "C").items() if k != "use_cache"]
    assert keyword in declared and with_cache(policy.model, "C")[keyword] == "C"

    class Old:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            pass
    assert with_cache(Old(), "C") == {"past_key_values": "C", "use_cache": True}
    policy.prefix_cache.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        first = policy.generate([req(policy, MSGS[0], temperature=0.0, max_tokens=6)])[0][0]
        again = policy.generate([req(policy, MSGS[0], temperature=0.0, max_tokens=6)])[0][0]
    assert again.token_ids == first.token_ids


def test_shapes_n_and_usage(policy: HFPolicy) -> None:
    reqs = [req(policy, MSGS[0], temperature=1.0, max_tokens=7, n=3, seed=1),
            req(policy, MSGS[1], temperature=0.0, max_tokens=5, n=2)]
    out = policy.generate(reqs)
    assert [len(g) for g in out] == [3, 2]
    for r, gens in zip(reqs, out):
        for g in gens:
            assert len(g.token_ids) == len(g.logprobs) == g.completion_tokens
            assert 1 <= g.completion_tokens <= r.params.max_tokens
            assert g.prompt_tokens == len(r.prompt_ids)
            assert all(lp <= 0.0 for lp in g.logprobs)
            assert g.finish_reason in ("stop", "length")
            if g.finish_reason == "length":
                assert g.completion_tokens == r.params.max_tokens and not g.ended_with_eos
            if g.ended_with_eos:
                assert g.token_ids[-1] in policy.tokenizer.eos_token_ids
    assert out[1][0].token_ids == out[1][1].token_ids  # greedy copies agree


def test_logprobs_match_forward_pass(policy: HFPolicy) -> None:
    import torch

    reqs = [req(policy, MSGS[1], temperature=0.9, top_p=0.8, max_tokens=10, n=2, seed=3),
            req(policy, MSGS[0], temperature=0.0, max_tokens=10)]
    for r, gens in zip(reqs, policy.generate(reqs)):
        for g in gens:
            full = torch.tensor([r.prompt_ids + g.token_ids])
            with torch.no_grad():
                logits = policy.model(full).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            P = len(r.prompt_ids)
            want = [lp[P - 1 + i, t].item() for i, t in enumerate(g.token_ids)]
            assert g.logprobs == pytest.approx(want, abs=1e-4)


def test_stop_strings_cut_text(policy: HFPolicy) -> None:
    base = policy.generate([req(policy, MSGS[0], temperature=0.0, max_tokens=24)])[0][0]
    text = base.text
    assert len(text) > 6
    stop = text[3:5]  # a stop string completed after a few tokens
    cut = text.index(stop)
    g = policy.generate([req(policy, MSGS[0], temperature=0.0, max_tokens=24, stop=("zzzz", stop))])[0][0]
    assert g.text == text[:cut]
    assert g.finish_reason == "stop" and not g.ended_with_eos
    assert g.token_ids == base.token_ids[:len(g.token_ids)]
    assert stop in policy.tokenizer.decode(g.token_ids)  # the last token completes the stop string
    assert stop not in policy.tokenizer.decode(g.token_ids[:-1])
    assert len(g.logprobs) == len(g.token_ids)


def test_max_tokens_length(policy: HFPolicy) -> None:
    out = policy.generate([req(policy, m, temperature=0.0, max_tokens=3) for m in MSGS])
    for gens in out:
        g = gens[0]
        assert g.completion_tokens <= 3
        assert g.finish_reason == ("stop" if g.ended_with_eos else "length")
    zero = policy.generate([req(policy, MSGS[0], max_tokens=0)])[0][0]
    assert zero.token_ids == [] and zero.finish_reason == "length"


def test_eos_ends_generation(policy: HFPolicy) -> None:
    """Force EOS by making it the only likely token: the generation stops on it and keeps it."""
    import torch

    eos = policy.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    head = policy.model.lm_head.weight
    saved = head.data.clone()
    try:
        head.data[eos] = saved[eos] + 50.0 * torch.sign(saved.mean(0))
        with torch.no_grad():
            g = policy.generate([req(policy, MSGS[0], temperature=0.0, max_tokens=8)])[0][0]
    finally:
        head.data.copy_(saved)
    if g.token_ids[-1] != eos:
        pytest.skip("could not force EOS on the random model")
    assert g.ended_with_eos and g.finish_reason == "stop"
    assert "<|im_end|>" not in g.text


def test_seeded_sampling_reproducible(policy: HFPolicy) -> None:
    reqs = [req(policy, MSGS[0], temperature=1.0, max_tokens=10, n=4, seed=7),
            req(policy, MSGS[2], temperature=1.0, max_tokens=10, n=2, seed=7)]
    a = [[g.token_ids for g in gens] for gens in policy.generate(reqs)]
    b = [[g.token_ids for g in gens] for gens in policy.generate(reqs)]
    assert a == b
    assert len({tuple(t) for t in a[0]}) > 1  # samples differ from each other


def test_messages_path_uses_chat_template(policy: HFPolicy) -> None:
    by_msgs = policy.generate([GenRequest(MSGS[1], SamplingParams(temperature=0.0, max_tokens=6))])[0][0]
    by_ids = policy.generate([req(policy, MSGS[1], temperature=0.0, max_tokens=6)])[0][0]
    assert by_msgs.token_ids == by_ids.token_ids
    assert by_msgs.prompt_tokens == len(ids_of(policy, MSGS[1]))


def test_reload(tiny_hf_model: str, tmp_path) -> None:
    import torch

    p = HFPolicy(tiny_hf_model, dtype="float32")
    r = req(p, MSGS[0], temperature=0.0, max_tokens=8)
    before = p.generate([r])[0][0]
    with torch.no_grad():
        for w in p.model.parameters():
            w.mul_(-1.0)
    p.model.save_pretrained(tmp_path / "ckpt")
    p.reload(str(tmp_path / "ckpt"))
    after = p.generate([r])[0][0]
    assert after.token_ids != before.token_ids
    p.reload(tiny_hf_model)
    assert p.generate([r])[0][0].token_ids == before.token_ids


def test_missing_model_is_a_policy_error(tmp_path) -> None:
    with pytest.raises(PolicyError) as e:
        HFPolicy(str(tmp_path / "nope"))
    assert "does not exist" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(PolicyError) as e:
        make_policy(f"hf:{tmp_path}")  # exists but holds no model
    assert "\n" not in str(e.value)


def test_bfloat16_runs(tiny_hf_model: str) -> None:
    p = HFPolicy(tiny_hf_model, dtype="bfloat16")
    g = p.generate([req(p, MSGS[0], temperature=0.0, max_tokens=5)])[0][0]
    assert len(g.token_ids) == len(g.logprobs) and all(math.isfinite(x) for x in g.logprobs)
