"""Every training loss and advantage estimator, as pure typed tensor functions.

Modelled on verl's ``core_algos``: functions take tensors and plain numbers, return tensors, keep
no state and never see a model, so each is tested on random tensors (and, where TRL computes the
same formula, against TRL).

Where a trainer's config chooses a variant by name, the name is looked up in a registry here,
and the trainers call whatever the registry holds (``register`` adds more; a config may then
name them):

* :data:`AGGREGATIONS` — how a ``[B, T]`` per-token loss becomes a scalar (``agg:`` in
  ``sft``, ``grpo``, ``ppo``);
* :data:`DPO_LOSSES` — the DPO family on the log-ratio margin (``loss:`` in ``dpo``); an entry
  registered with ``mean_logps=True`` gets per-token *mean* sequence log-probabilities;
* :data:`PRM_LOSSES` — process-reward-model losses (``loss:`` in ``prm``): ``pointwise`` on each
  step's logit against its soft label, and ``pairwise`` (registered with ``pairs=True``) on the
  logits of two sibling steps, the better one first;
* :data:`ADVANTAGES` — advantage estimators (``advantage:`` in ``grpo``, ``ppo``): group
  estimators ``f(rewards[B], group_ids[B]) -> [B]``, and, registered with
  ``needs_values=True``, value-based ones ``f(rewards[B, T], values[B, T], mask, *, gamma, lam)
  -> (advantages, returns)`` (PPO with a value head); :func:`process_advantages` adds a reward
  model's dense process rewards to a group estimator's, one advantage per step (PRIME).

An unknown name raises one ``ValueError`` that lists the known names.

Conventions: ``[B, T]`` tensors are aligned with the token ids (``logprobs[b, t]`` is the
log-probability of token ``t`` given tokens ``< t``; position 0 has none and is 0); ``mask`` is
1.0 on tokens that carry loss (assistant tokens the trainer may change) and 0.0 elsewhere
(prompt, observation, padding). Masks come from trajectory segments, never from re-rendering.

Loss aggregation over a ``[B, T]`` per-token loss (``agg``):

* ``token-mean``: sum over all loss tokens / number of loss tokens (long answers weigh more);
* ``seq-mean-token-mean``: mean per sequence, then mean over sequences (original GRPO);
* ``seq-mean-token-sum-norm``: sum per sequence / a constant ``norm`` (default ``T``), then mean
  over sequences (Dr. GRPO: no length bias).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

Fn = TypeVar("Fn", bound=Callable[..., Any])


class Registry(dict):
    """Name -> function. Looking up an unknown name raises one ``ValueError`` naming the
    known ones (``check`` does the same for config validators)."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def __missing__(self, name: str) -> Any:
        raise ValueError(f"unknown {self.what} {name!r} (one of {', '.join(self)})")

    def register(self, name: str, **attrs: Any) -> Callable[[Fn], Fn]:
        """Decorator: file ``fn`` under ``name``; ``attrs`` are set on it (e.g. ``mean_logps``)."""
        def deco(fn: Fn) -> Fn:
            for key, value in attrs.items():
                setattr(fn, key, value)
            self[name] = fn
            return fn
        return deco

    def check(self, name: str) -> str:
        """``name`` if registered, else the ``ValueError`` above."""
        self[name]
        return name


AGGREGATIONS = Registry("loss aggregation")
DPO_LOSSES = Registry("DPO loss")
ADVANTAGES = Registry("advantage estimator")
PRM_LOSSES = Registry("PRM loss")


# --- log-probabilities and aggregation -------------------------------------------------------------
def token_logprobs(logits: Tensor, labels: Tensor) -> Tensor:
    """``log_softmax(logits)[..., labels]`` without materialising the full log-softmax
    (gather minus logsumexp), in float32."""
    logits = logits.float()
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def sequence_logprobs(logits: Tensor, input_ids: Tensor) -> Tensor:
    """``[B, T]`` log-probabilities of ``input_ids`` under causal-LM ``logits`` (``[B, T, V]``),
    aligned with the ids (position 0 gets 0)."""
    lp = token_logprobs(logits[:, :-1], input_ids[:, 1:])
    return F.pad(lp, (1, 0))


def aggregate(loss: Tensor, mask: Tensor, agg: str = "token-mean", norm: float | None = None) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss over ``mask`` with the aggregation named ``agg``."""
    return AGGREGATIONS[agg](loss, mask.to(loss.dtype), norm)


@AGGREGATIONS.register("token-mean")
def token_mean(loss: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    per_seq = (loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    has = (mask.sum(-1) > 0).to(loss.dtype)
    return (per_seq * has).sum() / has.sum().clamp(min=1.0)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, norm: float | None = None) -> Tensor:
    return ((loss * mask).sum(-1) / float(norm or loss.shape[-1])).mean()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


# --- supervised ---------------------------------------------------------------------------------------
def nll_loss(logprobs: Tensor, mask: Tensor, agg: str = "token-mean") -> Tensor:
    """Masked negative log-likelihood of the loss tokens (SFT)."""
    return aggregate(-logprobs, mask, agg)


# --- preference -------------------------------------------------------------------------------------
def dpo_loss(chosen: Tensor, rejected: Tensor, ref_chosen: Tensor, ref_rejected: Tensor, *,
             beta: float = 0.1, kind: str = "sigmoid", label_smoothing: float = 0.0
             ) -> tuple[Tensor, Tensor, Tensor]:
    """Per-pair DPO-family loss from sequence log-probabilities (``[B]`` each), the variant
    named ``kind`` in :data:`DPO_LOSSES`. Returns ``(loss[B], chosen_reward[B],
    rejected_reward[B])`` with rewards ``beta * (logp - ref)``."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    loss = DPO_LOSSES[kind](chosen_ratio - rejected_ratio, beta=beta, label_smoothing=label_smoothing)
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


