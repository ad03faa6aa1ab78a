"""What the ``babyai`` agent sees and can do, as text, from its egocentric view.

Everything is computed in the agent's own frame, from minigrid's ``gen_obs_grid()`` (the view
rotated so the agent stands at the bottom middle facing up, with the visibility mask that walls
and closed doors cast): objects get names like ``red ball 1`` (numbered nearest first among
objects of the same colour and kind), positions are "N steps ahead, M to the left", and the
high-level actions (``go to red ball 1``, ``pick up red ball 1``, ``go through blue door 1``,
``toggle and go through blue door 1``) are planned by breadth-first search over the visible free
cells, so they expand into minigrid's primitive actions (turn left/right, forward, pick up, drop,
toggle). The wording follows the spirit of AgentGym's BabyAI text env; the code is our own.
"""
from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple

# minigrid's primitive actions (``MiniGridEnv.Actions``; DONE changes nothing) and their text
LEFT, RIGHT, FORWARD, PICKUP, DROP, TOGGLE, DONE = range(7)
PRIMITIVES = {"turn left": LEFT, "turn right": RIGHT, "move forward": FORWARD, "pick up": PICKUP,
              "drop": DROP, "toggle": TOGGLE}
PRIMITIVE_TEXT = {v: k for k, v in PRIMITIVES.items()}
MACROS = ("toggle and go through", "go through", "go to", "pick up")  # longest prefix first
_STEPS = ((0, -1), (1, 0), (0, 1), (-1, 0))  # view-frame (di, dj) for directions up, right, down, left
_PICKABLE = ("ball", "key", "box")


class Thing(NamedTuple):
    """A visible object: its name (``red ball 1``), kind, door state, and view-frame cell."""

    name: str
    kind: str
    color: str
    state: str  # "open" / "closed" / "locked" for doors, "" otherwise
    ahead: int
    right: int
    cell: tuple[int, int]


class View(NamedTuple):
    """The agent's view: the things it sees, what is ahead, what it carries, and the plans
    (action text -> primitive actions) of every action available from here."""

    things: tuple[Thing, ...]
    ahead: str
    carrying: str  # "red key" or ""
    plans: dict[str, tuple[int, ...]]
    reasons: dict[str, str]  # macro actions that name a visible thing but cannot be done, and why


