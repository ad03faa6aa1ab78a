"""constant: a policy backend plugin for omrl-search that always proposes one action.

``--policy constant:ACTION`` answers every request with ``Think: ...\\nAct: ACTION``. A backend
is a :class:`~omrl_search.policy.Policy` whose ``generate`` takes a batch of requests and
returns ``n`` :class:`~omrl_search.types.Generation` s for each, with token ids, logprobs and
usage; the entry point names a factory that builds it from the text after ``constant:``.
A real backend would run a model here; this one is deterministic and needs none.
"""
from __future__ import annotations

from omrl_search.policy import ByteChatTokenizer, Policy, PolicyError
from omrl_search.types import Generation, GenRequest


class ConstantPolicy(Policy):
    answers_prompts = False  # it only picks env actions

    def __init__(self, action: str) -> None:
        self.action, self.name = action, f"constant:{action}"
        self.tokenizer = ByteChatTokenizer()  # real token ids, so trees export as training data

    def generate(self, requests: list[GenRequest]) -> list[list[Generation]]:
        text = f"Think: I always do the same.\nAct: {self.action}"
        ids = self.tokenizer.encode(text) + [256]  # 256: the tokenizer's EOS
        out = []
        for req in requests:
            prompt = len(req.prompt_ids) if req.prompt_ids is not None else 0
            out.append([Generation(text, ids, [0.0] * len(ids), prompt, len(ids), "stop", True)
                        for _ in range(req.params.n)])
        return out


def make(arg: str) -> ConstantPolicy:
    if not arg.strip():
        raise PolicyError("constant: give the action, e.g. constant:right")
    return ConstantPolicy(arg.strip())
