"""The stages of ``omrl loop`` (:mod:`train.loop`): each a function of the stage's working folder
returning what its ``stage.json`` records. They call Python functions (``search_many``,
``label_results``, ``export``, the trainers, ``bench``), never the command line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Sequence

import omrl_search as om
from omrl_search.bench import bench, per_task
from omrl_search.exports import ExportError, export
from omrl_search.host import host_info, policy_dtype
from omrl_search.policy import make_policy
from omrl_search.result import read_results
from omrl_search.types import SamplingParams, Task

from . import loop_curriculum as curriculum
from .config import TrainError
from .loop_config import TRAINER_OF, TRAINERS, LoopConfig
from .loop_select import check_disjoint, decide, dev_score, dev_slice, without




def policy_spec(model: str) -> str:
    """The search-side spec of a training-side model: ``smollm2``, a policy spec
    (``scripted:oracle``, ``hf:DIR``) as is, an HF folder as ``hf:DIR``."""
    if model == "smollm2" or (":" in model and not Path(model).exists()):
        return model
    return f"hf:{model}"


def tokenizer_of(model: str) -> str | None:
    """The tokenizer exports re-encode with: the model's own (none for a non-HF policy spec)."""
    return model if model == "smollm2" or Path(model).exists() else None


def cfg_path(cfg: "LoopConfig", r: int, stage: str) -> Path:
    return Path(cfg.out) / f"round_{r}" / stage


def _write_json(path: Path, obj: Any) -> None:
    from omrl_search.result import write_text_atomic

    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


# --- task sets -------------------------------------------------------------------------------------
class TaskSets:
    """The run's dev slice (the end of the train split, or ``dev_split``'s first tasks), the train
    pool (the rest of the train split, without the dev puzzles) and the test tasks."""

    def __init__(self, cfg: "LoopConfig"):
        train = om.load_tasks(cfg.env, "train")
        self.cfg = cfg
        if cfg.dev_split is None:
            if cfg.dev_limit >= len(train):
                raise TrainError(f"dev_limit {cfg.dev_limit} leaves no train task ({cfg.env} has {len(train)})")
            self.dev = dev_slice(train, cfg.dev_limit)
            self.pool = without(train[:len(train) - cfg.dev_limit], self.dev)
        else:  # a stream of its own: the whole train split stays for demonstrations and search
            self.dev = self._own_dev(train)
            self.pool = without(train, self.dev)
        if cfg.expert_demos > len(self.pool):  # not silently fewer than asked
            raise TrainError(f"expert_demos {cfg.expert_demos} is more than the {len(self.pool)} {cfg.env} "
                             f"train tasks outside the dev slice (dev_limit {cfg.dev_limit})")
        self.demos = self.pool[:cfg.expert_demos] + self._level_demos(train)

    def _own_dev(self, train: list[Task]) -> list[Task]:
        """``dev_split``'s first ``dev_limit`` tasks whose puzzles are in neither the train nor
        the test split."""
        cfg = self.cfg
        held = train + om.load_tasks(cfg.env, "test") + self.test()  # all of the test split, and the streams
        dev = without(om.load_tasks(cfg.env, cfg.dev_split), held)[:cfg.dev_limit]
        if len(dev) < cfg.dev_limit:  # not silently a smaller slice than asked
            raise TrainError(f"dev_split {cfg.dev_split} has {len(dev)} {cfg.env} tasks outside the "
                             f"train and test splits, not dev_limit {cfg.dev_limit}")
        return dev

    def _level_demos(self, train: list[Task]) -> list[Task]:
        """``expert_levels``' tasks: each level's own stream without the train split's puzzles."""
        out: list[Task] = []
        for level, count in self.cfg.expert_levels.items():
            tasks = curriculum.level_tasks(self.cfg.env, self.cfg.curriculum, level, train + self.dev, 0, count)
            if len(tasks) < count:  # not silently fewer than asked
                raise TrainError(f"expert_levels: level {level} has {len(tasks)} {self.cfg.env} tasks "
                                 f"outside the train split, not {count}")
            out += tasks
        return out

    def test(self) -> list[Task]:
        """``test_limit`` tasks of each of ``test_splits``, in order, a puzzle once."""
        out: list[Task] = []
        for split in self.cfg.test_splits:
            out += without(om.load_tasks(self.cfg.env, split, self.cfg.test_limit), out)
        return out


