"""Optimizers that run on the host: the native CPU Adam and its building blocks."""

from offload.optim.adam import adam_step
from offload.optim.cpu_adam import CPUAdam
from offload.optim.hyper import AdamHyper

__all__ = ["AdamHyper", "CPUAdam", "adam_step"]
