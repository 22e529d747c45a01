"""FlashAttention-4's kernels as torch's FA4 registration calls them (`torch.nn.attention._fa4`, given this module's
path by `moeloop.steps.model.attention.activate_flash4`). torch unpacks `_flash_attn_fwd`'s result as (out, lse),
which flash-attn-4 4.0.0b15 returns; 4.0.0b20 returns four tensors and 4.0.0b36 five (out, lse and tensors for its
own backward variants), and torch's registration then fails at the first forward. `_flash_attn_bwd` returns
(dq, dk, dv) in both. Imported only where flash4 runs."""

from __future__ import annotations

from typing import Any

import torch
from flash_attn.cute.interface import _flash_attn_bwd
from flash_attn.cute.interface import _flash_attn_fwd as _forward

__all__ = ["_flash_attn_bwd", "_flash_attn_fwd"]


def _flash_attn_fwd(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = _forward(*args, **kwargs)[:2]
    return out, lse
