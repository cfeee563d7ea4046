"""Telling whether the RAM disk under local_dir hands out huge pages."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest

from incluster.ramdisk import huge_page_hint, mount_of, not_ram_hint

MOUNTS = """\
proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0
overlay / overlay rw,relatime,lowerdir=/a 0 0
tmpfs /dev/shm tmpfs rw,nosuid,nodev,size=24684092k 0 0
tmpfs /mnt/huge tmpfs rw,relatime,size=8g,huge=within_size 0 0
tmpfs /mnt/adv tmpfs rw,relatime,huge=advise 0 0
tmpfs /mnt/my\\040disk tmpfs rw,relatime,huge=always 0 0
"""


def test_the_longest_mount_point_wins_and_escapes_are_read():
    assert mount_of("/dev/shm/incluster/job", MOUNTS).point == "/dev/shm"
    assert mount_of("/mnt/huge/x", MOUNTS).option("huge") == "within_size"
    assert mount_of("/mnt/my disk/ckpt", MOUNTS).option("huge") == "always"
    assert mount_of("/home/u", MOUNTS).fstype == "overlay"
    assert mount_of("/dev/shmem", MOUNTS).point == "/"  # a prefix of a name is not a parent


@pytest.mark.parametrize(
    "path, hinted",
    [("/dev/shm/x", True), ("/mnt/adv/x", True), ("/mnt/huge/x", False), ("/mnt/my disk/x", False), ("/home/u", False)],
)
def test_a_hint_only_for_a_tmpfs_without_huge_pages(path, hinted):
    hint = huge_page_hint(path, MOUNTS)
    assert (hint is not None) == hinted
    if hinted:
        assert "huge=within_size" in hint and "local_dir" in hint  # it names the fix


def test_a_local_dir_on_a_disk_is_named_not_a_ram_disk():
    warned = not_ram_hint("/home/u/ckpt", MOUNTS)
    assert warned is not None and "overlay" in warned and "not in the node's RAM" in warned
    assert "/dev/shm/incluster" in warned  # it names the fix
    assert not_ram_hint("/dev/shm/x", MOUNTS) is None and not_ram_hint("/mnt/huge/x", MOUNTS) is None


def test_real_private_tmpfs_mounts_with_and_without_huge_pages(tmp_path):
    """Real mounts: a private tmpfs with and without huge pages (needs unprivileged user
    namespaces, as the RAM-disk-full test does)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode != 0:
        pytest.skip("no unprivileged mount namespaces here")
    script = (
        "import sys; from incluster.ramdisk import huge_page_hint; "
        "print(huge_page_hint(sys.argv[1]) is not None)"
    )
    out = {}
    for opts in ("size=4m", "size=4m,huge=within_size"):
        d = tmp_path / opts.replace(",", "_").replace("=", "-")
        d.mkdir()
        cmd = f"mount -t tmpfs -o {opts} tmpfs {d} && {sys.executable} -c '{script}' {d}/ckpt"
        res = subprocess.run(["unshare", "-rm", "sh", "-c", cmd], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        out[opts] = res.stdout.strip()
    assert out == {"size=4m": "True", "size=4m,huge=within_size": "False"}
    assert not os.listdir(tmp_path / "size-4m")  # the mount was private: nothing left behind


def test_the_checkpointer_names_the_fix_once(local_dir, caplog):
    import incluster
    from incluster import ramdisk

    expected = huge_page_hint(local_dir)
    ramdisk._hinted.discard(local_dir)
    caplog.set_level(logging.INFO, logger="incluster")
    for _ in range(2):
        incluster.Checkpointer(local_dir=local_dir, job="t", writer="thread").close()
    hints = [r.getMessage() for r in caplog.records if "huge pages" in r.getMessage()]
    assert hints == ([] if expected is None else [f"incluster: {expected}"])
