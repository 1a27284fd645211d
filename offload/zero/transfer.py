"""Every copy between the accelerator and host memory goes through here.

Note [transfer protocol]
Two streams, named by purpose: ``d2h`` carries gradients out, ``h2d`` carries
weights in (and reads them ahead). A copy returns a ``Pending``: its
destination, the event that marks the copy done, and what it holds (the
source, a pinned staging buffer of the pool).
  - ``to_host`` (d2h): the copy stream first waits for the compute stream (the
    source was just computed there), then copies without blocking into the
    destination (pinned host memory: the caller's, or a staging buffer from
    the pool). Whoever reads the host copy first calls ``wait()``: the CPU
    blocks on the event. Until then the Pending keeps the source alive.
  - ``to_device`` (h2d): the copy stream copies the host source without
    blocking into the device destination. Whoever computes with the
    destination first calls ``wait()``; on CUDA that makes the compute
    stream wait for the event without blocking the CPU.
  - A CPU that waits on an event sleeps until the copy is done: a spinning
    wait (CUDA's default) would take a core from the CPU Adam and from the
    thread that lands gradients.
  - ``release()`` gives a staging buffer back to its pool, and lets go of the
    source, only once the event has completed (it waits if it must): a
    buffer is never reused while a copy may still read or write it, as the
    store does with its I/O handles.
The accelerator being the CPU, there is nothing to copy: a copy is done when
it returns. With ``OFFLOAD_SIMULATED_DEVICE=1`` the CPU plays an asynchronous
device instead: copies run on one background thread ("offload-sim-copy"),
in chunks, at ``OFFLOAD_SIM_GBPS`` GB/s if set and with random pauses, so a
reader that does not wait sees stale or half-written data, and the
equivalence tests fail.
"""

from __future__ import annotations

import os
import queue
import random
import threading
import time
from typing import Protocol

import torch

from offload.store import PinnedPool, PoolExhausted

SIMULATE_ENV = "OFFLOAD_SIMULATED_DEVICE"
BANDWIDTH_ENV = "OFFLOAD_SIM_GBPS"


class Pending(Protocol):
    tensor: torch.Tensor  # the destination; read or compute with it only after wait()

    def done(self) -> bool: ...

    def wait(self) -> torch.Tensor: ...

    def release(self) -> None: ...


