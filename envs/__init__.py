"""Bundled environments; importing this package registers them with :func:`omrl_search.env.make_env`.

Every public module of this package is an env module and is imported here (modules whose name
starts with ``_`` are helpers). Env modules import their heavy or optional dependencies
(TextWorld, minigrid, ScienceWorld, ...) only inside methods, so importing this package stays
cheap and works without the ``envs`` extra; such an env fails with one line naming the missing
package when it is built.

* ``game24`` — make 24 from four numbers (:mod:`envs.game24`);
* ``countdown`` — reach a target from 3-6 numbers (:mod:`envs.countdown`);
* ``sokoban`` — push boxes onto targets in small generated rooms (:mod:`envs.sokoban`);
* the others are listed by ``omrl envs`` and described in the README.
"""
import importlib as _importlib
import pkgutil as _pkgutil

for _mod in sorted(m.name for m in _pkgutil.iter_modules(__path__)):
    if not _mod.startswith("_"):
        _importlib.import_module(f"{__name__}.{_mod}")
