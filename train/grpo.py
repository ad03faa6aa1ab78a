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
* **online on Ray** (``online.executor: ray:workers=4``, ``online.ray_address``): the rounds
  are searched on Ray actors (:mod:`omrl_search.executors`), each holding an hf policy built from
  ``hf:<model folder>:dtype=float32``; before every round the trainer's live weights (LoRA
  merged, on a copy) are pushed to them through Ray's object store (``policy_weights``), so
  they sample with the current policy; the actors are kept across rounds and only reload
  weights (their policy runs without the hf prefix cache, whose KV would be the old weights';
  in process the cache is emptied before every sampling pass). The pushed version (the optimizer step) is logged as ``pushed_version``. Tasks are
  seeded from ``(seed, task_id)`` as in process, but an hf policy samples per batch and a
  batch depends on which tasks share an actor, so the samples differ from an in-process run
  (not their distribution). The model folder must exist on every Ray node.

**Dynamic sampling** (DAPO; ``dynamic_sampling: true``, the default for group estimators): a
group whose rewards are all equal has zero advantage everywhere and would make an update on
nothing, so such groups are dropped and counted (``groups_flat`` in the metrics) before the
update. Online, a round then samples more tasks (``tasks_per_round`` at a time) until it has
``online.min_groups`` informative groups or has sampled ``online.max_sampling_tries`` times,
and trains on what it has. A round with none after the cap makes no update: it is counted
(``rounds_empty_total``) and sampled again on the next tasks; ``online.max_empty_rounds`` such
rounds in a row (default 4) stop the run with an error naming the counts.
Offline, the flat groups of the file are dropped and counted once.

**Constrained rollouts** (``online.constrain``, ``auto`` by default: the env's grammar where it
has one): the sampler records each token's logprob under the masked distribution it drew from
(renormalised over the tokens the grammar allowed); every step's grammar is exported with its
segment, and the trainer rebuilds the same mask at each of those tokens
(:class:`train.data.GrammarMasks`) before its log-softmax, so the importance ratio and the KL
read the same distribution the sample came from: the ratio is exactly 1 at the first update.

``advantage:`` names the group estimator in :data:`train.losses.ADVANTAGES` (``grpo``: mean-
and std-normalised per group; ``dr-grpo``: mean-centred only; ``rloo``: leave-one-out baseline)
and ``agg:`` the loss aggregation in :data:`train.losses.AGGREGATIONS`.

**Dense process rewards** (``process_rewards: {model: SPEC, coef: 0.5}``, PRIME-style): a PRM
or the implicit PRM scores every member's steps (online: ``model`` scores each sampling pass's
groups; offline: the file's ``process`` column, ``omrl export grpo --process-rm SPEC``); the
value each step gains is its process reward, and each turn's tokens get the outcome advantage
plus ``coef`` times its process return against the group's (:func:`train.losses.process_advantages`;
``scale: outcome``, the default, first rescales those terms to the outcome advantages' mean size,
so ``coef`` is their relative weight; ``raw`` leaves them as the values' differences).
Dynamic sampling still drops groups whose outcomes are all equal.