@DPO_LOSSES.register("sigmoid")
def dpo_sigmoid(delta: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """DPO (Rafailov et al. 2023) on the margin ``delta`` of log-ratios; ``label_smoothing``
    gives cDPO."""
    return (-F.logsigmoid(beta * delta) * (1 - label_smoothing)
            - F.logsigmoid(-beta * delta) * label_smoothing)


@DPO_LOSSES.register("hinge")
def dpo_hinge(delta: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """SLiC's hinge on the margin."""
    return torch.relu(1 - beta * delta)


@DPO_LOSSES.register("ipo", mean_logps=True)
def dpo_ipo(delta: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """IPO (Azar et al. 2023), on per-token *mean* log-probabilities, as the IPO authors and TRL
    do, so ``beta`` does not depend on length."""
    return (delta - 1 / (2 * beta)) ** 2


# --- process reward models ------------------------------------------------------------------------
@PRM_LOSSES.register("pointwise", pairs=False)
def prm_pointwise(logits: Tensor, targets: Tensor, mask: Tensor, *, pos_weight: float = 1.0) -> Tensor:
    """Binary cross-entropy of step logits ``[B, S]`` against soft targets in [0, 1], mean over
    the masked steps; ``pos_weight`` multiplies the positive term (class balancing: a set with
    2% positive steps passes about 49 so both classes weigh the same)."""
    pw = torch.tensor(float(pos_weight), dtype=torch.float32, device=logits.device)
    loss = F.binary_cross_entropy_with_logits(logits.float(), targets.float(), reduction="none",
                                              pos_weight=pw)
    m = mask.float()
    return (loss * m).sum() / m.sum().clamp(min=1.0)


@PRM_LOSSES.register("pairwise", pairs=True)
def prm_pairwise(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Bradley-Terry loss between sibling steps (rStar-Math's process preference model): the
    mean of ``-log sigmoid(chosen - rejected)`` over ``[P]`` pairs of step logits, the step with
    the higher value first. Only the difference is trained, so noisy absolute values (a Q of
    0.4 vs 0.5 from a handful of visits) do not become regression targets."""
    return F.softplus(rejected.float() - chosen.float()).mean()


# --- policy gradient -----------------------------------------------------------------------------
def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimator of KL(policy || reference) (Schulman 2020): unbiased, >= 0."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1


def clip_policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *,
                     clip_low: float = 0.2, clip_high: float = 0.2, agg: str = "token-mean",
                     ref_logprobs: Tensor | None = None, kl_coef: float = 0.0,
                     norm: float | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO/GRPO clipped surrogate with asymmetric clip (DAPO's clip-higher: the ratio is
    clipped to ``[1 - clip_low, 1 + clip_high]``) and an optional k3 KL penalty to a reference.

    ``advantages`` is ``[B]`` (one per sequence, GRPO) or ``[B, T]`` (per token, PPO/GAE).
    Returns the loss and detached statistics: ``clip_frac``, ``approx_kl`` (k3 of old vs new),
    ``kl`` (to the reference, when given).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    stats: dict[str, Tensor] = {}
    if ref_logprobs is not None and kl_coef:
        kl = kl_k3(logprobs, ref_logprobs)
        per_token = per_token + kl_coef * kl
        stats["kl"] = masked_mean(kl.detach(), mask)
    loss = aggregate(per_token, mask, agg, norm)
    with torch.no_grad():
        was_clipped = ((ratio < 1 - clip_low) & (advantages < 0)) | ((ratio > 1 + clip_high) & (advantages > 0))
        stats["clip_frac"] = masked_mean(was_clipped.to(logprobs.dtype), mask)
        stats["approx_kl"] = masked_mean(kl_k3(logprobs.detach(), old_logprobs), mask)
    return loss, stats


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip: float | None = 0.2, agg: str = "token-mean") -> Tensor:
    """Clipped value-function loss ``0.5 * max((v - R)^2, (v_clip - R)^2)`` (PPO)."""
    err = (values - returns) ** 2
    if clip is not None:
        v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
        err = torch.maximum(err, (v_clip - returns) ** 2)
    return 0.5 * aggregate(err, mask, agg)


# --- advantages --------------------------------------------------------------------------------------
@ADVANTAGES.register("grpo")
def group_advantages(rewards: Tensor, group_ids: Tensor, *, scale: str = "std",
                     eps: float = 1e-6) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, divided by the group's std
    (``scale="std"``, unbiased, as GRPO and TRL) or not (``"none"``, Dr. GRPO). Groups are keyed
    by ``group_ids`` (any integers, any group sizes, any order); a group of one gets 0."""
    rewards = rewards.float()
    inv, count, total = _group_sums(rewards, group_ids)
    centred = rewards - (total / count)[inv]
    if scale == "none":
        adv = centred
    elif scale == "std":
        var = torch.zeros_like(count).index_add_(0, inv, centred ** 2) / (count - 1).clamp(min=1.0)
        adv = centred / (var.sqrt()[inv] + eps)
    else:
        raise ValueError(f"unknown advantage scale {scale!r} (std or none)")
    return torch.where(count[inv] > 1, adv, torch.zeros_like(adv))


@ADVANTAGES.register("dr-grpo")
def dr_grpo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): the reward minus its group's mean, not divided by the std."""
    return group_advantages(rewards, group_ids, scale="none")


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): the reward minus the mean of the *other* rewards of its
    group; a group of one gets 0."""
    rewards = rewards.float()
    inv, count, total = _group_sums(rewards, group_ids)
    n = count[inv]
    adv = rewards - (total[inv] - rewards) / (n - 1).clamp(min=1.0)
    return torch.where(n > 1, adv, torch.zeros_like(adv))


def process_advantages(outcome: Sequence[float], values: Sequence[Sequence[float | None]],
                       groups: Sequence[Any], coef: float, scale: str = "raw") -> list[list[float]]:
    """Dense process rewards added to outcome advantages (PRIME, Cui et al. 2025): one advantage
    per step of each member.

    ``values[i]`` is a reward model's value of member ``i``'s snapshot (None: the root, which no
    step reached; its estimate is then the mean over the group of the values after the first
    step, the policy's expected value there) followed by its value after each step. The process
    reward of step ``s`` is the value it gained, ``r_s = v_s - v_{s-1}``; step ``k``'s process
    return is ``G_k = sum_{s >= k} r_s`` (gamma = 1), baselined, as the outcome is by RLOO, by
    the mean first-step return of the *other* members of its group (a group of one is its own
    baseline). Step ``k`` of member ``i`` gets ``outcome[i] + coef * (G_ik - baseline_i)``.

    ``scale="outcome"`` first rescales every process term ``G_ik - baseline_i`` by one factor so
    that their mean size over all steps equals the outcome advantages' (each member's counted
    once per step), which makes ``coef`` the process term's weight *relative to the outcome's*
    whatever range the reward model's values span; ``"raw"`` uses the value differences as they
    are. All-zero process terms stay zero."""
    if scale not in ("raw", "outcome"):
        raise ValueError(f"process_advantages: scale must be 'raw' or 'outcome', not {scale!r}")
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    full: list[list[float]] = [[0.0] for _ in values]
    for ids in members.values():
        firsts = [values[i][1] for i in ids if len(values[i]) > 1]
        root = sum(firsts) / len(firsts) if firsts else 0.0
        for i in ids:
            v = values[i]
            full[i] = [root if v[0] is None else float(v[0])] + [float(x) for x in v[1:]]
    returns = [[v[-1] - v[k - 1] for k in range(1, len(v))] for v in full]  # G_k telescopes
    terms = []
    for i, g in enumerate(groups):
        others = [returns[j][0] for j in members[g] if j != i and returns[j]]
        base = sum(others) / len(others) if others else (returns[i][0] if returns[i] else 0.0)
        terms.append([G - base for G in returns[i]])
    factor = 1.0
    if scale == "outcome":
        size = sum(abs(t) for ts in terms for t in ts)
        outcome_size = sum(abs(float(o)) * len(ts) for o, ts in zip(outcome, terms))
        factor = outcome_size / size if size > 0 else 0.0
    return [[float(o) + coef * factor * t for t in ts] for o, ts in zip(outcome, terms)]


def _group_sums(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dense group index per row, rows per group, reward sum per group)."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inv, torch.ones_like(rewards))
    return inv, count, torch.zeros_like(count).index_add_(0, inv, rewards)


@ADVANTAGES.register("gae", needs_values=True)
def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over ``[B, T]`` token rewards and values that skips
    tokens with ``mask == 0`` (observations, prompts, padding): the recursion runs over the
    policy's own tokens only, as if the observation tokens were not there, so an observation
    between two assistant turns neither discounts nor bootstraps. Rewards must sit on mask
    tokens (e.g. a turn's env reward on its last token). Returns ``(advantages, returns)``,
    zero off the mask."""
    mask = mask.to(values.dtype)
    B, T = rewards.shape
    adv = torch.zeros_like(values)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    last = torch.zeros_like(next_value)
    for t in range(T - 1, -1, -1):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        g = delta + gamma * lam * last
        adv[:, t] = g * m
        next_value = torch.where(m > 0, values[:, t], next_value)
        last = torch.where(m > 0, g, last)
    return adv, (adv + values) * mask
