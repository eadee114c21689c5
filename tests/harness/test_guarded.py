"""Guarded inputs: equal to the original, and a read one entry past the end faults."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
import torch
from harness_proc import ROOT, child_env, leftover_processes, run_cli

from cp_blocktables.harness import guarded
from cp_blocktables.harness.guarded import PAGE, GuardedPool, guard, guarded_copy

pytestmark = pytest.mark.skipif(not guarded.SUPPORTED, reason="needs Linux mprotect")

INPUTS = [
    pytest.param(torch.tensor([0, 3, 5], dtype=torch.int32), id="query_start_loc-int32"),
    pytest.param(torch.tensor([1, 0, -1], dtype=torch.int32), id="idx_mapping-with-dummy"),
    pytest.param(torch.arange(1000, dtype=torch.int64), id="positions-int64"),
    pytest.param(torch.arange(PAGE // 8, dtype=torch.int64), id="exactly-one-page"),
    pytest.param(torch.arange(PAGE // 8 + 1, dtype=torch.int64), id="one-entry-past-a-page"),
    pytest.param(torch.tensor([2**63 + 5, 7], dtype=torch.uint64), id="out_ptrs-uint64"),
    pytest.param(torch.arange(12, dtype=torch.int32)[::2], id="strided-source"),
]


def _ends_at_page(t: torch.Tensor) -> bool:
    return (t.data_ptr() + t.numel() * t.element_size()) % PAGE == 0


@pytest.mark.parametrize("t", INPUTS)
@pytest.mark.parametrize("how", ["fresh", "pooled"])
def test_guarded_copy_equals_the_input_and_ends_at_a_page(t, how):
    pool = GuardedPool("cpu")
    g = guarded_copy(t) if how == "fresh" else pool.copy(t)
    assert (g.dtype, g.shape, g.is_contiguous()) == (t.dtype, t.shape, True)
    assert g.tolist() == t.tolist()
    assert g.data_ptr() != t.data_ptr() and _ends_at_page(g)


def test_pool_reuses_storage_after_release_and_keeps_it_while_in_use():
    pool = GuardedPool("cpu")
    a = pool.copy(torch.tensor([1, 2, 3], dtype=torch.int32))
    b = pool.copy(torch.tensor([4, 5, 6], dtype=torch.int32))
    assert a.data_ptr() != b.data_ptr() and a.tolist() == [1, 2, 3]
    pool.release()
    c = pool.copy(torch.tensor([7, 8, 9], dtype=torch.int32))
    assert c.data_ptr() in (a.data_ptr(), b.data_ptr()) and c.tolist() == [7, 8, 9]


@pytest.mark.parametrize(
    ("device", "t"),
    [
        pytest.param("cuda", torch.tensor([1, 2]), id="cuda-rank"),
        pytest.param("cpu", torch.zeros(0, dtype=torch.int32), id="empty"),
        pytest.param("cpu", None, id="absent-num_computed_tokens"),
    ],
)
def test_what_is_handed_over_as_it_is(device, t):
    assert GuardedPool(device).copy(t) is t
    if t is not None and device == "cpu":
        assert guard(t) is t


_READ_PAST = textwrap.dedent(
    """
    import ctypes, sys, torch
    from cp_blocktables.harness.guarded import GuardedPool, guard
    t = torch.arange(int(sys.argv[1]), dtype=torch.int32)
    g = guard(t) if sys.argv[2] == "fresh" else GuardedPool("cpu").copy(t)
    end = g.data_ptr() + g.numel() * g.element_size()
    ctypes.string_at(end - 4, 4)  # the last entry: readable
    print("last read", flush=True)
    ctypes.string_at(end, 4)  # one entry past it
    print("read past the end")
    """
)


@pytest.mark.parametrize("n", [1, 3, 1024, 1025], ids=lambda n: f"{n}-entries")
@pytest.mark.parametrize("how", ["fresh", "pooled"])
def test_a_read_one_entry_past_a_guarded_copy_faults(n, how):
    """In a child process: the fault kills it, not pytest."""
    proc = subprocess.run(
        [sys.executable, "-c", _READ_PAST, str(n), how],
        capture_output=True, text=True, timeout=120, cwd=ROOT, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == -11, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[0] == "last read" and "past the end" not in proc.stdout


@pytest.mark.multirank
def test_the_default_sweep_fails_an_implementation_that_reads_past_query_start_loc():
    """`OursReadsPastQueryStartLoc` computes every result right; only the guarded inputs
    catch its read. Every rank dies of SIGSEGV, named by the spawner, none is left behind."""
    env = child_env()
    t0 = time.monotonic()
    proc = run_cli(
        ["verify", "--world-size", "8", "--device", "cpu", "--quiet", "--no-progress",
         "--impl", "tests.wrong_impls.faulty:OursReadsPastQueryStartLoc"],
        timeout=600, env=env,
    )  # fmt: skip
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "ended abnormally (signal 11, SIGSEGV" in out and "a read past an input's end" in out
    assert "faulty.py" in out  # faulthandler names the line that read
    assert took < 90
    time.sleep(0.5)
    assert leftover_processes(env["CP_BLOCKTABLES_TEST_MARKER"]) == []


@pytest.mark.multirank
def test_a_write_past_a_caller_owned_out_kills_the_rank_and_fails_the_run():
    """`OursWritesPastSlotOut` leaves every checked value right; the guarded `out` turns
    its stray store into SIGSEGV on the ranks whose step passed an `out`."""
    proc = run_cli(
        ["verify", "--world-size", "2", "--preset", "cp2-i1", "--device", "cpu", "--quiet",
         "--no-progress", "--impl", "tests.wrong_impls.faulty:OursWritesPastSlotOut"],
        timeout=300,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "SIGSEGV" in out and "a write past an output's" in out
