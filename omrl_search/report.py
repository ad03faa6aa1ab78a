"""build one self-contained HTML page (plots, tables, training curves, search trees) from a run folder

``omrl report RUN_DIR [--out FILE]`` looks through RUN_DIR for what the other commands write and
skips what is absent: ``omrl bench`` folders (``summary.json`` with ``config`` and ``strategies``;
trees from ``trees/*.jsonl`` when the bench ran with ``--save-trees``), ``omrl search --out``
folders (``results.jsonl``, ``summary.json``), training folders (``metrics.jsonl``, kind from
``omrl-train.json``) and loop rounds (folders named ``round_K`` with their ``report.md``). The
page (default ``RUN_DIR/report.html``) holds the data as JSON and draws it with its own inline
JS and SVG, so it opens offline. Success rates show their Wilson 95% interval (error bars on the
plots) and, where the run compared strategies, the McNemar p-value against the first. Trees are
capped (tasks per strategy and budget, nodes per tree, characters per text field, total size) and
the page says what was cut. ``--out`` is checked before RUN_DIR is read.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Iterator

#: folders never searched: model checkpoints, TensorBoard logs, LoRA adapters
SKIP_DIRS = {"checkpoints", "tb", "adapter", "__pycache__", "node_modules"}
ROUND_RE = re.compile(r"^round[_-]?(\d+)$")
#: per-task means each row carries (prefill and cached: the prompt tokens computed by the backend
#: and those served by its prefix cache, see omrl_search.budget)
PER_TASK = ("tokens", "prefill_tokens", "cached_tokens", "lm_calls", "rm_calls", "rm_tokens", "env_steps",
            "seconds")
#: the page's script, in order (one function scope): helpers and charts, the tree viewer, the page
JS_PARTS = ("base.js", "tree.js", "sections.js")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a bench, search, training or loop folder")
    p.add_argument("--out", help="the HTML file to write (default RUN_DIR/report.html)")
    p.add_argument("--max-tasks", type=int, default=12,
                   help="search trees kept per strategy and budget (default 12)")
    p.add_argument("--max-nodes", type=int, default=1500, help="nodes kept per tree (default 1500)")
    p.add_argument("--max-text", type=int, default=600,
                   help="characters kept per thought / action / observation (default 600)")
    p.add_argument("--max-mb", type=float, default=4.0,
                   help="size the embedded trees may take; fewer tasks are kept above it (default 4)")


def run(args: argparse.Namespace) -> int:
    from .cli import UsageError

    root = Path(args.run_dir)
    if not root.is_dir():
        raise UsageError(f"RUN_DIR {root} is not a directory")
    for flag in ("max_tasks", "max_nodes", "max_text"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.max_mb <= 0:
        raise UsageError(f"--max-mb must be > 0, got {args.max_mb}")
    from .outdir import check_writable_file, write_file_atomic

    out = check_writable_file(Path(args.out) if args.out else root / "report.html")  # before the work
    caps = Caps(args.max_tasks, args.max_nodes, args.max_text, int(args.max_mb * 2**20))
    data = collect(root, caps)
    if not (data["evals"] or data["training"] or data["rounds"]):
        raise UsageError(f"found no bench, search, training or loop results under {root}")
    write_file_atomic(out, render(data))
    trees = sum(len(g["results"]) for e in data["evals"] for g in e["trees"])
    counts = [(len(data["evals"]), "result set"), (trees, "tree"), (len(data["training"]), "training run"),
              (len(data["rounds"]), "round")]
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB): "
          + ", ".join(f"{n} {what}{'s' * (n != 1)}" for n, what in counts))
    for note in data["notes"]:
        print(f"  note: {note}")
    return 0


@dataclass
class Caps:
    """The limits on embedded trees, and a count of what they cut (reported on the page)."""

    max_tasks: int = 12
    max_nodes: int = 1500
    max_text: int = 600
    max_bytes: int = 4 * 2**20
    clipped_texts: int = 0
    cut_trees: int = 0
    notes: list[str] = field(default_factory=list)

    def clip(self, text: Any) -> str:
        text = "" if text is None else str(text)
        if len(text) <= self.max_text:
            return text
        self.clipped_texts += 1
        return f"{text[:self.max_text]}… [{len(text) - self.max_text} more characters]"


# --- discovery -------------------------------------------------------------------------------------
def collect(root: Path, caps: Caps | None = None) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-able data: result sets (``evals``: bench or search
    folders, with their summary rows and capped trees), training curves and loop rounds."""
    caps = caps or Caps()
    evals, training, rounds, unfinished = [], [], {}, []
    for folder in _walk(root, unfinished):
        rel = "" if folder == root else folder.relative_to(root).as_posix()
        rnd = _round_of(folder.relative_to(root))
        if rnd is not None and ROUND_RE.match(folder.name):
            md = folder / "report.md"
            rounds[rnd] = {"round": rnd, "id": rel,
                           "report_md": _clip_file(md) if md.is_file() else None}
        try:
            ev = _result_set(folder, rel, caps)
            if ev is not None:
                evals.append({**ev, "round": rnd})
            if (folder / "metrics.jsonl").is_file():
                training.append({**_training(folder), "id": rel, "round": rnd})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            caps.notes.append(f"skipped {rel or root.resolve().name}: {why}")
    _fit_size(evals, caps)
    if unfinished:
        caps.notes.append(f"not finished, left out: {', '.join(sorted(unfinished, key=_natural))}")
    if caps.cut_trees:
        caps.notes.append(f"{caps.cut_trees} trees cut to {caps.max_nodes} nodes (the best path and "
                          "the shallowest nodes kept)")
    if caps.clipped_texts:
        caps.notes.append(f"{caps.clipped_texts} texts cut to {caps.max_text} characters")
    return {"title": root.resolve().name, "loop": _loop_settings(root, caps), "evals": evals,
            "training": training, "rounds": [rounds[k] for k in sorted(rounds)], "notes": caps.notes}


