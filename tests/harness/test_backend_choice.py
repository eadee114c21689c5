"""The backend census: NCCL only when every rank of every host has a GPU of its own.

Two torchrun agents on one host each see LOCAL_WORLD_SIZE=2; only a census of
the whole job counts four ranks there. No GPU is needed: GPU counts and host
names are faked, and the census runs over a real TCPStore with one thread per
rank.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from cp_blocktables import cli
from cp_blocktables.harness import backend as backend_mod
from cp_blocktables.harness.backend import BackendUsageError, Seat, census, decide
from cp_blocktables.harness.group import PeerError


def seats(*hosts: tuple[str, int, int]) -> list[Seat]:
    """(host, ranks there, GPUs each sees) -> the census of ranks numbered host by host."""
    return [Seat(h, f"boot-{h}", g) for h, n, g in hosts for _ in range(n)]


def test_a_gpu_per_rank_on_every_host_is_nccl():
    census_ = seats(("a", 2, 2), ("b", 2, 4))
    placed = [decide("auto", census_, r) for r in range(4)]
    assert {p.backend for p in placed} == {"nccl"}
    assert [p.host_index for p in placed] == [0, 1, 0, 1]
    assert not any(p.note for p in placed)


def test_two_agents_on_one_host_of_two_gpus_share_them_under_gloo():
    """The H200 pair: two agents of LOCAL_WORLD_SIZE=2 on one host, 4 ranks, 2 GPUs."""
    census_ = seats(("h200", 4, 2))
    placed = [decide("auto", census_, r) for r in range(4)]
    assert {p.backend for p in placed} == {"gloo"}
    assert all(p.shares_gpus and p.ranks_on_host == 4 for p in placed)
    # GPU index: place among the host's ranks, not LOCAL_RANK (both agents count from 0)
    assert [p.host_index % p.gpus for p in placed] == [0, 1, 0, 1]
    assert "host h200 runs 4 ranks on 2 GPUs, so ranks share GPUs" in placed[0].note


def test_one_crowded_host_makes_every_rank_take_gloo():
    census_ = seats(("a", 2, 2), ("b", 3, 2))
    assert {decide("auto", census_, r).backend for r in range(5)} == {"gloo"}
    assert decide("auto", census_, 0).note  # rank 0's host is fine, and still says why


def test_the_same_host_name_after_a_reboot_or_elsewhere_is_another_host():
    census_ = [Seat("node", "boot-1", 1), Seat("node", "boot-2", 1)]
    assert decide("auto", census_, 1).backend == "nccl"


def test_no_gpu_anywhere_is_gloo_on_cpu_without_a_note():
    placed = decide("auto", seats(("cpu", 4, 0)), 2)
    assert placed.backend == "gloo" and not placed.shares_gpus and placed.note == ""


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        (
            (("h200", 4, 2),),
            "host h200 runs 4 ranks (local world size 4) but sees 2 GPUs; use --backend gloo",
        ),
        ((("cpu", 2, 0),), "host cpu runs 2 ranks (local world size 2) but sees 0 GPUs"),
    ],
    ids=["shared", "none"],
)
def test_nccl_where_ranks_would_share_a_gpu_is_a_usage_error(hosts, message):
    with pytest.raises(BackendUsageError, match="needs a GPU per rank") as exc:
        decide("nccl", seats(*hosts), 0)
    assert message in str(exc.value)


def _run_census(world: int, seat_of, timeout: float, ranks=None):
    """The census over a real TCPStore, one thread per rank in `ranks` (default: all)."""
    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    out: dict[int, object] = {}

    def rank_main(r: int) -> None:
        store = dist.TCPStore(
            "127.0.0.1", server.port, world, is_master=False, timeout=timedelta(seconds=30)
        )
        try:
            out[r] = census(dist.PrefixStore("default_pg", store), r, world, seat_of(r), timeout)
        except PeerError as e:
            out[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in (ranks or range(world))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_census_two_agents_on_one_host_agree_on_gloo():
    hostile = seats(("h200", 2, 2)) + seats(("h200", 2, 2))  # two agents, one host
    out = _run_census(4, lambda r: hostile[r], timeout=20)
    verdicts = [decide("auto", out[r], r) for r in range(4)]
    assert {v.backend for v in verdicts} == {"gloo"}
    assert [v.host_index for v in verdicts] == [0, 1, 2, 3]


def test_census_names_a_rank_that_never_arrives_within_the_timeout():
    out = _run_census(3, lambda r: Seat("x", "b", 0), timeout=1.5, ranks=[0, 2])
    for r in (0, 2):
        assert isinstance(out[r], PeerError)
        assert "never reached by rank 1 (no seat in the census)" in str(out[r])
        assert "rank 0" not in str(out[r]).split("never reached by")[1]


@pytest.fixture
def two_fake_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_nccl_under_torchrun_with_more_local_ranks_than_gpus_exits_2(
    two_fake_gpus, monkeypatch, capsys
):
    for var, value in {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cli.main(["verify", "--backend", "nccl", "--preset", "default"]) == 2
    err = capsys.readouterr().err
    assert "--backend nccl needs a GPU per rank: local world size 4, 2 GPUs visible" in err
    assert "Traceback" not in err


def test_seat_counts_gpus_through_the_fakes(two_fake_gpus):
    assert backend_mod.my_seat().gpus == 2
