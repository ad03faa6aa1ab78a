"""Where :func:`omrl_search.search_many` runs: ``local`` (this process, the default) or ``ray``.

:class:`Executor` is the parsed choice; :func:`search_here` is the in-process search and
:func:`search_on_ray` spreads it over actors that each run :func:`search_here` (so this module
needs nothing from :mod:`omrl_search.api`, which calls it).

``executor="ray"`` (``--executor ray`` in the CLI) partitions the tasks over Ray actors; each
actor builds its own policy and reward model **from their specs** once and runs the ordinary
in-process search (:func:`search_here`) on its share (so its own engine, envs and lockstep batching); the
results come back as ``results.jsonl`` lines (no live env snapshots) and are put back in the
input order. Because the engine seeds every task from ``(seed, task_id)``, a seeded scripted
search gives the same trees on Ray as in-process. (Sampling LM backends draw per batch, and
batches depend on which tasks share a worker, so their samples differ, not their distribution.)

Options follow the name like other specs: ``ray:workers=4,chunk=8,num_cpus=1,num_gpus=0.25``.

* ``workers``: actors (default: the cluster's CPUs divided by ``num_cpus``, at most one per task);
* ``chunk``: tasks handed to an actor at a time (default: an even share, the biggest lockstep
  batches; smaller chunks balance uneven tasks and report progress sooner);
* ``num_cpus`` / ``num_gpus``: Ray resources per actor (a GPU policy such as
  ``hf:PATH:device=cuda`` needs ``num_gpus``; fractions share one GPU).

Ray is started on demand (``ray.init(num_cpus=os.cpu_count(), include_dashboard=False)``) or
joined at ``ray_address`` (``auto``, ``ray://HEAD:10001``...); an already initialised Ray is
used as it is. Every node needs omrl-search installed. A Policy or RewardModel *object* is sent
to the actors only if it can be pickled (a scripted policy can, a loaded llama.cpp model cannot:
pass its spec string instead). An actor that dies loses only its chunk: those tasks come back as
failed results with the error as their fault, and a fresh actor takes its place. The actors are
kept for the next call with the same policy, reward model and resources (``omrl bench`` over
strategies and budgets builds the model once per actor); :func:`release` frees them.

Weight refresh: ``policy_weights=(version, state_dict)`` makes every actor's policy search with
these weights (a torch ``state_dict`` of CPU tensors, e.g. a trainer's live model: online GRPO
sends its own before every rollout round). They are put in Ray's object store once per
``version``, and an actor loads them (``load_state_dict``, strict) only when it holds another
version, so the kept actors are never rebuilt for new weights and the same version sent again
costs nothing: ``version`` must change whenever the weights do. The policy must be an ``hf:``
spec (it gives architecture, tokenizer and dtype; the push gives the weights); another policy,
or weights that do not fit, is one PolicyError. Actors keep the last weights pushed to them
until :func:`release` (or a call with another policy spec).

Envs are stepped where their tree is searched: inside the actor (``env_factory`` travels with
the other search arguments, so ``--env-server URL`` works here too). Per tree the engine steps one
env call at a time, so an env on an actor of its own would add a round trip per step without
adding parallelism that more search workers do not already give.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from .agent import ReActFormat, make_format
from .budget import Budget
from .engine import DEFAULT_MAX_FAULTS, DEFAULT_MAX_NODES, Engine
from .env import Env, make_env
from .policy import PolicyError, make_policy, require
from .result import SearchResult
from .reward import make_reward_model
from .specs import SpecError, parse_spec
from .strategy import Strategy
from .tree import FAILED, SearchTree
from .types import SamplingParams, Task

EXECUTORS = ("local", "ray")
_RAY_OPTIONS = {"workers": int, "chunk": int, "num_cpus": float, "num_gpus": float}


def parse_executor(spec: str | None) -> tuple[str, dict[str, Any]]:
    """``"ray:workers=4"`` -> ``("ray", {"workers": 4})``, checked; a bad one is a SpecError."""
    name, opts = parse_spec(spec or "local", "executor")
    if name not in EXECUTORS:
        raise SpecError(f"unknown executor {spec!r} (known: {', '.join(EXECUTORS)}; e.g. ray:workers=4)")
    allowed = _RAY_OPTIONS if name == "ray" else {}
    for key, value in opts.items():
        if key not in allowed:
            raise SpecError(f"executor {name}: unknown option {key!r} (known: {', '.join(allowed) or 'none'})")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise SpecError(f"executor {name}: {key} must be a positive number, got {value!r}")
        opts[key] = allowed[key](value)
    return name, opts


@dataclass(frozen=True)
class Executor:
    """A parsed executor: ``kind`` (local | ray), its ``options`` and the Ray cluster to join.

    Built once (by the CLI, ``bench`` or ``search_many``) and passed along as it is, so nothing
    downstream parses the spec again."""

    kind: str = "local"
    options: dict[str, Any] = field(default_factory=dict)
    ray_address: str | None = None

    @classmethod
    def parse(cls, spec: "str | Executor | None" = None, ray_address: str | None = None) -> "Executor":
        """From ``"ray:workers=4"`` (or an Executor, passed through); a bad spec is a SpecError."""
        if isinstance(spec, Executor):
            return spec if ray_address is None else replace(spec, ray_address=ray_address)
        kind, options = parse_executor(spec)
        if kind == "local" and ray_address:
            raise SpecError("ray_address needs executor 'ray' (e.g. ray:workers=4)")
        return cls(kind, options, ray_address)

    def build(self, make: Callable[[Any], Any], spec: Any) -> Any:
        """``make(spec)`` (a policy, a reward model) built here once when searching in this
        process; on Ray the spec itself, which every actor builds for itself."""
        return make(spec) if self.kind == "local" else spec

    def search(self, tasks: Sequence[Task], *, strategy: Strategy, policy: Any, reward_model: Any,
               budget: Budget, progress: bool = False,
               on_result: Callable[[SearchResult], None] | None = None,
               policy_weights: tuple[Any, Any] | None = None, **search_kwargs: Any) -> list[SearchResult]:
        """Search ``tasks`` here or on Ray; ``search_kwargs`` are :func:`search_here`'s (seed,
        max_depth, sampling, concurrency, env_factory, schedule, prefix_order, constrain,
        agent, lm_timeout, max_nodes, max_faults)."""
        if self.kind == "ray":
            return search_on_ray(tasks, options=self.options, ray_address=self.ray_address,
                                 strategy=strategy, policy=policy, reward_model=reward_model,
                                 progress=progress, on_result=on_result,
                                 policy_weights=policy_weights, budget=budget, **search_kwargs)
        if policy_weights is not None:
            raise PolicyError("policy_weights need executor=ray "
                              "(in process, load them into the policy object)")
        return search_here(tasks, strategy=strategy, policy=policy, reward_model=reward_model,
                           budget=budget, progress=progress, on_result=on_result, **search_kwargs)


def search_here(tasks: Sequence[Task], *, strategy: Strategy, policy: Any, reward_model: Any,
                budget: Budget, seed: int = 0, max_depth: int | None = None,
                sampling: SamplingParams | None = None, concurrency: int | None = None,
                progress: bool = False, on_result: Callable[[SearchResult], None] | None = None,
                env_factory: Callable[[str], Env] | None = None, schedule: str = "continuous",
                prefix_order: bool = True, constrain: str = "auto", agent: "str | ReActFormat" = "react",
                lm_timeout: float | None = None,
                max_nodes: int | None = DEFAULT_MAX_NODES,
                max_faults: int | None = DEFAULT_MAX_FAULTS) -> list[SearchResult]:
    """The in-process search (what every Ray actor runs on its share too): one engine, every
    tree's LM and reward-model calls batched. ``policy``/``reward_model``: objects or specs.
    ``agent``: the agent format's name (``react``, ``act``; :mod:`omrl_search.agent`).
    ``constrain``, ``lm_timeout``, ``max_nodes``, ``max_faults``: see
    :class:`~omrl_search.engine.Engine`."""
    engine = Engine(make_policy(policy), reward_model=make_reward_model(reward_model),
                    agent_format=make_format(agent), sampling=sampling, max_depth=max_depth, seed=seed,
                    env_factory=env_factory or make_env, schedule=schedule,
                    prefix_order=prefix_order, constrain=constrain, lm_timeout=lm_timeout,
                    max_nodes=max_nodes, max_faults=max_faults)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc=strategy.name, unit="task", leave=False)
    won = 0

    def done(result: SearchResult) -> None:
        nonlocal won
        won += result.success
        if bar is not None:
            bar.update(1)
            bar.set_postfix(success=f"{won}/{bar.n}")
        if on_result is not None:
            on_result(result)

    try:
        return engine.run(strategy, tasks, budget, concurrency=concurrency, on_result=done)
    finally:
        if bar is not None:
            bar.close()


def search_on_ray(tasks: Sequence[Task], *, options: dict[str, Any], ray_address: str | None,
                  strategy: Any, policy: Any, reward_model: Any, progress: bool = False,
                  on_result: Callable[[SearchResult], None] | None = None,
                  policy_weights: tuple[Any, Any] | None = None,
                  **search_kwargs: Any) -> list[SearchResult]:
    """``search_many(tasks, ...)`` on Ray actors; ``search_kwargs`` are passed to each actor's
    :func:`search_here` (budget, seed, max_depth, sampling, concurrency, env_factory, ...).
    ``policy_weights=(version, state_dict)``: load these weights into the actors' policy first."""
    ray = _ray(ray_address)
    policy, pkey = _portable(ray, policy, "policy", "e.g. 'smollm2:llamacpp' or 'openai:http://HOST:8000/v1#MODEL'")
    reward_model, rkey = _portable(ray, reward_model, "reward model", "e.g. 'prm:PATH'")
    tasks = list(tasks)
    if not tasks:
        return []
    per_actor = {"num_cpus": options.get("num_cpus", 1.0), "num_gpus": options.get("num_gpus", 0.0)}
    cpus = float(ray.cluster_resources().get("CPU", 1.0))
    workers = options.get("workers") or max(1, int(cpus // max(per_actor["num_cpus"], 1e-9)))
    workers = min(workers, len(tasks))
    chunk = options.get("chunk") or -(-len(tasks) // workers)
    chunks = [list(range(i, min(i + chunk, len(tasks)))) for i in range(0, len(tasks), chunk)]
    pool = _pool(ray, (pkey, rkey, tuple(sorted(per_actor.items()))), per_actor,
                 (policy, reward_model), workers)
    weights = pool.push(policy_weights, workers) if policy_weights is not None else None

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(tasks), desc=f"{getattr(strategy, 'name', strategy)}@ray", unit="task",
                   leave=False)
    results: list[SearchResult | None] = [None] * len(tasks)
    running: dict[Any, tuple[int, list[int]]] = {}  # ref -> (actor slot, task indices)

    def submit(slot: int) -> None:
        if chunks:
            idx = chunks.pop(0)
            chunk_tasks = [tasks[i] for i in idx]
            running[pool.actors[slot].run.remote(strategy, chunk_tasks, search_kwargs, weights)] = (slot, idx)

    try:
        for slot in range(workers):
            submit(slot)
        while running:
            [ref], _ = ray.wait(list(running), num_returns=1)
            slot, idx = running.pop(ref)
            try:
                got = [SearchResult.from_dict(d) for d in ray.get(ref)]
            except Exception as exc:  # noqa: BLE001 - a dead actor loses only its chunk
                lines = str(exc).strip().splitlines()
                fault = f"ray worker: {type(exc).__name__}: {lines[-1] if lines else ''}"
                got = [_failed(tasks[i], strategy, fault) for i in idx]
                pool.replace(slot)
            for i, res in zip(idx, got):
                results[i] = res
                if bar is not None:
                    bar.update(1)
                if on_result is not None:
                    on_result(res)
            submit(slot)
    finally:
        if bar is not None:
            bar.close()
    return results  # type: ignore[return-value]


class _Pool:
    """The search actors, kept between calls with the same policy, reward model and resources
    (``omrl bench`` over strategies and budgets builds the model once per actor)."""

    current: "_Pool | None" = None

    def __init__(self, ray: Any, key: tuple, per_actor: dict[str, float], args: tuple) -> None:
        self.ray, self.key, self.args = ray, key, args
        self.cls = ray.remote(**per_actor)(_SearchWorker)
        self.actors: list[Any] = []
        self.weights: tuple[Any, list[Any]] | None = None  # (version, [its object ref])

    def grow(self, n: int) -> None:
        """At least ``n`` actors, each checked to have built its policy (else one PolicyError)."""
        while len(self.actors) < n:
            self.actors.append(self.cls.remote(*self.args))
        errors = [e for e in self.ray.get([a.error.remote() for a in self.actors[:n]]) if e]
        if errors:
            release()
            raise PolicyError(errors[0])

    def push(self, policy_weights: tuple[Any, Any], n: int) -> tuple[Any, list[Any]]:
        """Put ``(version, state_dict)`` in the object store (once per version) and load it into
        the first ``n`` actors (each skips a version it holds); (version, [ref]) for ``run``,
        which loads it into an actor that replaced a dead one. Weights that do not fit: one
        PolicyError."""
        version, state = policy_weights
        if self.weights is None or self.weights[0] != version:
            self.weights = None  # drop the old weights' ref before putting the new ones
            self.weights = (version, [self.ray.put(dict(state))])  # a list: Ray passes the ref as is
        errors = [e for e in self.ray.get([a.load_weights.remote(*self.weights) for a in self.actors[:n]]) if e]
        if errors:
            raise PolicyError(errors[0])
        return self.weights

    def replace(self, slot: int) -> None:
        self.ray.kill(self.actors[slot])
        self.actors[slot] = self.cls.remote(*self.args)


def _pool(ray: Any, key: tuple, per_actor: dict[str, float], args: tuple, workers: int) -> _Pool:
    key = (ray.get_runtime_context().get_job_id(),) + key  # a new ray.init: new actors
    if _Pool.current is None or _Pool.current.key != key:
        release()
        _Pool.current = _Pool(ray, key, per_actor, args)
    _Pool.current.grow(workers)
    return _Pool.current


def release() -> None:
    """Kill the kept search actors (they also end with Ray)."""
    pool, _Pool.current = _Pool.current, None
    if pool is not None and pool.ray.is_initialized():
        for actor in pool.actors:
            pool.ray.kill(actor)


class _SearchWorker:
    """A Ray actor: one policy and reward model, built from their specs, searching chunks."""

    def __init__(self, policy: Any, reward_model: Any) -> None:
        self._error = ""
        self._version: Any = None  # of the weights pushed last (None: those the spec loaded)
        try:
            self.policy = make_policy(policy)
            self.reward_model = make_reward_model(reward_model)
        except Exception as exc:  # noqa: BLE001 - reported once, as one line, by error()
            self._error = exc.args[0] if isinstance(exc, (PolicyError, SpecError)) and exc.args else (
                f"{type(exc).__name__}: {exc}")

    def error(self) -> str:
        return self._error

    def load_weights(self, version: Any, ref: list[Any]) -> str:
        """Load the pushed ``state_dict`` (``ref[0]``) into the policy's model unless this
        ``version`` is loaded already; the error line, or "" when done."""
        if version == self._version:
            return ""
        model = getattr(self.policy, "model", None)
        if not hasattr(model, "load_state_dict"):
            return (f"policy_weights need a policy with torch weights ('hf:PATH'), "
                    f"not {type(self.policy).__name__}")
        import ray

        state, own = ray.get(ref[0]), model.state_dict()
        missing, unexpected = [k for k in own if k not in state], [k for k in state if k not in own]
        why = f"missing {missing[:2]}, unexpected {unexpected[:2]}" if missing or unexpected else ""
        if not why:
            try:
                model.load_state_dict(state)
                self.policy.clear_cache()  # its cached KV was computed with the old weights
            except RuntimeError as exc:  # a shape mismatch
                why = " ".join(line.strip() for line in str(exc).splitlines()[1:3])
        if why:
            return f"policy_weights do not fit the workers' {type(model).__name__}: {why}"
        self._version = version
        return ""

    def run(self, strategy: Any, tasks: list[Task], kwargs: dict[str, Any],
            weights: tuple[Any, list[Any]] | None = None) -> list[dict[str, Any]]:
        if weights is not None and (error := self.load_weights(*weights)):
            raise PolicyError(error)
        results = search_here(tasks, strategy=strategy, policy=self.policy,
                              reward_model=self.reward_model, **kwargs)
        return [r.to_dict() for r in results]


def _ray(address: str | None) -> Any:
    ray = require("ray", "ray")
    if not ray.is_initialized():
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
    return ray


def _portable(ray: Any, obj: Any, what: str, example: str) -> tuple[Any, Any]:
    """(what to send, a key for it): a spec string (or None) as it is; an object only if it
    pickles (its pickle is the key), else one clear line."""
    if obj is None or isinstance(obj, str):
        return obj, obj
    try:
        return obj, ray.cloudpickle.dumps(obj)
    except Exception as exc:  # noqa: BLE001
        raise PolicyError(f"executor=ray builds the {what} on every worker: give its spec string "
                          f"({example}), not a {type(obj).__name__} object "
                          f"(it cannot be pickled: {type(exc).__name__})") from None


def _failed(task: Task, strategy: Any, fault: str) -> SearchResult:
    """The result of a task whose worker died: a failed root, the error as its fault."""
    tree = SearchTree(task, "", None)
    tree.root.status, tree.root.error = FAILED, fault
    spec = strategy.spec() if hasattr(strategy, "spec") else str(strategy)
    return SearchResult(task=task, strategy=spec, tree=tree, best=None, success=False, spent={},
                        faults=[fault], stop_reason="error", seconds=0.0)

