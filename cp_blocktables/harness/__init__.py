"""The coverage harness (SPEC.md sections 6 and 7): `cp-blocktables verify`.

One process per CP rank builds the implementation under test, runs a seeded
multi-step workload (`workload`, shaped by `presets`), all-gathers every step's
outputs (`dist`) and checks them against the independent reference
(`checks`); `runner` drives a rank, `report` renders the verdict and
`impl_loader` finds an implementation named `module:attribute`.

Imports: the core (`cp_blocktables.contract`, `.reference`, and, as the
default implementation, `.block_tables`) and nothing else of the package.
"""
