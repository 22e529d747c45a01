"""AdamW with its moments in host memory (`trainer.offload_optimizer`).

FSDP2's `CPUOffloadPolicy` moves parameters, gradients and moments to the host and steps there: 16 bytes per
parameter of host memory (fp32 master weights, gradients, two moments), more than a node has for a large model
on few GPUs (a 14-layer Qwen3-30B-A3B shape is 9.3 B parameters, 149 GB, on an H200 machine of 128 GiB). This
keeps the master weights and gradients on the GPU (8 bytes per parameter) and only the two moments on the host
(pinned on CUDA), streamed to the GPU a chunk at a time for the update, which runs there.

The update is torch's AdamW (decoupled weight decay, bias-corrected moments), and the state has its names
(`step`, `exp_avg`, `exp_avg_sq`), so the trainer state reads and writes it as any AdamW's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from moeloop.steps.model.sharding import local

CHUNK_ELEMENTS = 1 << 26  # 64 Mi elements: 512 MiB of moments on the GPU at a time


class OffloadedAdamW(torch.optim.Optimizer):
    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                param, grad = local(parameter), local(parameter.grad)
                if not (param.is_contiguous() and grad.is_contiguous()):
                    raise ValueError("OffloadedAdamW steps contiguous (local) parameters and gradients")
                state = self.state[parameter]
                if not state:
                    pin = param.is_cuda
                    state["step"] = torch.tensor(0.0)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros(param.shape, dtype=param.dtype, pin_memory=pin)
                state["step"] += 1
                step = float(state["step"])
                step_size = group["lr"] / (1 - beta1**step)
                bias_correction2_sqrt = math.sqrt(1 - beta2**step)
                param.mul_(1 - group["lr"] * group["weight_decay"])
                param_n, grad_n = param.view(-1), grad.view(-1)
                host_avg_n, host_avg_sq_n = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
                for start in range(0, param_n.numel(), CHUNK_ELEMENTS):
                    chunk = slice(start, start + CHUNK_ELEMENTS)
                    avg_c = host_avg_n[chunk].to(param.device, non_blocking=True)
                    avg_sq_c = host_avg_sq_n[chunk].to(param.device, non_blocking=True)
                    avg_c.lerp_(grad_n[chunk], 1 - beta1)
                    avg_sq_c.mul_(beta2).addcmul_(grad_n[chunk], grad_n[chunk], value=1 - beta2)
                    denominator_c = (avg_sq_c.sqrt() / bias_correction2_sqrt).add_(group["eps"])
                    param_n[chunk].addcdiv_(avg_c, denominator_c, value=-step_size)
                    host_avg_n[chunk].copy_(avg_c, non_blocking=True)
                    host_avg_sq_n[chunk].copy_(avg_sq_c, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the moments' copies back to the host have landed
