"""Per-op timing of a training step, forward and backward, in layers; each imports only those below.

  ops.py          the op identities (one enum), and how rows group
  hooks.py        `timed` and `region`, which the model and the step call; imports nothing of ours
  timing.py       the one timing helper (CUDA events, graph replay, wall clock), shared with benchmarks/
  work.py         FLOPs and bytes per op, from the call's named arguments
  lora.py         LoRA's share of the fused rows, measured apart from the step
  recorder.py     OpProfiler: the step's timeline, resolved into rows
  calibration.py  the roofline, measured on the spot
  report.py       the numbers and the table
  command.py      `qlora profile` and `qlora train --profile`, driving a run through qlora_cli/step.py

This file imports nothing: the model imports hooks.py without loading the layers above it.
"""
