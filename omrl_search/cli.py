"""The ``omrl`` command.

Every argument is validated (env, tasks, strategies, policy, budget) before anything is written;
a bad one prints one line naming it and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Sequence

from .api import SUMMARY_FIELDS, load_tasks, search_many, summarize
from .budget import Budget
from .env import EnvError, TaskFileError, env_class, list_envs
from .policy import PolicyError, list_policies, make_policy
from .result import write_results, write_text_atomic
from .reward import list_reward_models, make_reward_model
from .specs import SpecError
from .strategy import list_strategies, make_strategy
from .types import SamplingParams


class UsageError(Exception):
    """A bad argument; printed as one line."""


#: sub-commands that live in their own modules: each has ``configure(parser)`` and ``run(args)``
#: (modules must import cheaply: torch and friends only inside ``run``)
PLUGINS = {"bench": "omrl_search.bench", "export": "omrl_search.exports",
           "label": "reward_models.labels", "train": "train.cli", "env": "envs.server",
           "loop": "train.loop", "report": "omrl_search.report"}


def _plugin(name: str):
    import importlib

    try:
        return importlib.import_module(PLUGINS[name])
    except ModuleNotFoundError as exc:
        if exc.name != PLUGINS[name]:
            raise
        return None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omrl", description="Search-based rollouts for LLM agents.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("search", help="run a search strategy over an env's tasks")
    s.add_argument("--env", required=True, help=f"environment name")
    s.add_argument("--split", default="test", help="task split (train|test)")
    s.add_argument("--file", help="a JSONL file of tasks instead of the built-in split")
    s.add_argument("--limit", type=int, default=None, help="first N tasks")
    s.add_argument("--strategy", action="append", default=None,
                   help="NAME[:key=value,...]; repeat to compare strategies (default react)")
    s.add_argument("--policy", default="scripted:oracle:p=0.3",
                   help="smollm2 | hf:PATH | llamacpp:FILE.gguf | scripted:oracle:p=P | scripted:random")
    s.add_argument("--reward-model", default=None, help="e.g. rules:format=0.2,outcome=1")
    s.add_argument("--budget", default=None, help="per-task limits, e.g. tokens=20000,env_steps=50")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-depth", type=int, default=None, help="steps per episode (default: env's)")
    s.add_argument("--max-tokens", type=int, default=96, help="completion tokens per step")
    s.add_argument("--temperature", type=float, default=1.0, help="default sampling temperature")
    s.add_argument("--concurrency", type=int, default=None, help="trees searched in lockstep")
    s.add_argument("--env-server", default=None, metavar="URL",
                   help="step envs on an `omrl env serve` at URL (agentgym+URL, webshop+URL, "
                        "sqlgym+URL: an AgentGym server)")
    add_executor_args(s)
    s.add_argument("--out", default=None, help="write DIR/results.jsonl and DIR/summary.json")
    s.add_argument("--no-progress", action="store_true")

    for name in PLUGINS:
        mod = _plugin(name)
        if mod is not None:
            mod.configure(sub.add_parser(name, help=mod.__doc__.strip().splitlines()[0]))

    for name, what in (("envs", "environments"), ("strategies", "strategies"),
                       ("policies", "policy backends"), ("reward-models", "reward models")):
        sub.add_parser(name, help=f"list {what}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    # OpenMP threads (torch's and llama.cpp's) spin while they wait; where another process shares
    # the cores that made SmolLM2 SFT steps 4x slower (52 s against 7-13 s passive, measured on
    # the 2-core dev VM) and llama.cpp 8-10x. Read when libgomp loads, so set before any import.
    import os

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = _parser().parse_args(argv)
    try:
        if args.command == "search":
            return _search(args)
        if args.command in PLUGINS:
            return _plugin(args.command).run(args)
        listing = {"envs": list_envs, "strategies": list_strategies, "policies": list_policies,
                   "reward-models": list_reward_models}[args.command]
        print("\n".join(listing()))
        return 0
    except (UsageError, SpecError, PolicyError, TaskFileError, EnvError, ValueError, KeyError) as exc:
        msg = exc.args[0] if exc.args else type(exc).__name__
        print(f"omrl: error: {msg}", file=sys.stderr)
        return 2


def tasks_from_args(args: argparse.Namespace) -> list:
    """The tasks named by ``--env/--split/--limit/--file``, validated (shared by sub-commands)."""
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


def add_executor_args(p: argparse.ArgumentParser) -> None:
    """``--executor`` and ``--ray-address`` (shared by search and bench)."""
    p.add_argument("--executor", default="local",
                   help="local (this process) | ray[:workers=N,chunk=C,num_cpus=X,num_gpus=Y]")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (auto, ray://HEAD:10001) instead of a local Ray")


def for_executor(args: argparse.Namespace, make, spec):
    """``make(spec)`` (a policy, a reward model) built here for ``--executor local``; for Ray the
    spec string itself: each actor builds its own. The executor spec is checked first."""
    from .executors import parse_executor

    where, _ = parse_executor(args.executor)
    if where == "local" and args.ray_address:
        raise UsageError("--ray-address needs --executor ray")
    return make(spec) if where == "local" else spec


def _search(args: argparse.Namespace) -> int:
    tasks = tasks_from_args(args)
    strategies = [make_strategy(s) for s in (args.strategy or ["react"])]
    budget = Budget.parse(args.budget)
    reward_model = for_executor(args, make_reward_model, args.reward_model)
    out = Path(args.out) if args.out else None
    if out is not None and out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    policy = for_executor(args, make_policy, args.policy)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    env_factory = None
    if args.env_server:
        from envs.remote import remote_factory

        env_factory = remote_factory(args.env_server, args.env)
        if args.concurrency is None:  # each tree holds a server env: stay under the server's cap
            args.concurrency = env_factory.max_envs

    summary, all_results = {}, []
    for strat in strategies:
        t0 = time.perf_counter()
        results = search_many(tasks, strategy=strat, policy=policy, reward_model=reward_model,
                              budget=budget, seed=args.seed, max_depth=args.max_depth,
                              sampling=sampling, concurrency=args.concurrency,
                              progress=not args.no_progress, env_factory=env_factory,
                              executor=args.executor, ray_address=args.ray_address)
        key = strat.spec() if len(strategies) > 1 and strat.name in summary else strat.name
        summary[key] = summarize(results, time.perf_counter() - t0)
        all_results += results
    print(format_table(summary))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_results(out / "results.jsonl", all_results)
        write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
        print(f"wrote {out / 'results.jsonl'} and {out / 'summary.json'}")
    return 0


def format_table(summary: dict[str, dict]) -> str:
    """A plain-text table, one row per strategy."""
    cols = ("strategy",) + SUMMARY_FIELDS
    rows = [[name] + [_fmt(s[c]) for c in SUMMARY_FIELDS] for name, s in summary.items()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    line = lambda vals: "  ".join(v.ljust(w) if i == 0 else v.rjust(w)  # noqa: E731
                                  for i, (v, w) in enumerate(zip(vals, widths)))
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _fmt(v: object) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
