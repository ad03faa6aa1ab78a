"""A web shop in the spirit of WebShop (Yao et al. 2022): find and buy what an instruction asks for.

The shop sells a generated catalogue of 3,000 products (:mod:`envs._catalogue`: 24 product types in
6 categories, each product with attributes, option values such as size and colour, and a price).
Pages are the search page, result pages (10 products a page, up to 50 results ranked by BM25),
product pages and the final page. An instruction is written from a target product: its type, some
of its attributes, one value of some of its option kinds and a price bound above its price; any
product that meets all of them earns the full reward, as in WebShop:

    r = (|U_att ∩ Y_att| + |U_opt ∩ Y_opt| + 1[price < bound]) / (|U_att| + |U_opt| + 1) × r_type

where ``U`` is the goal, ``Y`` the bought product and the options chosen, and ``r_type`` is 1 for
the same product type, 0.5 for another type of the same category and 0.1 otherwise. Success means
r = 1. A stable hash of the target product picks the split, so train and test never share one.

The state is an immutable :class:`ShopState` (value snapshots) that carries the goal itself, so
a snapshot restores into any instance; search results are recomputed from the query (cached).
"""
from __future__ import annotations

import math
import random
import re
from functools import lru_cache
from typing import Any, NamedTuple

from omrl_search.env import ValueSnapshots, register_env, stable_hash
from omrl_search.types import StepResult, Task

from . import _catalogue as shop
from ._catalogue import Product, fmt_price
from ._text_env import TextEnv, episode_over, say, step_result, trying

PER_PAGE = 10
SPLIT_SIZES = {"train": 2000, "test": 50}
TEST_PERCENT = 20  # of the products: test tasks are written only from these
STEP_LIMIT = 15
MAX_QUERY = 200  # characters of a query kept (and shown)
BACK, PREV, NEXT, BUY = "back to search", "< prev", "next >", "buy now"
_ACTION_RE = re.compile(r"^(search|click)\s*\[(.*)\]$", re.IGNORECASE | re.DOTALL)
_OPTION_PHRASES = {"color": "in {} color", "size": "in size {}", "scent": "with {} scent",
                   "flavor": "in {} flavor", "capacity": "with {} capacity", "pack": "as a {}",
                   "count": "in a {} box", "power": "with {} output", "thickness": "{} thick"}


_REASONS = {  # why the expert's action, by what it does
    "search": ("I search for the {ptype} the instruction describes: {query}.",
               "The instruction asks for {ptype}, so I search for {query}."),
    "open": ("{pid} looks like what the instruction asks for, so I open it.",
             "Product {pid} meets the goal; I look at it."),
    "page": ("A product that meets the goal is on another page of results.",
             "The matching product is on another page, so I go there."),
    "back": ("No result here meets the goal, so I go back to the search.",
             "Nothing on these results fits, so I search again."),
    "unfit": ("This product does not meet the goal, so I go back to the results.",
              "Not the right product; back to the results."),
    "option": ("The instruction asks for {kind} {value}, so I choose it.", "I pick {value} for {kind}, as asked."),
    "buy": ("This product has what the instruction asks, options included, so I buy it.",
            "Everything matches the goal: buy now."),
}


class Goal(NamedTuple):
    target: str  # id of the product the instruction was written from
    ptype: str
    category: str
    attrs: tuple[str, ...]
    options: tuple[tuple[str, str], ...]  # (kind, value)
    max_price: int  # cents; a price must be strictly lower
    instruction: str


class ShopState(NamedTuple):
    goal: Goal
    page: str = "search"  # search | results | item | done
    query: str = ""
    page_no: int = 1
    item: str = ""  # product id on an item page (and the bought one at the end)
    chosen: tuple[tuple[str, str], ...] = ()  # options chosen on the item page, in kind order
    steps: int = 0
    limit: int = STEP_LIMIT
    done: bool = False
    truncated: bool = False  # ended by the step limit, nothing bought
    reward: float = 0.0
    success: bool = False
    answer: str = ""
    note: str = ""  # the message of the last step, shown above the page


# --- goals and reward ------------------------------------------------------------------------
def product(pid: str) -> Product:
    return shop.by_id()[pid]


