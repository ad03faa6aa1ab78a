"""The ``omrl`` command, the front door (docs/design.md §2, §7).

``omrl search`` and the listings (``envs``, ``strategies``, ``policies``, ``reward-models``) are
built in; every other sub-command is an ``omrl_search.commands`` plugin: a module with
``configure(parser)`` and ``run(args) -> int`` whose docstring's first line is its help. Only the
command being run is imported (``omrl --help`` imports them all, for their help lines), so
``omrl search`` loads no trainer and no torch unless its policy needs it.

Every argument is validated (env, tasks, strategies, budget, ``--out``: created and writable)
before any model loads or search runs; a bad one, argparse's own errors included, prints one line
naming it and exits with status 2. Every command's ``--out`` (a path it writes: a folder or a
file) is checked here, for all of them, before the command runs: it can be written, and nothing
is created to find out (:func:`~omrl_search.outdir.check_out_path`). ``--out`` is written as a whole (:mod:`omrl_search.outdir`):
results are appended task by task to a hidden sibling that replaces DIR at the end; a run that
raises keeps its finished tasks in ``DIR.partial`` and says so. Every success rate printed or
written carries its Wilson 95% interval, and several strategies are each tested against the
first on the same tasks (exact McNemar; docs/design.md §8). The options several commands share
are defined once here: :func:`add_task_args`, :func:`add_run_args`, :func:`add_executor_args`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from .agent import AGENT_FORMATS
from .api import load_tasks, parse_budget, search_many, summarize
from .env import EnvError, TaskFileError, env_class, env_server_factory, list_envs
from .executors import Executor, parse_executor
from .host import host_info, policy_dtype
from .outdir import OutDir, ResultLog, check_out_path
from .plugins import COMMANDS, PluginError, command_help
from .policy import PolicyError, list_policies, make_policy
from .prompts import CONSTRAIN_MODES
from .reward import list_reward_models, make_reward_model
from .specs import SpecError, UsageError
from .strategy import list_strategies, make_strategy
from .types import DEFAULT_MAX_TOKENS, SamplingParams

__all__ = ["UsageError", "add_executor_args", "add_run_args", "add_task_args", "executor_from_args",
           "format_table", "main", "models_from_args", "sampling_from_args", "search_strategies",
           "tasks_from_args"]

#: the policy of ``omrl search`` / ``omrl bench`` when none is given (no model needed)
DEFAULT_POLICY = "scripted:oracle:p=0.3"
#: built-in listings: command -> (what, function giving the names)
LISTINGS = {"envs": ("environments", list_envs), "strategies": ("strategies", list_strategies),
            "policies": ("policy backends", list_policies),
            "reward-models": ("reward models", list_reward_models)}
#: the compute columns of the printed table
COST_FIELDS = ("prompt_tokens", "prefill_tokens", "completion_tokens", "lm_calls", "rm_calls", "env_steps", "seconds", "faults")
#: what a command may raise for bad input: one line, exit status 2
USER_ERRORS = (UsageError, SpecError, PolicyError, TaskFileError, EnvError, PluginError, ValueError,
               KeyError)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are :class:`UsageError` s, so :func:`main` prints them as one line
    (``omrl: error: argument --limit: ... (see omrl search --help)``) and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


def finite_at_least(low: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number >= ``low``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low:g}, got {text!r}")
        return value

    return parse


# --- options shared by commands (defined once) --------------------------------------------------
def add_task_args(p: argparse.ArgumentParser) -> None:
    """``--env``, ``--split``, ``--file``, ``--limit``: which tasks (read by :func:`tasks_from_args`)."""
    p.add_argument("--env", required=True, help="environment name (`omrl envs` lists them)")
    p.add_argument("--split", default="test", help="task split (train|test)")
    p.add_argument("--file", help="a JSONL file of tasks instead of the built-in split")
    p.add_argument("--limit", type=int_at_least(1), default=None,
                   help="first N tasks (default: the whole split)")


def add_run_args(p: argparse.ArgumentParser) -> None:
    """How tasks are searched: policy, reward model, seed, depth, sampling, concurrency,
    executor and progress bars (read by :func:`models_from_args`, :func:`sampling_from_args`)."""
    p.add_argument("--policy", default=DEFAULT_POLICY,
                   help="smollm2 | hf:PATH | llamacpp:FILE.gguf | openai:URL#MODEL | "
                        "scripted:oracle:p=P | scripted:random (`omrl policies` lists them)")
    p.add_argument("--reward-model", default=None, help="e.g. rules:format=0.2,outcome=1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-depth", type=int_at_least(1), default=None, help="steps per episode (default: env's)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=DEFAULT_MAX_TOKENS,
                   help=f"completion tokens per step (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--temperature", type=finite_at_least(0), default=1.0, help="default sampling temperature")
    p.add_argument("--concurrency", type=int_at_least(1), default=None, help="trees searched in lockstep")
    p.add_argument("--constrain", choices=CONSTRAIN_MODES, default="auto",
                   help="structured decoding of each step: auto (the env's action language where it "
                        "has one, else the Think/Act frame; recorded when a backend cannot), actions, "
                        "format or none (default auto)")
    p.add_argument("--agent", choices=sorted(AGENT_FORMATS), default="react",
                   help="agent format: react ('Think:' line then 'Act:'), act (the 'Act:' line "
                        "alone: no free-text thought, for small untrained models) or terse (the "
                        "action alone after a prompt of the task and observation only, for trained "
                        "policies searched at a token budget; default react)")
    add_executor_args(p)
    p.add_argument("--no-progress", action="store_true")


def add_executor_args(p: argparse.ArgumentParser) -> None:
    """``--executor`` and ``--ray-address`` (read by :func:`executor_from_args`)."""
    p.add_argument("--executor", default="local",
                   help="local (this process) | ray[:workers=N,chunk=C,num_cpus=X,num_gpus=Y]")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (auto, ray://HEAD:10001) instead of a local Ray")


def tasks_from_args(args: argparse.Namespace) -> list:
    """The tasks named by ``--env/--split/--limit/--file``, validated."""
    try:
        env_class(args.env)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    if args.limit is not None and args.limit < 1:
        raise UsageError(f"--limit must be >= 1, got {args.limit}")
    tasks = load_tasks(args.env, args.split, args.limit, args.file)
    if not tasks:
        raise UsageError(f"env {args.env!r} has no tasks in split {args.split!r}")
    return tasks


def executor_from_args(args: argparse.Namespace) -> Executor:
    """``--executor``/``--ray-address`` parsed once, into the Executor every search is given."""
    kind, options = parse_executor(args.executor)
    if kind == "local" and args.ray_address:
        raise UsageError("--ray-address needs --executor ray")
    return Executor(kind, options, args.ray_address)


def models_from_args(args: argparse.Namespace) -> tuple[Executor, Any, Any]:
    """(executor, policy, reward model): the models built once here for a local search, left as
    their specs for Ray (each actor builds its own). The executor spec is checked first."""
    executor = executor_from_args(args)
    reward_model = executor.build(make_reward_model, args.reward_model)
    return executor, executor.build(make_policy, args.policy), reward_model


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)


# --- omrl search ----------------------------------------------------------------------------
def _configure_search(s: argparse.ArgumentParser) -> None:
    add_task_args(s)
    s.add_argument("--strategy", action="append", default=None,
                   help="NAME[:key=value,...]; repeat to compare strategies (default react)")
    s.add_argument("--budget", default=None, help="per-task limits, e.g. tokens=20000,env_steps=50")
    s.add_argument("--env-server", default=None, metavar="URL",
                   help="step envs on an `omrl env serve` at URL (agentgym+URL, webshop+URL, "
                        "sqlgym+URL: an AgentGym server; other schemes: env-server plugins)")
    add_run_args(s)
    s.add_argument("--out", default=None,
                   help="write DIR/results.jsonl (task by task) and DIR/summary.json; DIR appears "
                        "whole at the end (a failed run's finished tasks: DIR.partial)")


def _search(args: argparse.Namespace) -> int:
    tasks = tasks_from_args(args)
    strategies = [make_strategy(s) for s in (args.strategy or ["react"])]
    budget = parse_budget(args.budget)
    env_factory = None
    if args.env_server:
        env_factory = env_server_factory(args.env_server, args.env)
        check = getattr(env_factory, "check_tasks", None)  # a server whose tasks are not ours
        if check is not None:
            try:
                check(tasks)
            except ValueError as exc:
                raise UsageError(str(exc)) from None
        if args.concurrency is None:  # each tree holds a server env: stay under the server's cap
            args.concurrency = getattr(env_factory, "max_envs", None)
    executor_from_args(args)  # checked here, before the output; built with the models below
    # the output is checked (and its temporary sibling made) before any model is built
    with OutDir.open(args.out) if args.out else nullcontext() as out:
        executor, policy, reward_model = models_from_args(args)
        summary = search_strategies(tasks, strategies, out, policy=policy, reward_model=reward_model,
                                    budget=budget, seed=args.seed, max_depth=args.max_depth,
                                    sampling=sampling_from_args(args), concurrency=args.concurrency,
                                    progress=not args.no_progress, env_factory=env_factory,
                                    executor=executor, constrain=args.constrain, agent=args.agent)
        print(format_table(summary))
    if args.out:
        print(f"wrote {Path(args.out) / 'results.jsonl'} and {Path(args.out) / 'summary.json'}")
    return 0


def search_strategies(tasks: list, strategies: list, out: OutDir | None, **kwargs: Any) -> dict[str, dict]:
    """Each strategy over ``tasks`` (``kwargs``: :func:`search_many`'s); the summary keyed by
    strategy name (the whole spec for a repeated name), each row with its Wilson interval and,
    after the first, a ``paired`` McNemar test against the first on the same tasks. With
    ``out``, every result is appended to ``results.jsonl`` as its task finishes (in task order
    once done) and ``summary.json`` is written at the end. Each row records the ``host`` (CPU,
    cores, native bf16) and the policy's ``dtype`` (:mod:`omrl_search.host`)."""
    from .stats import outcomes, paired

    if out is not None:
        out.main_file = "results.jsonl"
    order = {t.task_id: i for i, t in reversed(list(enumerate(tasks)))}
    summary: dict[str, dict] = {}
    solved: dict[str, dict[str, bool]] = {}
    with ResultLog(out.path / "results.jsonl", out) if out is not None else nullcontext() as log:
        for k, strat in enumerate(strategies):
            on_result = None
            if log is not None:
                on_result = lambda r, k=k: log.add((k, order.get(r.task.task_id, len(order))), r.to_json())  # noqa: E731
            t0 = time.perf_counter()
            results = search_many(tasks, strategy=strat, on_result=on_result, **kwargs)
            key = strat.spec() if len(strategies) > 1 and strat.name in summary else strat.name
            summary[key] = summarize(results, time.perf_counter() - t0)
            summary[key].update(host=host_info(), dtype=policy_dtype(kwargs.get("policy")))
            solved[key] = outcomes(results)
            del results  # one strategy's trees in memory at a time
    first = next(iter(summary))
    for key in list(summary)[1:]:
        summary[key]["paired"] = paired(first, solved[first], solved[key])
    if out is not None:
        (out.path / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --- the parser and main ----------------------------------------------------------------------
def _parser(command: str | None) -> argparse.ArgumentParser:
    """The parser with only ``command``'s sub-parser when it names one (its plugin alone is
    imported), else with every command (``omrl --help``, a typo): a plugin that fails to load
    is then left out with one warning line, the others stay."""
    p = Parser(prog="omrl", description="Search-based rollouts for LLM agents.")
    sub = p.add_subparsers(dest="command", required=True)
    builtin = ["search", *LISTINGS]
    every = command not in builtin and command not in COMMANDS.names()
    if every or command == "search":
        _configure_search(sub.add_parser("search", help="run a search strategy over an env's tasks"))
    for name in COMMANDS.names() if every else [command] if command not in builtin else []:
        try:
            mod = COMMANDS.get(name)
        except PluginError as exc:
            if not every:
                raise
            print(f"omrl: warning: {exc}", file=sys.stderr)
            continue
        mod.configure(sub.add_parser(name, help=command_help(mod)))
    for name, (what, _) in LISTINGS.items():
        if every or command == name:
            sub.add_parser(name, help=f"list {what}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # OpenMP threads (torch's and llama.cpp's) spin while they wait; where another process shares
    # the cores that made SmolLM2 SFT steps 4x slower (52 s against 7-13 s passive, measured on
    # the 2-core dev VM) and llama.cpp 8-10x. Read when libgomp loads, so set before any import.
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser(argv[0] if argv else None).parse_args(argv)
        if isinstance(getattr(args, "out", None), str):  # every command's --out, before its work
            check_out_path(args.out)
        if args.command == "search":
            return _search(args)
        if args.command in LISTINGS:
            print("\n".join(LISTINGS[args.command][1]()))
            return 0
        return COMMANDS.get(args.command).run(args)
    except USER_ERRORS as exc:
        msg = str(exc.args[0]) if exc.args else type(exc).__name__
        notes = getattr(exc, "__notes__", [])  # e.g. where a failed run's finished tasks are
        print(f"omrl: error: {'; '.join([msg.splitlines()[0] if msg else msg, *notes])}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        print("; ".join(["omrl: interrupted", *getattr(exc, "__notes__", [])]), file=sys.stderr)
        return 130


def format_table(summary: dict[str, dict]) -> str:
    """A plain-text table, one row per strategy: success with its 95% interval, the paired test
    against the first row (when there is one), then the compute spent."""
    from .stats import fmt_paired, fmt_rate

    against = {s["paired"]["vs"] for s in summary.values() if "paired" in s}
    paired = bool(against)
    vs = f"vs {against.pop()}" if len(against) == 1 else "paired"
    cols = ["strategy", "success [95% CI]"] + ([f"{vs} (McNemar)"] if paired else []) + list(COST_FIELDS)
    rows = [[name, fmt_rate(s) if "ci_low" in s else _fmt(s["success_rate"])]
            + ([fmt_paired(s["paired"]) if "paired" in s else "-"] if paired else [])
            + [_fmt(s[c]) for c in COST_FIELDS] for name, s in summary.items()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                  for i, (v, w) in enumerate(zip(vals, widths)))
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _fmt(v: object) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
