"""LM utilisation: generated tokens per second inside searches, against the backend's own peak.

Workload, per backend (default ``smollm2:hf`` and ``smollm2:llamacpp``, SmolLM2-135M-Instruct;
any policy spec works, e.g. ``openai:URL#MODEL`` for a running server or ``vllm:smollm2`` under
the vLLM venv; a backend that cannot be built is reported and skipped):

* **peak**: ``--peak-prompts`` ReAct prompts of ~220 tokens x ``--peak-tokens`` new tokens at
  temperature 0.7 in ONE ``generate`` call (the prompts of ``backend_throughput.py``): the most
  the backend gives under batched load;
* **searches**: MCTS (``--mcts``, default ``mcts:leaves=4,k=3,value=logprob``: rounds of 4
  leaves x 3 children per tree; rollout values would spend a small budget on one rollout) and
  Tree-of-Thoughts (``--tot``, default ``tot:b=3,k=3,n_evaluate=1``: expansions plus LM
  self-evaluation, asks of 64 tokens) over the first ``--tasks`` test tasks of ``--env``
  (default Game24; prompts grow by each turn's observation, so an env with longer observations
  shows more prefill) in the agent format ``--agent`` (default react; ``act`` writes the action
  alone), searched together (the engine ``search_many`` runs), each task with the token budget
  ``--budget``, ``--max-tokens`` new tokens per step at temperature 1, seed 0; in these modes
  (``--modes``):

  - ``serial``: one request at a time (concurrency 1, ``max_batch`` 1), on ``--serial-tasks``
    tasks (a rate; running all tasks one by one would take too long);
  - ``before``: the code before this benchmark's change: lockstep rounds (every waiting request
    of all trees served, in calls of ``max_batch``, before any tree resumes) in arrival order,
    and only the prefix shared by a whole chunk prefilled once by the backend;
  - ``lockstep``: lockstep rounds with the requests sorted by prompt ids and the backend's
    group prefixes (an ablation: continuous submission off);
  - ``continuous``: each call takes the oldest waiting request and its neighbours in prompt
    order up to ``max_batch`` sequences, a tree resumes as soon as its own requests are
    answered, and the backend prefills a prefix shared by a group of prompts once (the engine
    for backends that do not stream: ``hf``, ``llamacpp``);
  - ``streaming``: for backends with continuous batching of their own (``vllm`` with
    ``stream=true``, ``openai``; ``Policy.streams``): each request is submitted the moment its tree makes it and
    joins the sequences already decoding; answers are collected as they finish. (Skipped for
    backends that do not stream.)

Figures: generated (completion) tokens per wall second and per CPU second of this process
(other processes on a shared machine slow the wall figure more than the CPU figure), and
utilisation = achieved / peak for both. Per mode also the policy calls, sequences per call,
prompt tokens per generated token (what the budget charges), **prefilled** tokens per generated
token (what the backend actually ran through the model before decoding, padding included:
``hf`` and ``llamacpp`` only; a count, so the load on the machine does not blur it) and the
share of the search's time spent in ``generate``, the CPU seconds of the run, and ``cached``:
the share of prompt tokens a prefix cache served (``Generation.cached_tokens``; the ``hf``
backend's cache across calls, cleared before every run and the peak; compare
``smollm2:hf`` with ``smollm2:hf:prefix_cache=off``; the JSON has its hit counts).
``same_trees`` says whether ``before`` and ``continuous`` produced the same completions (the
schedule never changes a request's seed; a backend whose logits depend on the batch, like
bfloat16 ``hf``, may still differ, and then the searches themselves differ a little).

Modes and the peak run interleaved in one process, ``--reps`` times (best kept); the peak is
measured before and after the searches. OMP threads wait passively (``OMP_WAIT_POLICY``).

    python benchmarks/lm_utilisation.py [--backends smollm2:hf,smollm2:llamacpp] [--tasks 16]
        [--budget tokens=1000] [--max-tokens 32] [--serial-tasks 2] [--reps 1]
        [--modes serial,before,continuous,streaming] [--peak-prompts 32] [--peak-tokens 64]

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


import omrl_search as om  # noqa: E402
from backend_throughput import requests as peak_requests  # noqa: E402
from omrl_search.agent import make_format  # noqa: E402
from omrl_search.engine import Engine  # noqa: E402
from omrl_search.types import SamplingParams  # noqa: E402

STRATEGIES = {"mcts": "mcts:leaves=4,k=3,value=logprob", "tot": "tot:b=3,k=3,n_evaluate=1"}
MODES = {  # engine options, concurrency, the policy's max_batch (None: its own), group prefixes
    "serial": ({"schedule": "continuous", "prefix_order": True}, 1, 1, True),
    "before": ({"schedule": "lockstep", "prefix_order": False}, None, None, False),
    "lockstep": ({"schedule": "lockstep", "prefix_order": True}, None, None, True),
    "continuous": ({"schedule": "continuous", "prefix_order": True}, None, None, True),
    "streaming": ({"schedule": "continuous", "prefix_order": True}, None, None, True),
}


class Metered(om.Policy):
    """A policy that counts what passes through its ``generate``."""

    def __init__(self, inner: om.Policy):
        self.inner, self.name, self.tokenizer = inner, inner.name, inner.tokenizer
        self.max_batch, self.answers_prompts = inner.max_batch, inner.answers_prompts
        self.streams = False  # set per mode: ``streaming`` only
        self.reset()

    def reset(self) -> None:
        self.calls = self.seqs = self.generated = self.prompt = self.prefilled = self.cached = 0
        self.seconds = 0.0

    def count_prefill(self) -> bool:
        """Count the tokens the backend prefills (hf: forward calls that keep only the last
        logits; llamacpp: tokens evaluated before decoding); False for other backends."""
        inner = self.inner
        if hasattr(inner, "evaluate_tokens"):  # llamacpp
            evaluate = inner.evaluate_tokens

            def counted(tokens):
                self.prefilled += len(tokens)
                return evaluate(tokens)

            inner.evaluate_tokens = counted
            return True
        model = getattr(inner, "model", None)
        if model is None or not hasattr(model, "forward"):
            return False
        forward = model.forward

        def counted_forward(*a, **kw):
            if "logits_to_keep" in kw:
                self.prefilled += kw["input_ids"].numel()
            return forward(*a, **kw)

        model.forward = counted_forward
        return True

    def generate(self, requests):
        t0 = time.perf_counter()
        out = self.inner.generate(requests)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.seqs += sum(r.params.n for r in requests)
        self.generated += sum(g.completion_tokens for gs in out for g in gs)
        self.prompt += sum(gs[0].prompt_tokens for gs in out if gs)
        self.cached += sum(gs[0].cached_tokens for gs in out if gs)
        return out


    def submit(self, tickets):
        self.calls += 1  # a submission; ``seqs_per_call`` is then sequences per submission
        self.seqs += sum(r.params.n for _, r in tickets)
        self.inner.submit(tickets)

    def collect(self):
        t0 = time.perf_counter()
        done = self.inner.collect()
        self.seconds += time.perf_counter() - t0
        for _, gens in done:
            if isinstance(gens, list):
                self.generated += sum(g.completion_tokens for g in gens)
                self.prompt += gens[0].prompt_tokens if gens else 0
        return done


def measure_peak(policy: om.Policy, prompts: int, tokens: int) -> dict:
    reqs = peak_requests(policy, prompts, 1, seed=0)
    for r in reqs:
        r.params.max_tokens = tokens
    policy.clear_cache()  # every run starts cold (Policy.clear_cache)
    t0, c0 = time.perf_counter(), time.process_time()
    out = policy.generate(reqs)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    gen = sum(g.completion_tokens for gs in out for g in gs)
    return {"generated": gen, "seconds": round(wall, 2), "cpu_seconds": round(cpu, 2),
            "tok_s": round(gen / wall, 2),
            "tok_cpu_s": round(gen / max(cpu, 1e-9), 2)}


def run_search(metered: Metered, strategy: str, tasks: list, args, mode: str) -> tuple[dict, list]:
    """One search run in ``mode``; its figures and each tree's completions."""
    options, concurrency, max_batch, groups = MODES[mode]
    inner = metered.inner
    saved = inner.max_batch
    metered.max_batch = inner.max_batch = max_batch or saved
    if hasattr(inner, "group_prefixes"):
        inner.group_prefixes = groups
    metered.reset()
    metered.streams = mode == "streaming"  # the engine streams through the meter
    streamed = getattr(inner, "streams", False)
    inner.streams = metered.streams  # (vllm: off by default, ``stream=true``)
    inner.clear_cache()  # every run starts cold (Policy.clear_cache)
    engine = Engine(metered, sampling=SamplingParams(1.0, 1.0, args.max_tokens), seed=0,
                    agent_format=make_format(args.agent), **options)
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        results = engine.run(om.make_strategy(strategy), tasks, om.Budget.parse(args.budget),
                             concurrency=concurrency)
    finally:
        inner.streams = streamed
        metered.max_batch = inner.max_batch = saved
        if hasattr(inner, "group_prefixes"):
            inner.group_prefixes = True
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    m = metered
    row = {"tasks": len(tasks), "generated": m.generated, "seconds": round(wall, 2),
           "tok_s": round(m.generated / wall, 2), "tok_cpu_s": round(m.generated / max(cpu, 1e-9), 2),
           "calls": m.calls, "seqs_per_call": round(m.seqs / max(m.calls, 1), 2),
           "prompt_per_generated": round(m.prompt / max(m.generated, 1), 2),
           "prefilled_per_generated": round(m.prefilled / max(m.generated, 1), 2),
           "lm_share": round(m.seconds / wall, 3), "cpu_seconds": round(cpu, 2),
           "cached_per_prompt": round(m.cached / max(m.prompt, 1), 3),
           "prefix_cache": inner.stats().get("prefix_cache") if hasattr(inner, "stats") else None,
           "successes": sum(r.success for r in results), "faults": sum(len(r.faults) for r in results)}
    trees = [[n.step.completion_ids if n.step else None for n in r.tree.nodes] for r in results]
    return row, trees