def _searcher(cfg: "LoopConfig", r: int, model: str, prm: str | None) -> Callable[[list[Task]], list]:
    """Search tasks with the round's policy and PRM (each built once, on first use)."""
    built: dict[str, Any] = {}

    def search(tasks: list[Task]) -> list:
        if "policy" not in built:
            from omrl_search.reward import make_reward_model

            built["policy"] = make_policy(policy_spec(model))
            built["rm"] = make_reward_model(f"prm:{prm}") if prm else None
        return om.search_many(tasks, strategy=cfg.search_strategy, policy=built["policy"],
                              reward_model=built["rm"], budget=cfg.search_budget, seed=cfg.seed + r,
                              sampling=SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens),
                              progress=cfg.progress, agent=cfg.agent)
    search.built = built  # type: ignore[attr-defined]  # the search stage records the policy's dtype
    return search


# --- search --------------------------------------------------------------------------------------
def curriculum_stage(cfg: "LoopConfig", sets: TaskSets, r: int, model: str, prm: str | None):
    def run(d: Path) -> dict[str, Any]:
        starts = fresh_starts(cfg, r)
        info, results = curriculum.probe(cfg.env, cfg.curriculum, sets.dev, _searcher(cfg, r, model, prm), starts)
        if starts is not None:
            info["starts"] = starts
        for i, name in enumerate(cfg.curriculum.names()):
            if results[name]:
                check_disjoint([x.task for x in results[name]], sets.dev)
                om.write_results(d / f"probe_{i}.jsonl", results[name])
        return info
    return run


def fresh_starts(cfg: "LoopConfig", r: int) -> dict[str, int] | None:
    """With ``train_tasks: fresh``, where round ``r``'s tasks start in each curriculum level's
    stream: after all that the rounds before took (their curriculum records say which levels they
    chose); None with ``same`` (every round from the start)."""
    if cfg.train_tasks == "same":
        return None
    starts = dict.fromkeys(cfg.curriculum.names(), 0)
    for q in range(1, r):
        chosen = json.loads((cfg_path(cfg, q, "curriculum") / "stage.json").read_text())["chosen"]
        for name, n in curriculum.taken(cfg.curriculum, chosen, cfg.train_limit).items():
            starts[name] += n
    return starts


def search_stage(cfg: "LoopConfig", sets: TaskSets, r: int, model: str, prm: str | None,
                 plan: dict[str, Any] | None = None):
    """The round's train-split search: ``train_limit`` tasks of the pool, or with a curriculum
    (``plan``: the curriculum stage's record) tasks of the chosen levels, the probed ones' results
    reused and, with fresh train tasks, the rest from after them (``plan["starts"]``); in round 1
    also the solver demonstrations (``expert_demos``, ``expert_levels``)."""
    def run(d: Path) -> dict[str, Any]:
        search = _searcher(cfg, r, model, prm)
        info: dict[str, Any] = {"policy": policy_spec(model)}
        if plan is None:
            results = search(pool_window(cfg, sets, r))
        else:
            results = []
            names, starts = cfg.curriculum.names(), plan.get("starts")
            for name, want in curriculum.quotas(cfg.train_limit, plan["chosen"]).items():
                i = names.index(name)
                probe = cfg_path(cfg, r, "curriculum") / f"probe_{i}.jsonl"
                reused = list(read_results(probe))[:want] if probe.exists() else []
                more = curriculum.level_tasks(cfg.env, cfg.curriculum, cfg.curriculum.levels[i], sets.dev,
                                              (starts or {}).get(name, 0) + cfg.curriculum.probe_limit,
                                              max(0, want - len(reused)), exact=starts is not None)
                results += reused + (search(more) if more else [])
            info["levels"] = plan["chosen"]
        check_disjoint([x.task for x in results], sets.dev)
        om.write_results(d / "results.jsonl", results)
        info["search"] = om.summarize(results)
        # what the search ran on: bf16 on CPUs with native bf16, float32 elsewhere (the backend's choice)
        info["host"], info["dtype"] = host_info(), policy_dtype(search.built.get("policy"))
        if r == 1 and sets.demos:
            demos = om.search_many(sets.demos, strategy="react",
                                   policy="scripted:oracle:p=0", seed=cfg.seed, agent=cfg.agent)
            om.write_results(d / "demos.jsonl", demos)
            info["demos"] = om.summarize(demos)
        return info
    return run


