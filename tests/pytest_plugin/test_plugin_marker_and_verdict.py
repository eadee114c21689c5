"""The multi-rank pytest plugin's parts that need no rank process: how a `ranks` marker
is read (and refused) and how every rank's outcome combines into one verdict. The runs
through pytest itself are in `test_pytest_plugin.py`.
"""

from __future__ import annotations

import pytest

from cp_blocktables.pytest_plugin import ranks_spec
from cp_blocktables.pytest_plugin.protocol import Outcome
from cp_blocktables.pytest_plugin.rank_report import verdict


class _MarkedItem:
    def __init__(self, mark) -> None:
        self._mark = mark.mark

    def get_closest_marker(self, name: str):
        return self._mark if name == "ranks" else None


@pytest.mark.parametrize(
    ("mark", "expected"),
    [
        pytest.param(pytest.mark.ranks(4), (4, "gloo", "cpu", 60.0), id="cpu-default"),
        pytest.param(
            pytest.mark.ranks(2, device="cuda"), (2, "nccl", "cuda", 60.0), id="cuda-nccl"
        ),
        pytest.param(
            pytest.mark.ranks(world_size=2, device="cuda", backend="gloo", timeout=5),
            (2, "gloo", "cuda", 5.0),
            id="cuda-gloo-keywords",
        ),
    ],
)
def test_marker_is_read(mark, expected):
    spec = ranks_spec(_MarkedItem(mark), default_timeout_s=60.0)
    assert (spec.world_size, spec.backend, spec.device, spec.timeout_s) == expected


@pytest.mark.parametrize(
    ("mark", "complaint"),
    [
        pytest.param(pytest.mark.ranks(), "one positional argument", id="no-size"),
        pytest.param(pytest.mark.ranks(0), "world size must be an int >= 1", id="zero"),
        pytest.param(pytest.mark.ranks(True), "world size must be an int", id="bool"),
        pytest.param(pytest.mark.ranks(2, 3), "one positional argument", id="two-sizes"),
        pytest.param(pytest.mark.ranks(2, device="tpu"), "device must be one of", id="device"),
        pytest.param(pytest.mark.ranks(2, backend="mpi"), "backend must be one of", id="mpi"),
        pytest.param(pytest.mark.ranks(2, backend="nccl"), "needs device='cuda'", id="nccl-cpu"),
        pytest.param(pytest.mark.ranks(2, timeout=0), "timeout must be a positive", id="t0"),
        pytest.param(pytest.mark.ranks(2, nodes=2), "unknown arguments ['nodes']", id="kw"),
    ],
)
def test_bad_marker_is_refused_by_name(mark, complaint):
    with pytest.raises(ValueError, match=complaint.replace("[", r"\[").replace("]", r"\]")):
        ranks_spec(_MarkedItem(mark), default_timeout_s=60.0)


def _outcomes(*statuses: str) -> list[Outcome]:
    return [Outcome(r, s, message=f"{s} on {r}") for r, s in enumerate(statuses)]


@pytest.mark.parametrize(
    ("statuses", "expected_status", "headline_part"),
    [
        pytest.param(("passed", "passed"), "passed", "", id="all-pass"),
        pytest.param(("skipped", "skipped"), "skipped", "skipped on 0", id="all-skip"),
        pytest.param(("xfailed", "xfailed"), "xfailed", "xfailed on", id="all-xfail"),
        pytest.param(("passed", "failed"), "failed", "failed on ranks [1]", id="one-fails"),
        pytest.param(("died", "stopped"), "failed", "failed on ranks [0]", id="one-dies"),
        pytest.param(("passed", "timeout"), "failed", "timed out after 3 s on ranks [1]", id="t"),
        pytest.param(
            ("passed", "skipped", "skipped"),
            "failed",
            "pytest.skip() on ranks [1, 2] only; ranks [0] ran the test",
            id="uneven-skip",
        ),
        pytest.param(("xfailed", "passed"), "failed", "pytest.xfail() on ranks [0]", id="xf"),
    ],
)
def test_rank_outcomes_combine_into_one_verdict(statuses, expected_status, headline_part):
    v = verdict(_outcomes(*statuses), timeout_s=3.0)
    assert v.status == expected_status
    assert headline_part in v.headline
