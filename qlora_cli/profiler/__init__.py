"""Per-op timing of a training step, forward and backward, and the `qlora profile` command.
Imports qlora_kernels and every qlora_cli package below the CLI except export and generate.

Its modules are in layers, each importing only those above it in this list:
  timing.py       the one timing helper (CUDA events, graph replay, wall clock), shared with benchmarks/
  work.py         FLOPs and bytes per op, from the call's named arguments
  lora.py         LoRA's share of the fused rows, measured apart from the step
  recorder.py     OpProfiler: the step's timeline, resolved into rows
  calibration.py  the roofline, measured on the spot
  report.py       the numbers and the table
  command.py      `qlora profile` and `qlora train --profile`, driving a run through qlora_cli/train/step.py

The op identities and the `timed`/`region` hooks the model calls sit at the bottom (qlora_cli/core/ops.py,
qlora_cli/core/profiling.py), so the model never loads this package.
"""
