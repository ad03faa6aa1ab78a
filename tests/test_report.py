"""``omrl report``: what it finds in bench, search, training and loop folders, how it caps trees,
and the page itself loaded in headless Chromium (drawn without errors, one circle per tree node,
a node's details shown for ``?select=ID``)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from omrl_search.cli import main
from omrl_search.report import Caps, collect, render

pytest.importorskip("matplotlib")  # omrl bench draws its own PNGs


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A folder laid out as ``omrl loop`` writes it: loop.json; round_0/eval (a bench with trees);
    round_1 with search (Graph-of-Thoughts and beam trees: merge edges), policy/sft and prm/model
    (metrics, checkpoints), eval and report.md; round_2 with an unfinished stage."""
    loop = tmp_path_factory.mktemp("runs") / "loop"
    assert main(["bench", "--env", "game24", "--limit", "3", "--strategies", "react,mcts",
                 "--budgets", "tokens=2000,8000", "--seed", "0", "--out", str(loop / "round_0" / "eval"),
                 "--save-trees", "--no-progress"]) == 0
    shutil.copytree(loop / "round_0" / "eval", loop / "round_1" / "eval")
    assert main(["search", "--env", "game24", "--limit", "2", "--strategy", "got", "--strategy", "beam",
                 "--reward-model", "rules:format=0.2,outcome=1", "--out", str(loop / "round_1" / "search"),
                 "--no-progress"]) == 0
    trainings = (("sft", "policy/sft", [2.0, 1.5, 1.1]), ("prm", "prm/model", [0.7, 0.5, 0.4]))
    for kind, folder, losses in trainings:
        out = loop / "round_1" / folder
        (out / "checkpoints" / "step-2").mkdir(parents=True)
        (out / "checkpoints" / "step-2" / "metrics.jsonl").write_text('{"step": 1, "loss": 9}\n')
        lines = [json.dumps({"step": i + 1, "loss": v, "lr": 1e-4, "policy_version": i + 1})
                 for i, v in enumerate(losses)]
        (out / "metrics.jsonl").write_text("\n".join(lines[:2] + ["not json"] + lines[2:]) + "\n")
        (out / "omrl-train.json").write_text(json.dumps({"kind": kind, "step": 3}))
    (loop / "round_1" / "report.md").write_text("# Round 1\n\nsearch, train, eval\n")
    (loop / "round_2" / "search.partial").mkdir(parents=True)
    (loop / "round_2" / "search.partial" / "results.jsonl").write_text("")
    (loop / "loop.json").write_text(json.dumps({"env": "game24", "policy": "smollm2", "seed": 0}))
    return loop


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bench_folder_rows_and_trees(runs):
    bench = runs / "round_0" / "eval"
    data = collect(bench)
    (ev,) = data["evals"]
    assert ev["kind"] == "bench" and ev["id"] == "" and ev["config"]["tasks"] == 3
    summary = json.loads((bench / "summary.json").read_text())["strategies"]
    assert [(r["strategy"], r["budget"]) for r in ev["rows"]] == [
        ("react", "tokens=2000"), ("react", "tokens=8000"), ("mcts", "tokens=2000"), ("mcts", "tokens=8000")]
    for row in ev["rows"]:
        s = summary[row["strategy"]][row["budget"]]
        assert (row["ci_low"], row["ci_high"]) == (s["ci_low"], s["ci_high"])  # the interval, as written
        assert row["paired"] == s.get("paired") and (row["paired"] is None) == (row["strategy"] == "react")
        assert row["tokens"] == pytest.approx((s["prompt_tokens"] + s["completion_tokens"]) / 3, abs=1e-3)
        assert row["env_steps"] == pytest.approx(s["env_steps"] / 3, abs=1e-3)
        assert row["budget_value"] == float(row["budget"].split("=")[1])
    pairs = lambda items: {(x["strategy"], x["budget"]) for x in items}  # noqa: E731
    assert pairs(ev["trees"]) == pairs(ev["rows"])
    group = next(g for g in ev["trees"] if g["strategy"] == "mcts" and g["budget"] == "tokens=8000")
    stored = _lines(bench / "trees" / "mcts@tokens=8000.jsonl")
    assert group["total"] == len(group["results"]) == 3
    for res, raw in zip(group["results"], stored):
        assert res["task_id"] == raw["task"]["task_id"] and res["best"] == raw["best"]
        assert [n["id"] for n in res["nodes"]] == [n["id"] for n in raw["tree"]["nodes"]]
        visited = [n for n in raw["tree"]["nodes"] if n["visits"]]
        assert visited
        for n in visited:  # MCTS values come through as Q = value_sum / visits
            assert res["nodes"][n["id"]]["q"] == pytest.approx(n["value_sum"] / n["visits"], abs=1e-4)
    assert data["rounds"] == data["training"] == [] and data["loop"] is None


