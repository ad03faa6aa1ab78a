"""Reward models: implementations of :class:`omrl_search.reward.RewardModel`.

* ``rules`` — format / outcome / tag-count / env-reward rule rewards, composable by weights;
* ``prm:PATH`` — a trained process reward model (HF backbone + scalar head per step);
* ``orm:PATH`` — the same model read at the last step only (outcome reward model);
* ``judge:POLICY`` — a prompted policy grades each prefix (``Score: N``);
* ``implicit:POLICY[,ref=REF][,beta=B]`` — PRIME's implicit PRM: ``beta * log pi/pi_ref`` of
  each step's tokens, the running sum the path's value (no training, no labels).

Each factory is listed in ``pyproject.toml`` as an ``omrl_search.reward_models`` entry point
(docs/design.md §7). Label files for training come from search trees (``omrl label``, the
:mod:`reward_models.labels` command plugin). Nothing here imports torch until a learned model is
built.
"""
