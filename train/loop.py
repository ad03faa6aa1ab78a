"""run the closed loop: search -> PRM and policy training -> evaluation, round after round

``omrl loop --env game24 --policy smollm2 --rounds R --out runs/loop`` (settings from
:class:`LoopConfig`: defaults < ``--config FILE.yaml`` < flags < ``--set key=value``). Round 0
evaluates the base policy; each round ``r`` then

1. ``search`` — searches the train split with the current policy (guided by the current PRM),
   and in round 1 adds ``expert_demos`` solver demonstrations (``scripted:oracle:p=0``): a base
   model that never succeeds has nothing to imitate otherwise;
2. ``labels`` / ``prm`` — labels every step of the trees with Monte-Carlo values
   (:mod:`reward_models.labels`) and trains a PRM on the labels of all rounds so far;
3. ``data`` — exports SFT rows, DPO pairs and GRPO groups (:mod:`omrl_search.exports`);
4. ``policy`` — trains the policy from the current one: the ``first`` trainers in round 1
   (SFT), the ``then`` trainers later (DPO and/or GRPO). A trainer with no rows is skipped,
   and the skip is recorded;
5. ``eval`` — :func:`omrl_search.bench.bench` of every eval strategy on the test split at fixed
   budgets, with the round's policy and PRM; ``round_R/report.md`` holds the table of every
   round so far.

Every stage calls Python functions (``search_many``, ``label_results``, ``export``, the trainers
of :data:`train.trainers.TRAINERS`, ``bench``, the HTML report's ``collect``/``render``), never
the command line.

Each stage works in ``NAME.partial/`` and becomes ``NAME/`` (with ``stage.json``) only when it has
finished, so a loop killed anywhere and started again with the same command redoes only the
unfinished stage; trainers inside it resume from their checkpoints (bit-exact on CPU), searches
are seeded, so the results equal an unbroken run's. A run folder remembers its settings
(``loop.json``) and refuses to continue under different ones.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field

import omrl_search as om
from omrl_search.bench import bench, parse_budgets, split_strategies
from omrl_search.budget import Budget
from omrl_search.env import env_class
from omrl_search.exports import ExportError, export
from omrl_search.policy import PolicyError, make_policy
from omrl_search.report import collect, render
from omrl_search.result import read_results, write_text_atomic
from omrl_search.strategy import make_strategy
from omrl_search.types import SamplingParams
from reward_models.label_files import write_labels
from reward_models.labels import label_results, summarize_rows

from . import prm as prm_trainer
from .config import TrainError, settings_from_sources

#: the trainers a round can run: the kinds ``omrl export`` writes from search trees
TRAINERS = ("sft", "dpo", "grpo")
#: the loop's completion tokens per step, in every search and evaluation: a loop setting, shorter
#: than the search default (:data:`omrl_search.types.DEFAULT_MAX_TOKENS`) so rounds on a CPU stay
#: short; the loop's measured runs used it (``--max-tokens`` / ``max_tokens:`` change it)
LOOP_MAX_TOKENS = 48


class LoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    env: str = "game24"
    policy: str = "smollm2"  # the base policy: smollm2 or an HF folder
    rounds: int = Field(2, ge=1)
    out: str = "runs/loop"
    seed: int = 0
    max_tokens: int = Field(LOOP_MAX_TOKENS, ge=1)  # completion tokens per step, in every search
    temperature: float = Field(1.0, ge=0)
    # search on the train split
    train_limit: int = Field(64, ge=1)
    search_strategy: str = "best_of_n:n=4"
    search_budget: str = "tokens=4000"
    expert_demos: int = Field(0, ge=0)  # solver demonstrations added to round 1's data
    # the PRM
    prm: bool = True
    prm_base: str = "smollm2"
    prm_settings: dict[str, Any] = Field(default_factory=lambda: {
        "max_steps": 60, "keep_layers": 8, "train_layers": 2, "batch_size": 8})
    label_rollouts: int = Field(0, ge=0)  # extra MC rollouts per step (0: the trees' own leaves)
    # policy training
    first: list[str] = Field(default_factory=lambda: ["sft"])
    then: list[str] = Field(default_factory=lambda: ["dpo"])
    trainer_settings: dict[str, dict[str, Any]] = Field(default_factory=lambda: {
        "sft": {"max_steps": 100, "lr": 5e-5, "batch_size": 4},
        "dpo": {"max_steps": 40, "lr": 5e-6, "batch_size": 2},
        "grpo": {"max_steps": 40, "lr": 2e-6, "batch_size": 4}})
    save_every: int = Field(10, ge=1)  # trainer checkpoints, for resuming a killed stage
    # evaluation on the test split
    test_limit: int = Field(20, ge=1)
    eval_strategies: str = "react,best_of_n,mcts"
    eval_budgets: str = "tokens=1000,4000"
    progress: bool = True

    def check(self) -> None:
        """Cross-field checks, as one-line errors."""
        env_class(self.env)
        make_strategy(self.search_strategy)
        Budget.parse(self.search_budget)
        for s in split_strategies(self.eval_strategies):
            make_strategy(s)
        parse_budgets(self.eval_budgets)
        for name in self.first + self.then + list(self.trainer_settings):
            if name not in TRAINERS:
                raise ValueError(f"unknown trainer {name!r} (one of {', '.join(TRAINERS)})")
        for key in ("policy", "prm_base"):  # before loop.json or any stage is written
            model = getattr(self, key)
            if model != "smollm2" and not Path(model).exists():
                raise ValueError(f"{key}: {model} does not exist (smollm2 or an HF model folder)")


class LoopError(Exception):
    """A stage failed; the message says which and why."""


# --- stages ------------------------------------------------------------------------------------
class Run:
    """A loop folder: finished stages are ``NAME/stage.json``; the rest is redone."""

    def __init__(self, cfg: LoopConfig):
        self.cfg = cfg
        self.root = Path(cfg.out)

    def open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        saved = self.root / "loop.json"
        mine = self.cfg.model_dump(exclude={"rounds", "progress"})
        if saved.exists():
            before = json.loads(saved.read_text())
            diff = sorted(k for k in set(before) | set(mine) if before.get(k) != mine.get(k))
            if diff:
                raise LoopError(f"{self.root} was started with other settings ({', '.join(diff)}); "
                                "use another --out")
        else:
            _write_json(saved, mine)

    def stage(self, name: str, fn: Callable[[Path], dict[str, Any]]) -> dict[str, Any]:
        """Run ``fn(partial_dir)`` unless ``name`` has finished; returns its ``stage.json``."""
        final = self.root / name
        if (final / "stage.json").exists():
            return json.loads((final / "stage.json").read_text())
        if final.exists():
            shutil.rmtree(final)
        partial = final.with_name(final.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        print(f"[loop] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        info = fn(partial)
        info["seconds"] = round(time.perf_counter() - t0, 1)
        _write_json(partial / "stage.json", info)
        partial.rename(final)
        print(f"[loop] {name} done in {info['seconds']} s", file=sys.stderr, flush=True)
        return info


def _write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def policy_spec(model: str) -> str:
    """The search-side spec of a training-side model (``smollm2`` or an HF folder)."""
    return model if model == "smollm2" else f"hf:{model}"


def search_stage(cfg: LoopConfig, r: int, model: str, prm: str | None) -> Callable[[Path], dict]:
    def run(d: Path) -> dict[str, Any]:
        tasks = om.load_tasks(cfg.env, "train", cfg.train_limit)
        sampling = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens)
        results = om.search_many(tasks, strategy=cfg.search_strategy, policy=policy_spec(model),
                                 reward_model=f"prm:{prm}" if prm else None,
                                 budget=cfg.search_budget, seed=cfg.seed + r, sampling=sampling,
                                 progress=cfg.progress)
        om.write_results(d / "results.jsonl", results)
        info = {"policy": policy_spec(model), "search": om.summarize(results)}
        if r == 1 and cfg.expert_demos:
            demos = om.search_many(om.load_tasks(cfg.env, "train", cfg.expert_demos),
                                   strategy="react", policy="scripted:oracle:p=0", seed=cfg.seed)
            om.write_results(d / "demos.jsonl", demos)
            info["demos"] = om.summarize(demos)
        return info
    return run


def _search_files(cfg: LoopConfig, r: int) -> list[Path]:
    """The round's search results, then its solver demonstrations (if any)."""
    d = cfg_path(cfg, r, "search")
    return [d / "results.jsonl"] + ([d / "demos.jsonl"] if (d / "demos.jsonl").exists() else [])