With ``kl_coef > 0`` a k3 KL penalty to the reference (the initial policy: adapter disabled
under LoRA, else a frozen copy) is added per token.
"""
from __future__ import annotations

import os
import random
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omrl_search.executors import parse_executor
from omrl_search.types import DEFAULT_MAX_TOKENS, Task

from .common import (AdvantageName, AggregationName, PolicyConfig, Reference, grammar_masks,
                     layout_collate, make_builder, pad_id, policy_logprobs)
from .config import AgentName
from .data import RowBuilder, TokenRow, load_grpo
from .losses import ADVANTAGES, clip_policy_loss, process_advantages
from .runtime import ListSource, Runner, TrainError, is_peft, load_model, resolve_model_path


class ProcessRewards(BaseModel):
    """Dense process rewards added to the outcome advantage (:func:`train.losses.process_advantages`)."""

    model_config = ConfigDict(extra="forbid")
    # the reward model whose step values score online samples (prm:DIR, implicit:POLICY);
    # offline rows bring theirs in the process column (omrl export grpo --process-rm)
    model: str | None = None
    coef: float = Field(0.5, ge=0)  # weight of the process return beside the outcome advantage
    # outcome: the process terms are rescaled so that their mean size over the batch's steps is
    # the outcome advantages' (coef is then their relative weight, whatever the model's value
    # range); raw: coef times the value differences as they are
    scale: Literal["outcome", "raw"] = "outcome"


class OnlineSettings(BaseModel):
    """Where online GRPO samples its groups."""

    model_config = ConfigDict(extra="forbid")
    env: str = "game24"
    split: str = "train"
    # the tasks to sample instead of ``split``'s (task records, as results.jsonl writes them):
    # the loop passes its curriculum's chosen levels without the dev slice's puzzles
    tasks: list[Task] | None = None
    strategy: str = "best_of_n:n=4"  # any strategy; best_of_n gives one group per task
    tasks_per_round: int = Field(4, ge=1)
    steps_per_round: int = Field(1, ge=1)
    unit: Literal["trajectory", "step"] = "trajectory"
    agent: AgentName = "react"  # the format the samples are written in: the model's own
    temperature: float = Field(1.0, ge=0)
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1)
    max_depth: int | None = Field(None, ge=1)
    budget: str | None = None
    # structured decoding while sampling (the trainer rebuilds each step's mask: the ratio and
    # the KL use the masked distribution the tokens were sampled from; docs/training.md)
    constrain: Literal["none", "format", "actions", "auto"] = "auto"
    # dynamic sampling: informative (not flat) groups a round needs, None = tasks_per_round,
    # and how many times a round may sample tasks_per_round tasks to get them
    min_groups: int | None = Field(None, ge=1)
    max_sampling_tries: int = Field(4, ge=1)
    # a round whose passes found no trainable group is sampled again on the next tasks (counted
    # as rounds_empty_total, no update); this many such rounds in a row stop the run with an error
    max_empty_rounds: int = Field(4, ge=1)
    executor: str = "local"  # or e.g. "ray:workers=4": sample on Ray actors, weights pushed per round
    ray_address: str | None = None  # join this Ray cluster ("auto", "ray://HEAD:10001")

    @field_validator("executor")
    @classmethod
    def _known_executor(cls, spec: str) -> str:
        parse_executor(spec)  # a bad spec: one line naming the syntax
        return spec


class GRPOConfig(PolicyConfig):
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)  # > clip_low: DAPO's clip-higher
    kl_coef: float = Field(0.0, ge=0)
    agg: AggregationName = "token-mean"  # a name in train.losses.AGGREGATIONS
    advantage: AdvantageName = "grpo"  # a group estimator in train.losses.ADVANTAGES (grpo, dr-grpo, rloo)
    # DAPO dynamic sampling: drop (and count) groups whose rewards are all equal (no signal);
    # online, sample more groups in their place (online.min_groups, online.max_sampling_tries)
    dynamic_sampling: bool = True
    online: OnlineSettings | None = None
    # PRIME-style dense process rewards from a PRM or the implicit PRM (None: outcome only)
    process_rewards: ProcessRewards | None = None
    #: whether the trainer has a value model for estimators registered with needs_values (PPO)
    value_estimators: ClassVar[bool] = False

    @field_validator("advantage")
    @classmethod
    def _estimator_fits(cls, name: str) -> str:
        if needs_values(name) and not cls.value_estimators:
            raise ValueError(f"advantage {name!r} needs a value model: use omrl train ppo")
        return name

    @model_validator(mode="after")
    def _process_with_groups(self) -> "GRPOConfig":
        if self.process_rewards is not None and needs_values(self.advantage):
            raise ValueError(f"process_rewards adds to a group estimator's advantages, not {self.advantage!r}'s")
        return self


def needs_values(advantage: str) -> bool:
    """Whether the named estimator takes a value model's values (GAE) rather than group rewards."""
    return bool(getattr(ADVANTAGES[advantage], "needs_values", False))


