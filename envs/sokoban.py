"""Sokoban in small generated rooms: push every box onto a target.

Rooms (6-7 cells square inside the walls, 1-2 boxes) are made by *reverse play*: boxes start on
their targets and a random walk pulls them away, so every room is solvable; a breadth-first
search over (player, boxes) then gives the optimal number of moves, and rooms that are too easy
(< 3 moves), too long (> 12) or have a large state space are rejected. A stable hash of the room
picks its split, so train and test never share a room.

Difficulty knobs (``tasks(split, limit, boxes=2, size=(6, 7))``, or in the split:
``--split test:boxes=2,size=6-7``): ``size``, the room's inner side (4-10, default 6-7),
``boxes`` (1-4, default 1-2), ``moves``, the optimal solution's length (1-40, default 3-12), and
``level``, a preset of the three (1: one box in 5-6 with 3-10 moves, 2: two boxes in 6-7 with
4-14, 3: three boxes in 7-8 with 6-20) that the knobs given with it override. The task data
records ``boxes``, ``size`` ([rows, columns] inside the walls), ``optimal`` and ``level`` (its
number of boxes, at most 3). Rooms with knobs come from their own seeded stream, still split by
the room's hash.

The state is an immutable :class:`SokobanState` holding the static layout too, so a value
snapshot is self-contained. Walking into a wall or pushing a box against a wall or another box
is a legal move that changes nothing but the step count.
"""
from __future__ import annotations

import random
import re
import threading
from collections import deque
from functools import lru_cache
from typing import Any, NamedTuple

from omrl_search.env import ValueSnapshots, register_env, stable_hash
from omrl_search.types import StepResult, Task

from ._text_env import Range, TextEnv, episode_over, knob_label, say, step_result, task_knobs

DIRS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
LEGEND = "Legend: # wall, _ floor, O target, X box, √ box on target, P player, S player on target."
SPLIT_SIZES = {"train": 500, "test": 200}
TEST_PERCENT = 20
MOVES_RANGE = (3, 12)
STATE_CAP = 20_000  # BFS states beyond which a room counts as too large
# Symbol -> (static cell, box, player); the second group is the common XSB level format.
_SYMBOLS = {
    "#": ("#", 0, 0), "_": ("_", 0, 0), "O": ("O", 0, 0), "X": ("_", 1, 0), "√": ("O", 1, 0),
    "P": ("_", 0, 1), "S": ("O", 0, 1),
    " ": ("_", 0, 0), "-": ("_", 0, 0), ".": ("O", 0, 0), "$": ("_", 1, 0), "*": ("O", 1, 0),
    "@": ("_", 0, 1), "+": ("O", 0, 1),
}
_NOTES = {
    "moved": "You moved {}.",
    "pushed": "You pushed a box {}.",
    "wall": "You walked into a wall; nothing happened.",
    "blocked": "The box is blocked; nothing happened.",
}
_ACTION_RE = re.compile(r"^(?:move|go|walk|push)?\s*(up|down|left|right)$")

Pos = tuple[int, int]
KNOBS = {"level": (1, 3), "size": (4, 10), "boxes": (1, 4), "moves": (1, 40)}
LEVELS = {1: {"size": (5, 6), "boxes": (1, 1), "moves": (3, 10)},
          2: {"size": (6, 7), "boxes": (2, 2), "moves": (4, 14)},
          3: {"size": (7, 8), "boxes": (3, 3), "moves": (6, 20)}}


class Spec(NamedTuple):
    """What a stream of rooms is drawn from (the defaults: the built-in splits)."""

    size: Range = (6, 7)
    boxes: Range = (1, 2)
    moves: Range = MOVES_RANGE
    label: str = ""  # the knobs as a split says them ("" for the default stream)


