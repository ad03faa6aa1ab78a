"""What structured decoding costs and buys, per backend, on the bundled SmolLM2-135M-Instruct.

Workload: the first step of Game24 test tasks as the engine builds it (ReAct messages of the
task, rendered with the policy's chat template), ``--batch`` prompts per ``generate`` call
(default 8, n=1), temperature 0.7, ``DEFAULT_MAX_TOKENS`` completion tokens, seeded. Each call
runs under three constraints (see omrl_search/constrain.py):

* ``none``: no grammar;
* ``format``: the Think/Act frame with any one-line action;
* ``actions``: the frame with the env's action language at that state (``action_grammar()``:
  ``a op b`` over the numbers left, or ``answer EXPR``).

Backends: ``hf`` (transformers, float32 on CPU; ``--dtype``), ``llamacpp`` (llama.cpp on the
GGUF, masks from xgrammar) and ``llamacpp-gbnf`` (llama.cpp's own GBNF grammar sampler).
Conditions run interleaved ``--reps`` times after one warm-up round (which compiles the
grammars); per cell the best repetition counts. Figures per cell:

* ``tok/s``: generated tokens per wall second of the whole call; ``tok/CPU-s``: per CPU second
  of the process (the figure that holds on a shared, busy machine); ``decode``: per CPU second
  of the decode loop alone (the call less the backend's ``prefill_chunk``: the prompts are evaluated
  afresh every call, which is most of llama.cpp's time here); the best repetition by it counts;
* ``mask%``: the share of the decode loop's CPU time spent computing and applying the grammar
  mask (the backend's ``mask_logits``, timed): the mask's own cost, which a change in completion
  length (a constrained row ends right after its action, thinning the batch) does not blur;
* ``valid``: the fraction of completions that parse (``Think:``/``Act:``) to an action the env
  accepts (``valid`` after stepping it), over every task and repetition;
* ``ok``: the fraction the backend stamped ``constraint_check == "ok"``; ``compile_s``: seconds
  spent compiling grammars in the warm-up (once per grammar text and tokenizer).

Run: ``python benchmarks/constrained_decoding.py [--backends hf,llamacpp,llamacpp-gbnf]
[--reps 2] [--batch 8] [--tasks 16] [--threads N]``. Prints a table, then as its last line one JSON
object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch / llama_cpp load libgomp


from omrl_search.agent import ReActFormat, TurnEncoder  # noqa: E402
from omrl_search.constrain import Grammar  # noqa: E402
from omrl_search.types import DEFAULT_MAX_TOKENS, GenRequest, SamplingParams  # noqa: E402

CONDITIONS = ("none", "format", "actions")


def workload(policy, n_tasks: int) -> list[dict]:
    """Per Game24 task: its first messages, prompt ids, env snapshot and its grammars."""
    import omrl_search as om
    from omrl_search.env import make_env

    fmt, enc, env = ReActFormat(), TurnEncoder(policy.tokenizer), make_env("game24")
    frame = getattr(fmt, "grammar", None)
    out = []
    for task in om.load_tasks("game24", "test", limit=n_tasks):
        obs = env.reset(task)
        msgs = fmt.first_messages(env, task, obs)
        rules = env.action_grammar()
        if frame is not None:
            grammars = {"format": frame("format", None, "game24"), "actions": frame("actions", rules, "game24")}
        else:
            grammars = {"format": Grammar.any_line("game24"), "actions": Grammar.from_rules(rules, "game24")}
        out.append({"task": task, "messages": msgs, "ids": enc.first_prompt(msgs),
                    "snapshot": env.snapshot(), "grammars": {"none": None, **grammars}})
    return out


def valid_action(env, fmt: ReActFormat, item: dict, text: str) -> bool:
    parsed = fmt.parse(text)
    if parsed.error:
        return False
    env.restore(item["snapshot"])
    return bool(env.step(parsed.action).valid)


def run(policy, items: list[dict], cond: str, seed: int, timer: dict) -> dict:
    reqs = [GenRequest(it["messages"], SamplingParams(temperature=0.7, max_tokens=DEFAULT_MAX_TOKENS, seed=seed + k),
                       prompt_ids=it["ids"], grammar=it["grammars"][cond]) for k, it in enumerate(items)]
    timer["mask"] = timer["prefill"] = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    out = policy.generate(reqs)
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    gens = [gs[0] for gs in out]
    return {"tokens": sum(g.completion_tokens for g in gens), "seconds": secs, "cpu_s": cpu,
            "mask_s": timer["mask"], "prefill_s": timer["prefill"], "texts": [g.text for g in gens],
            "ok": sum(g.constraint_check == "ok" for g in gens)}


def instrument(policy) -> dict:
    """CPU time of the backend's hooks: ``mask_logits`` (every step), ``prefill_chunk`` (prompts) and
    ``guide_for`` (a row's matcher; compiles a grammar on first use)."""
    timer = {"mask": 0.0, "prefill": 0.0, "guide": 0.0}

    def timed(key: str, fn):
        def call(*a):
            t = time.process_time()
            try:
                return fn(*a)
            finally:
                timer[key] += time.process_time() - t
        return call

    policy.mask_logits = timed("mask", policy.mask_logits)
    policy.prefill_chunk = timed("prefill", policy.prefill_chunk)
    policy.guide_for = timed("guide", policy.guide_for)
    return timer


def make(backend: str, threads: int, dtype: str):
    from omrl_search.backends import smollm2

    if backend == "hf":
        from omrl_search.backends.hf import HFPolicy

        return HFPolicy(smollm2.hf_folder(), device="cpu", dtype=dtype, max_batch=32)
    if backend in ("llamacpp", "llamacpp-gbnf"):
        from omrl_search.backends.llamacpp import LlamaCppPolicy

        engine = "gbnf" if backend.endswith("gbnf") else "xgrammar"
        return LlamaCppPolicy(smollm2.gguf_path(), n_threads=threads, max_batch=8, n_ctx=1024,
                              grammar_engine=engine)
    raise SystemExit(f"unknown backend {backend!r} (hf, llamacpp, llamacpp-gbnf)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="hf,llamacpp,llamacpp-gbnf")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tasks", type=int, default=16, help="Game24 test tasks (batches of --batch)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--dtype", default="float32", help="hf's dtype (float32, bfloat16)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from omrl_search.env import make_env

    env, fmt = make_env("game24"), ReActFormat()
    load0 = os.getloadavg()[0]
    results: dict = {}
    for backend in args.backends.split(","):
        policy = make(backend, args.threads, args.dtype)
        timer = instrument(policy)
        items = workload(policy, args.tasks)
        batches = [items[i:i + args.batch] for i in range(0, len(items), args.batch)]
        for cond in CONDITIONS:  # warm-up: compiles every grammar once
            timer["guide"] = 0.0
            run(policy, batches[0], cond, 10_000, timer)
            for b in batches[1:]:
                run(policy, b[:1], cond, 10_000, timer)
            results.setdefault(backend, {})[cond] = {"compile_s": round(timer["guide"], 3)}
        best: dict = {}
        valid = {c: [0, 0] for c in CONDITIONS}
        ok = {c: 0 for c in CONDITIONS}
        for rep in range(args.reps):
            for cond in CONDITIONS:
                tok = secs = cpu = mask_s = pre_s = 0.0
                for bi, batch in enumerate(batches):
                    if backend.startswith("llamacpp"):  # its KV streams start cold every batch
                        policy.clear_cache()
                    r = run(policy, batch, cond, 1000 * rep + 100 * bi, timer)
                    tok, secs, cpu = tok + r["tokens"], secs + r["seconds"], cpu + r["cpu_s"]
                    mask_s, pre_s = mask_s + r["mask_s"], pre_s + r["prefill_s"]
                    ok[cond] += r["ok"]
                    for it, text in zip(batch, r["texts"]):
                        valid[cond][0] += valid_action(env, fmt, it, text)
                        valid[cond][1] += 1
                dec = cpu - pre_s
                print(f"  {backend:13s} {cond:7s} rep {rep}: {tok:5.0f} tok {secs:7.2f}s {tok / secs:6.1f} tok/s "
                      f"{tok / cpu:6.1f} tok/CPU-s {tok / dec:6.1f} decode tok/CPU-s mask {100 * mask_s / dec:4.1f}%"
                      " of decode CPU", file=sys.stderr)
                if cond not in best or tok / dec > best[cond][0] / best[cond][4]:
                    best[cond] = (tok, secs, cpu, mask_s, dec)
        for cond in CONDITIONS:
            tok, secs, cpu, mask_s, dec = best[cond]
            results[backend][cond].update({
                "tokens": int(tok), "seconds": round(secs, 3), "cpu_seconds": round(cpu, 3),
                "decode_cpu_seconds": round(dec, 3), "tokens_per_s": round(tok / secs, 1),
                "tokens_per_cpu_s": round(tok / cpu, 1), "decode_tokens_per_cpu_s": round(tok / dec, 1),
                "mask_share": round(mask_s / dec, 4), "valid_fraction": round(valid[cond][0] / valid[cond][1], 3),
                "ok_fraction": round(ok[cond] / valid[cond][1], 3) if cond != "none" else None,
                "completions": valid[cond][1]})
        policy.close()
    load1 = os.getloadavg()[0]

    from importlib.metadata import version

    machine = {"cpus": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine(),
               "threads": args.threads, "torch": torch.__version__, "xgrammar": version("xgrammar"),
               "hf_dtype": args.dtype, "loadavg_start": round(load0, 2), "loadavg_end": round(load1, 2)}
    print(f"\nSmolLM2-135M-Instruct on Game24 first steps, batch {args.batch}, {args.tasks} tasks, "
          f"best of {args.reps}; {machine['cpus']} CPUs, {args.threads} thread(s), "
          f"load {machine['loadavg_start']}->{machine['loadavg_end']}, xgrammar {machine['xgrammar']}")
    print(f"{'backend':14s}{'constraint':>11s}{'tok/s':>8s}{'tok/CPU-s':>10s}{'decode':>8s}{'mask%':>7s}"
          f"{'valid':>7s}{'ok':>6s}{'compile_s':>10s}")
    for backend, conds in results.items():
        for cond, r in conds.items():
            okf = "-" if r["ok_fraction"] is None else f"{r['ok_fraction']:.2f}"
            print(f"{backend:14s}{cond:>11s}{r['tokens_per_s']:8.1f}{r['tokens_per_cpu_s']:10.1f}"
                  f"{r['decode_tokens_per_cpu_s']:8.1f}{100 * r['mask_share']:6.1f}%{r['valid_fraction']:7.2f}"
                  f"{okf:>6s}{r['compile_s']:10.2f}")
    print(json.dumps({"machine": machine, "batch": args.batch, "tasks": args.tasks, "reps": args.reps,
                      "max_tokens": DEFAULT_MAX_TOKENS, "results": results}))


if __name__ == "__main__":
    main()
