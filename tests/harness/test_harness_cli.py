"""`cp-blocktables verify` argument handling: bad usage is exit 2 with a message, no traceback."""

from __future__ import annotations

import pytest
import torch

from cp_blocktables import cli
from cp_blocktables.harness import presets
from cp_blocktables.harness.backend import choose_backend
from cp_blocktables.harness.group import RankEnv
from cp_blocktables.harness.impl_loader import ImplSpecError, load_impl
from cp_blocktables.harness.options import VerifyOptions, plan


@pytest.fixture(autouse=True)
def _no_torchrun_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--impl", "no_colon_here"], "expected MODULE:ATTR"),
        (["--impl", "no_such_module_xyz:Thing"], "cannot import module 'no_such_module_xyz'"),
        (["--impl", "cp_blocktables:NoSuchClass"], "has no attribute 'NoSuchClass'"),
        (["--impl", "cp_blocktables:PAD_SLOT_ID"], "is a int, not a class"),
        (["--impl", "missing/file.py:X"], "no such file"),
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--world-size", "3", "--preset", "default"], "more than world size 3"),
        (["--world-size", "2", "--cp-size", "4"], "no preset can run with world size 2"),
        (["--backend", "nccl"], "needs torchrun"),
    ],
    ids=[
        "no-colon",
        "no-module",
        "no-attr",
        "not-class",
        "no-file",
        "preset",
        "cp-size",
        "override",
        "nccl",
    ],
)
def test_bad_usage_exits_2_with_a_message(args, message, capsys):
    assert cli.main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [["--world-size", "0"], ["--timeout", "-1"], ["--steps", "x"]])
def test_malformed_numbers_are_argparse_errors(args):
    with pytest.raises(SystemExit) as exc:
        cli.main(["verify", *args])
    assert exc.value.code == 2


def test_malformed_torchrun_environment_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["verify"]) == 2
    assert "malformed torchrun environment" in capsys.readouterr().err


def test_list_presets(capsys):
    assert cli.main(["verify", "--list-presets"]) == 0
    out = capsys.readouterr().out
    for name in ("default", "cp1-window", "cp8-large-ids", "sweep"):
        assert name in out


def test_subcommands_are_registered():
    assert {"verify", "bench"} <= set(cli.SUBCOMMANDS)
    assert "harness" in cli.BENCH_ACTIONS
    args = cli.build_parser().parse_args(["bench", "harness", "--no-big"])
    assert args.action == "harness" and args.no_big


def test_sweep_skips_presets_the_world_cannot_hold():
    opts = VerifyOptions(impls=["cp_blocktables:BlockTables"], presets=["sweep"])
    chosen, skipped = plan(opts, 4)
    # cp 3: one rank idle; cp 8: skipped
    assert [p.cp_size for p in chosen] == [1, 2, 2, 2, 4, 4, 3, 4, 1, 4, 2, 2, 1, 2, 3]
    assert [s.split()[1] for s in skipped] == ["cp8-large-ids", "cp8-span-2-31"]  # cp 8
    assert len(plan(opts, 8)[0]) == len(presets.SWEEP)


def test_impl_from_a_file_path(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("class Mine:\n    pass\n")
    assert load_impl(f"{f}:Mine").__name__ == "Mine"
    with pytest.raises(ImplSpecError, match="raised ZeroDivisionError"):
        bad = tmp_path / "bad.py"
        bad.write_text("1 / 0\n")
        load_impl(f"{bad}:X")


def test_rank_environment_parsing():
    assert RankEnv.from_environ({}) is None
    env = RankEnv.from_environ(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
        }
    )
    assert env == RankEnv(3, 8, 1, 4, "10.0.0.1", 1234)
    # auto is settled by the census of every rank when the group forms (test_backend_choice)
    assert choose_backend("auto", env) == "auto"
    assert choose_backend("nccl", env) == "nccl"
    assert choose_backend("gloo", env) == "gloo"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--device", "cpu", "--backend", "nccl"], "nccl needs", id="nccl-on-cpu"),
        pytest.param(
            ["--device", "cuda"],
            "no CUDA device",
            id="cuda-without-gpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present"),
        ),
    ],
)
def test_device_usage_errors(argv, message, capsys):
    assert cli.main(["verify", *argv]) == 2
    assert message in capsys.readouterr().err
