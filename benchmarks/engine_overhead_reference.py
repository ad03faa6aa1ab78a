"""Engine overhead next to a per-node Python search library: llm-reasoners' MCTS, same workload.

Runs the MCTS workload of ``benchmarks/engine_overhead.py`` (its own code path: ``measure``
with the same spec) and then the same search through llm-reasoners 1.0.2
(``reasoners.algorithm.mcts.MCTS``, a ``WorldModel`` + ``SearchConfig`` per task), alternating
the two ``--repeat`` times in one process and keeping each side's fastest run, so both figures
come from the same interpreter, machine and minute.

    pip install llm-reasoners==1.0.2 --no-deps && pip install numpy tqdm   # a scratch venv
    python benchmarks/engine_overhead_reference.py [--tasks 100] [--simulations 200] [--repeat 5]

Both sides: Game24 test tasks, our ``Game24Env`` stepping the state (restore the parent's value
snapshot, step, snapshot), k=3 candidate moves per expansion drawn with the same rule
(``engine_overhead.random_move``: two random numbers and a random op, from a seeded RNG), value
1 at a solved terminal and 0 otherwise, 200 simulations (omrl: backups; llm-reasoners:
``n_iters``), depth limit 6 (the env's step limit). Times are process CPU time; the env and the
policy are subtracted the same way on both sides where possible: the env by replaying every
tree's env calls afterwards on a fresh env (omrl: ``engine_overhead.env_seconds``;
llm-reasoners: the world model's ``init_state``, ``step`` and ``is_terminal`` calls, read off
the final tree), the policy by its own clock (omrl) or by replaying every ``SearchConfig`` hook
(``get_actions``, ``fast_reward``, ``reward``) the search made (plain llm-reasoners rows). What
is left is "overhead": omrl's engine + strategy code, or llm-reasoners' MCTS code.

The ``*_in_search`` columns subtract instead what the env and the policy cost where they ran:
both sides step ``engine_overhead.TimedGame24Env``, which times its own ``reset``, ``step`` and
``snapshot`` with ``perf_counter`` (the reference's world model times its ``restore`` too; the
engine sets a value snapshot's state itself), and the zero-cost policy and the plain hooks time
themselves the same way. A replay runs on warm caches, so it charges the env less than the
search paid and leaves the rest in "overhead", on both sides alike but not by equal amounts;
the in-search figures have no such gap, but mix wall-clock parts into a CPU-time total, so
they are meant for a quiet machine.

The ``llm-reasoners + agent hooks`` row is the library as an LLM agent uses it: its state
carries the path's text (first observation, then each turn's completion and observation);
``get_actions`` renders the chat for it with our ``ReActFormat`` and the policy's
``ByteChatTokenizer`` (render + encode, the text and ids an LM would receive), asks the same
``ZeroCostPolicy`` for k completions in one request, and parses each with ``ReActFormat.parse``;
the world model steps the parsed action. Only the env calls (replayed) and the policy (its own
clock, as on our side) are subtracted, so prompt building, parsing, request objects, the
state's bookkeeping and the reward hooks count as library + agent overhead. Before timing,
``check_prompts`` asserts that this rendering gives every request of our engine's search of
5 tasks the same messages and prompt ids (completion ids = the text's encoding, as an LM's).

What differs, and whom it favours:

* The plain llm-reasoners rows subtract every hook, so they lack work that omrl's overhead
  includes (favours them): each request's chat messages and prompt token ids, parsing the
  ``Think:/Act:`` completion, budget and token accounting, per-state dedup. The agent-hooks
  row adds the prompt and parsing work; it still does no budget accounting or dedup (favours
  it), and re-renders and re-encodes the whole prompt (~1 kB here) per expansion, as the
  library keeps nothing per node for it, where omrl caches messages per node and encodes only
  each new observation turn (against it). Its trees differ a little from the plain rows'
  (the zero-cost policy's RNG also draws token ids between moves); figures are per node.
* omrl searches all tasks in lockstep, 4 leaves per round with virtual loss, and batches the LM
  requests of every tree; llm-reasoners searches one task at a time, one leaf per iteration,
  and has no batching machinery to pay for (favours llm-reasoners).
* llm-reasoners creates a child per proposed action but steps the env only for a child it
  visits; its simulation expands every node on the rollout path (k proposals each) and
  follows the first child (``simulate_strategy='max'`` on equal fast rewards; the moves are
  random, so the rollout is random). omrl steps every proposed child (its count includes
  children pruned as duplicate states) and its rollout proposes one move per step. ``nodes``
  counts env-stepped nodes on both sides, rollout nodes included, so llm-reasoners' per-node
  figure also carries its never-stepped children (against it); the ``per_child`` column
  divides by children created instead (for it).
* UCT on Q = the mean of a node's list of cumulative rewards (llm-reasoners keeps every
  backup's value, so each Q costs O(visits)) vs PUCT on running sums with priors (omrl).
  llm-reasoners' default ``calc_q`` is ``np.mean``; the ``py-mean`` row passes a pure-Python
  mean, the cheapest its API allows. Its ``np.sqrt``/``np.log`` in UCT are not configurable.
* With 200 simulations both sides exhaust most of the ~40-node trees (3 moves per state, 3
  combines to the end), so most simulations re-visit finished paths (about 5 per node);
  ``--simulations 20`` shows the expansion-bound regime, where the gap is much smaller.
* ``import reasoners`` imports torch and transformers (its ``base.py``, for the LM classes);
  MCTS uses neither. Where they are not installed, empty stand-in modules are placed in
  ``sys.modules`` for that import only (and removed after), so the library's code runs
  unmodified without a 1 GB install; with them installed the import is plain.

Prints a table, then as its last line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import sys
import types
from typing import NamedTuple


import engine_overhead as eo  # noqa: E402
import omrl_search as om  # noqa: E402
from envs.game24 import Game24Env  # noqa: E402
from omrl_search.agent import ReActFormat  # noqa: E402
from omrl_search.engine import Engine  # noqa: E402
from omrl_search.policy import ByteChatTokenizer  # noqa: E402
from omrl_search.types import GenRequest, SamplingParams, Snapshot  # noqa: E402

INSTALL = "pip install llm-reasoners==1.0.2 --no-deps && pip install numpy tqdm"
CLOCK = eo.CLOCK


def import_reasoners_mcts():
    """``(reasoners.algorithm, note)``, or ``(None, why)`` when llm-reasoners is missing."""
    if importlib.util.find_spec("reasoners") is None:
        return None, "llm-reasoners is not installed"
    stand_ins = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    for name in stand_ins:
        sys.modules[name] = types.ModuleType(name)
    if "transformers" in stand_ins:
        sys.modules["transformers"].StoppingCriteriaList = list  # only an annotation in base.py
    try:
        from reasoners import algorithm
    except ImportError as exc:
        return None, f"cannot import reasoners.algorithm: {exc}"
    finally:
        for name in stand_ins:
            del sys.modules[name]
    note = f"stand-ins for {', '.join(stand_ins)} during import" if stand_ins else "plain import"
    return algorithm, note


def make_hooks():
    """The ``WorldModel`` and ``SearchConfig`` classes over our Game24 env (zero-cost policy)."""
    from reasoners import SearchConfig, WorldModel

    class Game24World(WorldModel):
        """States are our env's value snapshots; a step restores, steps and snapshots."""

        def __init__(self, task):
            super().__init__()
            self.task, self.env = task, RefEnv()

        def init_state(self):
            self.env.reset(self.task)
            return self.env.snapshot()

        def step(self, state, action):
            env = self.env
            env.restore(state)
            res = env.step(action)
            return env.snapshot(), {"success": res.success}

        def is_terminal(self, state):
            return state.payload.done

    class RandomMoves(SearchConfig):
        """k moves by ``engine_overhead.random_move`` from a fresh RNG per call (as the zero-cost
        policy seeds one per request); reward 1 for the step that solves the puzzle."""

        seconds = 0.0  # the hooks' own wall time in the search (the in-search policy share)

        def __init__(self, k: int, seed: int):
            super().__init__()
            self.k, self.seed, self.calls = k, seed, 0

        def get_actions(self, state):
            self.calls += 1
            rng, nums = random.Random(self.seed * 1_000_003 + self.calls), state.payload.numbers
            return [eo.random_move(rng, nums) for _ in range(self.k)]

        def reward(self, state, action, success=False, **_):
            return (1.0 if success else 0.0), {}

    for hook in ("get_actions", "fast_reward", "reward"):  # each hook times itself
        setattr(RandomMoves, hook, eo.timed(getattr(RandomMoves, hook), RandomMoves))
    return Game24World, RandomMoves


