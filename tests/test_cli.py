"""The omrl command: outputs, summary fields, and one-line errors that write nothing."""
from __future__ import annotations

import json

import pytest

from omrl_search.api import SUMMARY_FIELDS, load_tasks
from omrl_search.cli import main
from omrl_search.stats import fmt_paired, fmt_rate, mcnemar, wilson


def test_search_writes_results_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    rc = main(["search", "--env", "game24", "--split", "test", "--limit", "6",
               "--strategy", "react", "--strategy", "best_of_n:n=4",
               "--policy", "scripted:oracle:p=0.3", "--budget", "tokens=20000",
               "--seed", "0", "--out", str(out), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["react", "best_of_n"]
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and lines[0]["tree"]["nodes"]
    solved = {name: {r["task"]["task_id"]: r["success"] for r in lines if r["strategy"].split(":")[0] == name}
              for name in summary}
    for name, row in summary.items():
        assert set(SUMMARY_FIELDS) <= set(row) and row["tasks"] == 6
        assert row["successes"] == sum(solved[name].values())
        assert (row["ci_low"], row["ci_high"]) == pytest.approx(wilson(row["successes"], 6), abs=1e-4)
        assert row["ci_low"] <= row["success_rate"] <= row["ci_high"]
    # the second strategy against the first on the same tasks: exact McNemar
    assert "paired" not in summary["react"]
    assert summary["best_of_n"]["paired"] == {"vs": "react", **mcnemar(solved["react"], solved["best_of_n"])}
    # results.jsonl in task order per strategy (they are appended as tasks finish)
    ids = [t.task_id for t in load_tasks("game24", "test", 6)]
    assert [r["task"]["task_id"] for r in lines] == ids + ids
    table = capsys.readouterr().out
    assert "success [95% CI]" in table and "vs react (McNemar)" in table
    assert fmt_rate(summary["best_of_n"]) in table and fmt_paired(summary["best_of_n"]["paired"]) in table
    assert not [p for p in tmp_path.iterdir() if p.name != "run"]  # no temporary sibling left


@pytest.mark.parametrize("args,needle", [
    (["--env", "nope"], "unknown env 'nope'"),
    (["--env", "game24", "--strategy", "zigzag"], "unknown strategy 'zigzag'"),
    (["--env", "game24", "--strategy", "best_of_n:m=2"], "has no parameter m"),
    (["--env", "game24", "--policy", "gpt9"], "unknown policy 'gpt9'"),
    (["--env", "game24", "--policy", "scripted:oracle:p=2"], "p=2"),
    (["--env", "game24", "--budget", "tokens=-5"], "tokens=-5"),
    (["--env", "game24", "--budget", "joules=5"], "unknown budget kind 'joules'"),
    (["--env", "game24", "--limit", "0"], "--limit"),
    (["--env", "game24", "--strategy", "beam:width=abc"], "strategy 'beam': width must be an int, got 'abc'"),
    (["--env", "game24", "--strategy", "mcts:c_puct=fast"], "c_puct must be a finite number, got 'fast'"),
    (["--env", "game24", "--strategy", "mcts:reflect=2"], "reflect must be a bool (true/false), got '2'"),
    (["--env", "game24", "--budget", "tokens=nan"], "tokens=nan must be a finite positive number"),
    (["--env", "game24", "--budget", "tokens=inf"], "tokens=inf must be a finite positive number"),
    (["--env", "game24", "--budget", "seconds=1e999"], "seconds=inf must be a finite"),
    (["--env", "game24", "--policy", "hf:/nonexistent/model"], "/nonexistent/model"),
    (["--env", "game24", "--concurrency", "-3"], "--concurrency: must be an integer >= 1, got '-3'"),
    (["--env", "game24", "--max-tokens", "0"], "--max-tokens: must be an integer >= 1"),
    (["--env", "game24", "--max-depth", "0"], "--max-depth: must be an integer >= 1"),
    (["--env", "game24", "--temperature", "nan"], "--temperature: must be a finite number >= 0"),
    (["--env", "game24", "--limit", "many"], "--limit: must be an integer >= 1, got 'many'"),
    (["--env", "game24", "--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_one_line_no_output(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    rc = main(["search", *args, "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_python_api_refuses_what_the_cli_refuses():
    import omrl_search as om
    from omrl_search.specs import SpecError

    tasks = load_tasks("game24", "test", 2)
    for kwargs, needle in [({"budget": "tokens=nan"}, "tokens=nan"), ({"budget": {"tokens": float("inf")}}, "tokens=inf"),
                           ({"strategy": "beam:width=abc"}, "width must be an int"),
                           ({"concurrency": -3}, "concurrency must be >= 1")]:
        with pytest.raises(SpecError, match=needle):
            om.search_many(tasks, policy="scripted:oracle", **kwargs)


def test_bad_task_file_reports_file_and_line(tmp_path, capsys):
    f = tmp_path / "tasks.jsonl"
    f.write_text('{"numbers": [4, 6, 1, 1]}\n{"numbers": [4, 6]}\n')
    rc = main(["search", "--env", "game24", "--file", str(f), "--out", str(tmp_path / "o"),
               "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"{f}:2: " in err and not (tmp_path / "o").exists()


def test_commands_share_their_options_and_unknown_ones_list_every_command(capsys):
    from omrl_search.types import DEFAULT_MAX_TOKENS

    for command in ("search", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        assert f"default {DEFAULT_MAX_TOKENS}" in text and "--ray-address" in text and "--env" in text
    assert main(["serch", "--env", "game24"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "invalid choice: 'serch'" in err
    assert all(name in err for name in ("search", "bench", "train", "loop", "envs"))


def test_env_server_with_an_unknown_scheme_is_one_line(capsys):
    assert main(["search", "--env", "game24", "--env-server", "localhost:8000", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bad env server 'localhost:8000'" in err and "http://" in err


def test_constrain_setting_is_checked_and_recorded(tmp_path, capsys):
    """``--constrain`` is one of its modes (else one line, exit 2) and the summary records what
    was asked and what was in force (scripted policies cannot constrain: recorded, not silent)."""
    assert main(["search", "--env", "game24", "--limit", "1", "--constrain", "bogus", "--no-progress"]) == 2
    assert "--constrain" in capsys.readouterr().err
    out = tmp_path / "c"
    assert main(["search", "--env", "game24", "--limit", "2", "--policy", "scripted:oracle:p=0",
                 "--constrain", "auto", "--out", str(out), "--no-progress"]) == 0
    c = json.loads((out / "summary.json").read_text())["react"]["constraint"]
    assert c["asked"] == "auto" and c["modes"] == {"none": 2}
    assert any("cannot generate under a grammar" in note for note in c["notes"])
    # an explicit constraint the policy cannot honour is an error before any search runs
    assert main(["search", "--env", "game24", "--limit", "1", "--policy", "scripted:oracle:p=0",
                 "--constrain", "actions", "--no-progress"]) == 2
    assert "constrain=actions" in capsys.readouterr().err
