"""The words around Game24 / Countdown actions: their grammar and the reasoning behind a move.

* :func:`grammar` spells the action language of a state as grammar rules defining ``action``
  (see :mod:`omrl_search.constrain`): ``a op b`` over two *different* numbers left (each spelled
  as actions write it, ``8/3`` for a fraction; no division by a zero left), or ``answer EXPR``
  whose integers are the task's numbers. Every ``a op b`` the env accepts as valid is in the
  language and every ``a op b`` in it is valid; ``answer`` expressions are a subset of what the
  env reads (one space around each operator, no unary minus), and using every number exactly
  once is left to the env to judge. With one number left (the answer step waiting for the
  expression) no ``a op b`` remains, so the language is ``answer EXPR`` alone.
* :func:`explain` says what a move computes, what is left, and how the target is still reached
  (the solver's plan for the rest), in one of a few wordings.
"""
from __future__ import annotations

import random
from fractions import Fraction

from omrl_search.constrain import choice, literal

from ._text_env import listing, say
from .arith import eval_expression, fmt, read_action, solve

_OP = 'op ::= "+" | "-" | "*" | "/"'


def grammar(numbers: tuple[Fraction, ...], original: tuple[int, ...]) -> str:
    """Rules defining ``action`` with ``numbers`` left from the task's ``original`` numbers."""
    distinct = list(dict.fromkeys(numbers))
    alts: list[str] = []
    rules: list[str] = []
    for i, v in enumerate(distinct):
        rest = list(numbers)
        rest.remove(v)
        others = list(dict.fromkeys(rest))
        if not others:
            continue
        head = literal(fmt(v) + " ")
        rules.append(choice(f"rest-{i}", map(fmt, others)))
        nonzero = [x for x in others if x != 0]
        if len(nonzero) == len(others):
            alts.append(f'{head} op " " rest-{i}')
            continue
        alts.append(f'{head} ("+" | "-" | "*") " " rest-{i}')
        if nonzero:
            rules.append(choice(f"nonzero-{i}", map(fmt, nonzero)))
            alts.append(f'{head} "/ " nonzero-{i}')
    alts.append('"answer " expr')
    return "\n".join([
        "action ::= " + " | ".join(alts),
        _OP,
        'expr ::= term (" " op " " term)*',
        'term ::= given | "(" expr ")"',
        choice("given", map(str, original)),
        *rules,
    ])


def spell(tree) -> str:
    """An expression tree as text, subtrees and negative numbers in parentheses:
    ``32 - (-5)``, ``8 / (3 - (8/3))``."""
    if not isinstance(tree, tuple):
        return f"({fmt(tree)})" if tree < 0 else fmt(tree)
    left, op, right = tree
    wrap = lambda t: f"({spell(t)})" if isinstance(t, tuple) else spell(t)  # noqa: E731
    return f"{wrap(left)} {op} {wrap(right)}"


_REACHES = (
    "{move} = {value}, leaving {left}; {plan} = {target} finishes it.",
    "Combining {a} and {b} gives {value}; with {left} left, {plan} makes {target}.",
    "If I take {move} = {value}, the numbers left are {left}, and {plan} reaches the target {target}.",
    "{plan} = {target} once I have {value}, so first {move} = {value}, leaving {left}.",
)
_OPEN = (
    "{move} = {value}, leaving {left}; I still need {target} from them.",
    "Combining {a} and {b} gives {value}; {target} is still to be made from {left}.",
    "I try {move} = {value}, which leaves {left} to make {target}.",
)
_LAST = (
    "{move} = {value}, the target, using the last two numbers.",
    "The last two numbers: {move} = {value}, which is the target {target}.",
    "{move} makes {value}, exactly the target.",
)
_MISS = (
    "{move} = {value}, the last number, though the target is {target}.",
    "The last two numbers give {move} = {value}, not {target}.",
)
_ANSWER = (
    "{expr} uses {numbers}, each once, and equals {value}.",
    "With {numbers} each used once, {expr} = {value}.",
)


def explain(numbers: tuple[Fraction, ...], target: Fraction, action: str,
            rng: random.Random | None = None) -> str | None:
    """Why ``action`` with ``numbers`` left (None for an action the env would refuse)."""
    move = read_action(action, numbers)
    if move[0] == "invalid":
        return None
    if move[0] == "answer":
        try:
            value, used = eval_expression(move[1])
        except ValueError:
            return None
        expr = move[1].strip().rstrip(".").split("=")[0].strip()
        return say(rng, _ANSWER, expr=expr, numbers=listing(sorted(used)), value=fmt(value))
    _, a, op, b, value, rest = move
    fields = dict(move=f"{fmt(a)} {op} {fmt(b)}", a=fmt(a), b=fmt(b), value=fmt(value),
                  target=fmt(target), left=listing([fmt(x) for x in rest]))
    if len(rest) == 1:
        return say(rng, _LAST if value == target else _MISS, **fields)
    plan = solve(rest, target)
    if plan is None:
        return say(rng, _OPEN, **fields)
    return say(rng, _REACHES, plan=spell(plan), **fields)
