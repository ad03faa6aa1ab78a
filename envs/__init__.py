"""Bundled environments; importing this package registers them with :func:`omrl_search.env.make_env`.

* ``game24`` — make 24 from four numbers (:mod:`envs.game24`);
* ``countdown`` — reach a target from 3-6 numbers (:mod:`envs.countdown`);
* ``sokoban`` — push boxes onto targets in small generated rooms (:mod:`envs.sokoban`).
"""
from . import countdown, game24, sokoban  # noqa: F401  (register the envs)
