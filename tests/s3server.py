"""A real S3-protocol server for tests: moto's server mode on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Iterator

from incluster.testing.launch import free_port


def start() -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("moto_server", path=os.path.dirname(sys.executable)) or "moto_server"
    port = free_port()
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/", timeout=1)
            return proc, url
        except (OSError, socket.timeout):
            if proc.poll() is not None:
                raise RuntimeError("moto_server exited at start-up")
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto_server did not start within 30 s")


def options(endpoint: str) -> dict:
    return {"key": "test", "secret": "test", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def make_bucket(endpoint: str, bucket: str) -> None:
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="test", aws_secret_access_key="test", region_name="us-east-1"
    ).create_bucket(Bucket=bucket)


def server() -> Iterator[str]:
    proc, url = start()
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