def score(goal: Goal, p: Product, chosen: tuple[tuple[str, str], ...]) -> tuple[float, bool]:
    """WebShop's reward for buying ``p`` with options ``chosen`` (and whether it is a full match)."""
    hits = (len(set(goal.attrs) & set(p.attrs)) + len(set(goal.options) & set(chosen))
            + (p.price < goal.max_price))
    total = len(goal.attrs) + len(goal.options) + 1
    r_type = 1.0 if p.ptype == goal.ptype else 0.5 if p.category == goal.category else 0.1
    return hits / total * r_type, hits == total and r_type == 1.0


def satisfies(goal: Goal, p: Product) -> bool:
    """Whether buying ``p`` with the right options earns the full reward."""
    offered = dict(p.options)
    return (p.ptype == goal.ptype and set(goal.attrs) <= set(p.attrs) and p.price < goal.max_price
            and all(v in offered.get(k, ()) for k, v in goal.options))


def instruction(ptype: str, attrs, options, max_price: int, rng: random.Random) -> str:
    """``i need a t-shirt that is cotton and slim fit, in size small, and price lower than 30.00
    dollars`` (wording varied by ``rng``)."""
    lead = rng.choice(("i need", "i am looking for", "i want", "find me"))
    article = "an" if ptype[0] in "aeiou" else "a"
    text = f"{lead} {article} {ptype}"
    if attrs:
        text += f" {rng.choice(('that is', 'with'))} " + " and ".join(attrs)
    for kind, value in options:
        text += ", " + _OPTION_PHRASES.get(kind, kind + " {}").format(value)
    return f"{text}, and price lower than {max_price / 100:.2f} dollars"


def make_goal(p: Product, rng: random.Random) -> Goal:
    """A goal written from ``p``: 1-3 of its attributes, most option kinds, a price bound."""
    count = min(len(p.attrs), rng.choice((1, 2, 2, 3)))
    attrs = tuple(sorted(rng.sample(p.attrs, count), key=p.attrs.index))
    options = tuple((kind, rng.choice(values)) for kind, values in p.options if rng.random() < 0.8)
    bound = math.ceil(p.price * rng.uniform(1.05, 1.8) / 1000) * 1000  # next $10 above
    text = instruction(p.ptype, attrs, options, bound, rng)
    return Goal(p.pid, p.ptype, p.category, attrs, options, bound, text)


def product_split(pid: str) -> str:
    return "test" if int(stable_hash(("webshop", pid)), 16) % 100 < TEST_PERCENT else "train"


@lru_cache(maxsize=2)
def goals(split: str) -> tuple[Goal, ...]:
    """The split's goals, in generation order (computed once per process)."""
    pool = [p for p in shop.catalogue() if product_split(p.pid) == split]
    out: dict[tuple, Goal] = {}
    index = 0
    while len(out) < SPLIT_SIZES[split]:
        rng = random.Random(f"webshop:{split}:{index}")
        goal = make_goal(rng.choice(pool), rng)
        out.setdefault(goal[:6], goal)
        index += 1
    return tuple(out.values())


@lru_cache(maxsize=4096)
def expert_query(goal: Goal) -> str:
    """The first of a few ever more specific queries whose results hold a product meeting the
    goal: the attributes and type, then with the option values, then the target's title."""
    values = tuple(v for _, v in goal.options)
    tried = (" ".join((*goal.attrs, goal.ptype)), " ".join((*goal.attrs, *values, goal.ptype)),
             product(goal.target).title)
    for query in tried:
        if any(satisfies(goal, product(pid)) for pid in shop.search(query)):
            return query
    return tried[-1]


