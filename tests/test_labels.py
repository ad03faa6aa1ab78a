"""Step labels from search trees (``omrl label``) and label-file validation."""
from __future__ import annotations

from fractions import Fraction

import pytest

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

import omrl_search as om  # noqa: E402
from envs.arith import solvable  # noqa: E402
from omrl_search.cli import main  # noqa: E402
from omrl_search.env import make_env  # noqa: E402
from omrl_search.exports import prm_rows, prompt_messages  # noqa: E402
from reward_models.label_files import LabelFileError, read_labels, write_labels  # noqa: E402
from reward_models.labels import label_results  # noqa: E402


def _numbers_left(observation: str) -> list[Fraction]:
    board = observation.rsplit("Numbers left:", 1)[1].split("|")[0]
    return [Fraction(x) for x in board.split()]


@pytest.fixture(scope="module")
def mcts_results():
    tasks = om.load_tasks("game24", "train", limit=6)
    return om.search_many(tasks, strategy="mcts:simulations=8,value=rollout,k=2",
                          policy="scripted:oracle:p=0.6", seed=3)


def test_fresh_rollouts_of_an_exact_oracle_measure_solvability(mcts_results):
    """With fresh rollouts only, by an oracle that never errs, a step's MC value is exactly
    whether its state can still make 24."""
    rows = label_results(mcts_results, policy="scripted:oracle:p=0", rollouts=2, tree_leaves=False)
    checked = 0
    for row in rows:
        for i, (obs, mc, n) in enumerate(zip(row["observations"], row["mc_values"], row["mc_rollouts"])):
            last = i == len(row["completions"]) - 1
            if last and row["terminal"]:
                assert n == 1 and mc == float(row["success"])
                continue
            assert n == 2
            nums = _numbers_left(obs)
            assert mc == float(solvable(nums, 24)), (row["completions"][:i + 1], obs)
            checked += 1
    assert checked > 20
    assert {0.0, 1.0} <= {v for r in rows for v in r["mc_values"]}


def test_tree_leaves_count_as_rollouts_and_q_values_come_from_visits(mcts_results):
    rows = label_results(mcts_results, policy="scripted:oracle:p=0.6", rollouts=3)
    by_task = {r.task.task_id: r for r in mcts_results}
    with_q = 0
    for row in rows:
        tree = by_task[row["task_id"]].tree
        node = tree.root
        for i, comp in enumerate(row["completions"]):
            node = next(tree.nodes[c] for c in node.children
                        if tree.nodes[c].step.completion == comp and
                        tree.nodes[c].step.observation == row["observations"][i])
            assert row["mc_rollouts"][i] >= (1 if node.terminal else 3)
            if node.visits:
                assert row["q_values"][i] == pytest.approx(node.value_sum / node.visits)
                with_q += 1
            else:
                assert row["q_values"][i] is None
        assert row["soft_labels"] == row["mc_values"]
        assert row["labels"] == [v >= 0.5 for v in row["mc_values"]]
    assert with_q > 0


def test_soft_q_and_mean_and_determinism(mcts_results):
    a = label_results(mcts_results, policy="scripted:oracle:p=0.6", rollouts=2, soft="q", seed=1)
    b = label_results(mcts_results, policy="scripted:oracle:p=0.6", rollouts=2, soft="q", seed=1)
    assert a == b
    proven = 0
    for row in a:
        for i, (soft, q, mc) in enumerate(zip(row["soft_labels"], row["q_values"], row["mc_values"])):
            last = i == len(row["completions"]) - 1
            if last and row["terminal"]:
                assert soft == float(row["success"])  # a finished step is proven
            elif soft == 1.0 and q is not None and q != 1.0:
                proven += 1  # a solved leaf below: a proven win above its mean return
            else:
                assert soft == pytest.approx(q if q is not None else mc)  # no visits: MC
    assert proven > 0
    m = label_results(mcts_results, policy="scripted:oracle:p=0.6", rollouts=2, soft="mean", seed=1)
    row = next(r for r in m if r["q_values"][0] is not None)
    assert row["soft_labels"][0] == pytest.approx((row["q_values"][0] + row["mc_values"][0]) / 2)