def pool_window(cfg: "LoopConfig", sets: TaskSets, r: int) -> list[Task]:
    """Round ``r``'s train tasks without a curriculum: the pool's first ``train_limit``, or with
    ``train_tasks: fresh`` the ``r``-th ``train_limit`` of it (a TrainError if the pool is shorter)."""
    start = 0 if cfg.train_tasks == "same" else (r - 1) * cfg.train_limit
    if cfg.train_tasks == "fresh" and start + cfg.train_limit > len(sets.pool):
        raise TrainError(f"train_tasks fresh: round {r} needs {start + cfg.train_limit} {cfg.env} train "
                         f"tasks, the pool has {len(sets.pool)}")
    return sets.pool[start:start + cfg.train_limit]


def search_files(cfg: "LoopConfig", r: int) -> list[Path]:
    """The round's search results, then its solver demonstrations (if any)."""
    d = cfg_path(cfg, r, "search")
    return [d / "results.jsonl"] + ([d / "demos.jsonl"] if (d / "demos.jsonl").exists() else [])


# --- labels and the PRM --------------------------------------------------------------------------
def labels_stage(cfg: "LoopConfig", r: int, model: str):
    def run(d: Path) -> dict[str, Any]:
        from reward_models.label_files import write_labels
        from reward_models.labels import label_results, summarize_rows

        files = search_files(cfg, r) if cfg.prm_demos else search_files(cfg, r)[:1]
        results = [res for f in files for res in read_results(f)]
        policy = make_policy(policy_spec(model)) if cfg.label_rollouts else None
        rows = label_results(results, policy=policy, rollouts=cfg.label_rollouts, seed=cfg.seed + r,
                             sampling=SamplingParams(cfg.temperature, max_tokens=cfg.max_tokens),
                             soft=cfg.prm_soft, share_proofs=cfg.prm_share_proofs)
        if not rows:
            return {"rows": 0, "note": "no finished rollouts to label"}
        write_labels(rows, d)
        return summarize_rows(rows)
    return run


def prm_stage(cfg: "LoopConfig", r: int):
    def run(d: Path) -> dict[str, Any]:
        from . import prm as prm_trainer
        from .loop_prm import calibration

        folders = [str(cfg_path(cfg, k, "labels")) for k in range(1, r + 1)
                   if any(cfg_path(cfg, k, "labels").glob("*.parquet"))]
        if not folders:
            return {"trained": False, "note": "no label rows yet"}
        settings = {**cfg.prm_settings, "model": cfg.prm_base, "data": folders, "out": str(d / "model"),
                    "seed": cfg.seed, "save_every": cfg.save_every, "resume": True,
                    "progress": cfg.progress}
        conf = prm_trainer.PRMConfig.from_sources(None, settings)
        result = prm_trainer.train(conf)
        return {"trained": True, "model": str(cfg_path(cfg, r, "prm") / "model"),
                "validation": result.get("validation"),
                "calibration": calibration(d / "model", folders, conf.val_fraction)
                if conf.objective == "process" else None}
    return run