# --- the env ---------------------------------------------------------------------------------
@register_env("webshop")
class WebShopEnv(ValueSnapshots, TextEnv):
    """Search a generated shop, open products, choose options and buy the one asked for."""

    description = ("WebShop: search a web shop, open product pages, choose options (size, colour...) "
                   "and buy the product that matches the instruction.")
    action_help = (
        "Actions: `search[QUERY]` on the search page (e.g. `search[cotton t-shirt]`); "
        "`click[THING]` clicks a bracketed item of the page: a product id (e.g. `click[B0ABC12345]`), "
        "an option value (e.g. `click[large]`), `click[buy now]`, `click[next >]`, `click[< prev]` "
        "or `click[back to search]`."
    )
    examples = (
        "Think: The instruction asks for a cotton t-shirt, so I search for one.\n"
        "Act: search[cotton t-shirt]"
    )
    max_steps = STEP_LIMIT

    _shown: tuple[ShopState | None, str] = (None, "")  # observe()'s last state and its text

    def __init__(self) -> None:
        self.state: ShopState | None = None

    def reset(self, task: Task) -> str:
        self.state = ShopState(goal_from_data(task.data, task.instruction))
        return self.observe()

    def position(self):
        """The state without the last message, so equal positions share a state key."""
        return self.state._replace(note="")

    # --- pages -----------------------------------------------------------------------------
    def _results(self, s: ShopState) -> tuple[str, ...]:
        return shop.search(s.query)

    def clickables(self) -> list[str]:
        """The bracketed things of the current page, as ``click[...]`` takes them."""
        s = self._require()
        if s.page == "results":
            hits = self._results(s)
            pages = max(1, math.ceil(len(hits) / PER_PAGE))
            return ([BACK] + [PREV] * (s.page_no > 1) + [NEXT] * (s.page_no < pages)
                    + list(hits[(s.page_no - 1) * PER_PAGE:s.page_no * PER_PAGE]))
        if s.page == "item":
            return [BACK, PREV] + [v for _, values in product(s.item).options for v in values] + [BUY]
        return []

    def observe(self) -> str:
        s = self._require()
        if self._shown[0] is not s:
            self._shown = (s, "\n".join(x for x in (s.note, self._page(s)) if x))
        return self._shown[1]

    def _page(self, s: ShopState) -> str:
        head = f"Instruction: {s.goal.instruction}"
        if s.page == "search":
            return f"{head}\n[Search]"
        if s.page == "results":
            hits = self._results(s)
            if not hits:
                return f"{head}\n[{BACK}]\nNo products match \"{s.query}\"."
            pages = math.ceil(len(hits) / PER_PAGE)
            nav = " ".join(f"[{x}]" for x in (PREV, NEXT) if x in self.clickables())
            shown = [product(pid) for pid in hits[(s.page_no - 1) * PER_PAGE:s.page_no * PER_PAGE]]
            rows = [f"[{p.pid}] {p.title} | {fmt_price(p.price)}" for p in shown]
            title = f"Results for \"{s.query}\": page {s.page_no} of {pages} ({len(hits)} products)"
            return "\n".join([head, f"[{BACK}]", f"{title} {nav}".rstrip(), *rows])
        p = product(s.item)
        if s.page == "done":
            return f"{head}\nYou bought {p.title} ({p.pid}){_with(s.chosen)} for {fmt_price(p.price)}."
        chosen = dict(s.chosen)
        options = [f"{kind}: " + " ".join(f"[{v}]" + "*" * (chosen.get(kind) == v) for v in values)
                   for kind, values in p.options]
        lines = [head, f"[{BACK}] [{PREV}]", f"{p.title} ({p.pid})", f"Price: {fmt_price(p.price)}",
                 f"Category: {p.category}, {p.ptype}", f"Features: {'; '.join(p.attrs)}", *options]
        return "\n".join(lines + ["(* = selected)"] * bool(chosen) + [f"[{BUY}]"])

    # --- actions ---------------------------------------------------------------------------
    def step(self, action: str) -> StepResult:
        s = self._require()
        if s.done:
            return episode_over(s)
        text = " ".join(action.strip().strip("`'\"").strip().rstrip(".!").split())
        m = _ACTION_RE.match(text)
        if not m:
            why = "empty action" if not text else f"cannot parse {text[:60]!r}"
            return self._advance(s, {}, self.invalid_note(why))
        verb, arg = m.group(1).lower(), m.group(2).strip()
        if verb == "search":
            if s.page != "search":
                return self._advance(s, {}, self.invalid_note(f"there is no search box on this page; "
                                                          f"use click[{BACK}] first"))
            if not shop.tokens(arg):
                return self._advance(s, {}, self.invalid_note("the search query has no words to look for"))
            query = " ".join(arg.lower().split())[:MAX_QUERY]
            return self._advance(s, {"page": "results", "query": query, "page_no": 1}, "")
        return self._click(s, arg)

    def _click(self, s: ShopState, arg: str) -> StepResult:
        clickable = self.clickables()
        what = {c.lower(): c for c in clickable}.get(arg.lower())
        if what is None:
            shown = ", ".join(clickable[:8]) + (", ..." if len(clickable) > 8 else "")
            why = f"{arg[:40]!r} is not clickable on this page" + (f" (clickable: {shown})" if shown else
                                                                   "; use search[QUERY]")
            return self._advance(s, {}, self.invalid_note(why))
        if what == BACK:
            home = {"page": "search", "query": "", "page_no": 1, "item": "", "chosen": ()}
            return self._advance(s, home, "")
        if s.page == "results":
            if what in (PREV, NEXT):
                return self._advance(s, {"page_no": s.page_no + (1 if what == NEXT else -1)}, "")
            return self._advance(s, {"page": "item", "item": what, "chosen": ()}, "")
        if what == PREV:
            return self._advance(s, {"page": "results", "item": "", "chosen": ()}, "")
        p = product(s.item)
        if what == BUY:
            reward, success = score(s.goal, p, s.chosen)
            note = f"Thank you for shopping with us! Your score (min 0.0, max 1.0): {reward:.3f}"
            return self._advance(s, {"page": "done", "done": True, "reward": reward, "success": success,
                                     "answer": p.pid + _with(s.chosen)}, note)
        kind = next(k for k, values in p.options if what in values)
        chosen = {**dict(s.chosen), kind: what}
        in_order = tuple((k, chosen[k]) for k, _ in p.options if k in chosen)
        return self._advance(s, {"chosen": in_order}, f"You chose {kind}: {what}.")

    def _advance(self, s: ShopState, changes: dict[str, Any], note: str) -> StepResult:
        """Count a step, apply ``changes``, end the episode at a purchase or the step limit."""
        valid = not note.startswith("Invalid action:")
        steps = s.steps + 1
        if not changes.get("done") and steps >= s.limit:
            changes = {**changes, "done": True, "truncated": True, "answer": ""}
            note += f"\nOut of steps ({s.limit}); nothing was bought."
        self.state = s._replace(steps=steps, note=note.strip(), **changes)
        return step_result(self.state, self.observe(), self.state.reward, valid=valid)

    def action_grammar(self) -> str | None:
        """On the search page any ``search[QUERY]`` (a query starting with a letter or digit;
        one made only of stopwords is still refused); elsewhere None: ``valid_actions()``, the
        page's clickables, is the whole language there."""
        s = self._require()
        if s.done or s.page != "search":
            return None
        return 'action ::= "search[" [a-zA-Z0-9] [^\\]\\n]* "]"'

    def valid_actions(self) -> list[str]:
        """The clickable things of the page; on the search page, two searches from the instruction."""
        s = self._require()
        if s.done:
            return []
        if s.page == "search":
            return list(dict.fromkeys((f"search[{expert_query(s.goal)}]", f"search[{s.goal.ptype}]")))
        return [f"click[{c}]" for c in self.clickables()]

    def explain(self, action: str, rng=None) -> str | None:
        """Why the expert's search or click on this page (another action: a neutral line)."""
        s = self._require()
        if s.done:
            return None
        expert = self.expert_action()
        if " ".join(action.strip().strip("`'\"").split()).lower() != expert.lower():
            return trying(action, rng)
        thing = expert[expert.index("[") + 1:-1]
        if s.page == "search":
            key = "search"
        elif thing in (BACK, PREV, NEXT, BUY):
            key = {BACK: "back", NEXT: "page", BUY: "buy"}.get(thing) or ("page" if s.page == "results" else "unfit")
        else:
            key = "open" if s.page == "results" else "option"
        kind = next((k for k, v in s.goal.options if v == thing), "")
        return say(rng, _REASONS[key], query=thing, pid=thing, value=thing, kind=kind, ptype=s.goal.ptype)

    def expert_action(self) -> str | None:
        """Search with a good query, page to the nearest product meeting the goal, choose the
        goal's options, buy; from a page that cannot lead there, go back."""
        s = self._require()
        g = s.goal
        if s.done:
            return None
        if s.page == "search":
            return f"search[{expert_query(g)}]"
        if s.page == "item":
            p = product(s.item)
            if not satisfies(g, p):
                return f"click[{PREV}]"
            chosen = dict(s.chosen)
            missing = [v for k, v in g.options if chosen.get(k) != v]
            return f"click[{missing[0] if missing else BUY}]"
        hits = self._results(s)
        good = [i for i, pid in enumerate(hits) if satisfies(g, product(pid))]
        if not good:
            return f"click[{BACK}]"
        best = min(good, key=lambda i: (abs(i // PER_PAGE + 1 - s.page_no), i))
        page = best // PER_PAGE + 1
        return f"click[{hits[best] if page == s.page_no else NEXT if page > s.page_no else PREV}]"

    # --- task sets -------------------------------------------------------------------------
    @staticmethod
    def make_task(goal: Goal, split: str, task_id: str | None = None, seed: int = 0) -> Task:
        return Task(env="webshop", task_id=task_id or f"webshop-{stable_hash(goal[:6])}", split=split,
                    seed=seed, instruction=goal.instruction,
                    data={"product": goal.target, "attributes": list(goal.attrs),
                          "options": dict(goal.options), "max_price": goal.max_price / 100})

    @classmethod
    def tasks(cls, split: str, limit: int | None = None) -> list[Task]:
        if split not in SPLIT_SIZES:
            raise ValueError(f"webshop has splits 'train' and 'test', not {split!r}")
        return [cls.make_task(g, split, seed=i) for i, g in enumerate(goals(split)[:limit])]

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        """``{"product": "B0...", "attributes": [...], "options": {"size": "small"}, "max_price": 30}``;
        attributes default to all of the product's, options to none, max_price to the next $10
        above 1.5 times its price."""
        goal = goal_from_data(row, row.get("instruction"))
        task_id = row.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        return cls.make_task(goal, row.get("split", "test"), task_id)


def goal_from_data(row: dict[str, Any], text: str | None = None) -> Goal:
    """A goal from a task's data or a user row, validated against the catalogue."""
    pid = row.get("product")
    p = shop.by_id().get(pid) if isinstance(pid, str) else None
    if p is None:
        raise ValueError(f"product must be a product id of the catalogue (e.g. 'B06HRG19BW'), "
                         f"got {pid!r}")
    attrs = row.get("attributes", list(p.attrs))
    if not isinstance(attrs, list) or not set(attrs) <= set(p.attrs) or len(set(attrs)) != len(attrs):
        raise ValueError(f"attributes must be a list of distinct attributes of {pid} {list(p.attrs)}, "
                         f"got {attrs!r}")
    offered = dict(p.options)
    options = row.get("options", {})
    if not isinstance(options, dict) or not all(v in offered.get(k, ()) for k, v in options.items()):
        raise ValueError(f"options must map option kinds of {pid} to offered values {offered}, "
                         f"got {options!r}")
    bound = row.get("max_price", math.ceil(p.price * 1.5 / 1000) * 10)
    if type(bound) not in (int, float) or not p.price < round(bound * 100) <= 10**7:
        raise ValueError(f"max_price must be a number of dollars above the product's price "
                         f"{fmt_price(p.price)} (at most 100000), got {bound!r}")
    order = [k for k, _ in p.options]
    opts = tuple(sorted(options.items(), key=lambda kv: order.index(kv[0])))
    attrs = tuple(sorted(attrs, key=p.attrs.index))
    cents = round(bound * 100)
    if not isinstance(text, str) or not text.strip():
        text = instruction(p.ptype, attrs, opts, cents, random.Random(pid))
    return Goal(pid, p.ptype, p.category, attrs, opts, cents, text)


def _with(chosen) -> str:
    return " with " + ", ".join(f"{k}: {v}" for k, v in chosen) if chosen else ""