def load(spec: str, threads: int) -> om.Policy:
    if spec.startswith("smollm2:llamacpp") and "n_threads" not in spec:
        spec += f"{',' if spec.count(':') > 1 else ':'}n_threads={threads}"
    return om.make_policy(spec)


def bench_backend(spec: str, args) -> dict:
    t0 = time.perf_counter()
    try:
        policy = load(spec, args.threads)
    except Exception as exc:  # noqa: BLE001 - an optional backend that is not there
        print(f"  {spec}: skipped ({type(exc).__name__}: {str(exc).splitlines()[0]})", file=sys.stderr)
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    print(f"  {spec}: loaded in {time.perf_counter() - t0:.1f}s, max_batch {policy.max_batch}",
          file=sys.stderr)
    policy.generate(peak_requests(policy, 2, 1, seed=0))  # warm-up
    metered = Metered(policy)
    counts_prefill = metered.count_prefill()
    tasks = om.load_tasks(args.env, "test", limit=args.tasks)
    out: dict = {"max_batch": policy.max_batch, "peak": None, "searches": {}}
    peaks = []
    for rep in range(args.reps):
        peaks.append(measure_peak(policy, args.peak_prompts, args.peak_tokens))
        print(f"  {spec} peak rep {rep}: {peaks[-1]}", file=sys.stderr)
        for name in args.strategies:
            trees = {}
            for mode in args.modes:
                if mode == "streaming" and type(policy).submit is om.Policy.submit:
                    continue  # the backend has no continuous batching of its own
                subset = tasks[:args.serial_tasks] if mode == "serial" else tasks
                row, trees[mode] = run_search(metered, args.specs[name], subset, args, mode)
                if not counts_prefill:
                    row["prefilled_per_generated"] = None
                best = out["searches"].setdefault(name, {}).get(mode)
                if best is None or row["tok_s"] > best["tok_s"]:
                    out["searches"][name][mode] = row
                print(f"  {spec} {name} {mode} rep {rep}: {row}", file=sys.stderr)
            last = "streaming" if "streaming" in trees else "continuous"
            if "before" in trees and last in trees:
                out["searches"][name]["same_trees"] = trees["before"] == trees[last]
    peaks.append(measure_peak(policy, args.peak_prompts, args.peak_tokens))
    print(f"  {spec} peak after: {peaks[-1]}", file=sys.stderr)
    out["peak"] = max(peaks, key=lambda p: p["tok_s"])
    out["peak"]["tok_cpu_s"] = max(p["tok_cpu_s"] for p in peaks)
    for modes in out["searches"].values():
        for row in modes.values():
            if isinstance(row, dict):
                row["utilisation"] = round(row["tok_s"] / out["peak"]["tok_s"], 3)
                row["utilisation_cpu"] = round(row["tok_cpu_s"] / out["peak"]["tok_cpu_s"], 3)
    policy.close()
    return out


