"""The PRM's calibration in a loop round: a reliability table and its expected calibration error.

A PRM guides search by its scores, so besides ranking (step AUC, which ``omrl train prm``
reports) the loop reports whether a score of 0.7 means "about 70% of continuations from here
succeed": the validation steps (the PRM trainer's own validation split of the label rows, each
distinct step once) are binned by predicted score, and each bin's mean prediction is set against
its mean Monte-Carlo value (the soft label). ECE is the step-weighted mean gap. Both are given for
all steps and for the steps before the end (a finished row's last step shows the outcome in its
observation, and what guides a search happens before the end).

The validation rows come from the same trees and demonstrations the PRM trained on (solver
demonstrations are all successes and read unlike the policy's own steps, which flatters a PRM),
so :func:`heldout` also scores the PRM on trees grown on *test-split* tasks (the round's eval),
labelled from their own finished leaves: the figure that says whether it can guide a search.
Its per-step predictions can be written to a file (:func:`write_predictions`), and two PRMs'
files compared on the same steps with a task-resampled interval (:func:`compare_predictions`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from .prm import before_end, step_predictions  # the PRM trainer's own step scoring (evaluate uses it too)

BINS = 10


def reliability(preds: Sequence[float], labels: Sequence[float], bins: int = BINS) -> dict[str, Any]:
    """``{"steps", "ece", "bins": [{"lo", "hi", "steps", "mean_pred", "mean_label"}]}`` over
    ``bins`` equal-width bins of [0, 1] (empty bins left out; a score of 1.0 is in the last)."""
    if len(preds) != len(labels):
        raise ValueError(f"{len(preds)} predictions for {len(labels)} labels")
    groups: dict[int, list[tuple[float, float]]] = {}
    for p, y in zip(preds, labels):
        groups.setdefault(min(int(p * bins), bins - 1), []).append((p, y))
    n = len(preds)
    rows, ece = [], 0.0
    for b in sorted(groups):
        pts = groups[b]
        mp = sum(p for p, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        ece += len(pts) / n * abs(mp - my)
        rows.append({"lo": round(b / bins, 3), "hi": round((b + 1) / bins, 3), "steps": len(pts),
                     "mean_pred": round(mp, 4), "mean_label": round(my, 4)})
    return {"steps": n, "ece": round(ece, 4) if n else None, "bins": rows}


def load_scorer(model_dir: str | Path, dtype: str = "float32") -> Any:
    """The PRM saved in ``model_dir`` (on CPU, in ``dtype``: float32 by default, the figures'
    reference; bfloat16 is faster on a CPU with native bf16), or the reward model an
    ``implicit:...`` spec names (PRIME's implicit PRM, :mod:`reward_models.implicit`)."""
    if str(model_dir).startswith("implicit:"):
        if dtype != "float32":
            raise ValueError(f"dtype {dtype!r} is for a trained PRM folder, not an implicit:... spec")
        from omrl_search.reward import make_reward_model

        return make_reward_model(str(model_dir))
    from reward_models.prm import ProcessRewardModel

    return ProcessRewardModel.from_pretrained(str(model_dir), device="cpu", dtype=dtype)


def calibration(model_dir: str | Path, label_dirs: Sequence[str], val_fraction: float) -> dict[str, Any] | None:
    """Reliability of the PRM in ``model_dir`` on the validation rows of ``label_dirs`` (split as
    the trainer split them); None when there is no validation row."""
    from reward_models.label_files import load_label_dir
    from .prm import split_rows

    rows = [r for d in label_dirs for r in load_label_dir(d)]
    _, val = split_rows(rows, val_fraction)
    if not val:
        return None
    prm = load_scorer(model_dir)
    preds, gold, ends = step_predictions(prm, val)
    ip, iy = before_end(preds, gold, ends)
    return {"all": reliability(preds, gold), "before_end": reliability(ip, iy) if ip else None}


def heldout(model_dir: str | Path, results_files: Sequence[str | Path], labels: str = "mc",
            tasks: int | None = None, predictions: str | Path | None = None,
            dtype: str = "float32") -> dict[str, Any] | None:
    """Step AUC and calibration of the PRM in ``model_dir`` (or of ``implicit:POLICY,...``, the
    implicit PRM of :mod:`reward_models.implicit`) on the search trees of
    ``results_files`` (held-out tasks), labelled by Monte-Carlo values of each tree's own finished
    leaves (no extra rollouts): ``{"results", "all": metrics, "before_end": metrics}``, each
    metrics dict ``step_metrics`` plus ``calibration``; None when no step is labelled.
    ``labels``: an ``omrl label --soft`` kind (``exact``: the env's solver). ``tasks``: only the
    trees of the first N task ids (sorted), for a PRM too slow to score them all. ``predictions``:
    a JSONL file to write each scored step to (``task_id``, ``path``: a digest of its actions,
    ``end``, ``score``, ``label``), so that two PRMs can be compared on the same steps.
    ``dtype``: what the PRM computes in (:func:`load_scorer`)."""
    from omrl_search.result import read_results
    from reward_models.labels import label_results
    from reward_models.metrics import step_metrics

    results = [r for f in results_files for r in read_results(f)]
    if tasks is not None:
        keep = set(sorted({r.task.task_id for r in results})[:tasks])
        results = [r for r in results if r.task.task_id in keep]
    prm = load_scorer(model_dir, dtype)  # first: a PRM that cannot load fails before the labelling
    rows = label_results(results, rollouts=0, soft=labels)
    if not rows:
        return None
    preds, gold, ends = step_predictions(prm, rows)
    if not preds:
        return None
    if predictions is not None:
        write_predictions(predictions, rows, preds, gold, ends)
    out: dict[str, Any] = {"results": len(results),
                           "all": {**step_metrics(preds, gold), "calibration": reliability(preds, gold)}}
    ip, iy = before_end(preds, gold, ends)
    if ip:
        out["before_end"] = {**step_metrics(ip, iy), "calibration": reliability(ip, iy)}
    return out


def write_predictions(path: str | Path, rows: Sequence[dict[str, Any]], preds: Sequence[float],
                      gold: Sequence[float], ends: Sequence[bool]) -> None:
    """One JSON line per distinct step of ``rows`` (in :func:`~train.prm.unique_steps` order, as
    ``step_predictions`` returns them), keyed by task id and a digest of the step's action path;
    written whole to a temporary file first, so a failed run leaves no half-written file."""
    import hashlib
    import json
    import os

    from .prm import unique_steps

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as fh:
        for (row, n, _), p, y, end in zip(unique_steps(rows), preds, gold, ends):
            digest = hashlib.sha1(json.dumps(row["completions"][:n]).encode()).hexdigest()[:16]
            fh.write(json.dumps({"task_id": row["task_id"], "path": digest, "step": n, "end": end,
                                 "score": round(p, 6), "label": y}) + "\n")
    os.replace(tmp, path)


def read_predictions(path: str | Path) -> dict[tuple[str, str], dict[str, Any]]:
    """``(task_id, path) -> line`` of a :func:`write_predictions` file; a malformed line is a
    ``ValueError`` naming the file and line."""
    import json

    out = {}
    with Path(path).open() as fh:
        for i, line in enumerate(fh, 1):
            try:
                d = json.loads(line)
                out[(d["task_id"], d["path"])] = {"end": bool(d["end"]), "score": float(d["score"]),
                                                  "label": float(d["label"])}
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{i}: not a prediction line ({exc})") from None
    return out


def compare_predictions(file_a: str | Path, file_b: str | Path, resamples: int = 2000
                        ) -> dict[str, Any]:
    """Two PRMs' predictions on the same steps (:func:`write_predictions` files): for all steps
    and for those before the end, :func:`~reward_models.metrics.paired_auc` of B against A, tasks
    resampled whole. Only the steps both files scored count; differing labels are an error."""
    from reward_models.metrics import paired_auc

    a, b = read_predictions(file_a), read_predictions(file_b)
    shared = sorted(set(a) & set(b))
    if not shared:
        raise ValueError(f"{file_a} and {file_b} share no step: score the same trees with both PRMs")
    bad = next((k for k in shared if a[k]["label"] != b[k]["label"]), None)
    if bad is not None:
        raise ValueError(f"step {bad} has label {a[bad]['label']} in {file_a} but "
                         f"{b[bad]['label']} in {file_b}: were they scored against the same labels?")
    out: dict[str, Any] = {"a": str(file_a), "b": str(file_b), "only_a": len(a) - len(shared),
                           "only_b": len(b) - len(shared)}
    for part, keys in (("all", shared), ("before_end", [k for k in shared if not a[k]["end"]])):
        if keys:
            out[part] = paired_auc([a[k]["score"] for k in keys], [b[k]["score"] for k in keys],
                                   [a[k]["label"] >= 0.5 for k in keys], [k[0] for k in keys],
                                   resamples=resamples)
    return out
