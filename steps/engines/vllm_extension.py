"""Code that runs inside vLLM's worker processes, mixed into the worker by `worker_extension_cls`: the policy's
weights reloaded from a folder, or changed in place by a delta, and read back as the checkpoint's tensors
(`moeloop.steps.engines.weights`).

On CPU, vLLM packs every linear layer's weight for oneDNN (a copy) and frees the weight: nothing could then change
it in place, or read it. Imported into the worker before the model loads, this module has vLLM keep the weights and
multiply with torch's `F.linear` instead (`keep_cpu_linear_weights`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from moeloop.steps.engines.vllm_logs import quiet_misleading_lines
from moeloop.steps.engines.weights import EngineWeights, concatenated
from moeloop.steps.model.delta import CheckpointTensors

# vLLM's fused linear layers and the checkpoint tensors each concatenates, in order (its models' stacked_params_mapping;
# a model's packed_modules_mapping adds its own).
FUSED_LINEARS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
EXPERTS = re.compile(r"^(?P<block>.+)\.experts(?:\.routed_experts)?\.(?P<kind>w13|w2)_weight$")
# The MoE kernels that keep vLLM's loaded layout, [E, 2I, H] and [E, H, I]; CPU's packs it (a permutation per expert).
PLAIN_MOE_BACKENDS = {"TRITON", "BATCHED_TRITON"}


def keep_cpu_linear_weights() -> None:
    """vLLM on CPU: every linear layer keeps its weight and multiplies with F.linear (vLLM's own fallback)."""
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return

    def plain_linear(layer: torch.nn.Module, remove_weight: bool) -> None:
        layer.cpu_linear = torch.nn.functional.linear

    utils.dispatch_cpu_unquantized_gemm = plain_linear


keep_cpu_linear_weights()


class PolicyWeightReload:
    """In-place weight reload that also holds on CPU, the policy's weights as its checkpoint's tensors, and the
    layout vLLM captures routed experts in.

    vLLM 0.32 prepacks MoE expert weights for its CPU kernel only on the first load: on a weight update
    `UnquantizedFusedMoEMethod` copies the new, unpacked weights into the packed storage and skips the
    experts' `process_weights_after_loading`, so the CPU kernel computes with garbage. Packing again here
    makes the reloaded engine give the trainer's logprobs (tests/loop/test_vllm.py checks it).
    """

    def reload_policy_weights(self, weights_path: str) -> None:
        refusal = self.policy_reload_refusal()
        if refusal is not None:
            raise RuntimeError(f"{refusal}; set local.workers: false")
        quiet_misleading_lines()  # in the worker's process, where the reload logs
        self.settle_policy_digests()
        load_config = self.model_runner.vllm_config.load_config
        if load_config.load_format == "dummy":  # an engine started before its weights came: these are its first
            load_config.load_format = "auto"
        self.reload_weights(weights_path=weights_path)
        for module, experts in self._cpu_packed_experts():
            experts.process_weights_after_loading(module)

    def policy_reload_refusal(self) -> str | None:
        """Why the weights cannot be reloaded in place, in one line, or None: vLLM on CPU pads an MoE intermediate
        size to its kernel's alignment on the first load, and a reload would copy unpadded weights into it."""
        for _, experts in self._cpu_packed_experts():
            intermediate = experts.moe_config.intermediate_size_per_partition
            if experts._padded_intermediate_size(experts.moe_config) != intermediate:
                return (
                    f"in-place reload of padded CPU MoE weights (moe_intermediate_size {intermediate}) is not "
                    "supported by this vLLM"
                )
        return None

    def _cpu_packed_experts(self) -> list[tuple[torch.nn.Module, object]]:
        """On CPU, each MoE layer and its experts whose kernel packs their weights (none elsewhere)."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return []
        packed = []
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is not None and hasattr(experts, "_padded_intermediate_size"):
                packed.append((module, experts))
        return packed

    def map_policy_weights(self, checkpoint_dir: str, model_type: str) -> str | None:
        """Find where each tensor of the checkpoint the engine has just loaded lives in its weights; why deltas
        cannot be written into them, in one line, or None."""
        self.settle_policy_digests()
        self.policy_weights = None
        kinds = CheckpointTensors(Path(checkpoint_dir)).kinds()
        try:
            weights = vllm_weights(self.model_runner.get_model(), kinds, model_type)
        except ValueError as error:
            return str(error)
        refusal = weights.refusal(kinds)
        self.policy_weights = weights if refusal is None else None
        return refusal

    def apply_policy_delta(self, files: list[str]) -> None:
        self.policy_weights.apply_delta([Path(file) for file in files])

    def policy_weight_digests(self) -> dict[str, str]:
        return self.policy_weights.digests()

    def policy_weight_digests_later(self) -> None:
        """Start reading the digests back on a thread of this worker, beside the generating that follows."""
        self.policy_weights.digests_later()

    def finish_policy_digests(self) -> None:
        """Let a read policy_weight_digests_later started end (before sleep takes the weights off the GPU); its
        digests stay for policy_weight_digests."""
        if getattr(self, "policy_weights", None) is not None:
            self.policy_weights.finish_reading()

    def settle_policy_digests(self) -> None:
        """Wait for such a read and drop it: the weights are about to change."""
        if getattr(self, "policy_weights", None) is not None:
            self.policy_weights.settle()

    def route_layout(self) -> tuple[int, list[int]]:
        """(the routed-experts capture's columns, the decoder layers its MoE layers write to): vLLM's
        `RoutedExpertsCapturer` has one column per decoder layer (`get_total_num_hidden_layers`), and
        `bind_routed_experts_capturer` has each MoE runner (or capture source) write its routes at its `layer_id`,
        the index in its module name; a dense layer's column stays 0. Read from the modules it binds."""
        from vllm.model_executor.layers.fused_moe.layer import MoERunner
        from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

        modules = self.model_runner.get_model().modules()
        captured = {m.layer_id for m in modules if isinstance(m, (MoERunner, RoutedExpertsCaptureSource))}
        return self.vllm_config.model_config.get_total_num_hidden_layers(), sorted(captured)


def vllm_weights(
    model: torch.nn.Module, kinds: dict[str, tuple[tuple[int, ...], torch.dtype]], model_type: str
) -> EngineWeights:
    """The slots of the checkpoint's tensors (kinds: each one's shape and stored dtype) in a vLLM model's parameters
    (tensor parallelism 1, every expert in this engine)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    from moeloop.steps.model.families import family_named

    if get_tensor_model_parallel_world_size() > 1:
        raise ValueError("a tensor-parallel vLLM engine holds a part of each tensor: it takes whole checkpoints")
    fused = FUSED_LINEARS | dict(getattr(model, "packed_modules_mapping", None) or {})
    tensors, slots, packing = {}, {}, {}
    for name, tensor in model.named_parameters():
        tensors[name] = tensor.data
        experts = EXPERTS.match(name)
        if name in kinds:
            parts = [name]
        elif experts:
            module = model.get_submodule(name.rpartition(".")[0])
            if module.local_num_experts != module.global_num_experts:
                raise ValueError("an expert-parallel vLLM engine holds part of the experts: it takes whole checkpoints")
            parts = expert_parts(family_named(model_type).checkpoint_experts, experts["block"], experts["kind"],
                                 tensor.shape[0])  # fmt: skip
            permutation = moe_packing(module, tensor)
            if permutation is not None:
                packing[name] = permutation
        else:
            module, _, leaf = name.rpartition(".")
            parent, _, layer = module.rpartition(".")
            if layer not in fused:
                raise ValueError(f"vLLM's {name} is no checkpoint tensor and no fusion of them")
            parts = [f"{parent}.{part}.{leaf}" for part in fused[layer]]
        unknown = [part for part in parts if part not in kinds]
        if unknown:
            raise ValueError(f"vLLM's {name} holds {unknown[0]}, which is in no checkpoint file")
        slots |= concatenated(name, [(part, math.prod(kinds[part][0]), kinds[part][1]) for part in parts])
    return EngineWeights(tensors, slots, packing)


def expert_parts(names: tuple[str, str, str] | None, block: str, kind: str, experts: int) -> list[str]:
    """The checkpoint tensors of vLLM's w13 (each expert's gate, then its up) or w2 (its down), expert by expert."""
    if names is None:
        raise ValueError("this family's checkpoints hold its experts fused: deltas are not mapped into vLLM's")
    gate, up, down = names
    per_expert = (gate, up) if kind == "w13" else (down,)
    return [f"{block}.experts.{e}.{part}.weight" for e in range(experts) for part in per_expert]


def moe_packing(module: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor | None:
    """The packed position of each element of one expert's slab, where the layer's MoE kernel packs its weights;
    None where it keeps vLLM's layout. Found by packing the slab's own positions, a base-256 digit at a time (the
    engine's dtype holds 0..255 exactly, bf16 included)."""
    backend = module.quant_method.unquantized_backend.name
    if backend in PLAIN_MOE_BACKENDS:
        return None
    if backend != "CPU":
        raise ValueError(f"vLLM's {backend} MoE kernel re-lays its experts out in a way deltas are not mapped into")
    from vllm._custom_ops import cpu_prepack_moe_weight

    isa = module.quant_method.moe_kernel.fused_experts.isa
    slab = math.prod(tensor.shape[1:])
    positions = torch.arange(slab, dtype=torch.int64)
    source = torch.zeros(slab, dtype=torch.int64)  # the unpacked position each packed one holds
    for digit in range(max(1, math.ceil(math.log(slab, 256)))):
        probe = ((positions >> (8 * digit)) & 255).to(tensor.dtype).view(1, *tensor.shape[1:])
        source += cpu_prepack_moe_weight(probe, isa).view(-1).to(torch.int64) << (8 * digit)
    if not torch.equal(torch.bincount(source, minlength=slab), torch.ones(slab, dtype=torch.int64)):
        raise ValueError(f"vLLM's CPU MoE kernel ({isa}) packs its experts other than by a permutation")
    packed = torch.empty(slab, dtype=torch.int64)
    packed[source] = positions
    return packed.to(tensor.device)