class RefEnv(eo.TimedGame24Env):
    """The timed env with ``restore`` timed too: the reference restores through the env's API,
    where the engine sets a value snapshot's state itself."""

    restore = eo.timed(Game24Env.restore)


class AgentState(NamedTuple):
    """An agent's state on llm-reasoners: the env snapshot and the path's text (the first
    observation, then each turn's completion and the observation it got)."""

    snapshot: Snapshot
    first: str
    turns: tuple[tuple[str, str], ...]


def agent_prompt(fmt: ReActFormat, tok: ByteChatTokenizer, env, task, first: str, turns):
    """The chat for a path and its prompt ids, rendered whole (the text an LM would receive)."""
    messages = fmt.first_messages(env, task, first)
    for completion, observation in turns:
        messages += ({"role": "assistant", "content": completion},
                     fmt.observation_message(observation))
    return messages, tok.encode(tok.render(messages, add_generation_prompt=True))


def make_agent_hooks(policy: eo.ZeroCostPolicy):
    """``WorldModel`` and ``SearchConfig`` classes of a ReAct agent on llm-reasoners: per
    expansion, render the path's chat and prompt ids, ask ``policy`` (whose clock times only
    its draw) for k completions, and parse each one; the world model steps the parsed action."""
    from reasoners import SearchConfig, WorldModel

    class AgentWorld(WorldModel):
        def __init__(self, task):
            super().__init__()
            self.task, self.env = task, RefEnv()

        def init_state(self):
            first = self.env.reset(self.task)
            return AgentState(self.env.snapshot(), first, ())

        def step(self, state, action):
            completion, parsed = action
            if parsed.error:  # a malformed completion: the error is the observation
                return state._replace(turns=state.turns + ((completion, parsed.error),)), {}
            env = self.env
            env.restore(state.snapshot)
            res = env.step(parsed.action)
            turns = state.turns + ((completion, res.observation),)
            return (AgentState(env.snapshot(), state.first, turns),
                    {"success": res.success})

        def is_terminal(self, state):
            return state.snapshot.payload.done

    class AgentHooks(SearchConfig):
        def __init__(self, task, k: int, seed: int):
            super().__init__()
            self.task, self.k, self.seed, self.calls = task, k, seed, 0
            self.env, self.format = Game24Env(), ReActFormat()  # the env for its action syntax

        def get_actions(self, state):
            self.calls += 1
            fmt, env = self.format, self.env
            messages, ids = agent_prompt(fmt, policy.tokenizer, env, self.task, state.first,
                                         state.turns)
            seed = self.seed * 1_000_003 + self.calls
            params = SamplingParams(1.0, 1.0, 96, fmt.stop, self.k, seed)
            request = GenRequest(messages, params, ids, {"snapshot": state.snapshot})
            gens = policy.generate([request])[0]
            return [(g.text, fmt.parse(g.text, env.action_help)) for g in gens]

        def reward(self, state, action, success=False, **_):
            return (1.0 if success else 0.0), {}

    return AgentWorld, AgentHooks


