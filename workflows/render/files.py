"""Writing a render: every object linted and checked under the API server's size limit, then written as Hera's
YAML, all files or none.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import yaml

from moeloop.steps.errors import MoeloopError
from moeloop.steps.inputs import output_folder
from moeloop.workflows.lint.documents import lint_documents
from moeloop.workflows.render.loop import Loop

# libyaml's emitter when PyYAML was built with it: same output as PyYAML's own, about 3x faster.
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
# etcd's request limit is ~1.5 MiB and Argo adds status to a Workflow: a rendered object must stay well below.
MAX_OBJECT_BYTES = 1_000_000
YAML_WIDTH = 1 << 16  # no folded lines: a diff of two renders shows whole values


def write_rendered(loop: Loop, out_dir: Path) -> list[Path]:
    """Lint every object (templateRefs across them) and check its size, then write each with Hera's YAML
    serialization into out_dir. Nothing is written unless all can be."""
    objects = loop.objects()
    documents = {name: hera_object.to_dict() for name, hera_object in objects.items()}
    errors = lint_documents(documents.values(), source=str(out_dir))
    if errors:
        raise MoeloopError(f"refusing to write an invalid manifest: {errors[0]}")
    for file_name, document in documents.items():
        size = object_bytes(document)
        if size > MAX_OBJECT_BYTES:
            raise MoeloopError(f"{file_name}: {size} bytes is over the {MAX_OBJECT_BYTES}-byte object limit")
    texts = {name: hera_object.to_yaml(Dumper=YAML_DUMPER, width=YAML_WIDTH) for name, hera_object in objects.items()}
    return write_files(texts, out_dir)


def write_files(texts: dict[str, str], out_dir: Path) -> list[Path]:
    """Write each text to out_dir/<name>, replacing what is there: all or none. Every text goes to a temporary
    name first; only when all are written are they renamed into place."""
    output_folder(out_dir, "-o")
    temporaries: list[str] = []
    try:
        for name, text in texts.items():
            temporaries.append(_write_temporary(out_dir / name, text))
    except OSError as error:
        for temporary in temporaries:
            os.unlink(temporary)
        raise MoeloopError(f"{out_dir}: cannot write there: {error.strerror or error}") from None
    paths = [out_dir / name for name in texts]
    for temporary, path in zip(temporaries, paths):
        os.replace(temporary, path)
    return paths


def object_bytes(document: dict) -> int:
    """The object's size as the API server stores it (JSON)."""
    return len(json.dumps(document, separators=(",", ":")).encode())


def _write_temporary(path: Path, text: str) -> str:
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as stream:
            stream.write(text)
        os.chmod(temporary, 0o644)  # mkstemp makes it owner-only; a manifest is meant to be read by others
    except BaseException:
        os.unlink(temporary)
        raise
    return temporary

