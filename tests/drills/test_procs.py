"""`procs.free_port`: ports for hand-launched ranks, outside what the kernel hands out."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from cp_blocktables.drills.procs import _EPHEMERAL, _LOWEST, free_port


def _range(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return path


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("low", [32768, 20000, 11024], ids=lambda low: f"ephemeral-from-{low}")
def test_the_port_lies_below_the_ephemeral_range_and_is_free(tmp_path, low):
    ranges = _range(tmp_path, f"{low}\t60999\n")
    ports = {free_port(ranges) for _ in range(20)}
    assert all(_LOWEST <= p < low for p in ports), ports
    assert all(_bindable(p) for p in ports)
    assert len(ports) > 1, "the port is drawn at random, so runs side by side differ"


@pytest.mark.parametrize(
    "text", ["10500 60999", "", "not numbers"], ids=["no-room-below", "empty", "garbage"]
)
def test_without_room_below_the_kernel_chooses(tmp_path, text):
    port = free_port(_range(tmp_path, text))
    assert 0 < port < 65536 and _bindable(port)
    if _EPHEMERAL.exists():
        low, high = map(int, _EPHEMERAL.read_text().split())
        assert low <= port <= high


def test_an_unreadable_range_file_leaves_the_choice_to_the_kernel(tmp_path):
    port = free_port(tmp_path / "missing")
    assert 0 < port < 65536 and _bindable(port)
