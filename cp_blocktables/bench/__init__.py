"""Benchmarks (`cp-blocktables bench ...`): figures as ratios measured in one run.

`kernels` times the core's kernels beside an empty kernel, a copy and the
plain-PyTorch rival (`torch_rival`); `harness` what a verify run costs per
rank; `plugin` what the pytest plugin adds to a multi-rank test.

Imports: the core, the harness and the plugin's rank pool. Light on import:
modules import torch only when they run.
"""
