"""omrl-search: search-based rollouts for LLM agents over snapshotting environments.

The façade re-exports what users need::

    import omrl_search as om
    tasks = om.load_tasks("game24", "test", limit=20)
    results = om.search_many(tasks, strategy="best_of_n:n=8", policy="smollm2", budget="tokens=20000")
    print(om.summarize(results))

Envs, strategies, reward models, policy backends and ``omrl`` commands are plugins found through
entry points (docs/design.md §7); importing this package imports none of them (nor torch).
"""
from .api import load_tasks, search, search_many, summarize
from .budget import Budget, BudgetExhausted
from .engine import Engine, SearchContext
from .env import Env, NativeSnapshots, ReplayEnv, ValueSnapshots, list_envs, make_env, register_env
from .policy import Policy, list_policies, make_policy, register_policy
from .plugins import PluginError
from .result import SearchResult, read_results, write_results
from .reward import (RewardModel, aggregate, list_reward_models, make_reward_model,
                     register_reward_model)
from .strategy import Strategy, list_strategies, make_strategy, register_strategy
from .tree import Node, SearchTree, Trajectory
from .types import (Generation, GenRequest, SamplingParams, Segment, Snapshot, Step, StepResult,
                    Task)

__version__ = "0.1.0"

__all__ = [
    "Budget", "BudgetExhausted", "Engine", "Env", "Generation", "GenRequest", "Node",
    "NativeSnapshots", "PluginError", "Policy", "ReplayEnv", "RewardModel", "SamplingParams",
    "SearchContext", "SearchResult", "SearchTree", "Segment", "Snapshot", "Step", "StepResult",
    "Strategy", "Task", "Trajectory", "ValueSnapshots", "aggregate", "list_envs", "list_policies",
    "list_reward_models", "list_strategies", "load_tasks", "make_env", "make_policy",
    "make_reward_model", "make_strategy", "read_results", "register_env", "register_policy",
    "register_reward_model", "register_strategy", "search", "search_many", "summarize",
    "write_results",
]
