"""The implicit PRM (``implicit:POLICY,ref=REF,beta=B``) against a hand computation of
``beta * log pi / pi_ref`` with the tiny HF model, its memo, its spec and its use in a search."""
from __future__ import annotations

import json
import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import omrl_search as om  # noqa: E402
from omrl_search.reward import list_reward_models, make_reward_model  # noqa: E402
from omrl_search.specs import SpecError  # noqa: E402
from reward_models.implicit import ImplicitPRM, parse_implicit_spec, sigmoid  # noqa: E402


def _copy(src: str, folder, noise: float) -> str:
    """The tiny model with room for the engine's Game24 prompts (rotary positions: only the
    config's limit changes) and, with ``noise``, perturbed weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    model.config.max_position_embeddings = 4096
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(src).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def policy_model(tiny_hf_model, tmp_path_factory):
    return _copy(tiny_hf_model, tmp_path_factory.mktemp("policy_model"), 0.0)


@pytest.fixture(scope="module")
def ref_model(tiny_hf_model, tmp_path_factory):
    """The 'reference' the policy moved away from."""
    return _copy(tiny_hf_model, tmp_path_factory.mktemp("ref_model"), 0.05)


@pytest.fixture(scope="module")
def trajectory():
    task = om.load_tasks("game24", "test", limit=1)[0]
    res = om.search(task, strategy="react", policy="scripted:oracle:p=0", seed=0)
    leaf = max(res.tree.nodes, key=lambda n: n.depth)
    traj = res.tree.trajectory(leaf)
    assert len(traj.steps) >= 2
    return traj


def _hand_logprob(folder: str, messages, completion: str) -> float:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    p = tok(prompt, add_special_tokens=False).input_ids
    c = tok(completion, add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(torch.tensor([p + c])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return float(sum(lp[len(p) + j - 1, t] for j, t in enumerate(c)))


def test_step_rewards_are_the_beta_log_ratio_by_hand(policy_model, ref_model, trajectory):
    from omrl_search.agent import ReActFormat
    from omrl_search.exports import prompt_messages

    # both models in float32, as the hand computation (dtype auto is bfloat16 on native-bf16 CPUs)
    rm = make_reward_model(
        f"implicit:hf:{policy_model}:dtype=float32,ref=hf:{ref_model}:dtype=float32,beta=0.5")
    assert isinstance(rm, ImplicitPRM) and rm.beta == 0.5
    got = rm.step_rewards([trajectory])[0]
    fmt = ReActFormat()
    messages = prompt_messages(trajectory.task, trajectory.nodes[0].observation, fmt)
    want = []
    for step in trajectory.steps:
        want.append(0.5 * (_hand_logprob(policy_model, messages, step.completion)
                           - _hand_logprob(ref_model, messages, step.completion)))
        messages = messages + [{"role": "assistant", "content": step.completion},
                               fmt.observation_message(step.observation)]
    assert got == pytest.approx(want, abs=1e-4)
    assert any(abs(r) > 1e-3 for r in got)  # the two models differ
    # score: the squashed running sum; value (aggregation last): the whole path's
    sums = [sum(want[:i + 1]) for i in range(len(want))]
    assert rm.score([trajectory])[0] == pytest.approx([sigmoid(s) for s in sums], abs=1e-4)
    assert rm.value([trajectory])[0] == pytest.approx(sigmoid(sums[-1]), abs=1e-4)


def test_steps_scored_once_and_siblings_share_a_request(policy_model, ref_model, trajectory):
    rm = make_reward_model(f"implicit:hf:{policy_model},ref=hf:{ref_model}")
    calls = []
    real = rm.policy.score
    rm.policy.score = lambda reqs, comps: calls.append([len(c) for c in comps]) or real(reqs, comps)
    try:
        short = type(trajectory)(trajectory.task, trajectory.nodes[:2], trajectory.agent)
        got = rm.scored([short, trajectory])  # the first step is shared: one request, scored once
        assert calls == [[1] * len(trajectory.steps)]
        assert got.usage[0].prefill_tokens > 0 and got.usage[1].prefill_tokens > 0
        again = rm.scored([trajectory])
        assert len(calls) == 1  # everything memoised: no model call
        assert [u.prefill_tokens for u in again.usage] == [0]  # ... and no token run
    finally:
        del rm.policy.score
    assert rm.steps_scored == len(trajectory.steps)


def test_tokens_run_are_counted_for_rm_tokens(policy_model, ref_model, trajectory):
    """Without a prefix cache each step costs both models its whole prompt and completion."""
    from omrl_search.agent import ReActFormat
    from omrl_search.exports import prompt_messages

    rm = make_reward_model(f"implicit:hf:{policy_model}:prefix_cache=off,"
                           f"ref=hf:{ref_model}:prefix_cache=off")
    tok = transformers.AutoTokenizer.from_pretrained(policy_model)
    fmt, want = ReActFormat(), 0
    messages = prompt_messages(trajectory.task, trajectory.nodes[0].observation, fmt)
    for step in trajectory.steps:
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        want += len(tok(prompt, add_special_tokens=False).input_ids)
        want += len(tok(step.completion, add_special_tokens=False).input_ids)
        messages = messages + [{"role": "assistant", "content": step.completion},
                               fmt.observation_message(step.observation)]
    assert [u.prefill_tokens for u in rm.scored([trajectory]).usage] == [2 * want]


def test_the_same_model_as_its_own_reference_gives_zero(policy_model, trajectory):
    rm = make_reward_model(f"implicit:hf:{policy_model},ref=hf:{policy_model},squash=none")
    assert rm.policy is rm.ref
    assert rm.score([trajectory])[0] == [0.0] * len(trajectory.steps)


def test_ref_defaults_to_the_recorded_base(policy_model, ref_model, tmp_path):
    (tmp_path / "omrl-train.json").write_text(json.dumps({"base_model": ref_model}))
    from reward_models.implicit import default_ref

    assert default_ref(f"hf:{tmp_path}") == f"hf:{ref_model}"
    with pytest.raises(SpecError, match="give ref=REF"):
        make_reward_model(f"implicit:hf:{policy_model}")


@pytest.mark.parametrize("spec, msg", [
    ("implicit:", "expected implicit:POLICY"),
    ("implicit:smollm2,beta=x,ref=smollm2", "beta must be a number"),
    ("implicit:smollm2,ref=smollm2,squash=tanh", "squash must be one of"),
    ("implicit:smollm2,ref=a,ref=b", "ref given twice"),
])
def test_bad_specs_are_one_line(spec, msg):
    with pytest.raises(ValueError, match=msg):
        make_reward_model(spec)


def test_a_policy_that_cannot_score_is_refused():
    from omrl_search.policy import Policy

    class NoScore(Policy):
        name = "noscore"

        def generate(self, requests):
            return []

    with pytest.raises(ValueError, match="the ref 'noscore' cannot score completions"):
        ImplicitPRM(om.make_policy("scripted:oracle"), NoScore())


def test_spec_parsing_keeps_commas_of_policy_specs():
    assert parse_implicit_spec("hf:/m:dtype=float32,max_batch=4,ref=hf:/b:max_batch=2,x=1,beta=0.1") == (
        "hf:/m:dtype=float32,max_batch=4", {"ref": "hf:/b:max_batch=2,x=1", "beta": "0.1"})


def test_listed_and_guides_beam_like_a_prm(policy_model, ref_model):
    import importlib
    import tomllib
    from pathlib import Path

    assert "implicit" in list_reward_models()
    # listed by `omrl reward-models` through its entry point (once the package is installed)
    project = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    target = project["project"]["entry-points"]["omrl_search.reward_models"]["implicit"]
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    rm = make_reward_model(f"implicit:hf:{policy_model},ref=hf:{ref_model},beta=1")
    tasks = om.load_tasks("game24", "test", limit=2)
    results = om.search_many(tasks, strategy="beam:width=2,k=2,value=rm",
                             policy="scripted:oracle:p=0.5", reward_model=rm, seed=1)
    for r in results:
        assert not r.faults and r.spent["rm_calls"] > 0 and r.spent["rm_tokens"] > 0
        scored = [n.score for n in r.tree.nodes if n.score is not None]
        assert scored and all(0 < s < 1 for s in scored) and len(set(scored)) > 1
    assert math.isfinite(sum(n.score or 0 for r in results for n in r.tree.nodes))


def test_label_rows_score_as_their_trajectory_does(policy_model, ref_model, trajectory, tmp_path):
    """``benchmarks/prm_heldout.py --prm implicit:...`` scores label-file rows: a row scores as the
    trajectory it came from, and the held-out yardstick runs on saved trees with exact labels."""
    from reward_models.inputs import Episode, episode_from_trajectory
    from train.loop_prm import heldout

    spec = f"implicit:hf:{policy_model}:dtype=float32,ref=hf:{ref_model}:dtype=float32,beta=0.5"
    want = make_reward_model(spec).score([trajectory])[0]
    ep = episode_from_trajectory(trajectory)
    row = Episode(ep.prompt, ep.completions, ep.observations, None, None)  # what a label row holds
    assert make_reward_model(spec).score_episodes([row])[0] == pytest.approx(want, abs=1e-5)

    tasks = om.load_tasks("game24", "test", limit=2)
    results = om.search_many(tasks, strategy="best_of_n:n=3", policy="scripted:oracle:p=0.5", seed=1)
    om.write_results(tmp_path / "results.jsonl", results)
    out = heldout(spec, [tmp_path / "results.jsonl"], labels="exact")
    steps = out["all"]["calibration"]["steps"]
    assert out["results"] == 2 and steps > 0
    assert all(0.0 < b["mean_pred"] < 1.0 for b in out["all"]["calibration"]["bins"])
