"""The policy: an MoE causal LM of a family in `moeloop.steps.model.families`, in HF format, the tiny model's
tokenizer, and token log-probabilities.

The trainer holds it with expert parallelism (`moeloop.steps.model.moe`): each EP rank reads only its experts from the HF
safetensors (`load_policy_shard`), and publish writes the HF checkpoint from the trainer state's shards (`moeloop.steps.rl.checkpoint`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForTokenClassification,
    PretrainedConfig,
    PreTrainedTokenizerFast,
)

from moeloop.steps.config_model import (
    TinyDeepseekV3, TinyGptOss, TinyMixtral, TinyModelConfig, TinyQwen2Moe, TinyShape, TinyTokenizerConfig,
)
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.bpe import bpe_tokenizer
from moeloop.steps.model.dispatch import make_dispatcher
from moeloop.steps.model.families import MoeFamily, family_of_block, family_of_config, num_experts
from moeloop.steps.model.hf_shards import INDEX, SINGLE, StoredTensor, read_header
from moeloop.steps.model.moe import ExpertsImpl, MoeBlock, replace_moe_blocks
from moeloop.steps.prompting import sft_answer, sft_episode

PAD, EOS = "<pad>", "<eos>"


def build_tokenizer(texts: Iterable[str]) -> PreTrainedTokenizerFast:
    """One token per character seen in texts; built locally, nothing is downloaded."""
    characters = sorted(set("".join(texts)))
    vocab = {token: index for index, token in enumerate([PAD, EOS, *characters])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=PAD, eos_token=EOS)


def tiny_tokenizer(records: Iterable[dict[str, Any]], settings: TinyTokenizerConfig) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer (model.tokenizer), over the records' prompts (a messages prompt's contents) and
    the answers its SFT trains on: one token per character, or BPE trained on them with a ChatML template."""
    texts = []
    for record in records:
        prompt = record["prompt"]
        texts += [prompt] if isinstance(prompt, str) else [text for m in prompt for text in (m["role"], m["content"])]
        texts.append(sft_answer(record) or "")
        for message in sft_episode(record) or []:  # a reference episode's turns, as the template writes them
            texts += [message["role"], message.get("content") or ""]
            calls = message.get("tool_calls") or []
            texts += [f"<tool_call>{json.dumps(call['function'])}</tool_call>" for call in calls]
            if message["role"] == "tool":
                texts.append(f"<tool_response>{message.get('content')}</tool_response>")
    return bpe_tokenizer(texts, settings.vocab_size) if settings.kind == "bpe" else build_tokenizer(texts)


def tiny_model_config(shape: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, **extra: Any) -> PretrainedConfig:
    """The HF config of the tiny shape's family over the tokenizer's vocabulary (the policy's, or with extra
    settings such as num_labels, a reward model's that reads the same text)."""
    return AutoConfig.for_model(
        shape.family,
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_experts_per_tok=shape.num_experts_per_tok,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        **tiny_family_fields(shape),
        **extra,
    )


def tiny_family_fields(shape: TinyModelConfig) -> dict[str, Any]:
    """The tiny shape's family-specific fields in the names its family's HF config gives them."""
    if isinstance(shape, TinyDeepseekV3):
        own = [name for name in TinyDeepseekV3.model_fields if name not in TinyShape.model_fields and name != "family"]
        return {
            **{name: getattr(shape, name) for name in own},
            "num_key_value_heads": shape.num_attention_heads,  # multi-head latent attention: as many kv heads as heads
            "n_routed_experts": shape.num_experts,
            "intermediate_size": shape.intermediate_size,
            "moe_intermediate_size": shape.moe_intermediate_size,
            # HF routes DeepSeek-V3 one way and its config does not say which; vLLM reads these (else it routes by
            # softmax, without the correction bias), as DeepSeek-V3's published config.json has them.
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
        }
    softmax = {
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "router_aux_loss_coef": shape.router_aux_loss_coef,
    }
    if isinstance(shape, TinyMixtral):  # its experts' width is its intermediate_size; it always renormalises
        return {**softmax, "intermediate_size": shape.moe_intermediate_size, "num_local_experts": shape.num_experts}
    if isinstance(shape, TinyGptOss):  # as Mixtral's names; its layers alternate the window and full attention
        return {
            **softmax, "intermediate_size": shape.moe_intermediate_size, "num_local_experts": shape.num_experts,
            "sliding_window": shape.sliding_window,
        }  # fmt: skip
    routed = {
        **softmax,
        "intermediate_size": shape.intermediate_size,
        "moe_intermediate_size": shape.moe_intermediate_size,
        "num_experts": shape.num_experts,
        "norm_topk_prob": True,
    }
    if isinstance(shape, TinyQwen2Moe):
        return {**routed, "shared_expert_intermediate_size": shape.shared_expert_intermediate_size}
    return routed


