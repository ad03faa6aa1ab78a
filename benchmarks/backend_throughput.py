"""Generated tokens per second of the bundled model's backends under the engine's batched load.

Workload: ReAct-style chat prompts of ~200 tokens (a shared system prompt with the format and one
worked example, then a task and an observation that differ per prompt), temperature 0.7,
max_tokens 64, seeded. Scenarios (one ``generate`` call each, like one engine round):

* ``b1``     1 prompt, n=1            * ``b8``   8 prompts, n=1        * ``b32``  32 prompts, n=1
* ``b8n4``   8 prompts, n=4 (32 sequences: best-of-N / expansion of 8 nodes by 4 children)
* ``turn2``  16 prompts, then the second turn of each (prompt + its completion + an
  observation): what a ReAct rollout does every round; both calls are timed.
* ``mcts``, ``tot``: the policy calls of whole searches, ``search_many`` over the first
  ``--search-tasks`` Game24 test tasks together (``--mcts`` / ``--tot`` specs, budget
  ``--search-budget`` per task, ``--search-max-tokens`` new tokens per step at temperature 1,
  seed = repetition): the load a prefix cache across calls is for, as every child's prompt
  extends its parent's. The search runs once on the first backend, recording every
  ``generate`` call; each backend then replays the recorded calls in order (the same prompts,
  seeds and call sizes for all: a backend whose logits differ a little, as llama.cpp's do with
  and without reuse, would otherwise grow a different tree). Besides the tokens per second
  these report the prompt tokens, those the backend computed (``prefill``) and those its prefix
  cache served (``cached``).

Backends: ``hf`` (transformers on the HF folder converted from the GGUF) in bfloat16 and in
float32, ``llamacpp`` (llama.cpp on the Q4_1 GGUF itself, its prefix cache across calls on) and
``llamacpp-nocache`` (the same with ``prefix_cache=off``: every call prefills its prompts in
full; within a call, samples and shared prefixes are still evaluated once) and
``llamacpp-streams`` (cache on, ``prefix_cache_mb=0``: only the live KV streams are reused, no
saved states). Every backend runs each scenario
``--reps`` times, interleaved, in one process; the best repetition counts (ratios hold on a noisy
machine, the best time is the least disturbed one). llama.cpp's KV cache is cleared before each
repetition so that no repetition reuses the previous one's prompts.

Two figures per cell: generated tokens per wall-clock second with ``--threads`` threads (default:
all CPUs), and generated tokens per CPU-second of the process. On a shared, busy machine the
wall figure is distorted (llama.cpp's spinning OpenMP threads suffer most from oversubscription);
run with ``--threads 1`` there: one thread neither spins nor competes with itself, so tokens per
CPU-second measure the work each backend does per token, whatever the load.

OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, set here unless given): torch and
llama.cpp both spin by default, and on a busy machine spinning made 2 threads several times slower
than 1 (llama.cpp up to 10x); passive waiting removes that for both.

Run: ``python benchmarks/backend_throughput.py [--reps 2] [--threads 1] [--scenarios b1,b8,...]``;
the prefix cache on a search: ``--backends llamacpp,llamacpp-nocache --scenarios mcts``.
Prints a table, then as its last line one JSON object with every figure.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch / llama_cpp load libgomp


from omrl_search.types import GenRequest, SamplingParams  # noqa: E402

SYSTEM = (
    "You are an agent in a text-based household environment. At each step, first think about "
    "what to do, then act. Answer in exactly this format:\n"
    "Think: <your reasoning>\n"
    "Act: <one action>\n"
    "Valid actions: look, inventory, go to <place>, take <object> from <place>, "
    "put <object> in/on <place>, open <place>, close <place>, use <object>.\n"
    "Example:\n"
    "Task: put a clean mug on the desk.\n"
    "Observation: You are in the kitchen. You see a sink 1, a countertop 1 and a cabinet 1.\n"
    "Think: A mug is usually on the countertop. I should go there first.\n"
    "Act: go to countertop 1\n"
)
OBJECTS = ["apple", "mug", "key", "book", "knife", "towel", "lamp", "pen"]
PLACES = ["table 1", "drawer 2", "shelf 3", "fridge 1", "desk 1", "sofa 1", "bed 1", "cabinet 4"]


def prompt(i: int) -> list[dict[str, str]]:
    obj, place = OBJECTS[i % len(OBJECTS)], PLACES[(i * 3) % len(PLACES)]
    other = PLACES[(i * 5 + 1) % len(PLACES)]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": (
            f"Task {i}: find the {obj} and put it on the {place}.\n"
            f"Observation: You are in room {i}. You see a {other}, a {place} and a closed door. "
            f"Your hands are empty."
        )},
    ]


def params(n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.7, top_p=1.0, max_tokens=64, n=n, seed=seed)


def requests(policy, count: int, n: int, seed: int) -> list[GenRequest]:
    tok = policy.tokenizer
    out = []
    for i in range(count):
        msgs = prompt(i)
        out.append(GenRequest(msgs, params(n, seed), tok.encode(tok.render(msgs, True))))
    return out


SEARCH = {"mcts": "mcts:leaves=4,k=3,value=logprob", "tot": "tot:b=3,k=3,n_evaluate=1"}


_RECORDED: dict[tuple[str, int], tuple[list, dict]] = {}  # (scenario, seed) -> (calls, search)


def record_search(policy, name: str, seed: int, args) -> tuple[list, dict]:
    """Run the search once on ``policy`` and record its ``generate`` calls (cached by seed)."""
    import omrl_search as om

    if (name, seed) in _RECORDED:
        return _RECORDED[name, seed]
    tasks = om.load_tasks("game24", "test", limit=args.search_tasks)
    sampling = SamplingParams(temperature=1.0, max_tokens=args.search_max_tokens)
    calls: list = []
    generate = policy.generate
    policy.generate = lambda reqs: calls.append(list(reqs)) or generate(reqs)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        results = om.search_many(tasks, strategy=getattr(args, name), policy=policy, seed=seed,
                                 budget=args.search_budget, sampling=sampling)
    finally:
        del policy.generate
    info = {k: sum(int(r.spent.get(k, 0)) for r in results)
            for k in ("prompt_tokens", "completion_tokens", "cached_tokens", "lm_calls")}
    info.update(solved=sum(bool(r.success) for r in results), tasks=len(tasks),
                faults=sum(len(r.faults) for r in results), calls=len(calls),
                seconds=round(time.perf_counter() - t0, 2), cpu_seconds=round(time.process_time() - c0, 2))
    print(f"  recorded {name} (seed {seed}) on {getattr(policy, 'name', '?')}: {info}", file=sys.stderr)
    _RECORDED[name, seed] = calls, info
    return calls, info


def run_search(policy, name: str, seed: int, args, first) -> tuple[int, int, float, float, dict]:
    """One search scenario: the recorded calls replayed on ``policy``; (generated tokens,
    prompt tokens, wall s, CPU s, details)."""
    calls, info = record_search(first, name, seed, args)
    policy.clear_cache()
    d = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0, "calls": len(calls),
         "search": info}
    t0, c0 = time.perf_counter(), time.process_time()
    for reqs in calls:
        for gs in policy.generate(reqs):
            d["prompt_tokens"] += gs[0].prompt_tokens
            d["cached_tokens"] += gs[0].cached_tokens
            d["completion_tokens"] += sum(g.completion_tokens for g in gs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    d["prefill_tokens"] = d["prompt_tokens"] - d["cached_tokens"]
    return d["completion_tokens"], d["prompt_tokens"], wall, cpu, d


def run_scenario(policy, name: str, seed: int) -> tuple[int, int, float, float]:
    """Returns (generated tokens, prompt tokens, wall seconds, CPU seconds) for one repetition."""
    counts = {"b1": (1, 1), "b8": (8, 1), "b32": (32, 1), "b8n4": (8, 4), "turn2": (16, 1)}
    count, n = counts[name]
    reqs = requests(policy, count, n, seed)
    t0, c0 = time.perf_counter(), time.process_time()
    out = policy.generate(reqs)
    gen = sum(g.completion_tokens for gs in out for g in gs)
    ptok = sum(g.prompt_tokens for gs in out for g in gs)
    if name == "turn2":
        tok = policy.tokenizer
        obs = tok.encode("<|im_end|>\n<|im_start|>user\nObservation: Nothing happens. You see a "
                         "door.<|im_end|>\n<|im_start|>assistant\n")
        nxt = []
        for r, gs in zip(reqs, out):
            g = gs[0]
            ids = g.token_ids[:-1] if g.ended_with_eos else g.token_ids
            nxt.append(GenRequest(r.messages, params(1, seed + 1), r.prompt_ids + ids + obs))
        out2 = policy.generate(nxt)
        gen += sum(g.completion_tokens for gs in out2 for g in gs)
        ptok += sum(g.prompt_tokens for gs in out2 for g in gs)
    return gen, ptok, time.perf_counter() - t0, time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--scenarios", default="b1,b8,b32,b8n4,turn2")
    ap.add_argument("--backends", default="hf-bf16,hf-fp32,llamacpp")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--search-tasks", type=int, default=4)
    ap.add_argument("--search-budget", default="tokens=8000")
    ap.add_argument("--search-max-tokens", type=int, default=32)
    ap.add_argument("--mcts", default=SEARCH["mcts"])
    ap.add_argument("--tot", default=SEARCH["tot"])
    args = ap.parse_args()
    scenarios = args.scenarios.split(",")

    import torch

    torch.set_num_threads(args.threads)

    from omrl_search.backends import smollm2
    from omrl_search.backends.hf import HFPolicy

    policies = {}
    for b in args.backends.split(","):
        t0 = time.perf_counter()
        if b == "hf-bf16":
            policies[b] = HFPolicy(smollm2.hf_folder(), device="cpu", dtype="bfloat16")
        elif b == "hf-fp32":
            policies[b] = HFPolicy(smollm2.hf_folder(), device="cpu", dtype="float32")
        elif b in ("llamacpp", "llamacpp-nocache", "llamacpp-streams"):
            from omrl_search.backends.llamacpp import LlamaCppPolicy

            policies[b] = LlamaCppPolicy(smollm2.gguf_path(), n_threads=args.threads,
                                         prefix_cache=b != "llamacpp-nocache",
                                         prefix_cache_mb=0 if b == "llamacpp-streams" else 256)
        else:
            raise SystemExit(f"unknown backend {b}")
        print(f"loaded {b} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    for p in policies.values():  # warm-up
        p.generate(requests(p, 2, 1, 0)[:2])

    load0 = os.getloadavg()[0]
    best: dict[tuple[str, str], tuple[int, int, float, float]] = {}
    best_cpu: dict[tuple[str, str], float] = {}  # best generated tokens per CPU-second
    searched: dict[tuple[str, str], dict] = {}  # search scenarios: the best repetition's details
    for sc in scenarios:
        for rep in range(args.reps):
            for b, p in policies.items():
                p.clear_cache()  # every backend starts each repetition cold
                if sc in SEARCH:
                    *r, detail = run_search(p, sc, rep, args, next(iter(policies.values())))
                    r = tuple(r)
                    print(f"  {sc:6s} rep {rep} {b:9s} prompt {detail['prompt_tokens']} prefill "
                          f"{detail['prefill_tokens']} cached {detail['cached_tokens']} calls "
                          f"{detail['calls']}", file=sys.stderr)
                else:
                    r = run_scenario(p, sc, seed=rep)
                key = (sc, b)
                if key not in best or r[0] / r[2] > best[key][0] / best[key][2]:
                    best[key] = r
                    if sc in SEARCH:
                        searched[key] = detail
                best_cpu[key] = max(best_cpu.get(key, 0.0), r[0] / max(r[3], 1e-9))
                print(f"  {sc:6s} rep {rep} {b:9s} {r[0]:5d} tok {r[2]:7.2f}s {r[0] / r[2]:7.1f} tok/s "
                      f"{r[0] / max(r[3], 1e-9):7.1f} tok/CPU-s", file=sys.stderr)
    load1 = os.getloadavg()[0]

    import llama_cpp
    import transformers

    machine = {
        "cpus": len(os.sched_getaffinity(0)),
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": args.threads,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "transformers": transformers.__version__,
        "llama_cpp_python": llama_cpp.__version__,
        "loadavg_start": round(load0, 2),
        "loadavg_end": round(load1, 2),
    }
    names = list(policies)
    print(f"\nSmolLM2-135M-Instruct, generated tokens per second, best of {args.reps} "
          f"(wall with {args.threads} thread(s) | per CPU-second); {machine['cpus']} CPUs, "
          f"load {machine['loadavg_start']}->{machine['loadavg_end']}, torch {machine['torch']}, "
          f"llama-cpp-python {machine['llama_cpp_python']}")
    print(f"{'scenario':9s}" + "".join(f"{b:>20s}" for b in names) + "   prompt tok")
    figures: dict = {"machine": machine, "reps": args.reps, "results": {}}
    for sc in scenarios:
        cells = []
        for b in names:
            gen, ptok, secs, cpu = best[(sc, b)]
            cells.append(f"{gen / secs:11.1f} |{best_cpu[(sc, b)]:7.1f}")
            figures["results"].setdefault(sc, {})[b] = {
                "generated_tokens": gen, "prompt_tokens": ptok, "seconds": round(secs, 3),
                "cpu_seconds": round(cpu, 3), "tokens_per_s": round(gen / secs, 1),
                "tokens_per_cpu_s": round(best_cpu[(sc, b)], 1),
            }
            if (sc, b) in searched:
                d = searched[(sc, b)]
                figures["results"][sc][b].update(
                    {k: d[k] for k in ("prefill_tokens", "cached_tokens", "calls", "search")})
        print(f"{sc:9s}" + "".join(cells) + f"   {best[(sc, names[0])][1]:10d}")
        if any((sc, b) in searched for b in names):
            print(f"{'':9s}" + "".join(f"{'prefill ' + str(searched[(sc, b)]['prefill_tokens']):>20s}"
                                       for b in names if (sc, b) in searched) + "   (prompt tokens computed)")
    for b, p in policies.items():
        if hasattr(p, "cache_stats"):
            figures.setdefault("cache_stats", {})[b] = p.cache_stats()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
