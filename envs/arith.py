"""Shared base for "combine two numbers" puzzles (Game of 24, Countdown).

The player repeatedly replaces two of the remaining numbers by their sum, difference, product or
quotient until one number is left, or submits a whole expression with ``answer``. Arithmetic is
exact (:class:`fractions.Fraction`, never floats): ``8 / 3`` leaves ``8/3``, and actions write
fractions the same way (``3 - 8/3``), so ``8 / (3 - 8/3) = 24`` is reached. Every number must be
used exactly once. Subclasses only differ in how tasks are generated and worded.

With the task knob ``answer=on`` (task data ``answer_step``) reaching the target is not the end:
with only the target left, the episode waits for ``answer EXPR``, the whole expression over the
task's numbers, checked exactly (Tree-of-Thoughts' Game24 protocol: three combines, then the
expression). ``answer EXPR`` is accepted from any state in both modes.

The state is an immutable :class:`ArithState` (value snapshots) holding the path of combines that
led to it, so ``state_key()`` keeps states reached by different histories apart (a search that
wants them merged asks for dedup: :meth:`ArithmeticEnv.dedup_key` is the key of the numbers left).
"""
from __future__ import annotations

import ast
import re
from fractions import Fraction
from functools import lru_cache
from typing import Any, NamedTuple, Sequence

from omrl_search.env import ValueSnapshots, stable_hash
from omrl_search.types import StepResult, Task

from ._text_env import Range, TextEnv, episode_over, step_result, task_knobs

Number = int | Fraction

_NUM = r"-?\d+(?:/\d+)?"
_OPS = {"+": "+", "-": "-", "*": "*", "/": "/", "x": "*", "×": "*", "÷": "/", "−": "-"}
_STEP_RE = re.compile(rf"^({_NUM})\s*([-+*/x×÷−])\s*({_NUM})(?:\s*=\s*{_NUM})?$", re.IGNORECASE)
_ANSWER_RE = re.compile(r"^answer\b\s*:?\s*(.*)$", re.IGNORECASE | re.DOTALL)


class ArithState(NamedTuple):
    numbers: tuple[Fraction, ...]  # remaining numbers, sorted
    original: tuple[int, ...]  # the task's numbers, sorted (for ``answer`` checks)
    target: Fraction
    steps: int = 0
    limit: int = 6
    done: bool = False
    truncated: bool = False  # ended by the step limit
    success: bool = False
    answer: str = ""
    note: str = ""  # the message of the last step, shown above the numbers
    path: tuple[str, ...] = ()  # the combines so far ("8 / 3"; + and * smaller operand first)
    answer_step: bool = False  # with only the target left, wait for ``answer EXPR``


def fmt(x: Number) -> str:
    """``24``, ``-5`` or ``8/3``: the syntax actions use for numbers (``str`` of an int or a
    Fraction already is; converting first would cost ~1 µs a number)."""
    return str(x) if type(x) is Fraction or type(x) is int else str(Fraction(x))


def _frac(x: Number) -> Fraction:
    """``x`` as a Fraction; one already a Fraction is kept (``Fraction(f)`` costs ~1 µs)."""
    return x if type(x) is Fraction else Fraction(x)


def parse_number(token: str) -> Fraction:
    """A number token of an action (``-5``, ``8/3``), exactly as ``Fraction(token)`` reads it but
    without its regex; ``ZeroDivisionError`` for ``x/0``."""
    num, _, den = token.partition("/")
    return Fraction(int(num), int(den)) if den else Fraction(int(num))


def _norm(x: Number) -> Number:
    """An int when ``x`` is integral (ints are much faster than Fractions in the solver)."""
    return x.numerator if isinstance(x, Fraction) and x.denominator == 1 else x


