"""Publish's HF checkpoint from a trainer state's DCP weights: sharded safetensors streamed block by block, the same
tensors, config and generation config as HF's own `save_pretrained` (each family under its checkpoints' names),
and what `from_pretrained` loads; and a trainer rank reading only its experts from such a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel

from moeloop.steps.model.hf_shards import INDEX, SINGLE, SafetensorsWriter, StoredTensor, plan_shards
from moeloop.steps.model.families import FAMILIES, family_named
from moeloop.steps.model.policy import (
    build_tokenizer,
    hf_model_on_meta,
    read_hf_shard,
    save_policy,
    shard_model,
    stored_tensors,
    tensor_dtype,
)
from moeloop.steps.rl.checkpoint import (
    WEIGHTS_DIR,
    ReproducibleWriter,
    checkpointed,
    load_sharded,
    read_in_blocks,
    read_whole,
    save_sharded,
    write_hf_checkpoint,
)
from moeloop.steps.rl.parallel import Parallel
from tests.unit.test_moe import FAMILY_NAMES, NUM_EXPERTS, tiny_config


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    for path in files:
        with safe_open(path, "pt") as file:
            tensors.update({key: file.get_tensor(key) for key in file.keys()})  # noqa: SIM118 (safe_open's API)
    return tensors


def trainer_state_of(tmp_path: Path, family: str) -> tuple[PreTrainedModel, Path]:
    """A tiny policy of the family stored in bf16, its fp32 weights (and a DeepSeek-V3 router's correction bias, made
    random: HF's starts at zeros) as one process's DCP folder (what train commits at world 1)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family=family))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_()
    model.config.dtype = "bfloat16"
    state = tmp_path / "state"
    dcp.save(
        {name: tensor.detach() for name, tensor in checkpointed(model).items()},
        storage_writer=ReproducibleWriter(state / WEIGHTS_DIR),
        no_dist=True,
    )
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(state)
    build_tokenizer(["abc"]).save_pretrained(state)
    return model, state


@pytest.fixture
def trainer_state(tmp_path: Path) -> tuple[PreTrainedModel, Path]:
    return trainer_state_of(tmp_path, "qwen3_moe")


@pytest.mark.parametrize(
    ("family", "max_shard_bytes"),
    [("qwen3_moe", 4 << 30), ("qwen3_moe", 20 << 10), *((family, 20 << 10) for family in FAMILY_NAMES[1:])],
)
def test_publish_writes_what_hf_save_pretrained_writes(tmp_path: Path, family: str, max_shard_bytes: int) -> None:
    """HF's reference: the fp32 model loaded in bf16 (HF keeps DeepSeek-V3's correction bias in fp32), then saved."""
    model, state = trainer_state_of(tmp_path, family)
    write_hf_checkpoint(state, tmp_path / "published", max_shard_bytes)
    model.save_pretrained(tmp_path / "fp32")
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    save_policy(hf_model, build_tokenizer(["abc"]), tmp_path / "hf")  # HF's save_pretrained

    ours, theirs = checkpoint_tensors(tmp_path / "published"), checkpoint_tensors(tmp_path / "hf")
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert ours[key].dtype == (torch.float32 if key.endswith("e_score_correction_bias") else torch.bfloat16)
        assert torch.equal(ours[key], tensor), key
    if family == "deepseek_v3":  # the bias made the round trip in fp32
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert torch.equal(ours[bias], model.state_dict()[bias]) and ours[bias].abs().min() > 0
    for name in ("config.json", "generation_config.json", "tokenizer.json"):
        assert json.loads((tmp_path / "published" / name).read_text()) == json.loads((tmp_path / "hf" / name).read_text())

    files = sorted(path.name for path in (tmp_path / "published").glob("*.safetensors"))
    if max_shard_bytes > 1 << 20:
        assert files == [SINGLE] and not (tmp_path / "published" / INDEX).exists()
    else:
        assert len(files) > 3 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
        assert all((tmp_path / "published" / f).stat().st_size <= max_shard_bytes + 4096 for f in files)
        index = json.loads((tmp_path / "published" / INDEX).read_text())
        assert sorted(set(index["weight_map"].values())) == files and index["weight_map"].keys() == ours.keys()
        assert index["metadata"]["total_size"] == sum(t.numel() * t.itemsize for t in ours.values())

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 2, 1]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, hf_model.float()(input_ids=ids).logits)