def _loop_settings(root: Path, caps: Caps) -> dict[str, Any] | None:
    """``omrl loop``'s ``loop.json`` (env, policy, search settings), if RUN_DIR is a loop."""
    try:
        loop = _read_json(root / "loop.json") if (root / "loop.json").is_file() else None
    except (OSError, ValueError) as exc:
        caps.notes.append(f"skipped loop.json: {exc}")
        return None
    return loop if isinstance(loop, dict) else None


def _clip_file(path: Path, limit: int = 20000) -> str:
    text = path.read_text(errors="replace")
    return text if len(text) <= limit else text[:limit] + "\n… (cut)"


def _walk(root: Path, unfinished: list[str], depth: int = 6) -> Iterator[Path]:
    """``root`` and its folders, breadth first, in natural order (round_2 before round_10);
    stages of ``omrl loop`` still running (``NAME.partial``) are listed in ``unfinished``."""
    level = [root]
    for _ in range(depth + 1):
        nxt = []
        for folder in level:
            yield folder
            try:
                subs = [p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]
            except OSError:
                continue
            unfinished += [p.relative_to(root).as_posix() for p in subs if p.name.endswith(".partial")]
            nxt += sorted((p for p in subs if p.name not in SKIP_DIRS and not p.name.startswith(".")
                           and not p.name.endswith(".partial")), key=lambda p: _natural(p.name))
        level = nxt


def _natural(name: str) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _round_of(rel: Path) -> int | None:
    """The K of the innermost ``round_K`` folder on the path, if any."""
    for part in reversed(rel.parts):
        m = ROUND_RE.match(part)
        if m:
            return int(m.group(1))
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name}: {exc}") from None


