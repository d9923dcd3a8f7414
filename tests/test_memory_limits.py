"""The memory a process may take, as the compiler's and the server's memory rules read it: the
system's available memory, a control group's limit (a container's) and an address-space limit."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from he.runtime import address_space_room, available_memory, cgroup_room

GIB = 2 ** 30


def _tree(tmp_path: Path, files: dict[str, str], mountinfo: str, cgroup: str) -> tuple[str, str]:
    for rel, text in files.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    (tmp_path / "mountinfo").write_text(mountinfo.replace("ROOT", str(tmp_path)) + "\n")
    (tmp_path / "cgroup").write_text(cgroup + "\n")
    return str(tmp_path / "mountinfo"), str(tmp_path / "cgroup")


def test_a_cgroup_v2_limit_and_its_ancestors_limits_bound_the_room(tmp_path):
    paths = _tree(tmp_path, {
        "cg/memory.max": "max",                 # the root: no limit
        "cg/user.slice/memory.max": str(8 * GIB),
        "cg/user.slice/memory.current": str(5 * GIB),
        "cg/user.slice/app/memory.max": str(4 * GIB),
        "cg/user.slice/app/memory.current": str(GIB),
    }, "30 23 0:26 / ROOT/cg rw,nosuid,nodev - cgroup2 cgroup2 rw,nsdelegate",
        "0::/user.slice/app")
    assert cgroup_room(*paths) == 3 * GIB
    # a parent nearer its limit than the group is: its room
    (tmp_path / "cg/user.slice/memory.current").write_text(str(int(7.5 * GIB)))
    assert cgroup_room(*paths) == GIB // 2


def test_a_cgroup_v1_limit_in_a_container_whose_mount_shows_its_own_group(tmp_path):
    # a container sees its own group at the mount point (the mount's root is that group)
    paths = _tree(tmp_path, {
        "mem/memory.limit_in_bytes": str(2 * GIB),
        "mem/memory.usage_in_bytes": str(GIB // 2),
    }, "35 31 0:32 /docker/abc ROOT/mem rw,relatime - cgroup cgroup rw,memory\n"
       "36 31 0:33 / ROOT/cpu rw,relatime - cgroup cgroup rw,cpu",
        "4:memory:/docker/abc\n1:cpu:/docker/abc")
    assert cgroup_room(*paths) == int(1.5 * GIB)


def test_no_cgroup_limit_leaves_the_room_unbounded(tmp_path):
    # cgroup v1 writes "no limit" as the largest page-aligned 64-bit value
    paths = _tree(tmp_path, {
        "mem/memory.limit_in_bytes": "9223372036854771712",
        "mem/memory.usage_in_bytes": str(GIB),
        "mem/app/memory.limit_in_bytes": "9223372036854771712",
        "mem/app/memory.usage_in_bytes": str(GIB),
    }, "35 31 0:32 / ROOT/mem rw,relatime - cgroup cgroup rw,memory", "4:memory:/app")
    assert cgroup_room(*paths) is None
    assert cgroup_room(str(tmp_path / "absent"), str(tmp_path / "absent")) is None


def test_an_address_space_limit_bounds_the_memory_a_process_may_take():
    code = textwrap.dedent("""
        import os, resource
        from he.runtime import address_space_room, available_memory
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        assert address_space_room() is None
        resource.setrlimit(resource.RLIMIT_AS, (size + 2 * 2 ** 30, resource.RLIM_INFINITY))
        room = address_space_room()
        assert available_memory() <= room
        # the room is what the process can still take: half of it is allocated, and more
        # than all of it is refused
        half = bytearray(room // 2)
        del half
        try:
            bytearray(room + 256 * 2 ** 20)
        except MemoryError:
            print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_memory_available_is_a_positive_amount_here():
    room = available_memory()
    assert 0 < room
    if address_space_room() is None and cgroup_room() is None:
        with open("/proc/meminfo") as f:
            total = next(int(line.split()[1]) * 1024 for line in f
                         if line.startswith("MemTotal:"))
        assert room <= total


def test_keys_larger_than_the_memory_available_are_refused_before_they_are_made():
    """A client refuses to make, and a server to load, keys that alone exceed the memory the
    process may take (here an address-space cap just above its size), with the numbers, before
    SEAL allocates them; within the memory they are made and loaded as usual."""
    code = textwrap.dedent("""
        import os, resource
        import torch
        from torch import nn
        import he
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 32), nn.Flatten(), nn.Linear(32, 4)).eval()
        x = torch.rand(8, 64)
        prog = he.compile(model, x, calibration=x, packing="vector", ring_degree=8192)
        public = he.Client(prog).public_context()
        need = prog.key_bytes()
        assert need > 2 ** 20
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (size + need // 2, resource.RLIM_INFINITY))
        for make in (lambda: he.Client(prog), lambda: he.Server(prog, public)):
            try:
                make()
            except he.ResourceError as exc:
                msg = str(exc)
                assert "for the keys alone" in msg and "memory_budget=" in msg, msg
                assert f"N=8192" in msg, msg
            else:
                raise AssertionError("keys over the memory available were made")
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
