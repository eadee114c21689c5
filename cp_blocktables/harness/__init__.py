"""The coverage harness (SPEC.md sections 6 and 7): `cp-blocktables verify`.

One process per CP rank builds the implementation under test, runs a seeded
multi-step workload, all-gathers every step's outputs and checks them against
the independent reference. Modules, in the order a run meets them:

* the command line and the ranks: `cli_args` (arguments, options), `spawn`
  (ranks forked locally), `group` (where a rank is, the rendezvous),
  `backend` (gloo or NCCL), `comm` (process groups, collectives naming absent
  peers), `dist` (one import for those), `soak` (round after round with fresh
  seeds);
* what runs: `presets` (the registry: `PRESETS`, `SWEEP`, `resolve`) with
  `preset_spec` (what a preset is), `preset_catalog`, `preset_groups` and
  `preset_span` (the sweep's presets; zero to six groups in the second, past
  2**31 in the third) and `preset_extras` (benchmark and mutation presets);
  `impl_loader` (an implementation named `module:attribute`), `features`
  (what it accepts);
* the workload: `workload` (the steps and their loop), `lifecycle` (requests,
  blocks), `step_writes` (the calls a step's appends become), `batch_shape` (a
  step's batch), `corner_counts`;
* one rank: `runner` drives it; `executor` runs one step, with
  `executor_paths` (optional arguments, profiling writes),
  `executor_checks` (what one rank can check alone) and `guarded` (inputs
  that end at an unreadable page on the CPU, so a read past one faults);
* the checks: `checks` (per CP group) with `checks_slots`, `checks_tables`,
  `checks_kv`, and `violations`; the calls that must fail, on instances of
  their own: `probes` (construction, check 9), `integrity_probes` (check 10)
  and `wake_probe` with `sleep` (check 11);
* the verdict: `report` with `report_formats` (table, JSON, JUnit) and
  `report_plot`.

Imports: the core (`cp_blocktables.contract`, `.reference`, and, as the
default implementation, `.block_tables`), the command line's shared helpers
(`cp_blocktables.cli_base`) and nothing else of the package.
"""