def check_prompts(tasks) -> int:
    """Assert that ``agent_prompt`` gives every request of our engine's MCTS (same workload)
    the same messages and prompt ids as the engine; returns how many requests were checked.
    The policy here returns each completion's encoding as its ids, as an LM's would be (the
    zero-cost policy's ids are random bytes, which no re-rendering could reproduce)."""
    seen = []

    class Recording(eo.ZeroCostPolicy):
        reads_messages = True  # the messages are what is checked

        def generate(self, requests):
            seen.extend(requests)
            out = super().generate(requests)
            for gens in out:
                for g in gens:
                    g.token_ids = self.tokenizer.encode(g.text)
            return out

    spec = eo.workloads(20)["mcts"]
    results = Engine(Recording(), seed=0, env_factory=lambda _: Game24Env()).run(
        om.make_strategy(spec), tasks)
    fmt, tok, checked = ReActFormat(), ByteChatTokenizer(), 0
    for r in results:
        at = {id(n.snapshot): n for n in reversed(r.tree.nodes)}  # the first node per snapshot
        for req in (q for q in seen if q.meta["task"] is r.task):
            path = r.tree.path(at[id(req.meta["snapshot"])])
            turns = tuple((n.step.completion, n.step.observation) for n in path[1:])
            messages, ids = agent_prompt(fmt, tok, Game24Env(), r.task, path[0].observation, turns)
            if messages != req.messages or ids != req.prompt_ids:
                raise AssertionError(f"{r.task.task_id}: agent prompt differs from the engine's")
            checked += 1
    return checked