def labels_stage(cfg: LoopConfig, r: int, model: str) -> Callable[[Path], dict]:
    def run(d: Path) -> dict[str, Any]:
        results = [res for f in _search_files(cfg, r) for res in read_results(f)]
        policy = make_policy(policy_spec(model)) if cfg.label_rollouts else None
        rows = label_results(results, policy=policy, rollouts=cfg.label_rollouts, seed=cfg.seed + r,
                             sampling=SamplingParams(cfg.temperature, max_tokens=cfg.max_tokens))
        if not rows:
            return {"rows": 0, "note": "no finished rollouts to label"}
        write_labels(rows, d)
        return summarize_rows(rows)
    return run


def prm_stage(cfg: LoopConfig, r: int) -> Callable[[Path], dict]:
    def run(d: Path) -> dict[str, Any]:
        folders = [str(cfg_path(cfg, k, "labels")) for k in range(1, r + 1)
                   if any(cfg_path(cfg, k, "labels").glob("*.parquet"))]
        if not folders:
            return {"trained": False, "note": "no label rows yet"}
        settings = {**cfg.prm_settings, "model": cfg.prm_base, "data": folders, "out": str(d / "model"),
                    "seed": cfg.seed, "save_every": cfg.save_every, "resume": True,
                    "progress": cfg.progress}
        result = prm_trainer.train(prm_trainer.PRMConfig.from_sources(None, settings))
        return {"trained": True, "model": str(cfg_path(cfg, r, "prm") / "model"),
                "validation": result.get("validation")}
    return run


