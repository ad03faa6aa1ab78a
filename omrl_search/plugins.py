"""Plugins: how the core finds envs, strategies, reward models, policies, commands and env
servers without naming the packages that provide them (see docs/design.md §7).

A distribution lists its plugins as entry points in its ``pyproject.toml``; the entry's name is
what users type::

    [project.entry-points."omrl_search.envs"]
    toy = "my_pkg.toy:ToyEnv"

* ``omrl_search.envs``: an :class:`~omrl_search.env.Env` subclass (``--env NAME``);
* ``omrl_search.strategies``: a :class:`~omrl_search.strategy.Strategy` dataclass
  (``--strategy NAME:key=value``);
* ``omrl_search.reward_models``: a factory ``f(arg: str) -> RewardModel`` (``--reward-model NAME:ARG``);
* ``omrl_search.policies``: a factory ``f(arg: str) -> Policy`` (``--policy NAME:ARG``);
* ``omrl_search.commands``: a module with ``configure(parser)`` and ``run(args) -> int``, its
  docstring's first line the help (``omrl NAME ...``);
* ``omrl_search.env_servers``: a factory ``f(url: str, env: str | None)`` giving an
  ``env_factory`` (``env_factory(env_name) -> Env``, optionally with ``max_envs``) for
  ``--env-server SCHEME://...``; NAME is the URL scheme's part before ``+`` (``http``,
  ``agentgym`` for ``agentgym+http://...``).

Discovery reads the installed distributions' metadata once (no plugin is imported by it); an
entry is loaded, i.e. its module imported, the first time its name is asked for, and kept. A
plugin that fails to load (or loads something of the wrong kind) raises :class:`PluginError`,
one line naming the plugin and its entry point; every other plugin stays usable. Objects
registered in code (``register_env`` and friends: tests, notebooks) come first, then entry points.
"""
from __future__ import annotations

from typing import Any, Callable

GROUPS = ("omrl_search.envs", "omrl_search.strategies", "omrl_search.reward_models",
          "omrl_search.policies", "omrl_search.commands", "omrl_search.env_servers")

_ENTRIES: dict[str, dict[str, list[Any]]] | None = None  # group -> name -> distinct entry points


class PluginError(Exception):
    """A plugin could not be used: its entry point failed to load or gave the wrong kind of object."""


def _entries() -> dict[str, dict[str, list[Any]]]:
    """Every entry point of our groups, read once from the installed distributions' metadata."""
    global _ENTRIES
    if _ENTRIES is None:
        from importlib.metadata import entry_points

        found: dict[str, dict[str, list[Any]]] = {g: {} for g in GROUPS}
        every = entry_points()  # one scan of the installed distributions for all groups
        for group in GROUPS:
            for ep in every.select(group=group):
                same = found[group].setdefault(ep.name, [])
                if all(other.value != ep.value for other in same):  # one dist seen twice: once
                    same.append(ep)
        _ENTRIES = found
    return _ENTRIES


def refresh() -> None:
    """Forget what discovery found (after installing a plugin into a running process)."""
    global _ENTRIES
    _ENTRIES = None
    for registry in Registry.all:
        registry.loaded.clear()


def names(group: str) -> list[str]:
    """The entry-point names in ``group`` (nothing is imported)."""
    return sorted(_entries()[group])


def describe(ep: Any) -> str:
    """``omrl_search.envs: toy = my_pkg.toy:ToyEnv (my-pkg 0.1)``: where a plugin comes from."""
    dist = getattr(ep, "dist", None)
    origin = f" ({dist.name} {dist.version})" if dist is not None else ""
    return f"{ep.group}: {ep.name} = {ep.value}{origin}"


def load(group: str, name: str) -> Any:
    """The object behind entry point ``name`` of ``group`` (imported now), or None when there is
    no such entry; a failing import is one :class:`PluginError` line."""
    eps = _entries()[group].get(name)
    if not eps:
        return None
    if len(eps) > 1:
        raise PluginError(f"plugin {name!r} is given twice: " + " and ".join(describe(e) for e in eps))
    try:
        return eps[0].load()
    except Exception as exc:  # noqa: BLE001 - any import-time failure of a third-party plugin
        lines = str(exc).strip().splitlines()
        why = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        raise PluginError(f"plugin {name!r} ({describe(eps[0])}) failed to load: {why}") from exc


class Registry:
    """Names -> objects of one kind: those registered in code, then the group's entry points.

    ``check(obj)`` says whether a loaded object is of the right kind (``what`` describes that
    kind in the error); ``adopt(name, obj)`` runs once on each object loaded from an entry point
    (e.g. to give an unnamed class its entry name).
    """

    all: list["Registry"] = []

    def __init__(self, group: str, what: str, check: Callable[[Any], bool],
                 adopt: Callable[[str, Any], None] | None = None) -> None:
        self.group, self.what, self.check, self.adopt = group, what, check, adopt
        self.registered: dict[str, Any] = {}
        self.loaded: dict[str, Any] = {}
        Registry.all.append(self)

    def register(self, name: str, obj: Any) -> Any:
        self.registered[name] = obj
        return obj

    def names(self) -> list[str]:
        return sorted(set(self.registered) | set(names(self.group)))

    def get(self, name: str) -> Any:
        """The object called ``name``, or None when nothing is; PluginError for a broken plugin."""
        if name in self.registered:
            return self.registered[name]
        if name not in self.loaded:
            obj = load(self.group, name)
            if obj is None:
                return None
            if not self.check(obj):
                ep = _entries()[self.group][name][0]
                raise PluginError(f"plugin {name!r} ({describe(ep)}) is not {self.what} "
                                  f"(got {obj!r:.80})")
            if self.adopt is not None:
                self.adopt(name, obj)
            self.loaded[name] = obj
        return self.loaded[name]

    def unknown(self, kind: str, name: str) -> str:
        """``unknown env 'x' (known: a, b)``: the message for a name nothing provides."""
        return f"unknown {kind} {name!r} (known: {', '.join(self.names())})"


def name_if_unnamed(name: str, cls: Any) -> None:
    """``adopt`` for classes: an entry-point class without a ``name`` takes the entry's name."""
    if not getattr(cls, "name", ""):
        cls.name = name


def is_subclass(base: type) -> Callable[[Any], bool]:
    return lambda obj: isinstance(obj, type) and issubclass(obj, base)


#: CLI commands (``omrl NAME``)
COMMANDS = Registry("omrl_search.commands", "a command module with configure(parser) and run(args)",
                    lambda obj: all(callable(getattr(obj, f, None)) for f in ("configure", "run")))


def command_help(module: Any) -> str:
    """A command's one-line help: the first line of its module docstring."""
    doc = (getattr(module, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""
