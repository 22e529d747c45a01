"""Paths the pods read: the config's local paths, made relative to the repo root (the pods' WORKDIR) or refused."""

from __future__ import annotations

import os
from pathlib import Path

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.errors import MoeloopError

# Config fields naming a file the pods read: it must be reachable from inside the image or by URI.
LOCAL_PATH_FIELDS = (("task", "train_prompts"), ("task", "eval_prompts"), ("model", "checkpoint"))


def portable_config(config: MoeloopConfig) -> MoeloopConfig:
    """The config with local paths made relative to cwd, the repo root, which is the pods' WORKDIR."""
    cwd = Path.cwd().resolve()
    updates: dict[str, dict[str, str]] = {}
    for section, key in LOCAL_PATH_FIELDS:
        location = getattr(getattr(config, section), key)
        if location is not None:
            updates.setdefault(section, {})[key] = _portable_path(f"{section}.{key}", location, cwd)
    models = [
        model.model_copy(update={"path": _portable_path(f"reward.models[{k}].path", model.path, cwd)})
        for k, model in enumerate(config.reward.models)
    ]
    updates["reward"] = {"models": models}
    return config.model_copy(
        update={section: getattr(config, section).model_copy(update=keys) for section, keys in updates.items()}
    )


def _portable_path(field: str, location: str, cwd: Path) -> str:
    if "://" in location or not os.path.isabs(location):
        return location
    path = Path(location).resolve()  # a symlink out of the repo is as unreachable as a path outside it
    if not path.is_relative_to(cwd):
        raise MoeloopError(
            f"{field}: local path {location} is not reachable from the cluster; "
            "use an s3:// URI or a path inside the repo"
        )
    return path.relative_to(cwd).as_posix()
