"""Losses and advantages on random tensors: hand-checked formulas, and parity with TRL where TRL
computes the same thing (TRL is a test-only dependency: those tests skip without it)."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from train import losses as L  # noqa: E402


def _mask(B: int, T: int, seed: int = 0) -> "torch.Tensor":
    """A loss mask like real data: prompt first, then assistant runs split by observations."""
    g = torch.Generator().manual_seed(seed)
    m = (torch.rand(B, T, generator=g) > 0.35).float()
    m[:, :3] = 0
    m[0, -4:] = 0  # trailing padding
    return m


# --- hand-checked formulas ------------------------------------------------------------------------
def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 40.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert L.aggregate(loss, mask, "token-mean").item() == pytest.approx((2 + 3 + 10) / 3)
    assert L.aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2.5 + 10) / 2)
    assert L.aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((5 / 4 + 10 / 4) / 2)
    assert L.aggregate(loss, mask, "seq-mean-token-sum-norm", norm=8).item() == pytest.approx((5 / 8 + 10 / 8) / 2)
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        L.aggregate(loss, mask, "sum")


def test_sequence_logprobs_match_log_softmax_and_nll_ignores_masked_tokens():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 6, 11, generator=g)
    ids = torch.randint(0, 11, (2, 6), generator=g)
    lp = L.sequence_logprobs(logits, ids)
    ref = torch.log_softmax(logits, -1)
    assert lp[:, 0].abs().max() == 0
    for b in range(2):
        for t in range(1, 6):
            assert lp[b, t].item() == pytest.approx(ref[b, t - 1, ids[b, t]].item(), abs=1e-5)
    mask = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 0, 0, 0, 0]], dtype=torch.float32)
    want = -(lp[0, 2] + lp[0, 3] + lp[0, 5] + lp[1, 1]) / 4
    assert L.nll_loss(lp, mask).item() == pytest.approx(want.item(), abs=1e-6)
    changed = ids.clone()
    changed[0, 4] = (changed[0, 4] + 1) % 11  # an observation token: the loss must not move
    assert L.nll_loss(L.sequence_logprobs(logits, changed), mask).item() == pytest.approx(want.item(), abs=1e-6)


def test_group_advantages_any_sizes_and_order():
    rewards = torch.tensor([1.0, 0.0, 5.0, 1.0, 3.0, 7.0, 2.0])
    groups = torch.tensor([4, 4, 9, 4, 9, 2, 9])  # sizes 3, 3 and 1, interleaved
    adv = L.group_advantages(rewards, groups)
    for gid in (4, 9):
        idx = (groups == gid).nonzero().squeeze(-1)
        r = rewards[idx]
        want = (r - r.mean()) / (r.std() + 1e-6)
        assert torch.allclose(adv[idx], want, atol=1e-5)
    assert adv[5].item() == 0.0  # a group of one has no baseline
    flat = L.group_advantages(torch.tensor([2.0, 2.0, 2.0]), torch.tensor([0, 0, 0]))
    assert flat.abs().max().item() == 0.0
    centred = L.group_advantages(rewards, groups, scale="none")
    assert centred[0].item() == pytest.approx(1 - 2 / 3, abs=1e-6)


def test_gae_skips_observation_tokens():
    """GAE over a sequence with observation tokens inserted (mask 0) equals GAE over the same
    sequence with them removed: they neither discount nor bootstrap."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 1, 1]], dtype=torch.float32)
    values = torch.randn(1, 12, generator=g)
    rewards = torch.zeros(1, 12)
    rewards[0, 3], rewards[0, 11] = 0.5, 1.0
    adv, ret = L.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    keep = mask[0].bool()
    a2, r2 = L.gae(rewards[:, keep], values[:, keep], torch.ones(1, int(keep.sum())), gamma=0.9, lam=0.8)
    assert torch.allclose(adv[0, keep], a2[0], atol=1e-6)
    assert torch.allclose(ret[0, keep], r2[0], atol=1e-6)
    assert adv[0, ~keep].abs().max() == 0
    # the plain recursion by hand on the kept tokens
    v, r = values[0, keep].tolist(), rewards[0, keep].tolist()
    last, want = 0.0, []
    for t in reversed(range(len(v))):
        nv = v[t + 1] if t + 1 < len(v) else 0.0
        last = r[t] + 0.9 * nv - v[t] + 0.9 * 0.8 * last
        want.append(last)
    assert a2[0].tolist() == pytest.approx(list(reversed(want)), abs=1e-5)


