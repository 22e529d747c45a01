"""Upstream files some tests compare against: the Argo example corpus, Argo's CRDs and the Argo server's Swagger,
the Karpenter, JobSet and Kubeflow CRDs. They are not part of the package and not in the repository: the tests
read them from the folder named by $MOELOOP_SHARED (laid out as schemas/ and corpora/; `.ci/run` sets it to the
clone's ../shared). Without the variable those tests are skipped, with a reason that names it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV = "MOELOOP_SHARED"
SKIP_REASON = f"${ENV} is not set: it names the folder of upstream schemas and corpora (.ci/run sets it to ../shared)"
needs_upstream = pytest.mark.skipif(not os.environ.get(ENV), reason=SKIP_REASON)


def available() -> bool:
    return bool(os.environ.get(ENV))


def upstream(*parts: str) -> Path:
    """A path under $MOELOOP_SHARED; skips the calling test when the variable is unset, fails when the file is
    missing (a wrong variable must not pass as a skip)."""
    root = os.environ.get(ENV)
    if not root:
        pytest.skip(SKIP_REASON)
    path = Path(root).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"${ENV}={root}: {path} does not exist")
    return path
