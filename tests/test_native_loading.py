"""The native library is refused, with the reason and the fix, when it was
built from other sources or switched off: a stale library would read
arguments its callers no longer pass (Note [hyper-parameters by run] added
some), so it must not load."""

import pytest

from offload import _native
from offload.errors import NativeUnavailable

pytestmark = pytest.mark.skipif(not _native.status().available, reason="native library not built")


def _load_afresh():
    """_load without its cache, so the test's changes are seen and the engine's library stays loaded."""
    return _native._load.__wrapped__()


def test_the_built_library_loads_with_this_codes_abi():
    assert _load_afresh().offload_abi_version() == _native.ABI_VERSION


def test_a_library_of_another_abi_is_refused_as_stale(monkeypatch):
    monkeypatch.setattr(_native, "ABI_VERSION", _native.ABI_VERSION + 1)
    with pytest.raises(NativeUnavailable, match=rf"ABI {_native.ABI_VERSION - 1}, this code needs "
                                                rf"{_native.ABI_VERSION}\): it is stale; rebuild with `python3 -m pip install -e .`"):
        _load_afresh()


def test_a_library_lacking_a_function_is_refused_by_the_functions_name(monkeypatch):
    monkeypatch.setitem(_native._SIGNATURES, "offload_from_the_future", (None, []))
    with pytest.raises(NativeUnavailable, match=r"lacks offload_from_the_future: it is stale; rebuild"):
        _load_afresh()


def test_the_switch_turns_the_library_off_by_name(monkeypatch):
    monkeypatch.setenv("OFFLOAD_DISABLE_NATIVE", "1")
    with pytest.raises(NativeUnavailable, match="disabled by OFFLOAD_DISABLE_NATIVE=1"):
        _load_afresh()
    monkeypatch.setenv("OFFLOAD_DISABLE_NATIVE", "0")
    assert _load_afresh().offload_abi_version() == _native.ABI_VERSION