def spec_of(knobs: dict[str, Range]) -> Spec:
    """The stream for ``knobs``: a level's preset (a range of levels spans their presets), then
    the knobs given beside it."""
    if not knobs:
        return Spec()
    fields: dict[str, Range] = {}
    if "level" in knobs:
        lo, hi = knobs["level"]
        fields = {k: (LEVELS[lo][k][0], LEVELS[hi][k][1]) for k in LEVELS[lo]}
    fields.update({k: v for k, v in knobs.items() if k != "level"})
    return Spec(**fields, label=knob_label(knobs))


class SokobanState(NamedTuple):
    layout: tuple[str, ...]  # rows of "#" wall, "_" floor, "O" target (no boxes or player)
    player: Pos
    boxes: tuple[Pos, ...]  # sorted
    steps: int = 0
    limit: int = 40
    done: bool = False
    success: bool = False
    note: str = ""  # the message of the last step, shown above the grid

    @property
    def truncated(self) -> bool:
        """A room ends only when solved or out of steps."""
        return self.done and not self.success

    @property
    def answer(self) -> str:
        return "solved" if self.success else "unsolved"


# --- rooms -----------------------------------------------------------------------------------
def parse_room(rows: list[str]) -> tuple[tuple[str, ...], Pos, tuple[Pos, ...]]:
    """``(layout, player, boxes)`` from a text grid; raise ``ValueError(reason)`` if malformed."""
    if not isinstance(rows, list) or not rows or not all(isinstance(r, str) for r in rows):
        raise ValueError(f"room must be a non-empty list of strings, got {rows!r}")
    if len(rows) > 20 or max(map(len, rows)) > 20:
        raise ValueError("room must be at most 20x20")
    width = max(map(len, rows))
    layout, player, boxes = [], [], []
    for r, row in enumerate(rows):
        cells = []
        for c, ch in enumerate(row.ljust(width, "#")):
            if ch not in _SYMBOLS:
                raise ValueError(f"unknown symbol {ch!r} in room row {r}")
            cell, box, man = _SYMBOLS[ch]
            cells.append(cell)
            boxes += [(r, c)] * box
            player += [(r, c)] * man
        layout.append("".join(cells))
    if len(player) != 1:
        raise ValueError(f"room must have exactly one player, found {len(player)}")
    targets = [(r, c) for r, row in enumerate(layout) for c, ch in enumerate(row) if ch == "O"]
    if not boxes or len(boxes) != len(targets):
        raise ValueError(f"room must have as many boxes as targets (>= 1), "
                         f"found {len(boxes)} and {len(targets)}")
    region = _region(tuple(layout), player[0])
    if any(r in (0, len(layout) - 1) or c in (0, width - 1) for r, c in region):
        raise ValueError("room is not enclosed by walls")
    if not set(boxes) | set(targets) <= region:
        raise ValueError("every box and target must be reachable from the player")
    return tuple(layout), player[0], tuple(sorted(boxes))


def _region(layout: tuple[str, ...], start: Pos) -> set[Pos]:
    """Non-wall cells connected to ``start`` (boxes ignored)."""
    seen, todo = {start}, [start]
    inside = lambda r, c: 0 <= r < len(layout) and 0 <= c < len(layout[0])  # noqa: E731
    while todo:
        r, c = todo.pop()
        for q in ((r + dr, c + dc) for dr, dc in DIRS.values()):
            if q not in seen and inside(*q) and layout[q[0]][q[1]] != "#":
                seen.add(q)
                todo.append(q)
    return seen


def render(s: SokobanState) -> str:
    grid = [list(row) for row in s.layout]
    for r, c in s.boxes:
        grid[r][c] = "√" if grid[r][c] == "O" else "X"
    r, c = s.player
    grid[r][c] = "S" if grid[r][c] == "O" else "P"
    return "\n".join("".join(row) for row in grid)


