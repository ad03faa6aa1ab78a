"""Our SFT, DPO and GRPO steps against TRL's on the same model, data and machine.

Workload: oracle searches on Game24 (``scripted:oracle:p=0.4``, best-of-4) exported as SFT rows,
step-level DPO pairs and best-of-N GRPO groups, encoded with the model's tokenizer (the engine's
prompts, a few hundred tokens per sequence). Model: the bundled SmolLM2-135M-Instruct (its HF
folder, converted once from the GGUF) unless ``--model`` names another HF folder.

Both sides train on the *same token ids and loss masks* in the same order (TRL's datasets are
given our pre-tokenized ids: SFT ``input_ids`` + ``completion_mask``; DPO ``prompt_ids`` /
``chosen_ids`` / ``rejected_ids`` with the same precomputed reference logps; TRL has no offline
GRPO, so its ``GRPOTrainer.compute_loss`` is driven on our groups' prompt/completion split,
advantages and behaviour logprobs, with backward, clipping and AdamW as its trainer would).
Same lr, batch, AdamW, no warmup, grad clip 1.0, the same dtype (fp32, or bf16 autocast over
fp32 weights) and the same gradient-checkpointing setting (``--gc``; TRL's default is on).

Fairness: every measurement is one side in a fresh process (``--worker``), sides alternate
(ours first in even repeats, TRL first in odd ones), ``--repeats`` times; the table shows the
min and median tokens/s of each side over the repeats (tokens = sequence tokens, not padding,
over the timed steps after ``--warmup``), also per CPU-second of the process (its user + system
time: steadier than wall time on a shared machine; workers run with ``OMP_WAIT_POLICY=PASSIVE``
unless it is set, so idle threads do not spin), the ratios of medians, each process's peak RSS, and
the per-step losses of the first repeat (they should agree to float precision).
``--baseline-train DIR`` adds a third side, ``before``: our trainers imported from ``DIR/train``
(e.g. a copy of an earlier commit's ``train/``), measured in the same alternation. The last
line is one JSON object with every figure.

    python benchmarks/trainer_throughput.py                          # fp32, SFT+DPO+GRPO, 3 repeats
    python benchmarks/trainer_throughput.py --dtype bfloat16 --only dpo --repeats 5
    python benchmarks/trainer_throughput.py --baseline-train /tmp/before   # before vs after vs TRL
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("sft", "dpo", "grpo")


# --- data (parent process) -------------------------------------------------------------------------
def make_data(tmp: Path, model: str, tasks: int, need: int) -> dict[str, str]:
    """The three exports; the DPO file cut to the ``need`` pairs the steps use (both sides'
    setup computes reference logps for every pair of the file, which the steps never read)."""
    import pyarrow.parquet as pq

    import omrl_search as om
    from omrl_search.exports import export

    t = om.load_tasks("game24", "train", limit=tasks)
    res = om.search_many(t, strategy="best_of_n:n=4", policy="scripted:oracle:p=0.4", seed=0)
    om.write_results(tmp / "results.jsonl", res)
    out = {k: str(export(k, [tmp / "results.jsonl"], tmp / f"{k}.parquet", tokenizer=model)[0])
           for k in KINDS}
    for k, path in out.items():
        table = pq.read_table(path)
        if table.num_rows < need:
            sys.exit(f"{k}: {table.num_rows} rows cannot fill the steps' {need}: raise --tasks")
        if k == "dpo":
            pq.write_table(table.slice(0, need), path)
    return out


def reference_logps(a: argparse.Namespace, data: str, tmp: Path) -> list[list[float]]:
    """The DPO pairs' reference sequence logps, as our trainer precomputes them (TRL is given
    the same numbers)."""
    from train import dpo

    runner = dpo.build(dpo.DPOConfig(**trainer_settings(a, "dpo", data, str(tmp / "ref"))))
    return [list(p.ref) for p in runner.source.examples]


def trainer_settings(a: argparse.Namespace, kind: str, data: str, out: str) -> dict[str, Any]:
    kw = dict(model=a.model, data=[data], out=out, lr=a.lr, batch_size=a.batch_size,
              max_steps=a.warmup + a.steps, progress=False, dtype=a.dtype, seed=0,
              max_length=4096, gradient_checkpointing=a.gc == "on")
    if kind == "grpo":
        kw.update(clip_low=0.2, clip_high=0.28)
    if kind == "dpo":  # plain sigmoid DPO, as TRL's default (ours adds the RPO NLL by default)
        kw.update(beta=0.1, rpo_alpha=0.0, loss="sigmoid")
    return kw


# --- workers (one side, one trainer, one process) -------------------------------------------------
def ours(a: argparse.Namespace) -> tuple[list[float], list[float], list[float], list[int]]:
    """Our trainer on the data in file order: (losses, step seconds, step CPU seconds, step
    tokens)."""
    from train import dpo, grpo, sft
    from train.runtime import ListSource

    mod, cls = {"sft": (sft, sft.SFTConfig), "dpo": (dpo, dpo.DPOConfig),
                "grpo": (grpo, grpo.GRPOConfig)}[a.kind]
    runner = mod.build(cls(**trainer_settings(a, a.kind, a.data, a.out)))
    src = runner.source
    runner.source = ListSource(src.examples, src.batch_size, shuffle=False)
    losses, secs, cpu, toks = [], [], [], []
    for _ in range(a.warmup + a.steps):
        c0 = time.process_time()
        m = runner.train_step()
        cpu.append(time.process_time() - c0)
        losses.append(m["loss"])
        secs.append(m["seconds"])
        toks.append(int(m["tokens"]))
    return losses, secs, cpu, toks


def trl_args(cls: Any, a: argparse.Namespace, **kw: Any) -> Any:
    return cls(output_dir=a.out, per_device_train_batch_size=a.batch_size, learning_rate=a.lr,
               lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
               logging_steps=1, save_strategy="no", report_to=[], max_steps=a.warmup + a.steps,
               train_sampling_strategy="sequential", use_cpu=True, bf16=a.dtype == "bfloat16",
               seed=0, dataloader_num_workers=0, disable_tqdm=True,
               gradient_checkpointing=a.gc == "on", **kw)


def _timer() -> Any:
    """A TrainerCallback recording each step's wall and CPU time."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.t, self.c, self.times, self.cpu = 0.0, 0.0, [], []

        def on_step_begin(self, *args: Any, **kw: Any) -> None:
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, *args: Any, **kw: Any) -> None:
            self.times.append(time.perf_counter() - self.t)
            self.cpu.append(time.process_time() - self.c)

    return Timer()


