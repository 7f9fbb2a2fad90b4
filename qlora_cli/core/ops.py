"""The op identities: every row of the profile, named once for the model, the profiler and the tests.

A member is its row's name (a str), so it prints, compares and serialises as that name.
"""

from __future__ import annotations

from enum import Enum


class Op(str, Enum):
    # Timed in a decoder layer, forward (and recomputed in backward under checkpointing).
    RMSNORM_ATTN = "rmsnorm_attn"
    QKV_GEMM = "qkv_gemm"
    ROPE = "rope"
    ATTENTION = "attention"
    O_PROJ = "o_proj"
    RMSNORM_FFN = "rmsnorm_ffn"
    GATE_UP_GEMM = "gate_up_gemm"
    SILU = "silu"
    DOWN_GEMM = "down_gemm"
    # Qwen3.5's layers: its Gated DeltaNet layers' grouped input projection (in_proj_qkv/z/b/a), its
    # output projection, the conv, the delta rule and the gates have rows of their own (gates: the decay
    # and beta of the delta rule, the attention output gate, the gated RMSNorm).
    IN_PROJ = "in_proj"
    OUT_PROJ = "out_proj"
    CONV1D = "conv1d"
    DELTA_RULE = "delta_rule"
    GATES = "gates"
    # A mixture-of-experts MLP's: the router's softmax and top k, the copies sorted by expert, the
    # tokens spread to those rows and combined back, and the routed experts' grouped GEMMs, their
    # SwiGLU and their LoRA (a shared expert runs as the dense MLP's rows).
    ROUTER = "router"
    EXPERT_SORT = "expert_sort"
    EXPERT_ROWS = "expert_rows"
    EXPERT_GATE_UP = "expert_gate_up"
    EXPERT_SWIGLU = "expert_swiglu"
    EXPERT_DOWN = "expert_down"
    EXPERT_LORA = "expert_lora"
    # The backward rows of the layer's ops.
    DOWN_BWD = "down_bwd"
    SWIGLU_BWD = "swiglu_bwd"
    GATE_UP_BWD = "gate_up_bwd"
    O_PROJ_BWD = "o_proj_bwd"
    ATTN_BWD = "attn_bwd"
    ROPE_BWD = "rope_bwd"
    QKV_BWD = "qkv_bwd"
    NORM_BWD = "norm_bwd"
    CONV1D_BWD = "conv1d_bwd"
    DELTA_RULE_BWD = "delta_rule_bwd"
    GATES_BWD = "gates_bwd"
    IN_PROJ_BWD = "in_proj_bwd"
    OUT_PROJ_BWD = "out_proj_bwd"
    ROUTER_BWD = "router_bwd"
    EXPERT_ROWS_BWD = "expert_rows_bwd"
    EXPERT_GATE_UP_BWD = "expert_gate_up_bwd"
    EXPERT_SWIGLU_BWD = "expert_swiglu_bwd"
    EXPERT_DOWN_BWD = "expert_down_bwd"
    EXPERT_LORA_BWD = "expert_lora_bwd"
    # Outside the layers: ops the model times, regions the training step marks.
    EMBEDDING = "embedding"
    FINAL_NORM = "final_norm"
    LM_HEAD_LOSS = "lm_head_loss"
    OPTIMIZER = "optimizer"
    DATA = "data"
    # A scope, not a row: it brackets the backward pass, whose time belongs to the rows inside.
    BACKWARD = "backward"
    # LoRA's share of the projection and SwiGLU rows, measured apart from the step.
    LORA_FWD = "lora_fwd"
    LORA_BWD = "lora_bwd"

    def __str__(self) -> str:
        return self.value


