"""Online GRPO sampling on Ray actors: ``search_many(executor="ray", policy_weights=...)`` makes
the actors search with the pushed weights (not the ones their spec loaded), and online GRPO with
``online.executor=ray`` pushes the trainer's weights before every round, so its samples are the
trainer's own policy's. One local Ray (2 CPUs) for the whole module; the tiny random model."""
from __future__ import annotations

import json
import math

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import omrl_search as om  # noqa: E402
from omrl_search.backends.hf import HFPolicy  # noqa: E402
from omrl_search.executors import release  # noqa: E402
from omrl_search.policy import PolicyError  # noqa: E402
from omrl_search.types import SamplingParams  # noqa: E402
from train import grpo  # noqa: E402
from train.common import policy_logprobs  # noqa: E402
from train.runtime import TrainError  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ours = not ray.is_initialized()
    if ours:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    release()
    if ours:
        ray.shutdown()


def _steps(results):
    return [(s.completion_ids, s.logprobs) for r in results for s in r.best_trajectory.steps]


def _same(a, b) -> bool:
    if [ids for ids, _ in a] != [ids for ids, _ in b]:
        return False
    return all(torch.allclose(torch.tensor(x), torch.tensor(y), atol=1e-4) for (_, x), (_, y) in zip(a, b))


def test_actors_search_with_the_pushed_weights(tiny_agent_model):
    """Perturbed weights pushed to the actor give the in-process greedy completions and
    logprobs of the perturbed model; without the push the actor still has the spec's weights."""
    local = HFPolicy(tiny_agent_model, device="cpu", dtype="float32")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in local.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    state = {k: v.clone() for k, v in local.model.state_dict().items()}
    tasks = om.load_tasks("countdown", "train", 2)
    kw = dict(strategy="react", seed=5, max_depth=1,
              sampling=SamplingParams(temperature=0.0, max_tokens=8))
    spec = f"hf:{tiny_agent_model}:dtype=float32"
    want = _steps(om.search_many(tasks, policy=local, **kw))

    stale = _steps(om.search_many(tasks, policy=spec, executor="ray:workers=1", **kw))
    assert not _same(stale, want)  # the perturbation shows: a skipped push fails below
    pushed = _steps(om.search_many(tasks, policy=spec, executor="ray:workers=1",
                                   policy_weights=(1, state), **kw))
    assert _same(pushed, want)

    bad = {"model.nope.weight": torch.zeros(1)}
    with pytest.raises(PolicyError, match=r"^policy_weights do not fit the workers' LlamaForCausalLM: "
                                          r"missing \[.*unexpected \['model.nope.weight'\]$"):
        om.search_many(tasks, policy=spec, executor="ray:workers=1", policy_weights=(2, bad), **kw)


def test_online_grpo_on_ray_samples_with_the_trainers_weights(tiny_agent_model, tmp_path):
    """Two rounds on one Ray actor: each pushes the current weights (versions 0, 1); the
    behaviour logprobs the actor records are the trainer's own on the same ids, though every
    step moved the weights away from the base model's that the actor's spec loads."""
    # unconstrained, every group kept (flat on the random model): the subject is the weights
    cfg = grpo.GRPOConfig(model=tiny_agent_model, out=str(tmp_path / "o"), lr=1e-2, max_steps=2,
                          progress=False, dynamic_sampling=False,
                          online={"env": "countdown", "tasks_per_round": 2, "constrain": "none",
                                  "strategy": "best_of_n:n=3", "max_tokens": 8,
                                  "max_depth": 1, "executor": "ray:workers=1"})
    runner = grpo.build(cfg)
    gen = torch.Generator().manual_seed(2)

    def nudge(r, _metrics):  # the tiny random policy's rewards are flat: its own steps barely move it
        with torch.no_grad():
            for p in r.module.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen))

    runner.on_step = nudge
    runner.train()
    logged = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in logged] == [1.0, 2.0] and logged[-1]["policy_version"] == 2
    assert [m["pushed_version"] for m in logged] == [0.0, 1.0]
    assert all(m["rollout_rows"] == 6 and math.isfinite(m["loss"]) for m in logged)
    assert all(m["approx_kl"] < 1e-6 for m in logged)  # round 2 sampled with the nudged weights

    runner.source.pending = []
    batch = runner.collate(runner.source.next_batch(runner))  # a round from the trained weights
    m = batch["loss_mask"].bool()
    with torch.no_grad():
        lp = policy_logprobs(runner.module, batch)
        base = policy_logprobs(HFPolicy(tiny_agent_model, device="cpu", dtype="float32").model, batch)
    assert torch.allclose(lp[m], batch["old_logprobs"][m], atol=1e-4)
    assert not torch.allclose(base[m], batch["old_logprobs"][m], atol=1e-4)


def test_bad_settings_are_one_clear_line(tiny_agent_model, tmp_path):
    with pytest.raises(PolicyError, match=r"^policy_weights need a policy with torch weights \('hf:PATH'\), "
                                          r"not OraclePolicy$"):
        om.search_many(om.load_tasks("countdown", "train", 1), policy="scripted:oracle",
                       executor="ray:workers=1", policy_weights=(0, {}))
    with pytest.raises(TrainError, match=r"online.executor: .*unknown executor 'dask'"):
        grpo.GRPOConfig.from_sources(None, ["online.executor=dask"])
    cfg = grpo.GRPOConfig(model=tiny_agent_model, out=str(tmp_path), max_steps=1,
                          online={"env": "countdown", "ray_address": "auto"})
    with pytest.raises(TrainError, match=r"^online.ray_address needs online.executor=ray"):
        grpo.build(cfg)


def test_live_weights_are_the_plain_lm_lora_merged(tiny_agent_model, tmp_path):
    """What is pushed fits a plain model of the base architecture and computes what the trained
    model computes: a LoRA model's merged weights (its adapter untouched), PPO's ``lm``."""
    from transformers import AutoModelForCausalLM

    from train.config import LoraSettings
    from train.ppo import value_model
    from train.runtime import apply_lora

    def plain():
        return AutoModelForCausalLM.from_pretrained(tiny_agent_model, dtype=torch.float32)

    lora = apply_lora(plain(), LoraSettings(r=4))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(0.5 * torch.randn(p.shape, generator=gen))
    before = {k: v.clone() for k, v in lora.state_dict().items()}
    ids = torch.arange(10, 40).unsqueeze(0)
    for trained in (lora, value_model(lora)):
        pushed = plain()
        pushed.load_state_dict(grpo.live_weights(trained))  # strict: exactly the plain model's keys
        with torch.no_grad():
            want, got = lora(input_ids=ids).logits, pushed(input_ids=ids).logits
            assert not torch.allclose(plain()(input_ids=ids).logits, want, atol=1e-4)
        assert torch.allclose(got, want, atol=1e-4)
    assert all(torch.equal(before[k], v) for k, v in lora.state_dict().items())
