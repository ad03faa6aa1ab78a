"""train a process reward model on step labels from search trees (BCE on soft labels)

``omrl train prm --data DIR --base MODEL --out DIR`` reads the label files that ``omrl label``
wrote (:mod:`reward_models.label_files`), builds a :class:`~reward_models.prm.ProcessRewardModel`
on ``MODEL`` (an HF folder or ``smollm2``; ``keep_layers`` cuts the backbone to its bottom
blocks, ``train_layers`` trains only the top blocks and the head — full fine-tuning of even a 135M
backbone is slow on a CPU) and minimises binary cross-entropy between the head's logit at each
step and the step's soft label (a float in [0, 1], never rounded). ``objective: outcome`` trains
an ORM instead: the last step of each row only.

Losses by name (``--loss``, :data:`train.losses.PRM_LOSSES`): ``pointwise`` (the BCE above;
``balance: weight`` multiplies the positive term by negatives/positives of the training steps,
for sets with 2-3% positive steps — weighting, not sampling, because rows are whole paths whose
steps share prefixes: resampling rows cannot balance steps, and duplicating rare positive paths
repeats their negative steps too) and ``pairwise`` (rStar-Math's process preference model: a
Bradley-Terry loss between *sibling* steps — distinct next steps after the same prefix — whose
soft labels (Q values from ``omrl label --soft q``, or any other kind) differ by at least
``margin``; the step's logit is read where the pointwise loss reads it).

Data: rows of split ``train`` train; a ``validation`` split is the validation set when the folder
has one, otherwise ``val_fraction`` of the train *tasks* (by a stable hash of the task id, so
no task is in both). Rows of other splits (``test``) are never read here: they are held out for
:func:`evaluate` (``benchmarks/prm_quality.py``).

The loop is :class:`train.runtime.Runner` (device, bf16 autocast, checkpoints, exact resume,
progress bar, ``metrics.jsonl``). Every ``eval_every`` steps and at the end, step-level AUC,
accuracy and BCE on the validation set are printed and logged (``val_*`` in ``metrics.jsonl``;
the final figures also in ``omrl-train.json``). The output folder loads with ``prm:OUT``.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Literal, Sequence

from pydantic import Field

from .runtime import ListSource, Runner, TrainConfig, TrainError


class PRMConfig(TrainConfig):
    lr: float = Field(5e-5, gt=0)
    batch_size: int = Field(8, ge=1)
    max_length: int = Field(1024, ge=8)
    objective: Literal["process", "outcome"] = "process"
    read: Literal["observation", "step"] = "observation"
    input: Literal["auto", "segments", "text", "observations"] = "auto"
    aggregation: Literal["min", "last", "prod", "mean"] = "last"
    keep_layers: int | None = Field(None, ge=1)  # cut the backbone to its bottom N blocks
    train_layers: int | None = Field(None, ge=0)  # train only the top N blocks (+ head); None: all
    val_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    eval_every: int = Field(0, ge=0)  # optimizer steps between validations (0: only at the end)
    threshold: float = Field(0.5, gt=0.0, le=1.0)  # positive step: soft label >= threshold
    max_rows: int | None = Field(None, ge=1)  # train on a seeded random sample of this many rows
    loss: Literal["pointwise", "pairwise"] = "pointwise"  # train.losses.PRM_LOSSES
    margin: float = Field(0.3, gt=0.0, le=1.0)  # pairwise: least label gap between siblings
    balance: Literal["none", "weight"] = "none"  # pointwise: weight positives by neg/pos


# --- the loss -------------------------------------------------------------------------------------
def prm_bce_loss(logits: Any, targets: Any, mask: Any, pos_weight: float = 1.0) -> Any:
    """Mean binary cross-entropy with logits over the masked steps; soft targets in [0, 1]
    (:func:`train.losses.prm_pointwise`)."""
    from .losses import prm_pointwise

    return prm_pointwise(logits, targets, mask, pos_weight=pos_weight)


def make_loss_fn(threshold: float = 0.5, loss: str = "pointwise", pos_weight: float = 1.0):
    """The runner's loss function for the PRM loss named ``loss``: pointwise batches hold rows
    (``targets``), pairwise batches ``2P`` sequences, the ``P`` chosen ones first, each scored
    at its last step."""
    from .losses import PRM_LOSSES

    fn = PRM_LOSSES[loss]

    def loss_fn(model: Any, batch: dict[str, Any]) -> tuple[Any, dict[str, float]]:
        logits = model(batch["input_ids"], batch["attention_mask"], batch["positions"])
        mask = batch["step_mask"]
        tokens = float(batch["attention_mask"].sum())
        if getattr(fn, "pairs", False):
            last = logits.gather(1, (mask.sum(1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
            P = last.shape[0] // 2
            out = fn(last[:P], last[P:])
            return out, {"tokens": tokens, "accuracy": float((last[:P] > last[P:]).float().mean())}
        out = fn(logits, batch["targets"], mask, pos_weight=pos_weight)
        hit = ((logits.detach() >= 0) == (batch["targets"] >= threshold)) & mask
        return out, {"tokens": tokens, "accuracy": float(hit.sum() / mask.sum().clamp(min=1))}

    return loss_fn


def positive_weight(examples: Sequence[tuple]) -> float:
    """Negatives / positives over the soft targets of ``(ids, positions, targets)`` examples
    (1.0 when either class is missing): the ``balance: weight`` factor."""
    pos = sum(y for *_, ys in examples for y in ys)
    neg = sum(1.0 - y for *_, ys in examples for y in ys)
    return neg / pos if pos > 0 and neg > 0 else 1.0


def sibling_pairs(rows: Sequence[dict[str, Any]], margin: float) -> list[tuple[tuple, tuple]]:
    """``((row, steps), (row, steps))`` pairs of sibling steps (distinct next steps after the
    same prefix of the same task, each counted once), the one with the higher soft label first,
    whose soft labels differ by at least ``margin``. Siblings of a finished row's last step are
    paired too: its outcome is part of what it is judged by, as at any other step."""
    groups: dict[tuple, list[tuple[dict[str, Any], int, float]]] = {}
    for row, n, _ in unique_steps(rows):
        parent = (row["task_id"], tuple(row["completions"][:n - 1]))
        groups.setdefault(parent, []).append((row, n, float(row["soft_labels"][n - 1])))
    out = []
    for kids in groups.values():
        for a in range(len(kids)):
            for b in range(a + 1, len(kids)):
                (ra, na, ya), (rb, nb, yb) = kids[a], kids[b]
                if abs(ya - yb) >= margin - 1e-12:
                    out.append(((ra, na), (rb, nb)) if ya > yb else ((rb, nb), (ra, na)))
    return out


def build_pair_examples(prm: Any, rows: Sequence[dict[str, Any]], margin: float) -> list[tuple]:
    """``(ids, positions, ids, positions)`` per sibling pair (:func:`sibling_pairs`): each side
    the row cut after its step, encoded with the reward model's own encoder."""
    from reward_models.inputs import episode_from_row, truncate

    encoded: dict[tuple[int, int], tuple] = {}

    def enc(row: dict[str, Any], n: int) -> tuple:
        key = (id(row), n)
        if key not in encoded:
            encoded[key] = prm.encoder.encode(truncate(episode_from_row(row), n))
        return encoded[key]

    return [(*enc(*w), *enc(*lo)) for w, lo in sibling_pairs(rows, margin)]


