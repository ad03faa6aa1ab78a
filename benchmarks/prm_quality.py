"""PRM quality end to end on Game24: search trees -> ``omrl label`` -> ``omrl train prm`` -> a PRM,
its step-level AUC on held-out test-split tasks, and PRM-guided beam / MCTS against the same
strategies without a learned value, at equal token budgets.

Workload. Policy: the scripted Game24 oracle that takes a random other valid move with
probability ``p`` (default 0.5), with two changes that keep the comparison honest: every
completion says the same neutral thought (the stock oracle writes the env's explanation of the
expert's move or "Trying another step.", which would hand the PRM its label), and every completion's logprob is
uniform over the valid moves (the stock oracle's logprobs tell the expert move apart, which
would make ``value=logprob`` an oracle). Trees: MCTS (rollout values, so nodes carry Q-values)
and best-of-N on ``--train-tasks`` train-split and ``--test-tasks`` test-split puzzles (Game24's
splits share no puzzle). Labels: Monte-Carlo values with ``--rollouts`` rollouts per step
(tree leaves count; the missing ones are sampled with the same policy). PRM: SmolLM2-135M's
bottom ``--keep-layers`` blocks, the top ``--train-layers`` of them and the head trained
(CPU-sized; the rest frozen), text input (the scripted policy's ids are bytes).

    python benchmarks/prm_quality.py [--train-tasks 120] [--test-tasks 40] [--budget tokens=12000]
                                     [--keep-layers 4] [--train-layers 1] [--max-rows 600]
                                     [--soft mc|q|exact] [--loss pointwise|pairwise] [--balance weight]

``--soft`` picks the training labels (``exact`` is the env's solver: an oracle, so a PRM trained on
it is a ceiling experiment, named so in the output), ``--loss`` / ``--margin`` / ``--balance`` the
PRM loss (docs/reward_models.md). The held-out AUC is given against the MC labels of the test
trees and against their exact labels (``test_auc_exact``).

Prints tables, then as its last line one JSON object with every figure. Writes under --out
(trees, labels, the PRM, metrics).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path


import omrl_search as om  # noqa: E402
from omrl_search.backends.scripted import OraclePolicy  # noqa: E402
from omrl_search.cli import format_table, main as omrl  # noqa: E402
from omrl_search.policy import PolicyError, register_policy  # noqa: E402
from omrl_search.specs import parse_kv  # noqa: E402


class NeutralOracle(OraclePolicy):
    """The Game24 oracle with one neutral thought and uniform logprobs (see the docstring)."""

    def choose(self, env, rng, meta):
        text, _ = super().choose(env, rng, meta)
        return text, 1.0 / max(len(env.valid_actions() or []), 1)

    @staticmethod
    def completion(thought: str, action: str) -> str:
        return f"Think: I combine two of the numbers.\nAct: {action}"


@register_policy("neutral_oracle")
def _neutral(arg: str) -> NeutralOracle:
    opts = parse_kv(arg, "policy")
    if set(opts) - {"p"}:
        raise PolicyError("neutral_oracle takes only p")
    pol = NeutralOracle(float(opts.get("p", 0.5)))
    pol.name = f"neutral_oracle:p={pol.p}"
    return pol


def run(cmd: list[str]) -> None:
    print("$ omrl " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    code = omrl(cmd)
    if code:
        raise SystemExit(f"omrl {cmd[0]} failed with status {code}")
    print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-tasks", type=int, default=120)
    ap.add_argument("--test-tasks", type=int, default=40)
    ap.add_argument("--p", type=float, default=0.5, help="oracle error rate")
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--base", default="smollm2")
    ap.add_argument("--keep-layers", type=int, default=4)
    ap.add_argument("--train-layers", type=int, default=1)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--max-rows", type=int, default=600, help="training rows (a seeded sample)")
    ap.add_argument("--budget", default="tokens=12000", help="per-task budget of the searches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--soft", choices=("mc", "q", "exact"), default="mc",
                    help="training labels (exact: an oracle, a ceiling experiment)")
    ap.add_argument("--loss", choices=("pointwise", "pairwise"), default="pointwise")
    ap.add_argument("--margin", type=float, default=0.3, help="pairwise: least label gap")
    ap.add_argument("--balance", choices=("none", "weight"), default="none")
    ap.add_argument("--out", default="runs/prm_quality")
    ap.add_argument("--reuse", action="store_true", help="reuse trees, labels and PRM found in --out")
    args = ap.parse_args()
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policy = f"neutral_oracle:p={args.p}"
    figures: dict = {"workload": {k: v for k, v in vars(args).items()},
                     "machine": {"cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                                 "platform": platform.platform(), "cuda": torch.cuda.is_available()}}
    t_all = time.perf_counter()

    # 1. search trees on train and test tasks
    trees = out / "trees"
    if not (args.reuse and (trees / "results.jsonl").is_file()):
        tasks = (om.load_tasks("game24", "train", args.train_tasks)
                 + om.load_tasks("game24", "test", args.test_tasks))
        t0 = time.perf_counter()
        results = []
        for strat in ("mcts:simulations=12,k=3,value=rollout", "best_of_n:n=4"):
            results += om.search_many(tasks, strategy=strat, policy=policy, seed=args.seed)
        trees.mkdir(parents=True, exist_ok=True)
        om.write_results(trees / "results.jsonl", results)
        figures["trees"] = {"searches": len(results), "nodes": sum(len(r.tree) for r in results),
                            "seconds": round(time.perf_counter() - t0, 1)}

    # 2. labels
    labels = out / "labels"
    if not (args.reuse and (labels / "train.parquet").is_file()):
        run(["label", str(trees), "--out", str(labels), "--policy", policy, "--soft", args.soft,
             "--rollouts", str(args.rollouts), "--seed", str(args.seed), "--no-progress"])
    figures["labels"] = json.loads((labels / "meta.json").read_text())["splits"]
    figures["training_labels"] = args.soft + (" (oracle: a ceiling experiment)" if args.soft == "exact" else "")
    exact = out / "labels_exact"  # the yardstick: the env's solver on the same trees
    if not (args.reuse and (exact / "test.parquet").is_file()):
        run(["label", str(trees), "--out", str(exact), "--soft", "exact", "--no-progress"])

    # 3. train the PRM (train split only; validation = 10% of train tasks)
    prm_dir = out / "prm"
    t0 = time.perf_counter()
    if not (args.reuse and (prm_dir / "omrl-train.json").is_file()):
        run(["train", "prm", "--data", str(labels), "--base", args.base, "--out", str(prm_dir),
             "--keep-layers", str(args.keep_layers), "--train-layers", str(args.train_layers),
             "--epochs", str(args.epochs), "--lr", str(args.lr), "--batch-size", str(args.batch_size),
             "--max-rows", str(args.max_rows), "--seed", str(args.seed), "--loss", args.loss,
             "--margin", str(args.margin), "--balance", args.balance, "--no-progress"])
    marker = json.loads((prm_dir / "omrl-train.json").read_text())
    figures["train"] = {"seconds": round(time.perf_counter() - t0, 1), "steps": marker["step"],
                        "rows": marker.get("train_rows"), "validation": marker.get("validation")}

    # 4. step-level AUC on the held-out test split
    from reward_models.label_files import load_label_dir
    from reward_models.prm import ProcessRewardModel
    from train.prm import evaluate

    prm = ProcessRewardModel.from_pretrained(str(prm_dir), batch_size=16)
    test_rows = load_label_dir(labels, ["test"])
    t0 = time.perf_counter()
    figures["test_auc"] = evaluate(prm, test_rows)
    figures["test_auc"]["seconds"] = round(time.perf_counter() - t0, 1)
    print("\ntest split, distinct steps:", json.dumps(figures["test_auc"]), flush=True)
    figures["test_auc_exact"] = evaluate(prm, load_label_dir(exact, ["test"]))
    print("test split against exact labels:", json.dumps(figures["test_auc_exact"]), flush=True)

    # 5. guided search on the test tasks at equal token budgets
    tasks = om.load_tasks("game24", "test", args.test_tasks)
    # best-of-N runs unbudgeted: vote and PRM choice see the same samples (equal tokens by
    # construction); under a token budget the search stops before the PRM is asked.
    # select_by=verifier (the env's success check picks: flagged verifier_in_loop) is the ceiling
    # of any choice among those four samples. The `rules:outcome=1` rows score only what the
    # final observation says (1 for a solved terminal step, else 0): the part of the PRM's gain
    # that reading the env's verdict alone would give.
    outcome = "rules:outcome=1"
    runs = [("react", None, args.budget), ("best_of_n:n=4", None, None),
            ("best_of_n:n=4,select_by=verifier", None, None),
            ("best_of_n:n=4,select_by=rm", outcome, None), ("best_of_n:n=4,select_by=rm", prm, None),
            ("beam:width=3,k=3,value=logprob", None, args.budget),
            ("beam:width=3,k=3,value=rm", outcome, args.budget),
            ("beam:width=3,k=3,value=rm", prm, args.budget),
            ("mcts:simulations=64,k=3,value=logprob", None, args.budget),
            ("mcts:simulations=64,k=3,value=rollout", None, args.budget),
            ("mcts:simulations=64,k=3,value=rm", outcome, args.budget),
            ("mcts:simulations=64,k=3,value=rm", prm, args.budget)]
    summary = {}
    for strat, rm, budget in runs:
        t0 = time.perf_counter()
        res = om.search_many(tasks, strategy=strat, policy=policy, reward_model=rm,
                             budget=budget, seed=args.seed)
        name = strat + ("" if rm is None else " +outcome rule" if rm == outcome else " +PRM")
        summary[name] = om.summarize(res, time.perf_counter() - t0)
        print(f"  {name}: success {summary[name]['success_rate']:.3f} "
              f"({summary[name]['seconds']:.0f} s)", flush=True)
    figures["search"] = summary
    figures["seconds"] = round(time.perf_counter() - t_all, 1)

    print("\n" + format_table(summary))
    print(f"\nPRM step-level AUC on {figures['test_auc'].get('steps')} distinct test-split steps: "
          f"{figures['test_auc'].get('auc')} (before the final step: "
          f"{figures['test_auc'].get('auc_before_end')}); validation AUC "
          f"{(figures['train']['validation'] or {}).get('auc')}")
    print(json.dumps(figures, default=str))


if __name__ == "__main__":
    main()
