"""compare strategies at matched compute: every strategy at every budget, table and plots

``omrl bench --env game24 --strategies react,beam,mcts --budgets tokens=2000,8000`` runs each
strategy on the same tasks (the whole split unless ``--limit``) under each per-task budget (any
budget kind) and writes ``DIR/summary.json`` (per strategy and budget, the fields of ``omrl
search``'s summary: success rate with its Wilson 95% interval and, after the first strategy, an
exact McNemar test against it at the same budget; the prompt tokens split into
``prefill_tokens`` and ``cached_tokens``, see :mod:`omrl_search.budget`), ``DIR/table.md``, ``DIR/outcomes.jsonl`` (per
task), ``DIR/scaling.png`` (success rate with error bars against tokens spent per task, one line
per strategy) and ``DIR/scaling_env_steps.png`` (against env steps). Every argument and DIR are
checked before anything runs; DIR appears whole at the end (docs/design.md §8 for the
statistics). From Python (the loop's evaluations): :func:`bench`.
"""
from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Sequence

from .api import parse_budget, search_many, summarize
from .budget import KINDS
from .executors import Executor
from .host import describe, host_info, policy_dtype
from .outdir import OutDir, ResultLog
from .policy import Policy, make_policy
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
        parse_budget({kind: value})  # validates: a finite positive number
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
                    concurrency=args.concurrency, max_depth=args.max_depth, source=source,
                    constrain=args.constrain, agent=args.agent)
    flat = {f"{n}@{b}": s for n, per in summary["strategies"].items() for b, s in per.items()}
    print(format_table(flat))
    out = Path(args.out)
    print(f"wrote {out / 'summary.json'}, {out / 'table.md'}, {out / 'outcomes.jsonl'}, "
          f"{out / 'scaling.png'} and {out / 'scaling_env_steps.png'}")
    return 0


