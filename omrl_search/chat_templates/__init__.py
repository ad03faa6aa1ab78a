"""Chat templates for training the policy with other libraries on omrl-search's exports.

``smollm2_training.jinja`` is SmolLM2-Instruct's chat template with ``{% generation %}`` markers
around each assistant turn (its content and ``<|im_end|>``), so TRL's ``assistant_only_loss=True``
trains exactly the tokens our ``segments`` mark ``trainable``; it renders the same text as the
stock template (tested), and an assistant message with ``trainable: false`` (an invalid step in an
SFT export) is rendered without markers. Use it with ``SFTConfig(chat_template_path=path())``
(see docs/interop.md).
"""
from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).resolve().parent
TEMPLATES = ("smollm2",)


def path(name: str = "smollm2") -> str:
    """The file of a shipped training template (``smollm2``)."""
    if name not in TEMPLATES:
        raise ValueError(f"no training chat template {name!r} (shipped: {', '.join(TEMPLATES)})")
    return str(_DIR / f"{name}_training.jinja")


def training_template(name: str = "smollm2") -> str:
    """The text of a shipped training template."""
    return Path(path(name)).read_text(encoding="utf-8")
