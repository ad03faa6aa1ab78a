"""label search trees with per-step values (Monte-Carlo, MCTS Q) for PRM training

``omrl label RESULTS... --out DIR [--policy SPEC] [--rollouts N]`` reads search results
(``results.jsonl`` files or folders holding one) and writes ``DIR/<split>.parquet`` label files
(layout in :mod:`reward_models.label_files`); ``omrl label --check FILE...`` validates label files.
``omrl export prm RESULTS --out FILE`` writes the same rows from the trees alone (no fresh
rollouts): both build them with :func:`omrl_search.exports.prm_rows`, whose prompts are the
engine's own (system prompt, action help, first observation) and what the learned PRM reads.

For every step of every root-to-leaf path of every tree (failed nodes and duplicate-state
prunes left out):

* **Monte-Carlo value** in the style of Math-Shepherd (Wang et al. 2024): the share of rollouts
  from the step's node that end in success. The finished leaves already below the node in the
  tree count as rollouts (``--no-tree-leaves`` to use fresh ones only); where there are fewer than
  ``--rollouts`` N, the missing ones are sampled with ``--policy`` through the engine
  (``search_many``: every tree's rollouts advance together, one policy call per round). Nodes are
  rebuilt by replaying the recorded completions in the env and checked against the recorded state
  keys. Leaves of a search are chosen by the search, so values from them lean towards the search's
  own preferences; fresh rollouts are samples of the policy itself.
* **Q-value** where the node has MCTS visits: value sum / visits (the ``q_values`` column).
  As a label (``--soft q``, :func:`q_labels`) solver-proven values replace it: a node with a
  solved finished leaf below it is a proven win (1.0: the env is deterministic and single-player,
  so the way down is a way to win), a finished step that failed a proven loss (0.0); a node with
  neither visits nor a proof keeps its MC value.
* **Shared proofs** (``--soft q --share-proofs``, :func:`shared_proofs`), for envs that offer
  :meth:`omrl_search.env.Env.value_key` (Game24, Countdown): a proven win is passed on to every
  step, in any tree of any task, whose state has the same key, including children the search
  never visited. Every such label is a win the search reached; no solver is asked.
* **Exact value** (``--soft exact``, :func:`exact_labels`), for envs that offer
  :meth:`omrl_search.env.Env.exact_value` (Game24, Countdown): 1.0 when the state after the step
  can still be solved, 0.0 when not; a finished step is its success. Every step gets one, so no
  path is cut. It is an oracle the loop has on no other env: as *training* labels it is a ceiling
  experiment, never the loop's default.

``soft_labels`` is the MC value (``--soft mc``), the Q-value where there is one (``q``), the
mean of MC and the plain Q-value (``mean``) or the exact value (``exact``); ``labels`` is
``soft_labels >= --threshold``. A terminal step's MC value is its own success.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from omrl_search.exports import SOFT
from omrl_search.strategy import Strategy
from omrl_search.types import DEFAULT_MAX_TOKENS


# --- completing rollouts through the engine ------------------------------------------------------
@dataclass
class _Target:
    path: list[str]  # completions from the root to the node
    state_key: str
    need: int
    successes: int = 0
    done: int = 0


class RolloutCompleter(Strategy):
    """A strategy that rebuilds given nodes by replaying their completions (no LM call), then
    rolls each out ``need`` times with the policy. Results are stored on the targets."""

    name = "label-rollouts"
    verifier_in_loop = False

    def __init__(self, plans: dict[str, list[_Target]], temperature: float | None = None):
        self.plans, self.temperature = plans, temperature

    def spec(self) -> str:
        return self.name

    def select(self, ctx: Any) -> Any:
        return None

    async def run(self, ctx: Any) -> None:
        from omrl_search.tree import FAILED

        trie: dict[tuple[int, str], Any] = {}
        starts, owners = [], []
        for target in self.plans.get(ctx.task.task_id, []):
            node = ctx.root
            for completion in target.path:
                child = trie.get((node.id, completion))
                if child is None:
                    kids = ctx.apply(node, [completion], dedup=False)
                    if not kids:
                        raise ValueError(f"replay of {ctx.task.task_id} failed")
                    child = trie[(node.id, completion)] = kids[0]
                node = child
            if target.state_key and node.state_key and node.state_key != target.state_key:
                raise ValueError(f"replay of {ctx.task.task_id} diverged from the recorded tree "
                                   f"(state {node.state_key[:12]} != {target.state_key[:12]})")
            if node.status == FAILED:
                continue
            starts += [node] * target.need
            owners += [target] * target.need
        if not starts:
            return
        leaves = await ctx.rollout(starts, temperature=self.temperature)
        for target, leaf in zip(owners, leaves):
            if leaf.terminal and leaf.status != FAILED:  # a faulted rollout is not a sample
                target.done += 1
                target.successes += bool(leaf.success)


# --- Q and exact labels ------------------------------------------------------------------------------
KINDS = SOFT + ("exact",)  # what ``omrl label --soft`` accepts


def q_labels(results: Sequence[Any]) -> dict[tuple[int, int], float]:
    """``{(result index, node id): Q}`` of every tree (:func:`omrl_search.export_common.q_values`:
    proven wins and losses exact, other visited nodes their visit-weighted mean return). Nodes
    with neither are absent (their rows keep the MC value there)."""
    from omrl_search.export_common import q_values

    return {(i, nid): q for i, res in enumerate(results) for nid, (q, _) in q_values(res.tree).items()}


def check_exact(env_names: Iterable[str]) -> None:
    """One ValueError line naming the first env that cannot compute exact values."""
    from omrl_search.env import env_class, offers_exact_value

    for name in sorted(set(env_names)):
        if not offers_exact_value(env_class(name)):
            raise ValueError(f"env {name!r} cannot compute exact values (--soft exact / --labels "
                             "exact need an env offering Env.exact_value, e.g. game24 or countdown)")


def replayed_states(results: Sequence[Any]):
    """``(result index, node, env)`` for every stepped, unfinished node of every tree, the env
    standing at that node's state: each tree's env is reset to its task and the recorded actions
    replayed (checked against the recorded state keys; a malformed step, which never reached the
    env, keeps its parent's state). Finished steps come as ``(index, node, None)``."""
    from omrl_search.env import make_env
    from omrl_search.tree import FAILED

    envs: dict[str, Any] = {}
    for i, res in enumerate(results):
        tree = res.tree
        env = envs.get(tree.task.env) or envs.setdefault(tree.task.env, make_env(tree.task.env))
        env.reset(tree.task)
        states = {0: env.snapshot()}
        for n in tree.nodes[1:]:  # parents come before their children
            parent = tree.nodes[n.parent]
            if n.status == FAILED or n.step is None or parent.id not in states:
                continue
            if n.terminal:
                yield i, n, None
                continue
            env.restore(states[parent.id])
            if not (n.state_key and n.state_key == parent.state_key):  # a malformed step: no env step
                env.step(n.step.action)
                if n.state_key and env.state_key() != n.state_key:
                    raise ValueError(f"replay of {tree.task.task_id} diverged from the recorded tree "
                                     f"at node {n.id}")
            states[n.id] = env.snapshot()
            yield i, n, env


def exact_labels(results: Sequence[Any]) -> dict[tuple[int, int], float]:
    """``{(result index, node id): exact value}`` for every stepped node of every tree
    (:func:`replayed_states`): a finished step is its success, any other the env's
    :meth:`~omrl_search.env.Env.exact_value`."""
    check_exact(r.task.env for r in results)
    return {(i, n.id): float(n.success) if env is None else float(env.exact_value())
            for i, n, env in replayed_states(results)}


def shared_proofs(results: Sequence[Any]) -> dict[tuple[int, int], float]:
    """Q labels (:func:`q_labels`) with every solver-proven win passed on to the unfinished steps
    whose state the env keys the same (:meth:`~omrl_search.env.Env.value_key`), in the same tree
    or in another task's: a transposition table over all the trees. Sound where the key says what
    it promises (equal keys: both solvable or neither), since a proof is a way to win found by the
    search; it labels steps of no Q of their own (children the search never visited) when their
    state was proven elsewhere. No oracle: every win it passes on is one the search reached."""
    from omrl_search.export_common import q_values

    keys: dict[tuple[int, int], str] = {}
    for i, n, env in replayed_states(results):
        key = env.value_key() if env is not None else None
        if env is not None and key is None:
            raise ValueError(f"env {results[i].task.env!r} offers no value_key: --share-proofs needs "
                             "one (Game24, Countdown)")
        if key is not None:
            keys[(i, n.id)] = key
    out: dict[tuple[int, int], float] = {}
    won: set[str] = set()
    for i, res in enumerate(results):
        for nid, (q, proven) in q_values(res.tree).items():
            out[(i, nid)] = q
            if proven and q == 1.0 and (i, nid) in keys:
                won.add(keys[(i, nid)])
    out.update({node: 1.0 for node, key in keys.items() if key in won})
    return out


# --- labelling -------------------------------------------------------------------------------------
def label_results(results: Iterable[Any], *, policy: Any = None, rollouts: int = 4,
                  soft: str = "mc", threshold: float = 0.5, tree_leaves: bool = True,
                  segments: bool = True, seed: int = 0, max_depth: int | None = None,
                  sampling: Any = None, progress: bool = False, tokenizer: Any = None,
                  share_proofs: bool = False) -> list[dict[str, Any]]:
    """Label rows (see :mod:`reward_models.label_files`) from search results: the rows of
    :func:`omrl_search.exports.prm_rows` (``omrl export prm``), with fresh rollouts by
    ``policy`` added where a step has fewer than ``rollouts``."""
    from omrl_search.api import search_many
    from omrl_search.exports import SOFT, finished_below, label_paths, prm_rows

    if soft not in KINDS:
        raise ValueError(f"soft must be one of {', '.join(KINDS)}, got {soft!r}")
    if rollouts < 0 or not 0.0 < threshold <= 1.0:
        raise ValueError("need rollouts >= 0 and 0 < threshold <= 1")
    results = list(results)
    if share_proofs and soft != "q":
        raise ValueError("share_proofs passes solver-proven wins between Q labels: it needs soft=q")
    override = (exact_labels(results) if soft == "exact" else shared_proofs(results) if share_proofs
                else q_labels(results) if soft == "q" else None)
    if soft == "exact":
        policy = None  # every step has its value: no rollouts to complete
    plans: dict[str, list[_Target]] = {}
    tasks: dict[str, Any] = {}
    targets: dict[tuple[int, int], _Target] = {}
    for i, res in enumerate(results if policy is not None else []):
        tree = res.tree
        below = finished_below(tree) if tree_leaves else {}
        for path in label_paths(tree):
            for node in path:
                have = below.get(node.id, (0, 0))[1]
                if node.terminal or (i, node.id) in targets or have >= rollouts:
                    continue
                target = targets[(i, node.id)] = _Target(
                    [n.step.completion for n in tree.path(node)[1:]], node.state_key, rollouts - have)
                plans.setdefault(res.task.task_id, []).append(target)
                tasks.setdefault(res.task.task_id, res.task)
    if plans:
        completer = RolloutCompleter(plans, sampling.temperature if sampling is not None else None)
        done = search_many(list(tasks.values()), strategy=completer, policy=policy, seed=seed,
                           max_depth=max_depth, sampling=sampling, progress=progress,
                           agent=results[0].tree.agent)  # rollouts continue in the trees' format
        bad = [f"{r.task.task_id}: {f}" for r in done for f in r.faults if "strategy:" in f]
        if bad:
            raise ValueError(f"completing rollouts failed: {bad[0]}")
    extra = {key: (t.successes, t.done) for key, t in targets.items()}
    return prm_rows(results, soft="mc" if soft == "exact" else soft, threshold=threshold,
                    tree_leaves=tree_leaves, extra=extra, segments=segments, tokenizer=tokenizer,
                    override=override)


# --- the command -------------------------------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="*", help="results.jsonl files (or folders holding one)")
    p.add_argument("--out", help="folder for <split>.parquet label files and meta.json")
    p.add_argument("--check", nargs="+", metavar="FILE", help="only validate label files")
    p.add_argument("--policy", default=None,
                   help="policy that completes rollouts where the tree has too few (omit: tree only)")
    p.add_argument("--rollouts", type=int, default=4, help="rollouts wanted per step (default 4)")
    p.add_argument("--no-tree-leaves", action="store_true",
                   help="do not count the tree's own finished leaves as rollouts")
    p.add_argument("--soft", choices=KINDS, default="mc",
                   help="what soft_labels holds (default mc; q: MCTS Q with proven wins/losses; "
                        "exact: the env's exact value, an oracle: as training labels a ceiling experiment)")
    p.add_argument("--share-proofs", action="store_true",
                   help="with --soft q: a step whose state the env keys as a proven win's (in any "
                        "tree, any task) is a proven win too (Env.value_key: Game24, Countdown)")
    p.add_argument("--threshold", type=float, default=0.5, help="labels = soft_labels >= this")
    p.add_argument("--no-segments", action="store_true", help="leave the token-id segments out")
    p.add_argument("--max-depth", type=int, default=None, help="rollout depth (default: env's)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help=f"completion tokens per rollout step (default {DEFAULT_MAX_TOKENS})")
    p.add_argument("--tokenizer", default=None,
                   help="re-encode segments with this model's tokenizer (smollm2, an HF folder or a .gguf)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")


def _result_files(paths: Sequence[str]) -> list[Path]:
    """Result files named, or in a folder: its ``results.jsonl`` (``omrl search``) or, failing
    that, its ``trees/*.jsonl`` (``omrl bench --save-trees``)."""
    out = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            trees = sorted((p / "trees").glob("*.jsonl"))
            if not (p / "results.jsonl").is_file() and trees:
                out += trees
                continue
            p = p / "results.jsonl"
        if not p.is_file():
            raise ValueError(f"{raw}: no such results file (nor a bench folder with trees/*.jsonl)")
        out.append(p)
    return out


def run(args: argparse.Namespace) -> int:
    from .label_files import read_labels, write_labels

    if args.check:
        for f in args.check:
            rows = read_labels(f)
            print(f"{f}: ok, {len(rows)} rows, {sum(len(r['completions']) for r in rows)} steps")
        return 0
    if not args.results or not args.out:
        raise ValueError("give results files and --out DIR (or --check FILE...)")
    if args.rollouts < 0:
        raise ValueError(f"--rollouts must be >= 0, got {args.rollouts}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a folder")
    from omrl_search.policy import make_policy
    from omrl_search.result import read_results
    from omrl_search.types import SamplingParams

    results = [r for f in _result_files(args.results) for r in read_results(f)]
    if not results:
        raise ValueError("the results files hold no searches")
    if args.soft == "exact":
        check_exact(r.task.env for r in results)  # before any tokenizer or policy is loaded
    from omrl_search.exports import load_encoder

    encoder = load_encoder(args.tokenizer) if args.tokenizer else None
    policy = make_policy(args.policy) if args.policy and args.soft != "exact" else None
    t0 = time.perf_counter()
    rows = label_results(
        results, policy=policy, rollouts=args.rollouts, soft=args.soft, threshold=args.threshold,
        tree_leaves=not args.no_tree_leaves, segments=not args.no_segments, seed=args.seed,
        max_depth=args.max_depth, sampling=SamplingParams(args.temperature, max_tokens=args.max_tokens),
        progress=not args.no_progress, tokenizer=encoder, share_proofs=args.share_proofs)
    if not rows:
        raise ValueError("no labelled steps: the trees have no finished rollouts (give --policy)")
    written = write_labels(rows, out)
    meta = summarize_rows(rows)
    if args.soft == "exact":
        meta["oracle"] = ("exact labels: the env's solver, which the loop has on no other env; "
                          "as training labels a ceiling experiment")
        print("note: exact labels are an oracle; training on them is a ceiling experiment", file=sys.stderr)
    meta.update(seconds=round(time.perf_counter() - t0, 2), files=written,
                args={k: v for k, v in vars(args).items() if k not in ("func",)})
    (out / "meta.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    for split, s in meta["splits"].items():
        print(f"{split}: {s['rows']} rows, {s['steps']} steps, {s['positive']} positive, "
              f"mean soft label {s['mean_soft']:.3f}, {s['tasks']} tasks -> {written[split]}")
    return 0


def summarize_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    splits: dict[str, Any] = {}
    for r in rows:
        s = splits.setdefault(r["split"], {"rows": 0, "steps": 0, "positive": 0, "soft": 0.0,
                                           "tasks": set(), "with_q": 0})
        s["rows"] += 1
        s["steps"] += len(r["completions"])
        s["positive"] += sum(r["labels"])
        s["soft"] += sum(r["soft_labels"])
        s["with_q"] += sum(q is not None for q in r.get("q_values") or [])
        s["tasks"].add(r["task_id"])
    for s in splits.values():
        s["mean_soft"] = round(s.pop("soft") / max(s["steps"], 1), 4)
        s["tasks"] = len(s["tasks"])
    return {"rows": len(rows), "splits": splits}


if __name__ == "__main__":  # pragma: no cover
    from omrl_search.cli import main

    sys.exit(main(["label", *sys.argv[1:]]))