def bench(tasks: Sequence[Task], strategies: "str | Sequence[str | Strategy]", budgets: str, *,
          policy: "str | Policy", reward_model: Any = None, seed: int = 0,
          max_tokens: int | None = None, temperature: float = 1.0, out: "str | Path | None" = None,
          save_trees: bool = False, progress: bool = True, executor: "str | Executor" = "local",
          ray_address: str | None = None, concurrency: int | None = None,
          max_depth: int | None = None, source: str | None = None,
          constrain: str = "auto", agent: str = "react") -> dict[str, Any]:
    """Every strategy on ``tasks`` at every budget; the summary (``{"config", "strategies"}``,
    per strategy and budget the fields of ``omrl search``'s summary: success rate with its Wilson
    95% interval and, for every strategy after the first, ``paired``: an exact McNemar test
    against the first strategy at the same budget on the same tasks).

    ``strategies``: spec strings, or one comma string as ``--strategies`` takes; ``budgets``:
    ``"KIND=V1,V2,..."`` as ``--budgets`` takes; ``policy``/``reward_model``: specs or objects
    (built once here for a local executor; Ray actors build specs themselves); ``max_tokens``
    None is :data:`~omrl_search.types.DEFAULT_MAX_TOKENS`. With ``out``, writes there as a whole
    (:mod:`omrl_search.outdir`) ``summary.json``, ``table.md``, the two plots, ``outcomes.jsonl``
    (one line per strategy, budget and task, appended as each task finishes) and with
    ``save_trees`` ``trees/*.jsonl`` (also appended task by task); a run that raises keeps them
    in ``OUT.partial``. ``source`` names where the tasks came from in the summary (default:
    their splits). ``constrain``: the structured decoding of every step (``auto`` | ``actions`` |
    ``format`` | ``none``, see :func:`~omrl_search.api.search_many`), kept in the config with
    what was in force per row (``constraint``). ``agent``: the agent format (``react``, ``act``).
    Every argument, ``out`` included, is checked before any search runs (a bad
    one raises SpecError, UsageError, PolicyError or ValueError with one line).
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
    if out is None and save_trees:
        raise UsageError("save_trees needs an output directory (out=)")
    if out is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("omrl bench needs matplotlib for its plots: pip install matplotlib") from None
    sampling = SamplingParams(temperature=temperature,
                              max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens)
    with OutDir.open(out) if out is not None else nullcontext() as od:
        rm = where.build(make_reward_model, reward_model)
        pol = where.build(make_policy, policy)
        rows = _run_all(tasks, strats, kind, limits, od, save_trees, progress, policy=pol,
                        reward_model=rm, seed=seed, max_depth=max_depth, sampling=sampling,
                        concurrency=concurrency, executor=where, constrain=constrain,
                        agent=agent)
        env = tasks[0].env
        config = {"env": env, "split": source or ",".join(sorted({t.split for t in tasks})),
                  "tasks": len(tasks), "policy": _spec_of(policy), "reward_model": _spec_of(reward_model),
                  "budget_kind": kind, "budgets": limits, "seed": seed, "constrain": constrain,
                  "agent": agent, "host": host_info(), "dtype": policy_dtype(pol)}
        summary = {"config": config, "strategies": rows}
        if od is not None:
            (od.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            (od.path / "table.md").write_text(markdown(config, rows))
            plot(rows, od.path / "scaling.png", "tokens", f"tokens spent per task ({env}, {config['policy']})")
            plot(rows, od.path / "scaling_env_steps.png", "env_steps",
                 f"env steps per task ({env}, {config['policy']})")
    return summary


def _run_all(tasks: list[Task], strats: list[Strategy], kind: str, limits: list[float],
             od: OutDir | None, save_trees: bool, progress: bool,
             **search_kwargs: Any) -> dict[str, dict[str, dict[str, Any]]]:
    """The searches: rows per strategy and budget; with ``od``, each finished task's outcome
    (and tree) appended to its file at once, so a run that fails keeps every finished task."""
    if od is not None:
        od.main_file = "outcomes.jsonl"
    with ResultLog(od.path / "outcomes.jsonl", od) if od is not None else nullcontext() as log:
        return _run_logged(tasks, strats, kind, limits, od, save_trees, progress, log, **search_kwargs)


def _run_logged(tasks: list[Task], strats: list[Strategy], kind: str, limits: list[float],
                od: OutDir | None, save_trees: bool, progress: bool, log: ResultLog | None,
                **search_kwargs: Any) -> dict[str, dict[str, dict[str, Any]]]:
    from .stats import outcomes, paired  # scipy: loaded when a bench runs, not with `omrl --help`

    names = _names(strats)
    order = {t.task_id: i for i, t in reversed(list(enumerate(tasks)))}
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    solved: dict[tuple[str, str], dict[str, bool]] = {}
    for si, (name, strat) in enumerate(zip(names, strats)):
        bar = _bar(name, len(tasks) * len(limits)) if progress else None
        rows[name] = {}
        for bi, limit in enumerate(limits):
            label = f"{kind}={limit:g}"
            trees = ResultLog(od.path / "trees" / f"{name}@{label}.jsonl") if od and save_trees else nullcontext()

            def on_result(r: Any, name: str = name, label: str = label, key: tuple = (si, bi), trees=trees) -> None:
                at = (*key, order.get(r.task.task_id, len(order)))
                if log is not None:
                    log.add(at, json.dumps(outcome_line(name, label, r)))
                if isinstance(trees, ResultLog):
                    trees.add(at, r.to_json())
                if bar is not None:
                    bar.update(1)

            t0 = time.perf_counter()
            with trees:
                results = search_many(tasks, strategy=strat, budget={kind: limit}, on_result=on_result,
                                      **search_kwargs)
            row = rows[name][label] = {"strategy": strat.spec(), **summarize(results, time.perf_counter() - t0)}
            solved[name, label] = outcomes(results)
            del results
            if si:
                row["paired"] = paired(names[0], solved[names[0], label], solved[name, label])
            if bar is not None:
                bar.set_postfix({label: f"{row['success_rate']:.2f}"})
        if bar is not None:
            bar.close()
    return rows


def outcome_line(name: str, label: str, r: Any) -> dict[str, Any]:
    """One line of ``outcomes.jsonl``: a task's result without its tree."""
    return {"strategy": name, "budget": label, "task_id": r.task.task_id, "success": bool(r.success),
            "stop_reason": r.stop_reason, "faults": len(r.faults), "seconds": round(r.seconds, 4),
            "spent": r.spent}


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
    """Mean of ``key`` per task in a summary row (``prefill_tokens`` of a summary written before
    the split: all its prompt tokens; ``cached_tokens``: 0)."""
    if key == "tokens":
        value = s["prompt_tokens"] + s["completion_tokens"]
    elif key == "prefill_tokens":
        value = s.get(key, s["prompt_tokens"])
    elif key in ("cached_tokens", "rm_tokens"):  # 0 in summaries written before they were kept
        value = s.get(key, 0)
    else:
        value = s[key]
    return value / max(s["tasks"], 1)


