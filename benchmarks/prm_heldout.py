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

    python benchmarks/prm_heldout.py --prm runs/loop-countdown/round_3/prm/model \
        runs/bench-loop-countdown/*/results.jsonl
    python benchmarks/prm_heldout.py --labels exact --prm runs/loop-game24/round_3/prm/model \
        runs/bench-loop-game24/*/results.jsonl

Prints the figures, then as its last line one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.jsonl files of searches on held-out tasks")
    ap.add_argument("--prm", required=True, help="a trained PRM folder")
    ap.add_argument("--labels", choices=("mc", "q", "exact"), default="mc",
                    help="what a step is scored against (default mc: the tree's own leaves; exact: "
                         "the env's solver, Game24/Countdown)")
    args = ap.parse_args()

    from train.loop_prm import heldout

    try:
        out = heldout(args.prm, args.results, labels=args.labels)
    except ValueError as exc:  # e.g. an env without exact values: one line, exit 2
        print(f"prm_heldout: error: {exc}", file=sys.stderr)
        sys.exit(2)
    if out is None:
        sys.exit("prm_heldout: no labelled step in the results given")
    out["labels"] = args.labels
    for part in ("all", "before_end"):
        if part in out:
            m = out[part]
            print(f"{args.labels:5} {part:10} steps {m['calibration']['steps']:>5}  AUC {m.get('auc')}  "
                  f"ECE {m['calibration']['ece']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
