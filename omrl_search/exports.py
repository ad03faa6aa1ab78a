"""Export search trees as training data: SFT rows, DPO pairs, GRPO groups, PRM step labels (parquet).

Every row keeps TRL's conversational columns (``messages``; ``prompt``/``chosen``/``rejected``;
``prompt``/``completion``) so HF ``datasets`` and TRL read it, plus our **segment** columns:
lists of ``{role, token_ids, logprobs, trainable}`` holding the exact token ids the policy saw and
produced (never re-rendered), from which trainers derive every loss mask. Each sequence is stored
whole (shared prefix first, with ``trainable: false``). TRL 1.16 with each kind: docs/interop.md.

Each kind's rows are built in its own module (what they share: :mod:`.export_common`):

* **SFT** (:mod:`.export_sft`): ``sft`` — per result, the finished successful trajectories
  (fewer steps first), deduplicated, the top ``top_k`` kept; ``rs-sft`` — rejection-sampling
  SFT: per task over all results, successes only, deduplicated by action sequence, at most
  ``cap``; :func:`openmanus_rows` imports the OpenManus-RL SFT format
  (``{id, conversations: [{role, content}]}`` with ``Think:``/``Act:`` turns).
* **DPO** (:mod:`.export_dpo`): siblings from the same prompt ids (the prefix is identical by
  construction) at real branch points: the chosen one leads to success, the rejected one not
  (``pairs="value"``: values that differ by at least ``margin``; ``"qgap"``: MCTS Q values that
  differ by at least ``margin``, both siblings proven or visited ``min_visits`` times).
* **GRPO** (:mod:`.export_grpo`): siblings expanded from one snapshot form a group (any size);
  segments also carry the ``grammar`` each step was sampled under.
* **PRM** (:mod:`.export_prm`): per root-to-leaf path, each step's Monte-Carlo value, MCTS
  Q-value and label (:mod:`reward_models.label_files`; ``omrl label`` adds fresh policy rollouts).

Columns that could be misread mean one thing in every kind: ``reward`` is the **env's reward**
summed over the steps the row trains on (one step: that step's reward); ``value`` /
``chosen_value`` / ``soft_labels`` are **node values** (below); ``success`` is whether the row's
last step **ended a solved episode**; ``terminal`` whether it ended the episode at all.

A node's **value** (``value=``): ``mc`` — the mean outcome (1 success, 0 failure) of the finished
trajectories below it (Monte-Carlo); ``search`` — the search's own statistic (``visits``,
``value_sum``: MCTS); ``score`` — the reward model's score. Nodes without one are skipped.

Prompts are the engine's own (:func:`prompt_messages`), as is the learned PRM's text input.
Trees from policies without a real tokenizer (scripted: byte ids) or demonstrations can be
re-encoded with a real tokenizer (``tokenizer=``): the chat is encoded turn by turn with
:class:`~omrl_search.agent.TurnEncoder`, so ids match what the search would feed that model.
Such rows have no logprobs (not behaviour-policy samples).

This module imports no torch and never imports ``train``; pyarrow is imported when writing.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

from .agent import TurnEncoder
from .export_common import (VALUES, ExportError, env_reward, finished_below, load_encoder,
                            node_values, outcome, prompt_messages, seg_dict, segments_from_messages)
from .export_dpo import PAIRS, dpo_rows
from .export_grpo import grpo_rows
from .export_prm import SOFT, label_paths, prm_rows
from .export_sft import openmanus_rows, rs_sft_rows, sft_rows
from .outdir import make_dirs, remove_dirs
from .result import read_results

__all__ = ["KINDS", "VALUES", "SOFT", "PAIRS", "ExportError", "seg_dict", "segments_from_messages",
           "load_encoder", "outcome", "node_values", "prompt_messages", "env_reward",
           "finished_below", "label_paths", "sft_rows", "rs_sft_rows", "dpo_rows", "grpo_rows",
           "prm_rows", "openmanus_rows", "schema", "write_parquet", "export"]

KINDS = ("sft", "rs-sft", "dpo", "grpo", "prm", "openmanus")
#: kinds written with another kind's schema
_SCHEMA_OF = {"rs-sft": "sft", "openmanus": "sft"}
_BUILD = {"sft": sft_rows, "rs-sft": rs_sft_rows, "dpo": dpo_rows, "grpo": grpo_rows, "prm": prm_rows}


# --- parquet ---------------------------------------------------------------------------------------
def schema(kind: str) -> Any:
    """The pyarrow schema of ``kind`` rows (``prm``: the label-file layout; ``rs-sft`` and
    ``openmanus`` rows are SFT rows)."""
    import pyarrow as pa

    kind = _SCHEMA_OF.get(kind, kind)
    pairs = [("role", pa.string()), ("content", pa.string())]
    msg = pa.list_(pa.struct(pairs))
    seg = pa.list_(pa.struct([("role", pa.string()), ("token_ids", pa.list_(pa.int64())),
                              ("logprobs", pa.list_(pa.float64())), ("trainable", pa.bool_())]))
    # GRPO segments also carry the grammar a step was sampled under (null: unconstrained)
    grammar = pa.struct([("kind", pa.string()), ("rules", pa.string()), ("source", pa.string()),
                         ("think", pa.string()), ("act", pa.string())])
    grpo_seg = pa.list_(pa.struct(list(seg.value_type) + [pa.field("grammar", grammar)]))
    base = [("task_id", pa.string()), ("env", pa.string())]
    floats, ints = pa.list_(pa.float64()), pa.list_(pa.int64())
    fields = {
        "sft": base + [("messages", pa.list_(pa.struct(pairs + [("trainable", pa.bool_())]))),
                       ("segments", seg), ("success", pa.bool_()), ("reward", pa.float64()),
                       ("steps", pa.int64())],
        "dpo": base + [("pair_id", pa.string()), ("prompt", msg), ("chosen", msg),
                       ("rejected", msg), ("chosen_segments", seg), ("rejected_segments", seg),
                       ("chosen_value", pa.float64()), ("rejected_value", pa.float64())],
        "grpo": base + [("group_id", pa.string()), ("prompt", msg), ("completion", msg),
                        ("segments", grpo_seg), ("value", pa.float64()), ("reward", pa.float64()),
                        ("success", pa.bool_()), ("terminal", pa.bool_()),
                        ("process", floats)],  # null without --process-rm
        "prm": [("prompt", msg), ("completions", pa.list_(pa.string())),
                ("labels", pa.list_(pa.bool_())), ("soft_labels", floats), ("mc_values", floats),
                ("mc_rollouts", ints), ("q_values", floats), ("visits", ints),
                ("observations", pa.list_(pa.string())), ("segments", seg)] + base
               + [("split", pa.string()), ("strategy", pa.string()), ("success", pa.bool_()),
                  ("terminal", pa.bool_())],
    }[kind]
    return pa.schema(fields, metadata={b"omrl.kind": kind.encode()})


def write_parquet(rows: list[dict[str, Any]], path: str | Path, kind: str) -> Path:
    """Write rows atomically (temporary file renamed into place)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    sch = schema(kind)
    table = pa.Table.from_pylist([{k: r.get(k) for k in sch.names} for r in rows], schema=sch)
    created = make_dirs(path.parent)  # only now, with rows to write
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        remove_dirs(created)
        raise
    return path


