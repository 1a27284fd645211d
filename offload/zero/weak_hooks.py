"""Tensor hooks that hold their owner weakly.

Note [hooks on tensors hold weakly]
torch keeps a tensor's hooks (``register_post_accumulate_grad_hook``) in its
C++ autograd metadata, where the garbage collector cannot follow them. A
hook bound to a part of the engine made a cycle it never collected:
parameter -> hook -> reducer -> engine -> model -> parameter. An engine
dropped without ``close()`` (a notebook cell run again) then kept its
threads, swap files and memory for the life of the process, and the model
with it. Bound weakly, the cycle runs only through Python objects, and an
engine no one holds is collected, its stores' finalisers removing the swap
files; a hook that outlives its owner does nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


def weakly(method: Callable) -> Callable:
    """The bound ``method`` as a hook that does not keep its object alive."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return None if bound is None else bound(*args)

    return hook