def test_loop_folder_rounds_training_and_search(runs):
    data = collect(runs)
    assert data["loop"]["policy"] == "smollm2"
    assert [(e["id"], e["kind"], e["round"]) for e in data["evals"]] == [
        ("round_0/eval", "bench", 0), ("round_1/eval", "bench", 1), ("round_1/search", "search", 1)]
    assert [(r["round"], r["report_md"]) for r in data["rounds"]] == [
        (0, None), (1, "# Round 1\n\nsearch, train, eval\n"), (2, None)]
    assert "not finished, left out: round_2/search.partial" in data["notes"]
    # checkpoints/ is not searched; the unreadable line is counted, not fatal
    assert [(t["id"], t["kind"], t["round"], t["bad_lines"]) for t in data["training"]] == [
        ("round_1/policy/sft", "sft", 1, 1), ("round_1/prm/model", "prm", 1, 1)]
    assert data["training"][1]["series"]["loss"] == [[1, 0.7], [2, 0.5], [3, 0.4]]
    assert "policy_version" not in data["training"][0]["series"]
    search = data["evals"][2]
    assert [r["strategy"] for r in search["rows"]] == ["got", "beam"]
    assert search["rows"][0]["spec"].startswith("got:")
    got = next(g for g in search["trees"] if g["strategy"] == "got")
    assert all(r["merges"] for r in got["results"])  # Graph-of-Thoughts aggregation makes a DAG


def test_summaries_without_intervals_get_them(tmp_path):
    """A summary written before rows carried intervals (or by another tool) still shows one."""
    from omrl_search.stats import wilson

    bench = tmp_path / "old"
    bench.mkdir()
    row = {"tasks": 20, "successes": 7, "success_rate": 0.35, "prompt_tokens": 100, "completion_tokens": 20,
           "lm_calls": 4, "rm_calls": 0, "env_steps": 4, "seconds": 1.0, "faults": 0, "verifier_in_loop": False}
    (bench / "summary.json").write_text(json.dumps({"config": {"env": "game24", "tasks": 20},
                                                    "strategies": {"react": {"tokens=100": row}}}))
    (r,) = collect(bench)["evals"][0]["rows"]
    assert (r["ci_low"], r["ci_high"]) == pytest.approx(wilson(7, 20), abs=1e-4) and r["paired"] is None


def test_caps_cut_tasks_nodes_text_and_size(runs):
    bench = runs / "round_0" / "eval"
    stored = _lines(bench / "trees" / "mcts@tokens=8000.jsonl")
    caps = Caps(max_tasks=2, max_nodes=6, max_text=12)
    ev = collect(bench, caps)["evals"][0]
    group = next(g for g in ev["trees"] if g["strategy"] == "mcts" and g["budget"] == "tokens=8000")
    assert len(group["results"]) == 2 and group["total"] == 3
    for res, raw in zip(group["results"], stored):
        ids = {n["id"] for n in res["nodes"]}
        assert len(ids) == min(6, len(raw["tree"]["nodes"]))
        assert res["dropped"] == len(raw["tree"]["nodes"]) - len(ids)
        assert all(n["p"] is None or n["p"] in ids for n in res["nodes"])  # no orphans
        node, best_path = raw["tree"]["nodes"], set()
        v = raw["best"]
        while v is not None:
            best_path.add(v)
            v = node[v]["parent"]
        assert best_path <= ids
        for n in res["nodes"]:
            assert len(n["o"]) <= 12 or n["o"].endswith("more characters]")
    notes = " | ".join(collect(bench, Caps(max_tasks=2, max_nodes=6, max_text=12))["notes"])
    assert "first 2 tasks" in notes and "cut to 6 nodes" in notes and "cut to 12 characters" in notes
    tiny = collect(bench, Caps(max_bytes=1))  # over budget: one task per group is still shown
    assert all(len(g["results"]) == 1 for g in tiny["evals"][0]["trees"])
    assert any("under" in n and "MB" in n for n in tiny["notes"])


def test_page_is_self_contained_and_data_escaped(runs):
    data = collect(runs / "round_1" / "search")
    res = data["evals"][0]["trees"][0]["results"][0]
    res["nodes"][1]["o"] = "</script><script>alert(1)</script><!-- x"
    page = render(data)
    assert not re.search(r"<script[^>]+src|<link|@import|url\(", page, re.I)
    blob = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S).group(1)
    assert json.loads(blob) == json.loads(json.dumps(data))


