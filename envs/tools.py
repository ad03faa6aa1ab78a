"""Tool use with deterministic APIs: multi-step office tasks whose end state is checked.

The agent has a calendar (``calendar``, ``book``, ``cancel``), an expense ledger (``expense``),
a calculator (``calc``), a unit and currency converter (``convert``) and lookups over small
shipped tables (``lookup``: staff, offices, prices, rates, holidays; see :mod:`envs._toolkit`).
Each seed makes a three-week calendar and four tasks on it:

* *meeting* — book a meeting on the first weekday on or after a date that is no public holiday
  and is free at the time asked, its length given in hours (``book`` takes minutes);
* *call* — book a call at a colleague's local time (their office's UTC offset, looked up);
* *expense* — record the price of some items from the price list in another currency;
* *cleanup* — cancel the meetings of a day that are longer than a number of hours.

``finish`` compares the calendar and the ledger with the expected ones (ids aside, amounts to the
cent). The expert first makes the reference's lookups the agent has not made yet (so its
demonstrations look before they act), then repairs the difference between the current and the
expected state (cancel what is extra, book or record what is missing) and finishes. A stable hash
of the seed picks the split. The state is plain data (value snapshots).
"""
from __future__ import annotations

import json
import random
import re
from datetime import date, timedelta
from fractions import Fraction
from functools import lru_cache
from typing import Any, NamedTuple

from omrl_search.env import ValueSnapshots, register_env, stable_hash
from omrl_search.types import Task

from . import _toolkit as kit
from ._textactions import (ActionEnv, ActionError, Outcome, SeededTasks, norm_cell, parse_action,
                           split_args, task_id_of)

STARTS = ("2025-04-14", "2025-04-28", "2025-05-26", "2025-06-02")  # Mondays near holidays
TITLES = ("Standup", "Budget review", "1:1", "Design review", "Planning", "Hiring panel", "Demo")
READS = ("calendar", "lookup", "convert", "calc")

Event = tuple[str, str, int, int, str]  # (id, date, start minute, minutes, title)
Expense = tuple[str, Fraction, str, str]  # (id, amount, currency, note)


def _day(text: str) -> date:
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", text.strip()):
        raise ActionError(f"dates are written YYYY-MM-DD, got {text.strip()[:20]!r}")
    try:
        return date.fromisoformat(text.strip())
    except ValueError:
        raise ActionError(f"no such date {text.strip()!r}") from None


def _minute(text: str) -> int:
    m = re.fullmatch(r"(\d{1,2}):(\d{2})", text.strip())
    if m is None or int(m.group(1)) > 23 or int(m.group(2)) > 59:
        raise ActionError(f"times are written HH:MM (24 h), got {text.strip()[:20]!r}")
    return int(m.group(1)) * 60 + int(m.group(2))