def _move(layout, player: Pos, boxes: tuple[Pos, ...], d: Pos) -> tuple[Pos, tuple[Pos, ...], str]:
    """One move: ``(player, boxes, what)`` with what in moved/pushed/wall/blocked (no change)."""
    q = (player[0] + d[0], player[1] + d[1])
    if layout[q[0]][q[1]] == "#":
        return player, boxes, "wall"
    if q not in boxes:
        return q, boxes, "moved"
    beyond = (q[0] + d[0], q[1] + d[1])
    if layout[beyond[0]][beyond[1]] == "#" or beyond in boxes:
        return player, boxes, "blocked"
    return q, tuple(sorted(beyond if b == q else b for b in boxes)), "pushed"


@lru_cache(maxsize=256)
def _dead_cells(layout: tuple[str, ...]) -> frozenset[Pos]:
    """Floor cells (not targets) in a corner: a box pushed there can never move again."""
    wall = lambda r, c: layout[r][c] == "#"  # noqa: E731
    return frozenset(
        (r, c) for r in range(1, len(layout) - 1) for c in range(1, len(layout[0]) - 1)
        if layout[r][c] == "_"
        and (wall(r - 1, c) or wall(r + 1, c)) and (wall(r, c - 1) or wall(r, c + 1))
    )


_NEXT: dict[tuple, str | None] = {}  # (layout, player, boxes) -> first optimal move (expert cache)


def solve(layout: tuple[str, ...], player: Pos, boxes: tuple[Pos, ...],
          cap: int = STATE_CAP) -> list[str] | None:
    """A shortest move sequence putting every box on a target, or None when unsolvable.

    Breadth-first over (player, boxes), never pushing a box into a dead corner. Raises
    ``ValueError`` when more than ``cap`` states would be needed. Every state on the found path is
    cached with its next move, so an expert rollout costs one search.
    """
    targets = {(r, c) for r, row in enumerate(layout) for c, ch in enumerate(row) if ch == "O"}
    dead = _dead_cells(layout)
    start = (player, boxes)
    parent: dict[tuple, tuple | None] = {start: None}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if set(state[1]) <= targets:
            break
        for name, d in DIRS.items():
            p, bx, what = _move(layout, *state, d)
            if (p, bx) not in parent and not (what == "pushed" and set(bx) & dead):
                parent[(p, bx)] = (state, name)
                queue.append((p, bx))
        if len(parent) > cap:
            raise ValueError(f"room needs more than {cap} search states")
    else:
        return None
    path = []
    while parent[state] is not None:
        state, name = parent[state]
        path.append(name)
    path.reverse()
    if len(_NEXT) > 200_000:
        _NEXT.clear()
    state = start
    for name in path:
        _NEXT[(layout, *state)] = name
        state = _move(layout, *state, DIRS[name])[:2]
    return path


def _generate(rng: random.Random, split: str, spec: Spec = Spec()):
    """One candidate room for ``split`` by reverse play, or None when rejected."""
    sizes = tuple(range(spec.size[0], spec.size[1] + 1))
    h, w = rng.choice(sizes), rng.choice(sizes)
    grid = [["#"] * (w + 2)] + [["#"] + ["_"] * w + ["#"] for _ in range(h)] + [["#"] * (w + 2)]
    for _ in range(rng.randint(0, 6)):
        grid[rng.randint(1, h)][rng.randint(1, w)] = "#"
    floor = [(r, c) for r in range(1, h + 1) for c in range(1, w + 1) if grid[r][c] == "_"]
    if len(_region(tuple("".join(row) for row in grid), floor[0])) != len(floor):
        return None  # interior walls cut the room in pieces
    count = rng.choice(tuple(range(spec.boxes[0], spec.boxes[1] + 1)))
    if count + 1 > len(floor):
        return None
    targets = rng.sample(floor, count)
    for r, c in targets:
        grid[r][c] = "O"
    layout = tuple("".join(row) for row in grid)
    boxes = list(targets)
    player = rng.choice([p for p in floor if p not in boxes])
    for _ in range(rng.randint(15, 50) * (1 + (count > 2))):  # walk backwards, sometimes pulling a box
        d = rng.choice(list(DIRS.values()))
        q = (player[0] + d[0], player[1] + d[1])
        if layout[q[0]][q[1]] == "#" or q in boxes:
            continue
        behind = (player[0] - d[0], player[1] - d[1])
        if behind in boxes and rng.random() < 0.8:
            boxes[boxes.index(behind)] = player
        player = q
    boxes = tuple(sorted(boxes))
    if room_split(layout, player, boxes) != split:
        return None
    try:
        path = solve(layout, player, boxes, cap=STATE_CAP * (1 + 4 * (count > 2)))
    except ValueError:
        return None
    if path is None or not spec.moves[0] <= len(path) <= spec.moves[1]:
        return None
    return layout, player, boxes, len(path)


