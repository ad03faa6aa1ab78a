"""Reward models: implementations of :class:`omrl_search.reward.RewardModel`, registered by name.

Bundled now: ``rules`` (format / outcome / tag-count rule rewards, composable by weights).
"""
from . import rules  # noqa: F401
