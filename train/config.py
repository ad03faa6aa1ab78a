"""Training configuration: pydantic models loaded from YAML with CLI overrides.

``TrainConfig.from_sources("cfg.yaml", ["lr=1e-4", "lora.r=16"])``: defaults < YAML < overrides
(dotted keys reach nested settings; values are parsed as YAML scalars). Unknown keys and bad
values fail with one line naming the file and key. Trainers subclass :class:`TrainConfig`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Iterator, Literal, Sequence, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from omrl_search.agent import check_agent_name

M = TypeVar("M", bound=BaseModel)


class TrainError(Exception):
    """A bad config, data file or checkpoint; printed as one line by ``omrl train``."""


#: a config field naming an agent format of :data:`omrl_search.agent.AGENT_FORMATS` (react, act,
#: terse)
AgentName = Annotated[str, AfterValidator(check_agent_name)]


# --- configuration -----------------------------------------------------------------------------
class LoraSettings(BaseModel):
    """peft LoRA: rank, scale, dropout, which modules (``all-linear`` or names)."""

    model_config = ConfigDict(extra="forbid")
    r: int = Field(8, ge=1)
    alpha: float = 16.0
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] | str = "all-linear"
    merge: bool = True  # write the merged model as the output (the adapter is kept in adapter/)


class DeepSpeedSettings(BaseModel):
    """DeepSpeed ZeRO: stage 2 or 3, CPU offload of the optimizer, extra raw config keys."""

    model_config = ConfigDict(extra="forbid")
    stage: Literal[2, 3] = 2
    offload_optimizer: bool = False
    backend: str = "auto"  # torch.distributed backend: nccl on GPUs, gloo on CPU
    extra: dict[str, Any] = Field(default_factory=dict)


class TrainConfig(BaseModel):
    """Settings every trainer shares. Trainers subclass it for their own (``beta``, ``packing``...)."""

    model_config = ConfigDict(extra="forbid")
    model: str = "smollm2"  # an HF folder, a .gguf file, or "smollm2" (the bundled model)
    data: list[str] = Field(default_factory=list)  # parquet files
    out: str = "runs/train"

    @field_validator("data")
    @classmethod
    def _data_files_exist(cls, paths: list[str]) -> list[str]:
        """A missing data file is one line before any model loads (not after)."""
        for path in paths:
            if not Path(path).exists():  # a parquet file, or a folder of them (label files)
                raise ValueError(f"{path}: no such file")
        return paths
    lr: float = Field(1e-5, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    batch_size: int = Field(4, ge=1)  # sequences (or packed rows) per micro-batch, per device
    grad_accum: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1)  # optimizer steps; default: epochs over the data
    epochs: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    max_grad_norm: float | None = 1.0
    max_length: int = Field(1024, ge=8)  # tokens per sequence; longer rows are cut at the end
    seed: int = 0
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # bf16 = autocast over fp32 weights
    gradient_checkpointing: bool = False
    lora: LoraSettings | None = None
    deepspeed: DeepSpeedSettings | None = None
    save_every: int = Field(0, ge=0)  # optimizer steps between checkpoints (0: none until the end)
    keep_checkpoints: int = Field(2, ge=1)
    resume: bool = False
    log_every: int = Field(1, ge=1)
    tensorboard: bool = False
    progress: bool = True

    @classmethod
    def from_sources(cls, yaml_path: str | None = None,
                     overrides: dict[str, Any] | Sequence[str] | None = None) -> "TrainConfig":
        """Defaults < YAML file < overrides (see :func:`settings_from_sources`)."""
        return settings_from_sources(cls, yaml_path, overrides)


def settings_from_sources(cls: type[M], yaml_path: str | None = None,
                          overrides: dict[str, Any] | Sequence[str] | None = None) -> M:
    """A pydantic settings model from defaults < YAML file < overrides (a dict with dotted keys,
    or ``key=value`` strings whose values are parsed as YAML scalars). Errors name the file or
    key in one line (:class:`TrainError`)."""
    data: dict[str, Any] = {}
    if yaml_path:
        import yaml

        try:
            loaded = yaml.safe_load(Path(yaml_path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise TrainError(f"{yaml_path}: {str(exc).splitlines()[0]}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise TrainError(f"{yaml_path}: a config file must hold a mapping")
        data = loaded or {}
    for key, value in override_items(overrides):
        _set_dotted(data, key, value)
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "config"
        src = f"{yaml_path}: " if yaml_path else ""
        raise TrainError(f"{src}{where}: {err['msg']}") from None


def override_items(overrides: dict[str, Any] | Sequence[str] | None) -> Iterator[tuple[str, Any]]:
    if not overrides:
        return
    if isinstance(overrides, dict):
        yield from overrides.items()
        return
    import yaml

    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise TrainError(f"override {item!r} is not key=value")
        try:
            yield key.strip(), yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            yield key.strip(), raw


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    cur = data
    for p in parents:
        if not isinstance(cur.get(p), dict):
            cur[p] = {}
        cur = cur[p]
    cur[last] = value
