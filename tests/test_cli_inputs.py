"""Bad CLI inputs (issue 39 item 4): each is one stderr line naming what was wrong, exit status 2,
no traceback, nothing created, and no model weights loaded first. Every case runs the ``omrl``
main() in this process and compares the folder it could write to before and after."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from omrl_search.cli import main


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _refused(argv: list[str], capsys, root: Path, *needles: str) -> str:
    """Run ``omrl argv``; assert exit 2, one stderr line holding every needle, no traceback, and
    nothing new under ``root``. Returns the line."""
    capsys.readouterr()
    before = _tree(root)
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert _tree(root) == before, "something was written"
    return err


@pytest.fixture(scope="module")
def results_file(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run") / "run"
    assert main(["search", "--env", "game24", "--limit", "3", "--strategy", "beam", "--seed", "0",
                 "--policy", "scripted:oracle:p=0.3", "--out", str(out), "--no-progress"]) == 0
    return out / "results.jsonl"


@pytest.fixture()
def binary(tmp_path) -> Path:
    """A file whose first line is blank (skipped by every reader) and whose second holds a byte
    that is not UTF-8."""
    p = tmp_path / "binary.jsonl"
    p.write_bytes(b'\n{"numbers": [1, 2, \xff 3]}\n')
    return p


def _unwritable() -> Path:
    """A folder nothing can be created in, even as root (/proc, /sys); skip where there is none."""
    for p in (Path("/proc"), Path("/sys")):
        try:
            (p / "omrl-probe").mkdir()
        except OSError:
            if p.is_dir():
                return p
            continue
        (p / "omrl-probe").rmdir()
    pytest.skip("no unwritable folder on this host")


# --- a byte that is not UTF-8: file:line ------------------------------------------------------------
@pytest.mark.parametrize("command", [
    ["search", "--env", "game24", "--no-progress", "--file"],
    ["export", "sft", "--out", "OUT"],
    ["export", "dpo", "--out", "OUT"],
    ["export", "openmanus", "--out", "OUT"],
    ["export", "sft", "--tokenizer", "/nonexistent/tokenizer", "--out", "OUT"],  # sources read first
])
def test_a_non_utf8_line_is_named_by_file_and_line(command, binary, tmp_path, capsys):
    argv = [str(tmp_path / "o" / "x.parquet") if a == "OUT" else a for a in command] + [str(binary)]
    err = _refused(argv, capsys, tmp_path, f"{binary}:2: not UTF-8 text", "0xff")
    assert "error: utf-8" not in err


@pytest.mark.parametrize("command", [
    ["search", "--env", "game24", "--no-progress", "--file"],
    ["export", "sft", "--out", "OUT"],
    ["label", "--out", "OUT"],
])
def test_a_binary_file_is_named_by_file_and_line(command, sft_file, tmp_path, capsys):
    """A parquet file given where JSONL is read: its first line decodes as UTF-8, so the NUL
    byte in it is what names it."""
    argv = [str(tmp_path / "o" / "x") if a == "OUT" else a for a in command] + [str(sft_file)]
    _refused(argv, capsys, tmp_path, f"{sft_file}:1: not text (a NUL byte at column")


@pytest.mark.parametrize("data,where", [
    (b"ok\n\xff", "f:2: not UTF-8 text (byte 0xff at column 1;"),
    (b"x\ny\nzz\xc3", "f:3: not UTF-8 text (byte 0xc3 at column 3;"),
    (b"a\x00\n\xff", "f:1: not text (a NUL byte at column 2;"),  # the first bad byte is named
    (b"\xe2\x82\xac\n\x00", "f:2: not text (a NUL byte at column 1;"),
])
def test_decode_utf8_names_the_line_and_column(data, where):
    from omrl_search.textfile import decode_utf8

    with pytest.raises(ValueError) as err:
        decode_utf8(data, "f")
    assert str(err.value).startswith(where)
    assert decode_utf8("€ ok\nline two".encode(), "f") == "€ ok\nline two"


# --- omrl export leaves no --out folder when it fails --------------------------------------------------
@pytest.mark.parametrize("source", ["missing", "empty", "binary", "no-rows"])
def test_export_creates_no_out_folder_when_it_fails(source, binary, results_file, tmp_path, capsys):
    src = {"missing": tmp_path / "missing.jsonl", "empty": tmp_path / "empty.jsonl", "binary": binary,
           "no-rows": results_file}[source]
    if source == "empty":
        src.write_text("")
    extra = ["--min-group", "999"] if source == "no-rows" else []  # a real file that yields no group
    kind = "grpo" if source == "no-rows" else "sft"
    out = tmp_path / "new" / "deeper" / "x.parquet"
    needle = {"missing": "no such file", "empty": "nothing written", "binary": ":2: not UTF-8",
              "no-rows": "nothing written"}[source]
    _refused(["export", kind, str(src), "--out", str(out), *extra], capsys, tmp_path, needle)
    assert not (tmp_path / "new").exists()


# --- numbers an export cannot use ----------------------------------------------------------------------
@pytest.mark.parametrize("options,needle", [
    (["dpo", "--pairs", "value", "--margin", "nan"], "--margin: must be a finite number >= 0, got 'nan'"),
    (["dpo", "--pairs", "value", "--margin", "inf"], "--margin: must be a finite number >= 0, got 'inf'"),
    (["dpo", "--pairs", "value", "--margin", "-1"], "--margin: must be a finite number >= 0, got '-1'"),
    (["sft", "--top-k", "-1"], "--top-k: must be an integer >= 1, got '-1'"),
    (["sft", "--top-k", "0"], "--top-k: must be an integer >= 1, got '0'"),
])
def test_export_refuses_numbers_it_cannot_use(options, needle, results_file, tmp_path, capsys):
    kind, *rest = options
    _refused(["export", kind, str(results_file), "--out", str(tmp_path / "x.parquet"), *rest],
             capsys, tmp_path, needle)


def test_the_python_export_functions_refuse_them_too(results_file):
    from omrl_search.exports import ExportError, dpo_rows, sft_rows
    from omrl_search.result import read_results

    results = list(read_results(results_file))
    for margin in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ExportError, match="margin must be a finite number >= 0"):
            dpo_rows(results, pairs="value", margin=margin)
    for k in (0, -1):
        with pytest.raises(ExportError, match="top_k must be an integer >= 1"):
            sft_rows(results, top_k=k)


def test_good_values_still_write(results_file, tmp_path, capsys):
    """The control: the same commands with usable values write their file (into a new folder)."""
    for kind, rest in (("dpo", ["--pairs", "value", "--margin", "0.25"]), ("sft", ["--top-k", "2"])):
        out = tmp_path / "new" / f"{kind}.parquet"
        assert main(["export", kind, str(results_file), "--out", str(out), *rest]) == 0, capsys.readouterr().err
        assert out.is_file()


# --- an --out that cannot be written: one line, before the command's work --------------------------------
COMMANDS = {
    "label": lambda run: ["label", str(run.parent), "--no-progress"],
    "loop": lambda run: ["loop", "--env", "game24", "--no-progress"],
    "train-sft": lambda run: ["train", "sft", "--data", "DATA", "--no-progress"],
    "train-prm": lambda run: ["train", "prm", "--data", str(run.parent), "--base", "smollm2"],
    "search": lambda run: ["search", "--env", "game24", "--limit", "1", "--no-progress"],
    "bench": lambda run: ["bench", "--env", "game24", "--limit", "1", "--budgets", "tokens=100",
                          "--strategies", "react", "--no-progress"],
    "export": lambda run: ["export", "sft", str(run)],
    "report": lambda run: ["report", str(run.parent)],
}


@pytest.mark.parametrize("where", ["proc", "under-a-file"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_an_unwritable_out_is_one_line_for_every_command(command, where, results_file, tmp_path, capsys):
    """Checked in omrl's main() before the command runs (so before any model or data)."""
    if where == "proc":
        out = _unwritable() / "x"
        needle = "is not writable"
    else:
        (tmp_path / "file").write_text("x")
        out = tmp_path / "file" / "x"
        needle = "is not a directory"
    argv = [str(results_file) if a == "DATA" else a for a in COMMANDS[command](results_file)]
    _refused([*argv, "--out", str(out)], capsys, tmp_path, f"--out {out}", needle)


