"""A policy version's delta (steps/model/delta.py): what it holds, that applying it gives the new version bit for bit,
and the digest an engine reads back out of its own layout (steps/engines/weights.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moeloop.steps.engines.weights import EngineWeights, Slot, concatenated
from moeloop.steps.model import delta
from moeloop.steps.model.delta import (
    BLOCK,
    CheckpointTensors,
    DeltaFile,
    checkpoint_digests,
    decode,
    encode,
    tensor_digest,
    weights_digest,
    write_delta,
)
from moeloop.steps.model.file_changes import file_changes
from moeloop.steps.model.hf_shards import INDEX, SafetensorsWriter, StoredTensor
from moeloop.steps.rl.checkpoint import HFLayout


def versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Two bf16 versions: a tensor spanning several 65,536-element blocks with changes at their edges, one
    unchanged, and one whose only change is 0.0 -> -0.0 (equal as numbers, not as bytes)."""
    generator = torch.Generator().manual_seed(0)
    base = {
        "big": torch.randn(3 * BLOCK + 5, generator=generator).to(torch.bfloat16).view(1, -1),
        "same": torch.randn(7, 3, generator=generator).to(torch.bfloat16),
        "signed": torch.zeros(4, dtype=torch.bfloat16),
    }
    new = {name: tensor.clone() for name, tensor in base.items()}
    positions = torch.tensor([0, 1, BLOCK - 1, BLOCK, 2 * BLOCK + 17, 3 * BLOCK + 4])
    new["big"].view(-1)[positions] = (new["big"].view(-1)[positions].float() * 1.5).to(torch.bfloat16)
    new["signed"][2] = -0.0
    return base, new


def read_delta(files: list[Path]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, flat positions, new values) of each changed tensor in the files, decoded here."""
    changes = []
    for path in files:
        delta = DeltaFile(path)
        for c in delta.changed:
            positions = decode(delta.parts("counts", [c]), delta.parts("offsets", [c]))
            changes.append((c.name, positions, delta.parts("values", [c])))
    return changes


def apply(base: dict[str, torch.Tensor], files: list[Path]) -> dict[str, torch.Tensor]:
    result = {name: tensor.clone() for name, tensor in base.items()}
    for name, positions, values in read_delta(files):
        result[name].view(-1).index_copy_(0, positions, values)
    return result


def test_a_delta_holds_the_changed_elements_and_applying_it_gives_the_new_version_bit_for_bit(tmp_path: Path) -> None:
    base, new = versions()
    summary = write_delta(base, new, tmp_path)
    files = sorted(tmp_path.glob("delta-*.safetensors"))
    changed = {name: positions.tolist() for name, positions, _ in read_delta(files)}
    assert changed == {"big": [0, 1, BLOCK - 1, BLOCK, 2 * BLOCK + 17, 3 * BLOCK + 4], "signed": [2]}
    assert (summary.changed, summary.elements) == (7, 3 * BLOCK + 5 + 21 + 4)
    result = apply(base, files)
    for name in new:
        assert torch.equal(result[name].view(torch.int16), new[name].view(torch.int16)), name
    assert summary.digests == checkpoint_digests(new) and summary.base_digests == checkpoint_digests(base)
    record = summary.record(4, 5)
    assert record["digest"] == weights_digest(checkpoint_digests(result)) != record["base_digest"]
    assert summary.delta_bytes == sum(path.stat().st_size for path in files)


def test_a_delta_is_a_file_per_checkpoint_file_and_names_no_unchanged_tensor(tmp_path: Path) -> None:
    base, new = versions()
    base["third"] = torch.ones(3, dtype=torch.bfloat16)
    new["third"] = torch.tensor([2.0, 1.0, 1.0], dtype=torch.bfloat16)
    files = {"big": "model-00002-of-00002.safetensors", "third": "model-00002-of-00002.safetensors"}
    files |= {name: "model-00001-of-00002.safetensors" for name in ("signed", "same")}
    write_delta(base, new, tmp_path, files)
    by_file = {path.name: sorted(c.name for c in DeltaFile(path).changed) for path in tmp_path.glob("delta-*")}
    assert by_file == {
        "delta-model-00001-of-00002.safetensors": ["signed"],
        "delta-model-00002-of-00002.safetensors": ["big", "third"],
    }
    assert all(torch.equal(t, new[n]) for n, t in apply(base, sorted(tmp_path.glob("delta-*"))).items())


def test_the_bases_known_digests_are_taken_as_they_are_and_the_others_hashed(tmp_path: Path) -> None:
    """A committed record's digests of the base (commit_delta reads version N-1's) are not computed again: a known
    digest, here a made-up one, is the summary's as it is; the delta is the same."""
    base, new = versions()
    summary = write_delta(base, new, tmp_path / "known", base_digests={"big": "ab" * 32})
    assert summary.base_digests == checkpoint_digests(base) | {"big": "ab" * 32}
    assert summary.digests == checkpoint_digests(new)
    write_delta(base, new, tmp_path / "hashed")
    written = [sorted((tmp_path / run).glob("delta-*")) for run in ("known", "hashed")]
    assert [path.read_bytes() for path in written[0]] == [path.read_bytes() for path in written[1]]