@pytest.mark.parametrize("argv,needle", [
    (["nowhere"], "is not a directory"),
    ([""], "found no bench, search, training or loop results"),
    (["", "--max-tasks", "0"], "--max-tasks must be >= 1"),
    (["", "--max-mb", "-1"], "--max-mb must be > 0"),
    (["", "--out", "dir"], "is a directory"),
    (["", "--out", "file/report.html"], "is not writable"),
])
def test_bad_arguments_one_line_nothing_written(tmp_path, capsys, argv, needle):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    argv = [str(tmp_path / a) if a in ("nowhere", "dir", "file/report.html") else (str(empty) if a == "" else a)
            for a in argv]
    assert main(["report", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
    assert not list(tmp_path.rglob("*.html")) and not list(tmp_path.rglob("*.tmp"))


def test_out_is_checked_before_the_run_folder_is_read(runs, tmp_path, capsys, monkeypatch):
    import omrl_search.report as report

    monkeypatch.setattr(report, "collect", lambda *a, **k: pytest.fail("read the folder before checking --out"))
    (tmp_path / "file").write_text("x")
    assert main(["report", str(runs), "--out", str(tmp_path / "file" / "r.html")]) == 2
    assert "is not writable" in capsys.readouterr().err


# --- the page in a browser -----------------------------------------------------------------------
def _chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing (the Makefile installs it)")
        pytest.skip("chromium is not installed")
    return path


def _dump_dom(page: Path, query: str, tmp_path: Path) -> tuple[str, str]:
    profile = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}"
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", "--window-size=1400,1000",
           "--dump-dom", page.as_uri() + query]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout, proc.stderr


class _Element(HTMLParser):
    """The tags and text inside the element with a given id."""

    def __init__(self, element_id: str):
        super().__init__()
        self.id, self.depth, self.tags, self.text = element_id, 0, [], []

    def handle_starttag(self, tag, attrs):
        if self.depth or dict(attrs).get("id") == self.id:
            self.depth += 1
            self.tags.append((tag, dict(attrs)))

    def handle_startendtag(self, tag, attrs):
        if self.depth:
            self.tags.append((tag, dict(attrs)))

    def handle_endtag(self, tag):
        if self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.text.append(data)


def _element(dom: str, element_id: str) -> _Element:
    p = _Element(element_id)
    p.feed(dom)
    assert p.tags, f"no #{element_id} in the page"
    return p


def test_page_draws_plots_tree_and_node_details(runs, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(runs), "--out", str(out)]) == 0
    data = collect(runs)
    got = next(g for g in data["evals"][2]["trees"] if g["strategy"] == "got")["results"][1]
    node = next(n for n in got["nodes"] if n["id"] not in (0, got["best"]) and n.get("a"))
    query = f"?eval=round_1/search&strategy=got&task={got['task_id']}&select={node['id']}"
    dom, log = _dump_dom(out, query, tmp_path)

    root = re.search(r"<html[^>]*>", dom).group(0)  # the page marks itself drawn, or its errors
    assert 'data-ready="1"' in root and "data-errors" not in root
    assert not [line for line in log.splitlines() if "CONSOLE" in line], log
    tree = _element(dom, "tree-svg")
    assert tree.tags[0][1]["data-task"] == got["task_id"]
    assert sum(t == "circle" for t, _ in tree.tags) == len(got["nodes"])
    assert sum("merge" in a.get("class", "") for t, a in tree.tags if t == "path") == len(got["merges"])
    assert sum("best" in a.get("class", "").split() for t, a in tree.tags if t == "path") > 0
    selected = [a for t, a in tree.tags if t == "circle" and "selected" in a["class"]]
    assert [a["data-id"] for a in selected] == [str(node["id"])]
    details = "".join(_element(dom, "details").text)
    assert f"Node {node['id']}" in details and node["a"] in details and node["o"].split("\n")[0] in details

    scaling = _element(dom, "scaling")  # 3 plots, one line per strategy of every result set
    lines = sum(len({r["strategy"] for r in e["rows"]}) for e in data["evals"])
    assert sum(t == "svg" for t, _ in scaling.tags) == 3
    assert sum("series" in a.get("class", "") for t, a in scaling.tags if t == "path") == 3 * lines
    points = sum(len(e["rows"]) for e in data["evals"])  # each point with its 95% interval
    assert sum("errbar" in a.get("class", "") for t, a in scaling.tags if t == "path") == 3 * points
    results = _element(dom, "results")
    text = "".join(results.text)
    bench_rows = data["evals"][0]["rows"]
    mcts = next(r for r in bench_rows if r["strategy"] == "mcts" and r["budget"] == "tokens=8000")
    assert "success [95% CI]" in text and "vs react (McNemar)" in text
    assert f"[{mcts['ci_low']:.2f}, {mcts['ci_high']:.2f}]" in text
    assert f"({mcts['paired']['b_only']} vs {mcts['paired']['a_only']})" in text and "p=" in text
    assert sum("ci" in a.get("class", "").split() for t, a in results.tags if t == "span") == \
        sum(len(e["rows"]) for e in data["evals"])
    training = _element(dom, "training")
    assert sum("series" in a.get("class", "") for t, a in training.tags if t == "path") == 2
    rounds = "".join(_element(dom, "rounds").text)
    assert "round 2" in rounds and "eval · mcts @ tokens=8000" in rounds
    assert "sft training: last loss" in rounds and "prm training: last loss" in rounds
