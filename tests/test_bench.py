"""``omrl bench``: outputs, argument parsing, and one-line errors that write nothing."""
from __future__ import annotations

import json

import pytest

from omrl_search.api import SUMMARY_FIELDS, load_tasks
from omrl_search.bench import parse_budgets, split_strategies
from omrl_search.cli import main
from omrl_search.specs import SpecError
from omrl_search.stats import fmt_paired, mcnemar, wilson

pytest.importorskip("matplotlib")


def test_bench_writes_summary_table_and_plots(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(["bench", "--env", "game24", "--limit", "8", "--strategies", "react,beam:width=2,k=2,mcts",
               "--policy", "scripted:oracle:p=0.3", "--budgets", "lm_calls=2,20", "--seed", "0",
               "--out", str(out), "--no-progress", "--save-trees"])
    assert rc == 0
    data = json.loads((out / "summary.json").read_text())
    assert data["config"]["budgets"] == [2, 20] and data["config"]["tasks"] == 8
    assert list(data["strategies"]) == ["react", "beam", "mcts"]
    outcomes = [json.loads(line) for line in (out / "outcomes.jsonl").read_text().splitlines()]
    assert len(outcomes) == 3 * 2 * 8
    ids = [t.task_id for t in load_tasks("game24", "test", 8)]
    solved = {}
    for name, per in data["strategies"].items():
        assert list(per) == ["lm_calls=2", "lm_calls=20"]
        for label, row in per.items():
            assert set(SUMMARY_FIELDS) | {"verifier_in_loop", "strategy", "constraint", "prefill_tokens",
                                          "cached_tokens"} | ({"paired"} if name != "react" else set()) \
                == set(row)
            assert row["cached_tokens"] == 0 and row["prefill_tokens"] == row["prompt_tokens"]
            mine = [o for o in outcomes if (o["strategy"], o["budget"]) == (name, label)]
            assert [o["task_id"] for o in mine] == ids  # task order, though appended as tasks finished
            solved[name, label] = {o["task_id"]: o["success"] for o in mine}
            assert row["tasks"] == 8 and row["successes"] == sum(solved[name, label].values())
            assert (row["ci_low"], row["ci_high"]) == pytest.approx(wilson(row["successes"], 8), abs=1e-4)
            if name != "react":  # each strategy against the first at the same budget, same tasks
                assert row["paired"] == {"vs": "react", **mcnemar(solved["react", label], solved[name, label])}
        assert per["lm_calls=2"]["lm_calls"] <= per["lm_calls=20"]["lm_calls"]
    assert data["strategies"]["mcts"]["lm_calls=20"]["paired"]["b_only"] > 0
    assert data["strategies"]["beam"]["lm_calls=2"]["strategy"].startswith("beam:width=2,k=2")
    table = (out / "table.md").read_text()
    assert "| mcts* |" in table and "| beam | lm_calls=20 |" in table
    mcts = data["strategies"]["mcts"]["lm_calls=20"]
    assert f"{mcts['success_rate']:.2f} [{mcts['ci_low']:.2f}, {mcts['ci_high']:.2f}]" in table
    assert "exact McNemar" in table and fmt_paired(mcts["paired"]) in table
    for png in ("scaling.png", "scaling_env_steps.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trees = [json.loads(line) for line in (out / "trees" / "mcts@lm_calls=20.jsonl").read_text().splitlines()]
    assert [t["task"]["task_id"] for t in trees] == ids
    assert {t["task"]["task_id"]: t["success"] for t in trees} == solved["mcts", "lm_calls=20"]
    printed = capsys.readouterr().out
    assert "react@lm_calls=20" in printed and fmt_paired(mcts["paired"]) in printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench"]  # no temporary sibling left


def test_plots_have_error_bars(tmp_path, monkeypatch):
    """The plots draw each point's 95% interval (matplotlib errorbar, whose bounds are checked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.axes

    from omrl_search.bench import plot

    drawn = []
    real = matplotlib.axes.Axes.errorbar
    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar",
                        lambda self, x, y, yerr=None, **kw: drawn.append((x, y, yerr)) or real(self, x, y, yerr=yerr, **kw))
    row = lambda k, n, tokens: {"tasks": n, "successes": k, "success_rate": k / n,  # noqa: E731
                                **dict(zip(("ci_low", "ci_high"), wilson(k, n))),
                                "prompt_tokens": tokens * n, "completion_tokens": 0, "verifier_in_loop": False}
    plot({"react": {"tokens=100": row(3, 10, 90), "tokens=400": row(7, 10, 350)}}, tmp_path / "p.png",
         "tokens", "tokens")
    ((x, y, (below, above)),) = drawn
    assert x == [90, 350] and y == [0.3, 0.7]
    assert below == pytest.approx([0.3 - wilson(3, 10)[0], 0.7 - wilson(7, 10)[0]])
    assert above == pytest.approx([wilson(3, 10)[1] - 0.3, wilson(7, 10)[1] - 0.7])
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("args,needle", [
    (["--env", "nope"], "unknown env 'nope'"),
    (["--strategies", "react,zigzag"], "unknown strategy 'zigzag'"),
    (["--strategies", "k=2,react"], "follows no strategy"),
    (["--strategies", "beam:width=0"], "width and k must be >= 1"),
    (["--strategies", "mcts:value=oracle"], "unknown value source 'oracle'"),
    (["--strategies", "got:graph=score"], "needs a generate"),
    (["--budgets", "joules=5"], "KIND=V1,V2"),
    (["--budgets", "tokens=100,-5"], "tokens=-5"),
    (["--budgets", "tokens=100,100"], "repeated"),
    (["--budgets", "tokens=100,nan"], "tokens=nan must be a finite positive number"),
    (["--budgets", "seconds=inf"], "seconds=inf must be a finite positive number"),
    (["--strategies", "react,beam:width=abc,k=2"], "strategy 'beam': width must be an int, got 'abc'"),
    (["--policy", "gpt9"], "unknown policy 'gpt9'"),
    (["--limit", "0"], "--limit"),
    (["--reward-model", "magic"], "unknown reward model"),
])
def test_bad_arguments_one_line_no_output(tmp_path, capsys, args, needle):
    out = tmp_path / "bench"
    base = {"--env": "game24", "--budgets": "tokens=100", "--strategies": "react"}
    for flag, _ in zip(args[::2], args[1::2]):
        base.pop(flag, None)
    argv = ["bench", *[x for kv in base.items() for x in kv], *args, "--out", str(out), "--no-progress"]
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_out_must_be_a_directory(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    rc = main(["bench", "--env", "game24", "--budgets", "tokens=100", "--out", str(f), "--no-progress"])
    assert rc == 2 and "not a directory" in capsys.readouterr().err


def test_strategy_and_budget_lists_parse():
    assert split_strategies("react,beam:width=4,k=2,mcts:leaves=8") == \
        ["react", "beam:width=4,k=2", "mcts:leaves=8"]
    assert parse_budgets("env_steps=40,10") == ("env_steps", [10, 40])
    with pytest.raises(SpecError):
        parse_budgets("tokens")


def test_bench_python_api_returns_the_summary_the_cli_writes(tmp_path, capsys):
    from omrl_search.api import load_tasks
    from omrl_search.bench import bench

    tasks = load_tasks("game24", "test", 5)
    got = bench(tasks, "react,best_of_n:n=2", "lm_calls=3,9", policy="scripted:oracle:p=0.3",
                seed=1, progress=False)  # no out: nothing written
    assert list(got["strategies"]) == ["react", "best_of_n"]
    assert got["config"]["env"] == "game24" and got["config"]["split"] == "test"
    assert got["config"]["policy"] == "scripted:oracle:p=0.3" and got["config"]["budgets"] == [3, 9]
    out = tmp_path / "cli"
    assert main(["bench", "--env", "game24", "--limit", "5", "--strategies", "react,best_of_n:n=2",
                 "--budgets", "lm_calls=3,9", "--seed", "1", "--out", str(out), "--no-progress"]) == 0
    written = json.loads((out / "summary.json").read_text())
    drop = lambda s: {n: {b: {k: v for k, v in row.items() if k != "seconds"}  # noqa: E731
                          for b, row in per.items()} for n, per in s["strategies"].items()}
    assert drop(written) == drop(got) and written["config"] == got["config"]
    with pytest.raises(SpecError, match="unknown strategy 'zigzag'"):
        bench(tasks, ["react", "zigzag"], "tokens=100", policy="scripted:oracle", progress=False)


def test_bench_shows_prefill_and_cached_tokens(tmp_path):
    """A backend that serves prompt tokens from a prefix cache: summary.json and table.md give,
    per strategy and budget, the prompt tokens computed and those served from the cache."""
    from helpers import PartlyCached
    from omrl_search.bench import bench, per_task

    tasks = load_tasks("game24", "test", 4)
    summary = bench(tasks, "react,best_of_n:n=2", "lm_calls=4", policy=PartlyCached(0.3, divisor=3),
                    out=tmp_path / "b", progress=False)
    table = (tmp_path / "b" / "table.md").read_text()
    assert "| prefill | cached |" in table
    for name, per in summary["strategies"].items():
        row = per["lm_calls=4"]
        assert row["prefill_tokens"] + row["cached_tokens"] == row["prompt_tokens"]
        assert row["cached_tokens"] >= row["prompt_tokens"] // 3 - row["lm_calls"] > 0
        assert (f"| {per_task(row, 'tokens'):.0f} | {per_task(row, 'prefill_tokens'):.0f} | "
                f"{per_task(row, 'cached_tokens'):.0f} |") in table
    saved = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert saved["strategies"]["react"]["lm_calls=4"]["cached_tokens"] > 0
    from omrl_search.report import collect  # the report's rows carry the split per task too

    rows = {r["strategy"]: r for r in collect(tmp_path / "b")["evals"][0]["rows"]}
    react = summary["strategies"]["react"]["lm_calls=4"]
    assert rows["react"]["cached_tokens"] == pytest.approx(per_task(react, "cached_tokens"), abs=1e-3)
    assert rows["react"]["prefill_tokens"] == pytest.approx(per_task(react, "prefill_tokens"), abs=1e-3)
    old = {"tasks": 2, "prompt_tokens": 10, "completion_tokens": 4}  # a summary from before the split
    assert (per_task(old, "prefill_tokens"), per_task(old, "cached_tokens")) == (5, 0)