# --- omrl train: data and out are checked before the weights load ------------------------------------
@pytest.fixture()
def no_weights(monkeypatch, tmp_path) -> str:
    """A --model that must not be loaded: every trainer's load_model fails the test, and the
    folder itself is no model (loading it would fail with another message)."""
    import train.cli  # noqa: F401 - every module that binds load_model, imported before the patch
    import train.dpo
    import train.grpo
    import train.ppo
    import train.prm  # noqa: F401
    import train.runtime
    import train.sft
    import train.trainers  # noqa: F401

    def no_model(*a, **k):
        raise AssertionError("the weights were loaded before the data and --out were checked")

    for mod in (train.sft, train.dpo, train.grpo, train.ppo, train.runtime):
        monkeypatch.setattr(mod, "load_model", no_model)
    fake = tmp_path / "not-a-model"
    fake.mkdir()
    (fake / "config.json").write_text("{}")
    return str(fake)


@pytest.fixture(scope="module")
def sft_file(results_file, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "sft.parquet"
    assert main(["export", "sft", str(results_file), "--out", str(out), "--include-failures"]) == 0
    return out


@pytest.mark.parametrize("case", ["out-proc", "out-in-yaml", "empty-data", "binary-data",
                                  "dpo-on-sft-rows", "grpo-on-sft-rows", "no-data"])
def test_train_checks_data_and_out_before_loading_weights(case, no_weights, sft_file, binary, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "o"
    kind, data, extra, needles = "sft", [str(sft_file)], [], []
    if case == "out-proc":
        out = _unwritable() / "x"
        needles = [f"--out {out} is not writable"]
    elif case == "out-in-yaml":
        cfg = tmp_path / "c.yaml"
        (tmp_path / "file").write_text("x")
        cfg.write_text(json.dumps({"out": str(tmp_path / "file" / "o")}))
        extra, out = ["--config", str(cfg)], None
        needles = [f"out {tmp_path / 'file' / 'o'} is not writable"]
    elif case == "empty-data":
        data, needles = [str(empty)], [f"{empty}: not a readable parquet file"]
    elif case == "binary-data":
        data, needles = [str(binary)], [f"{binary}: not a readable parquet file"]
    elif case == "no-data":
        data, needles = [], ["no data files given"]
    else:
        kind = case.split("-")[0]
        needles = [f"{sft_file}:1: missing column", "an `omrl export sft` file", f"{kind} trains on {kind} rows"]
    argv = ["train", kind, "--model", no_weights, "--no-progress", *extra]
    argv += ["--data", *data] if data else []
    argv += ["--out", str(out)] if out is not None else []
    before = _tree(tmp_path)
    _refused(argv, capsys, tmp_path, *needles)
    assert _tree(tmp_path) == before


# --- folders made on the way to --out are removed again when nothing is written ---------------------
@pytest.mark.parametrize("command", [
    ["search", "--env", "game24", "--limit", "1", "--no-progress"],
    ["bench", "--env", "game24", "--limit", "1", "--budgets", "tokens=100", "--strategies", "react",
     "--no-progress"],
])
def test_a_run_that_fails_before_writing_leaves_no_parent_folders(command, tmp_path, capsys):
    """The policy cannot load: search/bench fail after --out was opened, and the folders
    opening it made above it go again."""
    out = tmp_path / "new" / "deeper" / "run"
    _refused([*command, "--policy", "hf:/nonexistent/model", "--out", str(out)], capsys, tmp_path,
             "/nonexistent/model")
    assert not (tmp_path / "new").exists()


def test_label_files_leave_no_folder_when_writing_fails(tmp_path):
    from reward_models.label_files import LabelFileError, write_labels

    row = {"prompt": "solve", "completions": ["Act: x"], "labels": [True], "soft_labels": [1.0],
           "observations": ["ok"], "env": "game24", "task_id": "t", "split": "no/such"}
    with pytest.raises(LabelFileError, match="split name 'no/such'"):
        write_labels([row], tmp_path / "new" / "labels")
    assert _tree(tmp_path) == []
    assert write_labels([{**row, "split": "train"}], tmp_path / "new" / "labels")  # the control
    assert (tmp_path / "new" / "labels" / "train.parquet").is_file()


@pytest.mark.parametrize("how", ["set", "yaml"])
def test_loop_out_given_only_in_the_config_is_checked_too(how, tmp_path, capsys):
    """``out`` from ``--set`` or the YAML file (not the --out flag main() checks) is checked by
    the loop itself, before any work: one line, exit 2, nothing written."""
    out = _unwritable() / "x"
    if how == "set":
        argv = ["loop", "--env", "game24", "--policy", "scripted:oracle", "--set", f"out={out}"]
    else:
        cfg = tmp_path / "loop.yaml"
        cfg.write_text(f"env: game24\npolicy: scripted:oracle\nout: {out}\n")
        argv = ["loop", "--config", str(cfg)]
    _refused(argv, capsys, tmp_path, f"out {out}", "is not writable")
