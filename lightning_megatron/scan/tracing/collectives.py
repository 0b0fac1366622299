"""Spans for tensor- and data-parallel collectives, installed only while a window is traced.

torch.distributed offers no hook on collectives, and megatron-core calls them from inside its layers and
gradient buffers. So for the traced steps only, this module swaps the collective entry points for timed
wrappers and puts the originals back afterwards: ``torch.distributed``'s functions, plus the aliases that
megatron-core 0.16 binds at import time (``dist_all_gather_func`` / ``dist_reduce_scatter_func`` in
``tensor_parallel.mappings``, ``tensor_parallel.layers`` (sequence parallelism's gathers and scatters inside the
linear layers' backward) and ``distributed.param_and_grad_buffer``). ``all_to_all_single`` (and the list form
``all_to_all``) is among them, whoever calls it; inside an MoE layer's dispatch or combine the span is named for the
exchange (``all_to_all layer 3 dispatch backward``, args ``layer``, ``exchange``, ``direction``: ``scan.tracing.moe``
sets ``context["moe"]``) and its group reads ``ep`` (megatron-core's expert groups are recognised by object).

An asynchronous collective (``async_op=True``) gets two spans: the collective itself, from its issue to the
``wait()`` that ends it (overlapped with compute, so not a wait), and ``<kind> wait`` (cat
``collective.wait``), the time the rank actually blocked in ``wait()``: that part is waiting for peers and is
taken out of net compute like a blocking collective. Point-to-point operations are not
wrapped (``P2POp`` refuses wrapped functions); the schedules' own timers cover them. Untraced steps run
the original functions, untouched. The one replacement of other projects' functions outside ``compat/`` (it is
the tracer's own machinery); listed in ``lightning_megatron.compat.inventory``.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_megatron.scan.analysis.format import TID
from lightning_megatron.scan.tracing.recorder import SpanRecorder

__all__ = ["CollectiveTracer"]

# (module, attribute, kind, which bound argument's bytes to count)
_TORCH_ENTRY_POINTS = [
    ("all_reduce", "all_reduce", "tensor"),
    ("all_gather_into_tensor", "all_gather", "output_tensor"),
    ("_all_gather_base", "all_gather", "output_tensor"),
    ("reduce_scatter_tensor", "reduce_scatter", "input"),
    ("_reduce_scatter_base", "reduce_scatter", "input"),
    ("broadcast", "broadcast", "tensor"),
    ("all_to_all_single", "all_to_all", "input"),
    ("all_to_all", "all_to_all", "input_tensor_list"),
]
_MEGATRON_ALIASES = [
    ("megatron.core.tensor_parallel.mappings", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.mappings", "dist_reduce_scatter_func"),
    ("megatron.core.tensor_parallel.layers", "dist_all_gather_func"),
    ("megatron.core.tensor_parallel.layers", "dist_reduce_scatter_func"),
    ("megatron.core.distributed.param_and_grad_buffer", "dist_all_gather_func"),
    ("megatron.core.distributed.param_and_grad_buffer", "dist_reduce_scatter_func"),
]


def _expert_group_names() -> dict[int, str]:
    """``id`` of megatron-core's expert groups → their short names (``ep``, ``tp_ep``, ``edp``), where initialized.

    By object, not by ranks: at EP2 on two ranks the expert-parallel group has the data-parallel group's ranks,
    and the MoE dispatcher's all-to-all must still read ``ep`` (the gradient all-reduce keeps ``dp``)."""
    from megatron.core import parallel_state as ps

    getters = {
        "ep": ps.get_expert_model_parallel_group,
        "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
        "edp": ps.get_expert_data_parallel_group,
    }
    names: dict[int, str] = {}
    for name, getter in getters.items():
        try:
            group = getter(check_initialized=False)
        except (AssertionError, RuntimeError, AttributeError, TypeError):
            continue
        if group is not None:
            names.setdefault(id(group), name)
    return names


def _bytes(tensor: Any) -> Optional[int]:
    """Bytes of a tensor, or of a list of tensors (``all_to_all``'s lists); None for anything else."""
    if isinstance(tensor, torch.Tensor):
        return tensor.numel() * tensor.element_size()
    if isinstance(tensor, (list, tuple)) and tensor and all(isinstance(t, torch.Tensor) for t in tensor):
        return sum(t.numel() * t.element_size() for t in tensor)
    return None