def data_stage(cfg: LoopConfig, r: int) -> Callable[[Path], dict]:
    def run(d: Path) -> dict[str, Any]:
        sources = _search_files(cfg, r)
        rows: dict[str, Any] = {}
        for kind in TRAINERS:
            try:
                _, rows[kind] = export(kind, sources if kind == "sft" else sources[:1],
                                       d / f"{kind}.parquet", tokenizer=cfg.policy)
            except ExportError as exc:
                rows[kind] = 0
                rows[f"{kind}_note"] = str(exc)
        return {"rows": rows}
    return run


def policy_stage(cfg: LoopConfig, r: int, model: str) -> Callable[[Path], dict]:
    def run(d: Path) -> dict[str, Any]:
        from .trainers import TRAINERS as trainers  # torch: imported when a trainer runs, not by `omrl --help`

        data = cfg_path(cfg, r, "data")
        current, trained = model, []
        for kind in (cfg.first if r == 1 else cfg.then):
            path = data / f"{kind}.parquet"
            if not path.exists():
                trained.append({"trainer": kind, "skipped": "no rows exported"})
                continue
            if kind == "grpo" and _all_groups_flat(path):
                trained.append({"trainer": kind, "skipped": "every group's rewards are equal (no signal)"})
                continue
            out = d / kind
            trainer = trainers[kind]
            settings = {**cfg.trainer_settings.get(kind, {}), "model": current, "data": [str(path)],
                        "out": str(out), "seed": cfg.seed + r, "save_every": cfg.save_every,
                        "resume": True, "progress": cfg.progress}
            conf = trainer.config.from_sources(None, settings)
            if not (out / "omrl-train.json").exists():  # not finished before a restart
                trainer.train(conf)
            last = _last_metrics(out)
            current = str(cfg_path(cfg, r, "policy") / kind)
            trained.append({"trainer": kind, "model": current,
                            **{k: last.get(k) for k in ("step", "loss") if k in last}})
        return {"model": current, "trained": trained}
    return run


def _all_groups_flat(path: Path) -> bool:
    """Whether no GRPO group has two different rewards: group-relative advantages are then all
    zero and a GRPO stage would only spend time."""
    import pyarrow.parquet as pq  # 0.4 s that `omrl --help` (it imports this module) need not pay

    spread: dict[Any, set[float]] = {}
    table = pq.read_table(path)
    target = "value" if "value" in table.column_names else "reward"  # older exports: reward
    for row in table.select(["group_id", target]).to_pylist():
        spread.setdefault(row["group_id"], set()).add(row[target])
    return all(len(rewards) <= 1 for rewards in spread.values())


def _last_metrics(out: Path) -> dict[str, Any]:
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    for line in reversed(lines):  # the last complete line (a kill can tear the last one)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}


def eval_stage(cfg: LoopConfig, model: str, prm: str | None) -> Callable[[Path], dict]:
    def run(d: Path) -> dict[str, Any]:
        summary = bench(om.load_tasks(cfg.env, "test", cfg.test_limit), cfg.eval_strategies,
                        cfg.eval_budgets, policy=policy_spec(model),
                        reward_model=f"prm:{prm}" if prm else None, seed=cfg.seed,
                        max_tokens=cfg.max_tokens, temperature=cfg.temperature, out=d,
                        save_trees=True, progress=cfg.progress)
        return {"policy": policy_spec(model), "prm": prm,
                "success": {name: {b: s["success_rate"] for b, s in per.items()}
                            for name, per in summary["strategies"].items()}}
    return run


def cfg_path(cfg: LoopConfig, r: int, stage: str) -> Path:
    return Path(cfg.out) / f"round_{r}" / stage


