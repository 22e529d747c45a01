"""The images the roles' pods run (images/): their names as the render writes them, and the `docker build` commands
that make them for a config (`moeloop images`).

rollout.environment's package is built into the images that run the environment (the build argument
ENVIRONMENT_PACKAGE, images/install-environment.sh), not installed as a pod starts: Spot rollout pods start again
often, and a node may reach no package index. Those images' tag carries the package's digest, so that a config with
another package names another image, never one built without it.
"""

from __future__ import annotations

import hashlib
import shlex

from moeloop.steps.config import MoeloopConfig
from moeloop.steps.config_cluster import ROLES

ROLE_IMAGES = {
    "rollout": "moeloop-rollout",
    "reward": "moeloop-rollout",  # reward models run on the rollout image's vLLM/torch
    "train": "moeloop-trainer",
    "cpu": "moeloop-cpu",
    "memory": "moeloop-cpu",
}
DOCKERFILES = {
    "moeloop-cpu": "images/cpu/Dockerfile",
    "moeloop-rollout": "images/rollout/Dockerfile",
    "moeloop-trainer": "images/trainer/Dockerfile",
}
# Start reads the environment's datasets and evaluate plays it on CPU; the rollouts play it on GPUs.
ENVIRONMENT_IMAGES = frozenset({"moeloop-cpu", "moeloop-rollout"})
ENVIRONMENT_TAG_DIGITS = 12


def image_tag(config: MoeloopConfig, image: str) -> str:
    """cluster.image_tag; for an image that installs rollout.environment's package, with `-env-<its digest>`."""
    environment = config.rollout.environment
    if environment is None or image not in ENVIRONMENT_IMAGES:
        return config.cluster.image_tag
    digest = hashlib.sha256(environment.package.encode()).hexdigest()[:ENVIRONMENT_TAG_DIGITS]
    return f"{config.cluster.image_tag}-env-{digest}"


def image_reference(config: MoeloopConfig, image: str) -> str:
    return f"{config.cluster.image_registry.rstrip('/')}/{image}:{image_tag(config, image)}"


def role_image(config: MoeloopConfig, role: str) -> str:
    """The image a role's pods run unless cluster.<role>.image names another."""
    return image_reference(config, ROLE_IMAGES[role])


def build_commands(config: MoeloopConfig) -> list[str]:
    """The `docker build` command (run from the repository root) of each image a role of the config runs by default;
    an image every role of which names its own is the user's to build."""
    used = {ROLE_IMAGES[role] for role in ROLES if getattr(config.cluster, role).image is None}
    commands = []
    for image, dockerfile in DOCKERFILES.items():
        if image not in used:
            continue
        arguments = ["docker", "build", "-f", dockerfile]
        if config.rollout.environment is not None and image in ENVIRONMENT_IMAGES:
            arguments += ["--build-arg", f"ENVIRONMENT_PACKAGE={config.rollout.environment.package}"]
        commands.append(shlex.join([*arguments, "-t", image_reference(config, image), "."]))
    return commands
