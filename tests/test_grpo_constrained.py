"""PPO/GRPO on grammar-constrained samples: the sampler records logprobs of the masked,
renormalised distribution; the trainer rebuilds each step's mask from the grammar exported with
its segment, so the importance ratio is exactly 1 at the first update (every layout, both
trainers), and without the masks it is not (the test can fail)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("xgrammar")

from omrl_search.agent import ReActFormat  # noqa: E402
from omrl_search.backends.hf import HFPolicy  # noqa: E402
from omrl_search.types import GenRequest, SamplingParams  # noqa: E402
from train import grpo, ppo  # noqa: E402
from train.common import grammar_masks, layout_collate, make_builder, pad_id, policy_logprobs  # noqa: E402
from train.data import collate  # noqa: E402
from train.packing import model_logprobs  # noqa: E402
from train.runtime import load_model  # noqa: E402

ACTIONS = ["1 + 2", "3 * 4", "answer (1 + 2) * 8", "12 - 5", "6 / 3"]


@pytest.fixture(scope="module")
def samples(tiny_agent_model):
    """Six completions of one prompt sampled under an action grammar at temperature 1.3."""
    pol = HFPolicy(tiny_agent_model, device="cpu", dtype="float32")
    grammar = ReActFormat().grammar("actions", ACTIONS, "test")
    msgs = [{"role": "system", "content": "Solve the task."}, {"role": "user", "content": "Numbers: 1 2 3 4"}]
    prompt = pol.tokenizer.encode(pol.tokenizer.render(msgs, add_generation_prompt=True))
    req = GenRequest(msgs, SamplingParams(temperature=1.3, max_tokens=24, n=6, seed=3),
                     prompt_ids=prompt, grammar=grammar)
    gens = pol.generate([req])[0]
    assert all(g.constrained for g in gens)
    return prompt, gens, grammar


def _rows(samples, builder, grammar_field=True):
    prompt, gens, grammar = samples
    rows = []
    for i, g in enumerate(gens):
        segs = [{"role": "context", "token_ids": prompt, "logprobs": None, "trainable": False},
                {"role": "assistant", "token_ids": g.token_ids, "logprobs": g.logprobs, "trainable": True,
                 "grammar": grammar.to_record() if grammar_field else None}]
        row = builder.from_segments(segs)
        row.reward, row.group = float(i % 2), 0
        rows.append(row)
    return grpo.assign_advantages(rows, "grpo")


@pytest.mark.parametrize("layout", ["padded", "packed", "shared-prefix", None])
def test_ratio_is_one_on_constrained_samples(samples, tiny_agent_model, layout):
    cfg = grpo.GRPOConfig(model=tiny_agent_model, out="unused", layout=layout or "padded",
                          online={"env": "countdown"})
    runner_model, tok = load_model(cfg)
    runner_model.eval()
    builder = make_builder(cfg, runner_model, tok)
    rows = _rows(samples, builder)
    masks = grammar_masks(runner_model, tok)
    if layout is None:  # the plain full-logits path (no layout keys)
        def collate_fn(xs):
            b = collate(xs, pad_id(tok))
            b.update({k: v for k, v in masks(xs).items() if k != "stats"})
            return b
    else:
        collate_fn = layout_collate(cfg, pad_id(tok), masks=masks)
    batch = collate_fn(rows)
    assert int(batch["grammar_at"].shape[0]) == sum(len(g.token_ids) for g in samples[1])
    m = batch["loss_mask"].bool()
    with torch.no_grad():
        lp = policy_logprobs(runner_model, batch)
        ratio = torch.exp(lp - batch["old_logprobs"])[m]
        assert (ratio - 1).abs().max() < 1e-5
        loss, metrics = grpo.policy_loss(cfg, None, runner_model, batch, batch["advantages"])
    assert metrics["approx_kl"] < 1e-9 and metrics["clip_frac"] == 0.0
    assert metrics.get("grammar_unmatched", 0.0) == 0.0
    # the same rows without their grammar: plain log-softmax, the ratio is off
    plain = layout_collate(cfg, pad_id(tok))(_rows(samples, builder, grammar_field=False))
    with torch.no_grad():
        off = torch.exp(policy_logprobs(runner_model, plain) - plain["old_logprobs"])[m]
    assert (off - 1).abs().max() > 1e-2


def test_ppo_value_trainer_reads_the_masked_logprobs(samples, tiny_agent_model):
    cfg = ppo.PPOConfig(model=tiny_agent_model, out="unused", online={"env": "countdown"})
    lm, tok = load_model(cfg)
    lm.eval()
    model = ppo.value_model(lm)
    rows = _rows(samples, make_builder(cfg, lm, tok))
    batch = grpo.with_stats(None, cfg, pad_id(tok), grammar_masks(lm, tok))(rows)
    with torch.no_grad():
        lp, _ = model_logprobs(model.lm, batch, hidden=True)
        _, metrics = ppo.ppo_loss_fn(cfg, None)(model, batch)
    m = batch["loss_mask"].bool()
    assert (torch.exp(lp - batch["old_logprobs"])[m] - 1).abs().max() < 1e-5
    assert metrics["approx_kl"] < 1e-9


def _engine_records_grammar(model_dir) -> bool:
    import omrl_search as om

    res = om.search_many(om.load_tasks("countdown", "train", 1), strategy="best_of_n:n=2",
                         policy=HFPolicy(model_dir, device="cpu", dtype="float32"), constrain="actions",
                         max_depth=1, sampling=SamplingParams(temperature=1.0, max_tokens=16), seed=0)
    return any(n.step is not None and n.step.grammar for r in res for n in r.tree.nodes)


def test_online_grpo_samples_under_the_grammar_and_starts_at_ratio_one(tiny_agent_model, tmp_path):
    """Online GRPO's default: constrained sampling (the env's grammar); every round's first
    update sees ratio 1 on the masked logprobs, every constrained token's mask rebuilt."""
    if not _engine_records_grammar(tiny_agent_model):
        pytest.skip("the engine does not set Step.grammar yet (omrl_search/engine.py)")
    import json

    cfg = grpo.GRPOConfig(model=tiny_agent_model, out=str(tmp_path / "o"), lr=1e-2, max_steps=2,
                          progress=False, dynamic_sampling=False,
                          online={"env": "countdown", "tasks_per_round": 2, "strategy": "best_of_n:n=3",
                                  "max_tokens": 24, "max_depth": 1})
    assert cfg.online.constrain == "auto"
    grpo.build(cfg).train()
    logged = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert len(logged) == 2
    for m in logged:
        assert m["grammar_tokens"] > 0 and m["grammar_unmatched"] == 0
        assert m["approx_kl"] < 1e-6 and m["clip_frac"] == 0.0


def test_constrained_samples_without_a_recorded_grammar_are_refused():
    from types import SimpleNamespace

    from train.runtime import TrainError

    step = SimpleNamespace(grammar=None)
    res = SimpleNamespace(constraint={"actions": 3}, tree=SimpleNamespace(nodes=[SimpleNamespace(step=step)]))
    with pytest.raises(TrainError, match="online.constrain=none"):
        grpo.check_grammars_recorded([res])
    step.grammar = {"kind": "actions"}
    grpo.check_grammars_recorded([res])
    grpo.check_grammars_recorded([SimpleNamespace(constraint={}, tree=SimpleNamespace(nodes=[]))])