def plan(layout, player: Pos, boxes: tuple[Pos, ...]) -> list[str] | None:
    """A shortest solution from a position: the expert's cached moves when it has been there,
    else a fresh search (None when unsolvable or too large)."""
    path, state = [], (player, boxes)
    while (layout, *state) in _NEXT and _NEXT[(layout, *state)] is not None:
        path.append(_NEXT[(layout, *state)])
        state = _move(layout, *state, DIRS[path[-1]])[:2]
        if len(path) > 400:
            break
    targets = {(r, c) for r, row in enumerate(layout) for c, ch in enumerate(row) if ch == "O"}
    if set(state[1]) <= targets:
        return path
    try:
        return solve(layout, player, boxes, cap=200_000)
    except ValueError:
        return None


def _cell(p: Pos) -> str:
    return f"row {p[0]}, column {p[1]}"


_PUSH_HOME = ("Pushing {dir} puts the box at {box} onto the target at {target}.",
              "The box at {box} is one push from the target at {target}, so I push it {dir}.",
              "I push the box at {box} {dir}, onto its target at {target}.")
_PUSH_ON = ("The box at {box} belongs on the target at {target}; pushing it {dir} moves it to {to}.",
            "I push the box at {box} {dir} to {to}, on its way to the target at {target}.",
            "Pushing {dir} takes the box at {box} to {to}; its target is at {target}.")
_WALK = ("I walk {dir} to get behind the box at {box}, to push it {push} toward the target at {target}.",
         "To push the box at {box} {push} (its target is at {target}), I first step {dir}.",
         "Moving {dir} brings me round to the box at {box}, which I will push {push}; it goes on "
         "the target at {target}.")
_STUCK = ("Moving {dir} changes nothing here.", "A move {dir} is blocked.")


def explain_move(s: SokobanState, name: str, rng=None) -> str:
    """The reason for moving ``name`` from ``s``: the first push of the move followed by a
    shortest solution, the box it moves and the target that box ends on (rows and columns
    counted from 0 at the top-left corner of the grid)."""
    player, boxes, what = _move(s.layout, s.player, s.boxes, DIRS[name])
    if what in ("wall", "blocked"):
        return say(rng, _STUCK, dir=name)
    moves = [name] + (plan(s.layout, player, boxes) or [])
    state, push, track = (s.player, s.boxes), None, None
    for k, move in enumerate(moves):  # find the first push; follow that box to where it ends
        p, bx, w = _move(s.layout, *state, DIRS[move])
        if w == "pushed" and push is None:
            push, track = (k, move, p), (p[0] + DIRS[move][0], p[1] + DIRS[move][1])
        elif w == "pushed" and p == track:
            track = (p[0] + DIRS[move][0], p[1] + DIRS[move][1])
        state = (p, bx)
    if push is None:  # no solution after this move: say only what it does
        return f"I move {name}." if what == "moved" else f"I push the box {name}."
    k, move, box = push
    fields = dict(dir=name, push=move, box=_cell(box), target=_cell(track))
    if k > 0:
        return say(rng, _WALK, **fields)
    to = (box[0] + DIRS[name][0], box[1] + DIRS[name][1])
    return say(rng, _PUSH_HOME if to == track else _PUSH_ON, to=_cell(to), **fields)


