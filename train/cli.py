"""Train a policy (sft, dpo, grpo, ppo) or a process reward model (prm) on exported data.

``omrl train KIND [--config FILE.yaml] [--model M] [--data F.parquet ...] [--out DIR]
[--set key=value ...] [--resume]``: settings come from the trainer's defaults, then the YAML
file, then the flags, then ``--set`` (dotted keys: ``--set lora.r=16``). A bad setting or data
row prints one line (``file:row: reason`` for data) and exits with status 2, writing nothing.
``prm`` is :mod:`train.prm` (its own flags).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from omrl_search.policy import PolicyError

from . import prm
from .config import TrainError, override_items

#: the policy trainers' help lines; :data:`train.trainers.TRAINERS` has the trainers themselves
#: (imported only when one runs: they import torch)
HELP = {"sft": "supervised fine-tuning on SFT rows (masked NLL, optional packing)",
        "dpo": "DPO / IPO / hinge on sibling pairs",
        "grpo": "GRPO on exported groups, or online / iterative with the search engine",
        "ppo": "PPO with a value head and GAE over the policy's own tokens"}

#: trainer -> the exported rows it trains on (:data:`train.data.COLUMNS`)
DATA_OF = {"sft": "sft", "dpo": "dpo", "grpo": "grpo", "ppo": "grpo"}
#: flag -> config key
FLAGS = {"model": "model", "data": "data", "out": "out", "max_steps": "max_steps", "lr": "lr",
         "batch_size": "batch_size", "grad_accum": "grad_accum", "seed": "seed"}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a YAML file of settings")
    p.add_argument("--model", help="HF folder, .gguf file or smollm2 (default smollm2)")
    p.add_argument("--data", nargs="+", help="parquet files from `omrl export`")
    p.add_argument("--out", help="output folder (the trained HF model, checkpoints, metrics)")
    p.add_argument("--max-steps", type=int, help="optimizer steps")
    p.add_argument("--lr", type=float)
    p.add_argument("--batch-size", type=int, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, help="micro-batches per optimizer step")
    p.add_argument("--seed", type=int)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any setting, e.g. lora.r=16, online.env=countdown (repeatable)")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trainer", required=True)
    for name, text in HELP.items():
        _common(sub.add_parser(name, help=text, description=text))
    prm.configure(sub.add_parser("prm", help=(prm.__doc__ or "prm").strip().splitlines()[0]))


def overrides(args: argparse.Namespace) -> list[str] | dict[str, Any]:
    out: dict[str, Any] = {}
    for flag, key in FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = value
    if getattr(args, "resume", False):
        out["resume"] = True
    if getattr(args, "no_progress", False):
        out["progress"] = False
    for key, value in override_items(args.set):
        out[key] = value
    return out


def check_before_loading(kind: str, cfg: Any) -> None:
    """What can be checked without the model, before its weights load: ``out`` can be written
    (also when it came from the YAML file; nothing is created) and the data files are parquet
    files with rows and the columns this trainer needs (:func:`train.data.check_files`; online
    GRPO/PPO sample their own data)."""
    from omrl_search.outdir import check_out_path
    from omrl_search.specs import UsageError

    from .data import check_files

    try:
        check_out_path(cfg.out, "out")  # --out itself was checked by omrl's main
    except UsageError as exc:
        raise TrainError(str(exc)) from None
    if getattr(cfg, "online", None) is None:
        check_files(cfg.data, DATA_OF[kind])


def run(args: argparse.Namespace) -> int:
    if args.trainer == "prm":
        return prm.run(args)
    from .trainers import TRAINERS  # torch: only when a trainer runs

    trainer = TRAINERS[args.trainer]
    try:
        cfg = trainer.config.from_sources(args.config, overrides(args))
        check_before_loading(args.trainer, cfg)
        last = trainer.train(cfg)
    except (TrainError, PolicyError) as exc:
        print(f"omrl train: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({"out": cfg.out, **{k: v for k, v in last.items()
                                         if k in ("step", "loss", "policy_version")}}))
    return 0
