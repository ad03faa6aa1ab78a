"""The outcome reward model (ORM): the PRM's backbone and head, read at the last step only.

Its one score per prefix is given to every step, so any aggregation returns it. Spec
``orm:PATH[:key=value,...]`` loads any saved reward model folder (one trained as a PRM, or with
``omrl train prm --objective outcome``) and reads it this way.
"""
from __future__ import annotations

from typing import Sequence

from omrl_search.reward import register_reward_model
from omrl_search.types import Usage

from .inputs import Episode
from .prm import ProcessRewardModel, load_spec


class OutcomeRewardModel(ProcessRewardModel):
    """One score per prefix, read after its last step, repeated for every step."""

    kind = "orm"

    def encode(self, ep: Episode) -> tuple[list[int], list[int]]:
        ids, pos = self.encoder.encode(ep)
        return ids, pos[-1:]

    def run_episodes(self, episodes: Sequence[Episode]) -> tuple[list[list[float]], list[Usage]]:
        scores, usage = super().run_episodes(episodes)
        return [s * len(ep) if s else [] for s, ep in zip(scores, episodes)], usage


@register_reward_model("orm")
def _orm(arg: str) -> OutcomeRewardModel:
    return load_spec(OutcomeRewardModel, arg)  # type: ignore[return-value]
