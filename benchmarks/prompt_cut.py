"""Does the short first-turn prompt lose success? The same tasks, the same policy and search,
once with the env's prompt as shipped and once with the longer prompt it replaced (commit 330f3e0:
a long instruction, a long action help and an example turn), paired task by task.

The long prompt is kept here only, as a subclass of the env registered as ``ENV_long`` that
changes nothing but the prompt's text (same actions, grammar, verifier and state keys); each
task's instruction is rewritten to the old wording. Prints each prompt's length in the
policy's tokens (the first task's whole first prompt, chat template included), each run's
success with its Wilson 95% interval and prompt tokens per task, and an exact McNemar test of
the long prompt against the short one; the last line is one JSON object.

    python benchmarks/prompt_cut.py --env game24 --policy smollm2 --limit 200 --out runs/prompt_cut
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the pre-cut texts, verbatim (git show 330f3e0^:envs/arith.py, envs/game24.py, envs/countdown.py)
LONG_HELP = ("Actions: `a op b` combines two of the numbers left (op is + - * /, spaces around op; "
             "fractions written like 8/3), e.g. `4 * 6` or `8/3 * 9`; or `answer EXPR` with a full "
             "expression over the original numbers, e.g. `answer (1 + 2 + 3) * 4`.")
LONG_EXAMPLE = "Think: (1 + 2 + 3) * 4 = 24, so I start by adding 1 and 2 to get 3.\nAct: 1 + 2"
LONG_INSTRUCTION = {
    "game24": ("Use the numbers {shown} and + - * / to make 24. Each number must be used exactly "
               "once. Combine two numbers per step (e.g. `4 * 6`), or give the whole expression "
               "with `answer EXPR` (e.g. `answer (1 + 2 + 3) * 4`)."),
    "countdown": ("Use the numbers {shown} and + - * / to make {target}. Every number must be used "
                  "exactly once. Combine two numbers per step (e.g. `25 * 4`), or give the whole "
                  "expression with `answer EXPR` (e.g. `answer 25 * 4 + 3`)."),
}


def long_env(name: str) -> str:
    """Register ``NAME_long``: the shipped env with the pre-cut action help and example turn."""
    from omrl_search.env import env_class, register_env

    base = env_class(name)
    register_env(f"{name}_long")(type(f"{base.__name__}Long", (base,),
                                      {"action_help": LONG_HELP, "examples": LONG_EXAMPLE}))
    return f"{name}_long"


def long_tasks(tasks, env: str, long_name: str):
    """The same tasks for the long env, with the old instruction's wording."""
    out = []
    for t in tasks:
        shown = " ".join(str(n) for n in t.data["numbers"])
        text = LONG_INSTRUCTION[env].format(shown=shown, target=t.data.get("target", 24))
        out.append(dataclasses.replace(t, env=long_name, instruction=text))
    return out


def first_prompt_tokens(task, policy, agent: str) -> int:
    """Tokens of the task's whole first prompt (system text and chat template included)."""
    from omrl_search.agent import make_format
    from omrl_search.env import make_env

    env = make_env(task.env)
    obs = env.reset(task)
    messages = make_format(agent).first_messages(env, task, obs)
    tok = policy.tokenizer
    return len(tok.encode(tok.render(messages, add_generation_prompt=True)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--env", choices=sorted(LONG_INSTRUCTION), default="game24")
    ap.add_argument("--split", default="test")
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--policy", default="smollm2")
    ap.add_argument("--agent", default="act")
    ap.add_argument("--strategy", default="react:temperature=0.0")
    ap.add_argument("--budget", default="tokens=2000")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="folder: short/ and long/ bench outputs")
    args = ap.parse_args()

    import omrl_search as om
    from omrl_search.bench import bench
    from omrl_search.policy import make_policy
    from omrl_search.stats import fmt_paired, fmt_rate, mcnemar
    from paired_runs import load  # this folder's reader of a bench's outcomes.jsonl

    policy = make_policy(args.policy)
    short = om.load_tasks(args.env, args.split, args.limit)
    runs = {"short": short, "long": long_tasks(short, args.env, long_env(args.env))}
    report: dict = {"env": args.env, "tasks": len(short), "policy": args.policy, "runs": {}}
    outcomes: dict[str, dict[str, bool]] = {}
    rate_keys = ("tasks", "successes", "success_rate", "ci_low", "ci_high")
    for name, tasks in runs.items():
        n_prompt = first_prompt_tokens(tasks[0], policy, args.agent)
        summary = bench(tasks, args.strategy, args.budget, policy=policy, seed=args.seed,
                        max_tokens=args.max_tokens, temperature=args.temperature, agent=args.agent,
                        out=Path(args.out) / name, progress=False)
        (by_budget,) = summary["strategies"].values()  # one strategy, one budget
        (row,) = by_budget.values()
        outcomes[name] = load(str(Path(args.out) / name / "outcomes.jsonl"))[1]
        totals = {"tokens": row["prompt_tokens"] + row["completion_tokens"],
                  "prompt_tokens": row["prompt_tokens"], "lm_calls": row["lm_calls"]}
        per_task = {k: round(v / row["tasks"], 1) for k, v in totals.items()}
        report["runs"][name] = {**{k: row[k] for k in rate_keys}, "first_prompt_tokens": n_prompt,
                                "per_task": per_task}
        print(f"{name:5s} first prompt {n_prompt} tokens  {fmt_rate(row)}  per task: {per_task}", flush=True)
    test = mcnemar(outcomes["short"], outcomes["long"])
    report["paired"] = test
    print(f"long vs short on {test['tasks']} tasks: {fmt_paired(test)}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