def trl(a: argparse.Namespace) -> tuple[list[float], list[float], list[float], list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train import dpo, grpo, sft
    from train.common import make_builder
    from train.data import load_dpo, load_sft

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    n = (a.warmup + a.steps) * a.batch_size
    cls = {"sft": sft.SFTConfig, "dpo": dpo.DPOConfig, "grpo": grpo.GRPOConfig}[a.kind]
    cfg = cls(**trainer_settings(a, a.kind, a.data, a.out))
    builder = make_builder(cfg, model, tok)
    if a.kind == "sft":
        rows = load_sft(cfg.data, builder)[:n]
        losses, secs, cpu = trl_sft(model, tok, rows, a)
        toks = [len(r.input_ids) for r in rows]
    elif a.kind == "dpo":
        pairs = load_dpo(cfg.data, builder)[:n]
        for p, ref in zip(pairs, json.loads(Path(a.refs).read_text())):
            p.ref = tuple(ref)
        losses, secs, cpu = trl_dpo(model, tok, pairs, a)
        toks = [len(p.chosen.input_ids) + len(p.rejected.input_ids) for p in pairs]
    else:
        rows = grpo.make_source(cfg, model, tok)[0].examples[:n]
        losses, secs, cpu = trl_grpo(model, tok, rows, a)
        toks = [len(r.input_ids) for r in rows]
    per_step = [sum(toks[i * a.batch_size:(i + 1) * a.batch_size]) for i in range(a.warmup + a.steps)]
    return losses, secs, cpu, per_step


Timings = tuple[list[float], list[float], list[float]]  # losses, step seconds, step CPU seconds


def trl_sft(model: Any, tok: Any, rows: list, a: argparse.Namespace) -> Timings:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    ds = Dataset.from_list([{"input_ids": r.input_ids, "completion_mask": r.loss_mask} for r in rows])
    timer = _timer()
    tr = SFTTrainer(model=model, processing_class=tok, train_dataset=ds, callbacks=[timer],
                    args=trl_args(SFTConfig, a, completion_only_loss=True, max_length=None,
                                  padding_free=False))
    tr.train()
    return [h["loss"] for h in tr.state.log_history if "loss" in h], timer.times, timer.cpu


def trl_dpo(model: Any, tok: Any, pairs: list, a: argparse.Namespace) -> Timings:
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    def split(p: Any) -> dict[str, Any]:
        n = p.chosen.prefix_len
        return {"prompt_ids": p.chosen.input_ids[:n], "chosen_ids": p.chosen.input_ids[n:],
                "rejected_ids": p.rejected.input_ids[n:], "ref_chosen_logps": p.ref[0],
                "ref_rejected_logps": p.ref[1]}

    rows = [split(p) for p in pairs]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}],
                             "chosen": [{"role": "assistant", "content": "y"}],
                             "rejected": [{"role": "assistant", "content": "z"}]}] * len(rows))
    timer = _timer()
    tr = DPOTrainer(model=model, processing_class=tok, train_dataset=ds, callbacks=[timer],
                    args=trl_args(DPOConfig, a, beta=0.1, precompute_ref_log_probs=True,
                                  max_length=None))
    tr.train_dataset = Dataset.from_list(rows)  # our exact ids and reference logps
    tr.train()
    return [h["loss"] for h in tr.state.log_history if "loss" in h], timer.times, timer.cpu