def _result_set(folder: Path, rel: str, caps: Caps) -> dict[str, Any] | None:
    """A bench folder (summary rows per strategy and budget, trees if saved) or a search folder
    (``results.jsonl``); None for anything else."""
    summary_path, results_path = folder / "summary.json", folder / "results.jsonl"
    summary = _read_json(summary_path) if summary_path.is_file() else None
    if isinstance(summary, dict) and "config" in summary and "strategies" in summary:
        config = summary["config"]
        rows = [_row(name, label, s) for name, per in summary["strategies"].items()
                for label, s in per.items()]
        trees = []
        for path in sorted((folder / "trees").glob("*.jsonl"), key=lambda p: _natural(p.name)):
            name, _, label = path.stem.rpartition("@")
            results = _load(path)
            trees.append(_tree_group(name or path.stem, label, results, caps))
        if not trees:
            caps.notes.append(f"{rel or folder.resolve().name}: no trees (omrl bench saves them with "
                              "--save-trees)")
        return {"id": rel, "kind": "bench", "config": config, "rows": rows, "trees": trees}
    if not results_path.is_file():
        return None
    results = _load(results_path)
    groups: dict[str, list] = {}
    for r in results:
        groups.setdefault(r.strategy, []).append(r)
    names = _strategy_names(list(groups))
    if not isinstance(summary, dict) or not summary:
        from .api import summarize

        summary = {names[spec]: summarize(rs) for spec, rs in groups.items()}
    specs = {names[s]: s for s in groups}
    rows = [_row(name, "", {"strategy": specs.get(name, name), **s}) for name, s in summary.items()
            if isinstance(s, dict)]
    trees = [_tree_group(names[spec], "", rs, caps) for spec, rs in groups.items()]
    first = results[0].task if results else None
    config = {"env": first.env if first else "", "split": first.split if first else "",
              "tasks": max((len(rs) for rs in groups.values()), default=0)}
    return {"id": rel, "kind": "search", "config": config, "rows": rows, "trees": trees}


def _load(path: Path) -> list:
    from .result import read_results

    return list(read_results(path))


def _strategy_names(specs: list[str]) -> dict[str, str]:
    """Spec -> the name ``omrl search`` keys its summary by: the bare name the first time, the
    whole spec for a later strategy of the same name."""
    out, seen = {}, set()
    for spec in specs:
        name = spec.split(":", 1)[0]
        out[spec] = spec if name in seen else name
        seen.add(name)
    return out


def _row(name: str, label: str, s: dict[str, Any]) -> dict[str, Any]:
    """One summary row with the mean compute spent per task (as the bench plots it), the success
    rate's 95% interval (computed here for summaries written before they carried it) and the
    paired test against the first strategy when the summary has one."""
    from .bench import per_task
    from .stats import rate

    kind, _, value = label.partition("=")
    ci = {k: s[k] for k in ("ci_low", "ci_high") if k in s} or rate(int(s["successes"]), int(s["tasks"]))
    row = {"strategy": name, "spec": s.get("strategy", name), "budget": label, "budget_kind": kind,
           "budget_value": float(value) if value else None, "tasks": s["tasks"],
           "successes": s["successes"], "success_rate": s["success_rate"], "ci_low": ci["ci_low"],
           "ci_high": ci["ci_high"], "paired": s.get("paired"), "faults": s.get("faults", 0),
           "verifier_in_loop": bool(s.get("verifier_in_loop", False))}
    row.update({k: round(per_task(s, k), 4) for k in PER_TASK})
    return row


# --- trees ---------------------------------------------------------------------------------------
def _tree_group(name: str, label: str, results: list, caps: Caps) -> dict[str, Any]:
    kept = [_compact(r, caps) for r in results[:caps.max_tasks]]
    return {"strategy": name, "budget": label, "spec": results[0].strategy if results else name,
            "total": len(results), "results": kept}


def _compact(r: Any, caps: Caps) -> dict[str, Any]:
    """One SearchResult as the viewer needs it: short keys, texts clipped, at most ``max_nodes``
    nodes (the best path first, then breadth first, so every kept node's parent is kept)."""
    nodes = r.tree.nodes
    keep = set(range(len(nodes)))
    if len(nodes) > caps.max_nodes:
        caps.cut_trees += 1
        keep = {n.id for n in r.tree.path(nodes[r.best])} if r.best is not None else {0}
        for n in sorted(nodes, key=lambda n: (n.depth, n.id)):
            if len(keep) >= caps.max_nodes:
                break
            if n.parent is None or n.parent in keep:
                keep.add(n.id)
    out_nodes = [_node(n, caps) for n in nodes if n.id in keep]
    return {"task_id": r.task.task_id, "instruction": caps.clip(r.task.instruction),
            "success": r.success, "best": r.best, "stop_reason": r.stop_reason,
            "faults": [caps.clip(f) for f in r.faults[:20]], "spent": r.spent,
            "seconds": round(r.seconds, 4), "verifier_in_loop": r.verifier_in_loop,
            "nodes": out_nodes, "merges": [[u, v] for u, v in r.tree.merges if u in keep and v in keep],
            "dropped": len(nodes) - len(keep)}


