"""`Comm`'s choice of each rank's device: which GPU, and whether it is named with an index."""

from __future__ import annotations

import pytest
import torch

from cp_blocktables.harness.backend import Placement
from cp_blocktables.harness.comm import Comm
from cp_blocktables.harness.group import RankEnv


def _comm(rank: int, backend: str, device: str, placement: Placement | None = None) -> Comm:
    comm = Comm(RankEnv(rank, 4, rank, 4, "127.0.0.1", 1), backend, 10.0, device)
    comm.placement = placement
    return comm


@pytest.fixture
def three_gpus(monkeypatch):
    """A host that reports three GPUs, and a record of every GPU made current."""
    made_current: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    return made_current


@pytest.mark.parametrize(
    ("rank", "backend", "device", "expected"),
    [
        pytest.param(0, "gloo", "cpu", "cpu", id="even-rank-cpu"),
        pytest.param(1, "gloo", "cpu", "cpu:0", id="odd-rank-cpu:0"),
        pytest.param(3, "gloo", "auto", "cpu:0", id="auto-without-census-is-the-cpu"),
        pytest.param(2, "nccl", "auto", "cuda:2", id="even-nccl-rank-indexed"),
        pytest.param(1, "nccl", "auto", "cuda", id="odd-nccl-rank-bare"),
        pytest.param(0, "gloo", "cuda", "cuda:0", id="even-gloo-rank-on-a-gpu"),
        pytest.param(3, "gloo", "cuda", "cuda", id="odd-gloo-rank-on-a-gpu-bare"),
    ],
)
def test_even_ranks_name_their_device_with_an_index_and_odd_ranks_without(
    three_gpus, rank, backend, device, expected
):
    assert _comm(rank, backend, device).device == torch.device(expected)


@pytest.mark.parametrize(
    ("rank", "backend", "device", "placement", "gpu"),
    [
        pytest.param(1, "nccl", "auto", None, 1, id="nccl-odd-rank-its-local-gpu"),
        pytest.param(2, "nccl", "auto", None, 2, id="nccl-even-rank-its-local-gpu"),
        pytest.param(3, "gloo", "cuda", None, 0, id="gloo-shares-round-robin"),
        pytest.param(
            1,
            "gloo",
            "auto",
            Placement("gloo", "h", 4, 5, 3, "fewer GPUs than ranks"),
            1,
            id="census-shares-by-host-index",
        ),
    ],
)
def test_the_rank_s_gpu_is_made_current_so_the_bare_cuda_means_it(
    three_gpus, rank, backend, device, placement, gpu
):
    comm = _comm(rank, backend, device, placement)
    comm._make_gpu_current()
    assert three_gpus == [gpu]
    if comm.device.index is not None:
        assert comm.device.index == gpu


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_a_rank_on_the_cpu_makes_no_gpu_current(three_gpus, device):
    _comm(1, "gloo", device)._make_gpu_current()
    assert three_gpus == []
