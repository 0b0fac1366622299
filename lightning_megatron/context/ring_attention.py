"""Causal ring attention over SDPA blocks: context parallelism without Transformer Engine.

Contract
--------
``ring_attention(q, k, v, group=..., scale=...)`` takes this rank's share of a causal self-attention, tensors in
SDPA's layout ``[batch, heads, local_seq, head_dim]`` (``k``/``v`` may have fewer heads: GQA), and returns this
rank's rows of the attention over the *whole* sequence: the same numbers, up to rounding, as causal SDPA on the
assembled sequence, and the same gradients for ``q``, ``k`` and ``v``.

The sequence is split as Megatron splits it (:func:`lightning_megatron.context.split.cp_chunk_indices`): of ``2N``
equal chunks, rank ``r`` of ``N`` holds chunks ``r`` and ``2N-1-r``, one early and one late, so every rank does the
same causal work. Key/value blocks travel around the ring (rank ``r`` sends to ``r+1``) while the block in hand is
computed; with the load-balanced split every step but the first is one unmasked block of half the work:

* step 0, the rank's own keys: causal attention of the local rows over the local keys (in local order the two
  chunks are already in sequence order, so plain causal masking is right);
* keys of a lower rank ``s < r``: their early chunk precedes both local chunks and their late chunk follows both, so
  all local rows attend to the early half of the block, unmasked;
* keys of a higher rank ``s > r``: both of its chunks lie after the early local chunk and before the late one, so the
  late half of the local rows attends to the whole block, unmasked.

Blocks are merged with their log-sum-exp (``softmax`` over the union of key sets), so the forward keeps only one
output and one ``lse`` per row. The backward runs the blocks again with the merged output and ``lse`` (each
block's probabilities are then the global ones), and the key/value gradients travel the ring behind their blocks,
arriving at their owner after ``N`` hops. Both directions are one ``autograd.Function``; exchanges use
``dist.batch_isend_irecv`` and are waited on only after the next block's computation was issued, so on GPUs they
overlap it.

Observers (MegaScan, ``scan.tracing.ring``): ``set_ring_observer(observer)`` makes every exchange call
``observer.exchange(what, send_to, recv_from, nbytes)`` as it is issued (``what``: ``"kv forward"``, ``"kv
backward"``, ``"dkv backward"``; global ranks) and ``observer.wait(handle, wait)`` to run its ``wait``; None (the
default) costs one attribute read per exchange.

Each block runs on the SDPA kernel that returns the log-sum-exp: ``_scaled_dot_product_flash_attention_for_cpu`` on
CPUs, ``_scaled_dot_product_flash_attention`` on GPUs in bf16/fp16; elsewhere (fp32 on GPUs) a plain-torch block
that computes the ``lse`` itself. Dropout is not supported (``MegatronConfigError`` where the attention asks for it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

__all__ = ["RingObserver", "ring_attention", "set_ring_observer"]


class RingObserver(Protocol):
    def exchange(self, what: str, send_to: int, recv_from: int, nbytes: int) -> Any: ...

    def wait(self, handle: Any, wait: Callable[[], None]) -> None: ...


_observer: Optional[RingObserver] = None


def set_ring_observer(observer: Optional[RingObserver]) -> Optional[RingObserver]:
    """Observe every ring exchange from now on (None: stop); returns the previous observer."""
    global _observer
    previous, _observer = _observer, observer
    return previous


# -- one block -------------------------------------------------------------------------------------------------
def _kernel(q: torch.Tensor) -> str:
    if q.device.type == "cpu":
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return "flash"
    return "math"


def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)  # True where masked


def _block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of one block: ``out`` in the input dtype, ``lse`` fp32 ``[batch, heads, rows]``."""
    kernel = _kernel(q)
    if kernel == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    if kernel == "flash":
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return res[0], res[1].float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def _block_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of ``dq, dk, dv``, given the *merged* output and log-sum-exp of the rows."""
    kernel = _kernel(q)
    if kernel == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    if kernel == "flash":
        # No cumulative sequence lengths (None, as the dense forward returns them): defined ones make the CUDA
        # kernel take its variable-length path, which reads q/k/v as packed [total_tokens, heads, dim]. The
        # philox seed and offset are read only with dropout.
        sq, sk = q.shape[-2], k.shape[-2]
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, sq, sk, 0.0, causal, zero, zero, scale=scale
        )
    qf, kf, vf, df = q.float(), k.float(), v.float(), dout.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(_causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), df)
    dprobs = torch.matmul(df, vf.transpose(-1, -2))
    delta = (df * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    return torch.matmul(dscores, kf).to(q.dtype), torch.matmul(dscores.transpose(-1, -2), qf).to(k.dtype), dv


def _merge(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Fold a block's ``(out, lse)`` into the running fp32 ``(acc, acc_lse)`` in place (softmax over the union)."""
    new = torch.logaddexp(acc_lse, lse)
    acc.mul_(torch.exp(acc_lse - new).unsqueeze(-1)).add_(out.float() * torch.exp(lse - new).unsqueeze(-1))
    acc_lse.copy_(new)


