"""Every measurement says what it ran on: CPU, native bf16 or not, and the policy's dtype."""
from __future__ import annotations

import json

import pytest

from omrl_search import host
from omrl_search.policy import make_policy


def test_bf16_native_reads_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert host.bf16_native() is False
    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert host.bf16_native() is True
    monkeypatch.setattr(host, "cpu_flags", lambda: frozenset({"amx_bf16", "amx_tile"}))
    assert host.bf16_native() is True


def test_this_hosts_flags_agree_with_proc_cpuinfo():
    text = open("/proc/cpuinfo").read() if __import__("os").path.exists("/proc/cpuinfo") else ""
    want = any(f" {flag}" in text for flag in host.BF16_FLAGS)
    assert host.host_info()["bf16_native"] is want


def test_policy_dtype_names_what_the_model_computes_in(tiny_hf_model):
    assert host.policy_dtype(make_policy("scripted:oracle")) is None
    assert host.policy_dtype(make_policy(f"hf:{tiny_hf_model}:dtype=float32")) == "float32"
    assert host.policy_dtype(make_policy(f"hf:{tiny_hf_model}:dtype=bfloat16")) == "bfloat16"


def test_describe_is_one_line_with_the_dtype():
    line = host.describe({"cpu": "X", "cores": 2, "bf16_native": False}, "float32")
    assert line == "host: X (2 cores, bf16 emulated), dtype: float32"


def test_bench_summary_and_table_record_host_and_dtype(tmp_path, tiny_hf_model):
    pytest.importorskip("matplotlib")
    from omrl_search.api import load_tasks
    from omrl_search.bench import bench

    out = tmp_path / "b"
    summary = bench(load_tasks("game24", "test", limit=2), "react", "tokens=200",
                    policy=f"hf:{tiny_hf_model}:dtype=float32", max_tokens=4, out=str(out),
                    progress=False)
    saved = json.loads((out / "summary.json").read_text())
    assert saved["config"]["dtype"] == "float32" == summary["config"]["dtype"]
    assert saved["config"]["host"] == host.host_info()
    assert "dtype: float32" in (out / "table.md").read_text()


def test_search_summary_rows_record_host_and_dtype(tmp_path, tiny_hf_model):
    from omrl_search.cli import main

    out = tmp_path / "s"
    assert main(["search", "--env", "game24", "--limit", "1", "--policy",
                 f"hf:{tiny_hf_model}:dtype=float32", "--max-tokens", "4", "--budget", "tokens=100",
                 "--no-progress", "--out", str(out)]) == 0
    row = json.loads((out / "summary.json").read_text())["react"]
    assert row["dtype"] == "float32" and row["host"] == host.host_info()
