"""What a training step minimises: an objective, given the model and one micro-batch's tensors.

The step, its CUDA graph and DDP's module (train/distributed.py, LossModule) reach the model through
the run's objective and never call its loss themselves, so another objective trains through the same
step, graphs and ranks. A preference loss asks the model for each document's summed label log-probs
(QLoRAModel.document_log_probs), and for the reference model's under `with model.adapter_off():`, a
switch held on the device that a captured graph replays both ways. The step divides what an objective returns by the trained tokens of the
whole accumulated batch. A graphed run captures the objective, which must then keep its shapes fixed
and never read a device value back to the host.
"""

from __future__ import annotations

from typing import Protocol

import torch

from qlora_cli.model.decoder import QLoRAModel


class Objective(Protocol):
    def __call__(
        self,
        model: QLoRAModel,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor | None,
        doc_ids: torch.Tensor | None,
        real_tokens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's summed loss, fp32 0-d; its trained-token count, which evaluation divides by).
        real_tokens: False at padding, where the model's loss needs to know it (Run.real_tokens), else None."""


def causal_lm(
    model: QLoRAModel, input_ids, labels, position_ids, doc_ids, real_tokens
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy summed over the trained labels, plus a MoE's load-balancing loss where
    its config asks for it (QLoRAModel.loss): what `qlora train` trains."""
    return model.loss(input_ids, labels, position_ids, doc_ids, real_tokens)