def _constraint_line(config: dict[str, Any], rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    """What each step was generated under: the setting asked and the modes searches ran in."""
    modes: dict[str, int] = {}
    violations = 0
    for per in rows.values():
        for row in per.values():
            c = row.get("constraint") or {}
            for mode, n in c.get("modes", {}).items():
                modes[mode] = modes.get(mode, 0) + n
            violations += int(c.get("violations", 0) or 0)
    ran = ", ".join(f"{m}: {n} searches" for m, n in sorted(modes.items())) or "no record"
    return (f"Structured decoding: `--constrain {config.get('constrain', 'auto')}`; in force: {ran}"
            + (f"; {violations} completions broke the grammar (client check)" if violations else "") + ".")


def markdown(config: dict[str, Any], rows: dict[str, dict[str, dict[str, Any]]]) -> str:
    """``table.md``: success rate with its 95% interval per strategy and budget, the paired test
    of each strategy against the first, then the compute actually spent."""
    from .stats import fmt_paired

    labels = [f"{config['budget_kind']}={b:g}" for b in config["budgets"]]
    lines = [f"# omrl bench: {config['env']} ({config['split']}, {config['tasks']} tasks), "
             f"policy `{config['policy']}`, seed {config['seed']}", "",
             describe(config["host"], config["dtype"]) if "host" in config else "", "",
             _constraint_line(config, rows), "",
             "Success rate per per-task budget, with its Wilson 95% interval (`*`: the env's "
             "success check steers the search or picks the answer — verifier in the loop).", "",
             "| strategy | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name, per in rows.items():
        mark = "*" if any(s["verifier_in_loop"] for s in per.values()) else ""
        lines.append(f"| {name}{mark} | " + " | ".join(_rate_cell(per[b]) for b in labels) + " |")
    pairs = [(name, b, per[b]["paired"]) for name, per in rows.items() for b in labels if "paired" in per[b]]
    if pairs:
        first = pairs[0][2]["vs"]
        lines += ["", f"Against {first} at the same budget on the same tasks (exact McNemar): the "
                  f"difference in success rate, the tasks solved only by the strategy vs only by "
                  f"{first}, and the two-sided p-value.", "",
                  "| strategy | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
        for name, per in rows.items():
            if any("paired" in per[b] for b in labels):
                lines.append(f"| {name} | " + " | ".join(fmt_paired(per[b]["paired"]) if "paired" in per[b]
                                                          else "–" for b in labels) + " |")
    lines += ["", "Compute spent, mean per task (tokens: prompt + completion; of the prompt tokens, "
              "prefill: computed by the backend, cached: served by its prefix cache):", "",
              "| strategy | budget | success | tokens | prefill | cached | lm_calls | rm_calls | rm_tokens "
              "| env_steps | faults |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, per in rows.items():
        for b in labels:
            s = per[b]
            lines.append(f"| {name} | {b} | {s['success_rate']:.2f} | {per_task(s, 'tokens'):.0f} | "
                         f"{per_task(s, 'prefill_tokens'):.0f} | {per_task(s, 'cached_tokens'):.0f} | "
                         f"{per_task(s, 'lm_calls'):.1f} | {per_task(s, 'rm_calls'):.1f} | "
                         f"{per_task(s, 'rm_tokens'):.0f} | "
                         f"{per_task(s, 'env_steps'):.1f} | {s['faults']} |")
    return "\n".join(lines) + "\n"


def _rate_cell(s: dict[str, Any]) -> str:
    return f"{s['success_rate']:.2f} [{s['ci_low']:.2f}, {s['ci_high']:.2f}]"


def plot(rows: dict[str, dict[str, dict[str, Any]]], path: Path, key: str, xlabel: str) -> None:
    """Success rate (error bars: its 95% interval) against the mean compute actually spent per
    task, one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, per) in enumerate(rows.items()):
        pts = sorted((per_task(s, key), s["success_rate"], s["ci_low"], s["ci_high"]) for s in per.values())
        verifier = any(s["verifier_in_loop"] for s in per.values())
        ax.errorbar([x for x, *_ in pts], [y for _, y, *_ in pts],
                    yerr=[[y - lo for _, y, lo, _ in pts], [hi - y for _, y, _, hi in pts]],
                    marker="osv^DPX*"[i % 8], markersize=7 - i % 3, capsize=3, elinewidth=1,
                    linestyle="--" if verifier else "-", alpha=0.85, zorder=10 - i,
                    label=name + (" (verifier)" if verifier else ""))
    if all(x > 0 for per in rows.values() for x in (per_task(s, key) for s in per.values())):
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("success rate (95% interval)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)  # inside the output's temporary directory: no temp file needed
    plt.close(fig)