def _group_names() -> dict[tuple[int, ...], str]:
    """Ranks of megatron-core's process groups → their short names (tp, dp, pp, ...), where initialized."""
    from megatron.core import parallel_state as ps

    getters = {
        "tp": ps.get_tensor_model_parallel_group,
        "pp": ps.get_pipeline_model_parallel_group,
        "dp": ps.get_data_parallel_group,
        "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "mp": ps.get_model_parallel_group,
        "embd": ps.get_embedding_group,
        "pos_embd": ps.get_position_embedding_group,
    }
    names: dict[tuple[int, ...], str] = {}
    for name, getter in getters.items():
        try:
            group = getter()
        except (AssertionError, RuntimeError, AttributeError):
            continue
        if group is not None:
            names.setdefault(tuple(dist.get_process_group_ranks(group)), name)
    return names


class _TracedWork:
    """An async collective's work handle whose ``wait`` is traced (``on_wait``) and closes the span (``on_done``)."""

    def __init__(self, work: Any, on_wait: Callable[[], Any], on_done: Callable[[Any], None]) -> None:
        self._work, self._on_wait, self._on_done, self._closed = work, on_wait, on_done, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            return self._work.wait(*args, **kwargs)
        waiting = self._on_wait()
        result = self._work.wait(*args, **kwargs)
        self._closed = True
        self._on_done(waiting)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CollectiveTracer:
    """``install()`` before a traced window, ``uninstall()`` after; spans go to ``recorder``."""

    def __init__(self, recorder: SpanRecorder, context: dict[str, Any]) -> None:
        self.recorder = recorder
        self.context = context  # the callback keeps context["step"] current
        self._names = _group_names()
        self._expert_names = _expert_group_names()
        self._ranks: dict[int, tuple[int, ...]] = {}
        self._seq: dict[tuple[int, ...], int] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def _group_ranks(self, group: Any) -> tuple[int, ...]:
        key = id(group)
        if key not in self._ranks:
            self._ranks[key] = tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))
        return self._ranks[key]

    def _wrap(self, fn: Callable, kind: str, tensor_arg: str) -> Callable:
        signature = inspect.signature(fn)

        def traced(*args: Any, **kwargs: Any) -> Any:
            if not self.recorder.active:
                return fn(*args, **kwargs)
            bound = signature.bind_partial(*args, **kwargs).arguments
            group = bound.get("group")
            ranks = self._group_ranks(group)
            seq = self._seq.get(ranks, 0)
            self._seq[ranks] = seq + 1
            args_out = {
                "step": self.context.get("step"),
                "group": list(ranks),
                "group_name": self._expert_names.get(id(group)) or self._names.get(ranks, "other"),
                "seq": seq,
                "bytes": _bytes(bound.get(tensor_arg)),
                "async": bool(bound.get("async_op", False)),
            }
            name = kind
            exchange = self.context.get("moe") if kind == "all_to_all" else None
            if exchange:  # inside an MoE layer's dispatch or combine (scan.tracing.moe)
                name = f"all_to_all layer {exchange['layer']} {exchange['exchange']} {exchange['direction']}"
                args_out.update(exchange)
            span = self.recorder.open(name, "collective", TID["communication"], args_out)
            work = fn(*args, **kwargs)
            if args_out["async"] and work is not None:
                wait_args = {**args_out, "async": False}
                name = f"{name} wait"

                def done(waiting: Any) -> None:
                    self.recorder.close(waiting)
                    self.recorder.close(span)

                return _TracedWork(
                    work, lambda: self.recorder.open(name, "collective.wait", TID["communication"], wait_args), done
                )
            self.recorder.close(span)
            return work

        traced.__wrapped__ = fn  # type: ignore[attr-defined]
        return traced

    def install(self) -> None:
        if self._saved:
            return
        wrappers: dict[int, Callable] = {}
        for attr, kind, tensor_arg in _TORCH_ENTRY_POINTS:
            original = getattr(dist, attr, None)
            if original is None:
                continue
            wrappers[id(original)] = self._wrap(original, kind, tensor_arg)
            self._saved.append((dist, attr, original))
            setattr(dist, attr, wrappers[id(original)])
        for module_name, attr in _MEGATRON_ALIASES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            original = getattr(module, attr, None)
            wrapped = wrappers.get(id(original))
            if wrapped is not None:  # a torch entry point; other replacements (fp32 accumulation) stay as they are
                self._saved.append((module, attr, original))
                setattr(module, attr, wrapped)

    def uninstall(self) -> None:
        for module, attr, original in reversed(self._saved):
            setattr(module, attr, original)
        self._saved = []
