"""The dtype table shared by the writer and the strict reader (safetensors names)."""

from __future__ import annotations

import torch

from incluster.errors import CheckpointError

# safetensors dtype name -> torch dtype. Only dtypes with a fixed byte width.
_TABLE: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (
    ("U16", "uint16"),
    ("U32", "uint32"),
    ("U64", "uint64"),
    ("F8_E4M3", "float8_e4m3fn"),
    ("F8_E5M2", "float8_e5m2"),
):
    if hasattr(torch, _attr):
        _TABLE[_name] = getattr(torch, _attr)

NAME_TO_DTYPE: dict[str, torch.dtype] = dict(_TABLE)
DTYPE_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in _TABLE.items()}
ITEMSIZE: dict[str, int] = {k: torch.empty((), dtype=v).element_size() for k, v in _TABLE.items()}


def dtype_name(dtype: torch.dtype, path: str) -> str:
    """The safetensors name of ``dtype``; a clear error for dtypes the format cannot hold."""
    try:
        return DTYPE_TO_NAME[dtype]
    except KeyError:
        raise CheckpointError(
            f"{path}: tensors of dtype {dtype} cannot be stored in a safetensors shard; "
            f"convert it (e.g. view a complex tensor with torch.view_as_real) before saving"
        ) from None
