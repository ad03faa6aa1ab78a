"""run the closed loop: search -> PRM and policy training -> keep-best on a dev slice -> evaluation

``omrl loop --env game24 --policy smollm2 --rounds R --out runs/loop`` (settings from
:class:`LoopConfig`: defaults < ``--config FILE.yaml`` < flags < ``--set key=value``). Round 0
evaluates the base policy on the dev slice and the test split; each round ``r`` then

1. ``curriculum`` (with ``curriculum:``) — probes each difficulty level's search success and picks
   the levels within the band (:mod:`train.loop_curriculum`);
2. ``search`` — searches train tasks (never a dev-slice puzzle) with the current policy, guided by
   the current PRM, and in round 1 adds ``expert_demos`` solver demonstrations (and
   ``expert_levels``' from the curriculum levels' own task streams);
3. ``labels`` / ``prm`` — Monte-Carlo step labels and a PRM trained on the labels of all rounds;
4. ``data`` — SFT rows, rejection-sampling SFT rows (the round's own successes), DPO pairs, GRPO
   groups (:mod:`omrl_search.exports`);
5. per trainer (``first`` in round 1, ``then`` later): ``train_KIND`` from the current policy, then
   ``dev_KIND``: the dev slice, and keep-best (:mod:`train.loop_select`) keeps or rejects it;
6. ``eval`` — :func:`omrl_search.bench.bench` of every eval strategy on the test split at fixed
   budgets with the round's kept policy and PRM; ``report.md`` (:mod:`train.loop_report`).

Each stage works in ``NAME.partial/`` and becomes ``NAME/`` (with ``stage.json``) only when it has
finished, so a loop killed anywhere and started again with the same command redoes only the
unfinished stage; trainers inside it resume from their checkpoints (bit-exact on CPU), searches
are seeded, so the results equal an unbroken run's. A run folder remembers its settings
(``loop.json``) and refuses to continue under different ones. See docs/loop.md.
"""
from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

from omrl_search.outdir import check_out_path
from omrl_search.policy import PolicyError
from omrl_search.report import collect, render
from omrl_search.result import write_text_atomic

from . import loop_stages as st
from .config import TrainError, override_items, settings_from_sources
from .loop_config import LoopConfig
from .loop_stages import TaskSets


class LoopError(Exception):
    """A stage failed; the message says which and why."""


# --- stages ------------------------------------------------------------------------------------
#: settings added after runs were started, as those runs behaved (their loop.json lacks them)
LEGACY_SETTINGS = {"continue_from": "kept", "expert_levels": {}, "promote": "better", "test_splits": ["test"],
                   "train_tasks": "same"}


