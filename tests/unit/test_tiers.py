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
