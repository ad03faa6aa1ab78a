"""Policy.score: the total logprob of given completions after a prompt (policy priors for
``mcts:priors=policy`` / ``beam:propose=policy``), on the hf backend (a tiny random model, checked
against a plain full forward), the scripted backends, and a backend without it."""
from __future__ import annotations

import math

import pytest

import omrl_search as om
from omrl_search.agent import ReActFormat
from omrl_search.env import make_env
from omrl_search.policy import Policy, PolicyError, make_policy
from omrl_search.types import GenRequest, SamplingParams

COMPLETIONS = ["Think: \nAct: take key", "Think: \nAct: open door", "Think: go\nAct: look",
               "Act: x"]


def req(ids: list[int]) -> GenRequest:
    return GenRequest([], SamplingParams(1.0, 1.0, 0), prompt_ids=list(ids))


# --- hf -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf(tiny_hf_model: str):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from omrl_search.backends.hf import HFPolicy

    return HFPolicy(tiny_hf_model, device="cpu", dtype="float32", max_batch=8)


def prompt(policy, text: str) -> list[int]:
    tok = policy.tokenizer
    msgs = [{"role": "system", "content": "You are an agent in a kitchen."}, {"role": "user", "content": text}]
    return tok.encode(tok.render(msgs, add_generation_prompt=True))


def plain(policy, ids: list[int], text: str) -> float:
    """Sum of the completion's token logprobs from one full forward over prompt + completion."""
    import torch

    comp = policy.tokenizer.encode(text)
    with torch.no_grad():
        logits = policy.model(torch.tensor([ids + comp])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return sum(lp[len(ids) - 1 + t, c].item() for t, c in enumerate(comp))


def test_hf_score_equals_a_full_forward(hf):
    hf.prefix_cache.clear()
    prompts = [prompt(hf, "Observation: a table."), prompt(hf, "Observation: a red door and a key.")]
    got = hf.score([req(p) for p in prompts], [COMPLETIONS, COMPLETIONS[:2]])
    assert [len(g) for g in got] == [4, 2]
    for p, scores, comps in zip(prompts, got, [COMPLETIONS, COMPLETIONS[:2]]):
        for s, c in zip(scores, comps):
            assert s == pytest.approx(plain(hf, p, c), abs=1e-4)
            assert s < 0
    assert hf.can_score


def test_hf_score_batching_and_prefix_cache_equivalence(hf, tiny_hf_model):
    from omrl_search.backends.hf import HFPolicy

    prompts = [prompt(hf, f"Observation: room {k} with a table.") for k in range(3)]
    comps = [COMPLETIONS, COMPLETIONS[1:], COMPLETIONS[:1]]
    hf.prefix_cache.clear()
    together = hf.score([req(p) for p in prompts], comps)
    assert hf.prefix_cache.stats()["inserted_tokens"] > 0
    again = hf.score([req(p) for p in prompts], comps)  # now served from the cache
    assert hf.prefix_cache.stats()["hit_tokens"] > 0
    alone = [hf.score([req(p)], [c])[0] for p, c in zip(prompts, comps)]
    off = HFPolicy(tiny_hf_model, dtype="float32", max_batch=3, prefix_cache="off")  # other chunks
    uncached = off.score([req(p) for p in prompts], comps)
    # float32 sums of ~60 nats over other batch shapes differ in their last bits (about 1e-5 on
    # AVX512 hosts): a relative tolerance of 1e-6 allows that and still catches a wrong cache
    for a, b, c, d in zip(together, again, alone, uncached):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-5)
        assert a == pytest.approx(c, rel=1e-6, abs=1e-5)
        assert a == pytest.approx(d, rel=1e-6, abs=1e-5)


def test_hf_score_empty_and_bad_input(hf):
    p = prompt(hf, "Observation: nothing.")
    assert hf.score([req(p)], [["", "Act: x"]])[0][0] == 0.0
    assert hf.score([], []) == []
    with pytest.raises(PolicyError):
        hf.score([req(p)], [])