class Run:
    """A loop folder: finished stages are ``NAME/stage.json``; the rest is redone."""

    def __init__(self, cfg: LoopConfig):
        self.cfg = cfg
        self.root = Path(cfg.out)
        self.git = git_commit()  # recorded in every stage this process runs

    def open(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        saved = self.root / "loop.json"
        mine = json.loads(self.cfg.model_dump_json(exclude={"rounds", "progress", "best_search", "best_budget"}))
        if saved.exists():
            before = {**LEGACY_SETTINGS, **json.loads(saved.read_text())}
            diff = sorted(k for k in set(before) | set(mine) if before.get(k) != mine.get(k))
            if diff:
                raise LoopError(f"{self.root} was started with other settings ({', '.join(diff)}); "
                                "use another --out")
        else:
            _write_json(saved, mine)

    def stage(self, name: str, fn: Callable[[Path], dict[str, Any]],
              inputs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run ``fn(partial_dir)`` unless ``name`` has finished; returns its ``stage.json``.
        ``inputs``, recorded in it, name what the stage depends on beyond the settings
        ``loop.json`` pins (the best checkpoint, which more rounds can change; the search's
        strategy and budget): a finished stage whose inputs differ is set aside
        (:func:`_set_aside`) and run again."""
        final = self.root / name
        if (final / "stage.json").exists():
            info = json.loads((final / "stage.json").read_text())
            if inputs is None or info.get("inputs") == inputs:
                return info
            aside = _set_aside(final)
            print(f"[loop] {name} ran on {info.get('inputs')}, now {inputs}: moved to {aside.name}",
                  file=sys.stderr, flush=True)
        if final.exists():
            shutil.rmtree(final)
        partial = final.with_name(final.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        print(f"[loop] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        info = fn(partial)
        if inputs is not None:
            info["inputs"] = inputs
        info["seconds"] = round(time.perf_counter() - t0, 1)
        info["git"] = self.git
        _write_json(partial / "stage.json", info)
        partial.rename(final)
        print(f"[loop] {name} done in {info['seconds']} s", file=sys.stderr, flush=True)
        return info


def _set_aside(final: Path) -> Path:
    """Move a finished stage folder to the first free ``NAME.replaced``, ``NAME.replaced-2``, ...
    (kept for the record, never deleted); returns where it went."""
    aside, n = final.with_name(final.name + ".replaced"), 1
    while aside.exists():
        n += 1
        aside = final.with_name(f"{final.name}.replaced-{n}")
    final.rename(aside)
    return aside


def _write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


# --- the loop ------------------------------------------------------------------------------------
class Track:
    """The current policy (what training continues from) and the best checkpoint (what the run
    hands back), as keep-best moves them. With ``continue_from="best"`` the current policy is
    always the best (a kept candidate that is not better is not trained on); with ``"kept"``
    it is the last kept candidate. ``earlier`` holds the dev outcomes of the checkpoints that were
    the best before the present one (keep-best rejects a candidate worse than any of them)."""

    def __init__(self, model: str, dev: dict[str, Any] | None, continue_from: str = "best"):
        self.continue_from = continue_from
        self.current = model
        self.best: dict[str, Any] = {"model": model, "where": "round 0, base",
                                     "score": (dev or {}).get("decision", {}).get("score"), "dev": dev}
        self.earlier: dict[str, dict[str, Any]] = {}

    def apply(self, r: int, kind: str, train: dict[str, Any], dev: dict[str, Any] | None) -> None:
        if "skipped" in train:
            return
        decision = (dev or {}).get("decision")
        if decision is None:  # no dev slice: kept unchecked, and the latest is the one handed back
            self.current = train["model"]
            self.best = {"model": train["model"], "where": f"round {r}, {kind}", "score": None, "dev": None}
            return
        if decision["keep"] and (decision["new_best"] or self.continue_from == "kept"):
            self.current = train["model"]
        if decision["new_best"]:
            if self.best["dev"] is not None:
                self.earlier[self.best["where"]] = self.best["dev"]["outcomes"]
            self.best = {"model": train["model"], "where": f"round {r}, {kind}",
                         "score": decision["score"], "dev": dev}


def run_loop(cfg: LoopConfig) -> dict[str, Any]:
    """Run (or finish) every round; returns the per-round test success table."""
    from .loop_report import plot_curves, round_report  # scipy: when a loop runs

    cfg.check()
    check_out_path(cfg.out, "out")  # also when it came from the YAML or --set, before any work
    sets = TaskSets(cfg)
    run = Run(cfg)
    run.open()
    prm = None
    dev0 = run.stage("round_0/dev", st.dev_stage(cfg, sets, cfg.policy, None)) if cfg.dev_limit else None
    track = Track(cfg.policy, dev0, cfg.continue_from)
    history: list[dict[str, Any]] = [{"round": 0, "dev": dev0,
                                      "eval": run.stage("round_0/eval", st.eval_stage(cfg, sets, cfg.policy, None))}]
    for r in range(1, cfg.rounds + 1):
        info: dict[str, Any] = {"round": r}
        plan = None
        if cfg.curriculum is not None:
            plan = info["curriculum"] = run.stage(f"round_{r}/curriculum",
                                                  st.curriculum_stage(cfg, sets, r, track.current, prm))
        info["search"] = run.stage(f"round_{r}/search", st.search_stage(cfg, sets, r, track.current, prm, plan))
        if cfg.prm:
            info["labels"] = run.stage(f"round_{r}/labels", st.labels_stage(cfg, r, track.current))
            info["prm"] = run.stage(f"round_{r}/prm", st.prm_stage(cfg, r))
            prm = info["prm"].get("model") or prm
        info["data"] = run.stage(f"round_{r}/data", st.data_stage(cfg, r))
        info["stages"] = []
        for kind in cfg.trainers(r):
            train = run.stage(f"round_{r}/train_{kind}", st.train_stage(cfg, r, kind, track.current, sets, plan, prm))
            dev = None
            if "skipped" not in train and cfg.dev_limit:
                dev = run.stage(f"round_{r}/dev_{kind}",
                                st.dev_stage(cfg, sets, train["model"], track.best["dev"], track.earlier))
            track.apply(r, kind, train, dev)
            info["stages"].append({"train": train, "dev": dev})
        info["policy"] = track.current
        info["eval"] = run.stage(f"round_{r}/eval", st.eval_stage(cfg, sets, track.current, prm))
        history.append(info)
        best = {k: v for k, v in track.best.items() if k != "dev"}
        plot_curves(history, run.root)  # learning_curve.png, tokens_per_solved.png (report.md shows them)
        text = round_report(cfg, history, best)
        write_text_atomic(run.root / f"round_{r}" / "report.md", text)
        write_text_atomic(run.root / "report.md", text)
        _write_json(run.root / f"round_{r}" / "loop_summary.json", _summary(info, best))
        write_results(run, history)
    best = {k: v for k, v in track.best.items() if k != "dev"}
    _write_json(run.root / "best.json", {**best, "current": track.current})
    if cfg.dev_limit:  # the checkpoint handed back, on the test split (once, if no round's eval was it)
        if st.policy_spec(best["model"]) not in {h["eval"].get("policy") for h in history}:
            best["eval"] = run.stage("eval_best", st.eval_stage(cfg, sets, best["model"], prm),
                                     inputs={"model": best["model"], "prm": prm})
        write_results(run, history, best=best)
    if cfg.best_search:
        done = run.stage("search_on_best", st.best_search_stage(cfg, sets, track.best["model"], prm),
                         inputs={"model": track.best["model"], "prm": prm, "strategy": cfg.best_search,
                                 "budget": cfg.best_budget})
        write_results(run, history, done, best=best if cfg.dev_limit else None)
    return {h["round"]: h["eval"]["success"] for h in history}


def write_results(run: Run, history: list[dict[str, Any]], best_search: dict[str, Any] | None = None,
                  best: dict[str, Any] | None = None) -> None:
    """``results.json`` from the rounds so far (and, once the rounds are over, the best
    checkpoint's held-out figures and the search on it); ``hours`` counts every recorded stage."""
    from .loop_report import results_record

    seconds = stage_seconds(history) + sum((x or {}).get("seconds", 0.0) for x in (best_search, (best or {}).get("eval")))
    searched = None
    if best_search:
        searched = {**best_search["record"], "git": best_search.get("git")}
    _write_json(run.root / "results.json", results_record(
        run.cfg, history, command=shlex.join(["omrl", *sys.argv[1:]]), git=run.git,
        hours=seconds / 3600, search_on_best=searched, best=best))


def git_commit(here: Path | None = None) -> str | None:
    """The commit of the code that ran (the checkout holding ``here``, this package by default),
    with ``-dirty`` when tracked files differ from it (as ``git describe --dirty`` marks it);
    None outside a git checkout."""
    import subprocess

    here = here or Path(__file__).resolve().parent
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=here, timeout=10)
        if done.returncode != 0 or not done.stdout.strip():
            return None
        clean = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=here, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() + ("" if clean else "-dirty")


def stage_seconds(history: list[dict[str, Any]]) -> float:
    """The seconds the recorded stages took (``Run.stage`` puts ``seconds`` in each)."""
    from .loop_report import stage_infos

    return float(sum(i.get("seconds", 0.0) for h in history for i in stage_infos(h)))


def _summary(info: dict[str, Any], best: dict[str, Any]) -> dict[str, Any]:
    """What a round decided, machine-readable: test rows, each stage's keep decision, the best."""
    stages = [{"trainer": s["train"]["trainer"], "skipped": s["train"].get("skipped"),
               "model": s["train"].get("model"),
               "decision": (s["dev"] or {}).get("decision"), "dev": (s["dev"] or {}).get("rows")}
              for s in info["stages"]]
    return {"round": info["round"], "policy": info["policy"], "test": info["eval"]["rows"],
            "curriculum": info.get("curriculum"), "stages": stages, "best": best}


# --- the command ---------------------------------------------------------------------------------
FLAGS = {"env": str, "policy": str, "rounds": int, "out": str, "seed": int, "max_tokens": int,
         "train_limit": int, "test_limit": int, "dev_limit": int, "search_strategy": str,
         "search_budget": str, "expert_demos": int, "prm_base": str}


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
    # defaults < --config < flags < --set (a --set key given as a flag too wins)
    return settings_from_sources(LoopConfig, args.config, {**flags, **dict(override_items(list(args.set)))})


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
