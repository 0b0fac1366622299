"""``MegaScan``: trace windows of training steps on every rank, and name the slow ones at fit end (and during the
fit, ``scan.tracing.online``).

Everything of a run lands in one directory, by default ``<trainer.log_dir>/megascan`` (beside the logger's
files, so ``tensorboard --logdir runs/`` finds a run's metrics and its Kineto traces together): the rank files,
rank 0's ``megascan-report.json``, and the Kineto traces of ``profile_steps`` under ``profile/``.
"""

from __future__ import annotations

import io
import json
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.profilers import PyTorchProfiler
from typing_extensions import override

from lightning_megatron.errors import MegatronConfigError
from lightning_megatron.scan.analysis.format import TID, clock_metadata, open_for_append, rank_file_name, rank_metadata
from lightning_megatron.scan.analysis.report import REPORT_FILE
from lightning_megatron.scan.tracing.busy import KernelActivity
from lightning_megatron.scan.tracing.clock import ClockOffset, clock_domain, measure_offset, now_us
from lightning_megatron.scan.tracing.collectives import CollectiveTracer
from lightning_megatron.scan.tracing.layers import Granularity, LayerTracer, choose_granularity
from lightning_megatron.scan.tracing.moe import MoETracer
from lightning_megatron.scan.tracing.online import OnlineDetection, write_report
from lightning_megatron.scan.tracing.p2p import P2PMessages
from lightning_megatron.scan.tracing.profile import PROFILE_OPTIONS, StepProfiler
from lightning_megatron.scan.tracing.recorder import Span, SpanRecorder
from lightning_megatron.scan.tracing.ring import RingTracer
from lightning_megatron.scan.tracing.sched import RunDelay
from lightning_megatron.strategy.listeners import P2P_TIMERS, StepListener

__all__ = ["MegaScan", "REPORT_FILE", "choose_granularity"]


_COMPUTE = {
    "forward-compute": "forward",
    "backward-compute": "backward",
    "weight-grad-compute": "weight-grad",
    "recompute-compute": "recompute",  # MegaFBD's backward replicas: the forward they redo before a backward
}


