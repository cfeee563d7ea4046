"""The on-disk format every tier stores: shard files, sidecars, checksums, layouts.

See docs/format.md for every byte.
"""

from incluster.format.checksum import Checksum, compute, verify
from incluster.format.layout import Layout, LayoutCache, TensorSpec, build_layout, fingerprint
from incluster.format.reader import ShardHeader, StoredTensor, parse_header
from incluster.format.sidecar import Sidecar, read_sidecar, write_sidecar

__all__ = [
    "Checksum",
    "Layout",
    "LayoutCache",
    "ShardHeader",
    "Sidecar",
    "StoredTensor",
    "TensorSpec",
    "build_layout",
    "compute",
    "fingerprint",
    "parse_header",
    "read_sidecar",
    "verify",
    "write_sidecar",
]
