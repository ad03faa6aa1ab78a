"""The env server's request and response bodies (``omrl env serve``, :mod:`envs.server`).

Imported when an app is made, not with :mod:`envs.server` (so ``omrl --help`` stays cheap).
Request bodies are strictly typed: ``{"id": false}`` and ``{"id": "0"}`` are no ids. The bodies
that name an env differ by server: :func:`request_bodies` makes them for the id dialect, or for
WebShop's, where ``env_idx`` may stand for ``id``.
"""
from __future__ import annotations

from typing import Any, ClassVar, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_ACTION_CHARS = 100_000
#: where /reset takes its task from: exactly one of these fields
TASK_SOURCES = ("data_idx", "session_id", "task")
#: WebShop's rule: the env is named by id or by env_idx, once
ID_OR_ENV_IDX = {"oneOf": [{"required": ["id"]}, {"required": ["env_idx"]}]}


class Strict(BaseModel):
    model_config = ConfigDict(strict=True)  # `{"id": false}` and `{"id": "0"}` are no ids


class ErrorOut(BaseModel):
    error: str


class IdRef(Strict):
    id: int = Field(description="the env id /create answered")
    env_idx: ClassVar[None] = None  # only the webshop server takes WebShop's name

    @property
    def ref(self) -> int:
        return self.id


class EnvIdxRef(Strict):  # id or env_idx (WebShop's clients send env_idx), exactly one
    model_config = ConfigDict(strict=True, json_schema_extra=ID_OR_ENV_IDX)
    id: int = Field(None, description="the env id /create answered")
    env_idx: int = Field(None, description="WebShop's name for id")

    @model_validator(mode="after")
    def _one_id(self):
        if (self.id is None) == (self.env_idx is None):
            raise ValueError("give the env id as id (or env_idx, WebShop's name for it), once")
        return self

    @property
    def ref(self) -> int:
        return self.id if self.id is not None else self.env_idx


class CreateBody(Strict):  # TextCraft's client sends {minecraft_dir, commands, goal}: ignored
    first_episode: bool = Field(True, description="start task data_idx=id and answer its "
                                                  "observation, as AgentGym's TextCraft does")


class TaskBody(Strict):
    env: str | None = None
    task_id: str
    split: str = "test"
    seed: int = 0
    instruction: str = ""
    data: dict[str, Any] = {}


DEDUP_KEY = "the env's dedup key, when it has one of its own (Env.dedup_key)"


class Created(BaseModel):
    id: int
    env: str
    observation: str = Field(description="the first task's observation ('' when the env has no "
                                         "task list or first_episode is false)")
    reward: float
    done: bool
    task_id: str | None = None


class Closed(BaseModel):
    id: int
    closed: bool


class ResetOut(BaseModel):
    id: int
    observation: str
    reward: float
    score: float
    done: bool
    task_id: str
    instruction: str
    state_key: str
    dedup_key: str | None = Field(None, description=DEDUP_KEY)
    snapshot_id: str | None = None
    task_name: str | None = Field(None, description="SciWorld: ScienceWorld's task name")
    var_num: int | None = Field(None, description="SciWorld: the task's variation")
    task_description: str | None = Field(None, description="SciWorld: the task, which its "
                                                           "client shows before the observation")


class StepOut(BaseModel):
    observation: str
    reward: float
    score: float = Field(description="the episode's score on the env's AgentGym scale: "
                                     "ScienceWorld's 0-100 for sciworld, else summed reward")
    done: bool = Field(description="terminated or truncated (AgentGym's one flag)")
    terminated: bool = Field(description="the task reached an end state")
    truncated: bool = Field(description="the episode was cut (a step limit)")
    success: bool
    valid: bool = Field(description="false when the action was malformed or not admissible")
    info: dict[str, Any]
    state_key: str
    dedup_key: str | None = Field(None, description=DEDUP_KEY)
    snapshot_id: str | None = None
    state: str | None = Field(None, description="the observation again, under WebShop's name "
                                                "(sent when the request named env_idx)")


class SnapshotOut(BaseModel):
    snapshot_id: str
    state_key: str
    dedup_key: str | None = Field(None, description=DEDUP_KEY)
    observation: str


class RestoreOut(BaseModel):
    observation: str
    state_key: str
    dedup_key: str | None = Field(None, description=DEDUP_KEY)
    score: float
    done: bool


class ForkOut(RestoreOut):
    id: int


class Bodies(NamedTuple):
    """The request bodies that name an env, for one dialect."""

    EnvRef: type
    ResetBody: type
    StepBody: type
    RestoreBody: type
    ForkBody: type


def request_bodies(webshop: bool) -> Bodies:
    """The env-naming bodies: by ``id`` (AgentGym's id dialect) or, on the webshop server, by
    ``id`` or ``env_idx``."""
    EnvRef = EnvIdxRef if webshop else IdRef

    def one_task_source(schema: dict[str, Any]) -> None:
        """The schema says what the server accepts: exactly one of data_idx, session_id, task
        (beside the id rule an env-ref class may already state)."""
        rules = schema.setdefault("allOf", [])
        rules.append({"oneOf": [{"required": [k]} for k in TASK_SOURCES]})
        if webshop:  # this class's own extra replaces EnvIdxRef's: restate its id rule
            rules.append(ID_OR_ENV_IDX)

    class ResetBody(EnvRef):
        model_config = ConfigDict(strict=True, json_schema_extra=one_task_source)
        data_idx: int | None = Field(None, description="index into the env's task list of `split` "
                                                       "(any index >= 0, taken modulo its size)")
        session_id: int | None = Field(None, description="WebShop's name for data_idx")
        split: str = "test"
        task: TaskBody | None = Field(None, description="a full task instead of data_idx, checked by "
                                                        "the env's task_from_dict")
        snapshot: bool = Field(False, description="also store a snapshot of the new state")

        @model_validator(mode="after")
        def _one_source(self):
            if sum(getattr(self, k) is not None for k in TASK_SOURCES) != 1:
                raise ValueError("give exactly one of data_idx (with split), session_id or task")
            return self

    class StepBody(EnvRef):
        action: str = Field(max_length=MAX_ACTION_CHARS)
        snapshot: bool = Field(False, description="also store a snapshot of the new state")

    class RestoreBody(EnvRef):
        snapshot_id: str = Field(max_length=200)

    class ForkBody(EnvRef):
        snapshot_id: str | None = Field(None, max_length=200)

    return Bodies(EnvRef, ResetBody, StepBody, RestoreBody, ForkBody)