def test_without_a_policy_rows_stop_at_the_first_unlabelled_step():
    tasks = om.load_tasks("game24", "train", limit=3)
    res = om.search_many(tasks, strategy="beam:width=2,k=2", policy="scripted:oracle:p=0.5")
    rows = label_results(res, policy=None, rollouts=4)
    assert rows
    for row in rows:
        assert all(n >= 1 for n in row["mc_rollouts"])
        assert len(row["completions"]) == len(row["soft_labels"]) == len(row["segments"]) // 2


def test_rows_keep_trl_columns_and_exact_segments(tmp_path, mcts_results):
    rows = label_results(mcts_results[:2], policy="scripted:oracle:p=0.6", rollouts=2)
    files = write_labels(rows, tmp_path)
    assert set(files) == {"train"}
    table = pq.read_table(files["train"])
    assert {"prompt", "completions", "labels", "soft_labels", "segments", "env", "task_id",
            "split"} <= set(table.column_names)
    assert table.schema.field("labels").type == pa.list_(pa.bool_())
    back = read_labels(files["train"])
    res = {r.task.task_id: r for r in mcts_results}[back[0]["task_id"]]
    # the prompt is the engine's: system prompt, task, action help, example, first observation
    assert back[0]["prompt"] == prompt_messages(res.task, res.tree.root.observation)
    system, user = back[0]["prompt"]
    assert system["role"] == "system" and "Act:" in system["content"]
    assert user["content"].startswith("Task: Use the numbers") and make_env("game24").action_help in user["content"]
    first = res.tree.nodes[res.tree.root.children[0]].step
    assert back[0]["segments"][0]["token_ids"] == first.context_ids  # the exact prompt ids
    assert back[0]["segments"][0]["trainable"] is False and back[0]["segments"][1]["trainable"] is True


def test_export_prm_is_omrl_label_without_fresh_rollouts(tmp_path, mcts_results, capsys):
    """``omrl export prm`` and ``omrl label`` build rows with one function: without a policy
    they are the same rows, in one file that validates as a label file."""
    results = tmp_path / "results.jsonl"
    om.write_results(results, mcts_results)
    rows = label_results(mcts_results, policy=None, rollouts=4, soft="mean", threshold=0.6)
    assert rows == prm_rows(mcts_results, soft="mean", threshold=0.6)
    out = tmp_path / "prm.parquet"
    assert main(["export", "prm", str(results), "--out", str(out), "--soft", "mean", "--threshold", "0.6"]) == 0
    assert f"wrote {len(rows)} prm rows" in capsys.readouterr().out
    back = read_labels(out)
    assert [r["soft_labels"] for r in back] == [r["soft_labels"] for r in rows]
    assert [r["prompt"] for r in back] == [r["prompt"] for r in rows]
    assert main(["label", "--check", str(out)]) == 0


def test_older_label_files_with_a_string_prompt_still_read(tmp_path):
    path = _write(tmp_path / "old.parquet", [{}])
    row = read_labels(path)[0]
    from reward_models.inputs import episode_from_row, first_messages

    assert first_messages(episode_from_row(row)) == [{"role": "user", "content": "Task: x"}]


# --- the command ----------------------------------------------------------------------------------
def test_label_command_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["search", "--env", "game24", "--split", "test", "--limit", "3", "--policy",
                 "scripted:oracle:p=0.5", "--strategy", "beam:width=2,k=2", "--out", str(run),
                 "--no-progress"]) == 0
    out = tmp_path / "labels"
    assert main(["label", str(run), "--out", str(out), "--policy", "scripted:oracle:p=0.5",
                 "--rollouts", "2", "--no-progress"]) == 0
    assert (out / "test.parquet").is_file() and (out / "meta.json").is_file()
    assert "test:" in capsys.readouterr().out
    assert main(["label", "--check", str(out / "test.parquet")]) == 0
    assert "ok" in capsys.readouterr().out


