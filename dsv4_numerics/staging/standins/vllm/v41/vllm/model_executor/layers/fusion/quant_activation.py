"""Stand-in: the quantised-activation container the V4.1 query quantiser returns (fields as the real one)."""
from dataclasses import dataclass

import torch


@dataclass
class QuantizedActivation:
    data: torch.Tensor
    scale: torch.Tensor
    orig_dtype: torch.dtype
    orig_shape: torch.Size
    quant_key: object


def get_input_quant_key(layer):
    if getattr(layer, "requires_unquantized_input", False):
        return None
    return getattr(layer, "_input_quant_key", None)