def machine(threads: int) -> dict:
    info = {"cpus": len(os.sched_getaffinity(0)), "cpu": platform.processor() or platform.machine(),
            "threads": threads, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "python": platform.python_version()}
    for mod in ("torch", "transformers", "llama_cpp", "vllm"):
        if mod in sys.modules:
            info[mod] = getattr(sys.modules[mod], "__version__", "?")
    return info


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def print_table(figures: dict) -> None:
    head = (f"{'backend':18s} {'search':6s} {'mode':10s} {'tasks':>5s} {'gen tok':>8s} {'sec':>7s} "
            f"{'tok/s':>7s} {'util':>6s} {'tok/CPU-s':>9s} {'util':>6s} {'calls':>6s} "
            f"{'seq/call':>8s} {'prompt/gen':>10s} {'prefill/gen':>11s} {'LM share':>8s} {'CPU-s':>7s} "
            f"{'cached':>6s}")
    print(head)
    for spec, res in figures["backends"].items():
        if "skipped" in res:
            print(f"{spec:18s} skipped: {res['skipped'].splitlines()[0]}")
            continue
        p = res["peak"]
        print(f"{spec:18s} {'peak':6s} {'1 call':10s} {'':>5s} {p['generated']:8d} {p['seconds']:7.1f} "
              f"{p['tok_s']:7.1f} {1:6.2f} {p['tok_cpu_s']:9.1f} {1:6.2f}")
        for name, modes in res["searches"].items():
            for mode, r in modes.items():
                if not isinstance(r, dict):
                    continue
                print(f"{spec:18s} {name:6s} {mode:10s} {r['tasks']:5d} {r['generated']:8d} "
                      f"{r['seconds']:7.1f} {r['tok_s']:7.1f} {r['utilisation']:6.2f} "
                      f"{r['tok_cpu_s']:9.1f} {r['utilisation_cpu']:6.2f} {r['calls']:6d} "
                      f"{r['seqs_per_call']:8.1f} {r['prompt_per_generated']:10.1f} "
                      f"{_num(r['prefilled_per_generated']):>11s} {r['lm_share']:8.2f} "
                      f"{r['cpu_seconds']:7.1f} {r['cached_per_prompt']:6.2f}")
            if "same_trees" in modes:
                print(f"{'':18s} {name:6s} before and the engine now: same completions: {modes['same_trees']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backends", default="smollm2:hf,smollm2:llamacpp")
    ap.add_argument("--strategies", default="mcts,tot")
    ap.add_argument("--modes", default="serial,before,continuous,streaming")
    ap.add_argument("--mcts", default=STRATEGIES["mcts"])
    ap.add_argument("--tot", default=STRATEGIES["tot"])
    ap.add_argument("--env", default="game24", help="the env whose test tasks are searched")
    ap.add_argument("--agent", default="react", help="agent format: react, act (the action alone), ...")
    ap.add_argument("--tasks", type=int, default=16)
    ap.add_argument("--serial-tasks", type=int, default=2)
    ap.add_argument("--budget", default="tokens=1000")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--peak-prompts", type=int, default=32)
    ap.add_argument("--peak-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    args.specs = {"mcts": args.mcts, "tot": args.tot}
    for bad in [s for s in args.strategies if s not in STRATEGIES] + [m for m in args.modes if m not in MODES]:
        raise SystemExit(f"unknown strategy or mode {bad!r} (strategies: {', '.join(STRATEGIES)}; "
                         f"modes: {', '.join(MODES)})")
    try:
        import torch

        torch.set_num_threads(args.threads)
    except ImportError:
        pass
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    figures: dict = {"workload": {k: v for k, v in vars(args).items()},
                     "strategy_specs": {s: args.specs[s] for s in args.strategies}, "backends": {}}
    for spec in [b for b in args.backends.split(",") if b]:
        figures["backends"][spec] = bench_backend(spec, args)
    figures["machine"] = dict(machine(args.threads), loadavg_start=[round(x, 2) for x in load0],
                              loadavg_end=[round(x, 2) for x in os.getloadavg()],
                              seconds=round(time.perf_counter() - t0, 1))
    m = figures["machine"]
    print(f"\n{args.env} x {args.tasks} tasks, agent {args.agent} (serial: {args.serial_tasks}), "
          f"budget {args.budget} per task, "
          f"max_tokens {args.max_tokens}, T=1, seed 0; peak: {args.peak_prompts} prompts x "
          f"{args.peak_tokens} tokens in one call; best of {args.reps}. {m['cpus']} CPUs ({m['cpu']}), "
          f"{args.threads} threads, load {m['loadavg_start'][0]}->{m['loadavg_end'][0]}, "
          f"{m['seconds']:.0f}s in all")
    print_table(figures)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
