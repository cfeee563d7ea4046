"""One contract for every byte tier: local path, file://, memory://, S3 (moto server)."""

from __future__ import annotations

import itertools
import os
import uuid

import pytest

from incluster.errors import TierUnavailableError
from incluster.tiers.base import Tier
from incluster.tiers.persistent import FsspecTier

import s3server

_ids = itertools.count()


@pytest.fixture(params=["path", "file", "memory", "s3"])
def tier(request, tmp_path):
    kind = request.param
    if kind == "path":
        yield FsspecTier(str(tmp_path / "tier"))
    elif kind == "file":
        yield FsspecTier(f"file://{tmp_path}/tier")
    elif kind == "memory":
        yield FsspecTier(f"memory://incluster-test-{uuid.uuid4().hex}")
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = f"b{next(_ids)}-{uuid.uuid4().hex[:8]}"
        s3server.make_bucket(endpoint, bucket)
        yield FsspecTier(f"s3://{bucket}/run", s3server.options(endpoint))


def test_satisfies_the_protocol(tier):
    assert isinstance(tier, Tier)


def test_write_read_list_delete(tier):
    data = os.urandom(3 * 1024 * 1024 + 17)
    tier.write("job/step-000000000001/rank-00000.safetensors", memoryview(data))
    tier.write("job/step-000000000001/COMMITTED.json", memoryview(b"{}"))
    assert tier.read("job/step-000000000001/rank-00000.safetensors") == data
    buf = bytearray(len(data))
    assert tier.read("job/step-000000000001/rank-00000.safetensors", into=memoryview(buf)) == len(data)
    assert bytes(buf) == data
    assert tier.list("job") == ["step-000000000001"]
    assert tier.list("job/step-000000000001") == ["COMMITTED.json", "rank-00000.safetensors"]
    tier.delete("job/step-000000000001")
    assert tier.list("job") == []
    tier.delete("job/never-existed")  # not an error


def test_overwrite_is_whole_and_leaves_no_temporaries(tier):
    tier.write("j/a", memoryview(b"x" * 1000))
    tier.write("j/a", memoryview(b"short"))
    assert tier.read("j/a") == b"short"
    assert tier.list("j") == ["a"]


def test_paths_cannot_escape_the_root(tier):
    with pytest.raises(ValueError, match=r"'\.\.'"):
        tier.write("../outside", memoryview(b"x"))


def test_missing_optional_package_names_the_extra():
    pytest.importorskip("torch")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        with pytest.raises(TierUnavailableError, match=r"incluster\[gcs\]"):
            FsspecTier("gs://some-bucket/run")
    else:
        pytest.skip("gcsfs is installed here")


@pytest.mark.parametrize("source", ["mapped", "bytes"])
def test_a_large_write_from_a_mapped_slot_is_whole_with_its_unaligned_tail(tmp_path, local_dir, source):
    """Large page-aligned buffers (a mapped slot) are written with O_DIRECT where the file
    system allows, the tail that is not a whole page through the page cache; a read-only
    buffer always through the page cache. Either way every byte lands."""
    import mmap

    n = (8 << 20) + 123
    payload = bytes(range(256)) * (n // 256) + bytes(range(n % 256))
    if source == "mapped":
        path = os.path.join(local_dir, "slot")
        with open(path, "wb") as f:
            f.write(payload)
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, n)
        os.close(fd)
        view = memoryview(mm)
    else:
        mm, view = None, memoryview(payload)
    tier = FsspecTier(str(tmp_path / "tier"))
    tier.write("job/step-1/rank-00000.safetensors", view)
    assert tier.read("job/step-1/rank-00000.safetensors") == payload
    assert os.listdir(tmp_path / "tier" / "job" / "step-1") == ["rank-00000.safetensors"]  # no temporary left
    view.release()
    if mm is not None:
        mm.close()


@pytest.mark.parametrize("kind", ["path", "s3"])
def test_what_another_process_wrote_is_read_and_listed_at_once(kind, tmp_path, request):
    """Each writer process has its own client. s3fs answered a read or listing from its
    cached listing of the folder: a file another client rewrote read as gone ("Etag no
    longer exists") or empty, a new one was not listed (the job's owner record, a
    manifest the last rank wrote)."""
    if kind == "path":
        url, opts = str(tmp_path / "tier"), {}
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        bucket = f"b{next(_ids)}-{uuid.uuid4().hex[:8]}"
        s3server.make_bucket(endpoint, bucket)
        url, opts = f"s3://{bucket}/run", s3server.options(endpoint)
    mine = FsspecTier(url, opts)
    other = FsspecTier(url, {**opts, "skip_instance_cache": True})  # another process's client
    assert mine.fs is not other.fs
    mine.write("j/RUN.json", memoryview(b'{"run": "a"}'))
    assert mine.list("j") == ["RUN.json"] and mine.read("j/RUN.json") == b'{"run": "a"}'  # listing cached
    other.write("j/RUN.json", memoryview(b'{"run": "bb"}'))
    other.write("j/step-000000000001/COMMITTED.json", memoryview(b"{}"))
    assert mine.read("j/RUN.json") == b'{"run": "bb"}'
    assert mine.list("j") == ["RUN.json", "step-000000000001"]
    assert mine.list_sizes("j")["RUN.json"] == 13