def room_split(layout, player: Pos, boxes) -> str:
    key = ("sokoban", layout, player, tuple(boxes))
    return "test" if int(stable_hash(key), 16) % 100 < TEST_PERCENT else "train"


_ROOMS: dict[tuple[str, Spec], list] = {}  # generated so far, per split and stream
_CURSOR: dict[tuple[str, Spec], int] = {}  # next candidate index, per split and stream
_LOCK = threading.Lock()
MAX_CANDIDATES = 400  # candidates per room wanted before a stream counts as exhausted


def rooms(split: str, count: int, spec: Spec = Spec()) -> list[tuple]:
    """The first ``count`` rooms of ``split`` in ``spec``'s stream (generated lazily, always in
    the same order); fewer when the knobs allow fewer (none: a ValueError line)."""
    stream = f"sokoban:{split}:{spec.label}:" if spec.label else f"sokoban:{split}:"
    key = (split, spec)
    with _LOCK:
        found = _ROOMS.setdefault(key, [])
        seen = {room[:3] for room in found}
        while len(found) < count and _CURSOR.get(key, 0) < MAX_CANDIDATES * max(count, 10):
            index = _CURSOR[key] = _CURSOR.get(key, 0) + 1
            room = _generate(random.Random(f"{stream}{index - 1}"), split, spec)
            if room is not None and room[:3] not in seen:
                seen.add(room[:3])
                found.append(room)
        if not found:
            raise ValueError(f"sokoban: no room has the knobs {spec.label} (try fewer boxes, "
                             "a larger size or a wider moves range)")
        return found[:count]


def step_limit(optimal: int) -> int:
    return min(max(4 * optimal, 12), SokobanEnv.max_steps)


