"""The Python API: ``search`` one task, ``search_many`` in lockstep, ``load_tasks``, ``summarize``."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from .budget import Budget
from .engine import DEFAULT_MAX_NODES
from .env import Env, env_class
from .agent import make_format
from .executors import Executor
from .policy import Policy
from .result import SearchResult, constraint_totals
from .reward import RewardModel
from .specs import SpecError
from .strategy import Strategy, make_strategy
from .types import SamplingParams, Task

#: a run's summary row; ``ci_low``/``ci_high`` bound the success rate (Wilson 95%, docs/design.md §8)
SUMMARY_FIELDS = ("tasks", "successes", "success_rate", "ci_low", "ci_high", "prompt_tokens",
                  "prefill_tokens", "cached_tokens", "completion_tokens", "lm_calls", "rm_calls",
                  "rm_tokens", "env_steps", "seconds", "faults")


def load_tasks(env: str, split: str = "test", limit: int | None = None,
               file: str | None = None) -> list[Task]:
    """An env's built-in tasks for ``split``, or the tasks of a user JSONL ``file``."""
    cls = env_class(env)
    tasks = cls.load_tasks(file) if file else cls.tasks(split)
    return tasks[:limit] if limit is not None else tasks


def search_many(tasks: Sequence[Task], *, strategy: "str | Strategy" = "react",
                policy: "str | Policy" = "scripted:oracle", reward_model: "str | RewardModel | None" = None,
                budget: "str | dict | Budget | None" = None, seed: int = 0,
                max_depth: int | None = None, sampling: SamplingParams | None = None,
                concurrency: int | None = None, progress: bool = False,
                on_result: Callable[[SearchResult], None] | None = None,
                env_factory: Callable[[str], Env] | None = None,
                executor: "str | Executor" = "local", ray_address: str | None = None,
                schedule: str = "continuous", prefix_order: bool = True,
                policy_weights: tuple[Any, Any] | None = None, constrain: str = "auto",
                agent: str = "react", lm_timeout: float | None = None,
                max_nodes: int | None = DEFAULT_MAX_NODES) -> list[SearchResult]:
    """Search every task with one strategy, batching all trees' LM and reward-model calls.

    Each argument may be a spec string or the object it names (a Strategy, Policy, RewardModel,
    Budget, :class:`~omrl_search.executors.Executor`); objects pass through unparsed, so a
    caller that built them once (the CLI, ``bench``) is not parsed again.
    ``budget`` applies to each task separately (``"tokens=20000"``, a dict, or a Budget).
    ``executor="ray"`` (or ``"ray:workers=4,..."``) runs the tasks on Ray actors, a local Ray or
    the cluster at ``ray_address``; see :mod:`omrl_search.executors`.
    ``env_factory(env_name)`` builds each search's env (default: in-process ``make_env``; e.g.
    :func:`omrl_search.env.env_server_factory` for envs on an ``omrl env serve`` or AgentGym server).
    ``schedule`` (``continuous`` | ``lockstep``) and ``prefix_order`` choose how the trees' LM
    requests are grouped into policy calls (see :class:`~omrl_search.engine.Engine`); neither
    changes a seeded search's trees, only how busy the LM is kept.
    ``policy_weights=(version, state_dict)`` (Ray only): the actors' ``hf:`` policy searches with
    these weights (pushed once per version; online GRPO sends its live weights every round).
    ``agent``: the agent format (``react``: a ``Think:`` line then ``Act:``; ``act``: the
    ``Act:`` line alone; ``terse``: the action alone after a prompt of the task and observation
    only; see :mod:`omrl_search.agent`).
    ``constrain`` (``auto`` | ``actions`` | ``format`` | ``none``): the grammar each step is
    generated under (docs/design.md §4: the env's action language where it has one under
    ``auto``); each result records what was in force. ``lm_timeout``: seconds one LM call may
    take before it is abandoned as that node's fault; ``max_nodes``: the cap on a tree's nodes
    when no budget stops it first (None: no cap).
    """
    if concurrency is not None and concurrency < 1:
        raise SpecError(f"concurrency must be >= 1 (or None for all tasks), got {concurrency}")
    where = Executor.parse(executor, ray_address)
    return where.search(tasks, strategy=make_strategy(strategy), policy=policy,
                        reward_model=reward_model, budget=parse_budget(budget), progress=progress,
                        on_result=on_result, policy_weights=policy_weights, seed=seed,
                        max_depth=max_depth, sampling=sampling, concurrency=concurrency,
                        env_factory=env_factory, schedule=schedule, prefix_order=prefix_order,
                        constrain=constrain, agent=make_format(agent).name, lm_timeout=lm_timeout,
                        max_nodes=max_nodes)


#: the one budget door (:meth:`Budget.parse`), under the name the CLI and ``bench`` import
parse_budget = Budget.parse


def search(task: Task, **kwargs: Any) -> SearchResult:
    """Search one task; the keyword arguments are those of :func:`search_many`."""
    return search_many([task], **kwargs)[0]


def summarize(results: Iterable[SearchResult], seconds: float | None = None) -> dict[str, Any]:
    """Per-run figures: tasks, successes, success rate with its Wilson 95% interval
    (``ci_low``, ``ci_high``), budget spent summed, faults."""
    from .stats import rate  # scipy: imported when a summary is made, not with the package

    results = list(results)
    out: dict[str, Any] = dict.fromkeys(SUMMARY_FIELDS, 0)
    out.update(rate(sum(bool(r.success) for r in results), len(results)))
    for r in results:
        for key in ("prompt_tokens", "cached_tokens", "completion_tokens", "lm_calls", "rm_calls",
                    "rm_tokens", "env_steps"):
            out[key] += int(r.spent.get(key, 0))
        out["faults"] += len(r.faults)
    # prompt tokens the backend computed (the rest its prefix cache served; all of them in
    # results written before the split was recorded)
    out["prefill_tokens"] = out["prompt_tokens"] - out["cached_tokens"]
    out["seconds"] = round(seconds if seconds is not None else sum(r.seconds for r in results), 3)
    out["verifier_in_loop"] = any(r.verifier_in_loop for r in results)
    out["constraint"] = constraint_totals(results)
    return out
