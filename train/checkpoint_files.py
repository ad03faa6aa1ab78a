"""What a checkpoint folder holds and how a finished folder is put in place.

Shared by the one-process runner (:mod:`train.runtime`) and the DeepSpeed paths
(:mod:`train.distributed`), so neither imports the other for them.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

#: the trainer's own state in a checkpoint folder (step, RNG, data position, policy version)
STATE_FILE = "trainer_state.pt"


def publish_folder(tmp: Path, dest: Path) -> None:
    """Move every entry of ``tmp`` into ``dest`` (replacing same-named entries), then drop tmp."""
    dest.mkdir(parents=True, exist_ok=True)
    for entry in tmp.iterdir():
        target = dest / entry.name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)
    tmp.rmdir()