def test_without_a_base_or_with_other_tensors_there_is_no_delta(tmp_path: Path) -> None:
    base, new = versions()
    summary = write_delta(None, new, tmp_path / "none")
    assert summary.digests == checkpoint_digests(new) and not list((tmp_path / "none").glob("delta-*"))
    assert summary.record(0, 1)["base_digest"] is None
    with pytest.raises(ValueError, match="different tensors"):
        write_delta({"other": base["big"]}, new, tmp_path / "other")
    with pytest.raises(ValueError, match="differ in kind"):
        write_delta(base | {"same": base["same"].float()}, new, tmp_path / "kind")


def test_positions_encode_per_block_and_decode_back() -> None:
    positions = torch.tensor([3, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 65535])
    counts, offsets = encode(positions, 6 * BLOCK)
    assert counts.tolist() == [2, 2, 0, 0, 0, 1] and offsets.dtype == torch.uint16
    assert torch.equal(decode(counts, offsets), positions)


def test_a_checkpoint_folders_tensors_and_digests_are_its_files_bytes(tmp_path: Path) -> None:
    _, new = versions()
    save_file(new, tmp_path / "model.safetensors")
    tensors = CheckpointTensors(tmp_path)
    assert tensors.kinds() == {name: (tuple(t.shape), torch.bfloat16) for name, t in new.items()}
    import blake3

    raw = new["same"].contiguous().view(torch.int16).numpy().tobytes()
    assert checkpoint_digests(tensors)["same"] == blake3.blake3(raw).hexdigest() == tensor_digest(new["same"])


def test_engine_weights_write_a_delta_into_fused_and_packed_tensors_and_read_the_checkpoint_back(
    tmp_path: Path,
) -> None:
    """An engine that fuses q and k into one fp32 tensor, and packs experts per slab (each slab transposed, as a
    kernel's packing permutes it): the delta lands on the changed elements only, and the digests read back are the
    new checkpoint's."""
    generator = torch.Generator().manual_seed(1)
    base = {name: torch.randn(shape, generator=generator).to(torch.bfloat16)
            for name, shape in {"q": (4, 3), "k": (2, 3), "e0": (2, 5), "e1": (2, 5)}.items()}  # fmt: skip
    new = {name: tensor.clone() for name, tensor in base.items()}
    new["k"][1, 2] = 7.0
    new["e1"][0, 4] = -3.0
    write_delta(base, new, tmp_path)
    qk = torch.cat([base["q"], base["k"]]).float()
    slab = torch.arange(10).view(2, 5).t().reshape(-1)  # packed position p holds unpacked element slab[p]
    packing = torch.empty(10, dtype=torch.int64)
    packing[slab] = torch.arange(10)
    experts = torch.stack([base["e0"], base["e1"]]).float().view(2, -1)[:, slab].contiguous()
    slots = concatenated("qk", [("q", 12, torch.bfloat16), ("k", 6, torch.bfloat16)])
    slots |= concatenated("experts", [("e0", 10, torch.bfloat16), ("e1", 10, torch.bfloat16)])
    weights = EngineWeights({"qk": qk, "experts": experts}, slots, {"experts": packing})
    assert weights.refusal(base) is None
    assert weights.digests() == checkpoint_digests(base)
    before = {"qk": qk.clone(), "experts": experts.clone()}
    weights.apply_delta(sorted(tmp_path.glob("delta-*")))
    assert weights.digests() == checkpoint_digests(new)
    assert int((qk != before["qk"]).sum()) == 1 and qk[5, 2] == 7.0
    assert int((experts != before["experts"]).sum()) == 1 and experts.view(2, -1)[1, packing[4]] == -3.0