class MegaScan(pl.Callback, StepListener):
    """Trace ``window`` consecutive steps every ``interval`` steps, one Chrome trace file per rank.

    A step the strategy replays as a CUDA graph (the default on one GPU) stays a replay when traced: the spans are
    the graph's own events, recorded at every replay (``scan.tracing.recorder``), marked ``args.graph`` and without the
    host's enqueue times (one launch queues the whole step).

    Args:
        trace_dir: Where each rank writes ``rankNNNNN-dpD-ppP-tpT.json[.gz]`` and rank 0 ``megascan-report.json``
            (a shared file system for multi-node jobs, or collect the files afterwards). None:
            ``<trainer.log_dir>/megascan`` (e.g. ``runs/gpt/version_0/megascan``; ``<default_root_dir>/megascan``
            without a logger), decided by rank 0 for every rank. Read the resolved path from ``trace_dir`` after
            set-up.
        interval, window: Trace steps ``s >= start_step`` with ``(s - start_step) % interval < window``.
        start_step: First traced step; 1 skips step 0, whose one-time warm-up would look like a slow rank.
        granularity: ``"stage"``: forward/backward per microbatch and chunk, pipeline sends/receives,
            collectives, gradient sync, optimizer step, data wait. ``"layer"`` adds attention and MLP of
            every layer; ``"op"`` every module with parameters inside the layers (costly: for diagnosis).
            None (the default) chooses per job (``choose_granularity``): ``"layer"`` where a pipeline stage
            has no peer rank to be compared with (pure pipeline parallelism), since only its layer parts can be
            compared across stages; ``"stage"`` elsewhere. The choice and its reason are in every rank file's
            metadata (``granularity``, ``granularity_reason``) and in the report's parameters.
        detect: At fit end, rank 0 reads all traces and reports slow ranks (``self.report``, the console,
            the Trainer's logger).
        detect_options: Thresholds for ``scan.analysis.detect.detect`` (``min_slowdown``, ``min_z``, ``min_impact``).
        detect_every: Also detect *during* the fit, after every this many traced windows: rank 0 analyses the
            last ``detect_steps`` steps (read in bounded memory), prints and logs suspects as they appear and
            recover (``megascan/...`` metrics, ``self.online``), and calls ``on_detect``. None: at fit end only.
        detect_steps: The sliding window of recent steps online detection looks at.
        on_detect: ``on_detect(report, trainer) -> bool``, on rank 0 after each online detection (save a
            checkpoint, page someone, exclude a host); returning True stops training on every rank.
        gzip: Write ``.json.gz`` (rank files and Kineto traces).
        clock_rounds: Round trips per rank when measuring clock offsets (at fit start and after each window).
        profile_steps: Global steps to also run ``torch.profiler`` over (CPU, and CUDA on GPUs), each a traced
            step: one Kineto trace per rank and run of consecutive steps in ``<trace_dir>/profile``, named
            ``rankNNNNN-dpD-ppP-tpT.<time>.pt.trace.json``, steps marked ``ProfilerStep#<step>``, for
            torch-tb-profiler (``tensorboard --logdir``) and HTA. Profiled steps are slower on every rank, by
            different amounts: their step spans say ``profiled`` and detection leaves them out.
        profile_options: ``torch.profiler.profile`` flags, all off by default: ``record_shapes``,
            ``profile_memory``, ``with_stack``, ``with_flops``, ``with_modules``.
        gpu_busy: On GPUs, also measure how long the GPU ran this process's kernels inside each span
            (``args.busy_us``, ``scan.tracing.busy``: a CUDA-only ``torch.profiler`` session per sampled window), so that
            detection names ``compute`` only where the kernels themselves took longer, not where the GPU idled
            between them (a slow host, launch gaps). No effect on CPUs. Windows with a ``profile_steps`` step, or
            while another profiler session runs (``Trainer(profiler="pytorch")``), go without it.
        gpu_busy_every: Measure busy time in every this many traced windows (1: all), to bound its cost: each
            CUDA-activity session pays CUPTI's set-up and tear-down, tens of milliseconds per window, so the
            default, one window in 10 (with ``interval=5``: one step in 50), keeps it to a fraction of a percent
            of a job's time (the overhead measured: docs/evaluation/megascan.md).
        trace_replays: Whether a traced step that the strategy replays as a CUDA graph is traced as a replay (the
            graph's own events, ``scan.tracing.recorder``) or run eagerly. True (and None, the same): replays, at every
            layout, so that tracing leaves the job's steps as they are; an eager step in place of a replay can
            take several times as long (docs/evaluation/megascan.md). False: traced steps run eagerly, which
            gives per-kernel host enqueue times; such steps are marked ``in_place_of_replay``, and their launch
            pace, which the replayed job does not pay, is not named (``scan.analysis.attribution``).
    """

    def __init__(
        self,
        trace_dir: Union[str, Path, None] = None,
        interval: int = 5,
        window: int = 2,
        start_step: int = 1,
        granularity: Optional[Granularity] = None,
        detect: bool = True,
        detect_options: Optional[dict[str, float]] = None,
        detect_every: Optional[int] = None,
        detect_steps: int = 20,
        on_detect: Optional[Callable[[Any, pl.Trainer], Optional[bool]]] = None,
        gzip: bool = False,
        clock_rounds: int = 8,
        profile_steps: Optional[list[int]] = None,
        profile_options: Optional[dict[str, bool]] = None,
        gpu_busy: bool = True,
        gpu_busy_every: int = 10,
        trace_replays: Optional[bool] = None,
    ) -> None:
        if trace_replays is not None and not isinstance(trace_replays, bool):
            raise MegatronConfigError(
                f"MegaScan(trace_replays={trace_replays!r}): True, False, or None (replays in one-process fits)."
            )
        self._trace_replays = trace_replays
        if window < 1 or interval < window:
            raise MegatronConfigError(
                f"MegaScan(interval={interval}, window={window}): need 1 <= window <= interval "
                "(window steps are traced out of every interval steps)."
            )
        if granularity not in (None, "stage", "layer", "op"):
            raise MegatronConfigError(
                f"MegaScan(granularity={granularity!r}): choose 'stage', 'layer' or 'op', or leave it None to let "
                "MegaScan choose per job."
            )
        if start_step < 0 or clock_rounds < 1:
            raise MegatronConfigError("MegaScan: start_step must be >= 0 and clock_rounds >= 1.")
        if detect_every is not None and (detect_every < 1 or detect_steps < 2):
            raise MegatronConfigError(
                f"MegaScan(detect_every={detect_every}, detect_steps={detect_steps}): detect_every is a number of "
                "traced windows (>= 1, or None for fit end only) and detect_steps a number of recent steps (>= 2)."
            )
        if isinstance(gpu_busy_every, bool) or not isinstance(gpu_busy_every, int) or gpu_busy_every < 1:
            raise MegatronConfigError(
                f"MegaScan(gpu_busy_every={gpu_busy_every!r}): a number of traced windows >= 1 (1: every window); "
                "turn busy time off with gpu_busy=False."
            )
        self.gpu_busy, self.gpu_busy_every = bool(gpu_busy), gpu_busy_every
        self.interval, self.window, self.start_step = interval, window, start_step
        self.profile_steps = self._check_profile(profile_steps, profile_options)
        self.profile_options = dict(profile_options or {})
        self.detect_every, self.detect_steps, self.on_detect = detect_every, detect_steps, on_detect
        self._windows = 0
        self._trace_dir_arg = trace_dir
        self.trace_dir: Optional[Path] = Path(trace_dir) if trace_dir is not None else None
        """Where the files go; resolved in ``setup`` when the argument was None."""
        self.granularity_setting: Optional[Granularity] = granularity
        """What the user asked for (None: chosen per job)."""
        self.granularity: Optional[Granularity] = granularity
        """The granularity this fit traces at: the setting, or what ``choose_granularity`` chose at fit start."""
        self.granularity_reason = "set by MegaScan(granularity=...)" if granularity is not None else ""
        self.detect, self.gzip, self.clock_rounds = detect, gzip, clock_rounds
        self.detect_options = dict(detect_options or {})
        self._online = OnlineDetection(detect_steps, start_step, self.detect_options, on_detect)
        self.report: Any = None
        self.path: Optional[Path] = None
        self._strategy: Any = None
        self._file: Optional[io.TextIOBase] = None
        self._recorder: Optional[SpanRecorder] = None
        self._collectives: Optional[CollectiveTracer] = None
        self._ring: Optional[RingTracer] = None  # ring attention's exchanges at CP > 1 (scan.tracing.ring)
        self._layers: Optional[LayerTracer] = None
        self._moe: Optional[MoETracer] = None  # MoE layers' exchanges and tokens per expert (scan.tracing.moe)
        self._layers_always = False  # layer hooks stay attached between windows (traced replays only)
        self._context: dict[str, Any] = {}
        self._open: dict[str, list[Span]] = {}
        self._open_outside: dict[str, list[Span]] = {}  # the window's open spans while a capture runs
        self.traces_replays = True
        """Whether steps replayed as CUDA graphs are traced as replays (set in ``setup`` from ``trace_replays``).
        Replayed traces are checked against eager ones in ``tests/test_scan_graphs_gpu.py`` (one GPU, TP2 and
        DP2)."""
        self._p2p = P2PMessages()  # the identity of the pipeline messages of the traced step
        self._step_span: Optional[Span] = None
        self._run_delay = RunDelay()  # the training thread's waits for a CPU (``scan.tracing.sched``)
        self._delay_at: dict[str, Optional[float]] = {"batch_end": None, "batch_start": None}
        self._last_batch_end: Optional[float] = None
        self._fetch_started: Optional[float] = None
        self._fetches: list[tuple[float, float]] = []  # the loader's fetches since the last step ended
        self._sync_started: Optional[float] = None
        self._syncs: list[tuple[float, float]] = []  # Lightning's synchronisations of the ranks since then
        self._clock_group: Any = None
        self._profiler: Optional[StepProfiler] = None
        self._busy_blocked = False

    def _check_profile(self, steps: Optional[list[int]], options: Optional[dict[str, bool]]) -> list[int]:
        """``profile_steps`` must be traced steps, so a Kineto trace always has MegaScan's view of the same step."""
        if isinstance(steps, (int, str)):
            raise MegatronConfigError(f"MegaScan(profile_steps={steps!r}): give a list of global steps, e.g. [2].")
        steps = list(steps or [])
        bad = [s for s in steps if isinstance(s, bool) or not isinstance(s, int) or not self.is_traced(s)]
        if bad:
            traced = [s for s in range(self.start_step, self.start_step + 3 * self.interval) if self.is_traced(s)]
            raise MegatronConfigError(
                f"MegaScan(profile_steps={steps}): {bad} are not traced steps. With start_step={self.start_step}, "
                f"interval={self.interval}, window={self.window} the traced steps are {traced}, ...; profile "
                "some of those (or change the schedule), so MegaScan's trace shows the profiled steps too."
            )
        unknown = sorted(set(options or {}) - PROFILE_OPTIONS)
        if unknown:
            raise MegatronConfigError(
                f"MegaScan(profile_options=...): unknown {unknown}; choose from {sorted(PROFILE_OPTIONS)}."
            )
        return sorted(set(steps))

    @property
    def online(self) -> list[dict[str, Any]]:
        """Online detections: ``{"step", "report", "appeared", "recovered"}`` each (rank 0; ``scan.tracing.online``)."""
        return self._online.history

    # -- which steps -------------------------------------------------------------------------------
    def is_traced(self, step: int) -> bool:
        return step >= self.start_step and (step - self.start_step) % self.interval < self.window

    def _window_ends(self, step: int, max_steps: int) -> bool:
        return (step - self.start_step) % self.interval == self.window - 1 or step == max_steps - 1

    # -- set-up ------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_megatron.strategy import MegatronAppStrategy

        if stage != "fit":
            return
        if not isinstance(trainer.strategy, MegatronAppStrategy):
            raise MegatronConfigError(
                f"MegaScan traces MegatronAppStrategy runs; this Trainer uses {type(trainer.strategy).__name__}. "
                "Pass strategy=MegatronAppStrategy(...) (or strategy='megatron')."
            )
        if self.profile_steps and isinstance(trainer.profiler, PyTorchProfiler):
            raise MegatronConfigError(
                f"MegaScan(profile_steps={self.profile_steps}) and Trainer(profiler=PyTorchProfiler) both run "
                "torch.profiler, and two of its sessions cannot run at once. Keep one: drop profile_steps (Lightning's "
                "profiler then covers the whole fit) or the Trainer's profiler (MegaScan's traces then hold the "
                "chosen steps, one Kineto file per rank)."
            )
        late = [s for s in self.profile_steps if 0 <= trainer.max_steps <= s]
        if late:
            raise MegatronConfigError(
                f"MegaScan(profile_steps={self.profile_steps}): {late} never run with max_steps={trainer.max_steps}."
            )
        self.traces_replays = self._trace_replays is not False
        self._busy_blocked = self.gpu_busy and isinstance(trainer.profiler, PyTorchProfiler)
        if self._busy_blocked:
            warnings.warn(
                "MegaScan(gpu_busy=True) beside Trainer(profiler=PyTorchProfiler): two torch.profiler sessions cannot "
                "run at once, so GPU busy time is not measured in this fit (detection falls back to span times).",
                stacklevel=2,
            )
        self._strategy = trainer.strategy
        self._strategy.add_step_listener(self)
        if self._trace_dir_arg is None:
            # Trainer.log_dir is the logger's (or default_root_dir) *as rank 0 sees it*, broadcast: the other
            # ranks' loggers guess their version number themselves, after rank 0 created its version directory.
            self.trace_dir = Path(trainer.log_dir or trainer.default_root_dir) / "megascan"

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = self._strategy
        parallel = strategy.parallel
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        coords = parallel.coordinates
        self.trace_dir.mkdir(parents=True, exist_ok=True)
        name = rank_file_name(rank, coords["dp"], coords["pp"], coords["tp"])
        self.path = self.trace_dir / (name + (".gz" if self.gzip else ""))
        self.path.unlink(missing_ok=True)  # this rank's file only: other runs' files are not ours to delete
        use_cuda = strategy.root_device.type == "cuda"
        if self.profile_steps:
            worker = name.removesuffix(".json")  # tb-profiler's and HTA's worker name: rank and coordinates
            self._profiler = StepProfiler(
                self.profile_steps, self.trace_dir / "profile", worker, use_cuda, self.profile_options, self.gzip
            )
        busy = None
        if use_cuda and self.gpu_busy and not self._busy_blocked and KernelActivity.available():
            busy = KernelActivity()
        self._recorder = SpanRecorder(rank, use_cuda, busy=busy)
        self._context = {"step": None}
        self._collectives = CollectiveTracer(self._recorder, self._context)
        if MoETracer.moe_layers(strategy.wrapped_chunks):
            self._moe = MoETracer(self._recorder, self._context)
        layout = parallel.layout
        if layout.context > 1:
            self._ring = RingTracer(self._recorder, self._context)
        self.granularity, self.granularity_reason = choose_granularity(
            self.granularity_setting, layout.pipeline, layout.tensor, parallel.data_parallel_size
        )
        if self.granularity != "stage":
            self._layers = LayerTracer(self._recorder, self._context, ops=self.granularity == "op")
            # Module hooks slow every step they are attached to (full backward hooks wrap each part's inputs and
            # outputs in autograd functions), so they are attached for the traced windows only -- except where
            # traced steps are graph replays, whose layer events are recorded once, by the captured step.
            self._layers_always = self.traces_replays and getattr(strategy, "step_graph", None) is not None
            if self._layers_always:
                self._layers.attach(strategy.wrapped_chunks)
        info = {
            "world_size": world,
            **coords,
            "host": socket.gethostname(),
            "clock_domain": clock_domain(),
            "device": str(strategy.root_device),
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "granularity": self.granularity,
            "granularity_reason": self.granularity_reason,
            "pipeline_size": layout.pipeline,
            "tensor_size": layout.tensor,
            "data_parallel_size": parallel.data_parallel_size,
            "virtual_pipeline_size": layout.virtual_pipeline,
            "schedule": getattr(strategy.schedule, "name", None),  # the bubbles' theory (scan.analysis.bubbles)
            "start_step": self.start_step,
            "interval": self.interval,
            "window": self.window,
            "gpu_busy": busy is not None,
            "gpu_busy_every": self.gpu_busy_every,
        }
        self._file = open_for_append(self.path)
        self._write(rank_metadata(rank, info))
        if dist.is_initialized() and world > 1:
            # Round trips need a host-side group: gloo, also when the training collectives run on NCCL.
            self._clock_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else dist.group.WORLD
        self._measure_clock()
        self._file.flush()

    def _measure_clock(self) -> None:
        offset = measure_offset(self._clock_group, self.clock_rounds) if self._clock_group is not None else None
        offset = offset or ClockOffset(0.0, 0.0, now_us(), 0)
        self._write(
            [
                clock_metadata(
                    self._recorder.rank, offset.offset_us, offset.uncertainty_us, offset.at_us, offset.round_trips
                )
            ]
        )

    def _write(self, events: list[dict[str, Any]]) -> None:
        self._file.write("".join(json.dumps(e, separators=(",", ":")) + ",\n" for e in events))

    # -- the traced step ---------------------------------------------------------------------------
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        now = now_us()
        if self._profiler is not None:  # its start-up lands between the host gap and the step: in neither
            self._profiler.begin(step)
        if self._recorder is None or not self.is_traced(step):
            return
        recorder = self._recorder
        if not recorder.active:
            recorder.begin_window(busy=self._busy_window(step))
            self._collectives.install()
            if self._ring is not None:
                self._ring.install()
            if self._moe is not None:
                self._moe.attach(self._strategy.wrapped_chunks)
            if self._layers is not None and not self._layers_always:
                self._layers.attach(self._strategy.wrapped_chunks)
        self._context["step"] = step
        self._p2p.begin_step(self._strategy, batch)
        delay = self._delay_at["batch_start"] = self._run_delay.read()
        if self._last_batch_end is not None:  # the host's time between steps: Lightning's bookkeeping and the fetch
            gap_args = {"step": step, **_cpu_wait(self._delay_at["batch_end"], delay)}
            recorder.add("host-gap", "host", TID["host"], self._last_batch_end, now, gap_args)
        for start, end in self._fetches:  # the fetches since the last step: data time is the loader's own time
            recorder.add("data-fetch", "data", TID["host"], start, end, {"step": step})
        for start, end in self._syncs:  # waiting there is waiting for the other ranks, not the host's own time
            recorder.add("step-sync", "sync", TID["host"], start, end, {"step": step})
        self._fetches, self._syncs = [], []
        args = {"step": step, "profiled": True} if step in self.profile_steps else {"step": step}
        if self._in_place_of_replay():
            args["in_place_of_replay"] = True
        self._step_span = recorder.open(f"step {step}", "step", TID["steps"], args)

    def _in_place_of_replay(self) -> bool:
        """Whether this traced step runs eagerly where the strategy would have replayed its captured graph: what
        its host spends launching kernels one by one, the replayed steps do not (``scan.analysis.attribution``)."""
        graph = getattr(self._strategy, "step_graph", None)
        return not self.traces_replays and graph is not None and graph.captures > 0 and graph.gave_up_because is None

    def _busy_window(self, step: int) -> bool:
        """Whether the window starting at ``step`` measures GPU busy time: every ``gpu_busy_every``-th window (the
        same ones on every rank), and none holding a profiled step (its profiler session would clash)."""
        if self._windows % self.gpu_busy_every:
            return False
        return not any(s in self.profile_steps for s in range(step, step + self.window))

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_batch_end = None  # the wait before the next training batch is not data loading

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder = self._recorder
        if recorder is not None and recorder.active:
            if self._step_span is not None:
                self._step_span.args.update(_cpu_wait(self._delay_at["batch_start"], self._run_delay.read()))
                recorder.close(self._step_span)
            self._step_span = None
            step = trainer.global_step - 1  # global_step already counts this batch's optimizer step
            if self._window_ends(step, trainer.max_steps):
                self._finish_window()
                self._windows += 1
                if self.detect_every and self._windows % self.detect_every == 0:
                    if self._online.run(trainer, self.trace_dir, step):
                        trainer.should_stop = True
        if self._profiler is not None:  # saving a trace takes a while: before the next host gap starts
            self._profiler.end()
        self._last_batch_end = now_us()
        self._delay_at["batch_end"] = self._run_delay.read()
        self._fetches, self._syncs = [], []  # what comes from here on belongs to the gap before the next step

    def _finish_window(self) -> None:
        self._collectives.uninstall()
        if self._ring is not None:
            self._ring.uninstall()
        if self._layers is not None and not self._layers_always:
            self._layers.detach()
        events = self._recorder.end_window()
        if self._moe is not None:
            self._moe.detach()
            events += self._moe.counters(events, self._recorder.rank)
        self._open = {}
        self._write(events)
        self._measure_clock()
        self._file.flush()

    # -- StepListener: megatron-core's timers and the strategy's microbatch announcements --------
    def span_start(self, name: str) -> None:
        if name == "data-fetch":  # between steps: kept until the next step is known to be traced
            self._fetch_started = now_us()
            return
        if name == "step-sync":  # the same
            self._sync_started = now_us()
            return
        recorder = self._recorder
        if recorder is None or not recorder.active:
            return
        step = self._context["step"]
        if name in _COMPUTE:
            span = recorder.open(_COMPUTE[name], "compute", TID["compute"], {"step": step})
        elif name in P2P_TIMERS:
            span = recorder.open(name, "p2p", TID["communication"], self._p2p.args(name, step))
        elif name == "all-grads-sync":
            span = recorder.open("grad-sync", "grad_sync", TID["host"], {"step": step})
        elif name == "optimizer-step":  # the update alone: a user's hooks around it are the step's host time
            span = recorder.open("optimizer-step", "optimizer", TID["host"], {"step": step})
        else:
            return
        self._open.setdefault(name, []).append(span)

    def span_stop(self, name: str) -> None:
        if name == "data-fetch":
            if self._fetch_started is not None:
                self._fetches.append((self._fetch_started, now_us()))
                self._fetch_started = None
            return
        if name == "step-sync":
            if self._sync_started is not None:
                self._syncs.append((self._sync_started, now_us()))
                self._sync_started = None
            return
        stack = self._open.get(name)
        if stack and self._recorder is not None:
            self._recorder.close(stack.pop())

    @property
    def graph_safe(self) -> bool:
        """Inside a step MegaScan records CUDA events only, so a CUDA-graph step keeps its graph and MegaScan traces
        the replays (``traces_replays``). Where it does not, only the traced steps run eagerly; the others stay
        replays (nothing is recorded in them)."""
        return self.traces_replays or self._recorder is None or not self._recorder.active

    def graph_capture(self, started: bool) -> None:
        """Open the captured step's spans whether or not it is traced: they are the template of every replay."""
        recorder, collectives = self._recorder, self._collectives
        if recorder is None or collectives is None or not self.traces_replays:
            return
        if started:
            self._open_outside, self._open = self._open, {}
            collectives.install()  # (already installed in a traced window)
            recorder.begin_capture()
        else:
            recorder.end_capture()
            if not recorder.active:
                collectives.uninstall()
            self._open = self._open_outside

    def graph_replay(self, started: bool) -> None:
        if self._recorder is None or not self.traces_replays:
            return
        if started:
            self._recorder.before_replay()
        else:
            self._recorder.replayed({"step": self._context["step"]})

    def microbatch(self, phase: str, chunk: int, microbatch: int) -> None:
        stack = self._open.get(f"{phase}-compute")
        if not stack and phase == "forward":
            stack = self._open.get("recompute-compute")
        if stack:
            stack[-1].args.update(microbatch=microbatch, chunk=chunk)
        if self._layers is not None:
            self._layers.current = (phase, chunk, microbatch)

    def p2p_messages(self, name: str, sends: list[dict[str, Any]], recvs: list[dict[str, Any]]) -> None:
        stack = self._open.get(name)
        if stack:  # the schedule knows the messages' identity: it replaces the FIFO guess of P2PMessages
            stack[-1].args.update(sends=sends, recvs=recvs)

    # -- the end -----------------------------------------------------------------------------------
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._recorder is None:
            return
        if self._recorder.active:  # the run ended inside a window (max_steps, or a stop signal)
            self._finish_window()
        self._close()
        trainer.strategy.barrier("megascan")
        if self.detect and trainer.is_global_zero:
            from lightning_megatron.scan.analysis.detect import detect
            from lightning_megatron.scan.analysis.report import log_to

            self.report = detect(self.trace_dir, **self.detect_options)
            write_report(self.trace_dir, self.report)
            print(f"MegaScan ({self.trace_dir}):\n{self.report.table()}", flush=True)
            if trainer.logger is not None:
                log_to(trainer.logger, self.report, trainer.global_step)
        if self.detect:
            self.report = trainer.strategy.broadcast(self.report, src=0)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._close()
        if self._strategy is not None:
            self._strategy.remove_step_listener(self)
        if self._layers is not None:
            self._layers.detach()
            self._layers = None
        if self._clock_group is not None and self._clock_group is not dist.group.WORLD:
            dist.destroy_process_group(self._clock_group)
        self._clock_group = None

    def _close(self) -> None:
        """Leave nothing patched, open or profiling, whatever ended the run."""
        if self._profiler is not None:
            self._profiler.close()
        if self._collectives is not None:
            self._collectives.uninstall()
        if self._ring is not None:
            self._ring.uninstall()
        if self._moe is not None:
            self._moe.detach()
        if self._recorder is not None:
            self._recorder.shutdown()
        if self._file is not None:
            self._file.close()
            self._file = None
        self._run_delay.close()


def _cpu_wait(before: Optional[float], after: Optional[float]) -> dict[str, float]:
    """``{"cpu_wait_us": ...}``: the training thread's run-queue delay between two reads, or nothing."""
    return {} if before is None or after is None else {"cpu_wait_us": round(after - before, 1)}
