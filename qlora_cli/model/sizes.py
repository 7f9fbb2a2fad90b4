"""The bytes of one value in each dtype the memory planner counts in, for the planner and the mixers."""

BF16 = 2
FP32 = 4
