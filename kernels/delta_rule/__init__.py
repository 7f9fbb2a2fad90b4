"""Qwen3.5's Gated DeltaNet recurrence (the gated delta rule), chunked in Triton, by stage.

Imports qlora_kernels' _dispatch and _layout only. Per value head the state S [Dk, Dv] evolves token
by token as in transformers' torch_recurrent_gated_delta_rule: S <- exp(g) S; S <- S + k (beta (v -
S^T k))^T; o = S^T (scale q). The Triton path splits the row into chunks of 64 tokens: inside a chunk
the updates are solved at once as a unit lower-triangular system (the UT/WY form), and only the state
crosses chunks, in fp32. Packed documents (doc_ids) reset the state exactly: every within-chunk
quantity is masked to pairs of tokens of one document and the log-decay is summed per document,
never offset by a huge number.

The stages, each a module: reference (token by token), tables (the per-chunk tables), scan (the
state pass, with the output or storing the states, and its reverse), backward (the chunk-parallel
gradients), step (one decode token), function (the autograd Function and the public calls); common
holds what they share.
"""

from .common import CHUNK
from .function import GatedDeltaRuleFunction, gated_delta_rule, gated_delta_rule_step
from .reference import gated_delta_rule_reference, gated_delta_rule_step_reference

__all__ = [
    "CHUNK",
    "GatedDeltaRuleFunction",
    "gated_delta_rule",
    "gated_delta_rule_reference",
    "gated_delta_rule_step",
    "gated_delta_rule_step_reference",
]
