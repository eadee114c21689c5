"""Benchmarks (`cp-blocktables bench ...`): figures as ratios measured in one run.

`kernels` runs the kernel benchmark: `cases` (a step's reads, gathers, writes,
yardsticks) and `cases_features` (integrity checks, kernel block sizes) build
its rows, `timing` times them (CUDA-graph replay, back-to-back host calls),
`report` prints them and judges the goals; `upstream_rival` is the
upstream-style rival they are measured against and `torch_rival` a plain
PyTorch one; `host_path` measures our Python per call with launches stubbed.
`harness` measures what a verify run costs per rank (host against device
checks), `plugin` what the pytest plugin adds to a multi-rank test;
`cli_args` holds the `bench` actions.

Imports: the core, the harness and the plugin's rank pool. Light on import:
modules import torch only when they run.
"""
