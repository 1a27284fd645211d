import pytest

from offload import _native

requires_native = pytest.mark.skipif(not _native.status().available, reason="native library not built")

BACKENDS = ["native", "aiofiles"]