def test_clip_loss_behaviour():
    lp = torch.tensor([[0.0, -1.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    adv = torch.tensor([1.0])
    loss, stats = L.clip_policy_loss(lp, lp.clone(), adv, mask)
    assert loss.item() == pytest.approx(-1.0)  # ratio 1: minus the advantage
    assert stats["clip_frac"].item() == 0 and stats["approx_kl"].item() == 0
    old = lp - 1.0  # ratio e > 1 + clip_high: clipped for a positive advantage
    loss, stats = L.clip_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.3)
    assert loss.item() == pytest.approx(-1.3) and stats["clip_frac"].item() == 1.0
    loss, _ = L.clip_policy_loss(lp, old, -adv, mask)  # negative advantage: no clip upwards
    assert loss.item() == pytest.approx(math.e)
    assert L.kl_k3(lp, lp).abs().max() == 0
    assert (L.kl_k3(torch.randn(50), torch.randn(50)) >= 0).all()


def test_value_loss_clips_large_moves():
    v, old, ret = torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[3.0]])
    m = torch.ones(1, 1)
    assert L.value_loss(v, old, ret, m, clip=None).item() == pytest.approx(0.5)
    assert L.value_loss(v, old, ret, m, clip=0.5).item() == pytest.approx(0.5 * 2.5 ** 2)


def test_dpo_kinds_by_hand_and_registry():
    c, r, rc, rr = (torch.tensor([x]) for x in (-1.0, -3.0, -2.0, -2.0))
    loss, cw, rw = L.dpo_loss(c, r, rc, rr, beta=0.5)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))))
    assert (cw.item(), rw.item()) == (0.5, -0.5)
    assert L.dpo_loss(c, r, rc, rr, beta=0.5, kind="hinge")[0].item() == pytest.approx(0.0)
    assert L.dpo_loss(c, r, rc, rr, beta=0.5, kind="ipo")[0].item() == pytest.approx((2 - 1) ** 2)
    with pytest.raises(ValueError, match=r"unknown DPO loss 'kto' \(one of sigmoid, hinge, ipo"):
        L.dpo_loss(c, r, rc, rr, kind="kto")


def test_registries_name_the_functions_and_list_known_names_on_a_miss():
    assert L.DPO_LOSSES["ipo"] is L.dpo_ipo and L.dpo_ipo.mean_logps
    assert not getattr(L.DPO_LOSSES["sigmoid"], "mean_logps", False)
    assert L.ADVANTAGES["grpo"] is L.group_advantages and L.ADVANTAGES["gae"] is L.gae
    assert L.gae.needs_values and not getattr(L.ADVANTAGES["rloo"], "needs_values", False)
    assert list(L.AGGREGATIONS) == ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
    for reg, what in ((L.AGGREGATIONS, "loss aggregation"), (L.DPO_LOSSES, "DPO loss"),
                      (L.ADVANTAGES, "advantage estimator")):
        with pytest.raises(ValueError) as err:
            reg.check("nosuch")
        assert str(err.value) == f"unknown {what} 'nosuch' (one of {', '.join(reg)})"
        assert "nosuch" not in reg  # a miss adds nothing


def test_dr_grpo_and_rloo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 5.0, 2.0, 3.0, 7.0])
    groups = torch.tensor([4, 4, 9, 4, 9, 2])  # sizes 3, 2 and 1
    dr = L.ADVANTAGES["dr-grpo"](rewards, groups)
    assert dr.tolist() == pytest.approx([0.0, -1.0, 1.0, 1.0, -1.0, 0.0])
    rloo = L.ADVANTAGES["rloo"](rewards, groups)  # minus the mean of the others in the group
    assert rloo.tolist() == pytest.approx([1 - 1.0, 0 - 1.5, 5 - 3.0, 2 - 0.5, 3 - 5.0, 0.0])
    # RLOO is the mean-centred advantage scaled by n / (n - 1)
    assert rloo[:2].tolist() == pytest.approx((dr[:2] * 3 / 2).tolist())


# --- parity with TRL --------------------------------------------------------------------------------
class _Acc:
    device = "cpu"
    num_processes = 1
    sync_gradients = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def test_token_logprobs_match_trl_selective_log_softmax():
    pytest.importorskip("trl")
    from trl.trainer.utils import selective_log_softmax

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 7, 50, generator=g)
    ids = torch.randint(0, 50, (3, 7), generator=g)
    assert torch.allclose(L.token_logprobs(logits, ids), selective_log_softmax(logits, ids), atol=1e-5)


