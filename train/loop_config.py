"""The loop's settings (:class:`LoopConfig`) and the trainers a round can run.

Its own module so that the loop's stages (:mod:`train.loop_stages`), its report and the loop
driver (:mod:`train.loop`) all depend on the settings, and the settings on none of them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

import omrl_search as om
from omrl_search.bench import parse_budgets, split_strategies
from omrl_search.budget import Budget
from omrl_search.env import env_class
from omrl_search.strategy import make_strategy
from omrl_search.types import DEFAULT_MAX_TOKENS

from .config import AgentName
from .loop_curriculum import CurriculumSettings, check_levels

#: the trainers a round can run; ``rs_sft`` is SFT on the round's own search successes
TRAINERS = ("sft", "rs_sft", "dpo", "grpo")
#: which trainer of :data:`train.trainers.TRAINERS` runs a loop trainer
TRAINER_OF = {"sft": "sft", "rs_sft": "sft", "dpo": "dpo", "grpo": "grpo"}


class LoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env: str = "game24"
    policy: str = "smollm2"  # the base policy: smollm2, an HF folder, or a policy spec (scripted:...)
    rounds: int = Field(2, ge=1)
    out: str = "runs/loop"
    seed: int = 0
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1)  # per step, in every search (configs set 16)
    temperature: float = Field(1.0, ge=0)
    # the agent format of every search, eval and demonstration (omrl_search.agent): react
    # (Think line, then Act), act (the Act line alone: a few tokens a step) or terse (the action
    # alone after a prompt of the task and observation only)
    agent: AgentName = "react"
    # search on the train split (without the dev slice's puzzles)
    train_limit: int = Field(64, ge=1)
    # which train tasks each round searches: the same ones every round (the pool's, or each
    # curriculum level's, first), or fresh ones, after those every earlier round took
    train_tasks: Literal["same", "fresh"] = "same"
    search_strategy: str = "best_of_n:n=4"
    search_budget: str = "tokens=4000"
    expert_demos: int = Field(0, ge=0)  # solver demonstrations added to round 1's data
    # more demonstrations than the train split holds: {level: count} of the curriculum levels'
    # own task streams (puzzles of the plain train split left out, so no dev puzzle and no pool
    # demonstration twice), added to round 1's data beside expert_demos
    expert_levels: dict[int | str, int] = Field(default_factory=dict)
    curriculum: CurriculumSettings | None = None
    # the PRM
    prm: bool = True
    prm_base: str = "smollm2"
    prm_settings: dict[str, Any] = Field(default_factory=lambda: {
        "max_steps": 60, "keep_layers": 8, "train_layers": 2, "batch_size": 8})
    label_rollouts: int = Field(0, ge=0)  # extra MC rollouts per step (0: the trees' own leaves)
    # what the PRM learns (omrl label --soft): mc (each step's share of successful finished
    # leaves below it), q (MCTS Q values, solver-proven wins and losses exact: the labels of
    # MCTS trees) or mean (their mean); with prm_settings.loss: pairwise for the pairwise loss
    prm_soft: Literal["mc", "q", "mean"] = "mc"
    # with prm_soft q: pass each proven win on to every step of the round's trees whose state the
    # env keys the same (omrl label --share-proofs; envs with Env.value_key: Game24, Countdown)
    prm_share_proofs: bool = False
    # label the solver demonstrations for the PRM too (all successes, worded unlike the policy:
    # they teach "solver-like = good", which a search over the policy's own steps cannot use)
    prm_demos: bool = True
    # policy training
    first: list[str] = Field(default_factory=lambda: ["sft"])
    then: list[str] = Field(default_factory=lambda: ["rs_sft", "dpo"])
    # per-round trainers (round r runs schedule[r-1], the last entry repeating); replaces first/then
    schedule: list[list[str]] | None = None
    rs_cap: int = Field(2, ge=1)  # rs_sft: distinct successful trajectories kept per task
    # rs_sft: the successes of this round's search and of the rounds before it (None: all of
    # them; 0: this round's alone), deduplicated together by the states they pass through, so
    # the policy keeps training on what it solved before instead of forgetting it
    rs_history: int | None = Field(None, ge=0)
    # dpo: which siblings pair (omrl export dpo --pairs): branch (the chosen leads to success,
    # the rejected not), qgap (MCTS Q values differ by >= dpo_margin, each proven or visited
    # dpo_min_visits times) or value
    dpo_pairs: Literal["branch", "qgap", "value"] = "branch"
    dpo_margin: float = Field(0.5, ge=0, allow_inf_nan=False)
    dpo_min_visits: int = Field(2, ge=1)
    # online GRPO's dense process rewards (PRIME-style, train.losses.process_advantages): none
    # (outcome only), prm (the round's PRM scores each step) or implicit (the implicit PRM of
    # the policy being trained against the run's starting policy), weighted by process_coef
    # relative to the outcome advantage (the process terms are rescaled to its size)
    process_rewards: Literal["none", "prm", "implicit"] = "none"
    process_coef: float = Field(0.5, ge=0, allow_inf_nan=False)
    trainer_settings: dict[str, dict[str, Any]] = Field(default_factory=lambda: {
        "sft": {"max_steps": 100, "lr": 5e-5, "batch_size": 4},
        "rs_sft": {"max_steps": 40, "lr": 2e-5, "batch_size": 4},
        "dpo": {"max_steps": 40, "lr": 5e-6, "batch_size": 2},
        "grpo": {"max_steps": 40, "lr": 2e-6, "batch_size": 4}})
    save_every: int = Field(10, ge=1)  # trainer checkpoints, for resuming a killed stage
    # keep-best: the dev slice (the last dev_limit train tasks; 0: every stage kept unchecked)
    dev_limit: int = Field(100, ge=0)
    # or the first dev_limit tasks of a train stream of its own (``train:KNOBS``; Countdown's
    # ``train:target=10-999`` has the train split's mix), less train- and test-split puzzles: a
    # dev slice as big as keep-best needs without taking tasks from the demonstrations and search
    dev_split: str | None = None
    dev_strategies: str = "react,best_of_n:n=4"
    dev_budget: str = "tokens=2000"
    keep_alpha: float = Field(0.05, gt=0, lt=1)
    # where training goes on from after a stage: best (the best checkpoint so far; a kept stage
    # that is not better is not trained on) or kept (the last stage not rejected: a run of small,
    # each insignificant, losses can then be built on, as a 100-task dev slice allows)
    continue_from: Literal["best", "kept"] = "best"
    # when a kept stage becomes the best (what the run hands back and, with continue_from: best,
    # what training goes on from): better (a strictly higher dev score) or not_worse (every kept
    # stage: the newest checkpoint the dev slice does not show to be worse than any former best)
    promote: Literal["better", "not_worse"] = "better"
    # evaluation on the test split (reported; no decision looks at it)
    test_limit: int = Field(200, ge=1)
    # the held-out tasks: test_limit of each split, a puzzle once; a test stream of its own
    # (Countdown's test:target=10-999, the test split's mix, no puzzle shared) adds power where
    # 200 tasks cannot tell two rounds apart (docs/loop.md: 600 held-out puzzles)
    test_splits: list[str] = Field(default_factory=lambda: ["test"], min_length=1)
    eval_strategies: str = "react,best_of_n,mcts"
    eval_budgets: str = "tokens=1000,4000"
    # after the last round: one search on the test split with the best checkpoint (and the last
    # round's PRM, which value=auto uses), results.json's search_on_best; None: not run. Adding
    # it to a finished run runs only this search (loop.json does not pin it)
    best_search: str | None = None
    best_budget: str = "tokens=5000"
    progress: bool = True

    def check(self) -> None:
        """Cross-field checks, as one-line errors."""
        env_class(self.env)
        make_strategy(self.search_strategy)
        Budget.parse(self.search_budget)
        for s in split_strategies(self.eval_strategies) + split_strategies(self.dev_strategies):
            make_strategy(s)
        parse_budgets(self.eval_budgets)
        if self.dev_split is not None:
            if self.dev_split.partition(":")[0] != "train":
                raise ValueError(f"dev_split: a train stream (train:KNOBS), got {self.dev_split!r}")
            om.load_tasks(self.env, self.dev_split, 1)  # a bad knob: its one ValueError line
        for split in self.test_splits:
            if split.partition(":")[0] != "test":
                raise ValueError(f"test_splits: test streams (test or test:KNOBS), got {split!r}")
            om.load_tasks(self.env, split, 1)
        if len(parse_budgets(self.dev_budget)[1]) != 1:
            raise ValueError(f"dev_budget: one budget, got {self.dev_budget!r}")
        if self.best_search is not None:
            if len(split_strategies(self.best_search)) != 1:
                raise ValueError(f"best_search: one strategy, got {self.best_search!r}")
            make_strategy(self.best_search)
            if len(parse_budgets(self.best_budget)[1]) != 1:
                raise ValueError(f"best_budget: one budget, got {self.best_budget!r}")
        if self.prm_share_proofs and self.prm_soft != "q":
            raise ValueError("prm_share_proofs passes proven wins between Q labels: set prm_soft: q")
        if self.schedule is not None and not self.schedule:
            raise ValueError("schedule: at least one round's trainers")
        for name in self.first + self.then + sum(self.schedule or [], []) + list(self.trainer_settings):
            if name not in TRAINERS:
                raise ValueError(f"unknown trainer {name!r} (one of {', '.join(TRAINERS)})")
        self._check_trainer_settings()
        if self.process_rewards != "none" and (self.trainer_settings.get("grpo") or {}).get("online") is None:
            raise ValueError("process_rewards: scores online GRPO's samples; set trainer_settings.grpo.online")
        if self.process_rewards == "prm" and not self.prm:
            raise ValueError("process_rewards: prm needs the loop's PRM (prm: true)")
        if self.curriculum is not None:
            check_levels(self.env, self.curriculum)
        if self.expert_levels:
            levels = self.curriculum.levels if self.curriculum is not None else []
            if not levels:
                raise ValueError("expert_levels: draws from the curriculum's levels; set curriculum")
            for level, count in self.expert_levels.items():
                if level not in levels or count < 0:
                    raise ValueError(f"expert_levels: {level}: {count} is not a curriculum level "
                                     f"({', '.join(map(str, levels))}) with a count >= 0")
        for key in ("policy", "prm_base"):  # before loop.json or any stage is written
            model = getattr(self, key)
            if key == "prm_base" and not self.prm:
                continue
            if model != "smollm2" and not Path(model).exists() and (key == "prm_base" or ":" not in model):
                raise ValueError(f"{key}: {model} does not exist (smollm2 or an HF model folder)")


    def _check_trainer_settings(self) -> None:
        """Each trainer's settings against its config model, so a bad key fails before round 0
        (not hours later, when its stage starts)."""
        from pydantic import ValidationError

        from .trainers import TRAINERS as trainers  # torch: the loop is about to run anyway

        for kind, settings in self.trainer_settings.items():
            try:
                trainers[TRAINER_OF[kind]].config.model_validate(settings)
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"trainer_settings.{kind}.{where}: {err['msg']}") from None

    def trainers(self, r: int) -> list[str]:
        """The trainers round ``r`` (from 1) runs, in order."""
        if self.schedule is not None:
            return list(self.schedule[min(r, len(self.schedule)) - 1])
        return list(self.first if r == 1 else self.then)
