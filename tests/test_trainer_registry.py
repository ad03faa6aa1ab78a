"""Configs choose losses by name and the trainers use what the registries of ``train.losses``
hold: for each name, the trainer's loss (or row advantages) equals the registered pure function
called directly, the names give different results, a newly registered name is usable from a
config at once, and an unknown name fails when the config is built, listing the known names."""
from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

import omrl_search as om  # noqa: E402
from omrl_search.exports import export  # noqa: E402
from train import dpo, grpo, ppo, sft  # noqa: E402
from train import losses as L  # noqa: E402
from train.common import policy_logprobs  # noqa: E402
from train.runtime import TrainError  # noqa: E402


@pytest.fixture(scope="module")
def data(tiny_agent_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("registry_data")
    results = om.search_many(om.load_tasks("game24", "train", limit=4), strategy="best_of_n:n=3",
                             policy="scripted:oracle:p=0.4", seed=0)
    om.write_results(d / "results.jsonl", results)
    for kind in ("sft", "dpo", "grpo"):
        export(kind, [d / "results.jsonl"], d / f"{kind}.parquet", tokenizer=tiny_agent_model)
    return d


def _build(mod, cls, model, data, kind, tmp_path, **kw):
    cfg = cls(model=model, data=[str(data / f"{kind}.parquet")], out=str(tmp_path / "o"),
              batch_size=2, max_steps=1, progress=False, **kw)
    return mod.build(cfg)


def _all_differ(values):
    return all(abs(a - b) > 1e-4 for a, b in itertools.combinations(values, 2))


@pytest.fixture
def extra_name():
    """Registers test entries and removes them afterwards."""
    added = []

    def add(registry, name, fn, **attrs):
        registry.register(name, **attrs)(fn)
        added.append((registry, name))
    yield add
    for registry, name in added:
        del registry[name]


def test_each_aggregation_reaches_sft_and_grpo(tiny_agent_model, data, tmp_path, extra_name):
    extra_name(L.AGGREGATIONS, "test-max", lambda loss, mask, norm=None: (loss * mask).max())
    got = {}
    for name in L.AGGREGATIONS:
        runner = _build(sft, sft.SFTConfig, tiny_agent_model, data, "sft", tmp_path, agg=name)
        batch = runner.collate(runner.source.examples[:3])
        with torch.no_grad():
            loss, _ = runner.loss_fn(runner.module, batch)
            lp = policy_logprobs(runner.module, batch)
        want = L.AGGREGATIONS[name](-lp, batch["loss_mask"], None)
        assert loss.item() == pytest.approx(want.item(), abs=1e-6)
        got[name] = loss.item()
    assert got["test-max"] == pytest.approx(float((-lp * batch["loss_mask"]).max()), abs=1e-6)
    assert _all_differ(got.values())
    per_grpo = []
    for name in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        runner = _build(grpo, grpo.GRPOConfig, tiny_agent_model, data, "grpo", tmp_path, agg=name)
        rows = [r for r in runner.source.examples if r.advantage != 0][:3]
        batch = runner.collate(rows)
        with torch.no_grad():
            loss, _ = runner.loss_fn(runner.module, batch)
            lp = policy_logprobs(runner.module, batch)
        # on-policy rows (no behaviour logprobs): ratio 1, per-token loss = -advantage
        per_token = -batch["advantages"].unsqueeze(-1).expand_as(lp)
        want = L.AGGREGATIONS[name](per_token, batch["loss_mask"], None)
        assert loss.item() == pytest.approx(want.item(), abs=1e-6)
        per_grpo.append(loss.item())
    assert _all_differ(per_grpo)


def test_each_dpo_loss_reaches_the_trainer(tiny_agent_model, data, tmp_path):
    got = []
    for name in L.DPO_LOSSES:
        runner = _build(dpo, dpo.DPOConfig, tiny_agent_model, data, "dpo", tmp_path, loss=name, beta=0.5,
                        rpo_alpha=0.0)  # the pure DPO loss (no NLL term)
        batch = runner.collate(runner.source.examples[:2])
        g = torch.Generator().manual_seed(0)
        batch["ref_logps"] = batch["ref_logps"] + torch.randn(4, generator=g)  # a non-zero margin
        with torch.no_grad():
            loss, _ = runner.loss_fn(runner.module, batch)
            lp = policy_logprobs(runner.module, batch)
        mask = batch["loss_mask"]
        seq = (lp * mask).sum(-1)
        if name == "ipo":
            seq = seq / mask.sum(-1)  # IPO's entry asks for per-token mean logprobs
        c, r = seq.chunk(2)
        rc, rr = batch["ref_logps"].chunk(2)
        want = L.DPO_LOSSES[name]((c - rc) - (r - rr), beta=0.5, label_smoothing=0.0).mean()
        assert loss.item() == pytest.approx(want.item(), rel=1e-5)
        got.append(loss.item())
    assert _all_differ(got)


def test_each_advantage_estimator_reaches_grpo_and_ppo(tiny_agent_model, data, tmp_path, extra_name):
    extra_name(L.ADVANTAGES, "test-ones", lambda rewards, group_ids: torch.ones_like(rewards))
    per_name = {}
    for name in ("grpo", "dr-grpo", "rloo", "test-ones"):
        runner = _build(grpo, grpo.GRPOConfig, tiny_agent_model, data, "grpo", tmp_path, advantage=name)
        rows = runner.source.examples
        want = L.ADVANTAGES[name](torch.tensor([r.reward for r in rows]), torch.tensor([r.group for r in rows]))
        assert [r.advantage for r in rows] == pytest.approx(want.tolist(), abs=1e-6)
        per_name[name] = [r.advantage for r in rows]
    assert per_name["test-ones"] == [1.0] * len(per_name["grpo"])
    for a, b in itertools.combinations(per_name.values(), 2):
        assert a != pytest.approx(b, abs=1e-4)
    with_head = _build(ppo, ppo.PPOConfig, tiny_agent_model, data, "grpo", tmp_path)
    assert with_head.cfg.advantage == "gae" and hasattr(with_head.module, "v_head")
    groups = _build(ppo, ppo.PPOConfig, tiny_agent_model, data, "grpo", tmp_path, advantage="rloo")
    assert not hasattr(groups.module, "v_head")
    assert [r.advantage for r in groups.source.examples] == pytest.approx(per_name["rloo"], abs=1e-6)


@pytest.mark.parametrize("cls,key,value,message", [
    (sft.SFTConfig, "agg", "sum",
     "agg: Value error, unknown loss aggregation 'sum' (one of token-mean, seq-mean-token-mean, "
     "seq-mean-token-sum-norm)"),
    (grpo.GRPOConfig, "agg", "mean", "agg: Value error, unknown loss aggregation 'mean' (one of"),
    (dpo.DPOConfig, "loss", "kto", "loss: Value error, unknown DPO loss 'kto' (one of sigmoid, hinge, ipo)"),
    (grpo.GRPOConfig, "advantage", "ppo",
     "advantage: Value error, unknown advantage estimator 'ppo' (one of grpo, dr-grpo, rloo, gae)"),
    (grpo.GRPOConfig, "advantage", "gae", "advantage: Value error, advantage 'gae' needs a value model"),
])
def test_an_unknown_name_fails_when_the_config_is_built(cls, key, value, message, tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text(f"{key}: {value}\n")
    with pytest.raises(TrainError) as err:
        cls.from_sources(str(y))
    assert str(err.value).startswith(f"{y}: {message}")
    assert "\n" not in str(err.value)
    assert ppo.PPOConfig.from_sources(None, {"advantage": "gae"}).advantage == "gae"


def test_every_trainer_the_cli_offers_is_registered():
    from train.cli import HELP
    from train.trainers import TRAINERS

    assert list(HELP) == list(TRAINERS)
    assert TRAINERS["dpo"].config is dpo.DPOConfig and TRAINERS["ppo"].train is ppo.train