def assign_advantages(rows: list[TokenRow], advantage: str,
                      process: ProcessRewards | None = None) -> list[TokenRow]:
    """The named group estimator's advantages on the rows (by their ``group``; a value-based
    estimator is left to the trainer's batches), and with ``process`` one advantage per turn,
    the outcome's plus the rows' dense process rewards. Flat groups are dropped by
    :func:`split_flat`."""
    import torch

    if not rows:
        return rows
    if not needs_values(advantage):
        rewards = torch.tensor([r.reward for r in rows], dtype=torch.float32)
        groups = torch.tensor([r.group for r in rows])
        for r, a in zip(rows, ADVANTAGES[advantage](rewards, groups).tolist()):
            r.advantage = a
    if process is not None:
        missing = sum(r.process is None for r in rows)
        if missing:
            raise TrainError(f"process_rewards: {missing} of {len(rows)} GRPO rows have no process "
                             "values (export with --process-rm SPEC, or set process_rewards.model online)")
        steps = process_advantages([r.advantage for r in rows], [r.process for r in rows],
                                   [r.group for r in rows], process.coef, process.scale)
        for r, a in zip(rows, steps):
            r.step_advantages = a
    return rows


def process_shift(rows: list[TokenRow]) -> dict[str, float]:
    """How far dense process rewards moved the rows' advantages: the mean |outcome advantage|
    (``adv_outcome_abs``) and the mean |step advantage - outcome advantage| over every turn
    (``adv_process_abs``). A process term far below the outcome's barely changes the update."""
    turns = [(r.advantage, a) for r in rows for a in (r.step_advantages or ())]
    if not turns:
        return {}
    return {"adv_outcome_abs": sum(abs(o) for o, _ in turns) / len(turns),
            "adv_process_abs": sum(abs(a - o) for o, a in turns) / len(turns)}


def split_flat(rows: list[TokenRow]) -> tuple[list[TokenRow], dict[str, float]]:
    """``rows`` without the groups whose rewards are all equal (zero reward variance: no
    advantage, nothing to learn), and the counts ``groups_sampled``, ``groups_flat``,
    ``groups_kept``."""
    spread: dict[int, set[float]] = {}
    for r in rows:
        spread.setdefault(r.group, set()).add(r.reward)
    flat = sum(len(v) < 2 for v in spread.values())
    kept = [r for r in rows if len(spread[r.group]) > 1]
    return kept, {"groups_sampled": float(len(spread)), "groups_flat": float(flat),
                  "groups_kept": float(len(spread) - flat)}


