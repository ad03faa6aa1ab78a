"""Bundled environments, one module per env; ``_``-prefixed modules are helpers.

Each env is listed in ``pyproject.toml`` as an ``omrl_search.envs`` entry point and imported only
when it is used (docs/design.md §7), so ``omrl envs`` lists them without importing any. Env
modules import their heavy or optional dependencies (TextWorld, minigrid, ScienceWorld, ...) only
inside methods, so such an env fails with one line naming the missing package when it is built.

* ``game24`` — make 24 from four numbers (:mod:`envs.game24`);
* ``countdown`` — reach a target from 3-6 numbers (:mod:`envs.countdown`);
* ``sokoban`` — push boxes onto targets in small generated rooms (:mod:`envs.sokoban`);
* the others are listed by ``omrl envs`` and described in docs/environments.md.

:mod:`envs.server` (``omrl env serve``) is an ``omrl_search.commands`` plugin and
:mod:`envs.remote` the ``omrl_search.env_servers`` plugin behind ``--env-server URL``.
"""