def make_pair_collate(prm: Any):
    def collate(examples: list[tuple]) -> dict[str, Any]:
        seqs = [(e[0], e[1]) for e in examples] + [(e[2], e[3]) for e in examples]
        return prm.collate(seqs, device="cpu")

    return collate


# --- data -------------------------------------------------------------------------------------------
def split_rows(rows: list[dict[str, Any]], val_fraction: float) -> tuple[list[dict], list[dict]]:
    """(train, validation) rows: the ``validation`` split if present, else a task-level hash
    split of the ``train`` rows."""
    from omrl_search.env import stable_hash

    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "validation"]
    if val or not val_fraction:
        return train, val
    cut = int(val_fraction * 10_000)
    is_val = {t: int(stable_hash(("prm-val", t)), 16) % 10_000 < cut for t in {r["task_id"] for r in train}}
    return [r for r in train if not is_val[r["task_id"]]], [r for r in train if is_val[r["task_id"]]]


def build_examples(prm: Any, rows: Sequence[dict[str, Any]], objective: str = "process") -> list[tuple]:
    """``(ids, positions, targets)`` per row, with the reward model's own encoder."""
    from reward_models.inputs import episode_from_row

    out = []
    for row in rows:
        ids, pos = prm.encoder.encode(episode_from_row(row))
        targets = [float(y) for y in row["soft_labels"]]
        if objective == "outcome":
            pos, targets = pos[-1:], targets[-1:]
        out.append((ids, pos, targets))
    return out