def drops_flat(cfg: GRPOConfig) -> bool:
    """Whether dynamic sampling applies: on, with a group estimator (a value model's GAE gets
    a signal from a flat group too)."""
    return cfg.dynamic_sampling and not needs_values(cfg.advantage)


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
        self.round, self.cursor, self.passes, self.version = 0, 0, 0, 0
        self.flat_total, self.empty_total = 0.0, 0.0
        self.pending: list[list[TokenRow]] = []
        self.stats: dict[str, float] = {}
        self.last_fault = ""
        self._policy: Any = None
        self._process_rm: Any = None
        self.remote = parse_executor(cfg.online.executor)[0] != "local"
        self._run = uuid.uuid4().hex[:8]  # pushed versions are (run, step): no clash between runs
        self.reencode: Any = None  # a TurnEncoder to re-encode samples with (tests: scripted policies)

    def policy(self, runner: Runner) -> Any:
        """The hf backend over the model being trained (its own copy is dropped at once). Its
        prefix cache is emptied before every sampling pass: the KV it holds was computed with
        the weights before the last update."""
        if self._policy is None:
            from omrl_search.backends.hf import HFPolicy

            path, gguf = resolve_model_path(self.cfg.model)
            pol = HFPolicy(path, device=str(runner.device), dtype="float32", gguf_file=gguf)
            pol.model = None
            self._policy = pol
        self._policy.model = runner.module
        self._policy.clear_cache()  # KV cached under the previous weights
        return self._policy

    def process_rm(self) -> Any:
        """The reward model of ``process_rewards`` (built once), or None."""
        pr = self.cfg.process_rewards
        if pr is None:
            return None
        if self._process_rm is None:
            from omrl_search.reward import make_reward_model

            if not pr.model:
                raise TrainError("process_rewards.model: online GRPO needs a reward model to score "
                                 "its samples (prm:DIR or implicit:POLICY)")
            self._process_rm = make_reward_model(pr.model)
        return self._process_rm

    def remote_policy(self) -> str:
        """The spec the Ray actors build their policy from: architecture, tokenizer and dtype
        from the base model's folder (the weights come from the push). No prefix cache: an
        actor loads pushed weights in place, and cached KV of the old ones would be reused."""
        path, gguf = resolve_model_path(self.cfg.model)
        return (f"hf:{os.path.abspath(path)}:dtype=float32,prefix_cache=off"
                + (f",gguf_file={gguf}" if gguf else ""))

    def next_batch(self, runner: Runner) -> list[TokenRow] | None:
        if not self.pending:
            self.rollout(runner)
        return self.pending.pop(0)

    def rollout(self, runner: Runner) -> None:
        """One round's micro-batches. A round whose sampling passes found no trainable group
        makes no update: it is counted (``rounds_empty_total``) and sampled again on the next tasks,
        up to ``max_empty_rounds`` in a row, so one unlucky round does not end a long run."""
        for _ in range(self.on.max_empty_rounds):
            rows = self._sample_round(runner)
            if rows:
                break
            self.empty_total += 1
        else:
            why = f"; e.g. {self.last_fault}" if self.last_fault else ""
            raise TrainError(f"online GRPO: {self.on.max_empty_rounds} rounds in a row gave no trainable "
                             f"group (the last: {int(self.stats['sampling_passes'])} sampling passes, "
                             f"{int(self.stats['groups_sampled'])} groups, "
                             f"{int(self.stats['groups_flat'])} with equal rewards{why})")
        rows = assign_advantages(rows, self.cfg.advantage, self.cfg.process_rewards)
        self.stats.update(process_shift(rows))
        n_mb = self.on.steps_per_round * self.cfg.grad_accum
        random.Random(self.cfg.seed * 7919 + self.round).shuffle(rows)
        size = -(-len(rows) // n_mb)  # the round's rows split evenly (cycled when too few)
        cyc = rows * (1 + (size * n_mb) // len(rows))
        self.pending = [cyc[i * size:(i + 1) * size] for i in range(n_mb)]

    def _sample_round(self, runner: Runner) -> list[TokenRow]:
        """Sampling passes of ``tasks_per_round`` tasks until the round has ``min_groups``
        informative groups (dynamic sampling) or any trainable group (without), or
        ``max_sampling_tries`` passes: the round's rows (none when every group was flat)."""
        on, dynamic = self.on, drops_flat(self.cfg)
        need = (on.min_groups or on.tasks_per_round) if dynamic else 1
        rows: list[TokenRow] = []
        counts = dict.fromkeys(("groups_sampled", "groups_flat", "groups_kept"), 0.0)
        results: list[Any] = []
        passes = 0
        while counts["groups_kept"] < need and passes < on.max_sampling_tries:
            got, res = self.sample_pass(runner, offset=1 + max((r.group for r in rows), default=-1))
            passes += 1
            results += res
            if dynamic:
                got, c = split_flat(got)
            else:
                c = {"groups_sampled": float(len({r.group for r in got})), "groups_flat": 0.0}
                c["groups_kept"] = c["groups_sampled"]
            for k in counts:
                counts[k] += c[k]
            rows += got
        self.round += 1
        self.flat_total += counts["groups_flat"]
        self.stats = {"rollout_success": sum(r.success for r in results) / len(results),
                      "rollout_reward": sum(r.reward for r in rows) / len(rows) if rows else 0.0,
                      "rollout_rows": float(len(rows)), "round": float(self.round),
                      "sampling_passes": float(passes), **counts, "groups_flat_total": self.flat_total}
        self.stats["rounds_empty_total"] = self.empty_total
        if self.remote:
            self.stats["pushed_version"] = float(self.version)
        return rows

    def sample_pass(self, runner: Runner, offset: int) -> tuple[list[TokenRow], list[Any]]:
        """Search the next ``tasks_per_round`` tasks with the live weights: their GRPO rows
        (groups numbered from ``offset``) and the results."""
        from omrl_search.exports import grpo_rows

        on = self.on
        tasks = [self.tasks[(self.cursor + i) % len(self.tasks)] for i in range(on.tasks_per_round)]
        self.cursor = (self.cursor + on.tasks_per_round) % len(self.tasks)
        results = self.search(runner, tasks, self.cfg.seed * 100_003 + self.passes)
        self.passes += 1
        check_grammars_recorded(results)
        self.last_fault = next((f for r in results for f in r.faults), self.last_fault)
        rows: list[TokenRow] = []
        groups: dict[str, int] = {}
        for row in grpo_rows(results, unit=on.unit, tokenizer=self.reencode, reward_model=self.process_rm()):
            try:
                seq = self.builder.from_segments(row["segments"])
            except ValueError:
                continue  # e.g. a turn cut to nothing by max_length
            seq.reward = row["value"]  # the training target (row["reward"] is the env's reward)
            seq.group = offset + groups.setdefault(row["group_id"], len(groups))
            seq.process = row.get("process")
            rows.append(seq)
        return rows, results

    def search(self, runner: Runner, tasks: list[Any], seed: int) -> list[Any]:
        """The searches of one sampling pass, with the trainer's current policy (override it to
        search with another policy, as the tests do)."""
        from omrl_search import search_many
        from omrl_search.types import SamplingParams

        on = self.on
        search = dict(strategy=on.strategy, budget=on.budget, seed=seed, max_depth=on.max_depth,
                      constrain=on.constrain, agent=on.agent,
                      sampling=SamplingParams(temperature=on.temperature, max_tokens=on.max_tokens))
        if self.remote:
            self.version = runner.policy_version
            return search_many(tasks, policy=self.remote_policy(), executor=on.executor,
                               ray_address=on.ray_address,
                               policy_weights=((self._run, self.version), live_weights(runner.module)),
                               **search)
        model = runner.module
        was = model.training
        model.eval()
        try:
            with runner.autocast():
                return search_many(tasks, policy=self.policy(runner), **search)
        finally:
            model.train(was)

    def state_dict(self) -> dict[str, Any]:
        return {"round": self.round, "cursor": self.cursor, "pending": self.pending,
                "stats": self.stats, "passes": self.passes, "flat_total": self.flat_total,
                "empty_total": self.empty_total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round, self.cursor = state["round"], state["cursor"]
        self.pending, self.stats = state["pending"], state["stats"]
        self.passes = state.get("passes", self.round)
        self.flat_total = state.get("flat_total", 0.0)
        self.empty_total = state.get("empty_total", 0.0)


def check_grammars_recorded(results: list[Any]) -> None:
    """Refuse constrained samples whose steps do not say which grammar they were sampled under
    (an engine that does not set ``Step.grammar``): their masked logprobs could not be
    recomputed and every ratio would be off."""
    constrained = sum(int((r.constraint or {}).get(k, 0) or 0)
                      for r in results for k in ("actions", "format"))
    if constrained and not any(n.step is not None and n.step.grammar for r in results for n in r.tree.nodes):
        raise TrainError("online GRPO: constrained samples carry no Step.grammar (the engine did not "
                         "record it), so their masked logprobs cannot be recomputed; set "
                         "online.constrain=none")


def live_weights(module: Any) -> dict[str, Any]:
    """The policy LM's weights as CPU tensors, to push to sampling actors: PPO's value model
    sends its ``lm``; a LoRA model its merged weights (merged on a copy, the adapter stays)."""
    import copy

    import torch

    lm = module.lm if hasattr(module, "v_head") else module
    with torch.no_grad():
        if is_peft(lm):
            lm = copy.deepcopy(lm).merge_and_unload()
        return {k: v.detach().to("cpu") for k, v in lm.state_dict().items()}


def make_source(cfg: GRPOConfig, model: Any, tok: Any) -> tuple[Any, int | None]:
    """(batch source, total steps) for offline data or online sampling. Offline with dynamic
    sampling, the file's flat groups are dropped and counted (``source.stats``, logged with
    every step)."""
    builder = make_builder(cfg, model, tok)
    if cfg.online is None:
        rows = load_grpo(cfg.data, builder)
        counts: dict[str, float] = {}
        if drops_flat(cfg):  # before the advantages: the process terms are scaled over what trains
            rows, counts = split_flat(rows)
        rows = assign_advantages(rows, cfg.advantage, cfg.process_rewards)
        if len(rows) < cfg.batch_size:
            flat = f", {int(counts['groups_flat'])} of {int(counts['groups_sampled'])} groups " \
                   "had equal rewards" if counts else ""
            raise TrainError(f"{len(rows)} GRPO rows (after filtering{flat}) cannot fill a batch "
                             f"of {cfg.batch_size}")
        source = ListSource(rows, cfg.batch_size, seed=cfg.seed)
        source.stats = counts  # type: ignore[attr-defined]
        return source, None
    if cfg.max_steps is None:
        raise TrainError("online GRPO needs max_steps (rounds x steps_per_round)")
    if parse_executor(cfg.online.executor)[0] == "local":
        if cfg.online.ray_address:
            raise TrainError("online.ray_address needs online.executor=ray (e.g. ray:workers=4)")
    elif cfg.deepspeed is not None and cfg.deepspeed.stage == 3:
        raise TrainError("online.executor=ray pushes whole weights to its actors: "
                         "use deepspeed stage 2, not 3 (partitioned weights)")
    from omrl_search.api import load_tasks

    try:
        tasks = list(cfg.online.tasks) if cfg.online.tasks is not None else \
            load_tasks(cfg.online.env, cfg.online.split)
    except (KeyError, ValueError) as exc:
        raise TrainError(f"online.env/split: {exc.args[0]}") from None
    other = next((t.env for t in tasks if t.env != cfg.online.env), None)
    if other is not None:
        raise TrainError(f"online.tasks: a {other!r} task for online.env {cfg.online.env!r}")
    if not tasks:
        raise TrainError(f"env {cfg.online.env!r} has no {cfg.online.split!r} tasks")
    random.Random(cfg.seed).shuffle(tasks)
    return RolloutSource(cfg, tasks, builder, tok), cfg.max_steps


def with_stats(source: Any, cfg: GRPOConfig, pid: int, masks: Any = None):
    """collate (with the grammar masks of constrained samples) that also carries the latest
    rollout statistics into the logged metrics."""
    collate = layout_collate(cfg, pid, masks=masks)

    def fn(xs: list[TokenRow]) -> dict[str, Any]:
        batch = collate(xs)
        stats = getattr(source, "stats", None)
        if stats:
            batch["stats"] = {**batch.get("stats", {}), **stats}
        return batch
    return fn


def build(cfg: GRPOConfig) -> Runner:
    model, tok = load_model(cfg)
    reference = Reference(model) if cfg.kl_coef else None
    source, total = make_source(cfg, model, tok)
    collate = with_stats(source, cfg, pad_id(tok), grammar_masks(model, tok))
    return Runner(cfg, model, grpo_loss_fn(cfg, reference), source, collate,
                  tokenizer=tok, kind="grpo", total_steps=total)


def train(cfg: GRPOConfig) -> dict[str, Any]:
    return build(cfg).train()
