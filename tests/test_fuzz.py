"""What offload reads from disk, fed random and mutated bytes (hypothesis):
safetensors files, a checkpoint's manifest (re-checksummed, so the mutation
gets past the CRC to the parsing behind it) and the swap-file header. Each
gives a clean ``OffloadError`` naming the file, or reads what is there:
never another exception, a crash or a hang, and allocations stay bounded by
the file's real size (checked before anything is allocated)."""

import json
import os
import struct
import zlib

import pytest
import torch

import offload
from offload import _native, checkpoint
from offload.checkpoint.format import MANIFEST, _canonical
from offload.errors import OffloadError
from offload.safetensors_file import SafetensorsReader, write_safetensors
from offload.store import shard_file

from .zero.harness import batch, config, make_model

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed (pip install -e .[test])")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 150)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)


def _read_all(path: str) -> None:
    reader = SafetensorsReader(path)
    try:
        for key in reader.entries:
            reader.read(key)
    finally:
        reader.close()


def _valid_safetensors(path) -> bytes:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    write_safetensors(str(path), [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()], tensors.items())
    return path.read_bytes()


@FUZZ
@given(data=st.binary(max_size=2048))
def test_random_bytes_are_no_safetensors_file(tmp_path, data):
    path = tmp_path / "random.safetensors"
    path.write_bytes(data)
    with pytest.raises(OffloadError, match="random.safetensors"):
        _read_all(str(path))


@FUZZ
@given(at=st.integers(0, 10_000), value=st.integers(0, 255), cut=st.integers(0, 10_000))
def test_a_mutated_safetensors_file_reads_or_fails_cleanly(tmp_path, at, value, cut):
    data = bytearray(_valid_safetensors(tmp_path / "valid.safetensors"))
    data[at % len(data)] = value
    path = tmp_path / "mutated.safetensors"
    path.write_bytes(bytes(data[: len(data) - cut % 16]))  # flipped, and sometimes truncated
    try:
        _read_all(str(path))
    except OffloadError as e:
        assert "mutated.safetensors" in str(e)


@FUZZ
@given(entry=JSON, key=st.text(max_size=8))
def test_a_hostile_safetensors_header_fails_cleanly(tmp_path, entry, key):
    header = json.dumps({key: entry, "ok": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    try:
        _read_all(str(path))
    except OffloadError as e:
        assert "hostile.safetensors" in str(e)


def test_a_deeply_nested_header_is_refused_not_a_recursion_error(tmp_path):
    header = b"[" * 100_000 + b"]" * 100_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(OffloadError, match="deep.safetensors: the safetensors header is not JSON"):
        SafetensorsReader(str(path))


@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("ckpt")
    with offload.initialize(make_model(), config(2, "cpu", 1)) as engine:
        engine.backward(engine(batch(0, 0, 0)))
        engine.step()
        return engine.save_checkpoint(str(directory))


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


def _export_with(tmp_path, saved: str, mutate) -> None:
    """Export the checkpoint ``saved`` with its manifest changed by ``mutate(data)``
    and the checksum made to match, so the change reaches the parsing behind it."""
    with open(os.path.join(saved, MANIFEST)) as f:
        data = json.load(f)
    data.pop("crc32")
    mutate(data)
    directory = tmp_path / "ckpt"
    directory.mkdir(exist_ok=True)
    for name in os.listdir(saved):
        if name != MANIFEST and not os.path.exists(directory / name):
            os.symlink(os.path.join(saved, name), directory / name)
    (directory / MANIFEST).write_text(json.dumps({**data, "crc32": zlib.crc32(_canonical(data))}))
    checkpoint.export(str(directory), str(tmp_path / "out.safetensors"), torch.float32)


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@FUZZ
@given(choice=st.integers(0, 10**6), value=JSON)
def test_a_hostile_manifest_with_a_valid_checksum_fails_cleanly(tmp_path, saved_checkpoint, choice, value):
    """Any one field replaced by any JSON value: the export (which trusts
    nothing but the files) reads it or refuses it by name."""

    def replace(data):
        paths = [p for p in _paths(data) if p]
        *parents, last = paths[choice % len(paths)]
        for k in parents:
            data = data[k]
        data[last] = value

    try:
        _export_with(tmp_path, saved_checkpoint, replace)
    except OffloadError as e:
        assert "manifest" in str(e) or str(tmp_path) in str(e)  # it names the manifest or the file at fault


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@pytest.mark.parametrize("field, value, message", [
    ("keys", [], r"a parameter of bucket 0 has keys \[\] and shape"),  # found by the fuzzer: an IndexError
    ("shape", [-4, 2], r"has keys .* and shape \[-4, 2\]"),
])
def test_a_parameter_record_out_of_range_is_refused(tmp_path, saved_checkpoint, field, value, message):
    def change(data):
        data["layout"][0]["params"][0][field] = value

    with pytest.raises(OffloadError, match=message):
        _export_with(tmp_path, saved_checkpoint, change)


@pytest.mark.skipif(not _native.status().available, reason="native library not built")
@FUZZ
@given(data=st.binary(max_size=256))
def test_a_random_swap_file_header_is_refused(data):
    """The fields live in the first bytes; the rest of the block is padding."""
    header = torch.zeros(shard_file.HEADER_BYTES, dtype=torch.uint8)
    header[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else header[:0]
    meta = shard_file.ShardMeta((10,), torch.float32)
    with pytest.raises(OffloadError, match="x.swap"):
        shard_file.verify(header, "x.swap", meta, 1, 1 << 20, 0)