def trl_grpo(model: Any, tok: Any, rows: list, a: argparse.Namespace) -> Timings:
    """TRL's GRPO loss on our groups, with backward, clipping and AdamW as its trainer does."""
    import contextlib

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    tr = GRPOTrainer(model=model, processing_class=tok,
                     reward_funcs=[lambda completions, **k: [0.0] * len(completions)],
                     train_dataset=Dataset.from_list([{"prompt": "x"}] * 8),
                     args=trl_args(GRPOConfig, a, num_generations=2, max_completion_length=256,
                                   loss_type="bnpo", beta=0.0, epsilon=0.2, epsilon_high=0.28))
    tr.current_gradient_accumulation_steps = 1  # set by Trainer.train(); we drive the steps
    if a.gc == "on" and not model.is_gradient_checkpointing:  # Trainer.train() would enable it
        model.gradient_checkpointing_enable()
    # the HF Trainer's default optimizer (adamw_torch_fused), as on the other two TRL sides
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, fused=True)
    cast = (torch.autocast("cpu", dtype=torch.bfloat16) if a.dtype == "bfloat16"
            else contextlib.nullcontext())
    losses, times, cpu = [], [], []
    pad = tok.pad_token_id
    for i in range(a.warmup + a.steps):
        batch = rows[i * a.batch_size:(i + 1) * a.batch_size]
        t0, c0 = time.perf_counter(), time.process_time()
        P = max(r.prefix_len for r in batch)
        C = max(len(r.input_ids) - r.prefix_len for r in batch)
        pid, pm = torch.full((len(batch), P), pad), torch.zeros(len(batch), P)
        cid, cm = torch.full((len(batch), C), pad), torch.zeros(len(batch), C)
        tm, old = torch.zeros(len(batch), C), torch.zeros(len(batch), C)
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
        model.train()
        with cast:
            loss = tr.compute_loss(model, inputs)  # the Trainer hook its training_step calls
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(float(loss))
    return losses, times, cpu


