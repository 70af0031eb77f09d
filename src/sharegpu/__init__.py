"""sharegpu: many Kubernetes pods sharing NVIDIA GPUs, placed densely and safely."""

from sharegpu.core.errors import (
    InvalidInputError,
    InvalidInventoryError,
    InvalidRequestError,
    InvalidTraceError,
    SharegpuError,
    UnknownPolicyError,
)

__version__ = "0.1.0"

__all__ = [
    "InvalidInputError",
    "InvalidInventoryError",
    "InvalidRequestError",
    "InvalidTraceError",
    "SharegpuError",
    "UnknownPolicyError",
    "__version__",
]