def walk(root):
    """Every node of an llm-reasoners tree (placeholders included)."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        if node.children:
            stack.extend(node.children)


def stepped(trees, agent: bool):
    """Per tree, the env calls the search made: ``(parent snapshot, action, child snapshot)``
    for every node that reached the env (an agent state's snapshot and its parsed action
    unwrapped; a malformed completion never reaches the env)."""
    out = []
    for task, root in trees:
        steps = [(n.parent.state, n.action, n.state) for n in walk(root)
                 if n.parent is not None and n.state is not None]
        if agent:
            steps = [(p.snapshot, a.action, c.snapshot) for p, (_, a), c in steps if not a.error]
        out.append((task, steps))
    return out


def env_replay_seconds(trees, agent: bool, steps_per_node: int = 1) -> float:
    """CPU seconds of the searches' env calls (``init_state``, then ``step`` and
    ``is_terminal`` per stepped node; ``steps_per_node`` steps where the algorithm steps each
    node more than once, as llm-reasoners' DFS does), replayed on fresh plain world models."""
    world_cls, _ = make_hooks()
    calls = stepped(trees, agent)  # gathered before the clock starts
    t0 = CLOCK()
    for task, steps in calls:
        world = world_cls(task)
        world.init_state()
        step, terminal = world.step, world.is_terminal
        for parent, action, state in steps:
            for _ in range(steps_per_node):
                step(parent, action)
            terminal(state)
    return CLOCK() - t0


def hook_replay_seconds(config_cls, k: int, trees, fast: bool = True) -> float:
    """CPU seconds of the zero-cost hooks the searches called (``get_actions``,
    ``fast_reward`` unless ``fast`` is False, ``reward``), replayed from the final trees on
    fresh configs."""
    calls = []
    for (task, root), (_, steps) in zip(trees, stepped(trees, agent=False)):
        asked = [n for n in walk(root) if n.children]
        calls.append((steps, [n.state for n in asked],
                      [(n.state, c.action) for n in asked for c in n.children] if fast else []))
    t0 = CLOCK()
    for i, (steps, asked, proposed) in enumerate(calls):
        config = config_cls(k, i)
        actions, fast_reward, reward = config.get_actions, config.fast_reward, config.reward
        for state in asked:
            actions(state)
        for state, action in proposed:
            fast_reward(state, action)
        for parent, action, state in steps:
            reward(parent, action, success=state.payload.success)
    return CLOCK() - t0


#: llm-reasoners' counterparts of the workloads: MCTS (``n_iters`` simulations, UCT on Q),
#: BeamSearch (``beam_size`` 5, k=3 per beam, argmax on the step's reward, ties in proposal
#: order) and DFS (``max_per_state`` 3, no prior, explores until its ``total_states``; it
#: steps each child twice, once outside its state-count check, so its env replay does too)
def reasoners_search(algorithm, kind: str, simulations: int, calc_q):
    depth = Game24Env.max_steps
    if kind == "mcts":
        return algorithm.MCTS(n_iters=simulations, depth_limit=depth, w_exp=1.0, calc_q=calc_q,
                              disable_tqdm=True)
    if kind == "beam":
        return algorithm.BeamSearch(beam_size=5, max_depth=depth)
    return algorithm.DFS(total_states=10_000, max_per_state=3, depth=depth, prior=False,
                         max_terminal_nodes=10_000)


