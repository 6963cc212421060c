"""Detected device facts: consistent with what this host's /proc says, no Jetson keys without Jetson files,
and the documented Jetson SKUs from a model string and MemTotal."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from edgeflow.tracking.codeversion import code_identity
from edgeflow.engines.cpu_host import ISA_FLAGS
from edgeflow.device.facts import JETSON_FACTS, detect_facts, jetson_sku


def _proc(path: str) -> dict[str, str]:
    """The first `key: value` of each key in a /proc file, read here independently of the code under test."""
    out: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in out:
            out[key.strip()] = value.strip()
    return out


def test_facts_on_this_host_match_its_cpuinfo_and_meminfo() -> None:
    facts = detect_facts()
    cpuinfo, meminfo = _proc("/proc/cpuinfo"), _proc("/proc/meminfo")

    assert all(isinstance(v, str) and v for v in facts.values()), facts
    if "model name" in cpuinfo:
        assert facts["cpu_model"] == cpuinfo["model name"]
    flags = set(cpuinfo.get("flags", "").split())
    expected_isa = sorted(f for f in ISA_FLAGS if f in flags)
    if expected_isa:
        assert facts["isa"].split(",") == expected_isa
    else:
        assert "isa" not in facts  # present only when detected
    total_mb = int(meminfo["MemTotal"].split()[0]) // 1024
    assert facts["mem_total_mb"] == str(total_mb)
    assert 0 < int(facts["mem_free_mb"]) <= total_mb
    assert facts["hostname"] == socket.gethostname()
    assert facts["edgeflow"] == code_identity()
    if not Path("/proc/device-tree/model").exists():
        assert facts["sku"] == facts["cpu_model"]  # not a Jetson: the CPU model


def test_a_host_without_jetson_files_has_no_jetson_keys(tmp_path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:       16384000 kB\nMemAvailable:    8192000 kB\n")

    facts = detect_facts(root=tmp_path)

    assert not set(JETSON_FACTS) & set(facts), facts
    assert "sm" not in facts  # no NVIDIA driver under this root: the GPU is not queried
    assert facts["mem_total_mb"] == str(16384000 // 1024) and facts["mem_free_mb"] == str(8192000 // 1024)
    assert facts["sku"] == facts["cpu_model"]


def test_a_jetson_tree_gives_its_sku_and_l4t_release(tmp_path) -> None:
    (tmp_path / "proc" / "device-tree").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    (tmp_path / "proc" / "device-tree" / "model").write_bytes(b"NVIDIA Jetson AGX Orin Developer Kit\x00")
    (tmp_path / "proc" / "meminfo").write_text("MemTotal:       64335836 kB\nMemAvailable:   60000000 kB\n")
    (tmp_path / "etc" / "nv_tegra_release").write_text(
        "# R36 (release), REVISION: 3.0, GCID: 36191598, BOARD: generic, EABI: aarch64, DATE: Mon May  6 17:34:21 UTC 2024\n")

    facts = detect_facts(root=tmp_path)

    assert facts["sku"] == "agx-orin-64gb"
    assert facts["l4t"] == "36.3.0"


@pytest.mark.parametrize(("model", "mem_total_mb", "sku"), [
    ("NVIDIA Jetson AGX Orin Developer Kit", 62_828, "agx-orin-64gb"),  # MemTotal 64335836 kB
    ("Jetson AGX Orin", 30_536, "agx-orin-32gb"),
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit", 15_388, "orin-nx-16gb"),
    ("NVIDIA Jetson Orin NX Engineering Reference Developer Kit", 7_450, "orin-nx-8gb"),
    ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super", 7_620, "orin-nano-8gb"),
    ("NVIDIA Jetson Orin Nano Developer Kit", 3_450, "orin-nano-4gb"),
    ("NVIDIA Jetson AGX Orin Developer Kit", 65_536, "agx-orin-64gb"),  # exactly the module's size
])
def test_documented_jetson_skus(model: str, mem_total_mb: int, sku: str) -> None:
    assert jetson_sku(model, mem_total_mb) == sku


@pytest.mark.parametrize(("model", "mem_total_mb"), [
    ("NVIDIA Jetson AGX Orin Developer Kit", 70_000),  # more than any AGX Orin module
    ("NVIDIA Jetson Xavier NX Developer Kit", 7_600),  # not a documented family
    ("Raspberry Pi 4 Model B Rev 1.4", 3_800),
])
def test_undocumented_boards_have_no_documented_sku(model: str, mem_total_mb: int) -> None:
    assert jetson_sku(model, mem_total_mb) is None
