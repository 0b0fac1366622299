"""MegaFBD's performance model: the step time the rank split should take, from its parts.

The parts are measured on the job itself (device events around each piece of work in the second and third steps, and a
transfer calibrated between partners when the session opens; a received message is copied in on the receiving
GPU's stream, so its copy is part of the receiver's work): per pipeline stage, the forward replica's forward
(in ship mode with the capture and packing), the backward replica's recompute (or replay) and backward, the bytes
of each message kind, the link's latency and bandwidth, and the gradient reduction at the end of the step.
:func:`predict` composes them with the schedule's dependencies (a small event simulation: a forward replica runs
the microbatches dealt to it in turn, stage after stage; a backward stage needs its input or bundle and the
next stage's gradient; a ship-mode forward runs at most ``prefetch`` microbatches ahead of its partner) and
:func:`describe` prints the table the session shows at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_megatron.pipeline.fbd.roles import dealt_to

__all__ = ["Parts", "describe", "predict"]


@dataclass(frozen=True)
class Parts:
    """Seconds and bytes per microbatch and stage (lists indexed by stage), and the link."""

    mode: str
    microbatches: int
    backward_replicas: int
    forward_replicas: int
    """The split (``Roles``): microbatch ``m`` of backward replica ``b`` runs on forward replica
    ``(m·B + b) mod F``."""
    prefetch: int
    forward_s: list[float]
    recompute_s: list[float]
    backward_s: list[float]
    input_bytes: list[float]
    """Recompute mode: stage ``s``'s output, the input of backward stage ``s + 1``."""
    bundle_bytes: list[float]
    grad_bytes: list[float]
    latency_s: float
    bandwidth: float
    """Bytes per second between partners."""
    sync_s: float
    forward_stages: int = -1
    """Stages whose forward the forward replicas run (-1: all in ship mode, all but the last in recompute mode)."""
    recompute_host_s: tuple[float, ...] | list[float] = ()
    """The host's seconds for each recompute (diagnostic: near the device's time, the recompute is host-bound)."""

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / max(self.bandwidth, 1.0)


def predict(parts: Parts) -> float:
    """The predicted seconds of one step's forwards, backwards and gradient reduction."""
    stages, microbatches = len(parts.forward_s), parts.microbatches
    backward, forward = parts.backward_replicas, parts.forward_replicas
    ship = parts.mode == "ship"
    forward_stages = parts.forward_stages if parts.forward_stages >= 0 else stages if ship else stages - 1
    fwd_done: dict[tuple[int, int, int], float] = {}
    bwd_started: dict[tuple[int, int, int], float] = {}
    bwd_done: dict[tuple[int, int, int], float] = {}
    fwd_free = [[0.0] * stages for _ in range(forward)]
    bwd_free = [[0.0] * stages for _ in range(backward)]
    order: list[list[tuple[int, int]]] = [[] for _ in range(forward)]  # each forward replica's (m, b), in turn
    for m in range(microbatches):
        for b in range(backward):
            order[dealt_to(b, m, backward, forward)].append((m, b))
    # A ship-mode forward waits for the bundle `prefetch` earlier of the same partner on the same forward replica.
    waits_for: dict[tuple[int, int], int] = {}
    for runs in order:
        for b in range(backward):
            mine = [m for m, partner in runs if partner == b]
            waits_for.update({(m, b): mine[k - parts.prefetch] for k, m in enumerate(mine) if k >= parts.prefetch})
    # The replicas are simulated in rounds: a ship-mode forward depends on its partner's progress (prefetch), so
    # alternate until every time is known.
    pending_fwd = [[(m, b, s) for (m, b) in runs for s in range(forward_stages)] for runs in order]
    pending_bwd = {b: [(m, s) for m in range(microbatches) for s in reversed(range(stages))] for b in range(backward)}
    progress = True
    while progress and (any(pending_fwd) or any(pending_bwd.values())):
        progress = False
        for f, queue in enumerate(pending_fwd):
            while queue:
                m, b, s = queue[0]
                ready = 0.0 if s == 0 else fwd_done[(m, b, s - 1)] + parts.transfer_s(parts.input_bytes[s - 1])
                if ship and (m, b) in waits_for:
                    key = (waits_for[(m, b)], b, s)
                    if key not in bwd_started:
                        break
                    ready = max(ready, bwd_started[key])
                start = max(fwd_free[f][s], ready)
                fwd_free[f][s] = fwd_done[(m, b, s)] = start + parts.forward_s[s]
                queue.pop(0)
                progress = True
        for b in range(backward):
            queue = pending_bwd[b]
            while queue:
                m, s = queue[0]
                # The receiver copies a message in on its own stream: the copy occupies the backward GPU.
                if ship:
                    source, nbytes = fwd_done.get((m, b, s)), parts.bundle_bytes[s]
                else:
                    source = 0.0 if s == 0 else fwd_done.get((m, b, s - 1))
                    nbytes = parts.input_bytes[s - 1] if s > 0 else 0.0
                ready = None if source is None else source + (parts.latency_s if nbytes else 0.0)
                grad_ready = 0.0
                if s < stages - 1:
                    later = bwd_done.get((m, b, s + 1))
                    grad_ready = None if later is None else later + parts.transfer_s(parts.grad_bytes[s + 1])
                if ready is None or grad_ready is None:
                    break
                start = max(bwd_free[b][s], ready) + nbytes / max(parts.bandwidth, 1.0)
                bwd_started[(m, b, s)] = start
                backward_start = max(start + parts.recompute_s[s], grad_ready)
                bwd_free[b][s] = bwd_done[(m, b, s)] = backward_start + parts.backward_s[s]
                queue.pop(0)
                progress = True
    if any(pending_fwd) or any(pending_bwd.values()):
        raise AssertionError("the performance model's dependencies did not resolve (a bug in the model)")
    return max(max(bwd_done.values()), max(fwd_done.values(), default=0.0)) + parts.sync_s


def describe(parts: Parts, predicted_s: float) -> str:
    """The start-up table: the measured parts per stage and the predicted step."""
    ms = 1e3
    lines = [
        f"MegaFBD performance model ({parts.mode}, {parts.microbatches} microbatches, {parts.forward_replicas} "
        f"forward replica(s) : {parts.backward_replicas} backward replica(s))",
        f"  link: {parts.latency_s * 1e6:.0f} µs + {parts.bandwidth / 1e9:.1f} GB/s",
        "  stage  forward ms  recompute ms (host)  backward ms  shipped MB/microbatch",
    ]
    for s in range(len(parts.forward_s)):
        shipped = parts.bundle_bytes[s] if parts.mode == "ship" else parts.input_bytes[s]
        host = parts.recompute_host_s[s] if s < len(parts.recompute_host_s) else 0.0
        lines.append(
            f"  {s:>5}  {parts.forward_s[s] * ms:10.2f}  {parts.recompute_s[s] * ms:12.2f} ({host * ms:5.1f})  "
            f"{parts.backward_s[s] * ms:11.2f}  {shipped / 1e6:21.2f}"
        )
    lines.append(f"  gradient reduction: {parts.sync_s * ms:.2f} ms; predicted step: {predicted_s * ms:.2f} ms")
    return "\n".join(lines)