def build_tiny_model(shape: TinyModelConfig, tokenizer: PreTrainedTokenizerFast, seed: int) -> torch.nn.Module:
    config = tiny_model_config(shape, tokenizer)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def load_policy(
    directory: Path, dtype: torch.dtype | str = "auto", device: torch.device | None = None
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """Load an HF checkpoint folder, by default in the dtype its weights are stored in (a bf16 start stays bf16)."""
    try:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise MoeloopError(f"not a loadable HF checkpoint: {directory} ({str(error).splitlines()[0]})") from None
    return model.to(device) if device is not None else model, tokenizer


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}  # safetensors' names


def check_stored_tensors(directory: Path) -> None:
    """The HF checkpoint's safetensors hold every tensor of the model its config.json makes, each of that shape and
    of a floating-point dtype; else a one-line error naming the tensors that are not (from_pretrained would cast an
    integer tensor silently, and report a shape that does not match in a log no step shows)."""
    index = directory / INDEX
    try:
        files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else {SINGLE}
        found = {name: (*entry, file) for file in sorted(files) for name, entry in read_header(directory / file).items()}
        config = AutoConfig.from_pretrained(directory)
    except FileNotFoundError:
        return  # no safetensors: the loader says what it misses
    except (OSError, ValueError, KeyError) as error:
        raise MoeloopError(f"not a loadable HF checkpoint: {directory} ({str(error).splitlines()[0]})") from None
    model = hf_model_on_meta(config)
    blocks = sparse_blocks(model)
    shapes, dtypes, missing = [], [], []  # in this order in the error: the most telling first
    for key, value in model.state_dict().items():
        for tensor in stored_tensors(key, tuple(value.shape), blocks, torch.float32):
            dtype, shape, file = found.get(tensor.name, (None, None, None))
            if file is None:
                missing.append(f"{tensor.name} is in no safetensors file")
            elif shape != tensor.shape:
                shapes.append(f"{tensor.name} is {list(shape)} in {file}, {list(tensor.shape)} by config.json")
            elif dtype not in FLOAT_DTYPES:
                dtypes.append(f"{tensor.name} is {dtype} in {file}, not a floating-point dtype")
    if problems := shapes + dtypes + missing:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise MoeloopError(f"its weights are not the model its config.json makes: {'; '.join(problems[:3])}{more}")


def save_policy(model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)


