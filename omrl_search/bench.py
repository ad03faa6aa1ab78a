"""compare strategies at matched compute: every strategy at every budget, table and plots

``omrl bench --env game24 --limit 100 --strategies react,beam,mcts --budgets tokens=2000,8000``
runs each strategy on the same tasks under each per-task budget (any budget kind) and writes
``DIR/summary.json`` (per strategy and budget, the fields of ``omrl search``'s summary),
``DIR/table.md``, ``DIR/scaling.png`` (success rate against tokens spent per task, one line per
strategy) and ``DIR/scaling_env_steps.png`` (against env steps). Every argument is checked
before anything runs or is written. From Python (the loop's evaluations): :func:`bench`.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any, Sequence

from .api import search_many, summarize
from .budget import KINDS, Budget
from .executors import Executor
from .policy import Policy, make_policy
from .result import write_results, write_text_atomic
from .reward import make_reward_model
from .specs import SpecError, UsageError, coerce
from .strategy import Strategy, make_strategy
from .types import DEFAULT_MAX_TOKENS, SamplingParams, Task

DEFAULT_STRATEGIES = "react,best_of_n,beam,tot,got,dfsdt,mcts"


def configure(p: argparse.ArgumentParser) -> None:
    from .cli import add_run_args, add_task_args

    add_task_args(p)
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES,
                   help="comma-separated strategy specs, e.g. react,beam:width=4,k=2,mcts")
    p.add_argument("--budgets", required=True,
                   help=f"KIND=V1,V2,... per-task limits; KIND is one of {', '.join(KINDS)}")
    add_run_args(p)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--save-trees", action="store_true", help="also write DIR/trees/*.jsonl")


def split_strategies(text: str) -> list[str]:
    """``"react,beam:width=4,k=2,mcts"`` -> ``["react", "beam:width=4,k=2", "mcts"]``: a piece
    with ``=`` and no ``:`` continues the previous strategy's parameters."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece.split("=", 1)[0] and specs and ":" in specs[-1]:
            specs[-1] += "," + piece
        elif "=" in piece and ":" not in piece:
            raise SpecError(f"bad --strategies {text!r}: {piece!r} follows no strategy with parameters")
        else:
            specs.append(piece)
    if not specs:
        raise SpecError("--strategies is empty")
    return specs


def parse_budgets(text: str) -> tuple[str, list[float]]:
    """``"tokens=2000,8000"`` -> ``("tokens", [2000, 8000])``, each value a valid limit."""
    kind, eq, values = text.partition("=")
    kind = kind.strip()
    if not eq or kind not in KINDS:
        raise SpecError(f"bad --budgets {text!r}: expected KIND=V1,V2,... with KIND one of {', '.join(KINDS)}")
    out = []
    for v in values.split(","):
        value = coerce(v.strip())
        Budget({kind: value})  # validates: a positive number
        out.append(value)
    if len(set(out)) != len(out):
        raise SpecError(f"bad --budgets {text!r}: repeated value")
    return kind, sorted(out)


def run(args: argparse.Namespace) -> int:
    """``omrl bench``: :func:`bench` over the tasks of ``--env``, then the table on stdout."""
    from .cli import executor_from_args, format_table, tasks_from_args

    tasks = tasks_from_args(args)
    source = args.file or args.split
    summary = bench(tasks, args.strategies, args.budgets, policy=args.policy,
                    reward_model=args.reward_model, seed=args.seed, max_tokens=args.max_tokens,
                    temperature=args.temperature, out=args.out, save_trees=args.save_trees,
                    progress=not args.no_progress, executor=executor_from_args(args),
                    concurrency=args.concurrency, max_depth=args.max_depth, source=source)
    flat = {f"{n}@{b}": s for n, per in summary["strategies"].items() for b, s in per.items()}
    print(format_table(flat))
    out = Path(args.out)
    print(f"wrote {out / 'summary.json'}, {out / 'table.md'}, {out / 'scaling.png'} and "
          f"{out / 'scaling_env_steps.png'}")
    return 0


