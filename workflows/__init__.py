"""What runs where: the loop's DAG, its Argo objects, the local runner and the `moeloop` CLI.

`moeloop.workflows.build(config, run_uri)` returns the run's Argo objects as Hera objects (workflows/render/loop.py's
`Loop`), for Python users who add to them and submit them with Hera; `examples/notify_after_publish.py` is one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeloop.workflows.render.loop import Loop, build

__all__ = ["Loop", "build"]


def __getattr__(name: str) -> Any:
    # Imported on first use: Hera takes half a second to import, which `moeloop run` and `report` do not need.
    if name in __all__:
        from moeloop.workflows.render import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'moeloop.workflows' has no attribute {name!r}")
