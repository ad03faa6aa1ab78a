"""A trained PRM's step AUC and calibration on held-out search trees (tasks it was never trained on).

The loop reports its PRM on a validation slice of the label rows it trained from; those rows
include the solver's demonstrations, which any scorer tells apart from the policy's own steps, so
that figure flatters the PRM. This script asks the question a search needs answered instead: on
trees grown on *test-split* tasks (e.g. an ``omrl bench --save-trees`` run), does the PRM's score
of a step predict whether play from it succeeds? Labels are Monte-Carlo values from each tree's
own finished leaves (``omrl label`` without extra rollouts); steps are counted once; "before the
end" leaves out a finished row's last step, whose observation shows the outcome.

``--labels exact`` scores against exact labels instead (Game24, Countdown: the env's solver says
whether the state after each step can still be solved; a finished step is its success): the
ground truth, free of the noise of Monte-Carlo values from a few leaves, so it tells whether a
weak figure is the PRM's or the labels'. ``--labels q``: MCTS Q-values with proven wins/losses.

``--prm implicit:POLICY[,ref=REF][,beta=B]`` scores the implicit PRM of a policy trained on
outcomes (beta times the summed log-ratio against its reference, squashed) the same way.

``--tasks N`` scores the trees of the first N task ids only (a 30-block PRM takes over an hour on
all of 200 tasks' trees on 2 cores); ``--predictions FILE`` writes each scored step, and
``--compare A B`` sets two such files side by side: each PRM's AUC on the steps both scored and
the difference with a 95% bootstrap interval and p-value, whole tasks resampled (steps of one
task share prefixes and an outcome, so they are not independent draws).

``--dtype bfloat16`` scores in bf16 rather than float32: faster on a CPU with native bf16 (AMX /
AVX512-BF16; 1.8x CPU time for the 8-block text PRM on 2 cores), each score a little off float32's
and the AUC within a few thousandths (docs/reward_models.md).

``--mc-vs-exact`` (no PRM) scores the Monte-Carlo labels themselves against the exact ones on the
same steps: how much of a PRM's shortfall the MC labels alone would explain.

    python benchmarks/prm_heldout.py --prm runs/loop-countdown/round_3/prm/model \
        runs/bench-loop-countdown/*/results.jsonl
    python benchmarks/prm_heldout.py --labels exact --prm runs/loop-game24/round_3/prm/model \
        runs/bench-loop-game24/*/results.jsonl
    python benchmarks/prm_heldout.py --labels exact --tasks 60 --prm prm_a --predictions a.jsonl TREES
    python benchmarks/prm_heldout.py --compare a.jsonl b.jsonl

Prints the figures, then as its last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path



def mc_vs_exact(results_files):
    """``{"results", "all", "before_end"}``: each distinct step's MC value (the tree's own
    finished leaves) as the prediction, its exact label as the truth; steps without an MC value
    are left out. None when no step has one."""
    from omrl_search.result import read_results
    from reward_models.labels import label_results
    from reward_models.metrics import step_metrics
    from train.loop_prm import reliability
    from train.prm import unique_steps

    results = [r for f in results_files for r in read_results(f)]
    exact = {}
    for row in label_results(results, soft="exact"):  # checks the envs first
        for i, y in enumerate(row["soft_labels"]):
            exact[(row["task_id"], tuple(row["completions"][:i + 1]))] = y
    parts: dict = {"all": ([], []), "before_end": ([], [])}
    for row, n, end in unique_steps(label_results(results, rollouts=0)):
        pair = (row["soft_labels"][n - 1], exact[(row["task_id"], tuple(row["completions"][:n]))])
        for part in ("all",) if end else ("all", "before_end"):
            parts[part][0].append(pair[0])
            parts[part][1].append(pair[1])
    if not parts["all"][0]:
        return None
    return {"results": len(results), **{k: {**step_metrics(p, y), "calibration": reliability(p, y)}
                                       for k, (p, y) in parts.items() if p}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="*", help="results.jsonl files of searches on held-out tasks")
    ap.add_argument("--prm", help="a trained PRM folder, or implicit:POLICY[,ref=REF][,beta=B] "
                                  "(the implicit PRM; not with --mc-vs-exact)")
    ap.add_argument("--mc-vs-exact", action="store_true",
                    help="no PRM: the trees' own MC labels scored against exact labels")
    ap.add_argument("--labels", choices=("mc", "q", "exact"), default="mc",
                    help="what a step is scored against (default mc: the tree's own leaves; exact: "
                         "the env's solver, Game24/Countdown)")
    ap.add_argument("--tasks", type=int, metavar="N",
                    help="score the trees of the first N task ids (sorted) only")
    ap.add_argument("--predictions", metavar="FILE", help="write each scored step (JSONL) to FILE")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="what the PRM computes in (default float32; bfloat16 is faster on a CPU "
                         "with native bf16, its AUC within a few thousandths of float32's)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"),
                    help="no scoring: two --predictions files, B's AUC against A's on shared steps")
    args = ap.parse_args()

    from train.loop_prm import compare_predictions, heldout

    if args.compare:
        if args.results or args.prm or args.mc_vs_exact:
            ap.error("--compare takes two predictions files and nothing else")
        try:
            out = compare_predictions(*args.compare)
        except (OSError, ValueError) as exc:
            print(f"prm_heldout: error: {exc}", file=sys.stderr)
            sys.exit(2)
        for part in ("all", "before_end"):
            if part in out:
                m = out[part]
                print(f"{part:10} steps {m['steps']:>5} tasks {m['tasks']:>4}  AUC A {m['auc_a']}  "
                      f"B {m['auc_b']}  B-A {m['diff']:+.4f} [{m['ci_low']}, {m['ci_high']}] "
                      f"p={m['p_value']:.2g}")
        print(json.dumps(out))
        return
    if not args.results:
        ap.error("give the results.jsonl files of held-out searches")
    if args.tasks is not None and args.tasks < 1:
        ap.error("--tasks takes a positive number")
    if args.mc_vs_exact == bool(args.prm):
        ap.error("give --prm FOLDER or --mc-vs-exact (one of them)")
    if args.mc_vs_exact and (args.tasks or args.predictions or args.dtype != "float32"):
        ap.error("--tasks, --predictions and --dtype go with --prm")
    missing = [f for f in args.results if not Path(f).is_file()]
    if missing:  # e.g. an unexpanded glob: one line, exit 2
        ap.error(f"no such results file: {missing[0]}")
    try:
        out = (mc_vs_exact(args.results) if args.mc_vs_exact
               else heldout(args.prm, args.results, labels=args.labels, tasks=args.tasks,
                            predictions=args.predictions, dtype=args.dtype))
    except ValueError as exc:  # e.g. an env without exact values: one line, exit 2
        print(f"prm_heldout: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if out is None:
        sys.exit("prm_heldout: no labelled step in the results given")
    out["labels"] = "mc-vs-exact" if args.mc_vs_exact else args.labels
    if args.prm:
        out["dtype"] = args.dtype
    for part in ("all", "before_end"):
        if part in out:
            m = out[part]
            print(f"{out['labels']:11} {part:10} steps {m['calibration']['steps']:>5}  AUC {m.get('auc')}  "
                  f"ECE {m['calibration']['ece']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
