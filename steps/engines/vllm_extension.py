"""Code that runs inside vLLM's worker processes, mixed into the worker by `worker_extension_cls`."""

from __future__ import annotations


class PolicyWeightReload:
    """In-place weight reload that also holds on CPU; and the layout vLLM captures routed experts in.

    vLLM 0.32 prepacks MoE expert weights for its CPU kernel only on the first load: on a weight update
    `UnquantizedFusedMoEMethod` copies the new, unpacked weights into the packed storage and skips the
    experts' `process_weights_after_loading`, so the CPU kernel computes with garbage. Packing again here
    makes the reloaded engine give the trainer's logprobs (tests/loop/test_vllm.py checks it).
    """

    def reload_policy_weights(self, weights_path: str) -> None:
        from vllm.platforms import current_platform

        self.reload_weights(weights_path=weights_path)
        if not current_platform.is_cpu():
            return
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if experts is None or not hasattr(experts, "_padded_intermediate_size"):
                continue
            intermediate = experts.moe_config.intermediate_size_per_partition
            if experts._padded_intermediate_size(experts.moe_config) != intermediate:
                raise RuntimeError(
                    f"in-place reload of padded CPU MoE weights (moe_intermediate_size {intermediate}) is not "
                    "supported by this vLLM; set local.workers: false"
                )
            experts.process_weights_after_loading(module)

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
