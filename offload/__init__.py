"""offload: ZeRO-Offload / ZeRO-Infinity training for PyTorch.

Training state lives in tiers (accelerator, pinned host memory, NVMe files) and
moves just before it is needed. The public API is what this module exports.
"""

__version__ = "0.1.0"
