"""Tree-of-Thoughts on Game24 as the paper runs it: a custom ``propose`` / ``value`` pair.

The paper's Game24 protocol (Yao et al., 2023, section 4.1) in this project's terms:

* tasks with the answer step on (``--split test:answer=on``): three combines, then the whole
  expression, ``answer EXPR`` (four thoughts);
* **propose** (:func:`propose_prompt`): one LM call per state lists the possible next steps
  (``a op b = c (left: ...)``, a one-shot example shows the form); every listed step is applied.
  With only 24 left it asks for the answer instead: the steps so far rewritten as one
  expression (``Answer: (4 + 8) * (6 - 4) = 24``);
* **value** (:func:`value_prompt`): the numbers left, judged ``sure``, ``likely`` or
  ``impossible`` (few-shot), three samples mapped to 20 / 1 / 0.001 and summed, cached by the
  prompt (the paper's value cache: equal numbers left are valued once); an answer state is
  judged ``sure`` or ``impossible`` against the input numbers (:func:`judge_prompt`);
* breadth ``b=5``, the rest ToT's defaults of the ``tot`` strategy (frontier in value order,
  repeats kept and valued 0).

Only the public strategy API is used: ``ProposePrompt(prompt=..., parse=...)`` and
``LMValue(prompt=..., answer_prompt=..., mapping=..., reduce="sum", cache_by="prompt")`` given to
``TreeOfThoughts`` as its proposer and evaluator. The prompts' wording and examples are this project's own.

:class:`ScriptedToT` answers these prompts the way a perfect model would (exact arithmetic), so
the pipeline runs without a model (the test and ``--policy scripted``).

Run: ``python examples/tot_game24/tot_game24.py --policy smollm2 --limit 5``.
"""
from __future__ import annotations

import argparse
import re
from itertools import combinations
from typing import Any

import omrl_search as om
from omrl_search.types import Generation
from strategies.tot import ProposePrompt, TreeOfThoughts
from strategies.values import LMValue

TARGET = "24"
NUMBER = r"-?\d+(?:/\d+)?"
MAPPING = {"sure": 20.0, "likely": 1.0, "impossible": 0.001}  # ToT's values, summed over samples

PROPOSE = """Use + - * / on two of the numbers to make a new number. List the possible next steps, one per line.
Input: 3 5 7 13
Possible next steps:
3 + 5 = 8 (left: 7 8 13)
3 * 5 = 15 (left: 7 13 15)
13 - 7 = 6 (left: 3 5 6)
7 - 5 = 2 (left: 2 3 13)
13 + 3 = 16 (left: 5 7 16)
7 * 3 = 21 (left: 5 13 21)
13 - 5 = 8 (left: 3 7 8)
7 / 3 = 7/3 (left: 7/3 5 13)
Input: {numbers}
Possible next steps:
"""

ANSWER = """Rewrite the steps as one expression over the input numbers, each used once, that makes 24.
Input: 4 4 6 8
Steps:
4 + 8 = 12 (left: 4 6 12)
6 - 4 = 2 (left: 2 12)
2 * 12 = 24 (left: 24)
Answer: (6 - 4) * (4 + 8) = 24
Input: {numbers}
Steps:
{steps}
Answer:"""

VALUE = """Evaluate if the given numbers can reach 24 (sure/likely/impossible).
4 6
4 * 6 = 24
sure
3 4 9
(9 - 3) * 4 = 6 * 4 = 24
sure
11 12
11 + 12 = 23; 12 - 11 = 1; 11 * 12 = 132; 12 / 11 is below 2
impossible
2 9 11
2 + 9 + 11 = 22; (11 - 9) * 2 = 4; 11 * 2 + 9 = 31
no 24 yet, but the numbers are in a reasonable range
likely
1 2 3
(1 + 2) * 3 = 9; (1 + 3) * 2 = 8; the numbers are too small
impossible
{numbers}
"""

JUDGE = """Judge an answer to the game of 24: it must use each input number exactly once and no other numbers, and equal 24 (sure/impossible).
Input: 4 4 6 8
Answer: (4 + 8) * (6 - 4) = 24
Judge: sure
Input: 1 6 6 10
Answer: 6 * (10 - 6) = 24
Judge: impossible (1 is not used)
Input: 3 5 7 9
Answer: 3 * (7 + 5) = 24
Judge: impossible (3 * 12 = 36, and 9 is not used)
Input: {numbers}
Answer: {answer}
Judge:"""


# --- reading the env's observations --------------------------------------------------------------
def numbers_left(observation: str) -> list[str]:
    """The numbers of the env's ``Numbers left: 1 4 8/3 | target: 24`` line."""
    m = re.search(r"Numbers left: ([^|\n]*)\|", observation)
    return m.group(1).split() if m else []


def _path(ctx, node) -> list[Any]:
    return ctx.tree.path(node)


def _inputs(ctx) -> str:
    return " ".join(map(str, ctx.task.data["numbers"]))


def _steps(ctx, node) -> str:
    """The combines so far as the propose prompt writes them: ``4 + 8 = 12 (left: 4 6 12)``."""
    lines = []
    for n in _path(ctx, node)[1:]:
        m = re.search(rf"^({NUMBER} [-+*/] {NUMBER} = {NUMBER})$", n.observation, re.MULTILINE)
        if n.step is not None and n.step.valid and m:
            lines.append(f"{m.group(1)} (left: {' '.join(numbers_left(n.observation))})")
    return "\n".join(lines)


# --- the propose / value pair ----------------------------------------------------------------------
def propose_prompt(ctx, node, k: int | None = None) -> str:
    """ToT's propose prompt for the numbers left; with only 24 left, the answer prompt."""
    left = numbers_left(node.observation)
    if left == [TARGET]:
        return ANSWER.format(numbers=_inputs(ctx), steps=_steps(ctx, node))
    return PROPOSE.format(numbers=" ".join(left))