def test_nll_matches_transformers_causal_lm_loss():
    """TRL's SFT loss is the model's own causal-LM loss over labels not equal to -100."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 9, 30, generator=g)
    ids = torch.randint(0, 30, (2, 9), generator=g)
    mask = _mask(2, 9)
    ours = L.nll_loss(L.sequence_logprobs(logits, ids), mask)
    theirs = ForCausalLMLoss(logits, ids.masked_fill(mask == 0, -100), vocab_size=30)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "hinge"])
def test_dpo_matches_trl(kind):
    pytest.importorskip("trl")
    from trl.trainer.dpo_trainer import DPOTrainer

    B, T, beta = 4, 10, 0.3
    g = torch.Generator().manual_seed(7)
    mask = _mask(2 * B, T, seed=8)
    per_token = -torch.rand(2 * B, T, generator=g) * 3  # the policy's token logprobs
    ref_tok = -torch.rand(2 * B, T, generator=g) * 3
    shift = mask[:, 1:]
    # TRL's model returns log-probs of the labels (0 where the label is -100), shifted by one
    out = SimpleNamespace(log_probs=per_token[:, 1:] * shift, entropy=torch.zeros(2 * B, T - 1),
                          mean_logits=torch.zeros(2 * B, T - 1),
                          is_top1=torch.zeros(2 * B, T - 1, dtype=torch.bool))
    mean = kind == "ipo"  # TRL normalises IPO by the completion length; we take mean logps
    ref_sum = (ref_tok * mask).sum(-1)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Acc(), aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=True, f_divergence_type="reverse_kl",
        loss_types=[kind], loss_weights=[1.0], beta=beta, label_smoothing=0.0, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros(2 * B, T, dtype=torch.long), "attention_mask": torch.ones(2 * B, T),
              "completion_mask": mask, "ref_chosen_logps": ref_sum[:B], "ref_rejected_logps": ref_sum[B:]}
    theirs = DPOTrainer._compute_loss(fake, lambda **kw: out, inputs, False)

    def seq(t):
        s = (t * mask).sum(-1)
        return s / mask.sum(-1) if mean else s

    pol, ref = seq(per_token), seq(ref_tok)
    ours, _, _ = L.dpo_loss(pol[:B], pol[B:], ref[:B], ref[B:], beta=beta, kind=kind)
    assert ours.mean().item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("trl_type,agg", [("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"),
                                          ("dr_grpo", "seq-mean-token-sum-norm")])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_clip_loss_matches_trl_grpo(trl_type, agg, beta):
    pytest.importorskip("trl")
    from trl.trainer.grpo_trainer import GRPOTrainer

    B, P, C = 6, 3, 8
    g = torch.Generator().manual_seed(9)
    lp = -torch.rand(B, C, generator=g) * 2
    old = lp + torch.randn(B, C, generator=g) * 0.3  # ratios both inside and outside the clip
    ref = lp + torch.randn(B, C, generator=g) * 0.2
    cmask = _mask(B, C, seed=10)
    cmask[:, :3] = torch.tensor([1.0, 1.0, 0.0])  # completions start right away
    adv = torch.randn(B, generator=g)
    fake = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Acc(), aux_loss_enabled=False,
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, args=SimpleNamespace(use_bias_correction_kl=False, delta=None),
        loss_type=trl_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        max_completion_length=C, _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None))
    inputs = {"prompt_ids": torch.zeros(B, P, dtype=torch.long), "prompt_mask": torch.ones(B, P),
              "completion_ids": torch.zeros(B, C, dtype=torch.long), "completion_mask": cmask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref}
    theirs = GRPOTrainer._compute_loss(fake, None, inputs)
    ours, _ = L.clip_policy_loss(lp, old, adv, cmask, clip_low=0.2, clip_high=0.28, agg=agg,
                                 ref_logprobs=ref if beta else None, kl_coef=beta, norm=C)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5, abs=1e-6)


def test_group_advantages_match_trl_formula_for_equal_groups():
    """TRL's GRPO: rewards.view(-1, G); (r - mean) / (std + 1e-4) per group."""
    g = torch.Generator().manual_seed(11)
    rewards = torch.rand(12, generator=g)
    G = 4
    grouped = rewards.view(-1, G)
    trl_adv = (rewards - grouped.mean(1).repeat_interleave(G)) / (grouped.std(1).repeat_interleave(G) + 1e-4)
    ours = L.group_advantages(rewards, torch.arange(12) // G, eps=1e-4)
    assert torch.allclose(ours, trl_adv, atol=1e-6)