def apply_op(a: Number, op: str, b: Number) -> Number | None:
    """``a op b`` exactly; None on division by zero."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if b == 0:
        return None
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return _norm(_frac(a) / b)


def _moves(a: Number, b: Number):
    """Distinct ``(a', op, b', value)`` moves on a pair; commutative ops in one order only."""
    yield a, "+", b, a + b
    yield a, "*", b, a * b
    yield a, "-", b, a - b
    if a != b:
        yield b, "-", a, b - a
    for x, y in ((a, b), (b, a)) if a != b else ((a, b),):
        value = apply_op(x, "/", y)
        if value is not None:
            yield x, "/", y, value


# --- solver ----------------------------------------------------------------------------------
# An expression tree is a number (a leaf) or ``(left, op, right)``. The solver splits the multiset
# in two: the smaller side (<= 3 numbers) enumerates all its values from a table, the other side
# must then reach the one value that completes the target, recursively. This is exact and
# complete, and much faster than a move-by-move DFS on 5-6 numbers (no dead subtrees re-explored).


def _splits(nums: tuple) -> list[tuple[tuple, tuple]]:
    """Distinct ``(smaller, larger)`` splits of a sorted multiset into two non-empty parts."""
    n, out = len(nums), {}
    for mask in range(1, 1 << n, 2):  # masks holding nums[0]: each unordered split once
        if mask == (1 << n) - 1:
            continue
        a = tuple(x for i, x in enumerate(nums) if mask >> i & 1)
        b = tuple(x for i, x in enumerate(nums) if not mask >> i & 1)
        out.setdefault((a, b) if len(a) <= len(b) else (b, a))
    return list(out)


@lru_cache(maxsize=1 << 16)
def _table(nums: tuple) -> dict:
    """Every value reachable using all of ``nums`` (small multisets), with one tree for each."""
    if len(nums) == 1:
        return {nums[0]: nums[0]}
    out: dict = {}
    for left, right in _splits(nums):
        for a, ta in _table(left).items():
            for b, tb in _table(right).items():
                for x, op, y, value in _moves(a, b):
                    out.setdefault(_norm(value), (ta, op, tb) if x == a else (tb, op, ta))
    return out


def _completions(a: Number, t: Number):
    """``(r, build)``: the value ``r`` the other side needs so that ``a`` and ``r`` make ``t``."""
    yield t - a, lambda ta, tb: (ta, "+", tb)
    yield a - t, lambda ta, tb: (ta, "-", tb)
    yield t + a, lambda ta, tb: (tb, "-", ta)
    if a != 0:
        yield _norm(_frac(t) / a), lambda ta, tb: (ta, "*", tb)
        yield _norm(t * a), lambda ta, tb: (tb, "/", ta)
        if t != 0:
            yield _norm(_frac(a) / t), lambda ta, tb: (ta, "/", tb)


def _lookup(nums: tuple, t: Number, table: int):
    return _table(nums).get(t) if len(nums) <= table else _find(nums, t, table)


@lru_cache(maxsize=1 << 18)
def _find(nums: tuple, t: Number, table: int):
    for small, big in _splits(nums):
        for a, ta in _table(small).items():
            if a == 0 and t == 0:  # 0 * anything: any expression over the other side will do
                tb = big[0]
                for x in big[1:]:
                    tb = (tb, "+", x)
                return (ta, "*", tb)
            for r, build in _completions(a, t):
                tb = _lookup(big, r, table)
                if tb is not None:
                    return build(ta, tb)
    return None


def solve(numbers, target):
    """An expression tree using every number once that equals ``target``, or None (exact)."""
    nums = tuple(sorted(_norm(_frac(x)) for x in numbers))
    # Tables of 4-multisets pay off when many targets are asked of them (5+ numbers).
    return _lookup(nums, _norm(_frac(target)), 3 if len(nums) <= 4 else 4)


def solvable(numbers, target) -> bool:
    """True when ``numbers`` can make ``target``, each used exactly once."""
    return solve(numbers, target) is not None


def first_move(tree) -> tuple[Number, str, Number] | None:
    """A combine step whose operands are both numbers (None for a bare number)."""
    if not isinstance(tree, tuple):
        return None
    left, op, right = tree
    if not isinstance(left, tuple) and not isinstance(right, tuple):
        return left, op, right
    return first_move(left) or first_move(right)


def replay(original, path) -> list[tuple[Number, Any]]:
    """``(value, tree)`` of each number left after the combines ``path`` (``"8 / 3"``) from the
    ``original`` numbers: the trees are what the numbers are made of."""
    left: list[tuple[Number, Any]] = [(x, x) for x in original]
    for move in path:
        a, op, b = move.split(" ")
        a, b = _norm(parse_number(a)), _norm(parse_number(b))
        ia = next(i for i, (v, _) in enumerate(left) if v == a)
        ta = left.pop(ia)[1]
        ib = next(i for i, (v, _) in enumerate(left) if v == b)
        tb = left.pop(ib)[1]
        left.append((_norm(apply_op(a, op, b)), (ta, op, tb)))
    return left


def to_text(tree) -> str:
    """The tree as a fully parenthesised expression, e.g. ``8 / (3 - 8 / 3)``."""
    if not isinstance(tree, tuple):
        return fmt(tree)
    left, op, right = tree
    wrap = lambda t: f"({to_text(t)})" if isinstance(t, tuple) else to_text(t)  # noqa: E731
    return f"{wrap(left)} {op} {wrap(right)}"


# --- answer expressions ----------------------------------------------------------------------
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def eval_expression(text: str) -> tuple[Fraction, list[int]]:
    """Evaluate an arithmetic expression exactly; return its value and the numbers it uses.

    Only integer literals, ``+ - * /`` and parentheses are accepted (parsed with :mod:`ast`,
    never evaluated as Python). Raises ``ValueError(reason)`` otherwise.
    """
    text = text.strip().rstrip(".").strip().strip("`").split("=")[0]
    text = text.replace("×", "*").replace("÷", "/").replace("−", "-")
    text = re.sub(r"(?<=[\d)\s])[xX](?=[\d(\s])", "*", text)
    if not text.strip():
        raise ValueError("the answer has no expression")
    if len(text) > 200:
        raise ValueError("the expression is too long")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse the expression {text.strip()!r}") from None
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("the expression divides by zero")
            return apply_op(left, _BINOPS[type(node.op)], right)
        raise ValueError("only integers, + - * / and parentheses are allowed in the answer")

    value = walk(tree.body)
    return Fraction(value), used


def read_action(action: str, numbers: tuple[Fraction, ...]) -> tuple:
    """What ``action`` asks in a state with ``numbers`` left: ``("answer", expression)``,
    ``("combine", a, op, b, value, numbers after)`` or ``("invalid", why)``."""
    text = action.strip().strip("`'\"").strip().rstrip(".!").strip()
    m = _ANSWER_RE.match(text)
    if m:
        return "answer", m.group(1)
    m = _STEP_RE.match(text)
    if not m:
        return "invalid", "empty action" if not text else f"cannot parse {text[:60]!r}"
    try:
        a, op, b = parse_number(m.group(1)), _OPS[m.group(2).lower()], parse_number(m.group(3))
    except ZeroDivisionError:
        return "invalid", "a number has a zero denominator"
    rest = list(numbers)
    for x in (a, b):
        try:
            rest.remove(x)
        except ValueError:
            return "invalid", f"{fmt(x)} is not among the numbers left"
    value = apply_op(a, op, b)
    if value is None:
        return "invalid", "division by zero"
    rest.append(_frac(value))
    return "combine", a, op, b, value, tuple(sorted(rest))


# --- the env ---------------------------------------------------------------------------------
class ArithmeticEnv(ValueSnapshots, TextEnv):
    """Reach ``target`` from the task's numbers, combining two numbers per step.

    Task ``data``: ``{"numbers": [ints], "target": int}``. Subclasses provide ``tasks``,
    ``task_from_dict`` and the wording.
    """

    description = "Combine numbers with + - * / to reach a target; every number used exactly once."
    # The first-turn prompt is the task's instruction, this help and the observation (no example
    # turn: the format's system text says Think/Act and constrained decoding enforces it); every
    # token here is prefilled at every node of a search, so the wording is kept short.
    action_help = "Actions: `a op b` on two numbers left (e.g. `8/3 * 9`) or `answer EXPR`, the whole expression."
    examples = ""
    max_steps = 6

    _shown: tuple[ArithState | None, str] = (None, "")  # observe()'s last state and its text

    def __init__(self) -> None:
        self.state: ArithState | None = None

    def limit_for(self, numbers: list[int]) -> int:
        """Steps allowed for a task (enough combines plus room for a few invalid attempts)."""
        return self.max_steps

    # --- episode ---------------------------------------------------------------------------
    def reset(self, task: Task) -> str:
        numbers = [int(x) for x in task.data["numbers"]]
        answer_step = bool(task.data.get("answer_step", False))
        self.state = ArithState(
            numbers=tuple(sorted(Fraction(x) for x in numbers)),
            original=tuple(sorted(numbers)),
            target=Fraction(task.data["target"]),
            limit=self.limit_for(numbers) + answer_step,  # one more step: the answer
            answer_step=answer_step,
        )
        return self.observe()

    def position(self):
        """The state without the last message: its key keeps the path of combines, so states
        reached by different histories stay apart (ToT's states are their histories)."""
        return self.state._replace(note="")

    def dedup_key(self) -> str:
        """The key of the numbers left (and the step count), without the path: two routes to
        the same numbers share it. For searches that merge transpositions on purpose. It is
        made at every snapshot, so it hashes only the fields that differ within one task (the
        task's numbers, target, limit and mode are the same for every state a search meets)."""
        s = self._require()
        return stable_hash((s.numbers, s.steps, s.done, s.truncated, s.success, s.answer))

    def observe(self) -> str:
        s = self._require()
        if self._shown[0] is not s:  # snapshot() right after step() shows the same state again
            board = f"Numbers left: {' '.join(map(fmt, s.numbers))} | target: {fmt(s.target)}"
            self._shown = (s, f"{s.note}\n{board}" if s.note else board)
        return self._shown[1]

    def step(self, action: str) -> StepResult:
        s = self._require()
        if s.done:
            return episode_over(s)
        move = read_action(action, s.numbers)
        if move[0] == "answer":
            return self._answer(move[1])
        if move[0] == "invalid":
            return self._invalid(move[1])
        _, a, op, b, value, rest = move
        # the path records the operation (``6 * 4`` is ``4 * 6``), the note what was written
        x, y = (b, a) if op in "+*" and b < a else (a, b)
        path = s.path + (f"{fmt(x)} {op} {fmt(y)}",)
        return self._advance(numbers=rest, note=f"{fmt(a)} {op} {fmt(b)} = {fmt(value)}", path=path)

    def final_answer(self) -> str | None:
        """``answer EXPR`` spelling the combines so far as one expression, when they reached
        the target (None otherwise)."""
        s = self._require()
        if len(s.numbers) != 1 or s.numbers[0] != s.target:
            return None
        ((_, tree),) = replay(s.original, s.path)
        return f"answer {to_text(tree)}"

    def valid_actions(self) -> list[str]:
        s = self._require()
        if s.done:
            return []
        if len(s.numbers) == 1:  # only the target left (answer step): write the expression
            return [self.final_answer()]
        nums, seen = s.numbers, set()
        for i in range(len(nums)):
            for j in range(i + 1, len(nums)):
                for x, op, y, _ in _moves(nums[i], nums[j]):
                    seen.add(f"{fmt(x)} {op} {fmt(y)}")
        return sorted(seen)

    def expert_action(self) -> str | None:
        s = self._require()
        if s.done:
            return None
        if len(s.numbers) == 1:
            return self.final_answer()
        move = first_move(solve(s.numbers, s.target))
        return None if move is None else f"{fmt(move[0])} {move[1]} {fmt(move[2])}"

    def exact_value(self) -> float:
        """1.0 when the numbers left can still make the target (the exact solver), 0.0 when
        not; a finished episode is its success. Any unfinished state has a step left, and
        ``answer EXPR`` (accepted from any state) can spell a solution in one step, so the step
        limit never turns a solvable state into a lost one."""
        s = self._require()
        if s.done:
            return float(s.success)
        return float(solvable(s.numbers, s.target))

    def value_key(self) -> str:
        """The numbers left (a multiset: the state keeps them sorted) and the target, and the
        answer mode: what :meth:`exact_value` depends on, so two states with one key are both
        solvable or both lost, in any task (the step count is left out for the reason given
        there)."""
        s = self._require()
        if s.done:
            return stable_hash(("done", s.success))
        return stable_hash((s.numbers, s.target, s.answer_step))

    def action_grammar(self) -> str | None:
        """``a op b`` over two numbers left, or ``answer EXPR`` (see :mod:`envs._arith_lang`)."""
        s = self._require()
        if s.done:
            return None
        from ._arith_lang import grammar  # the module reads this one's arithmetic

        return grammar(s.numbers, s.original)

    def explain(self, action: str, rng=None) -> str | None:
        """What ``action`` computes, what is left, and the rest of a way to the target."""
        s = self._require()
        if s.done:
            return None
        from ._arith_lang import explain

        return explain(s.numbers, s.target, action, rng)

    # --- helpers ---------------------------------------------------------------------------
    def _advance(self, *, numbers=None, note: str, valid: bool = True, answer: str | None = None,
                 success: bool = False, path: tuple[str, ...] | None = None) -> StepResult:
        """Count a step, apply the changes and end the episode when it is over."""
        s = self.state
        numbers = s.numbers if numbers is None else numbers
        steps = s.steps + 1
        done, truncated = answer is not None or len(numbers) == 1, False
        if answer is None and len(numbers) == 1:
            if s.answer_step and numbers[0] == s.target:
                done = False
                note += (f"\nOnly {fmt(s.target)} is left: now write the whole expression, "
                         "`answer EXPR`.")
            else:
                answer, success = fmt(numbers[0]), numbers[0] == s.target
                if not success:
                    note += f"\nFailed: {answer} is not {fmt(s.target)}."
        if success:
            note += f"\nSolved: reached {fmt(s.target)}."
        elif not done and steps >= s.limit:
            done, truncated, answer = True, True, ""
            note += f"\nOut of steps ({s.limit}); the puzzle is not solved."
        self.state = s._replace(numbers=numbers, steps=steps, done=done, truncated=truncated,
                                success=success, answer=answer or "", note=note,
                                path=s.path if path is None else path)
        return step_result(self.state, self.observe(), 1.0 if success else 0.0, valid=valid)

    def _invalid(self, why: str) -> StepResult:
        return self._advance(note=self.invalid_note(why), valid=False)

    def _answer(self, expr: str) -> StepResult:
        s = self.state
        try:
            value, used = eval_expression(expr)
        except ValueError as exc:
            return self._invalid(str(exc))
        if sorted(used) != list(s.original):
            note = (f"Failed: your expression uses {' '.join(map(str, sorted(used)))} but must use "
                    f"exactly {' '.join(map(str, s.original))}, each once.")
            return self._advance(note=note, answer=fmt(value), success=False)
        note = f"{expr.strip().rstrip('.').split('=')[0].strip()} = {fmt(value)}"
        if value != s.target:
            note += f"\nFailed: {fmt(value)} is not {fmt(s.target)}."
        return self._advance(note=note, answer=fmt(value), success=value == s.target)


def instruction(numbers: list[int], target: int, answer_step: bool = False) -> str:
    """The task's instruction (short: it is in every prompt of a search)."""
    text = f"Use the numbers {' '.join(map(str, numbers))} and + - * / to make {target}, each number once."
    return text + f" Once only {target} is left, write `answer EXPR`." if answer_step else text


def arith_knobs(env: str, split: str, given: dict[str, Any], known: dict[str, Range],
                answer: Any = None, splits: Sequence[str] = ("train", "test")
                ) -> tuple[str, dict[str, Range], bool]:
    """:func:`~envs._text_env.task_knobs` plus the choice knob ``answer=on|off`` (in the split,
    ``"test:level=2,answer=on"``, or the keyword ``answer``: on, off or a bool, which wins):
    returns ``(split, knobs, answer step on)``; a bad value is one ValueError line."""
    if isinstance(answer, bool):
        answer = "on" if answer else "off"
    split, knobs = task_knobs(env, split, {**given, "answer": answer},
                              {**known, "answer": ("on", "off")}, splits)
    return split, knobs, knobs.pop("answer", "off") == "on"


def answer_step_of(row: dict[str, Any]) -> bool:
    """A task row's ``answer_step`` (default false); one ValueError line unless a bool."""
    value = row.get("answer_step", False)
    if not isinstance(value, bool):
        raise ValueError(f"answer_step must be true or false, got {value!r}")
    return value


def check_numbers(row: dict[str, Any], count: range, low: int, high: int) -> list[int]:
    """Validate ``row["numbers"]`` for ``task_from_dict``; raise ``ValueError(reason)``."""
    nums = row.get("numbers")
    ok = (isinstance(nums, list) and len(nums) in count
          and all(type(x) is int and low <= x <= high for x in nums))
    if not ok:
        size = f"{count.start}" if len(count) == 1 else f"{count.start} to {count.stop - 1}"
        raise ValueError(f"numbers must be a list of {size} integers from {low} to {high}, got {nums!r}")
    return nums