# --- the loop ------------------------------------------------------------------------------------
def run_loop(cfg: LoopConfig) -> dict[str, Any]:
    """Run (or finish) every round; returns the per-round eval success table."""
    cfg.check()
    run = Run(cfg)
    run.open()
    model, prm = cfg.policy, None
    history: list[dict[str, Any]] = [{"round": 0, "eval": run.stage("round_0/eval", eval_stage(cfg, model, None))}]
    for r in range(1, cfg.rounds + 1):
        info: dict[str, Any] = {"round": r}
        info["search"] = run.stage(f"round_{r}/search", search_stage(cfg, r, model, prm))
        if cfg.prm:
            info["labels"] = run.stage(f"round_{r}/labels", labels_stage(cfg, r, model))
            info["prm"] = run.stage(f"round_{r}/prm", prm_stage(cfg, r))
            prm = info["prm"].get("model") or prm
        info["data"] = run.stage(f"round_{r}/data", data_stage(cfg, r))
        info["policy"] = run.stage(f"round_{r}/policy", policy_stage(cfg, r, model))
        model = info["policy"]["model"]
        info["eval"] = run.stage(f"round_{r}/eval", eval_stage(cfg, model, prm))
        history.append(info)
        text = round_report(cfg, history)
        write_text_atomic(run.root / f"round_{r}" / "report.md", text)
        write_text_atomic(run.root / "report.md", text)
    return {h["round"]: h["eval"]["success"] for h in history}


def round_report(cfg: LoopConfig, history: list[dict[str, Any]]) -> str:
    """The eval table of every round so far, then what each round searched and trained."""
    rounds = [h["round"] for h in history]
    lines = [f"# omrl loop: {cfg.env}, base policy `{cfg.policy}`, rounds 0-{rounds[-1]}", "",
             f"Success rate on {cfg.test_limit} test tasks (round 0: the base policy; "
             "round r: after r rounds of search and training; PRM-guided from round 1).", "",
             "| strategy | budget | " + " | ".join(f"round {r}" for r in rounds) + " |",
             "|---|---|" + "---|" * len(rounds)]
    first = history[0]["eval"]["success"]
    for name, per in first.items():
        for budget in per:
            cells = [f"{h['eval']['success'].get(name, {}).get(budget, float('nan')):.2f}" for h in history]
            lines.append(f"| {name} | {budget} | " + " | ".join(cells) + " |")
    lines += ["", "| round | train-split search success | demos | PRM val AUC | rows sft/dpo/grpo | trained |",
              "|---|---|---|---|---|---|"]
    for h in history[1:]:
        s = h["search"]["search"]
        val = (h.get("prm") or {}).get("validation") or {}
        rows = h["data"]["rows"]
        trained = ", ".join(t["trainer"] + (f" (skipped: {t['skipped']})" if "skipped" in t
                                            else f" {t.get('step', '?')} steps, loss {t.get('loss', float('nan')):.3f}")
                            for t in h["policy"]["trained"])
        auc = val.get("auc")
        lines.append(f"| {h['round']} | {s['successes']}/{s['tasks']} | {h['search'].get('demos', {}).get('tasks', 0)} | "
                     f"{'-' if auc is None else f'{auc:.3f}'} | {rows['sft']}/{rows['dpo']}/{rows['grpo']} | {trained} |")
    return "\n".join(lines) + "\n"


# --- the command ---------------------------------------------------------------------------------
FLAGS = {"env": str, "policy": str, "rounds": int, "out": str, "seed": int, "max_tokens": int,
         "train_limit": int, "test_limit": int, "search_strategy": str, "search_budget": str,
         "expert_demos": int, "prm_base": str}


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a YAML file of LoopConfig settings")
    for key, typ in FLAGS.items():
        p.add_argument("--" + key.replace("_", "-"), type=typ, default=None)
    p.add_argument("--strategies", dest="eval_strategies", help="eval strategies, comma-separated")
    p.add_argument("--budgets", dest="eval_budgets", help="eval budgets, e.g. tokens=1000,4000")
    p.add_argument("--no-prm", action="store_true", help="no PRM: skip labelling and PRM training")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any setting, e.g. trainer_settings.sft.max_steps=150 (repeatable)")


def config_from_args(args: argparse.Namespace) -> LoopConfig:
    flags = {k: getattr(args, k) for k in (*FLAGS, "eval_strategies", "eval_budgets")
             if getattr(args, k, None) is not None}
    if args.no_prm:
        flags["prm"] = False
    if args.no_progress:
        flags["progress"] = False
    base = settings_from_sources(LoopConfig, args.config, list(args.set))
    return settings_from_sources(LoopConfig, None, {**base.model_dump(), **flags})


def html_report(root: Path) -> Path:
    """``root/report.html``: the page ``omrl report`` makes (plots, rounds, trees)."""
    page = root / "report.html"
    write_text_atomic(page, render(collect(root)))
    return page


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        run_loop(cfg)
    except (LoopError, TrainError, PolicyError) as exc:
        print(f"omrl loop: error: {exc}", file=sys.stderr)
        return 2
    print((Path(cfg.out) / "report.md").read_text())
    print(f"wrote {html_report(Path(cfg.out))}")
    return 0
