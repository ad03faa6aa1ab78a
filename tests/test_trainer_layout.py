"""Trainers compute what the loss needs (train/packing.py), on a tiny random Llama saved and
reloaded with ``from_pretrained`` (fp32): packed and prefix-shared rows give every sequence the
log-probabilities it has alone (1e-5), every trainer's loss and gradients equal the full-logits
padded path's (1e-4), and the LM head runs only where a loss token is predicted."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

import omrl_search as om  # noqa: E402
from omrl_search.exports import export  # noqa: E402
from train import dpo, grpo, ppo, sft  # noqa: E402
from train.common import make_builder, pad_id  # noqa: E402
from train.data import collate, load_dpo  # noqa: E402
from train.packing import LAYOUTS, add_layout, model_logprobs  # noqa: E402
from train.runtime import TrainConfig  # noqa: E402

LAYOUT_KEYS = ("model_inputs", "index")


@pytest.fixture(scope="module")
def data(tiny_agent_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("layout_data")
    results = om.search_many(om.load_tasks("game24", "train", limit=4), strategy="best_of_n:n=3",
                             policy="scripted:oracle:p=0.4", seed=0)
    om.write_results(d / "results.jsonl", results)
    for kind in ("sft", "dpo", "grpo"):
        export(kind, [d / "results.jsonl"], d / f"{kind}.parquet", tokenizer=tiny_agent_model)
    return d


@pytest.fixture(scope="module")
def rows(tiny_agent_model, data):
    """Chosen and rejected sequences of DPO pairs (pairs share their prompt; every pair shares
    the env's instructions with the others), in pair order."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_agent_model)
    tok = AutoTokenizer.from_pretrained(tiny_agent_model)
    pairs = load_dpo([data / "dpo.parquet"], make_builder(TrainConfig(max_length=4096), model, tok))
    return [r for p in pairs[:3] for r in (p.chosen, p.rejected)], pad_id(tok)


def _model(path, attn="sdpa"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("layout,pack_tokens", [("packed", 4096), ("packed", 300),
                                                 ("shared-prefix", 4096), ("shared-prefix", 300)])
def test_packed_rows_give_each_sequence_its_own_logprobs(layout, pack_tokens, attn, tiny_agent_model, rows):
    seqs, pid = rows
    model = _model(tiny_agent_model, attn)
    batch = add_layout(collate(seqs, pid), layout, pack_tokens)
    R, N = batch["model_inputs"]["input_ids"].shape
    if pack_tokens == 300:
        assert R > 1  # several packed rows
    total = sum(len(r.input_ids) for r in seqs)
    held = batch["index"][batch["index"] >= 0].unique().numel()  # tokens the model runs
    if layout == "packed":  # every token up to each sequence's last loss token, once
        assert held == sum(len(r.loss_mask) - 1 - r.loss_mask[::-1].index(1) for r in seqs)
    elif pack_tokens > 1000:
        assert R <= len(seqs) // 2 and held < 0.6 * total  # pairs share rows, prompts held once
    with torch.no_grad():
        lp, _ = model_logprobs(model, batch)
        for b, row in enumerate(seqs):
            alone, _ = model_logprobs(model, collate([row], pid))  # the plain path, one sequence
            m = torch.tensor(row.loss_mask, dtype=torch.bool)
            assert torch.allclose(lp[b, :len(m)][m], alone[0][m], atol=1e-5, rtol=0)
            assert lp[b, :len(m)][~m].abs().max() == 0  # nothing outside the loss tokens


def test_dataset_packed_rows_keep_sequences_apart(tiny_agent_model, rows):
    from train.data import collate_packed, pack

    seqs, pid = rows
    model = _model(tiny_agent_model)
    packed = pack(seqs[:4], max_length=sum(len(r.input_ids) for r in seqs[:4]))
    assert len(packed) == 1
    with torch.no_grad():
        plain, _ = model_logprobs(model, collate_packed(packed, pid))  # block mask, full logits
        laid, _ = model_logprobs(model, add_layout(collate_packed(packed, pid), "padded", 0))
        start = 0
        for row in seqs[:4]:  # pack keeps input order inside a bin
            n = len(row.input_ids)
            alone, _ = model_logprobs(model, collate([row], pid))
            m = torch.tensor(row.loss_mask, dtype=torch.bool)
            assert torch.allclose(plain[0, start:start + n][m], alone[0][m], atol=1e-5, rtol=0)
            assert torch.allclose(laid[0, start:start + n][m], alone[0][m], atol=1e-5, rtol=0)
            start += n


def _loss_and_grads(runner, batch):
    model = runner.module
    model.zero_grad(set_to_none=True)
    loss, _ = runner.loss_fn(model, batch)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


KINDS = {"sft": (sft, sft.SFTConfig, "sft", {}),
         "dpo": (dpo, dpo.DPOConfig, "dpo", {"reference": "model", "loss": "ipo"}),
         "grpo": (grpo, grpo.GRPOConfig, "grpo", {"kl_coef": 0.1, "agg": "seq-mean-token-mean"}),
         "ppo": (ppo, ppo.PPOConfig, "grpo", {"vf_coef": 1.0})}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_losses_and_gradients_equal_the_full_logits_path(kind, layout, tiny_agent_model, data, tmp_path):
    mod, cls, file, extra = KINDS[kind]
    runner = mod.build(cls(model=tiny_agent_model, data=[str(data / f"{file}.parquet")],
                           out=str(tmp_path / "o"), batch_size=3, max_steps=1, progress=False,
                           layout=layout, pack_tokens=700, **extra))
    if kind == "ppo":  # a non-zero head, so values and their gradients are not trivially 0
        torch.nn.init.normal_(runner.module.v_head.weight, std=0.1)
    items = runner.source.examples[:3]
    laid = runner.collate(items)
    plain = {k: v for k, v in laid.items() if k not in LAYOUT_KEYS}
    loss, grads = _loss_and_grads(runner, laid)
    want, want_grads = _loss_and_grads(runner, plain)
    assert loss == pytest.approx(want, abs=1e-4, rel=1e-4)
    assert torch.allclose(grads, want_grads, atol=1e-4, rtol=1e-3)
    assert grads.abs().max() > 0


class _Capture(torch.nn.Module):
    """Records what the model was asked for and the logits it gave (keeping their gradient)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.kept, self.logits = model, None, None

    def forward(self, **kw):
        out = self.model(**kw)
        self.kept = kw.get("logits_to_keep")
        out.logits.retain_grad()
        self.logits = out.logits
        return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_head_runs_only_where_a_loss_token_is_predicted(layout, tiny_agent_model, data, tmp_path):
    runner = sft.build(sft.SFTConfig(model=tiny_agent_model, data=[str(data / "sft.parquet")],
                                     out=str(tmp_path / "o"), batch_size=2, progress=False,
                                     layout=layout))
    batch = runner.collate(runner.source.examples[:2])
    cap = _Capture(runner.module)
    loss, _ = runner.loss_fn(cap, batch)
    loss.backward()
    n_loss = int(batch["loss_mask"][:, 1:].sum())
    grad = cap.logits.grad.reshape(-1, cap.logits.shape[-1])
    assert int(cap.kept.sum()) == grad.shape[0] == n_loss  # one logit row per loss token
    assert bool((grad.abs().amax(-1) > 0).all())
    assert grad.shape[0] < 0.5 * int(batch["n_tokens"])  # far fewer than all positions


class _NoKeep(torch.nn.Module):
    """A causal LM whose forward knows no ``logits_to_keep`` (``strict``: refuses it; else drops
    it silently): it returns logits at every position."""

    def __init__(self, model, strict):
        super().__init__()
        self.model, self.strict, self.config = model, strict, model.config

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None,
                output_hidden_states=None, **kw):
        if self.strict and kw:
            raise TypeError(f"forward() got an unexpected keyword argument {next(iter(kw))!r}")
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=use_cache, output_hidden_states=output_hidden_states)


@pytest.mark.parametrize("strict", [True, False])
def test_a_model_without_logits_to_keep_gets_the_same_logprobs(strict, tiny_agent_model, rows):
    seqs, pid = rows
    model = _model(tiny_agent_model)
    batch = add_layout(collate(seqs[:2], pid), "shared-prefix", 4096)
    with torch.no_grad():
        want, _ = model_logprobs(model, batch)
        got, _ = model_logprobs(_NoKeep(model, strict), batch)
    assert torch.equal(got, want)