# -- the ring --------------------------------------------------------------------------------------------------
class _Ring:
    """This rank's place in ``group``: sends go to the next rank, receives come from the previous one."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def shift(self, tensor: torch.Tensor, what: str) -> tuple[tuple[list, Any], torch.Tensor]:
        """Start sending ``tensor`` to the next rank and receiving its peer from the previous one."""
        received = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group),
            dist.P2POp(dist.irecv, received, self.prev, self.group),
        ]
        observer = _observer
        handle = None
        if observer is not None:
            handle = observer.exchange(what, self.next, self.prev, tensor.numel() * tensor.element_size())
        return (dist.batch_isend_irecv(ops), (observer, handle)), received

    @staticmethod
    def wait(pending: tuple[list, Any]) -> None:
        requests, (observer, handle) = pending

        def wait() -> None:
            for request in requests:
                request.wait()

        if observer is None:
            wait()
        else:
            observer.wait(handle, wait)


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Key/value heads repeated for the query heads that share them (SDPA's ``enable_gqa`` order)."""
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=1)


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradient of :func:`_expand`: the query heads' shares summed back onto their key/value head."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, group):  # noqa: ANN001, ANN205
        ring = _Ring(group)
        groups = q.shape[1] // k.shape[1]
        half = q.shape[2] // 2
        acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        acc_lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ring.size):
            pending = ring.shift(kv, "kv forward") if step + 1 < ring.size else None
            source = (ring.rank - step) % ring.size
            k_blk, v_blk = _expand(kv[0], groups), _expand(kv[1], groups)
            if step == 0:
                out, lse = _block_forward(q, k_blk, v_blk, True, scale)
                _merge(acc, acc_lse, out, lse)
            elif source < ring.rank:
                out, lse = _block_forward(q, k_blk[:, :, :half], v_blk[:, :, :half], False, scale)
                _merge(acc, acc_lse, out, lse)
            else:
                out, lse = _block_forward(q[:, :, half:], k_blk, v_blk, False, scale)
                _merge(acc[:, :, half:], acc_lse[:, :, half:], out, lse)
            if pending is not None:
                ring.wait(pending[0])
                kv = pending[1]
        out = acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, acc_lse)
        ctx.scale, ctx.group = scale, group
        return out

    @staticmethod
    def backward(ctx, dout):  # noqa: ANN001, ANN205
        q, k, v, out, lse = ctx.saved_tensors
        ring = _Ring(ctx.group)
        scale, groups, half = ctx.scale, q.shape[1] // k.shape[1], q.shape[2] // 2
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv: Optional[torch.Tensor] = None
        dkv_pending = None
        for step in range(ring.size):
            kv_pending = ring.shift(kv, "kv backward") if step + 1 < ring.size else None
            source = (ring.rank - step) % ring.size
            k_blk, v_blk = _expand(kv[0], groups), _expand(kv[1], groups)
            grads = torch.zeros((2, *k_blk.shape), dtype=torch.float32, device=q.device)
            if step == 0:
                dq_b, dk_b, dv_b = _block_backward(dout, q, k_blk, v_blk, out, lse, True, scale)
                dq.add_(dq_b)
                grads[0].add_(dk_b)
                grads[1].add_(dv_b)
            elif source < ring.rank:
                dq_b, dk_b, dv_b = _block_backward(
                    dout, q, k_blk[:, :, :half].contiguous(), v_blk[:, :, :half].contiguous(), out, lse, False, scale
                )
                dq.add_(dq_b)
                grads[0, :, :, :half].add_(dk_b)
                grads[1, :, :, :half].add_(dv_b)
            else:
                dq_b, dk_b, dv_b = _block_backward(
                    dout[:, :, half:].contiguous(),
                    q[:, :, half:].contiguous(),
                    k_blk,
                    v_blk,
                    out[:, :, half:].contiguous(),
                    lse[:, :, half:].contiguous(),
                    False,
                    scale,
                )
                dq[:, :, half:].add_(dq_b)
                grads[0].add_(dk_b)
                grads[1].add_(dv_b)
            folded = torch.stack([_fold(grads[0], groups), _fold(grads[1], groups)])
            # The accumulated gradient of the block in hand arrives from the previous rank, which held it a step
            # earlier; it was left in flight during this step's computation.
            if dkv_pending is not None:
                ring.wait(dkv_pending[0])
                folded.add_(dkv_pending[1])
            dkv_pending = ring.shift(folded, "dkv backward")
            if kv_pending is not None:
                ring.wait(kv_pending[0])
                kv = kv_pending[1]
        ring.wait(dkv_pending[0])
        dkv = dkv_pending[1]  # after N hops: the sum over every rank's rows, for this rank's own keys and values
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: dist.ProcessGroup, scale: float
) -> torch.Tensor:
    """Causal attention of this rank's rows over the whole sequence split across ``group`` (see the module's
    contract). ``q``: ``[batch, heads, local_seq, head_dim]``; ``k``, ``v``: ``[batch, kv_heads, local_seq,
    head_dim]`` with ``heads`` a multiple of ``kv_heads``; ``local_seq`` even (two chunks)."""
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs two equal chunks per rank; the local sequence has {q.shape[2]} rows")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k.shape[1]} key/value heads evenly")
    if dist.get_world_size(group) == 1:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), scale, group)
