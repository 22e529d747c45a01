"""The cluster guide (manifests/README.md), followed on paper as a new user would: every file it names exists (or an
earlier step of the guide creates it), every `moeloop` command parses with the CLI's own parser, every
`docker build` names a Dockerfile, build arguments that Dockerfile declares and a ghcr.io/moeloop name,
every `kubectl apply -k` a kustomization, and the config snippet validates."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import yaml

from moeloop.steps.config import MoeloopConfig, load_config
from tests.conftest import REPO
from moeloop.workflows.cli import parser

GUIDE_TITLE = "## Cluster guide"
# The commands the guide shows (issue #6's CLI contract).
CLI_CONTRACT = frozenset({"render", "lint", "register", "submit", "schedule", "status", "resubmit"})
REPO_DIRS = ("manifests", "images", "configs", "steps", "workflows", "tests", "benchmarks")
PATH_TOKEN = re.compile(rf"(?<![\w./-])((?:{'|'.join(REPO_DIRS)})/[\w./-]*[\w/])")


GUIDE = REPO / "manifests" / "README.md"


def guide() -> str:
    text = GUIDE.read_text()
    assert GUIDE_TITLE in text, f"{GUIDE} has no cluster guide"
    section = text[text.index(GUIDE_TITLE) :]
    end = section.find("\n## ", len(GUIDE_TITLE))
    return section if end < 0 else section[:end]


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", guide(), flags=re.DOTALL)


def shell_commands() -> list[list[str]]:
    commands = []
    for block in code_blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(shlex.split(line))
    return commands


def subcommands() -> set[str]:
    (commands,) = [a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return set(commands.choices)


def created_by_the_guide() -> set[Path]:
    return {(REPO / argv[-1]).resolve() for argv in shell_commands() if argv[0] == "cp"}


def test_every_file_the_guide_names_exists() -> None:
    named = set(PATH_TOKEN.findall(guide()))
    assert {"manifests/overlays/example", "images/trainer/Dockerfile", "manifests/iam/README.md"} <= named
    missing = [
        p for p in sorted(named) if not (REPO / p).exists() and (REPO / p).resolve() not in created_by_the_guide()
    ]
    assert not missing, f"the cluster guide names files that do not exist: {missing}"


def moeloop_command_errors(commands: list[list[str]]) -> list[str]:
    errors, available = [], subcommands()
    for argv in commands:
        if argv[1] in available:
            try:
                parser().parse_args(argv[1:])
            except SystemExit:  # argparse's verdict on an unknown flag or a missing argument
                errors.append(f"`{shlex.join(argv)}` does not parse")
        else:
            errors.append(f"`moeloop {argv[1]}` is not a command of the CLI")
    return errors


def test_every_moeloop_command_is_one_the_cli_has() -> None:
    commands = [argv for argv in shell_commands() if argv[0] == "moeloop"]
    shown = {argv[1] for argv in commands}
    assert shown == CLI_CONTRACT, f"the guide shows {sorted(shown)}, the contract is {sorted(CLI_CONTRACT)}"
    errors = moeloop_command_errors(commands)
    assert not errors, "\n".join(errors)


def test_every_docker_build_names_a_dockerfile_its_arguments_and_an_image_name() -> None:
    builds = [argv for argv in shell_commands() if argv[:2] == ["docker", "build"]]
    assert {argv[argv.index("-f") + 1] for argv in builds} == {
        f"images/{n}/Dockerfile" for n in ("cpu", "rollout", "trainer")
    }
    for argv in builds:
        dockerfile = argv[argv.index("-f") + 1]
        declared = set(re.findall(r"^ARG (\w+)", (REPO / dockerfile).read_text(), flags=re.MULTILINE))
        arguments = {argv[i + 1].split("=")[0] for i, token in enumerate(argv) if token == "--build-arg"}
        assert arguments and arguments <= declared, f"{dockerfile}: undeclared build arguments {arguments - declared}"
        name = Path(dockerfile).parent.name
        assert re.fullmatch(rf"ghcr\.io/moeloop/moeloop-{name}:[\w.-]+", argv[argv.index("-t") + 1])
        assert argv[-1] == "."  # the build context is the repository root: the Dockerfiles copy steps/, workflows/
    pushed = {argv[2] for argv in shell_commands() if argv[:2] == ["docker", "push"]}
    assert pushed == {argv[argv.index("-t") + 1] for argv in builds}


def test_kubectl_applies_a_kustomization() -> None:
    applied = [argv[argv.index("-k") + 1] for argv in shell_commands() if argv[:2] == ["kubectl", "apply"]]
    assert applied and all((REPO / d / "kustomization.yaml").is_file() for d in applied)


def test_the_config_snippet_validates_on_the_demo_config() -> None:
    (snippet,) = code_blocks("yaml")
    data = load_config(REPO / "configs" / "tiny.yaml").model_dump()
    data.update(yaml.safe_load(snippet))
    config = MoeloopConfig.model_validate(data)
    assert config.storage_root.startswith("s3://") and config.cluster.namespace == "moeloop"


def test_a_broken_command_would_be_caught() -> None:
    broken = [
        ["moeloop", "submit", "configs/my-run.yaml", "--host"],
        ["moeloop", "render", "configs/my-run.yaml", "--output-dir", "rendered/"],
        ["moeloop", "deploy", "configs/my-run.yaml"],
    ]
    assert moeloop_command_errors(broken) == [
        "`moeloop submit configs/my-run.yaml --host` does not parse",
        "`moeloop render configs/my-run.yaml --output-dir rendered/` does not parse",
        "`moeloop deploy` is not a command of the CLI",
    ]
