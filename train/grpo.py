"""GRPO: clipped policy gradient on groups of siblings from one snapshot, offline or online.

* **offline** (``data:``): groups exported with ``omrl export grpo``; group advantages are
  computed once over the file; the ratio's denominator is the behaviour policy's logprobs from
  the segments (rows without them are treated as on-policy: ratio 1 at the first update).
* **online** (``online:``): every round samples groups for ``tasks_per_round`` tasks through
  :func:`omrl_search.search_many` with the *current* weights (the hf backend over the live model,
  no copy), exports them as GRPO rows with their exact ids and logprobs, then trains
  ``steps_per_round`` optimizer steps on them. ``steps_per_round: 1`` is on-policy GRPO (sample
  every step); more is iterative GRPO (rounds with a refreshed policy, PPO-style reuse of each
  round's samples under the clip). The pending samples of a round are saved in checkpoints, so
  ``resume`` continues exactly. Online, ``batch_size`` is not used: a round's rows are split
  evenly over its ``steps_per_round * grad_accum`` micro-batches.

With ``kl_coef > 0`` a k3 KL penalty to the reference (the initial policy: adapter disabled
under LoRA, else a frozen copy) is added per token.
"""
from __future__ import annotations

import random
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .common import Reference, make_builder, pad_id, policy_logprobs
from .data import RowBuilder, TokenRow, collate, load_grpo
from .losses import clip_policy_loss, group_advantages
from .runtime import ListSource, Runner, TrainConfig, TrainError, load_model, resolve_model_path

Agg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class OnlineSettings(BaseModel):
    """Where online GRPO samples its groups."""

    model_config = ConfigDict(extra="forbid")
    env: str = "game24"
    split: str = "train"
    strategy: str = "best_of_n:n=4"  # any strategy; best_of_n gives one group per task
    tasks_per_round: int = Field(4, ge=1)
    steps_per_round: int = Field(1, ge=1)
    unit: Literal["trajectory", "step"] = "trajectory"
    temperature: float = Field(1.0, ge=0)
    max_tokens: int = Field(64, ge=1)
    max_depth: int | None = Field(None, ge=1)
    budget: str | None = None


class GRPOConfig(TrainConfig):
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)  # > clip_low: DAPO's clip-higher
    kl_coef: float = Field(0.0, ge=0)
    agg: Agg = "token-mean"
    adv_scale: Literal["std", "none"] = "std"
    drop_flat_groups: bool = False  # drop groups whose rewards are all equal (no signal)
    online: OnlineSettings | None = None


def assign_advantages(rows: list[TokenRow], scale: str, drop_flat: bool) -> list[TokenRow]:
    """Group-normalised advantages on the rows (by their ``group``), optionally without the
    groups that carry no signal."""
    import torch

    if not rows:
        return rows
    rewards = torch.tensor([r.reward for r in rows], dtype=torch.float32)
    groups = torch.tensor([r.group for r in rows])
    adv = group_advantages(rewards, groups, scale=scale)
    for r, a in zip(rows, adv.tolist()):
        r.advantage = a
    if drop_flat:
        spread: dict[int, set[float]] = {}
        for r in rows:
            spread.setdefault(r.group, set()).add(r.reward)
        rows = [r for r in rows if len(spread[r.group]) > 1]
    return rows


def policy_loss(cfg: GRPOConfig, reference: Reference | None, model: Any, batch: dict[str, Any],
                advantages: Any, lp: Any = None) -> tuple[Any, dict[str, float]]:
    """The clipped surrogate on one batch (``lp``: the policy's logprobs if already computed)."""
    import torch

    if lp is None:
        lp = policy_logprobs(model, batch)
    old = torch.where(batch["has_old"].unsqueeze(-1), batch["old_logprobs"], lp.detach())
    ref = reference.logprobs(model, batch) if reference is not None and cfg.kl_coef else None
    loss, stats = clip_policy_loss(lp, old, advantages, batch["loss_mask"], clip_low=cfg.clip_low,
                                   clip_high=cfg.clip_high, agg=cfg.agg, ref_logprobs=ref,
                                   kl_coef=cfg.kl_coef)
    metrics = {k: float(v) for k, v in stats.items()}
    metrics.update(batch.get("stats", {}), tokens=float(batch["n_tokens"]))
    return loss, metrics


def grpo_loss_fn(cfg: GRPOConfig, reference: Reference | None):
    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        return policy_loss(cfg, reference, model, batch, batch["advantages"])
    return loss_fn