def export(kind: str, sources: Sequence[str | Path], out: str | Path, *,
           tokenizer: str | TurnEncoder | None = None, **options: Any) -> tuple[Path, int]:
    """Read ``results.jsonl`` files (or an OpenManus file), build ``kind`` rows, write parquet.
    Returns (path, rows). Nothing is written when there are no rows or the input is bad."""
    if kind not in KINDS:
        raise ExportError(f"unknown export {kind!r} (one of {', '.join(KINDS)})")
    for s in sources:
        if not Path(s).is_file():
            raise ExportError(f"{s}: no such file")
    results = []
    if kind != "openmanus":  # every source read (and refused, when bad) before a tokenizer loads
        for s in sources:
            try:
                results += list(read_results(s))
            except ValueError as exc:  # file:line: invalid JSON, not UTF-8, a bad record
                raise ExportError(str(exc)) from None
    enc = load_encoder(tokenizer) if isinstance(tokenizer, str) else tokenizer
    if kind == "openmanus":
        rows = [r for s in sources for r in openmanus_rows(s, enc)]
    else:
        rows = _BUILD[kind](results, tokenizer=enc, **options)
    if not rows:
        raise ExportError(f"no {kind} rows in {', '.join(map(str, sources))} (nothing written)")
    return write_parquet(rows, out, kind), len(rows)


