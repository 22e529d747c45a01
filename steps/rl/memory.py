"""The train step's peak GPU memory per rank, predicted from the model's shape and the trainer's settings.

The model is the one issue 19 describes: FSDP2 over the (dp, ep) mesh with mixed precision (bf16 compute,
fp32 master weights, gradients reduced in fp32, fp32 AdamW moments), activation checkpointing per decoder
layer, packed microbatches of at most `max_tokens_per_microbatch` tokens. Every term below is named, sized
from first principles, and returned on its own, so it can be compared term by term with
`torch.cuda.max_memory_allocated()`. Against the product's train step on an H200 at five shapes of the
Qwen3-30B-A3B layer (benchmarks/policy_update.md, `benchmarks/trainer_memory.py`) it is within 9% of the GPU's peak
(the allocator's peak reservation plus the CUDA context), high or low; `workspace_bytes` is a stated allowance
for that context and the allocator's fragmentation. `refuse_unfit_trainer` turns it into the train and start
steps' check.

Sharding: FSDP2 shards the dense weights and the routers over all `world_size` ranks, and each EP slice of the
experts over the dp = world_size / ep ranks that hold it, so every persistent term is (all parameters) /
world_size per rank. What is gathered whole is one decoder layer at a time (plus the one prefetched): its
dense part whole, its experts' 1/ep slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moeloop.steps.model.shape import ModelShape, parameter_counts, shape_from_hf_config
from moeloop.steps.config import TrainerConfig
from moeloop.steps.errors import MoeloopError

GIB = 1 << 30
LOGIT_ROWS = 4096  # moeloop.steps.model.logprobs.CHUNK_ROWS
FP32, BF16 = 4, 2
Precision = Literal["bf16", "fp32"]
Reference = Literal["sharded", "precomputed", "none"]


@dataclass(frozen=True)
class TrainMemory:
    moment: str  # when the peak comes: "backward start" (logits and activations alive) or "backward end"
    terms: dict[str, int]  # name -> bytes on one GPU at that moment

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def attention_activations(s: ModelShape, element: int) -> int:
    """Bytes one token saves for the backward in one attention block (flash/varlen attention: no scores)."""
    h, n = s.hidden_size, s.num_heads
    input_norm = element * h + FP32  # the RMSNorm's input and its fp32 reciprocal RMS
    projections_in = element * h  # the normed input, shared by the q, k, v (MLA: q_a, kv_a) projections
    if s.kv_lora_rank is not None:  # MLA: q_a's and kv_a's outputs (their norms' inputs) and the normed ones
        norms = 2 * element * ((s.q_lora_rank or 0) + s.kv_lora_rank + s.qk_rope_head_dim) + 2 * FP32
        qkv = element * n * (2 * s.qk_head_dim + s.v_head_dim)  # kv_b_proj gives every head its own k and v
    else:  # Qwen3's per-head q and k norms: their inputs and fp32 reciprocal RMS
        norms = (element * s.qk_head_dim + FP32) * (n + s.num_kv_heads) if s.qk_norm else 0
        qkv = element * (n * s.qk_head_dim + s.num_kv_heads * (s.qk_head_dim + s.v_head_dim))
    attention_out = element * n * s.v_head_dim + n * FP32  # the kernel's output (o_proj's input) and logsumexp
    return input_norm + projections_in + norms + qkv + attention_out


def mlp_activations(element: int, intermediate: int) -> int:
    """One SwiGLU MLP's saved tensors for one token: gate and up outputs (the activation's inputs) and the
    activation's output (down's input). Its input is counted by whoever normed it."""
    return element * 3 * intermediate


def layer_activations(s: ModelShape, element: int, moe: bool, routing_imbalance: float) -> float:
    """Bytes one token saves in one decoder layer, everything kept (no checkpointing)."""
    h = s.hidden_size
    block_in = element * h + FP32 + element * h  # post-attention RMSNorm's input and rstd, its normed output
    if not moe:
        return attention_activations(s, element) + block_in + mlp_activations(element, s.dense_intermediate)
    k = s.experts_per_token
    router = 2 * FP32 * s.num_experts + k * (FP32 + 8)  # logits and scores in fp32, top-k weights and indices
    # The experts see k copies of every token: the permuted input (the grouped GEMM's saved input), the MLP,
    # and down's output, kept for the routing weight's gradient. A rank gets its experts' share of them,
    # `routing_imbalance` times the mean where routing is skewed.
    routed = routing_imbalance * k * (element * 2 * h + mlp_activations(element, s.expert_intermediate))
    shared = s.shared_experts * mlp_activations(element, s.shared_intermediate)
    shared += element * h if s.shared_expert_gate else 0  # Qwen2-MoE: the shared output, kept for its gate
    return attention_activations(s, element) + block_in + router + routed + shared


def predict_train_peak_bytes(
    shape: ModelShape,
    world_size: int,
    expert_parallel: int,
    max_tokens_per_microbatch: int,
    precision: Precision = "bf16",
    activation_checkpointing: bool = True,
    offload_optimizer: bool = False,
    reference: Reference = "sharded",
    gradient_accumulation: bool = True,
    routing_imbalance: float = 1.0,
    workspace_bytes: int = 4 * GIB,
) -> TrainMemory:
    """Peak bytes on one GPU of the train step, term by term.

    max_tokens_per_microbatch: tokens one rank runs through the model at once (packed samples).
    offload_optimizer: `trainer.offload_optimizer` (steps/rl/offload.py): AdamW's moments live on the host; the fp32
      master weights and gradients stay on the GPU.
    reference: the KL reference policy `sharded` like the policy (bf16, frozen), its logprobs `precomputed`
      once per update before training (nothing of it left at the peak), or `none` (kl_coef 0).
    gradient_accumulation: a minibatch is more than one microbatch, so the gradients of the earlier ones are
      alive while the last one's logits and activations are; with one microbatch per optimizer step the
      gradients fill in as the backward frees the activations, and the peak is the larger of the two moments.
    routing_imbalance: the busiest rank's expert tokens over the mean (1: perfectly balanced routing).
    workspace_bytes: CUDA context, NCCL buffers, cuBLAS/Triton workspaces, allocator fragmentation.
    """
    if world_size % expert_parallel:
        raise ValueError(f"world_size {world_size} is not a multiple of expert_parallel {expert_parallel}")
    counts = parameter_counts(shape)
    compute = BF16 if precision == "bf16" else FP32
    shard = counts.total / world_size  # parameters this rank holds of every sharded state
    terms = {
        # fp32 either way: the master copy under bf16 mixed precision, the parameters themselves under fp32.
        "master_weights": FP32 * shard,
        "gradients": FP32 * shard,  # sharded, in fp32 (reduce_dtype)
        "adam_moments": 0 if offload_optimizer else 2 * FP32 * shard,
        "reference_policy": compute * shard if reference == "sharded" else 0,
    }
    # One layer gathered for compute and the next one prefetched: the dense part whole, the experts' EP slice.
    layer = counts.layer_dense + counts.layer_experts / expert_parallel
    terms["gathered_layers"] = 2 * compute * layer
    # One layer's unsharded gradients in the compute dtype, and their fp32 copy for the reduce-scatter.
    terms["unsharded_gradients"] = (compute + (FP32 if precision == "bf16" else 0)) * layer
    tokens = max_tokens_per_microbatch
    dense = layer_activations(shape, compute, False, routing_imbalance) if shape.dense_layers else 0
    moe = layer_activations(shape, compute, True, routing_imbalance) if shape.moe_layers else 0
    if activation_checkpointing:
        # Every layer keeps only its input; the layer being back-propagated is recomputed whole.
        terms["activations"] = tokens * (shape.num_layers * compute * shape.hidden_size + max(dense, moe))
    else:
        terms["activations"] = tokens * (shape.dense_layers * dense + shape.moe_layers * moe)
    # The LM head computes the targets' log-probabilities LOGIT_ROWS rows at a time (moeloop.steps.model.logprobs): one
    # chunk's logits in the compute dtype, their fp32 copy and fp32 gradient, and the head's fp32 weight gradient.
    rows = min(tokens, LOGIT_ROWS)
    terms["logits"] = rows * shape.vocab_size * (compute + FP32 + FP32) + FP32 * shape.vocab_size * shape.hidden_size
    terms["workspace"] = workspace_bytes
    start = {**terms, "gradients": terms["gradients"] if gradient_accumulation else 0}
    end = {**terms, "activations": 0, "logits": 0}
    moment, peak = max(("backward start", start), ("backward end", end), key=lambda item: sum(item[1].values()))
    return TrainMemory(moment, {name: int(value) for name, value in peak.items()})


def refuse_unfit_trainer(settings: TrainerConfig, hf_config: dict, source: str) -> None:
    """A one-line error where the train step's predicted peak per GPU exceeds `trainer.gpu_memory_bytes`; nothing
    to check where that is not set. The start and train steps call it before any weight is loaded. The reference
    policy's logprobs are computed once, before the policy loads (steps/train.py): it adds nothing to the peak. A
    trainer that lives for a chunk (steps/rl/held.py) runs that pass beside its policy and moments, its gradients
    freed after each update: the reference's fp32 shard takes their room, and the peak is the backward's still."""
    if settings.gpu_memory_bytes is None:
        return
    memory = predict_train_peak_bytes(
        shape_from_hf_config(hf_config, source), settings.world_size, settings.expert_parallel,
        settings.max_tokens_per_microbatch, settings.compute_precision(cuda=True), settings.activation_checkpointing,
        settings.offload_optimizer, "precomputed",
    )  # fmt: skip
    if memory.total > settings.gpu_memory_bytes:
        largest = sorted(memory.terms.items(), key=lambda item: -item[1])[:3]
        parts = ", ".join(f"{name} {value / GIB:.1f}" for name, value in largest)
        raise MoeloopError(
            f"the train step needs about {memory.total / GIB:.1f} GiB per GPU ({parts}), more than"
            f" trainer.gpu_memory_bytes ({settings.gpu_memory_bytes / GIB:.1f} GiB): raise trainer.world_size or"
            " expert_parallel, turn on activation_checkpointing or offload_optimizer, or lower max_tokens_per_microbatch"
        )