def test_label_command_bad_input_writes_nothing(tmp_path, capsys):
    out = tmp_path / "labels"
    assert main(["label", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
    assert "no such results file" in capsys.readouterr().err
    assert not out.exists()


def _write(path, rows, drop=()):
    good = {"prompt": "Task: x", "completions": ["Act: a", "Act: b"], "labels": [True, False],
            "soft_labels": [0.75, 0.25], "observations": ["o1", "o2"], "env": "game24",
            "task_id": "t", "split": "train"}
    table = pa.Table.from_pylist([{**good, **r} for r in rows])
    if drop:
        table = table.drop_columns(list(drop))
    pq.write_table(table, path)
    return str(path)


@pytest.mark.parametrize("rows, drop, reason", [
    ([{}, {}], ("soft_labels",), ":1: missing column(s) soft_labels"),
    ([{"prompt": ""}], (), ":1: prompt must not be empty"),
    ([{}, {"soft_labels": [0.5, 1.5]}], (), ":2: soft label 1.5 of step 2 is outside [0, 1]"),
    ([{"soft_labels": [-0.1, 0.0]}], (), ":1: soft label -0.1 of step 1 is outside [0, 1]"),
    ([{}, {}, {"completions": ["Act: a", "  "]}], (), ":3: step 2 is empty"),
    ([{"completions": [], "labels": [], "soft_labels": [], "observations": []}], (),
     ":1: no steps (completions is empty)"),
    ([{"labels": [True]}], (), ":1: labels has 1 entries for 2 steps"),
])
def test_bad_label_files_fail_with_file_row_reason(tmp_path, capsys, rows, drop, reason):
    path = _write(tmp_path / "bad.parquet", rows, drop)
    with pytest.raises(LabelFileError) as err:
        read_labels(path)
    assert str(err.value) == path + reason
    assert main(["label", "--check", path]) == 2
    assert capsys.readouterr().err.strip() == f"omrl: error: {path}{reason}"


def test_unreadable_label_file(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_text("not parquet")
    with pytest.raises(LabelFileError, match=r"x\.parquet:0: cannot read parquet"):
        read_labels(path)


def test_replay_that_diverges_from_the_recorded_tree_is_an_error():
    tasks = om.load_tasks("game24", "train", limit=1)
    res = om.search_many(tasks, strategy="best_of_n:n=2", policy="scripted:oracle:p=0.5")
    node = next(n for n in res[0].tree.nodes if n.parent is not None and not n.terminal)
    node.state_key = "not-the-recorded-state"
    with pytest.raises(ValueError, match="diverged from the recorded tree"):
        label_results(res, policy="scripted:oracle:p=0.5", rollouts=50)


def test_label_reads_a_bench_folders_saved_trees(tmp_path, capsys):
    """``omrl label BENCH_DIR``: a bench run with ``--save-trees`` has no results.jsonl; its
    trees/*.jsonl (one file per strategy and budget) are what is labelled."""
    run = tmp_path / "bench"
    assert main(["bench", "--env", "game24", "--split", "test", "--limit", "2", "--policy",
                 "scripted:oracle:p=0.5", "--strategies", "react,beam:width=2,k=2", "--budgets",
                 "tokens=3000", "--out", str(run), "--no-progress", "--save-trees"]) == 0
    assert len(list((run / "trees").glob("*.jsonl"))) == 2 and not (run / "results.jsonl").exists()
    out = tmp_path / "labels"
    assert main(["label", str(run), "--out", str(out), "--rollouts", "0", "--no-progress"]) == 0
    from reward_models.label_files import load_label_dir

    rows = load_label_dir(str(out))
    assert {r["strategy"].split(":")[0] for r in rows} == {"react", "beam"}