class Transfer:
    """Copies for one engine, by whichever engine fits the accelerator."""

    def __init__(self, device: torch.device, pool: PinnedPool | None = None) -> None:
        self.device = device
        self.pool = _SharedPool(pool) if pool is not None else None
        if device.type == "cuda":
            self._copier: _Copier = _CudaCopier(device)
        elif simulated():
            self._copier = _SimulatedCopier()
        else:
            self._copier = _ImmediateCopier()

    @property
    def asynchronous(self) -> bool:
        """Copies may land after they return: the host and the accelerator are apart."""
        return not isinstance(self._copier, _ImmediateCopier)

    def to_host(self, src: torch.Tensor, into: torch.Tensor | None = None, wait_for_room: bool = False) -> Pending:
        """``src`` (on the accelerator) copied into ``into`` (host, same size), or
        into a pinned staging buffer from the pool (``release()`` gives it back).
        A full pool raises PoolExhausted, or, with ``wait_for_room``, waits for
        another thread to give a buffer back."""
        buffer = None
        if into is None:
            if not self.asynchronous:
                return _Done(src)  # the accelerator's memory is host memory: read it where it is
            buffer = self.pool.acquire(src.numel() * src.element_size(), wait_for_room)
            into = buffer.data[: src.numel() * src.element_size()].view(src.dtype).view(src.shape)
        return self._copier.copy(into, src, "d2h", self.pool, buffer)

    def to_device(self, src: torch.Tensor, into: torch.Tensor) -> Pending:
        """``src`` (host) copied into ``into`` (on the accelerator, same size)."""
        return self._copier.copy(into, src, "h2d", None, None)

    def host_copy(self, src: torch.Tensor) -> torch.Tensor:
        """A host copy of ``src``, now (for paths off the step's critical path)."""
        into = torch.empty(src.shape, dtype=src.dtype)
        return self._copier.copy(into, src, "d2h", None, None).wait()

    def device_copy(self, src: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A copy of host tensor ``src`` on the accelerator, now."""
        into = torch.empty(src.shape, dtype=dtype or src.dtype, device=self.device)
        return self._copier.copy(into, src, "h2d", None, None).wait()

    def close(self) -> None:
        self._copier.close()


class _SharedPool:
    """The staging pool, used from two threads (the landing thread gives back
    what backward copied out): one lock, and a wait for room."""

    def __init__(self, pool: PinnedPool) -> None:
        self._pool = pool
        self._changed = threading.Condition()

    def acquire(self, nbytes: int, wait_for_room: bool):
        with self._changed:
            while True:
                try:
                    return self._pool.acquire(nbytes)
                except PoolExhausted:
                    if not wait_for_room or self._pool.in_use_bytes == 0:
                        raise
                    self._changed.wait()

    def release(self, buffer) -> None:
        with self._changed:
            self._pool.release(buffer)
            self._changed.notify_all()


def simulated() -> bool:
    return os.environ.get(SIMULATE_ENV, "") not in ("", "0")


class _Copier(Protocol):
    def copy(self, into: torch.Tensor, src: torch.Tensor, direction: str, pool: PinnedPool | None,
             buffer) -> Pending: ...

    def close(self) -> None: ...


class _Done:
    """A copy that was complete when it returned (or never needed)."""

    def __init__(self, tensor: torch.Tensor, pool: PinnedPool | None = None, buffer=None) -> None:
        self.tensor, self._pool, self._buffer = tensor, pool, buffer

    def done(self) -> bool:
        return True

    def wait(self) -> torch.Tensor:
        return self.tensor

    def release(self) -> None:
        if self._buffer is not None:
            self._pool.release(self._buffer)
            self._buffer = None


class _ImmediateCopier:
    def copy(self, into, src, direction, pool, buffer) -> Pending:
        into.copy_(src)
        return _Done(into, pool, buffer)

    def close(self) -> None:
        pass


class _CudaPending:
    def __init__(self, into: torch.Tensor, src: torch.Tensor, event: torch.cuda.Event, direction: str,
                 pool: PinnedPool | None, buffer) -> None:
        self.tensor, self._src, self._event, self._direction = into, src, event, direction
        self._pool, self._buffer = pool, buffer

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> torch.Tensor:
        if self._direction == "h2d":
            torch.cuda.current_stream(self.tensor.device).wait_event(self._event)  # the compute stream, not the CPU
        else:
            self._event.synchronize()
        return self.tensor

    def release(self) -> None:
        try:
            self._event.synchronize()
        finally:  # a failed copy's buffer goes back too: a sender waiting for room would wait for ever
            self._src = None
            if self._buffer is not None:
                self._pool.release(self._buffer)
                self._buffer = None


class _CudaCopier:
    def __init__(self, device: torch.device) -> None:
        self.streams = {"d2h": torch.cuda.Stream(device), "h2d": torch.cuda.Stream(device)}

    def copy(self, into, src, direction, pool, buffer) -> Pending:
        stream = self.streams[direction]
        stream.wait_stream(torch.cuda.current_stream(stream.device))  # the source is ready on the compute stream
        with torch.cuda.stream(stream):
            into.copy_(src, non_blocking=True)
            event = torch.cuda.Event(blocking=True)  # a CPU waiting on it sleeps, leaving its core to the Adam
            event.record(stream)
        return _CudaPending(into, src, event, direction, pool, buffer)

    def close(self) -> None:
        for stream in self.streams.values():
            stream.synchronize()


class _SimulatedPending:
    def __init__(self, into: torch.Tensor, src: torch.Tensor, pool: PinnedPool | None, buffer) -> None:
        self.tensor, self._src, self._pool, self._buffer = into, src, pool, buffer
        self.event = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> torch.Tensor:
        self.event.wait()
        if self.error is not None:
            raise self.error
        return self.tensor

    def release(self) -> None:
        self.event.wait()
        self._src = None
        if self._buffer is not None:
            self._pool.release(self._buffer)
            self._buffer = None


class _SimulatedCopier:
    """One copy thread, in order, as a copy engine works: each copy moves in
    chunks with pauses between them, so a reader that skips ``wait()`` sees
    the destination stale or half written."""

    CHUNK_BYTES = 64 << 10

    def __init__(self) -> None:
        gbps = float(os.environ.get(BANDWIDTH_ENV, "0") or 0)
        self._seconds_per_byte = 1 / (gbps * 1e9) if gbps > 0 else 0.0
        self._random = random.Random(0)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="offload-sim-copy", daemon=True)
        self._thread.start()

    def copy(self, into, src, direction, pool, buffer) -> Pending:
        pending = _SimulatedPending(into, src, pool, buffer)
        self._queue.put(pending)
        return pending

    def _run(self) -> None:
        while (pending := self._queue.get()) is not None:
            try:
                # The source may be a view the caller drops at once: the pending keeps it.
                into, src = pending.tensor.view(-1), pending._src.reshape(-1)
                step = max(1, self.CHUNK_BYTES // max(1, into.element_size()))
                for begin in range(0, into.numel(), step):
                    end = min(into.numel(), begin + step)
                    time.sleep(self._random.random() * 2e-4 + (end - begin) * into.element_size() * self._seconds_per_byte)
                    into[begin:end].copy_(src[begin:end])
            except BaseException as exc:  # handed to whoever waits, never lost
                pending.error = exc
            pending.event.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
