"""lm_head projection fused with cross-entropy, chunked over tokens.

Qwen's vocabulary is 152k, so [tokens x vocab] logits would dwarf everything else a step keeps.
Rows are processed a chunk at a time: one cuBLAS GEMM gives the chunk's logits, one Triton kernel
turns them into per-row losses and, in place, into d loss / d logits, and a second GEMM turns that
into d loss / d hidden for the chunk. The gradient is therefore complete when forward returns, and
backward only scales it by the incoming gradient. Only one chunk of logits exists at a time.

Precision: the logits buffer has the dtype of `hidden` (bf16 on GPU, as HF's lm_head produces
them); the GEMMs accumulate in fp32, and the logsumexp, loss and softmax math run in fp32.

The same per-row losses, negated and summed per document of a packed row, are the documents' label
log-probs that a preference loss compares (linear_document_logprobs).
"""

import torch
import torch.nn.functional as F

from qlora_kernels._dispatch import TRITON_AVAILABLE, use_triton
from qlora_kernels._layout import documents_per_token

if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

LOGITS_CHUNK_BYTES = 256 * 1024 * 1024
BLOCK_V = 4096


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token loss and trained-token count, in fp32 with the full logits materialized."""
    logits = hidden.float() @ weight.float().T
    loss_sum = F.cross_entropy(logits, labels, reduction="sum", ignore_index=ignore_index)
    return loss_sum, (labels != ignore_index).sum()


def linear_token_logprobs_reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100
) -> torch.Tensor:
    """Each row's label log-prob in fp32 (0 where the label is ignored), from the full logits."""
    logits = hidden.float() @ weight.float().T
    trained = labels != ignore_index
    logprobs = F.log_softmax(logits, dim=-1).gather(1, labels.where(trained, 0)[:, None]).squeeze(1)
    return logprobs.where(trained, 0.0)


def document_sums(token_values: torch.Tensor, documents: torch.Tensor) -> torch.Tensor:
    """[B, T] per-token values summed per document: [b, d] is row b's document d (counted from 0
    along the row, as kernels._layout numbers them), 0 past the row's last document.

    T columns hold any row's documents, so the shape never depends on the data: no host read, and a
    CUDA graph can capture it."""
    sums = torch.zeros(token_values.shape, dtype=token_values.dtype, device=token_values.device)
    return sums.scatter_add(1, documents.long(), token_values)


def linear_document_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    ignore_index: int = -100,
) -> torch.Tensor:
    """linear_document_logprobs from the full logits, in fp32."""
    token_logprobs = linear_token_logprobs_reference(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), ignore_index=ignore_index
    )
    return document_sums(token_logprobs.view(labels.shape), documents_per_token(doc_ids, hidden))


# Defined only where triton is installed; without it use_triton() is False and the references run.
if TRITON_AVAILABLE:

    @triton.jit
    def _cross_entropy_rows_kernel(
        logits_ptr,
        labels_ptr,
        row_loss_ptr,
        stride_row,
        ignore_index,
        N_VOCAB: tl.constexpr,
        BLOCK_V: tl.constexpr,
        WRITE_GRAD: tl.constexpr,
        SKIP_IGNORED: tl.constexpr,
    ):
        """One program per row: online logsumexp over the vocabulary, then softmax - onehot in place.

        The vocabulary size is a compile-time constant: it is fixed per model, and Triton's interpreter
        cannot loop to a runtime bound under numpy 2.4. With SKIP_IGNORED an ignored row's logits are
        neither read nor written (they were never computed: see _trained_rows_first); its loss is 0.
        """
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * stride_row
        label = tl.load(labels_ptr + row)
        if SKIP_IGNORED & (label == ignore_index):
            tl.store(row_loss_ptr + row, 0.0)
            return
        offsets = tl.arange(0, BLOCK_V)

        running_max = float("-inf")
        running_sum = 0.0
        label_logit = 0.0
        for start in range(0, N_VOCAB, BLOCK_V):
            cols = start + offsets
            x = tl.load(row_ptr + cols, mask=cols < N_VOCAB, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, axis=0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
            running_max = new_max
            label_logit += tl.sum(tl.where(cols == label, x, 0.0), axis=0)
        logsumexp = running_max + tl.log(running_sum)

        trained = label != ignore_index
        tl.store(row_loss_ptr + row, tl.where(trained, logsumexp - label_logit, 0.0))

        if WRITE_GRAD:
            keep = trained.to(tl.float32)
            for start in range(0, N_VOCAB, BLOCK_V):
                cols = start + offsets
                in_vocab = cols < N_VOCAB
                x = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
                grad = (tl.exp(x - logsumexp) - tl.where(cols == label, 1.0, 0.0)) * keep
                tl.store(row_ptr + cols, grad.to(logits_ptr.dtype.element_ty), mask=in_vocab)


def _check_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or labels.dim() != 1:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], labels [N]; got {tuple(hidden.shape)}, "
            f"{tuple(weight.shape)}, {tuple(labels.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != labels.shape[0]:
        raise ValueError(
            f"shapes do not line up: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    if labels.dtype != torch.int64:
        raise ValueError(f"labels must be int64, got {labels.dtype}")
    if hidden.device != weight.device or hidden.device != labels.device:
        raise ValueError(
            f"hidden, weight and labels must be on one device; got {hidden.device}, {weight.device}, "
            f"{labels.device}"
        )
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "linear_cross_entropy computes no gradient for weight (the lm_head is frozen); "
            "call weight.requires_grad_(False) or pass weight.detach()"
        )
    if not (labels.is_cuda and torch.cuda.is_current_stream_capturing()):
        check_labels_in_vocab(labels, weight.shape[0], ignore_index)