# --- the env ---------------------------------------------------------------------------------
@register_env("sokoban")
class SokobanEnv(ValueSnapshots, TextEnv):
    """Push all boxes onto targets; moves are up, down, left, right."""

    description = "Sokoban: walk the player around a small room and push every box onto a target."
    action_help = "Actions: `up`, `down`, `left` or `right` (one move; walk into a box to push it)."
    examples = (
        "Think: The box is right of me and the target is right of the box, so I push it right.\n"
        "Act: right"
    )
    max_steps = 48

    def __init__(self) -> None:
        self.state: SokobanState | None = None

    def reset(self, task: Task) -> str:
        layout, player, boxes = parse_room(task.data["room"])
        limit = task.data.get("max_steps") or step_limit(task.data.get("optimal") or 10)
        self.state = SokobanState(layout, player, boxes, limit=limit)
        return self.observe()

    def position(self):
        """The state without the last message, so equal positions share a state key."""
        return self.state._replace(note="")

    def observe(self) -> str:
        s = self._require()
        on = sum(s.layout[r][c] == "O" for r, c in s.boxes)
        status = f"Boxes on targets: {on} of {len(s.boxes)}."
        if not s.done:
            status += f" Possible moves: {', '.join(self.valid_actions()) or 'none'}."
        return "\n".join(x for x in (s.note, render(s), LEGEND, status) if x)

    def step(self, action: str) -> StepResult:
        s = self._require()
        if s.done:
            return episode_over(s)
        text = " ".join(action.lower().strip().strip("`'\"").rstrip(".!").split())
        m = _ACTION_RE.match(text)
        if m:
            player, boxes, what = _move(s.layout, s.player, s.boxes, DIRS[m.group(1)])
            note = _NOTES[what].format(m.group(1))
        else:
            player, boxes = s.player, s.boxes
            note = self.invalid_note(f"cannot parse {text[:60]!r}" if text else "empty action")
        steps = s.steps + 1
        success = all(s.layout[r][c] == "O" for r, c in boxes)
        done = success or steps >= s.limit
        if success:
            note += " All boxes are on targets: solved!"
        elif done:
            note += f" Out of steps ({s.limit}); the room is not solved."
        self.state = s._replace(player=player, boxes=boxes, steps=steps, done=done,
                                success=success, note=note)
        return step_result(self.state, self.observe(), 1.0 if success else 0.0, valid=m is not None)

    def valid_actions(self) -> list[str]:
        """The moves that change the state (blocked moves are legal but useless)."""
        s = self._require()
        if s.done:
            return []
        moves = ((n, _move(s.layout, s.player, s.boxes, d)[2]) for n, d in DIRS.items())
        return [n for n, what in moves if what in ("moved", "pushed")]

    def expert_action(self) -> str | None:
        s = self._require()
        if s.done:
            return None
        key = (s.layout, s.player, s.boxes)
        if key not in _NEXT:
            try:
                path = solve(s.layout, s.player, s.boxes, cap=200_000)
            except ValueError:
                return None
            if not path:
                _NEXT[key] = None
        return _NEXT[key]

    def explain(self, action: str, rng=None) -> str | None:
        """Which box the move serves and where that box goes (see :func:`explain_move`)."""
        s = self._require()
        if s.done:
            return None
        m = _ACTION_RE.match(" ".join(action.lower().strip().strip("`'\"").rstrip(".!").split()))
        return None if m is None else explain_move(s, m.group(1), rng)

    # --- task sets -------------------------------------------------------------------------
    @staticmethod
    def make_task(layout, player, boxes, optimal: int, split: str, task_id: str, seed: int = 0):
        room = render(SokobanState(layout, player, boxes)).split("\n")
        data = {"room": room, "optimal": optimal, "boxes": len(boxes),
                "size": [len(layout) - 2, len(layout[0]) - 2], "level": min(len(boxes), 3)}
        return Task(
            env="sokoban",
            task_id=task_id,
            split=split,
            seed=seed,
            instruction=(
                f"Push every box (X) onto a target (O) in this room ({len(boxes)} box"
                f"{'es' if len(boxes) > 1 else ''}). Move with up, down, left or right; walking into a "
                "box pushes it one cell, boxes cannot be pulled, and a box against a wall or another "
                f"box does not move. It can be solved in {optimal} moves."
            ),
            data=data,
        )

    @classmethod
    def tasks(cls, split: str, limit: int | None = None, *, level: Any = None, size: Any = None,
              boxes: Any = None, moves: Any = None) -> list[Task]:
        """The split's rooms; the knobs (also in ``split``) are in the module docstring."""
        given = {"level": level, "size": size, "boxes": boxes, "moves": moves}
        split, knobs = task_knobs("sokoban", split, given, KNOBS, tuple(SPLIT_SIZES))
        count = SPLIT_SIZES[split] if limit is None else min(limit, SPLIT_SIZES[split])
        spec = spec_of(knobs)
        name = (lambda i, room: f"sokoban-{split}-{i}") if not knobs else \
            (lambda i, room: f"sokoban-{split}-{stable_hash(room[:3])}")
        return [cls.make_task(*room, split=split, task_id=name(i, room), seed=i)
                for i, room in enumerate(rooms(split, count, spec))]

    @classmethod
    def task_from_dict(cls, row: dict[str, Any]) -> Task:
        layout, player, boxes = parse_room(row.get("room"))
        path = solve(layout, player, boxes)  # raises ValueError when too large
        if path is None:
            raise ValueError("room is not solvable")
        if not path:
            raise ValueError("room is already solved")
        task_id = row.get("task_id", f"sokoban-{stable_hash((layout, player, boxes))}")
        if not isinstance(task_id, str):
            raise ValueError(f"task_id must be a string, got {task_id!r}")
        return cls.make_task(layout, player, boxes, len(path), row.get("split", "test"), task_id)

