"""The kernel benchmark on CPU: a smoke run of the whole table, its JSON, its byte counts."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math

import numpy as np
import pytest
import torch

from cp_blocktables import BlockTablesConfig
from cp_blocktables.bench import cases
from cp_blocktables.bench import kernels as bench
from cp_blocktables.bench.report import Row, goals
from cp_blocktables.kernels import slot_mappings

READ_KINDS = {"compute_slot_mappings", "gather_block_tables"}
WRITE_KINDS = {"step writes (append + apply)", "append_block_ids", "apply_staged_writes"}
ALL_KINDS = READ_KINDS | WRITE_KINDS | {"launch_floor", "copy", "integrity_checks", "kernel_blocks"}
FUSED = "gather_and_compute_slot_mappings"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One quick CPU run: `(rows, printed text, parsed JSON)`."""
    path = tmp_path_factory.mktemp("bench") / "out.json"
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        rows = bench.run_kernel_bench("cpu", quick=True, json_path=str(path))
    return rows, text.getvalue(), json.loads(path.read_text())


def test_every_row_kind_is_measured(smoke):
    rows, _, _ = smoke
    kinds = {r["kind"] for r in rows}
    assert kinds - {FUSED} == ALL_KINDS
    slots = [r["params"] for r in rows if r["kind"] == "compute_slot_mappings"]
    assert {(p["groups"], p["cp_size"]) for p in slots} == {(1, 1), (1, 4), (4, 1), (4, 4)}
    masked = {r["params"].get("sliding_window") for r in rows if r["kind"] == "gather_block_tables"}
    assert masked == {None, False, True}


def test_rows_ran_agreed_and_have_sane_figures(smoke):
    rows, _, _ = smoke
    for r in rows:
        where = f"{r['kind']} {r['case']}"
        assert r["error"] is None, where
        assert r["cpu_figures"] is True, where
        assert math.isfinite(r["host_us"] or 0.0), where
        if r["kind"] == "launch_floor":
            assert r["bytes"] == 0 and r["floor_ratio"] == 1.0
            continue
        if r["kind"] in READ_KINDS | {FUSED}:
            assert r["device_us"] > 0 and r["rival_device_us"] > 0, where
            assert math.isclose(r["device_ratio"], r["device_us"] / r["rival_device_us"]), where
            assert math.isclose(r["host_ratio"], r["host_us"] / r["rival_host_us"]), where
            assert r["bytes"] > 0, where
            assert math.isclose(r["gbps"], r["bytes"] / r["device_us"] / 1e3), where
        if r["kind"] in WRITE_KINDS:
            assert r["host_us"] > 0 and r["rival_host_us"] > 0, where
            assert math.isclose(r["host_ratio"], r["host_us"] / r["rival_host_us"]), where
        if r["kind"] == "integrity_checks":
            assert r["device_us"] > 0 and r["extra"]["kernel_us"] > 0, where
        if r["kind"] == "kernel_blocks":  # same slots whichever K divides B (SPEC.md 8.1)
            base = r["extra"]["k_eq_b_device_us"]
            assert base > 0 and math.isclose(r["extra"]["ratio"], r["device_us"] / base), where
        if r["kind"] != "copy":
            assert r["agrees"] is True, f"ours and the rival disagree: {where}"


def test_a_failing_row_is_recorded_and_the_run_goes_on():
    rows = []
    cases.guarded(rows, Row("k", "bad", {}), lambda row: 1 / 0)
    cases.guarded(rows, Row("k", "good", {}), lambda row: setattr(row, "host_us", 1.0))
    assert [r.case for r in rows] == ["bad", "good"]
    assert rows[0].error.startswith("ZeroDivisionError") and rows[1].error is None
    verdicts = goals(rows)
    assert verdicts[-1]["status"] == "MISS" and "bad" in verdicts[-1]["figure"]


def test_only_measures_the_families_asked_for(capsys):
    rows = bench.run_kernel_bench("cpu", quick=True, json_path=None, only=["writes"])
    assert {r["kind"] for r in rows} == WRITE_KINDS | {"launch_floor", "copy"}
    capsys.readouterr()
    with pytest.raises(ValueError, match="unknown row families"):
        bench.run_kernel_bench("cpu", quick=True, json_path=None, only=["nope"])