# --- training data and policy training -------------------------------------------------------------
def data_stage(cfg: "LoopConfig", r: int):
    def run(d: Path) -> dict[str, Any]:
        sources = search_files(cfg, r)
        tok = tokenizer_of(cfg.policy)
        rows: dict[str, Any] = {}
        mixed = rs_rounds(cfg, r)
        # sft: search successes and solver demos; rs_sft: the search's own successes, this
        # round's and rs_history rounds' before, deduplicated by state path, at most rs_cap per
        # task; dpo/grpo: the search's trees
        files = {"sft": sources, "rs_sft": [search_files(cfg, q)[0] for q in mixed]}
        opts = {"rs_sft": {"cap": cfg.rs_cap},
                "dpo": {"pairs": cfg.dpo_pairs, "margin": cfg.dpo_margin, "min_visits": cfg.dpo_min_visits}}
        for kind in TRAINERS:
            what = "rs-sft" if kind == "rs_sft" else kind
            try:
                _, rows[kind] = export(what, files.get(kind, sources[:1]), d / f"{kind}.parquet",
                                       tokenizer=tok, **opts.get(kind, {}))
            except ExportError as exc:
                rows[kind] = 0
                rows[f"{kind}_note"] = str(exc)
        rows["rs_sft_rounds"] = mixed
        return {"rows": rows}
    return run


def rs_rounds(cfg: "LoopConfig", r: int) -> list[int]:
    """The rounds whose search results RS-SFT of round ``r`` learns from: ``r`` and the
    ``rs_history`` rounds before it (all earlier rounds when None) that have any."""
    first = 1 if cfg.rs_history is None else max(1, r - cfg.rs_history)
    return [q for q in range(first, r + 1) if search_files(cfg, q)[0].exists()]


def run_trainer(kind: str, settings: dict[str, Any]) -> str:
    """Train ``kind`` (a loop trainer) with ``settings`` unless its output is already finished;
    returns the trained model (the output folder). Tests replace this with scripted stages."""
    from .trainers import TRAINERS as trainers  # torch: imported when a trainer runs

    trainer = trainers[TRAINER_OF[kind]]
    conf = trainer.config.from_sources(None, settings)
    out = Path(settings["out"])
    if not (out / "omrl-train.json").exists():  # not finished before a restart
        trainer.train(conf)
    return str(out)


def online_grpo(cfg: "LoopConfig") -> bool:
    """Whether the loop's GRPO samples its own groups (``trainer_settings.grpo.online`` set, even
    to ``{}``) rather than training on the round's exported groups."""
    return (cfg.trainer_settings.get("grpo") or {}).get("online") is not None


def train_tasks(cfg: "LoopConfig", sets: TaskSets, plan: dict[str, Any] | None) -> list[Task]:
    """The train tasks online GRPO samples from: the curriculum's chosen levels (``plan``), else
    the pool; never a dev-slice puzzle."""
    if plan is None:
        return list(sets.pool)
    return [t for name in plan["chosen"]
            for t in curriculum.level_tasks(cfg.env, cfg.curriculum, name, sets.dev)]


