"""The multi-rank pytest plugin: `@pytest.mark.ranks(N)` runs a test body on N ranks.

Registered as `cp_blocktables.pytest_plugin` (the `pytest11` entry point and
`-p cp_blocktables.pytest_plugin`). `plugin` holds the hooks and fixtures,
`pool` the reusable rank processes, `pool_runner` the pooled mode (a test
body sent to each rank of a pool), `worker` what one rank process does,
`protocol` what the pytest process and the ranks exchange, `spmd` the mode
where torchrun launches the ranks, `rank_report` the verdict and report over
every rank's outcome.

Imports: the core (a rank builds `BlockTables` for `block_tables_factory`) and
the plugin benchmark's fixture (`cp_blocktables.bench.plugin`, re-exported as
`bench_plugin_overhead`); nothing of the harness or drills. Registering the
plugin must not import torch.
"""

from .plugin import (
    RanksSpec,
    bench_plugin_overhead,
    block_tables_factory,
    device,
    pytest_addoption,
    pytest_configure,
    pytest_itemcollected,
    pytest_pyfunc_call,
    pytest_report_header,
    pytest_runtest_makereport,
    pytest_runtest_setup,
    pytest_unconfigure,
    rank,
    ranks_spec,
    world_size,
)

__all__ = [
    "RanksSpec",
    "bench_plugin_overhead",
    "block_tables_factory",
    "device",
    "pytest_addoption",
    "pytest_configure",
    "pytest_itemcollected",
    "pytest_pyfunc_call",
    "pytest_report_header",
    "pytest_runtest_makereport",
    "pytest_runtest_setup",
    "pytest_unconfigure",
    "rank",
    "ranks_spec",
    "world_size",
]
