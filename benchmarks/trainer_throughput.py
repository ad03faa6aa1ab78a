"""Our SFT, DPO and GRPO steps against TRL's on the same model, data and machine.

Workload: expert/oracle searches on Game24 (``scripted:oracle``) exported as SFT rows, step-level
DPO pairs and best-of-N GRPO groups, re-encoded with the model's tokenizer (the engine's prompts,
a few hundred tokens per sequence). Model: SmolLM2-135M-Instruct loaded with ``gguf_file=`` (the
bundled GGUF, dequantised to float32) unless ``--model`` names another HF folder.

Both sides train on the *same token ids and loss masks* in the same order (TRL's datasets are
given our pre-tokenized ids: SFT ``input_ids`` + ``completion_mask``; DPO ``prompt_ids`` /
``chosen_ids`` / ``rejected_ids`` with precomputed reference logps; TRL has no offline GRPO, so its
``GRPOTrainer._compute_loss`` is driven on our groups' prompt/completion split, advantages and
behaviour logprobs, with backward and AdamW as its trainer would). Same lr, batch, AdamW, no
warmup, grad clip 1.0, fp32. For each trainer and side: tokens per second over the timed steps
(after ``--warmup`` steps) and the per-step losses, printed side by side; the losses should agree
to float precision. The last line is one JSON object with every figure.

    python benchmarks/trainer_throughput.py                 # SmolLM2, 1 warm-up + 3 timed steps
    python benchmarks/trainer_throughput.py --model DIR --steps 2 --batch-size 2
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_data(tmp: Path, tokenizer: str, tasks: int) -> dict[str, Path]:
    import omrl_search as om
    from omrl_search.exports import export

    t = om.load_tasks("game24", "train", limit=tasks)
    res = om.search_many(t, strategy="best_of_n:n=4", policy="scripted:oracle:p=0.4", seed=0)
    om.write_results(tmp / "results.jsonl", res)
    return {k: export(k, [tmp / "results.jsonl"], tmp / f"{k}.parquet", tokenizer=tokenizer)[0]
            for k in ("sft", "dpo", "grpo")}


def ours(kind: str, cfg_kw: dict, steps: int, warmup: int) -> tuple[list[float], float, Any]:
    """Our trainer on fixed-order data: (losses, tokens/s over the timed steps, runner)."""
    from train import dpo, grpo, sft
    from train.runtime import ListSource

    mod, cls = {"sft": (sft, sft.SFTConfig), "dpo": (dpo, dpo.DPOConfig),
                "grpo": (grpo, grpo.GRPOConfig)}[kind]
    runner = mod.build(cls(**cfg_kw))
    src = runner.source
    runner.source = ListSource(src.examples, src.batch_size, shuffle=False)
    losses, toks, secs = [], 0, 0.0
    for i in range(warmup + steps):
        m = runner.train_step()
        losses.append(m["loss"])
        if i >= warmup:
            toks += m["tokens"]
            secs += m["seconds"]
    return losses, toks / secs, runner


def trl_args(cls, out: str, a: argparse.Namespace, **kw):
    return cls(output_dir=out, per_device_train_batch_size=a.batch_size, learning_rate=a.lr,
               lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
               logging_steps=1, save_strategy="no", report_to=[], max_steps=a.warmup + a.steps,
               train_sampling_strategy="sequential", use_cpu=True, bf16=False, seed=0,
               dataloader_num_workers=0, disable_tqdm=True, **kw)


class _Timer:
    """A TrainerCallback recording each step's wall time."""

    def __new__(cls):
        from transformers import TrainerCallback

        class T(TrainerCallback):
            def __init__(self):
                self.t, self.times = 0.0, []

            def on_step_begin(self, *a, **k):
                self.t = time.perf_counter()

            def on_step_end(self, *a, **k):
                self.times.append(time.perf_counter() - self.t)

        return T()


def trl_sft(model, tok, rows, a, out) -> tuple[list[float], float]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    ds = Dataset.from_list([{"input_ids": r.input_ids, "completion_mask": r.loss_mask} for r in rows])
    timer = _Timer()
    tr = SFTTrainer(model=model, processing_class=tok, train_dataset=ds, callbacks=[timer],
                    args=trl_args(SFTConfig, out, a, completion_only_loss=True, max_length=None,
                                  padding_free=False))
    tr.train()
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    ntok = [sum(len(r.input_ids) for r in rows[i * a.batch_size:(i + 1) * a.batch_size])
            for i in range(a.warmup + a.steps)]
    return losses, sum(ntok[a.warmup:]) / sum(timer.times[a.warmup:])


def trl_dpo(model, tok, pairs, a, out, beta) -> tuple[list[float], float]:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    def split(p):
        n = p.chosen.prefix_len
        return {"prompt_ids": p.chosen.input_ids[:n], "chosen_ids": p.chosen.input_ids[n:],
                "rejected_ids": p.rejected.input_ids[n:], "ref_chosen_logps": p.ref[0],
                "ref_rejected_logps": p.ref[1]}

    rows = [split(p) for p in pairs]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}],
                             "chosen": [{"role": "assistant", "content": "y"}],
                             "rejected": [{"role": "assistant", "content": "z"}]}] * len(rows))
    timer = _Timer()
    tr = DPOTrainer(model=model, processing_class=tok, train_dataset=ds, callbacks=[timer],
                    args=trl_args(DPOConfig, out, a, beta=beta, precompute_ref_log_probs=True,
                                  max_length=None))
    tr.train_dataset = Dataset.from_list(rows)  # our exact ids and reference logps
    tr.train()
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    ntok = [sum(len(p.chosen.input_ids) + len(p.rejected.input_ids)
                for p in pairs[i * a.batch_size:(i + 1) * a.batch_size]) for i in range(a.warmup + a.steps)]
    return losses, sum(ntok[a.warmup:]) / sum(timer.times[a.warmup:])