def test_blocks_of_saved_chunks_are_the_tensors_rows(
    trainer_state: tuple[PreTrainedModel, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, state = trainer_state
    whole = read_whole(state / WEIGHTS_DIR, torch.float32)
    keys = sorted(whole)
    for block_elements in (1 << 26, 100):  # small tensors batched per load; every tensor alone
        monkeypatch.setattr("moeloop.steps.rl.checkpoint.READ_BLOCK_ELEMENTS", block_elements)
        blocks = list(read_in_blocks(state / WEIGHTS_DIR, keys))
        assert list(dict.fromkeys(key for key, _ in blocks)) == keys
        streamed = torch.cat([block.reshape(-1) for _, block in blocks])
        torch.testing.assert_close(streamed, torch.cat([whole[key].reshape(-1) for key in keys]), rtol=0, atol=0)


F32 = torch.float32


def test_experts_are_stored_per_expert_in_the_fused_tensors_byte_order() -> None:
    qwen3, _, mixtral, *_ = FAMILIES
    blocks = {"model.layers.3.mlp": (qwen3, range(2))}
    gate_up = stored_tensors("model.layers.3.mlp.experts.gate_up_proj", (2, 6, 4), blocks, F32)
    assert gate_up == [
        StoredTensor("model.layers.3.mlp.experts.0.gate_proj.weight", (3, 4), F32),
        StoredTensor("model.layers.3.mlp.experts.0.up_proj.weight", (3, 4), F32),
        StoredTensor("model.layers.3.mlp.experts.1.gate_proj.weight", (3, 4), F32),
        StoredTensor("model.layers.3.mlp.experts.1.up_proj.weight", (3, 4), F32),
    ]
    down = stored_tensors("model.layers.3.mlp.experts.down_proj", (2, 4, 3), blocks, F32)
    assert down[1] == StoredTensor("model.layers.3.mlp.experts.1.down_proj.weight", (4, 3), F32)
    assert stored_tensors("model.norm.weight", (4,), blocks, F32) == [StoredTensor("model.norm.weight", (4,), F32)]
    # Mixtral's checkpoints name the block block_sparse_moe and its experts' gate, up and down w1, w3 and w2.
    blocks = {"model.layers.3.mlp": (mixtral, range(2))}
    assert [t.name for t in stored_tensors("model.layers.3.mlp.experts.gate_up_proj", (2, 6, 4), blocks, F32)][:2] == [
        "model.layers.3.block_sparse_moe.experts.0.w1.weight",
        "model.layers.3.block_sparse_moe.experts.0.w3.weight",
    ]
    gate = stored_tensors("model.layers.3.mlp.gate.weight", (2, 4), blocks, F32)
    assert gate == [StoredTensor("model.layers.3.block_sparse_moe.gate.weight", (2, 4), F32)]


def test_shards_keep_the_order_and_a_tensor_over_the_limit_is_alone() -> None:
    sizes = {"a": (4,), "b": (4,), "big": (40,), "c": (2,)}
    tensors = {name: [StoredTensor(name, shape, F32)] for name, shape in sizes.items()}
    assert plan_shards(tensors, max_shard_bytes=32) == [["a", "b"], ["big"], ["c"]]
    down = stored_tensors("m.experts.down_proj", (4, 2, 2), {"m": (FAMILIES[0], range(4))}, F32)
    experts = {"e": down, "n": [StoredTensor("n", (2,), F32)]}
    assert plan_shards(experts, max_shard_bytes=40) == [["e"], ["n"]]  # a model tensor is not split


def test_the_trainer_state_keeps_a_routers_correction_bias(tmp_path: Path) -> None:
    """DeepSeek-V3's correction bias is a buffer, no parameter: the trainer state saves it beside the parameters (no
    optimizer state) and loads it back."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family="deepseek_v3"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    model.get_buffer(bias).normal_()
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    save_sharded(model, optimizer, Parallel(), tmp_path)
    assert torch.equal(read_whole(tmp_path / WEIGHTS_DIR, F32)[bias], model.get_buffer(bias))
    assert not any(key.startswith(bias) for key in read_whole(tmp_path / "optimizer", F32))

    fresh = AutoModelForCausalLM.from_config(tiny_config(family="deepseek_v3"))
    assert fresh.get_buffer(bias).abs().max() == 0
    load_sharded(fresh, torch.optim.AdamW(fresh.parameters()), Parallel(), tmp_path, "state")
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_a_shard_holds_tensors_of_several_dtypes(tmp_path: Path) -> None:
    """Each tensor in its own dtype (a bf16 checkpoint's fp32 correction bias), a block in another refused."""
    tensors = [StoredTensor("w", (2, 3), torch.bfloat16), StoredTensor("bias", (3,), F32), StoredTensor("n", (3,), F32)]
    w, bias_and_n = torch.randn(2, 3).to(torch.bfloat16), torch.randn(6)
    with SafetensorsWriter(tmp_path / SINGLE, tensors) as writer:
        writer.write(w[:1])
        with pytest.raises(ValueError, match=r"^a block of torch.float32 for w, stored in torch.bfloat16$"):
            writer.write(w[1:].float())
        writer.write(w[1:])
        writer.write(bias_and_n)  # a block may span tensors of its dtype
    saved = checkpoint_tensors(tmp_path)
    assert saved["w"].dtype == torch.bfloat16 and torch.equal(saved["w"], w)
    assert saved["bias"].dtype == F32 and torch.equal(torch.cat([saved["bias"], saved["n"]]), bias_and_n)
    model = hf_model_on_meta(tiny_config(family="deepseek_v3"))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert tensor_dtype(bias, model, torch.bfloat16) == F32 and tensor_dtype(bias, model, F32) == F32
    assert tensor_dtype("model.layers.1.mlp.gate.weight", model, torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_an_ep_rank_reads_only_its_experts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """EP rank 1 of 2 reads, from HF's own save_pretrained of the family, experts [E / 2, E) and every other
    tensor, fused as its `MoeBlock`s hold them: per expert, or (GPT-OSS, whose checkpoints hold the experts fused)
    the rows [E / 2, E) of each fused tensor."""
    torch.manual_seed(0)
    hf_model = AutoModelForCausalLM.from_config(tiny_config(family=family))
    save_policy(hf_model, build_tokenizer(["abc"]), tmp_path / "hf")
    read: list[str] = []
    sliced: list[tuple[str, int, int]] = []

    class RecordingSlice:  # safetensors' slice of one tensor, recording the rows read
        def __init__(self, name: str, rows: Any) -> None:
            self.name, self.rows = name, rows

        def __getitem__(self, rows: slice) -> torch.Tensor:
            sliced.append((self.name, rows.start, rows.stop))
            return self.rows[rows]

    class RecordingFile:  # safetensors' safe_open, recording the tensors read
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.file = safe_open(*args, **kwargs)

        def __enter__(self) -> RecordingFile:
            self.opened = self.file.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.file.__exit__(*exc)

        def keys(self) -> list[str]:
            return self.opened.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.opened.get_tensor(name)

        def get_slice(self, name: str) -> RecordingSlice:
            return RecordingSlice(name, self.opened.get_slice(name))

    monkeypatch.setattr("moeloop.steps.model.policy.safe_open", RecordingFile)
    rank1_of_2 = SimpleNamespace(size=lambda: 2, rank=lambda: 1)  # only its size and rank are read
    cpu = torch.device("cpu")
    model = shard_model(AutoModelForCausalLM, hf_model.config, "all_to_all", "grouped_mm", rank1_of_2, cpu)
    state = read_hf_shard(tmp_path / "hf", model, cpu)

    if family_named(family).checkpoint_experts is None:
        experts = [name for name in hf_model.state_dict() if ".experts." in name]
        assert sorted(sliced) == sorted((name, NUM_EXPERTS // 2, NUM_EXPERTS) for name in experts) and len(experts) == 8
        assert not any(".experts." in name for name in read)
    else:
        experts_read = {int(name.split(".experts.")[1].split(".")[0]) for name in read if ".experts." in name}
        assert experts_read == set(range(NUM_EXPERTS // 2, NUM_EXPERTS)) and not sliced
    assert len(read) == len(set(read))
    model.load_state_dict(state, strict=True)
    local = slice(NUM_EXPERTS // 2, NUM_EXPERTS)
    for name, tensor in hf_model.state_dict().items():
        expected = tensor[local] if ".experts." in name else tensor
        assert torch.equal(state[name], expected), name
