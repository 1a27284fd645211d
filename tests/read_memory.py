"""Host memory held while safetensors files are read, for tests that run in a
subprocess with glibc's mmap threshold fixed (so RSS measures what is held,
not the allocator's history)."""

import contextlib

import psutil

from offload import safetensors_file


@contextlib.contextmanager
def growth_while_reading():
    """Yields a dict whose ``bytes``, on exit, is the peak RSS above the one at
    entry, sampled before every ``SafetensorsReader.read`` and at the end."""
    process = psutil.Process()
    result = {"bytes": 0}
    before = process.memory_info().rss
    original = safetensors_file.SafetensorsReader.read

    def sampled(self, *args):
        result["bytes"] = max(result["bytes"], process.memory_info().rss - before)
        return original(self, *args)

    safetensors_file.SafetensorsReader.read = sampled
    try:
        yield result
    finally:
        safetensors_file.SafetensorsReader.read = original
        result["bytes"] = max(result["bytes"], process.memory_info().rss - before)