def test_digests_hashed_side_by_side_are_each_tensors_blake3(monkeypatch: pytest.MonkeyPatch) -> None:
    """`Digests` on host tensors: hundreds of them, with so little allowed in flight that it waits for the oldest
    hashes again and again, in the order they were added."""
    import blake3

    monkeypatch.setattr(delta, "IN_FLIGHT_BYTES", 4096)
    generator = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randn(1 + i * 7, generator=generator).to(torch.bfloat16) for i in range(300)}
    digests = checkpoint_digests(tensors)
    assert list(digests) == list(tensors)
    raw = {name: t.view(torch.int16).numpy().tobytes() for name, t in tensors.items()}
    assert digests == {name: blake3.blake3(data).hexdigest() for name, data in raw.items()}


def test_digests_on_fewer_threads_hash_the_same_and_keep_to_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check beside an engine's generating (`Digests(threads)`) takes no more cores than it is given, a large
    tensor's hash included (by default: all of them), and its digests are the all-cores ones."""
    import blake3

    monkeypatch.setattr(delta, "PARALLEL_HASH_BYTES", 1024)  # every tensor here a large one's path
    generator = torch.Generator().manual_seed(4)
    tensors = {f"t{i}": torch.randn(600 * (i + 1), generator=generator).to(torch.bfloat16) for i in range(6)}
    asked: list[int] = []
    hasher = blake3.blake3

    def spied(data: object, max_threads: int = 1) -> object:
        asked.append(max_threads)
        return hasher(data, max_threads=max_threads)

    monkeypatch.setattr(delta.blake3, "blake3", spied)
    spied.AUTO = hasher.AUTO  # type: ignore[attr-defined]
    everywhere = checkpoint_digests(tensors)
    assert set(asked) == {hasher.AUTO}
    asked.clear()
    with delta.Digests(threads=1) as digests:
        assert digests.pool._max_workers == 1
        for name, tensor in tensors.items():
            digests.add(name, tensor)
        assert digests.result() == everywhere
    assert set(asked) == {1}


def delta_file(path: Path, changes: dict[str, tuple[list[int], list[float]]], numels: dict[str, int]) -> Path:
    """A delta file as write_delta lays one out, of changes {name: (positions, values)} to fp32 tensors."""
    tensors = {}
    for name, (positions, values) in changes.items():
        counts, offsets = encode(torch.tensor(positions), numels[name])
        tensors |= {f"{name}:counts": counts, f"{name}:offsets": offsets, f"{name}:values": torch.tensor(values)}
    save_file(tensors, path)
    return path


def test_a_delta_writing_past_its_tensor_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Positions beyond a checkpoint tensor (a delta of another model) would land in its neighbour in the fused
    tensor: refused naming it, before any of the file is written, in a tensor's last block and beyond its blocks."""
    slots = concatenated("qk", [("q", 4, torch.float32), ("k", 4, torch.float32)])
    weights = EngineWeights({"qk": torch.zeros(8)}, slots, {})
    past = delta_file(tmp_path / "past.safetensors", {"k": ([1], [2.0]), "q": ([0, 4], [1.0, 1.0])}, {"k": 4, "q": 4})
    with pytest.raises(ValueError, match="a delta of q writes position 4 of its 4"):
        weights.apply_delta([past])
    beyond = delta_file(tmp_path / "beyond.safetensors", {"q": ([BLOCK + 1], [1.0])}, {"q": 4})
    with pytest.raises(ValueError, match="a delta of q does not encode positions in its 4 elements"):
        weights.apply_delta([beyond])
    assert not weights.tensors["qk"].any()
    fits = delta_file(tmp_path / "fits.safetensors", {"k": ([3], [2.0]), "q": ([0], [1.0])}, {"k": 4, "q": 4})
    weights.apply_delta([fits])
    assert weights.tensors["qk"].tolist() == [1.0, 0, 0, 0, 0, 0, 0, 2.0]