def online_settings(cfg: "LoopConfig", tasks: Sequence[Task]) -> dict[str, Any]:
    """Online GRPO's ``online`` settings in the loop: the run's agent format, tokens a step and
    temperature unless ``trainer_settings.grpo.online`` says otherwise, and always the run's
    env and ``tasks``."""
    mine = {"agent": cfg.agent, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    return {**mine, **cfg.trainer_settings["grpo"]["online"], "env": cfg.env, "tasks": list(tasks)}


def process_spec(cfg: "LoopConfig", model: str, prm: str | None) -> str | None:
    """The reward model that gives online GRPO its dense process rewards (``process_rewards``):
    the round's PRM, or the implicit PRM of ``model`` against the run's starting policy."""
    if cfg.process_rewards == "prm":
        return f"prm:{prm}" if prm else None
    if cfg.process_rewards == "implicit":
        return f"implicit:{policy_spec(model)},ref={policy_spec(cfg.policy)}"
    return None


def train_stage(cfg: "LoopConfig", r: int, kind: str, model: str, sets: TaskSets | None = None,
                plan: dict[str, Any] | None = None, prm: str | None = None):
    """One trainer from the current policy; the model path is where the stage ends up. Online
    GRPO (:func:`online_grpo`) samples :func:`train_tasks` (``sets``, ``plan``) with the policy it
    trains, so flat groups are replaced by new ones (dynamic sampling) instead of only dropped,
    with dense process rewards from :func:`process_spec` (``prm``: the round's PRM) when asked."""
    def run(d: Path) -> dict[str, Any]:
        settings = {**cfg.trainer_settings.get(kind, {}), "model": model,
                    "out": str(d / "model"), "seed": cfg.seed + r, "save_every": cfg.save_every,
                    "resume": True, "progress": cfg.progress}
        if kind == "grpo" and online_grpo(cfg):
            tasks = train_tasks(cfg, sets, plan)
            if not tasks:
                return {"trainer": kind, "from": model, "skipped": "no train tasks to sample"}
            settings["online"] = online_settings(cfg, tasks)
            spec = process_spec(cfg, model, prm)
            if spec:
                settings["process_rewards"] = {"model": spec, "coef": cfg.process_coef}
            elif cfg.process_rewards != "none":
                return {"trainer": kind, "from": model, "skipped": "no PRM trained yet for process rewards"}
        else:
            path = cfg_path(cfg, r, "data") / f"{kind}.parquet"
            if not path.exists():
                return {"trainer": kind, "from": model, "skipped": "no rows exported"}
            if kind == "grpo" and all_groups_flat(path):
                return {"trainer": kind, "from": model,
                        "skipped": "every group's rewards are equal (no signal)"}
            settings["data"] = [str(path)]
        trained = run_trainer(kind, settings)
        final = cfg_path(cfg, r, f"train_{kind}") / "model"
        model_out = str(final) if Path(trained) == d / "model" else trained
        last = last_metrics(d / "model")
        return {"trainer": kind, "from": model, "model": model_out,
                **{k: last.get(k) for k in ("step", "loss") if k in last}}
    return run


def all_groups_flat(path: Path) -> bool:
    """Whether no GRPO group has two different rewards: group-relative advantages are then all
    zero and a GRPO stage would only spend time."""
    import pyarrow.parquet as pq  # 0.4 s that `omrl --help` (it imports this module) need not pay

    spread: dict[Any, set[float]] = {}
    table = pq.read_table(path)
    target = "value" if "value" in table.column_names else "reward"  # older exports: reward
    for row in table.select(["group_id", target]).to_pylist():
        spread.setdefault(row["group_id"], set()).add(row[target])
    return all(len(rewards) <= 1 for rewards in spread.values())


def last_metrics(out: Path) -> dict[str, Any]:
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    for line in reversed(lines):  # the last complete line (a kill can tear the last one)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    return {}


# --- evaluations -----------------------------------------------------------------------------------
def bench_tasks(cfg: "LoopConfig", tasks: list[Task], strategies: str, budgets: str, model: str,
                prm: str | None, d: Path) -> dict[str, Any]:
    """``omrl bench`` of ``tasks`` in the loop's settings (seed, agent, step tokens, trees kept)
    into ``d``: ``strategy -> budget -> {tasks, successes, success_rate, ci_low, ci_high}``."""
    summary = bench(tasks, strategies, budgets, policy=policy_spec(model),
                    reward_model=f"prm:{prm}" if prm else None, seed=cfg.seed,
                    max_tokens=cfg.max_tokens, temperature=cfg.temperature, out=d,
                    save_trees=True, progress=cfg.progress, agent=cfg.agent)
    return {name: {b: {k: s[k] for k in ("tasks", "successes", "success_rate", "ci_low", "ci_high")}
                   for b, s in per.items()} for name, per in summary["strategies"].items()}


def bench_outcomes(folder: Path) -> dict[str, dict[str, dict[str, bool]]]:
    """``strategy -> budget -> task_id -> success`` from a bench folder's outcomes.jsonl."""
    out: dict[str, dict[str, dict[str, bool]]] = {}
    for line in (folder / "outcomes.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            out.setdefault(row["strategy"], {}).setdefault(row["budget"], {})[row["task_id"]] = bool(row["success"])
    return out


def eval_stage(cfg: "LoopConfig", sets: TaskSets, model: str, prm: str | None):
    """The test split (reported, never decided on): every eval strategy at every eval budget."""
    def run(d: Path) -> dict[str, Any]:
        rows = bench_tasks(cfg, sets.test(), cfg.eval_strategies, cfg.eval_budgets, model, prm, d)
        ran_on = json.loads((d / "summary.json").read_text())["config"]  # bench's host and dtype
        info = {"policy": policy_spec(model), "prm": prm, "rows": rows,
                "success": {n: {b: s["success_rate"] for b, s in per.items()} for n, per in rows.items()},
                "host": ran_on.get("host"), "dtype": ran_on.get("dtype")}
        if prm:  # the round's PRM on these held-out trees (see train.loop_prm.heldout)
            from .loop_prm import heldout

            info["prm_heldout"] = heldout(prm, sorted((d / "trees").glob("*.jsonl")))
        return info
    return run


def best_search_stage(cfg: "LoopConfig", sets: TaskSets, model: str, prm: str | None):
    """After the last round: ``best_search`` at ``best_budget`` on the test split with the best
    checkpoint; ``record`` is results.json's ``search_on_best``."""
    def run(d: Path) -> dict[str, Any]:
        bench_tasks(cfg, sets.test(), cfg.best_search, cfg.best_budget, model, prm, d)
        summary = json.loads((d / "summary.json").read_text())
        ((_, per),) = summary["strategies"].items()
        ((budget, s),) = per.items()
        record = {"strategy": s["strategy"], "budget": budget, "policy": policy_spec(model), "prm": prm,
                  **{k: s[k] for k in ("tasks", "successes", "ci_low", "ci_high")},
                  "tokens_per_task": round(per_task(s, "tokens")),
                  "rm_tokens_per_task": round(per_task(s, "rm_tokens")),
                  "verifier_in_loop": s.get("verifier_in_loop", False)}
        return {"record": record, "host": summary["config"].get("host"), "dtype": summary["config"].get("dtype")}
    return run


def dev_outcomes(folder: Path) -> dict[str, dict[str, bool]]:
    """A dev evaluation's outcomes per strategy (its one budget)."""
    return {name: next(iter(per.values())) for name, per in bench_outcomes(folder).items()}


def dev_stage(cfg: "LoopConfig", sets: TaskSets, model: str, best: dict[str, Any] | None,
              earlier: dict[str, Any] | None = None):
    """The dev slice with the dev strategies (no reward model: checkpoints from different rounds
    are compared under one rule), then the keep-best decision against ``best`` (the best
    checkpoint's dev record; None for the base policy, which is kept as the first best) and the
    ``earlier`` bests' dev outcomes (where -> outcomes)."""
    def run(d: Path) -> dict[str, Any]:
        rows = bench_tasks(cfg, sets.dev, cfg.dev_strategies, cfg.dev_budget, model, None, d)
        mine = dev_outcomes(d)
        if best is None:
            decision = {"keep": True, "new_best": True, "reason": "the starting policy: the first best",
                        "score": None, "best_score": None, "tests": {}}
        else:
            decision = decide(mine, best["outcomes"], cfg.keep_alpha, promote=cfg.promote, earlier=earlier)
        decision["score"] = round(dev_score(mine), 4)
        return {"model": model, "rows": rows, "outcomes": mine, "decision": decision}
    return run
