"""What a PRM-guided search pays for its scores: the PRM's prefix cache on and off, on real trees.

A search scores every new node's whole episode; without the cache each score is a forward over
the prompt and every step so far. This replays saved search trees (``omrl bench --save-trees``)
node by node in the order the search made them (a round's new nodes scored together, as the
engine does), once with ``prefix_cache=off`` and once with the cache, and prints per side the
nodes scored, CPU and wall seconds, tokens forwarded against tokens read, and the largest
difference between the two sides' scores.

    python benchmarks/prm_scoring.py --prm runs/loop-countdown/round_3/prm/model \
        runs/bench-loop-countdown/trees/mcts@tokens=3000.jsonl --trees 10

Prints a table, then as its last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import resource
import time



def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def rounds_of(tree) -> list[list]:
    """The tree's scored nodes (not the root) grouped by depth: parents before children."""
    by_depth: dict[int, list] = {}
    for node in tree.nodes[1:]:
        by_depth.setdefault(node.depth, []).append(node)
    return [by_depth[d] for d in sorted(by_depth)]


def run_side(prm_dir: str, trees: list, cache: str, batch: int) -> dict:
    from reward_models.prm import ProcessRewardModel

    prm = ProcessRewardModel.from_pretrained(prm_dir, device="cpu", dtype="float32", prefix_cache=cache)
    scores: list[float] = []
    c0, t0 = _cpu(), time.perf_counter()
    for tree in trees:  # one tree at a time, rounds in order, chunks of `batch` new nodes
        for nodes in rounds_of(tree):
            for s in range(0, len(nodes), batch):
                trajs = [tree.trajectory(n) for n in nodes[s:s + batch]]
                scores += [row[-1] for row in prm.score(trajs)]
    cpu, wall = _cpu() - c0, time.perf_counter() - t0
    out = {"cache": cache, "nodes": len(scores), "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
           "ms_per_node_cpu": round(1000 * cpu / max(len(scores), 1), 2)}
    if prm.prefix is not None:
        st = prm.prefix.stats()
        out.update(tokens=st["tokens"], forwarded_tokens=st["forwarded_tokens"],
                   forwarded_share=st["forwarded_share"], memo_hits=st["memo_hits"], steps=st["steps"])
    return out, scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trees", nargs="+", help="results.jsonl / trees/*.jsonl files of saved searches")
    ap.add_argument("--prm", required=True, help="a trained PRM folder")
    ap.add_argument("--trees-limit", "--trees", dest="limit", type=int, default=10,
                    help="how many trees to replay (the largest first)")
    ap.add_argument("--batch", type=int, default=8, help="nodes scored per call (the engine's round)")
    args = ap.parse_args()

    import torch

    from omrl_search.result import read_results

    results = [r for f in args.trees for r in read_results(f)]
    trees = sorted((r.tree for r in results), key=lambda t: -len(t.nodes))[:args.limit]
    print(f"{len(trees)} trees, {sum(len(t.nodes) - 1 for t in trees)} nodes to score; "
          f"torch threads {torch.get_num_threads()}", flush=True)
    sides = {}
    for cache in ("off", "on"):
        sides[cache], scores = run_side(args.prm, trees, cache, args.batch)
        sides[cache]["_scores"] = scores
    diff = max(abs(a - b) for a, b in zip(sides["off"].pop("_scores"), sides["on"].pop("_scores")))
    print("| PRM prefix cache | nodes | CPU s | wall s | CPU ms / node | tokens forwarded / read |")
    print("|---|---|---|---|---|---|")
    for cache, s in sides.items():
        share = f"{s['forwarded_tokens']} / {s['tokens']} ({s['forwarded_share']:.0%})" if cache == "on" else "all"
        print(f"| {cache} | {s['nodes']} | {s['cpu_s']} | {s['wall_s']} | {s['ms_per_node_cpu']} | {share} |")
    speed = sides["off"]["cpu_s"] / max(sides["on"]["cpu_s"], 1e-9)
    print(f"CPU speed-up {speed:.1f}x; largest score difference {diff:.2e}")
    print(json.dumps({"sides": sides, "cpu_speedup": round(speed, 2), "max_abs_diff": diff}))


if __name__ == "__main__":
    main()