def make_collate(prm: Any):
    def collate(examples: list[tuple]) -> dict[str, Any]:
        import torch

        batch = prm.collate([(ids, pos) for ids, pos, _ in examples], device="cpu")
        S = batch["positions"].shape[1]
        targets = torch.zeros((len(examples), S), dtype=torch.float32)
        for b, (_, _, ys) in enumerate(examples):
            targets[b, :len(ys)] = torch.tensor(ys, dtype=torch.float32)
        batch["targets"] = targets
        return batch  # the runner moves it to its device

    return collate


# --- evaluation -----------------------------------------------------------------------------------
def unique_steps(rows: Sequence[dict[str, Any]]) -> list[tuple[dict[str, Any], int, bool]]:
    """Each distinct step once, as ``(row, step count, is_outcome)``: rows share prefixes, and a
    step shared by many rows must not count many times. ``is_outcome`` marks a terminal row's
    last step (its observation shows the outcome)."""
    seen: set = set()
    out = []
    for row in rows:
        for i in range(len(row["completions"])):
            key = (row["task_id"], tuple(row["completions"][:i + 1]))
            if key in seen:
                continue
            seen.add(key)
            last = i == len(row["completions"]) - 1
            out.append((row, i + 1, bool(last and row.get("terminal"))))
    return out


def step_predictions(prm: Any, rows: Sequence[dict[str, Any]]) -> tuple[list[float], list[float], list[bool]]:
    """The score of ``prm``, the soft label and "is a finished row's last step" of every distinct
    step of ``rows`` (:func:`unique_steps`). An ORM scores each step's own prefix; a PRM is
    causal, so one pass over a row gives the scores of all its steps."""
    from reward_models.inputs import episode_from_row, truncate

    steps = unique_steps(rows)
    if getattr(prm, "kind", None) == "orm":
        preds = [float(s[-1]) for s in prm.score_episodes(
            [truncate(episode_from_row(r), n) for r, n, _ in steps])]
    else:
        rows_once = list({id(r): r for r, _, _ in steps}.values())
        score_of = {id(r): s for r, s in zip(rows_once, prm.score_episodes(
            [episode_from_row(r) for r in rows_once]))}
        preds = [float(score_of[id(r)][n - 1]) for r, n, _ in steps]
    gold = [float(r["soft_labels"][n - 1]) for r, n, _ in steps]
    return preds, gold, [end for _, _, end in steps]


def evaluate(prm: Any, rows: Sequence[dict[str, Any]], threshold: float = 0.5) -> dict[str, Any]:
    """Step-level AUC / accuracy / BCE of ``prm`` on distinct steps of ``rows`` (all steps, and
    ``*_before_end``: without the final steps of finished rows, whose observation shows the
    outcome)."""
    from reward_models.metrics import step_metrics

    preds, gold, ends = step_predictions(prm, rows)
    if not preds:
        return {}
    out = step_metrics(preds, gold, threshold)
    ip, iy = before_end(preds, gold, ends)
    if ip:
        out.update({f"{k}_before_end": v for k, v in step_metrics(ip, iy, threshold).items()})
    return out


def before_end(preds: Sequence[float], gold: Sequence[float], ends: Sequence[bool]
               ) -> tuple[list[float], list[float]]:
    """The predictions and labels of the steps that are not a finished row's last step (whose
    observation shows the outcome): what guides a search happens before the end."""
    kept = [(p, y) for p, y, end in zip(preds, gold, ends) if not end]
    return [p for p, _ in kept], [y for _, y in kept]