def test_json_holds_meta_rows_and_goals(smoke):
    rows, _, data = smoke
    assert data["meta"]["cpu_figures"] is True
    assert data["meta"]["device"] == "cpu"
    assert data["meta"]["torch"] == torch.__version__
    assert [(r["kind"], r["case"]) for r in data["rows"]] == [(r["kind"], r["case"]) for r in rows]
    assert len(data["goals"]) == 7
    assert {g["status"] for g in data["goals"]} <= {"PASS", "MISS", "not measured"}


def test_table_is_printed_with_the_cpu_banner(smoke):
    rows, text, _ = smoke
    assert bench.CPU_BANNER in text
    assert "triton" in text and torch.__version__ in text
    for r in rows:
        assert r["case"] in text
    assert "goals" in text
    assert "slot mappings (and the fused read) by layout: by tile: T=16" in text


def test_slot_rows_say_which_layout_ran(smoke):
    """On CPU every read row has more request programs than the interpreter is allowed."""
    rows, _, _ = smoke
    for r in rows:
        if r["kind"] in {"compute_slot_mappings", FUSED}:
            assert r["params"]["slot_layout"] == "tile", r["case"]


@pytest.mark.parametrize(
    ("tokens", "layout"),
    [
        pytest.param(256, "request", id="decode-256"),
        pytest.param(8192, "request", id="mixed-8K"),
        pytest.param(65536, "tile", id="mixed-64K"),
    ],
)
@pytest.mark.parametrize("groups", [1, 4], ids=["G1", "G4"])
def test_gpu_rows_at_small_batches_run_by_request(tokens, layout, groups):
    """The CUDA plan's decode and mixed-8K rows measure the request layout (issue 13's
    small batches); 64K tokens and more, the tile layout."""
    rows_, _, _ = cases.batch(tokens, np.random.default_rng(0))
    bt = cases.BlockTables(list(cases.BLOCK_SIZES[:groups]), cases.MAX_REQS, tokens,
                           [4] * groups, "cpu")  # fmt: skip
    launch = slot_mappings._SlotLaunch(False, groups, tokens, bt._layout, 1, cases.MAX_REQS)
    assert launch.pick(len(rows_), tokens)[1]["BY_REQUEST"] is (layout == "request")


@pytest.mark.parametrize(
    "cp_size, cp_rank, table_reads",
    [
        # Positions 0..5 of block size 4: columns 0 and 1, two entries.
        pytest.param(1, 0, 2, id="cp1"),
        # Virtual blocks of 8: all six positions in column 0; rank 1 owns 1, 3, 5.
        pytest.param(2, 1, 1, id="cp2-owner"),
    ],
)
def test_slot_bytes_count_each_distinct_table_entry_once(cp_size, cp_rank, table_reads):
    cfg = BlockTablesConfig([4], 8, 16, [4], cp_size=cp_size, cp_rank=cp_rank)
    idx = torch.tensor([3], dtype=torch.int32)
    lens = torch.tensor([6])
    pos = torch.arange(6, dtype=torch.int64)
    expected = 8 * 6 + 4 * 2 + 4 * 1 + 8 * 16 + 4 * table_reads
    assert bench._slot_bytes(cfg, idx, lens, pos) == expected


def test_options_parse_as_the_cli_passes_them():
    parser = argparse.ArgumentParser()
    bench.add_bench_kernels_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--json", "x.json", "--quick"])
    assert (args.device, args.json_path, args.quick) == ("cpu", "x.json", True)
    defaults = parser.parse_args([])
    assert (defaults.device, defaults.json_path, defaults.quick) == ("auto", None, False)
    assert defaults.only is None
    assert parser.parse_args(["--only", "reads", "writes"]).only == ["reads", "writes"]


def test_cuda_without_a_gpu_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = argparse.Namespace(device="cuda", json_path=None, quick=True, only=None)
    assert bench.bench_kernels_command(args) == 2
    assert "no CUDA device" in capsys.readouterr().err