def _node(n: Any, caps: Caps) -> dict[str, Any]:
    d: dict[str, Any] = {"id": n.id, "p": n.parent, "d": n.depth, "n": n.visits,
                         "q": _num(n.value) if n.visits else None, "pr": _num(n.prior),
                         "s": _num(n.score), "t": n.terminal, "ok": n.success, "st": n.status,
                         "o": caps.clip(n.observation)}
    if n.error:
        d["err"] = caps.clip(n.error)
    step = n.step
    if step is not None:
        d.update(th=caps.clip(step.thought), a=caps.clip(step.action), r=_num(step.reward),
                 v=step.valid)
        if step.completion.strip() != f"Think: {step.thought}\nAct: {step.action}".strip():
            d["c"] = caps.clip(step.completion)
        info = {k: caps.clip(v) if isinstance(v, str) else v for k, v in step.info.items()
                if isinstance(v, (str, int, float, bool)) and k not in ("valid", "success")}
        if info:
            d["info"] = info
    return d


def _num(x: Any) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 4)


def _fit_size(evals: list[dict[str, Any]], caps: Caps) -> None:
    """Keep the first ``n`` trees of every group, ``n`` as large as fits ``max_bytes``."""
    groups = [g for e in evals for g in e["trees"]]
    sizes = [[len(json.dumps(r)) for r in g["results"]] for g in groups]
    n = max((len(s) for s in sizes), default=0)
    while n > 1 and sum(sum(s[:n]) for s in sizes) > caps.max_bytes:
        n -= 1
    for g in groups:
        g["results"] = g["results"][:n]
    shown = [(len(g["results"]), g["total"]) for g in groups]
    if any(k < t for k, t in shown):
        why = f"to keep the trees under {caps.max_bytes / 2**20:g} MB" if n < caps.max_tasks \
            else f"--max-tasks {caps.max_tasks}"
        caps.notes.append(f"trees of the first {n} tasks per strategy and budget shown ({why}); "
                          f"{sum(t for _, t in shown) - sum(k for k, _ in shown)} more in the files")


# --- training curves -----------------------------------------------------------------------------
def _training(folder: Path, max_points: int = 1000) -> dict[str, Any]:
    """Numeric metrics per step from ``metrics.jsonl`` (thinned to ``max_points``)."""
    series: dict[str, list[list[float]]] = {}
    bad = 0
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        try:
            rec = json.loads(line)
            step = float(rec["step"])
        except (ValueError, KeyError, TypeError):
            bad += line.strip() != ""
            continue
        for k, v in rec.items():
            if (k not in ("step", "policy_version") and isinstance(v, (int, float))
                    and not isinstance(v, bool) and math.isfinite(v)):
                series.setdefault(k, []).append([step, round(float(v), 6)])
    for k, pts in series.items():
        if len(pts) > max_points:
            stride = -(-len(pts) // max_points)
            series[k] = pts[::stride] + ([pts[-1]] if (len(pts) - 1) % stride else [])
    marker = folder / "omrl-train.json"
    kind = folder.name
    if marker.is_file():
        try:
            kind = _read_json(marker).get("kind", kind)
        except ValueError:
            pass
    return {"kind": kind, "series": series, "bad_lines": bad}


# --- the page ------------------------------------------------------------------------------------
def render(data: dict[str, Any]) -> str:
    """The HTML page: the template with its CSS, JS and the data inlined."""
    assets = resources.files(__package__) / "report_assets"
    page = (assets / "report.html").read_text(encoding="utf-8")
    blob = json.dumps(data, separators=(",", ":"), allow_nan=False, default=str)
    blob = blob.replace("</", "<\\/").replace("<!--", "<\\u0021--")
    script = "\n".join((assets / name).read_text(encoding="utf-8") for name in JS_PARTS)
    parts = {"/*@CSS@*/": (assets / "report.css").read_text(encoding="utf-8"), "/*@JS@*/": script,
             "@TITLE@": html.escape(data["title"]), "@DATA@": blob}
    return re.sub("|".join(re.escape(k) for k in parts), lambda m: parts[m.group(0)], page)