def see(env: Any) -> View:
    """The :class:`View` of a minigrid env (``env`` is the unwrapped env)."""
    grid, vis = env.gen_obs_grid()
    size = grid.width
    me = (size // 2, size - 1)
    found = []
    for i in range(size):
        for j in range(size):
            obj = grid.get(i, j)
            if vis[i, j] and (i, j) != me and obj is not None and obj.type not in ("wall", "empty"):
                state = ("locked" if obj.is_locked else "open" if obj.is_open else "closed") \
                    if obj.type == "door" else ""
                found.append((me[1] - j, i - me[0], obj, state, (i, j)))
    found.sort(key=lambda t: (t[0] + abs(t[1]), t[0], t[1]))
    counts: dict[str, int] = {}
    things = []
    for ahead, right, obj, state, cell in found:
        base = f"{obj.color} {obj.type}"
        counts[base] = counts.get(base, 0) + 1
        things.append(Thing(f"{base} {counts[base]}", obj.type, obj.color, state, ahead, right, cell))
    carrying = f"{env.carrying.color} {env.carrying.type}" if env.carrying else ""
    plans, reasons = _plans(grid, vis, me, tuple(things), env.carrying)
    return View(tuple(things), _ahead(grid, vis, me, things), carrying, plans, reasons)


def describe(view: View) -> str:
    """The observation text of a view (without the last action's message)."""
    if view.things:
        seen = "You see " + "; ".join(_thing_text(t) for t in view.things) + "."
    else:
        seen = "You see no objects, only walls and floor."
    held = f"You are carrying a {view.carrying}." if view.carrying else "You are carrying nothing."
    return f"{seen}\n{view.ahead}\n{held}\nAvailable actions: {', '.join(view.plans)}."


def _thing_text(t: Thing) -> str:
    where = [f"{t.ahead} step{'s' * (t.ahead != 1)} ahead"] if t.ahead else []
    if t.right:
        where.append(f"{abs(t.right)} to the {'right' if t.right > 0 else 'left'}")
    state = f"{t.state} " if t.state else ""
    return f"a {state}{t.name} ({', '.join(where)})"


def _passable(obj: Any) -> bool:
    return obj is None or (obj.can_overlap() and obj.type != "lava")


def _ahead(grid: Any, vis: Any, me: tuple[int, int], things: list[Thing]) -> str:
    """What blocks the way straight ahead, and how far."""
    i, j = me
    for dist in range(1, me[1] + 1):
        obj = grid.get(i, j - dist)
        if not vis[i, j - dist]:
            break
        if not _passable(obj):
            if obj.type == "wall":
                return f"You are facing a wall {dist} step{'s' * (dist != 1)} away."
            name = next(t.name for t in things if t.cell == (i, j - dist))
            return f"You are facing the {name}, {dist} step{'s' * (dist != 1)} away."
    return "The way ahead is clear as far as you can see."


def _search(grid: Any, vis: Any, me: tuple[int, int]) -> dict:
    """Breadth-first search over (cell, direction) in the view frame: the parent of each
    reachable state (start: the agent's cell facing up, direction 0)."""
    size = grid.width
    start = (me[0], me[1], 0)
    parent: dict = {start: None}
    queue = deque([start])
    while queue:
        i, j, d = state = queue.popleft()
        di, dj = _STEPS[d]
        moves = [((i, j, (d - 1) % 4), LEFT), ((i, j, (d + 1) % 4), RIGHT)]
        ni, nj = i + di, j + dj
        if 0 <= ni < size and 0 <= nj < size and vis[ni, nj] and _passable(grid.get(ni, nj)):
            moves.append(((ni, nj, d), FORWARD))
        for nxt, action in moves:
            if nxt not in parent:
                parent[nxt] = (state, action)
                queue.append(nxt)
    return parent


def _path(parent: dict, goal: Any) -> tuple[int, ...] | None:
    """Primitive actions to the first-found state satisfying ``goal(state)`` (BFS order: shortest)."""
    state = next((s for s in parent if goal(s)), None)  # dicts keep BFS insertion order
    if state is None:
        return None
    path = []
    while parent[state] is not None:
        state, action = parent[state]
        path.append(action)
    return tuple(reversed(path))


def _facing(cell: tuple[int, int]):
    return lambda s: (s[0] + _STEPS[s[2]][0], s[1] + _STEPS[s[2]][1]) == cell


def _plans(grid, vis, me, things: tuple[Thing, ...], carrying) -> tuple[dict, dict]:
    """Every available action with its primitive actions, and why named ones are unavailable."""
    front = grid.get(me[0], me[1] - 1)
    plans: dict[str, tuple[int, ...]] = {"turn left": (LEFT,), "turn right": (RIGHT,)}
    if _passable(front):
        plans["move forward"] = (FORWARD,)
    if front is not None and front.can_pickup() and carrying is None:
        plans["pick up"] = (PICKUP,)
    if carrying is not None and front is None:
        plans["drop"] = (DROP,)
    if front is not None and front.type in ("door", "box"):
        plans["toggle"] = (TOGGLE,)
    parent = _search(grid, vis, me)
    reasons: dict[str, str] = {}
    for t in things:
        to_face = _path(parent, _facing(t.cell))
        if to_face is None:
            for verb in ("go to", "pick up") if t.kind in _PICKABLE else ("go to",):
                reasons[f"{verb} {t.name}"] = f"there is no clear path to the {t.name} in view"
            continue
        plans[f"go to {t.name}"] = to_face or (DONE,)  # already facing it: a step that stays
        if t.kind in _PICKABLE:
            if carrying is None:
                plans[f"pick up {t.name}"] = to_face + (PICKUP,)
            else:
                reasons[f"pick up {t.name}"] = "your hands are full (drop what you carry first)"
        if t.kind == "door" and t.state == "open":
            into = _path(parent, lambda s, c=t.cell: s[:2] == c)
            if into is not None:
                plans[f"go through {t.name}"] = into + (FORWARD,)
            reasons[f"toggle and go through {t.name}"] = f"the {t.name} is open: go through it"
        elif t.kind == "door":
            reasons[f"go through {t.name}"] = (f"the {t.name} is {t.state}: "
                                               f"toggle and go through it")
            if t.state == "locked" and (carrying is None or carrying.type != "key"
                                        or carrying.color != t.color):
                reasons[f"toggle and go through {t.name}"] = (
                    f"the {t.name} is locked: carry the {t.color} key to open it")
            else:
                plans[f"toggle and go through {t.name}"] = to_face + (TOGGLE, FORWARD, FORWARD)
    return plans, reasons


def parse(text: str) -> str:
    """An action in canonical form: lower case, single spaces, common aliases resolved."""
    text = " ".join(text.lower().strip().strip("`'\"").strip().rstrip(".!").split())
    text = {"left": "turn left", "right": "turn right", "forward": "move forward",
            "go forward": "move forward", "move ahead": "move forward", "pickup": "pick up",
            "open": "toggle"}.get(text, text)
    return "pick up " + text[7:] if text.startswith("pickup ") else text


def why_not(text: str, view: View) -> str:
    """Why ``text`` (not among the view's plans) cannot be done here."""
    if text in view.reasons:
        return view.reasons[text]
    for macro in MACROS:
        if text.startswith(macro + " "):
            name = text[len(macro) + 1:]
            if not any(t.name == name for t in view.things):
                return f"there is no {name} in view"
            return f"you cannot {macro} the {name}"
    return f"cannot parse {text[:60]!r}" if text else "empty action"
