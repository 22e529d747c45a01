"""Publish's HF checkpoint from a trainer state's DCP weights: sharded safetensors streamed block by block, the same
tensors, config and generation config as HF's own `save_pretrained`, and what `from_pretrained` loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Qwen3MoeForCausalLM

from steps.model.hf_shards import INDEX, SINGLE, StoredTensor, plan_shards
from steps.model.policy import build_tokenizer, save_policy, stored_tensors
from steps.rl.checkpoint import WEIGHTS_DIR, ReproducibleWriter, read_in_blocks, read_whole, write_hf_checkpoint
from tests.test_moe import tiny_config


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    for path in files:
        with safe_open(path, "pt") as file:
            tensors.update({key: file.get_tensor(key) for key in file.keys()})  # noqa: SIM118 (safe_open's API)
    return tensors


@pytest.fixture
def trainer_state(tmp_path: Path) -> tuple[Qwen3MoeForCausalLM, Path]:
    """A tiny policy stored in bf16, its fp32 weights as one process's DCP folder (what train commits at world 1)."""
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(tiny_config())
    model.config.dtype = "bfloat16"
    state = tmp_path / "state"
    dcp.save(
        {name: p.detach() for name, p in model.named_parameters()},
        storage_writer=ReproducibleWriter(state / WEIGHTS_DIR),
        no_dist=True,
    )
    model.config.architectures = [Qwen3MoeForCausalLM.__name__]
    model.config.save_pretrained(state)
    build_tokenizer(["abc"]).save_pretrained(state)
    return model, state


@pytest.mark.parametrize("max_shard_bytes", [4 << 30, 20 << 10])
def test_publish_writes_what_hf_save_pretrained_writes(
    trainer_state: tuple[Qwen3MoeForCausalLM, Path], tmp_path: Path, max_shard_bytes: int
) -> None:
    model, state = trainer_state
    write_hf_checkpoint(state, tmp_path / "published", max_shard_bytes)
    hf_model = model.to(torch.bfloat16)
    save_policy(hf_model, build_tokenizer(["abc"]), tmp_path / "hf")  # HF's save_pretrained

    ours, theirs = checkpoint_tensors(tmp_path / "published"), checkpoint_tensors(tmp_path / "hf")
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert ours[key].dtype == torch.bfloat16
        assert torch.equal(ours[key], tensor), key
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
        assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in ours.values())

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "published", dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 2, 1]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, hf_model.float()(input_ids=ids).logits)


def test_blocks_of_saved_chunks_are_the_tensors_rows(
    trainer_state: tuple[Qwen3MoeForCausalLM, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, state = trainer_state
    whole = read_whole(state / WEIGHTS_DIR, torch.float32)
    keys = sorted(whole)
    for block_elements in (1 << 26, 100):  # small tensors batched per load; every tensor alone
        monkeypatch.setattr("steps.rl.checkpoint.READ_BLOCK_ELEMENTS", block_elements)
        streamed = torch.cat([block.reshape(-1) for block in read_in_blocks(state / WEIGHTS_DIR, keys)])
        torch.testing.assert_close(streamed, torch.cat([whole[key].reshape(-1) for key in keys]), rtol=0, atol=0)


def test_experts_are_stored_per_expert_in_the_fused_tensors_byte_order() -> None:
    gate_up = stored_tensors("model.layers.3.mlp.experts.gate_up_proj", (2, 6, 4))
    assert gate_up == [
        StoredTensor("model.layers.3.mlp.experts.0.gate_proj.weight", (3, 4)),
        StoredTensor("model.layers.3.mlp.experts.0.up_proj.weight", (3, 4)),
        StoredTensor("model.layers.3.mlp.experts.1.gate_proj.weight", (3, 4)),
        StoredTensor("model.layers.3.mlp.experts.1.up_proj.weight", (3, 4)),
    ]
    assert stored_tensors("model.layers.3.mlp.experts.down_proj", (2, 4, 3))[1].name.endswith("1.down_proj.weight")
    assert stored_tensors("model.norm.weight", (4,)) == [StoredTensor("model.norm.weight", (4,))]


def test_shards_keep_the_order_and_a_tensor_over_the_limit_is_alone() -> None:
    sizes = {"a": (4,), "b": (4,), "big": (40,), "c": (2,)}
    tensors = {name: [StoredTensor(name, shape)] for name, shape in sizes.items()}
    assert plan_shards(tensors, torch.float32, max_shard_bytes=32) == [["a", "b"], ["big"], ["c"]]
    experts = {"e": stored_tensors("m.experts.down_proj", (4, 2, 2)), "n": [StoredTensor("n", (2,))]}
    assert plan_shards(experts, torch.float32, max_shard_bytes=40) == [["e"], ["n"]]  # a model tensor is not split