def test_hf_scored_step_prompt_reuses_the_candidate(hf):
    """A candidate's KV is stored: the chosen step's next prompt extends it from the cache."""
    hf.prefix_cache.clear()
    p = prompt(hf, "Observation: a key on the floor.")
    hf.score([req(p)], [COMPLETIONS[:2]])
    comp = hf.tokenizer.encode(COMPLETIONS[1])
    assert hf.prefix_cache.match_len(p + comp + [3, 4]) == len(p) + len(comp)


def test_hf_score_reports_cached_prompt_tokens(hf):
    """``last_score_cached``: per request, the prompt tokens its prefix cache served (0 on a cold
    cache, the whole prompt but its last token once the prompt was scored before)."""
    hf.prefix_cache.clear()
    p, q = prompt(hf, "Observation: a lamp."), prompt(hf, "Observation: a long corridor.")
    hf.score([req(p), req(q)], [COMPLETIONS[:2], COMPLETIONS[:1]])
    assert hf.last_score_cached == [0, 0]
    hf.score([req(q), req(p)], [COMPLETIONS[:1], COMPLETIONS[:3]])
    assert hf.last_score_cached == [len(q) - 1, len(p) - 1]


def test_engine_charges_what_score_says_the_cache_served():
    """serve_scores charges each scored prompt's ``last_score_cached`` tokens as cached_tokens
    (before, every scored prompt token counted as prefill); generations report none here."""
    from omrl_search.backends.scripted import OraclePolicy

    class Served(OraclePolicy):
        served = 0  # tokens reported so far (this instance's)

        def score(self, requests, completions):
            out = super().score(requests, completions)
            self.last_score_cached = [3] * len(requests)
            self.served += 3 * len(requests)
            return out

    pol = Served(p=0.3)
    task = om.load_tasks("countdown", "test", limit=1)
    (res,) = om.search_many(task, strategy="mcts:priors=policy,simulations=8,k=2", policy=pol,
                            budget="lm_calls=30", seed=0)
    spent = res.spent
    assert pol.served > 0 and spent["cached_tokens"] == pol.served
    assert spent["prefill_tokens"] + spent["cached_tokens"] == spent["prompt_tokens"]


# --- scripted -------------------------------------------------------------------------------------
def scripted_request(env_name: str):
    task = om.load_tasks(env_name, "test", limit=1)[0]
    env = make_env(env_name)
    env.reset(task)
    snap = env.snapshot()
    return env, GenRequest([], SamplingParams(), None, {"task": task, "snapshot": snap, "env": env_name})


def test_scripted_oracle_scores_as_it_samples():
    env, r = scripted_request("sokoban")
    expert, acts = env.expert_action(), env.valid_actions()
    others = [a for a in acts if a != expert]
    fmt = ReActFormat()
    pol = make_policy("scripted:oracle:p=0.3")
    assert pol.can_score
    [scores] = pol.score([r], [[fmt.render("", a) for a in acts]])
    for a, s in zip(acts, scores):
        want = math.log(0.7) if a == expert else math.log(0.3 / len(others))
        assert s == pytest.approx(want)
    assert max(zip(scores, acts))[1] == expert
    assert pol.score([r], [["Act: no such move"]])[0][0] == pytest.approx(math.log(1e-12))
    # consistent with generate: a sampled completion's logprobs sum to its score
    r.params.seed, r.params.n = 5, 8
    for g in pol.generate([r])[0]:
        assert sum(g.logprobs) == pytest.approx(pol.score([r], [[g.text]])[0][0])
    assert pol.score([r], [[fmt.render("", expert)]]) == pol.score([r], [[fmt.render("", expert)]])


def test_scripted_random_scores_uniformly():
    env, r = scripted_request("sokoban")
    acts = env.valid_actions()
    [scores] = make_policy("scripted:random").score([r], [[ReActFormat().render("", a) for a in acts]])
    assert scores == pytest.approx([-math.log(len(acts))] * len(acts))


# --- a backend without it -------------------------------------------------------------------------
def test_a_backend_without_score_says_so():
    class Plain(Policy):
        name = "plain"

        def generate(self, requests):
            return []

    p = Plain()
    assert not p.can_score
    with pytest.raises(PolicyError) as e:
        p.score([], [])
    assert str(e.value) == "backend 'plain' does not score completions (Policy.score)"