def measure_reasoners(algorithm, tasks, simulations: int, k: int, calc_q, agent: bool = False,
                      kind: str = "mcts") -> dict:
    """llm-reasoners' ``kind`` search over every task, one at a time. Plain: every hook is
    subtracted. ``agent``: only the env calls and the policy's own clock are (prompt building,
    parsing and the agent's state bookkeeping stay in, as on our side)."""
    policy = eo.ZeroCostPolicy()
    if agent:
        world_cls, config_cls = make_agent_hooks(policy)
        configs = [config_cls(task, k, i) for i, task in enumerate(tasks)]
    else:
        world_cls, config_cls = make_hooks()
        configs = [config_cls(k, i) for i in range(len(tasks))]
    algo = reasoners_search(algorithm, kind, simulations, calc_q)
    root_of = (lambda out: out.tree_state) if kind != "beam" else (lambda out: out.tree)
    eo.TimedGame24Env.seconds = config_cls.seconds = 0.0
    t0 = CLOCK()
    trees = [(task, root_of(algo(world_cls(task), config))) for task, config in zip(tasks, configs)]
    cpu = CLOCK() - t0
    env_in_search = eo.TimedGame24Env.seconds
    policy_in_search = policy.seconds if agent else config_cls.seconds
    twice = 2 if kind == "dfs" else 1
    env_s = env_replay_seconds(trees, agent, twice)
    policy_s = policy.seconds if agent else hook_replay_seconds(config_cls, k, trees, kind != "dfs")
    all_nodes = [n for _, root in trees for n in walk(root)]
    nodes = sum(1 for n in all_nodes if n.parent is not None and n.state is not None)
    sims = sum(len(root.cum_rewards) for _, root in trees) if kind == "mcts" else 0
    solved = sum(any(n.state is not None and n.reward > 0 for n in walk(root)) for _, root in trees)
    return row(cpu, env_s, policy_s, nodes, sims, len(all_nodes) - len(trees), solved,
               nodes * twice, cpu - env_in_search - policy_in_search)


def row(cpu: float, env_s: float, policy_s: float, nodes: int, sims: int, created: int,
        solved: int, env_steps: int, over_in_search: float) -> dict:
    over = cpu - env_s - policy_s
    env_steps = env_steps or nodes
    return {"overhead_us_per_node_in_search": round(1e6 * over_in_search / nodes, 2),
            "overhead_us_per_simulation_in_search": round(1e6 * over_in_search / sims, 2) if sims else "-",
            "nodes": nodes, "children_created": created, "simulations": sims,
            "env_steps": env_steps, "trees_with_success": solved, "cpu_s": round(cpu, 4),
            "env_s": round(env_s, 4), "policy_s": round(policy_s, 4), "overhead_s": round(over, 4),
            "us_per_node": round(1e6 * cpu / nodes, 2),
            "env_us_per_node": round(1e6 * env_s / nodes, 2),
            "policy_us_per_node": round(1e6 * policy_s / nodes, 2),
            "overhead_us_per_node": round(1e6 * over / nodes, 2),
            "overhead_us_per_child": round(1e6 * over / created, 2),
            "overhead_us_per_env_step": round(1e6 * over / env_steps, 2),
            "overhead_us_per_simulation": round(1e6 * over / sims, 2) if sims else "-"}


def measure_omrl(tasks, simulations: int, kind: str = "mcts") -> dict:
    """``engine_overhead.measure`` on its ``kind`` spec, in this table's terms."""
    r = eo.measure(kind, eo.workloads(simulations)[kind], tasks, profile=False)
    return row(r["cpu_s"], r["env_s"], r["policy_s"], r["nodes"], r["simulations"] if kind == "mcts" else 0,
               r["nodes"], r["trees_with_success"], r["env_steps"],
               r["cpu_s"] - r["env_in_search_s"] - r["policy_s"])


def python_mean(xs):
    """Q for llm-reasoners' ``calc_q`` without numpy's per-call array conversion."""
    return sum(xs) / len(xs)


