"""The run's metrics files, metrics/iter-NNNNNN.json: evaluate writes each one whole once the iteration is done;
evaluate's re-run and `moeloop report` read them back here, each checked to be its own iteration's."""

from __future__ import annotations

import re
from typing import Any

from moeloop.steps.errors import MoeloopError
from moeloop.steps.storage.run import RunStorage

METRICS_NAME = re.compile(r"iter-(\d{6})\.json")


def read_metrics(storage: RunStorage, iteration: int) -> dict[str, Any]:
    """One iteration's metrics; anything else at its path is foreign data, an error."""
    relative = storage.metrics(iteration)
    value = storage.read_json(relative)
    if not isinstance(value, dict) or value.get("iteration") != iteration:
        raise MoeloopError(
            f"{storage.display(relative)} is not iteration {iteration}'s metrics: foreign data,"
            " refusing to use or overwrite it"
        )
    return value


def committed_metrics(storage: RunStorage) -> list[dict[str, Any]]:
    """Every metrics file of the run, by iteration."""
    folder = RunStorage.metrics(0).rsplit("/", 1)[0]
    found = (METRICS_NAME.fullmatch(name) for name in storage.list(folder))
    return [read_metrics(storage, int(match[1])) for match in found if match]
