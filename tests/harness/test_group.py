"""Ending a rank because a peer failed: exit code 1, and torchrun still names the peer."""

from __future__ import annotations

import math
import time

import pytest

from cp_blocktables.harness.group import PeerError, end_after_peer_failure


@pytest.mark.parametrize("under_torchrun", [False, True], ids=["spawned", "torchrun"])
def test_a_rank_ended_by_a_peer_exits_1_after_the_peers_second(monkeypatch, capsys, under_torchrun):
    """torchrun's root cause is the failure of the smallest whole-second timestamp, ties to
    the lowest rank: under torchrun the rank returns only once a later second began."""
    if under_torchrun:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    else:
        monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    peer_failed = time.time()
    assert end_after_peer_failure(PeerError("rank 1 never arrived")) == 1
    assert "rank 1 never arrived" in capsys.readouterr().err
    if under_torchrun:
        assert math.floor(time.time()) > math.floor(peer_failed)
    else:
        assert time.time() - peer_failed < 0.5  # spawned ranks: no wait