def trl_grpo(model, tok, rows, a, out, gcfg) -> tuple[list[float], float]:
    """TRL's GRPO loss on our groups, with backward, clipping and AdamW as its trainer does."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tr = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                     train_dataset=Dataset.from_list([{"prompt": "x"}] * 8),
                     args=trl_args(GRPOConfig, out, a, num_generations=2, max_completion_length=256,
                                   loss_type="bnpo", beta=gcfg.kl_coef, epsilon=gcfg.clip_low,
                                   epsilon_high=gcfg.clip_high))
    tr.current_gradient_accumulation_steps = 1  # set by Trainer.train(); we drive the steps
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    losses, times, toks = [], [], []
    for i in range(a.warmup + a.steps):
        batch = rows[i * a.batch_size:(i + 1) * a.batch_size]
        P = max(r.prefix_len for r in batch)
        C = max(len(r.input_ids) - r.prefix_len for r in batch)
        pad = tok.pad_token_id
        pid = torch.full((len(batch), P), pad)
        pm = torch.zeros(len(batch), P)
        cid = torch.full((len(batch), C), pad)
        cm = torch.zeros(len(batch), C)
        tm = torch.zeros(len(batch), C)
        old = torch.zeros(len(batch), C)
        for b, r in enumerate(batch):  # prompts left-padded, completions right-padded, as TRL does
            n, L = r.prefix_len, len(r.input_ids)
            pid[b, P - n:] = torch.tensor(r.input_ids[:n])
            pm[b, P - n:] = 1
            cid[b, :L - n] = torch.tensor(r.input_ids[n:])
            cm[b, :L - n] = 1
            tm[b, :L - n] = torch.tensor(r.loss_mask[n:], dtype=torch.float32)
            old[b, :L - n] = torch.tensor(r.logprobs[n:])
        inputs = {"prompt_ids": pid, "prompt_mask": pm, "completion_ids": cid, "completion_mask": cm,
                  "tool_mask": tm, "advantages": torch.tensor([r.advantage for r in batch]),
                  "old_per_token_logps": old if all(r.has_logprobs for r in batch) else None}
        t0 = time.perf_counter()
        model.train()
        loss = tr._compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        toks.append(sum(len(r.input_ids) for r in batch))
    return losses, sum(toks[a.warmup:]) / sum(times[a.warmup:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an HF folder (default: SmolLM2 via gguf_file=)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--only", default="sft,dpo,grpo")
    a = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.models import dequantized

    if a.model:
        model_spec, load = a.model, dict(pretrained_model_name_or_path=a.model)
    else:
        from omrl_search.backends.smollm2 import gguf_path

        model_spec = gguf_path()
        d, f = os.path.split(model_spec)
        load = dict(pretrained_model_name_or_path=d, gguf_file=f)
    tmp = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    data = make_data(tmp, model_spec, a.tasks)
    tok = AutoTokenizer.from_pretrained(**load)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    common = dict(model=model_spec, lr=a.lr, batch_size=a.batch_size, max_steps=a.warmup + a.steps,
                  progress=False, dtype="float32", seed=0, max_length=4096)
    figures: dict[str, dict] = {}
    for kind in a.only.split(","):
        kw = dict(common, data=[str(data[kind])], out=str(tmp / f"ours-{kind}"))
        if kind == "grpo":
            kw.update(clip_low=0.2, clip_high=0.28)
        o_losses, o_tps, runner = ours(kind, kw, a.steps, a.warmup)
        rows = runner.source.examples[:(a.warmup + a.steps) * a.batch_size]
        if len(rows) < (a.warmup + a.steps) * a.batch_size:
            sys.exit(f"{kind}: {len(rows)} rows cannot fill {a.warmup + a.steps} steps: raise --tasks")
        del runner
        torch.manual_seed(0)
        model = dequantized(AutoModelForCausalLM.from_pretrained(**load, dtype=torch.float32))
        out = str(tmp / f"trl-{kind}")
        if kind == "sft":
            t_losses, t_tps = trl_sft(model, tok, rows, a, out)
        elif kind == "dpo":
            t_losses, t_tps = trl_dpo(model, tok, rows, a, out, beta=0.1)
        else:
            from train.grpo import GRPOConfig

            t_losses, t_tps = trl_grpo(model, tok, rows, a, out, GRPOConfig(clip_low=0.2, clip_high=0.28))
        figures[kind] = {"ours_tokens_per_s": round(o_tps, 1), "trl_tokens_per_s": round(t_tps, 1),
                         "ours_losses": [round(x, 6) for x in o_losses],
                         "trl_losses": [round(x, 6) for x in t_losses],
                         "max_abs_loss_diff": max(abs(x - y) for x, y in zip(o_losses, t_losses))}
        del model
    import trl

    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"trl {trl.__version__}; model {model_spec}; batch {a.batch_size}; {a.steps} timed steps")
    print(f"{'trainer':8} {'ours tok/s':>11} {'TRL tok/s':>10} {'ratio':>6}  losses (ours | TRL)")
    for k, f in figures.items():
        ratio = f["ours_tokens_per_s"] / f["trl_tokens_per_s"]
        pairs = "  ".join(f"{x:.4f}|{y:.4f}" for x, y in zip(f["ours_losses"], f["trl_losses"]))
        print(f"{k:8} {f['ours_tokens_per_s']:>11.1f} {f['trl_tokens_per_s']:>10.1f} {ratio:>6.2f}  {pairs}")
    print(json.dumps({"model": model_spec, "batch_size": a.batch_size, "steps": a.steps,
                      "trl": trl.__version__, "results": figures}))


if __name__ == "__main__":
    main()