# Forward row of each timed op -> the row its backward goes to. Rows named the same both ways
# (final_norm, lm_head_loss) hold forward and backward together.
BACKWARD_ROW = {
    Op.RMSNORM_ATTN: Op.NORM_BWD,
    Op.QKV_GEMM: Op.QKV_BWD,
    Op.ROPE: Op.ROPE_BWD,
    Op.ATTENTION: Op.ATTN_BWD,
    Op.O_PROJ: Op.O_PROJ_BWD,
    Op.RMSNORM_FFN: Op.NORM_BWD,
    Op.GATE_UP_GEMM: Op.GATE_UP_BWD,
    Op.SILU: Op.SWIGLU_BWD,
    Op.DOWN_GEMM: Op.DOWN_BWD,
    Op.IN_PROJ: Op.IN_PROJ_BWD,
    Op.OUT_PROJ: Op.OUT_PROJ_BWD,
    Op.CONV1D: Op.CONV1D_BWD,
    Op.DELTA_RULE: Op.DELTA_RULE_BWD,
    Op.GATES: Op.GATES_BWD,
    Op.ROUTER: Op.ROUTER_BWD,
    Op.EXPERT_ROWS: Op.EXPERT_ROWS_BWD,
    Op.EXPERT_GATE_UP: Op.EXPERT_GATE_UP_BWD,
    Op.EXPERT_SWIGLU: Op.EXPERT_SWIGLU_BWD,
    Op.EXPERT_DOWN: Op.EXPERT_DOWN_BWD,
    Op.EXPERT_LORA: Op.EXPERT_LORA_BWD,
    Op.FINAL_NORM: Op.FINAL_NORM,
    Op.LM_HEAD_LOSS: Op.LM_HEAD_LOSS,
}
# A mixture-of-experts MLP's forward rows, in the order it runs them.
MOE_FORWARD = (
    Op.ROUTER,
    Op.EXPERT_SORT,
    Op.EXPERT_ROWS,
    Op.EXPERT_GATE_UP,
    Op.EXPERT_SWIGLU,
    Op.EXPERT_DOWN,
    Op.EXPERT_LORA,
)
LAYER_FORWARD = (
    Op.RMSNORM_ATTN,
    Op.QKV_GEMM,
    Op.IN_PROJ,
    Op.CONV1D,
    Op.ROPE,
    Op.ATTENTION,
    Op.DELTA_RULE,
    Op.GATES,
    Op.O_PROJ,
    Op.OUT_PROJ,
    Op.RMSNORM_FFN,
    *MOE_FORWARD,
    Op.GATE_UP_GEMM,
    Op.SILU,
    Op.DOWN_GEMM,
)
LAYER_BACKWARD = (
    Op.DOWN_BWD,
    Op.SWIGLU_BWD,
    Op.GATE_UP_BWD,
    Op.EXPERT_LORA_BWD,
    Op.EXPERT_DOWN_BWD,
    Op.EXPERT_SWIGLU_BWD,
    Op.EXPERT_GATE_UP_BWD,
    Op.EXPERT_ROWS_BWD,
    Op.ROUTER_BWD,
    Op.O_PROJ_BWD,
    Op.OUT_PROJ_BWD,
    Op.GATES_BWD,
    Op.DELTA_RULE_BWD,
    Op.ATTN_BWD,
    Op.ROPE_BWD,
    Op.CONV1D_BWD,
    Op.QKV_BWD,
    Op.IN_PROJ_BWD,
    Op.NORM_BWD,
)
# Rows only Qwen3.5's layers fill: the table leaves them out of a run that never called them.
HYBRID_ROWS = (
    Op.IN_PROJ,
    Op.OUT_PROJ,
    Op.CONV1D,
    Op.DELTA_RULE,
    Op.GATES,
    Op.IN_PROJ_BWD,
    Op.OUT_PROJ_BWD,
    Op.CONV1D_BWD,
    Op.DELTA_RULE_BWD,
    Op.GATES_BWD,
)
# Rows only mixture-of-experts layers fill, left out in the same way (expert_lora: with LoRA on them).
MOE_ROWS = (*MOE_FORWARD, *(BACKWARD_ROW[op] for op in MOE_FORWARD if op in BACKWARD_ROW))
OUTSIDE_LAYERS = (Op.EMBEDDING, Op.FINAL_NORM, Op.LM_HEAD_LOSS, Op.OPTIMIZER, Op.DATA)
LORA_ROWS = (Op.LORA_FWD, Op.LORA_BWD)
# The rows whose FLOPs are the frozen projections' GEMMs: in FP8 under fp8: true.
FROZEN_GEMM_ROWS = (
    Op.QKV_GEMM,
    Op.IN_PROJ,
    Op.O_PROJ,
    Op.OUT_PROJ,
    Op.GATE_UP_GEMM,
    Op.DOWN_GEMM,
    Op.QKV_BWD,
    Op.IN_PROJ_BWD,
    Op.O_PROJ_BWD,
    Op.OUT_PROJ_BWD,
    Op.GATE_UP_BWD,
    Op.DOWN_BWD,
)
# Regions that only bracket other regions: their own time stays unattributed.
SCOPES = (Op.BACKWARD,)
