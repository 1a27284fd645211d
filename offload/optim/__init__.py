"""Optimizers that run on the host: the native CPU Adam and its building blocks."""

from offload.optim.adam import AdamHyper, adam_step
from offload.optim.cpu_adam import CPUAdam

__all__ = ["AdamHyper", "CPUAdam", "adam_step"]