# --- ``omrl export`` ---------------------------------------------------------------------------------
def configure(parser: Any) -> None:
    """Export search results as SFT / rejection-sampling SFT / DPO / GRPO / PRM-label parquet, or import OpenManus-RL data."""
    from .cli import finite_at_least, int_at_least

    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("sources", nargs="+", help="results.jsonl files (openmanus: a JSON/JSONL file)")
    parser.add_argument("--out", required=True, help="the parquet file to write")
    parser.add_argument("--tokenizer", default=None,
                        help="re-encode with this model's tokenizer (smollm2, an HF folder or a .gguf)")
    parser.add_argument("--top-k", type=int_at_least(1), default=1, help="sft: trajectories kept per task")
    parser.add_argument("--include-failures", action="store_true",
                        help="sft: keep failed trajectories too (after the successful ones)")
    parser.add_argument("--cap", type=int_at_least(1), default=4, help="rs-sft: distinct successes kept per task")
    parser.add_argument("--pairs", choices=PAIRS, default="branch",
                        help="dpo: branch (chosen leads to success, rejected not), value (node values "
                             "differ by >= margin) or qgap (MCTS Q values differ by >= margin)")
    parser.add_argument("--margin", type=finite_at_least(0), default=0.5,
                        help="dpo --pairs value|qgap: least value gap")
    parser.add_argument("--min-visits", type=int_at_least(1), default=2,
                        help="dpo --pairs qgap: visits each unproven sibling needs")
    parser.add_argument("--max-pairs", type=int_at_least(1), default=4, help="dpo: pairs per branch point")
    parser.add_argument("--unit", choices=("step", "trajectory"), default=None,
                        help="dpo/grpo: single turns or whole continuations (dpo: step, grpo: trajectory)")
    parser.add_argument("--value", choices=VALUES, default="mc", help="dpo/grpo: node values")
    parser.add_argument("--min-group", type=int_at_least(1), default=2, help="grpo: smallest group kept")
    parser.add_argument("--process-rm", default=None, metavar="SPEC",
                        help="grpo: a reward model (prm:DIR, implicit:POLICY) whose step values "
                             "fill the process column (dense process rewards)")
    parser.add_argument("--soft", choices=SOFT, default="mc",
                        help="prm: what soft_labels hold (mc, q where there is one, their mean)")
    parser.add_argument("--threshold", type=finite_at_least(0), default=0.5, help="prm: labels = soft_labels >= this")


def run(args: Any) -> int:
    import sys

    from .outdir import check_writable_file

    check_writable_file(args.out)  # before any input is read; creates nothing
    opts: dict[str, Any] = {}
    if args.kind == "sft":
        opts = {"top_k": args.top_k, "include_failures": args.include_failures}
    elif args.kind == "rs-sft":
        opts = {"cap": args.cap}
    elif args.kind == "dpo":
        opts = {"pairs": args.pairs, "margin": args.margin, "max_pairs": args.max_pairs, "value": args.value,
                "unit": args.unit or "step", "min_visits": args.min_visits}
    elif args.kind == "grpo":
        opts = {"min_group": args.min_group, "value": args.value, "unit": args.unit or "trajectory"}
    elif args.kind == "prm":
        opts = {"soft": args.soft, "threshold": args.threshold}
    try:
        if args.kind == "grpo" and args.process_rm:
            from .reward import make_reward_model

            opts["reward_model"] = make_reward_model(args.process_rm)
        path, n = export(args.kind, args.sources, args.out, tokenizer=args.tokenizer, **opts)
    except (ExportError, ValueError) as exc:  # also a bad --process-rm spec or an unscored member
        print(f"omrl export: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {n} {args.kind} rows to {path}")
    return 0