class RolloutSource:
    """Online batches: at the start of each round, sample groups with the live model, then
    serve ``steps_per_round * grad_accum`` micro-batches from them (rows shuffled, cycled)."""

    def __init__(self, cfg: GRPOConfig, tasks: list[Any], builder: RowBuilder, hf_tokenizer: Any):
        self.cfg, self.on, self.tasks, self.builder = cfg, cfg.online, tasks, builder
        self.tok = hf_tokenizer
        self.round, self.cursor = 0, 0
        self.pending: list[list[TokenRow]] = []
        self.stats: dict[str, float] = {}
        self.last_fault = ""
        self._policy: Any = None

    def policy(self, runner: Runner) -> Any:
        """The hf backend over the model being trained (its own copy is dropped at once)."""
        if self._policy is None:
            from omrl_search.backends.hf import HFPolicy

            path, gguf = resolve_model_path(self.cfg.model)
            pol = HFPolicy(path, device=str(runner.device), dtype="float32", gguf_file=gguf)
            pol.model = None
            self._policy = pol
        self._policy.model = runner.module
        return self._policy

    def next_batch(self, runner: Runner) -> list[TokenRow] | None:
        tries = 0
        while not self.pending:
            self._rollout(runner)
            tries += 1
            if tries >= 10 and not self.pending:
                why = f" (e.g. {self.last_fault})" if self.last_fault else ""
                raise TrainError(f"online GRPO: 10 rounds in a row gave no trainable group{why}")
        return self.pending.pop(0)

    def _rollout(self, runner: Runner) -> None:
        from omrl_search import search_many
        from omrl_search.exports import grpo_rows
        from omrl_search.types import SamplingParams

        on = self.on
        tasks = [self.tasks[(self.cursor + i) % len(self.tasks)] for i in range(on.tasks_per_round)]
        self.cursor = (self.cursor + on.tasks_per_round) % len(self.tasks)
        model = runner.module
        was = model.training
        model.eval()
        try:
            with runner.autocast():
                results = search_many(tasks, strategy=on.strategy, policy=self.policy(runner),
                                      budget=on.budget, seed=self.cfg.seed * 100_003 + self.round,
                                      max_depth=on.max_depth,
                                      sampling=SamplingParams(temperature=on.temperature,
                                                              max_tokens=on.max_tokens))
        finally:
            model.train(was)
        self.round += 1
        self.last_fault = next((f for r in results for f in r.faults), "")
        rows: list[TokenRow] = []
        groups: dict[str, int] = {}
        for row in grpo_rows(results, unit=on.unit):
            try:
                seq = self.builder.from_segments(row["segments"])
            except ValueError:
                continue  # e.g. a turn cut to nothing by max_length
            seq.reward = row["reward"]
            seq.group = groups.setdefault(row["group_id"], len(groups))
            rows.append(seq)
        rows = assign_advantages(rows, self.cfg.adv_scale, self.cfg.drop_flat_groups)
        n_mb = on.steps_per_round * self.cfg.grad_accum
        self.stats = {"rollout_success": sum(r.success for r in results) / len(results),
                      "rollout_reward": sum(r.reward for r in rows) / len(rows) if rows else 0.0,
                      "rollout_rows": float(len(rows)), "round": float(self.round)}
        if not rows:
            return
        random.Random(self.cfg.seed * 7919 + self.round).shuffle(rows)
        size = -(-len(rows) // n_mb)  # the round's rows split evenly (cycled when too few)
        cyc = rows * (1 + (size * n_mb) // len(rows))
        self.pending = [cyc[i * size:(i + 1) * size] for i in range(n_mb)]

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "cursor": self.cursor, "pending": self.pending,
                "stats": self.stats}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round, self.cursor = state["round"], state["cursor"]
        self.pending, self.stats = state["pending"], state["stats"]


def make_source(cfg: GRPOConfig, model: Any, tok: Any) -> tuple[Any, int | None]:
    """(batch source, total steps) for offline data or online sampling."""
    builder = make_builder(cfg, model, tok)
    if cfg.online is None:
        rows = assign_advantages(load_grpo(cfg.data, builder), cfg.adv_scale, cfg.drop_flat_groups)
        if len(rows) < cfg.batch_size:
            raise TrainError(f"{len(rows)} GRPO rows (after filtering) cannot fill a batch of {cfg.batch_size}")
        return ListSource(rows, cfg.batch_size, seed=cfg.seed), None
    if cfg.max_steps is None:
        raise TrainError("online GRPO needs max_steps (rounds x steps_per_round)")
    from omrl_search.api import load_tasks

    try:
        tasks = load_tasks(cfg.online.env, cfg.online.split)
    except (KeyError, ValueError) as exc:
        raise TrainError(f"online.env/split: {exc.args[0]}") from None
    if not tasks:
        raise TrainError(f"env {cfg.online.env!r} has no {cfg.online.split!r} tasks")
    random.Random(cfg.seed).shuffle(tasks)
    return RolloutSource(cfg, tasks, builder, tok), cfg.max_steps


def with_stats(source: Any, pid: int):
    """collate that also carries the latest rollout statistics into the logged metrics."""
    def fn(xs: list[TokenRow]) -> dict[str, Any]:
        batch = collate(xs, pid)
        stats = getattr(source, "stats", None)
        if stats:
            batch["stats"] = dict(stats)
        return batch
    return fn


def build(cfg: GRPOConfig) -> Runner:
    model, tok = load_model(cfg)
    reference = Reference(model) if cfg.kl_coef else None
    source, total = make_source(cfg, model, tok)
    return Runner(cfg, model, grpo_loss_fn(cfg, reference), source, with_stats(source, pad_id(tok)),
                  tokenizer=tok, kind="grpo", total_steps=total)


def train(cfg: GRPOConfig) -> dict[str, Any]:
    return build(cfg).train()