def test_a_file_that_is_not_a_delta_is_refused_naming_what_it_holds(tmp_path: Path) -> None:
    weights = EngineWeights({"w": torch.zeros(4)}, {"w": Slot("w", 0, 4, torch.float32)}, {})
    save_file({"w:counts": torch.ones(1, dtype=torch.int32), "w:offsets": torch.zeros(1, dtype=torch.uint16)},
              tmp_path / "two.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match="w has the parts"):
        weights.apply_delta([tmp_path / "two.safetensors"])
    save_file({"w:counts": torch.ones(1), "w:offsets": torch.zeros(1, dtype=torch.uint16), "w:values": torch.ones(1)},
              tmp_path / "float_counts.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match="w:counts .* is no delta's counts"):
        weights.apply_delta([tmp_path / "float_counts.safetensors"])
    save_file({"w:counts": torch.tensor([2], dtype=torch.int32), "w:offsets": torch.zeros(1, dtype=torch.uint16),
               "w:values": torch.ones(1)}, tmp_path / "counts.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match="a delta of w does not encode positions"):
        weights.apply_delta([tmp_path / "counts.safetensors"])
    save_file({"x:counts": torch.ones(1, dtype=torch.int32), "x:offsets": torch.zeros(1, dtype=torch.uint16),
               "x:values": torch.ones(1)}, tmp_path / "other.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match="a delta changes x, which the engine does not hold"):
        weights.apply_delta([tmp_path / "other.safetensors"])
    assert not weights.tensors["w"].any()


def test_engine_weights_refuse_what_they_cannot_hold_exactly() -> None:
    bf16 = {"w": Slot("w", 0, 4, torch.bfloat16)}
    assert "does not hold" in EngineWeights({"w": torch.zeros(4, dtype=torch.float16)}, bf16, {}).refusal(["w"])
    assert "holds no x" in EngineWeights({"w": torch.zeros(4)}, bf16, {}).refusal(["w", "x"])
    assert "elements do not hold" in EngineWeights({"w": torch.zeros(3)}, bf16, {}).refusal(["w"])
    assert EngineWeights({"w": torch.zeros(6)}, bf16, {}).refusal(["w"]) is None  # the rest: padding


def test_a_delta_file_laid_out_tensor_by_tensor_applies_as_one_laid_out_by_part(tmp_path: Path) -> None:
    """write_delta's files hold each part of every tensor together (safetensors orders by dtype, then name), which
    the engine copies a batch at a time; a file that holds each tensor's three parts together, as another writer
    may, gives the same weights."""
    import json
    import struct

    base, new = versions()
    write_delta(base, new, tmp_path / "by_part")
    (by_part,) = sorted((tmp_path / "by_part").glob("delta-*"))
    delta = DeltaFile(by_part)
    entries, data = {}, b""
    for c in sorted(delta.changed, key=lambda c: c.name):
        for part in ("counts", "offsets", "values"):
            tensor = delta.parts(part, [c])
            raw = tensor.view(torch.uint8).numpy().tobytes()
            data += b"\0" * (-len(data) % 4)  # each part starts aligned to its elements
            code = {"counts": "I32", "offsets": "U16", "values": "BF16"}[part]
            where = [len(data), len(data) + len(raw)]
            entries[f"{c.name}:{part}"] = {"dtype": code, "shape": [len(tensor)], "data_offsets": where}
            data += raw
    text = json.dumps(entries).encode()
    text += b" " * (-len(text) % 8)
    by_tensor = tmp_path / "by_tensor.safetensors"
    by_tensor.write_bytes(struct.pack("<Q", len(text)) + text + data)
    assert [c.name for c in DeltaFile(by_tensor).changed] == [c.name for c in delta.changed]
    held = {}
    for layout, path in (("by part", by_part), ("by tensor", by_tensor)):
        flat = {name: tensor.clone().view(-1) for name, tensor in base.items()}
        weights = EngineWeights(flat, concatenated_each(base), {})
        weights.apply_delta([path])
        held[layout] = weights.digests()
    assert held["by part"] == held["by tensor"] == checkpoint_digests(new)


def concatenated_each(tensors: dict[str, torch.Tensor]) -> dict[str, Slot]:
    """Each tensor its own engine tensor."""
    return {name: Slot(name, 0, t.numel(), t.dtype) for name, t in tensors.items()}


def test_a_cut_delta_file_is_refused_naming_the_part_past_its_end(tmp_path: Path) -> None:
    base, new = versions()
    write_delta(base, new, tmp_path / "whole")
    (whole,) = sorted((tmp_path / "whole").glob("delta-*"))
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(whole.read_bytes()[:-4])
    with pytest.raises(ValueError, match=r"cut.safetensors: \S+ lies at bytes \d+-\d+ of its \d+ bytes of data"):
        DeltaFile(cut)


def test_ranks_share_a_checkpoints_files_whole_and_balanced_by_bytes() -> None:
    """A trainer's ranks each write whole files of the checkpoint (and their deltas): the largest first, each to the
    rank holding the fewest bytes; every file once; a rank beyond the files writes none."""
    sizes = {"a": 100, "b": 60, "c": 50, "d": 40, "e": 10}  # bf16 elements: 200, 120, 100, 80, 20 bytes
    stored = {key: [StoredTensor(f"model.{key}", (n,), torch.bfloat16)] for key, n in sizes.items()}
    layout = HFLayout(None, None, stored, [f"f{k}" for k in range(5)], [[key] for key in sizes])
    assert layout.shares(2) == [[0, 3], [1, 2, 4]]  # 280 and 240 bytes
    assert sorted(f for share in layout.shares(3) for f in share) == list(range(5))
    assert layout.shares(8)[5:] == [[], [], []]
    assert layout.weight_map([1, 4]) == {"model.b": "f1", "model.e": "f4"}


def test_a_checkpoint_files_tensors_compared_at_once_make_the_delta_one_at_a_time_makes(tmp_path: Path) -> None:
    """Folders of one layout: a file of 2-byte tensors (bf16 and fp16) or of fp32 ones compares as one array
    (file_changes); a file of both sizes, or laid out otherwise in the base, a tensor at a time; the delta files are
    the same bytes as from the same tensors in memory, compared one at a time."""
    base, new = versions()
    base["half"], base["norm"] = torch.arange(BLOCK + 9, dtype=torch.float16), torch.ones(5)
    new["half"], new["norm"] = base["half"].clone(), torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0])
    base["bias"], base["scale"] = torch.zeros(2 * BLOCK), torch.ones(3)
    new["bias"], new["scale"] = base["bias"].clone(), base["scale"].clone()
    new["bias"][[0, 2 * BLOCK - 1]] = -0.0
    new["half"][[4, BLOCK + 8]] = -1.0
    files = {"big": "model-00001-of-00002.safetensors", "signed": "model-00001-of-00002.safetensors"}
    reverse = functools.partial(sorted, reverse=True)
    files |= {"half": "model-00001-of-00002.safetensors"}
    files |= {name: "model-00002-of-00002.safetensors" for name in ("same", "norm")}
    files |= {name: "model-00003-of-00003.safetensors" for name in ("bias", "scale")}
    for folder, version, order in (("base", base, sorted), ("new", new, sorted), ("reordered", base, reverse)):
        (tmp_path / folder).mkdir()
        for file in set(files.values()):
            names = order(name for name in files if files[name] == file)
            stored = [StoredTensor(name, tuple(version[name].shape), version[name].dtype) for name in names]
            with SafetensorsWriter(tmp_path / folder / file, stored) as writer:
                for name in names:
                    writer.write(version[name])
        (tmp_path / folder / INDEX).write_text(json.dumps({"weight_map": files}))
    first, second, other = (tmp_path / f / "model-00001-of-00002.safetensors" for f in ("base", "new", "reordered"))
    at_once = file_changes(first, second, ["big", "signed", "half"])
    assert at_once is not None and sorted(at_once) == ["big", "half", "signed"]
    assert file_changes(other, second, ["big", "signed", "half"]) is None  # laid out otherwise
    assert file_changes(*(tmp_path / f / "model-00002-of-00002.safetensors" for f in ("base", "new")), files) is None
    third = (tmp_path / f / "model-00003-of-00003.safetensors" for f in ("base", "new"))
    fp32 = file_changes(*third, ["bias", "scale"])
    assert fp32 is not None and list(fp32) == ["bias"] and fp32["bias"][2].dtype == torch.float32
    assert file_changes(first, second, ["big", "signed"]) is None  # not all of the file's tensors

    in_memory = write_delta(base, new, tmp_path / "in-memory", files)
    for folder in ("base", "reordered"):
        from_files = write_delta(CheckpointTensors(tmp_path / folder), CheckpointTensors(tmp_path / "new"),
                                 tmp_path / f"from-{folder}", files)  # fmt: skip
        assert from_files == in_memory, folder
        written = [sorted((tmp_path / run).glob("delta-*")) for run in ("in-memory", f"from-{folder}")]
        assert [p.name for p in written[0]] == [p.name for p in written[1]] == [
            "delta-model-00001-of-00002.safetensors", "delta-model-00002-of-00002.safetensors",
            "delta-model-00003-of-00003.safetensors"]  # fmt: skip
        assert [p.read_bytes() for p in written[0]] == [p.read_bytes() for p in written[1]], folder
    assert in_memory.changed == 7 + 2 + 1 + 2
    assert all(torch.equal(t.view(-1).view(torch.uint8), new[n].view(-1).view(torch.uint8))
               for n, t in apply(base, sorted((tmp_path / "from-base").glob("delta-*"))).items())  # fmt: skip
