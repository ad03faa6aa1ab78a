"""Reward models: implementations of :class:`omrl_search.reward.RewardModel`, registered by name.

* ``rules`` — format / outcome / tag-count / env-reward rule rewards, composable by weights;
* ``prm:PATH`` — a trained process reward model (HF backbone + scalar head per step);
* ``orm:PATH`` — the same model read at the last step only (outcome reward model);
* ``judge:POLICY`` — a prompted policy grades each prefix (``Score: N``).

Label files for training come from search trees (``omrl label``, :mod:`reward_models.labels`).
Nothing here imports torch until a learned model is built.
"""
from . import judge, orm, prm, rules  # noqa: F401