def parse_proposals(text: str) -> list[str]:
    """Actions from a proposal answer: ``a op b`` of each ``a op b = c ...`` line, or
    ``answer EXPR`` from an ``Answer: EXPR = 24`` line."""
    acts = []
    for line in text.splitlines():
        line = line.strip()
        m = re.match(r"^(?:answer\s*:)\s*(.+?)\s*(?:=\s*[-\d/ ]+)?$", line, re.IGNORECASE)
        if m:
            acts.append(f"answer {m.group(1)}")
            continue
        m = re.match(rf"^({NUMBER})\s*([-+*/])\s*({NUMBER})(?:\s*=|\s*$)", line)
        if m:
            acts.append(f"{m.group(1)} {m.group(2)} {m.group(3)}")
    return acts


def value_prompt(ctx, node) -> str:
    """ToT's value prompt: the numbers left, nothing else (so equal numbers share a value)."""
    return VALUE.format(numbers=" ".join(numbers_left(node.observation)))


def judge_prompt(ctx, node) -> str:
    """ToT's last-step value prompt: the answer, judged against the input numbers."""
    action = node.step.action if node.step is not None else ""
    return JUDGE.format(numbers=_inputs(ctx), answer=action[len("answer"):].strip())


def strategy(b: int = 5, n_evaluate: int = 3, **options: Any) -> TreeOfThoughts:
    """ToT with the Game24 propose / value prompts (``options``: other ``tot`` knobs)."""
    proposer = ProposePrompt(prompt=propose_prompt, parse=parse_proposals, max_tokens=200)
    evaluator = LMValue(n=n_evaluate, mapping=MAPPING, reduce="sum", prompt=value_prompt,
                        answer_prompt=judge_prompt, cache_by="prompt", max_tokens=120)
    return TreeOfThoughts(method="bfs", b=b, proposer=proposer, evaluator=evaluator, **options)


# --- a stand-in model that answers the prompts exactly ------------------------------------------
class ScriptedToT(om.Policy):
    """Answers the four prompts as a perfect model would: every distinct next step, the answer
    rebuilt from the steps, ``sure`` when 24 is reachable (else ``impossible``), and the
    judge's exact verdict. Deterministic; no env access, only the prompt text."""

    name, answers_prompts = "scripted-tot", True

    def __init__(self) -> None:
        from omrl_search.policy import ByteChatTokenizer

        self.tokenizer = ByteChatTokenizer()
        self.prompts: list[str] = []

    def generate(self, requests):
        out = []
        for req in requests:
            prompt = req.messages[-1]["content"]
            self.prompts.append(prompt)
            text = self.answer(prompt)
            ids = self.tokenizer.encode(text)
            out.append([Generation(text, ids, None, len(prompt), len(ids))] * req.params.n)
        return out

    @staticmethod
    def answer(prompt: str) -> str:
        from fractions import Fraction

        from envs.arith import apply_op, eval_expression, fmt, replay, solvable, to_text

        if prompt.startswith("Use + - * /"):  # propose: every distinct step
            left = [Fraction(x) for x in prompt.split("Input: ")[-1].split("\n")[0].split()]
            lines = {}
            for i, j in combinations(range(len(left)), 2):
                rest = left[:i] + left[i + 1:j] + left[j + 1:]
                for a, b in ((left[i], left[j]), (left[j], left[i])):
                    for op in "+-*/":
                        value = apply_op(a, op, b)
                        if value is not None:
                            now = " ".join(map(fmt, sorted(rest + [Fraction(value)])))
                            lines.setdefault(f"{fmt(a)} {op} {fmt(b)}", f"= {fmt(value)} (left: {now})")
            return "\n".join(f"{k} {v}" for k, v in lines.items())
        if prompt.startswith("Rewrite the steps"):  # the answer: the steps as one expression
            blocks = prompt.split("Input: ")[-1].split("\n")
            original = [int(x) for x in blocks[0].split()]
            path = [" ".join(line.split(" ")[:3]) for line in blocks[2:] if "=" in line]
            ((_, tree),) = replay(sorted(original), path)
            return f"Answer: {to_text(tree)} = 24"
        if prompt.startswith("Evaluate"):  # value: reachable or not
            left = [Fraction(x) for x in prompt.rstrip().rsplit("\n", 1)[-1].split()]
            return "sure" if solvable(left, 24) else "impossible"
        if prompt.startswith("Judge"):  # last step: the answer checked exactly
            numbers = prompt.split("Input: ")[-1].split("\n")[0].split()
            expr = prompt.split("Answer: ")[-1].split("\n")[0]
            try:
                value, used = eval_expression(expr)
            except ValueError:
                return "impossible"
            return "sure" if value == 24 and sorted(used) == sorted(map(int, numbers)) else "impossible"
        return "impossible"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="scripted", help="a policy spec, or 'scripted' for ScriptedToT")
    ap.add_argument("--split", default="test:answer=on")
    ap.add_argument("--limit", type=int, default=5)
    ap.add_argument("--b", type=int, default=5)
    args = ap.parse_args(argv)
    policy = ScriptedToT() if args.policy == "scripted" else args.policy
    tasks = om.load_tasks("game24", args.split, limit=args.limit)
    results = om.search_many(tasks, strategy=strategy(b=args.b), policy=policy)
    for r in results:
        answer = r.best_trajectory.steps[-1].action if r.best_trajectory and r.best_trajectory.steps else ""
        print(f"{r.task.task_id}\t{'solved' if r.success else 'failed'}\t{answer}")
    print(f"solved {sum(r.success for r in results)} of {len(results)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