def check_labels_in_vocab(labels: torch.Tensor, n_vocab: int, ignore_index: int) -> None:
    """Out-of-range labels would silently train towards nothing in the kernel, so refuse them.

    On the GPU this reads a flag back to the host, which a CUDA graph capture cannot; code that
    captures the loss (qlora_cli.train.graphs) calls this on the labels before it copies them in.
    """
    out_of_vocab = (labels != ignore_index) & ((labels < 0) | (labels >= n_vocab))
    if bool(out_of_vocab.any()):
        bad = labels[out_of_vocab][0].item()
        raise ValueError(f"label {bad} is outside the vocabulary [0, {n_vocab}) and is not {ignore_index}")


def default_chunk_size(n_rows: int, n_vocab: int, element_size: int) -> int:
    """Rows per chunk so one chunk of logits takes about LOGITS_CHUNK_BYTES."""
    rows = max(1, LOGITS_CHUNK_BYTES // (n_vocab * element_size))
    if rows >= 128:
        rows -= rows % 128
    return max(1, min(rows, n_rows))


def _cross_entropy_rows(
    logits: torch.Tensor,
    labels: torch.Tensor,
    row_loss: torch.Tensor,
    ignore_index: int,
    write_grad: bool,
    skip_ignored: bool = False,
) -> None:
    """Per-row losses into row_loss; with write_grad, logits become softmax - onehot (0 if ignored, or
    left as they are with skip_ignored)."""
    n_rows, n_vocab = logits.shape
    if n_rows == 0:
        return
    if logits.stride(1) != 1 or not labels.is_contiguous() or not row_loss.is_contiguous():
        raise ValueError("logits rows, labels and row_loss must be contiguous")
    block_v = min(BLOCK_V, triton.next_power_of_2(n_vocab))
    _cross_entropy_rows_kernel[(n_rows,)](
        logits,
        labels,
        row_loss,
        logits.stride(0),
        ignore_index,
        N_VOCAB=n_vocab,
        BLOCK_V=block_v,
        WRITE_GRAD=write_grad,
        SKIP_IGNORED=skip_ignored,
        num_warps=8,
    )


def linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None,
    ignore_index: int,
    needs_grad: bool,
    trained_rows_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row losses in fp32 and, if needs_grad, each row's d loss / d hidden, one chunk of rows at a
    time (a row's gradient depends on its own loss only). trained_rows_only: the GEMMs skip the rows
    whose label is ignored (_trained_rows_first), where torch's grouped GEMM takes these tensors."""
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"hidden and weight must share a float dtype; got {hidden.dtype}, {weight.dtype}")
    n_rows, n_vocab = hidden.shape[0], weight.shape[0]
    if chunk_size is None:
        chunk_size = default_chunk_size(n_rows, n_vocab, hidden.element_size())
    elif chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if trained_rows_only and _grouped_gemm_takes(hidden, weight):
        return _trained_rows_first(hidden, weight, labels, chunk_size, ignore_index, needs_grad)

    labels = labels.contiguous()
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if needs_grad else None
    logits_buffer = torch.empty(min(chunk_size, n_rows), n_vocab, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, chunk_size):
        end = min(start + chunk_size, n_rows)
        logits = logits_buffer[: end - start]
        torch.mm(hidden[start:end], weight.T, out=logits)
        _cross_entropy_rows(logits, labels[start:end], row_loss[start:end], ignore_index, needs_grad)
        if needs_grad:
            torch.mm(logits, weight, out=grad_hidden[start:end])
    return row_loss, grad_hidden


def _grouped_gemm_takes(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch's grouped GEMM is there (recent torch) and takes these: on the GPU bf16 only, and rows of
    16 bytes (a vocabulary and hidden size that are multiples of 8)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if hidden.device.type == "cpu":
        return True
    return hidden.dtype == torch.bfloat16 and weight.shape[0] % 8 == 0 and weight.shape[1] % 8 == 0


def _trained_rows_first(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
    ignore_index: int,
    needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """linear_cross_entropy_forward on the trained rows alone: a prompt masked out of the loss (most of
    an SFT row) costs the lm_head's two GEMMs nothing. The rows are put trained-first on the GPU, and
    each chunk's GEMMs are grouped GEMMs of one group whose row count, the chunk's trained rows, is a
    device tensor: no host read, so a CUDA graph replays it for any mix of rows. The rows past that
    count get no logits and no gradient from the GEMMs; their gradient is set to 0. Rows are gathered
    and their gradients scattered a chunk at a time: no sorted copy of the whole hidden state."""
    n_rows = hidden.shape[0]
    ignored = labels == ignore_index
    order = torch.argsort(ignored.to(torch.int8), stable=True)
    trained = (~ignored).sum(dtype=torch.int32).view(1)
    sorted_labels = labels.index_select(0, order)
    sorted_loss = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if needs_grad else None
    for start in range(0, n_rows, chunk_size):
        end = min(start + chunk_size, n_rows)
        rows, counted = order[start:end], (trained - start).clamp(0, end - start)
        logits = torch._grouped_mm(hidden.index_select(0, rows), weight.T[None], offs=counted)
        _cross_entropy_rows(
            logits,
            sorted_labels[start:end],
            sorted_loss[start:end],
            ignore_index,
            needs_grad,
            skip_ignored=True,
        )
        if needs_grad:
            chunk_grad = torch._grouped_mm(logits, weight[None], offs=counted)
            chunk_grad.masked_fill_(torch.arange(end - start, device=hidden.device)[:, None] >= counted, 0)
            grad_hidden.index_copy_(0, rows, chunk_grad)
        # The grouped GEMM takes no out=: without this the next chunk's logits are allocated while
        # this chunk's are still held, two chunks at once.
        del logits
    return torch.empty_like(sorted_loss).index_copy_(0, order, sorted_loss), grad_hidden


class LinearCrossEntropyFunction(torch.autograd.Function):
    """The gradient is computed in forward; backward scales it by d loss / d loss_sum."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index, trained_rows_only):
        row_loss, grad_hidden = linear_cross_entropy_forward(
            hidden,
            weight,
            labels,
            chunk_size,
            ignore_index,
            needs_grad=ctx.needs_input_grad[0],
            trained_rows_only=trained_rows_only,
        )
        ctx.save_for_backward(grad_hidden)
        return row_loss.sum()

    @staticmethod
    def backward(ctx, grad_loss_sum):
        (grad_hidden,) = ctx.saved_tensors
        grad_hidden = (grad_hidden.float() * grad_loss_sum).to(grad_hidden.dtype)
        return grad_hidden, None, None, None, None, None


class LinearTokenLogprobsFunction(torch.autograd.Function):
    """Each row's label log-prob, the negated row loss; its gradient is computed in forward, and
    backward weighs each row's by that row's incoming gradient."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, ignore_index):
        row_loss, grad_hidden = linear_cross_entropy_forward(
            hidden, weight, labels, chunk_size, ignore_index, needs_grad=ctx.needs_input_grad[0]
        )
        ctx.save_for_backward(grad_hidden)
        return -row_loss

    @staticmethod
    def backward(ctx, grad_logprobs):
        (grad_hidden,) = ctx.saved_tensors
        grad_hidden = (grad_hidden.float() * -grad_logprobs[:, None]).to(grad_hidden.dtype)
        return grad_hidden, None, None, None, None


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    trained_rows_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, n_tokens) of logits = hidden @ weight.T against labels; gradient reaches hidden only.

    loss_sum is summed, not averaged, so the caller can divide by the trained-token count of the
    whole accumulated batch. chunk_size is the number of rows whose logits exist at once (Triton path).
    trained_rows_only: the lm_head's GEMMs skip the ignored rows (for batches where many are), at the
    cost of sorting the rows first; the result is the same.
    """
    _check_inputs(hidden, weight, labels, ignore_index)
    if not use_triton(hidden):
        return linear_cross_entropy_reference(hidden, weight, labels, ignore_index=ignore_index)
    loss_sum = LinearCrossEntropyFunction.apply(
        hidden, weight, labels, chunk_size, ignore_index, trained_rows_only
    )
    return loss_sum, (labels != ignore_index).sum()


def linear_document_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    doc_ids: torch.Tensor | None,
    *,
    chunk_size: int | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """fp32 [B, T]: [b, d] is the sum of the label log-probs of row b's document d, logits being
    hidden @ weight.T; ignored labels add nothing, and columns past a row's last document are 0.

    hidden is [B, T, H] and labels [B, T]; doc_ids [B, T] delimit a packed row's documents as the
    attention kernels read them (None: each row is one document). What a preference loss compares
    (a policy's and a reference model's log-prob of each document); the gradient reaches hidden only,
    and no [tokens x vocab] logits exist on the Triton path.
    """
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"expected hidden [B, T, H] and labels [B, T]; got {tuple(hidden.shape)}, {tuple(labels.shape)}"
        )
    rows, row_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    _check_inputs(rows, weight, row_labels, ignore_index)
    if not use_triton(hidden):
        return linear_document_logprobs_reference(hidden, weight, labels, doc_ids, ignore_index=ignore_index)
    token_logprobs = LinearTokenLogprobsFunction.apply(rows, weight, row_labels, chunk_size, ignore_index)
    return document_sums(token_logprobs.view(labels.shape), documents_per_token(doc_ids, hidden))