def hhmm(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


def _overlap(events, day: str, start: int, minutes: int) -> Event | None:
    return next((e for e in events if e[1] == day and e[2] < start + minutes and start < e[2] + e[3]), None)


def _event_key(e) -> tuple:
    return e[1], e[2], e[3], norm_cell(e[4])


def _books(events: tuple[Event, ...], ledger: tuple[Expense, ...]) -> str:
    return stable_hash((events, ledger))


def _read_key(verb: str, arg: str) -> str:
    """A read action in a canonical form (what ``seen`` records and the plan is matched by)."""
    if verb == "calendar":
        return f"calendar {_day(arg).isoformat()}"
    if verb == "lookup":
        return "lookup {} {}".format(*kit.lookup(arg)[1])
    if verb == "convert":
        text, _, unit = kit.convert(arg)
        return f"convert {text.split(' = ')[0].lower()} to {unit}"
    return "calc " + "".join(arg.split())


class ToolSpec(NamedTuple):
    key: str
    events: tuple[Event, ...]  # the calendar at the start
    goal_events: tuple[Event, ...]  # the expected calendar (ids do not matter)
    goal_ledger: tuple[tuple[Fraction, str, str], ...]  # expected (amount, currency, note)
    plan: tuple[str, ...]  # the reference's read actions
    plan_keys: tuple[str, ...]


class ToolState(NamedTuple):
    spec: ToolSpec
    events: tuple[Event, ...]
    ledger: tuple[Expense, ...] = ()
    books: str = ""  # a hash of the events and the ledger (stands in for them in the state key)
    serial: int = 0  # ids handed out so far
    seen: tuple[str, ...] = ()  # read actions made (canonical, sorted)
    steps: int = 0
    limit: int = 16
    done: bool = False
    truncated: bool = False  # ended by the step limit
    success: bool = False
    answer: str = ""
    note: str = ""


@register_env("tools")
class ToolsEnv(ValueSnapshots, ActionEnv):
    """Office tasks over a calendar, a ledger, a calculator, a converter and table lookups."""

    description = ("Tool use: finish office tasks with a calendar, an expense ledger, a calculator, a "
                   "converter and lookups.")
    action_help = (
        "Actions: `calendar: YYYY-MM-DD` shows a day; `book: YYYY-MM-DD, HH:MM, MINUTES, TITLE` "
        "books a meeting; `cancel: ID` removes an event or expense; `expense: AMOUNT CURRENCY, NOTE` "
        "records an expense; `calc: EXPRESSION`; `convert: VALUE UNIT to UNIT` (time, length, mass, "
        "C/F, currencies); `lookup: TABLE` or `lookup: TABLE, KEY` (tables: staff, offices, prices, "
        "rates, holidays); `finish` when the task is done."
    )
    examples = "Think: The meeting length is in hours but book takes minutes.\nAct: convert: 1.5 h to min"
    verbs = {"calendar": "calendar: DATE", "book": "book: DATE, HH:MM, MINUTES, TITLE", "cancel": "cancel: ID",
             "expense": "expense: AMOUNT CURRENCY, NOTE", "calc": "calc: EXPRESSION",
             "convert": "convert: VALUE UNIT to UNIT", "lookup": "lookup: TABLE, KEY", "finish": "finish"}
    reasons = {
        "calendar": ("I check the calendar on {a0} first.", "I look at {a0} in the calendar before changing anything."),
        "book": ("The task asks for this meeting, so I book {a3} on {a0} at {a1} for {a2} minutes.",
                 "I book {a3} on {a0} at {a1}, as the task asks."),
        "cancel": ("Entry {a0} should not be there, so I cancel it.", "I cancel {a0}, as the task asks."),
        "expense": ("The task asks to record this expense: {arg}.", "I record the expense of {a0}."),
        "calc": ("I need {arg} computed.", "I work out {arg}."),
        "convert": ("The units differ, so I convert {arg}.", "I convert {arg}, the unit I need."),
        "lookup": ("I look up {arg} for the facts the task needs.", "The task depends on {arg}, so I look it up."),
        "finish": ("Everything the task asks is done, so I finish.", "The task is complete, so I finish."),
    }
    max_steps = 16

    def __init__(self) -> None:
        self.state: ToolState | None = None

    def reset(self, task: Task) -> str:
        spec = spec_of(task.data)
        self.state = ToolState(spec, spec.events, books=_books(spec.events, ()), serial=len(spec.events),
                               limit=self.max_steps, note=f"Tools ready. The calendar is in {kit.HOME} time.")
        return self.observe()

    def position(self) -> tuple:
        """The state with the task, the events and the ledger replaced by their hashes (keeps
        the state key cheap)."""
        return self.state._replace(spec=self.state.spec.key, events=(), ledger=())

    # --- actions --------------------------------------------------------------------------
    def _read(self, verb: str, arg: str, text: str) -> Outcome:
        seen = tuple(sorted(set(self.state.seen) | {_read_key(verb, arg)}))
        return Outcome(text, changes={"seen": seen})

    def do_calendar(self, arg: str) -> Outcome:
        day = _day(arg)
        items = [f"{e[0]} {hhmm(e[2])}-{hhmm(e[2] + e[3])} {e[4]}" for e in self.state.events
                 if e[1] == day.isoformat()]
        return self._read("calendar", arg, f"{day:%A} {day}: {'; '.join(items) or 'no events'}")

    def do_lookup(self, arg: str) -> Outcome:
        return self._read("lookup", arg, kit.lookup(arg)[0])

    def do_convert(self, arg: str) -> Outcome:
        return self._read("convert", arg, kit.convert(arg)[0])

    def do_calc(self, arg: str) -> Outcome:
        return self._read("calc", arg, kit.calc(arg))

    def do_book(self, arg: str) -> Outcome:
        day, start, minutes, title = split_args(arg, 4, 4, self.verbs["book"])
        day, start = _day(day).isoformat(), _minute(start)
        if not re.fullmatch(r"\d{1,3}", minutes) or not 0 < int(minutes) <= 600:
            raise ActionError(f"MINUTES must be a whole number of minutes (1 to 600), got {minutes[:20]!r}")
        minutes = int(minutes)
        if start + minutes > 24 * 60:
            raise ActionError("the meeting must end by midnight")
        clash = _overlap(self.state.events, day, start, minutes)
        if clash is not None:
            return Outcome(f"Not booked: {hhmm(start)}-{hhmm(start + minutes)} overlaps {clash[0]} "
                           f"{hhmm(clash[2])}-{hhmm(clash[2] + clash[3])} {clash[4]}.")
        eid, s = f"E{self.state.serial + 1}", self.state
        events = tuple(sorted(s.events + ((eid, day, start, minutes, title[:80]),), key=lambda e: e[1:3]))
        return Outcome(f"Booked {eid}: {day} {hhmm(start)}-{hhmm(start + minutes)} {title[:80]}.",
                       changes={"events": events, "serial": s.serial + 1, "books": _books(events, s.ledger)})

    def do_cancel(self, arg: str) -> Outcome:
        s, ref = self.state, arg.strip().upper()
        events = tuple(e for e in s.events if e[0] != ref)
        ledger = tuple(x for x in s.ledger if x[0] != ref)
        if len(events) + len(ledger) == len(s.events) + len(s.ledger):
            raise ActionError(f"no event or expense with id {arg.strip()[:20]!r}")
        return Outcome(f"Cancelled {ref}.", changes={"events": events, "ledger": ledger,
                                                     "books": _books(events, ledger)})

    def do_expense(self, arg: str) -> Outcome:
        money, note = split_args(arg, 2, 2, self.verbs["expense"])
        m = re.fullmatch(r"(\S+)\s+([A-Za-z]{3})", money)
        if m is None or m.group(2).upper() not in kit.RATES:
            raise ActionError(f"write the amount and a currency code ({', '.join(kit.RATES)}), e.g. `12.50 EUR`")
        amount = kit.number(m.group(1), "the amount")
        if amount <= 0:
            raise ActionError("the amount must be positive")
        s, xid = self.state, f"X{self.state.serial + 1}"
        entry = (xid, amount, m.group(2).upper(), note[:80])
        ledger = s.ledger + (entry,)
        return Outcome(f"Recorded {xid}: {kit.fmt(amount)} {entry[2]} for {entry[3]}.",
                       changes={"ledger": ledger, "serial": s.serial + 1, "books": _books(s.events, ledger)})

    def do_finish(self, _: str) -> Outcome:
        extra, missing, extra_x, missing_x = self._diff()
        ok = not (extra or missing or extra_x or missing_x)
        s = self.state
        start = set(s.spec.events)
        changes = [f"+{e[1]} {hhmm(e[2])} {e[3]}min {norm_cell(e[4])}" for e in s.events if e not in start]
        changes += [f"-{e[0]}" for e in s.spec.events if e not in s.events]
        changes += [f"+{kit.fmt(x[1])} {x[2]} {norm_cell(x[3])}" for x in s.ledger]
        answer = "; ".join(changes) or "no changes"
        verdict = "the task is done" if ok else "the calendar or the ledger is not as the task asks"
        return Outcome(f"Finished: {verdict}.", final=(ok, answer))

    def _diff(self) -> tuple[list[Event], list[Event], list[Expense], list[tuple]]:
        """Events and expenses that are extra, and expected ones that are missing."""
        s = self.state
        missing, extra = list(s.spec.goal_events), []
        for e in s.events:
            hit = next((g for g in missing if _event_key(g) == _event_key(e)), None)
            if hit is None:
                extra.append(e)
            else:
                missing.remove(hit)
        missing_x, extra_x = list(s.spec.goal_ledger), []
        for x in s.ledger:
            hit = next((g for g in missing_x if abs(g[0] - x[1]) <= Fraction(1, 100) and g[1] == x[2]
                        and g[2] == norm_cell(x[3])), None)
            if hit is None:
                extra_x.append(x)
            else:
                missing_x.remove(hit)
        return extra, missing, extra_x, missing_x

    # --- expert and exploration ---------------------------------------------------------
    def expert_action(self) -> str | None:
        s = self._require()
        if s.done:
            return None
        for action, key in zip(s.spec.plan, s.spec.plan_keys):
            if key not in s.seen:
                return action
        extra, missing, extra_x, missing_x = self._diff()
        if extra or extra_x:
            return f"cancel: {(extra or extra_x)[0][0]}"
        if missing:
            _, day, start, minutes, title = missing[0]
            return f"book: {day}, {hhmm(start)}, {minutes}, {title}"
        if missing_x:
            amount, cur, note = missing_x[0]
            return f"expense: {kit.fmt(amount)} {cur}, {note}"
        return "finish"

    def valid_actions(self) -> list[str]:
        """Reads (the reference's lookups, the first days of the calendar) and ``finish``."""
        s = self._require()
        if s.done:
            return []
        days = sorted({e[1] for e in s.spec.events})[:5]
        return list(dict.fromkeys([*s.spec.plan, "lookup: holidays", *(f"calendar: {d}" for d in days),
                                   "finish"]))

    # --- task sets ------------------------------------------------------------------------
    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        return _TASKS.take(split, limit)

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        instruction = row.get("instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise ValueError(f"instruction must be a non-empty string, got {instruction!r}")
        data = {k: row[k] for k in ("calendar", "goal", "plan") if k in row}
        spec = spec_of(data)
        return Task(env="tools", task_id=task_id_of(row, f"tools-{spec.key}"), split=row.get("split", "test"),
                    instruction=instruction.strip(), data=data)


def spec_of(data: dict[str, Any]) -> ToolSpec:
    """The prepared task of ``data``; raise ``ValueError(reason)`` when it is unusable."""
    return _spec(json.dumps(data, sort_keys=True))


@lru_cache(maxsize=4096)
def _spec(data_json: str) -> ToolSpec:
    data = json.loads(data_json)
    rows, goal, plan = data.get("calendar", []), data.get("goal"), data.get("plan", [])
    if not isinstance(rows, list) or not isinstance(goal, dict) or not isinstance(plan, list):
        raise ValueError("calendar must be a list, goal an object and plan a list")
    env = ToolsEnv()
    empty = ToolSpec("", (), (), (), (), ())
    env.state = ToolState(empty, (), limit=10_000)

    def do(action: str, what: str) -> Outcome:
        try:
            verb, arg = parse_action(action, ToolsEnv.verbs)
            if verb in ("finish",) or (what == "plan" and verb not in READS):
                raise ActionError(f"{verb} is not allowed here")
            return getattr(env, f"do_{verb}")(arg)
        except ActionError as exc:
            raise ValueError(f"{what}: {action[:80]!r} fails: {exc}") from None

    def apply(out: Outcome, what: str) -> None:
        if out.text.startswith("Not booked"):
            raise ValueError(f"{what}: {out.text}")
        env.state = env.state._replace(**(out.changes or {}))

    for row in rows:
        if not (isinstance(row, list) and len(row) == 4):
            raise ValueError(f"calendar rows are [date, HH:MM, minutes, title], got {row!r}")
        apply(do(f"book: {', '.join(map(str, row))}", "calendar"), "calendar")
    start = env.state.events
    unknown = set(goal) - {"add", "remove", "expenses"}
    if unknown or not any(goal.get(k) for k in ("add", "remove", "expenses")):
        raise ValueError("goal must have add, remove and/or expenses (and nothing else), and change something")
    for ref in goal.get("remove", []):
        apply(do(f"cancel: {ref}", "goal remove"), "goal remove")
    for row in goal.get("add", []):
        if not (isinstance(row, list) and len(row) == 4):
            raise ValueError(f"goal add rows are [date, HH:MM, minutes, title], got {row!r}")
        apply(do(f"book: {', '.join(map(str, row))}", "goal add"), "goal add")
    for row in goal.get("expenses", []):
        if not (isinstance(row, list) and len(row) == 3):
            raise ValueError(f"goal expenses are [amount, currency, note], got {row!r}")
        apply(do(f"expense: {row[0]} {row[1]}, {row[2]}", "goal expense"), "goal expense")
    for action in plan:
        if not isinstance(action, str):
            raise ValueError(f"plan actions must be strings, got {action!r}")
        do(action, "plan")
    keys = tuple(_read_key(*parse_action(a, ToolsEnv.verbs)) for a in plan)
    return ToolSpec(stable_hash(data_json), start, env.state.events,
                    tuple((x[1], x[2], norm_cell(x[3])) for x in env.state.ledger), tuple(plan), keys)


# --- generated tasks -------------------------------------------------------------------------
def _calendar(rng: random.Random) -> tuple[date, list[list]]:
    """Three weeks of working days with 1-4 meetings each, from a Monday near holidays."""
    start, rows = date.fromisoformat(rng.choice(STARTS)), []
    for i in range(19):
        day = (start + timedelta(days=i)).isoformat()
        if (start + timedelta(days=i)).weekday() >= 5 or day in kit.HOLIDAYS:
            continue
        booked: list[Event] = []
        for _ in range(rng.randint(1, 4)):
            t, m = rng.randrange(9 * 60, 17 * 60 + 1, 30), rng.choice((30, 60, 90, 120))
            if _overlap(booked, day, t, m) is None:
                booked.append(("", day, t, m, rng.choice(TITLES)))
        rows += [[day, hhmm(e[2]), e[3], e[4]] for e in sorted(booked, key=lambda e: e[2])]
    return start, rows


def _events(rows: list[list]) -> list[Event]:
    return [(f"E{i}", r[0], _minute(r[1]), r[2], r[3]) for i, r in enumerate(rows, 1)]


def _weekday(rng: random.Random, start: date, span: int) -> date:
    days = [start + timedelta(days=i) for i in range(span)]
    return rng.choice([d for d in days if d.weekday() < 5 and d.isoformat() not in kit.HOLIDAYS])


def _meeting(rng: random.Random, start: date, rows: list[list]):
    first, t = start + timedelta(days=rng.randint(0, 9)), rng.randrange(9 * 60, 16 * 60 + 1, 30)
    hours = rng.choice(("0.5", "1", "1.5", "2"))
    minutes, title = int(Fraction(hours) * 60), rng.choice(("Retro", "Kickoff", "Roadmap sync", "Offsite prep"))
    plan, day, events = ["lookup: holidays", f"convert: {hours} h to min"], first, _events(rows)
    while day.weekday() >= 5 or day.isoformat() in kit.HOLIDAYS or _overlap(events, day.isoformat(), t, minutes):
        if day.weekday() < 5 and day.isoformat() not in kit.HOLIDAYS:
            plan.append(f"calendar: {day}")
        day += timedelta(days=1)
    if day == first or day > start + timedelta(days=18):
        return None
    return (f"Book a {hours}-hour meeting titled '{title}' at {hhmm(t)} on the first weekday on or after "
            f"{first:%A} {first} that is not a public holiday and where that time is free (`book` takes "
            "minutes). Then `finish`."), {"add": [[day.isoformat(), hhmm(t), minutes, title]]}, \
        plan + [f"calendar: {day}"]


def _call(rng: random.Random, start: date, rows: list[list]):
    name = rng.choice([n for n, (office, _) in kit.STAFF.items() if office != kit.HOME])
    office = kit.STAFF[name][0]
    day, local, minutes = _weekday(rng, start, 19), rng.randrange(8 * 60, 18 * 60 + 1, 60), rng.choice((30, 45, 60))
    home = local + int((kit.OFFICES[kit.HOME][0] - kit.OFFICES[office][0]) * 60)
    if not 8 * 60 <= home <= 19 * 60 - minutes or _overlap(_events(rows), day.isoformat(), home, minutes):
        return None
    return (f"Schedule a {minutes}-minute call titled 'Call with {name}' on {day:%A} {day} at {hhmm(local)} "
            f"in {name}'s local time. Our calendar is in {kit.HOME} time (UTC+1). Then `finish`."), \
        {"add": [[day.isoformat(), hhmm(home), minutes, f"Call with {name}"]]}, \
        [f"lookup: staff, {name}", f"lookup: offices, {office}"]


def _expense(rng: random.Random, start: date, rows: list[list]):
    item, qty = rng.choice(sorted(kit.PRICES)), rng.randint(2, 5)
    price, cur = kit.PRICES[item]
    target = rng.choice([c for c in ("EUR", "USD", "GBP", "CHF") if c != cur])
    total = qty * price
    cents = int(total * kit.RATES[cur] / kit.RATES[target] * 100 + Fraction(1, 2))
    return (f"Record an expense for {qty} x {item} from the price list, in {target} rounded to the cent, "
            f"with the note '{item}'. Then `finish`."), \
        {"expenses": [[f"{cents // 100}.{cents % 100:02d}", target, item]]}, \
        [f"lookup: prices, {item}", f"calc: {qty} * {kit.fmt(price)}", f"convert: {kit.fmt(total)} {cur} to {target}"]


def _cleanup(rng: random.Random, start: date, rows: list[list]):
    day, hours = _weekday(rng, start, 19).isoformat(), rng.choice(("0.5", "1", "1.5"))
    today = [e for e in _events(rows) if e[1] == day]
    longer = [e[0] for e in today if e[3] > Fraction(hours) * 60]
    if len(today) < 3 or not 0 < len(longer) < len(today):
        return None
    return (f"Cancel every meeting on {date.fromisoformat(day):%A} {day} that is longer than {hours} "
            f"hour{'' if hours == '1' else 's'}, and keep the others. Then `finish`."), \
        {"remove": longer}, [f"calendar: {day}", f"convert: {hours} h to min"]


def _make_tasks(seed: int, split: str) -> list[Task]:
    """One task of each kind on the calendar of ``seed`` (drafts that do not fit are redrawn)."""
    rng = random.Random(f"tools:{seed}")
    start, rows = _calendar(rng)
    tasks = []
    for j, kind in enumerate(rng.sample((_meeting, _call, _expense, _cleanup), 4)):
        for _ in range(30):
            draft = kind(rng, start, rows)
            if draft is not None:
                instruction, goal, plan = draft
                data = {"calendar": rows, "goal": goal, "plan": plan}
                try:
                    spec_of(data)
                except ValueError:
                    continue
                tasks.append(Task(env="tools", task_id=f"tools-{seed}-{j}", split=split,
                                  instruction=instruction, data=data))
                break
    return tasks


_TASKS = SeededTasks("tools", _make_tasks, {"train": 500, "test": 50})