KINDS = ("mcts", "beam", "dfs")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=100)
    ap.add_argument("--simulations", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5, help="runs per side; the fastest is kept")
    ap.add_argument("--kinds", default="mcts", help=f"comma-separated, of {','.join(KINDS)}")
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: each of {', '.join(KINDS)}, got {args.kinds!r}")
    tasks = om.load_tasks("game24", "test", limit=args.tasks)
    algorithm, note = import_reasoners_mcts()
    checked = None
    sides = {}
    for kind in kinds:
        tag = "" if kind == "mcts" else f" {kind}"
        sides["omrl-search" + tag] = lambda kind=kind: measure_omrl(tasks, args.simulations, kind)
        if algorithm is None:
            continue
        import numpy as np
        sides["llm-reasoners" + tag] = lambda kind=kind: measure_reasoners(
            algorithm, tasks, args.simulations, 3, np.mean, kind=kind)
        if kind == "mcts":
            sides["llm-reasoners py-mean"] = lambda: measure_reasoners(
                algorithm, tasks, args.simulations, 3, python_mean)
            sides["llm-reasoners + agent hooks"] = lambda: measure_reasoners(
                algorithm, tasks, args.simulations, 3, np.mean, agent=True)
            sides["llm-reasoners + agent, py-mean"] = lambda: measure_reasoners(
                algorithm, tasks, args.simulations, 3, python_mean, agent=True)
        else:
            sides[f"llm-reasoners + agent hooks {kind}"] = lambda kind=kind: measure_reasoners(
                algorithm, tasks, args.simulations, 3, np.mean, agent=True, kind=kind)
    if algorithm is not None and "mcts" in kinds:
        checked = check_prompts(tasks[:5])
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for _ in range(max(args.repeat, 1)):  # alternate the sides so they share the machine's state
        for name, fn in sides.items():
            runs[name].append(fn())
    rows = {name: min(rs, key=lambda r: r["cpu_s"]) for name, rs in runs.items()}
    for name, r in rows.items():  # each row against our row of the same workload
        kind = next((k for k in KINDS[1:] if name.endswith(f" {k}")), "mcts")
        ours = rows["omrl-search" + ("" if kind == "mcts" else f" {kind}")]
        r["overhead_ratio_to_omrl"] = round(r["overhead_us_per_node"] / ours["overhead_us_per_node"], 1)
        r["in_search_ratio_to_omrl"] = round(r["overhead_us_per_node_in_search"]
                                             / ours["overhead_us_per_node_in_search"], 1)
    cols = ("nodes", "children_created", "simulations", "env_steps", "cpu_s", "us_per_node",
            "env_us_per_node", "policy_us_per_node", "overhead_us_per_node", "overhead_us_per_child",
            "overhead_us_per_env_step", "overhead_us_per_simulation", "overhead_ratio_to_omrl",
            "overhead_us_per_node_in_search", "overhead_us_per_simulation_in_search",
            "in_search_ratio_to_omrl")
    print(f"Game24, {args.tasks} tasks, {args.simulations} MCTS simulations, k=3, zero-cost policy, "
          f"fastest of {args.repeat} alternating runs (CPU time); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}, Python {platform.python_version()}")
    if checked is not None:
        print(f"agent hooks: prompts identical to the engine's for {checked} requests of "
              f"{min(len(tasks), 5)} tasks (messages and token ids)")
    print(f"{'':36}" + "".join(f"{c:>{len(c) + 2}}" for c in cols))
    for name, r in rows.items():
        print(f"{name:36}" + "".join(f"{r.get(c, '-'):>{len(c) + 2}}" for c in cols))
    version = None
    if algorithm is None:
        print(f"llm-reasoners side skipped ({note}): {INSTALL}")
    else:
        version = importlib.metadata.version("llm-reasoners")
    print(json.dumps({"benchmark": "engine_overhead_reference", "python": platform.python_version(),
                      "cpus": os.cpu_count(), "tasks": args.tasks, "simulations": args.simulations,
                      "repeat": args.repeat, "load_average": os.getloadavg()[0],
                      "llm_reasoners": version, "reasoners_import": note,
                      "agent_prompts_checked": checked, **rows}))


if __name__ == "__main__":
    main()