def load_policy_shard(
    directory: Path,
    dispatcher: str,
    experts_impl: ExpertsImpl,
    ep_group: dist.ProcessGroup | None,
    device: torch.device,
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """This EP rank's policy in fp32: the dense weights and routers whole, only its experts, read from the HF
    safetensors of directory. The model is built on the meta device, so no rank ever holds all experts."""
    config, tokenizer = read_config(directory)
    model = shard_model(AutoModelForCausalLM, config, dispatcher, experts_impl, ep_group, device)
    model.load_state_dict(read_hf_shard(directory, model, device), strict=True)
    return model, tokenizer


def load_critic_shard(
    directory: Path,
    dispatcher: str,
    experts_impl: ExpertsImpl,
    ep_group: dist.ProcessGroup | None,
    device: torch.device,
    from_policy: bool,
) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """This EP rank's share of the PPO critic: the policy's family with a scalar value head per token, HF's
    `...ForTokenClassification` with num_labels=1 (so `AutoModelForTokenClassification` loads its checkpoint).

    from_policy: directory is a policy checkpoint; the critic takes its body (everything but the LM head) and a
    zero value head, so every value starts at 0. Else directory is a critic checkpoint.
    """
    config, tokenizer = read_config(directory)
    if from_policy:
        config.num_labels = 1
        config.classifier_dropout = 0.0  # values are deterministic, in training too
    model = shard_model(AutoModelForTokenClassification, config, dispatcher, experts_impl, ep_group, device)
    model.config.architectures = [type(model).__name__]
    head = {"score.weight", "score.bias"} if from_policy else set()
    state = read_hf_shard(directory, model, device, skip=head)
    state.update({key: torch.zeros_like(model.state_dict()[key], device=device) for key in head})
    model.load_state_dict(state, strict=True)
    return model, tokenizer


def read_config(directory: Path) -> tuple[Any, PreTrainedTokenizerFast]:
    try:
        return AutoConfig.from_pretrained(directory), PreTrainedTokenizerFast.from_pretrained(directory)
    except (OSError, ValueError) as error:
        raise MoeloopError(f"not a loadable HF checkpoint: {directory} ({str(error).splitlines()[0]})") from None


def shard_model(
    auto_class: Any,
    config: Any,
    dispatcher: str,
    experts_impl: ExpertsImpl,
    ep_group: dist.ProcessGroup | None,
    device: torch.device,
) -> torch.nn.Module:
    """An uninitialised fp32 model of auto_class on device, its MoE blocks holding this EP rank's experts. Its
    config keeps the dtype the checkpoint is stored in, which the trainer state is saved in again."""
    family_of_config(config)  # a one-line error for a model of no known family
    stored_dtype = config.dtype
    with torch.device("meta"):
        model = auto_class.from_config(config, dtype=torch.float32)
    model.config.dtype = stored_dtype
    replace_moe_blocks(model, make_dispatcher(dispatcher, num_experts(config), ep_group), experts_impl)
    model.to_empty(device=device)
    # The rotary frequencies are a non-persistent buffer, in no checkpoint: to_empty left them uninitialised.
    model.model.rotary_emb = type(model.model.rotary_emb)(config).to(device)
    return model


def read_hf_shard(
    directory: Path, model: torch.nn.Module, device: torch.device, skip: set[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """model's state dict, less the keys in skip, from the HF checkpoint: every MoE block's local experts fused as
    `GroupedExperts` holds them (gate_up_proj [e, 2I, H] from the per-expert gate and up projections [I, H],
    down_proj [e, H, I]; or the rows of the local experts of a checkpoint's fused tensors, GPT-OSS's), every tensor
    under the name its family's checkpoints give it.

    Reads only those tensors, and of a fused experts tensor only those rows (safe_open reads tensor by tensor, and
    slices), from one file or an index of shards.
    """
    index = directory / "model.safetensors.index.json"
    if index.exists():
        file_of = {key: directory / name for key, name in json.loads(index.read_text())["weight_map"].items()}
    else:
        with safe_open(directory / "model.safetensors", "pt") as single:
            file_of = dict.fromkeys(single.keys(), directory / "model.safetensors")
    layout = sparse_blocks(model)
    keys = [key for key in model.state_dict() if key not in skip]
    expert_keys = {key: names for key in keys if (names := per_expert_names(key, layout)) is not None}
    name_of = {key: stored_name(key, layout) for key in keys if key not in expert_keys}
    rows_of = {name_of[key]: rows for key in name_of if (rows := fused_expert_rows(key, layout)) is not None}
    wanted = [*name_of.values(), *(name for parts in expert_keys.values() for names in parts for name in names)]
    missing = [name for name in wanted if name not in file_of]
    if missing:
        raise MoeloopError(f"HF checkpoint {directory} lacks {len(missing)} tensors, e.g. {missing[0]}")
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in wanted:
        by_file[file_of[name]].append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(path, "pt", device=str(device)) as file:
            for name in names:
                rows = rows_of.get(name)
                tensor = file.get_tensor(name) if rows is None else file.get_slice(name)[rows.start : rows.stop]
                tensors[name] = tensor.float()
    state = {key: tensors.pop(name) for key, name in name_of.items()}
    for fused, parts in expert_keys.items():
        state[fused] = torch.stack([torch.cat([tensors[name] for name in names]) for names in parts])
    return state


SparseBlocks = dict[str, tuple[MoeFamily, range]]


def sparse_blocks(model: torch.nn.Module) -> SparseBlocks:
    """Every sparse MoE block of model by module name: its family, and the experts model holds of it (a `MoeBlock`
    its EP rank's, HF's own block all)."""
    blocks: SparseBlocks = {}
    for name, module in model.named_modules():
        if isinstance(module, MoeBlock):
            first = module.dispatcher.ep_rank * module.dispatcher.num_local_experts
            blocks[name] = (module.family, range(first, first + module.dispatcher.num_local_experts))
        elif (family := family_of_block(module)) is not None:
            blocks[name] = (family, range(module.experts.num_experts))
    return blocks


def block_of(key: str, blocks: SparseBlocks) -> tuple[str, str] | None:
    """(the sparse block's module name, the rest of key) for a tensor of a sparse block; None for any other."""
    parts = key.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        if (block := ".".join(parts[:cut])) in blocks:
            return block, ".".join(parts[cut:])
    return None


def per_expert_names(key: str, blocks: SparseBlocks) -> list[list[str]] | None:
    """The HF checkpoint's per-expert tensors that the fused experts tensor key holds, for the experts the model
    holds, expert by expert (`MoeFamily.per_expert_names`); None where key is no fused experts tensor."""
    found = block_of(key, blocks)
    return None if found is None else blocks[found[0]][0].per_expert_names(*found, blocks[found[0]][1])


def fused_expert_rows(key: str, blocks: SparseBlocks) -> range | None:
    """The experts (rows) the model holds of a fused experts tensor that the checkpoint stores fused as well
    (`MoeFamily.fused_on_disk`); None for any other tensor."""
    found = block_of(key, blocks)
    return blocks[found[0]][1] if found is not None and blocks[found[0]][0].fused_on_disk(found[1]) else None


def stored_name(key: str, blocks: SparseBlocks) -> str:
    """The HF checkpoint's name of a tensor that is no fused experts tensor (a sparse block's may be renamed)."""
    found = block_of(key, blocks)
    return key if found is None else blocks[found[0]][0].stored_name(*found)


def stored_tensors(key: str, shape: tuple[int, ...], blocks: SparseBlocks, dtype: torch.dtype) -> list[StoredTensor]:
    """The HF checkpoint's tensors, in dtype, that the model's tensor key (of shape) is stored as, in the order of
    its bytes: the experts [E, 2I, H] as E times the gate and up projections [I, H] (each expert's rows are its
    gate's, then its up's); anything else as it is, under its family's checkpoint name."""
    names = per_expert_names(key, blocks)
    if names is None:
        return [StoredTensor(stored_name(key, blocks), shape, dtype)]
    return [StoredTensor(name, (shape[1] // len(parts), *shape[2:]), dtype) for parts in names for name in parts]


def tensor_dtype(key: str, model: torch.nn.Module, dtype: torch.dtype) -> torch.dtype:
    """The dtype HF loads (and so saves) model's tensor key in from a checkpoint of dtype: fp32 for what its class
    keeps in fp32 in half precision (`_keep_in_fp32_modules_strict`, by module or tensor name: DeepSeek-V3's router
    correction bias), dtype for the rest."""
    kept = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) and kept & set(key.split(".")) else dtype


def stored_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are stored in (fp32 where it says none)."""
    dtype = config.dtype
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype or torch.float32


def hf_model_on_meta(config: Any) -> torch.nn.Module:
    """The HF model of a checkpoint's config, on the meta device: the policy's, or the critic's (its config names
    a `...ForTokenClassification`). Its parameter names and shapes are what the checkpoint holds in memory."""
    critic = any(name.endswith("ForTokenClassification") for name in config.architectures or [])
    with torch.device("meta"):
        return (AutoModelForTokenClassification if critic else AutoModelForCausalLM).from_config(config, dtype=torch.float32)


def pack_sequences(
    prompts: list[list[int]], responses: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+response batch.

    Returns input_ids_BT, attention_mask_BT, and response_mask_BT marking the response tokens.
    """
    length = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=False))
    input_ids_BT = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    attention_mask_BT = torch.zeros((len(prompts), length), dtype=torch.long)
    response_mask_BT = torch.zeros((len(prompts), length), dtype=torch.bool)
    for row, (prompt, response) in enumerate(zip(prompts, responses, strict=False)):
        end = len(prompt) + len(response)
        input_ids_BT[row, :end] = torch.tensor(prompt + response)
        attention_mask_BT[row, :end] = 1
        response_mask_BT[row, len(prompt) : end] = True
    return input_ids_BT, attention_mask_BT, response_mask_BT


def token_logprobs(
    model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Log-probability of each token given its prefix (position 0 gets 0), and each MoE layer's router logits.

    Logits are divided by the sampling temperature so that they match the engine's behaviour logprobs.
    """
    # No KV cache in training: it would hold every layer's keys and values, and its per-layer state is a guard that
    # recompiles compiled decoder layers once per layer (past dynamo's limit of 8, the rest would run eager).
    output = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT, output_router_logits=True, use_cache=False)
    logits_BTV = output.logits[:, :-1].float() / temperature
    targets_BT = input_ids_BT[:, 1:]
    logprobs_BT = -F.cross_entropy(logits_BTV.transpose(1, 2), targets_BT, reduction="none")
    return F.pad(logprobs_BT, (1, 0)), output.router_logits  # router logits: [B * T, E] per MoE layer


def token_values(
    critic: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The critic's value of the state each token was chosen in, aligned as `token_logprobs` aligns logprobs:
    position t holds the value head's output at t-1 (the prefix before token t); position 0 gets 0. Also each MoE
    layer's router logits."""
    output = critic.model(
        input_ids=input_ids_BT, attention_mask=attention_mask_BT, output_router_logits=True, use_cache=False
    )
    values_BT = critic.score(output.last_hidden_state).squeeze(-1).float()
    return F.pad(values_BT[:, :-1], (1, 0)), output.router_logits