def bench(tasks: Sequence[Task], strategies: "str | Sequence[str | Strategy]", budgets: str, *,
          policy: "str | Policy", reward_model: Any = None, seed: int = 0,
          max_tokens: int | None = None, temperature: float = 1.0, out: "str | Path | None" = None,
          save_trees: bool = False, progress: bool = True, executor: "str | Executor" = "local",
          ray_address: str | None = None, concurrency: int | None = None,
          max_depth: int | None = None, source: str | None = None) -> dict[str, Any]:
    """Every strategy on ``tasks`` at every budget; the summary (``{"config", "strategies"}``,
    per strategy and budget the fields of ``omrl search``'s summary).

    ``strategies``: spec strings, or one comma string as ``--strategies`` takes; ``budgets``:
    ``"KIND=V1,V2,..."`` as ``--budgets`` takes; ``policy``/``reward_model``: specs or objects
    (built once here for a local executor; Ray actors build specs themselves); ``max_tokens``
    None is :data:`~omrl_search.types.DEFAULT_MAX_TOKENS`. With ``out``, writes
    ``summary.json``, ``table.md``, the two plots (and with ``save_trees`` ``trees/*.jsonl``)
    there. ``source`` names where the tasks came from in the summary (default: their splits).
    Every argument is checked before any search runs or anything is written (a bad one raises
    SpecError, UsageError, PolicyError or ValueError with one line).
    """
    # --- validate everything first -------------------------------------------------------------
    tasks = list(tasks)
    if not tasks:
        raise UsageError("bench needs at least one task")
    specs = split_strategies(strategies) if isinstance(strategies, str) else list(strategies)
    strats = [make_strategy(s) for s in specs]
    if not strats:
        raise SpecError("no strategies to bench")
    kind, limits = parse_budgets(budgets)
    where = Executor.parse(executor, ray_address)
    out = Path(out) if out is not None else None
    if out is None and save_trees:
        raise UsageError("save_trees needs an output directory (out=)")
    if out is not None:
        if out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} exists and is not a directory")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("omrl bench needs matplotlib for its plots: pip install matplotlib") from None
    rm = where.build(make_reward_model, reward_model)
    pol = where.build(make_policy, policy)
    sampling = SamplingParams(temperature=temperature,
                              max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    names = _names(strats)

    # --- run -----------------------------------------------------------------------------------
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    for name, strat in zip(names, strats):
        bar = _bar(name, len(tasks) * len(limits)) if progress else None
        rows[name] = {}
        for limit in limits:
            label = f"{kind}={limit:g}"
            t0 = time.perf_counter()
            results = search_many(tasks, strategy=strat, policy=pol, reward_model=rm,
                                  budget={kind: limit}, seed=seed, max_depth=max_depth,
                                  sampling=sampling, concurrency=concurrency,
                                  on_result=(lambda r: bar.update(1)) if bar else None,
                                  executor=where)
            rows[name][label] = {"strategy": strat.spec(), **summarize(results, time.perf_counter() - t0)}
            if bar is not None:
                bar.set_postfix({label: f"{rows[name][label]['success_rate']:.2f}"})
            if save_trees and out is not None:
                (out / "trees").mkdir(exist_ok=True)
                write_results(out / "trees" / f"{name}@{label}.jsonl", results)
        if bar is not None:
            bar.close()

    env = tasks[0].env
    config = {"env": env, "split": source or ",".join(sorted({t.split for t in tasks})),
              "tasks": len(tasks), "policy": _spec_of(policy), "reward_model": _spec_of(reward_model),
              "budget_kind": kind, "budgets": limits, "seed": seed}
    summary = {"config": config, "strategies": rows}
    if out is not None:
        write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        write_text_atomic(out / "table.md", markdown(config, rows))
        plot(rows, out / "scaling.png", "tokens", f"tokens spent per task ({env}, {config['policy']})")
        plot(rows, out / "scaling_env_steps.png", "env_steps",
             f"env steps per task ({env}, {config['policy']})")
    return summary


def _spec_of(obj: Any) -> Any:
    """What the summary records of a policy or reward model: its spec, or an object's name."""
    return obj if obj is None or isinstance(obj, str) else getattr(obj, "name", type(obj).__name__)


def _names(strategies) -> list[str]:
    counts: dict[str, int] = {}
    for s in strategies:
        counts[s.name] = counts.get(s.name, 0) + 1
    return [s.name if counts[s.name] == 1 else s.spec() for s in strategies]


def _bar(name: str, total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{name:>10}", unit="task")


def per_task(s: dict[str, Any], key: str) -> float:
    value = s["prompt_tokens"] + s["completion_tokens"] if key == "tokens" else s[key]
    return value / max(s["tasks"], 1)


def markdown(config: dict[str, Any], rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    """``table.md``: success rate per strategy and budget, then the compute actually spent."""
    labels = [f"{config['budget_kind']}={b:g}" for b in config["budgets"]]
    lines = [f"# omrl bench: {config['env']} ({config['split']}, {config['tasks']} tasks), "
             f"policy `{config['policy']}`, seed {config['seed']}", "",
             "Success rate per per-task budget (`*`: the env's success check steers the search "
             "or picks the answer — verifier in the loop).", "",
             "| strategy | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, per in rows.items():
        mark = "*" if any(s["verifier_in_loop"] for s in per.values()) else ""
        lines.append(f"| {name}{mark} | " + " | ".join(f"{per[b]['success_rate']:.2f}" for b in labels) + " |")
    lines += ["", "Compute spent, mean per task:", "",
              "| strategy | budget | success | tokens | lm_calls | rm_calls | env_steps | faults |",
              "|---|---|---|---|---|---|---|---|"]
    for name, per in rows.items():
        for b in labels:
            s = per[b]
            lines.append(f"| {name} | {b} | {s['success_rate']:.2f} | {per_task(s, 'tokens'):.0f} | "
                         f"{per_task(s, 'lm_calls'):.1f} | {per_task(s, 'rm_calls'):.1f} | "
                         f"{per_task(s, 'env_steps'):.1f} | {s['faults']} |")
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict[str, dict[str, Any]]], path: Path, key: str, xlabel: str) -> None:
    """Success rate against the mean compute actually spent per task, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, per) in enumerate(rows.items()):
        pts = sorted((per_task(s, key), s["success_rate"]) for s in per.values())
        verifier = any(s["verifier_in_loop"] for s in per.values())
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="osv^DPX*"[i % 8], markersize=7 - i % 3,
                linestyle="--" if verifier else "-", alpha=0.85, zorder=10 - i,
                label=name + (" (verifier)" if verifier else ""))
    if all(x > 0 for per in rows.values() for x in (per_task(s, key) for s in per.values())):
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