def worker(a: argparse.Namespace) -> None:
    losses, secs, cpu, toks = (ours if a.worker in ("ours", "before") else trl)(a)
    timed = slice(a.warmup, None)
    print(json.dumps({"losses": losses, "tokens_per_s": sum(toks[timed]) / sum(secs[timed]),
                      "tokens_per_cpu_s": sum(toks[timed]) / sum(cpu[timed]),
                      "step_seconds": secs, "step_cpu_seconds": cpu,
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


# --- the parent: data once, then alternating worker processes --------------------------------------
def run_worker(side: str, kind: str, a: argparse.Namespace, data: dict[str, str], tmp: Path,
               refs: str | None, baseline: str | None) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", side, "--kind", kind, "--data", data[kind],
           "--out", str(tmp / f"{side}-{kind}"), "--model", a.model, "--dtype", a.dtype,
           "--gc", a.gc, "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--batch-size", str(a.batch_size), "--lr", str(a.lr)]
    if refs:
        cmd += ["--refs", refs]
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle threads sleep: CPU time is work done
    if side == "before" and baseline:  # DIR/train imported before the installed one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [baseline, env.get("PYTHONPATH")]))
    load0 = os.getloadavg()[0]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"{side} {kind} worker failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["load"] = [round(load0, 1), round(os.getloadavg()[0], 1)]  # 1-min load before, after
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an HF folder (default: the bundled SmolLM2)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--gc", default="off", choices=["on", "off"], help="gradient checkpointing, both sides")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--only", default=",".join(KINDS))
    p.add_argument("--baseline-train", default=None,
                   help="a folder holding another version of train/: measured as side 'before'")
    # worker-only arguments
    p.add_argument("--worker", choices=["ours", "trl", "before"], help=argparse.SUPPRESS)
    p.add_argument("--kind", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--refs", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if a.model is None:
        from omrl_search.backends.smollm2 import hf_folder

        a.model = hf_folder()
    kinds = [k for k in a.only.split(",") if k]
    if any(k not in KINDS for k in kinds):
        sys.exit(f"--only: each of {', '.join(KINDS)}")
    sides = ["ours", "trl"] + (["before"] if a.baseline_train else [])
    tmp = Path(tempfile.mkdtemp(prefix="trainer-bench-"))
    data = make_data(tmp, a.model, a.tasks, (a.warmup + a.steps) * a.batch_size)
    refs = None
    if "dpo" in kinds:
        refs = str(tmp / "refs.json")
        Path(refs).write_text(json.dumps(reference_logps(a, data["dpo"], tmp)))
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {k: {s: [] for s in sides} for k in kinds}
    for rep in range(a.repeats):
        order = sides if rep % 2 == 0 else sides[::-1]
        for kind in kinds:
            for side in order:
                runs[kind][side].append(run_worker(side, kind, a, data, tmp, refs, a.baseline_train))
                print(f"  repeat {rep + 1} {kind:4} {side:6} "
                      f"{runs[kind][side][-1]['tokens_per_s']:8.1f} tok/s "
                      f"{runs[kind][side][-1]['tokens_per_cpu_s']:8.1f} tok/CPU-s",
                      file=sys.stderr, flush=True)
    import torch
    import trl as trl_pkg

    figures: dict[str, Any] = {}
    for kind in kinds:
        f: dict[str, Any] = {}
        for side in sides:
            f[side] = {"peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs[kind][side])),
                       "losses": [round(x, 6) for x in runs[kind][side][0]["losses"]]}
            for key in ("tokens_per_s", "tokens_per_cpu_s"):
                xs = [r[key] for r in runs[kind][side]]
                f[side][key] = {"all": [round(x, 1) for x in xs], "min": round(min(xs), 1),
                                "median": round(statistics.median(xs), 1)}
        for key in ("tokens_per_s", "tokens_per_cpu_s"):
            f[f"ratio_{key}"] = round(f["ours"][key]["median"] / f["trl"][key]["median"], 3)
            if "before" in f:
                f[f"speedup_{key}_vs_before"] = round(f["ours"][key]["median"] / f["before"][key]["median"], 3)
        f["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(f["ours"]["losses"], f["trl"]["losses"]))
        if "before" in f:
            f["max_abs_loss_diff_before"] = max(abs(x - y) for x, y in
                                                zip(f["ours"]["losses"], f["before"]["losses"]))
        figures[kind] = f
    load = os.getloadavg()
    print(f"machine: {platform.machine()} {os.cpu_count()} cpus, load {load[0]:.1f}, torch "
          f"{torch.__version__}, trl {trl_pkg.__version__}; model {a.model}; {a.dtype}; gradient "
          f"checkpointing {a.gc}; batch {a.batch_size}; {a.steps} timed steps; {a.repeats} repeats")
    print(f"{'trainer':8} {'side':7} {'tok/s min':>10} {'median':>7} {'tok/CPU-s min':>14} {'median':>7} "
          f"{'peak RSS MB':>12}  losses (first repeat)")
    for kind, f in figures.items():
        for side in sides:
            w, c = f[side]["tokens_per_s"], f[side]["tokens_per_cpu_s"]
            print(f"{kind:8} {side:7} {w['min']:>10.1f} {w['median']:>7.1f} {c['min']:>14.1f} "
                  f"{c['median']:>7.1f} {f[side]['peak_rss_mb']:>12}  "
                  + " ".join(f"{x:.4f}" for x in f[side]["losses"]))
        extra = (f"; ours/before x{f['speedup_tokens_per_s_vs_before']:.2f} wall, "
                 f"x{f['speedup_tokens_per_cpu_s_vs_before']:.2f} CPU" if "before" in f else "")
        print(f"{kind:8} ours/TRL (medians) x{f['ratio_tokens_per_s']:.2f} wall, "
              f"x{f['ratio_tokens_per_cpu_s']:.2f} CPU{extra}; max |loss diff| vs TRL "
              f"{f['max_abs_loss_diff']:.2e}")
    print(json.dumps({"model": a.model, "dtype": a.dtype, "gradient_checkpointing": a.gc,
                      "batch_size": a.batch_size, "steps": a.steps, "warmup": a.warmup,
                      "repeats": a.repeats, "load_avg": [round(x, 2) for x in load],
                      "trl": trl_pkg.__version__, "torch": torch.__version__, "results": figures}))


if __name__ == "__main__":
    main()