# --- the job ------------------------------------------------------------------------------------------
def build(cfg: PRMConfig, rows: list[dict[str, Any]]) -> tuple[Runner, Any, list[dict], list[dict]]:
    """The runner, the reward model, and the train / validation rows."""
    from reward_models.prm import ProcessRewardModel

    if cfg.loss == "pairwise" and cfg.objective == "outcome":
        raise TrainError("loss pairwise compares sibling steps: it trains a PRM (objective process)")
    train_rows, val_rows = split_rows(rows, cfg.val_fraction)
    if not train_rows:
        raise TrainError("no rows of split 'train' in the label data")
    if cfg.max_rows is not None and len(train_rows) > cfg.max_rows:
        import random

        train_rows = random.Random(cfg.seed).sample(train_rows, cfg.max_rows)
    cls = ProcessRewardModel
    if cfg.objective == "outcome":
        from reward_models.orm import OutcomeRewardModel as cls  # type: ignore[no-redef]
    try:
        prm = cls.from_base(
            cfg.model, read=cfg.read, input=cfg.input, aggregation=cfg.aggregation,
            keep_layers=cfg.keep_layers, device="cpu", dtype="float32", seed=cfg.seed,
            max_length=cfg.max_length, batch_size=cfg.batch_size)
    except ValueError as exc:
        raise TrainError(str(exc)) from None
    trainable = prm.model.freeze(cfg.train_layers)
    pos_weight = 1.0
    if cfg.loss == "pairwise":
        examples = build_pair_examples(prm, train_rows, cfg.margin)
        collate, what = make_pair_collate(prm), f"sibling pairs (label gap >= {cfg.margin})"
    else:
        examples = build_examples(prm, train_rows, cfg.objective)
        collate, what = make_collate(prm), "training rows"
        if cfg.balance == "weight":
            pos_weight = positive_weight(examples)
    if len(examples) < cfg.batch_size:
        raise TrainError(f"{len(examples)} {what} cannot fill a batch of {cfg.batch_size}")
    source = ListSource(examples, cfg.batch_size, seed=cfg.seed)

    def on_step(runner: Runner, metrics: dict[str, float]) -> None:
        if cfg.eval_every and runner.step % cfg.eval_every == 0 and runner.step < runner.max_steps:
            _validate(runner, prm, val_rows, cfg)

    runner = Runner(cfg, prm.model, make_loss_fn(cfg.threshold, cfg.loss, pos_weight), source, collate,
                    save_fn=lambda model, folder: prm.write_files(folder),
                    load_fn=lambda model, folder: prm.load_weights(folder),
                    on_step=on_step, kind="prm")
    runner.trainable_parameters = trainable  # type: ignore[attr-defined]
    runner.examples = len(examples)  # type: ignore[attr-defined]
    return runner, prm, train_rows, val_rows


