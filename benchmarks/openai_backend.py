"""The same searches through the ``openai`` backend and in process: do the figures agree?

Workload: the first ``--tasks`` Game24 test tasks, each ``--strategies`` entry (default ReAct and
best-of-4), ``--max-depth`` steps, ``--max-tokens`` per step, temperature 1.0, one seed, with the
bundled SmolLM2-135M (Q4_1 GGUF) on two backends:

* ``inproc``: ``smollm2:llamacpp`` (llama.cpp in this process);
* ``openai``: llama-cpp-python's OpenAI-compatible server on the same GGUF (a subprocess,
  ``omrl_search.backends.llamacpp_server``) through ``openai:URL#smollm2`` (chat endpoint).

Both use ``--threads`` threads and flash attention off (the server's default), so they run the
same model with the same numerics; they draw different random numbers, so the samples differ and
the figures should agree within sampling noise. Per backend and strategy: success rate, the
fraction of steps with a well-formed ``Think:/Act:`` answer and with a valid action, completion
tokens per LM call, tokens, faults and wall seconds. ``max_in_flight=1``: llama-cpp-python serves one sequence at a time and
reuses the prompt prefix of the previous call, so calls that share a prompt go best in order.

Run: ``python benchmarks/openai_backend.py [--tasks 20] [--threads 1]``. Prints a table, then as
its last line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before llama_cpp loads libgomp


def figures(results: list, seconds: float) -> dict:
    from omrl_search import summarize

    s = summarize(results, seconds)
    steps = [n.step for r in results for n in r.tree.nodes[1:]]
    s["steps"] = len(steps)
    s["valid_steps"] = sum(st.valid for st in steps)
    s["valid_rate"] = round(s["valid_steps"] / max(len(steps), 1), 4)
    formed = sum(not st.observation.startswith("Invalid format") for st in steps)
    s["well_formed_rate"] = round(formed / max(len(steps), 1), 4)
    s["completion_tokens_per_call"] = round(s["completion_tokens"] / max(s["lm_calls"], 1), 2)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--strategies", default="react;best_of_n:n=4", help="';'-separated specs")
    ap.add_argument("--max-depth", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    from omrl_search import load_tasks, search_many
    from omrl_search.backends.llamacpp_server import serving
    from omrl_search.backends.smollm2 import gguf_path
    from omrl_search.policy import make_policy
    from omrl_search.types import SamplingParams

    tasks = load_tasks("game24", "test", args.tasks)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    strategies = [s for s in args.strategies.split(";") if s]
    rows: dict[str, dict] = {}
    with serving(gguf_path(), alias="smollm2", threads=args.threads) as url:
        policies = {
            "inproc": make_policy(f"smollm2:llamacpp:n_threads={args.threads},flash_attn=false"),
            "openai": make_policy(f"openai:{url}#smollm2:max_in_flight=1,timeout=300"),
        }
        for strat in strategies:
            for name, pol in policies.items():
                t0 = time.perf_counter()
                res = search_many(tasks, strategy=strat, policy=pol, seed=args.seed,
                                  max_depth=args.max_depth, sampling=sampling)
                rows[f"{name}/{strat}"] = figures(res, time.perf_counter() - t0)
                print(f"  {name}/{strat}: {rows[f'{name}/{strat}']}", flush=True)
        for pol in policies.values():
            pol.close()

    cols = ("success_rate", "steps", "well_formed_rate", "valid_rate", "completion_tokens_per_call",
            "prompt_tokens", "completion_tokens", "lm_calls", "faults", "seconds")
    print(f"\nGame24 test, {len(tasks)} tasks, SmolLM2-135M Q4_1, max_depth {args.max_depth}, "
          f"max_tokens {args.max_tokens}, seed {args.seed}, {args.threads} thread(s), {platform.node()}")
    print("run".ljust(28) + "".join(c[:12].rjust(13) for c in cols))
    for key, s in rows.items():
        print(key.ljust(28) + "".join(str(s[c]).rjust(13) for c in cols))
    print(json.dumps({"tasks": len(tasks), "max_depth": args.max_depth, "max_tokens": args.max_tokens,
                      "seed": args.seed, "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