def _validate(runner: Runner, prm: Any, val_rows: list[dict], cfg: PRMConfig) -> dict[str, Any]:
    if not val_rows:
        return {}
    prm.clear_cache()  # scores memoised by an earlier validation are the old weights' scores
    with runner.autocast():
        m = evaluate(prm, val_rows, cfg.threshold)
    runner.model.train()
    line = {"step": runner.step, **{f"val_{k}": v for k, v in m.items()}}
    if runner.logging:  # during training: the runner's log
        runner.log(line)
    elif runner.rank == 0:  # after it: append to the same file
        with open(runner.out / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")
    if runner.rank == 0:
        print(f"step {runner.step}: val auc {m.get('auc')} acc {m.get('accuracy')} "
              f"bce {m.get('bce')} ({m.get('steps')} steps)", file=sys.stderr, flush=True)
    return m


def train(cfg: PRMConfig) -> dict[str, Any]:
    """Train and write ``cfg.out``; returns the final training and validation metrics."""
    from reward_models.label_files import LabelFileError, label_files, load_label_dir

    try:
        files = [str(f) for d in cfg.data for f in label_files(d)]
        rows = [r for d in cfg.data for r in load_label_dir(d)]
    except LabelFileError as exc:
        raise TrainError(str(exc)) from None
    cfg = cfg.model_copy(update={"data": files})
    runner, prm, train_rows, val_rows = build(cfg, rows)
    print(f"prm ({cfg.loss}): {runner.examples} examples from {len(train_rows)} train rows ({sum(len(r['completions']) for r in train_rows)} steps), "
          f"{len(val_rows)} validation rows, {runner.trainable_parameters:,} trainable parameters, "
          f"{runner.max_steps} steps on {runner.device}", file=sys.stderr, flush=True)
    oracle = oracle_labels(cfg.data)
    if oracle:
        print(f"prm: trained on exact (oracle) labels: a ceiling experiment ({oracle})",
              file=sys.stderr, flush=True)
    last = runner.train()
    val = _validate(runner, prm, val_rows, cfg)
    runner.write_marker(validation=val, train_rows=len(train_rows), val_rows=len(val_rows),
                        reward_model=prm.config(), oracle_labels=oracle or None)
    return {"train": last, "validation": val}


def oracle_labels(files: Sequence[str]) -> str:
    """The ``oracle`` note of the label folders' ``meta.json`` (``omrl label --soft exact``
    writes it) of any of ``files``, or "" when none was labelled by an oracle."""
    from pathlib import Path

    for f in files:
        meta = Path(f).parent / "meta.json"
        try:
            note = json.loads(meta.read_text()).get("oracle") if meta.is_file() else None
        except (OSError, ValueError):
            note = None
        if note:
            return str(meta)
    return ""


# --- the command ------------------------------------------------------------------------------------
def configure(p: argparse.ArgumentParser) -> None:
    from reward_models.inputs import INPUTS, READS

    p.add_argument("--data", required=True, action="extend", nargs="+",
                   help="label folder(s) written by omrl label, or label files")
    p.add_argument("--base", required=True, help="backbone: an HF folder or smollm2")
    p.add_argument("--out", required=True, help="output folder (loads with prm:OUT)")
    p.add_argument("--config", help="YAML file of PRMConfig settings")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any PRMConfig setting, e.g. --set keep_layers=8 --set train_layers=2")
    for flag, kw in (("--epochs", {"type": float}), ("--lr", {"type": float}),
                     ("--batch-size", {"type": int}), ("--max-steps", {"type": int}),
                     ("--keep-layers", {"type": int}), ("--train-layers", {"type": int}),
                     ("--max-rows", {"type": int}),
                     ("--val-fraction", {"type": float}), ("--eval-every", {"type": int}),
                     ("--save-every", {"type": int}), ("--seed", {"type": int}),
                     ("--objective", {"choices": ["process", "outcome"]}),
                     ("--loss", {"choices": ["pointwise", "pairwise"]}),
                     ("--margin", {"type": float}), ("--balance", {"choices": ["none", "weight"]}),
                     ("--read", {"choices": list(READS)}), ("--input", {"choices": list(INPUTS)}),
                     ("--device", {}), ("--dtype", {"choices": ["auto", "float32", "bfloat16"]})):
        p.add_argument(flag, default=None, **kw)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument("--no-progress", action="store_true")


def config_from_args(args: argparse.Namespace) -> PRMConfig:
    """YAML < ``--set`` items < the explicit flags."""
    cfg = PRMConfig.from_sources(args.config, list(args.set))
    flags: dict[str, Any] = {"model": args.base, "out": args.out, "data": list(args.data)}
    for key in ("epochs", "lr", "batch_size", "max_steps", "keep_layers", "train_layers", "max_rows",
                "val_fraction", "eval_every", "save_every", "seed", "objective", "read", "input",
                "device", "dtype", "loss", "margin", "balance"):
        if getattr(args, key, None) is not None:
            flags[key] = getattr(args, key)
    if args.resume:
        flags["resume"] = True
    if args.no_progress:
        flags["progress"] = False
    return PRMConfig.from_sources(None, {**cfg.model_dump(), **flags})


def run(args: argparse.Namespace) -> int:
    try:
        result = train(config_from_args(args))
    except TrainError as exc:
        print(f"omrl train: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": args.out, **result}, default=str))
    return 0
