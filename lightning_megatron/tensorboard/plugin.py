"""The ``megascan`` TensorBoard plugin: MegaScan's traces and slow-rank reports as a TensorBoard tab.

The contract: HTTP routes over ``runs.RunStore`` and one static ES module, nothing else. TensorBoard finds the
plugin through the ``tensorboard_plugins`` entry point, serves the routes under ``/data/plugin/megascan/`` and
loads ``index.js`` in an iframe (``frontend_metadata``); every route answers JSON, except the tab's modules and
the merged trace. Every argument is checked (``runs.BadRequest`` → 400, ``runs.NotFound`` → 404, as
``{"error": message}``); only files under the logdir are read, and only the plugin's own cache is written.

Routes (``run`` is a name from ``/runs``):

* ``/runs``: the runs under the logdir;
* ``/suspects?run=R[&detect=1]``: the run's detection report (saved, or computed on request);
* ``/heatmap?run=R``: per rank × step, step time and its compute / communication-and-wait / other split;
* ``/timeline?run=R&step=S[&ranks=0-7,12]``: one step of the clock-aligned timeline, spans and flows;
* ``/trace?run=R[&download=1]``: the merged, clock-aligned Chrome trace (gzip-encoded JSON);
* ``/index.js`` and the modules it imports (``STATIC_FILES``): the tab.

This module imports neither torch, Lightning nor megatron-core (it runs inside TensorBoard, which must start
in seconds, and may be installed where no training happens); ``lightning_megatron``'s package ``__init__``
files are lazy for this reason.
"""

from __future__ import annotations

import gzip
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from tensorboard.backend import http_util
from tensorboard.plugins import base_plugin
from werkzeug import wrappers, wsgi

from lightning_megatron.tensorboard.runs import BadRequest, RunError, RunStore, parse_ranks

__all__ = ["PLUGIN_NAME", "MegaScanPlugin"]

PLUGIN_NAME = "megascan"
STATIC_DIR = Path(__file__).parent / "static"
# the tab's ES modules, served as they are
STATIC_FILES = ("index.js", "common.js", "heatmap.js", "timeline.js", "bubbles.js")
INACTIVE_RECHECK_S = 10.0  # an inactive verdict is reused this long (a run may start writing any time)
_TRUE = ("1", "true", "yes")


def _json(request: wrappers.Request, payload: Any, code: int = 200) -> wrappers.Response:
    return http_util.Respond(request, payload, "application/json", code=code)


def _route(handler: Callable[[Any, wrappers.Request], wrappers.Response]) -> Callable[..., Any]:
    """A WSGI app from a method: GET only, refusals from ``RunStore`` as JSON errors with their status."""

    @wrappers.Request.application
    def app(self: Any, request: wrappers.Request) -> wrappers.Response:
        if request.method not in ("GET", "HEAD"):
            return _json(request, {"error": "method not allowed"}, 405)
        try:
            return handler(self, request)
        except RunError as err:
            return _json(request, {"error": str(err)}, err.status)

    app.__doc__ = handler.__doc__
    return app


def _static(name: str) -> Callable[..., Any]:
    """The app serving one of the tab's modules: a fixed file, no path from the request is ever used."""
    path = STATIC_DIR / name

    @wrappers.Request.application
    def app(request: wrappers.Request) -> wrappers.Response:
        if request.method not in ("GET", "HEAD"):
            return _json(request, {"error": "method not allowed"}, 405)
        return http_util.Respond(request, path.read_bytes(), "application/javascript")

    return app


def _step_arg(request: wrappers.Request) -> int:
    text = request.args.get("step", "")
    if not re.fullmatch(r"\d{1,9}", text):
        raise BadRequest("step must be a non-negative integer")
    return int(text)


class MegaScanPlugin(base_plugin.TBPlugin):
    """TensorBoard's view of the MegaScan runs under its logdir (see the module docstring)."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        super().__init__(context)
        logdir = context.logdir or ""
        # only local directories: a cloud logdir (gs://, s3://) holds no MegaScan files we can read
        self._store = RunStore("" if "://" in logdir else logdir)
        self._active: Optional[tuple[bool, float]] = None
        self._active_lock = threading.Lock()

    def get_plugin_apps(self) -> dict[str, Callable[..., Any]]:
        return {
            **{f"/{name}": _static(name) for name in STATIC_FILES},
            "/runs": self._serve_runs,
            "/suspects": self._serve_suspects,
            "/heatmap": self._serve_heatmap,
            "/timeline": self._serve_timeline,
            "/trace": self._serve_trace,
        }

    def is_active(self) -> bool:
        """Whether the logdir holds a MegaScan run: a bounded look (``runs.ACTIVE_DIRS`` directories), cached
        for good once true and for ``INACTIVE_RECHECK_S`` when false (TensorBoard asks on every page load)."""
        with self._active_lock:
            if self._active is not None and (
                self._active[0] or time.monotonic() - self._active[1] < INACTIVE_RECHECK_S
            ):
                return self._active[0]
        active = self._store.has_runs()
        with self._active_lock:
            self._active = (active, time.monotonic())
        return active

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js", tab_name="MegaScan", disable_reload=True)

    # ------------------------------------------------------------------------------------------ routes

    @_route
    def _serve_runs(self, request: wrappers.Request) -> wrappers.Response:
        return _json(request, {"runs": self._store.runs()})

    @_route
    def _serve_suspects(self, request: wrappers.Request) -> wrappers.Response:
        detect = request.args.get("detect", "0").lower() in _TRUE
        return _json(request, self._store.report(request.args.get("run", ""), detect=detect))

    @_route
    def _serve_heatmap(self, request: wrappers.Request) -> wrappers.Response:
        return _json(request, self._store.heatmap(request.args.get("run", "")))

    @_route
    def _serve_timeline(self, request: wrappers.Request) -> wrappers.Response:
        run, step = request.args.get("run", ""), _step_arg(request)
        ranks_text = request.args.get("ranks", "")
        ranks = parse_ranks(ranks_text) if ranks_text else None
        return _json(request, self._store.timeline(run, step, ranks))

    @_route
    def _serve_trace(self, request: wrappers.Request) -> wrappers.Response:
        """The merged trace, streamed: gzip-encoded to clients that accept it (browsers decode it on the fly),
        decompressed for the others; an attachment named after the run with ``download=1``."""
        run = request.args.get("run", "")
        path = self._store.merged_trace(run)
        headers = [("X-Content-Type-Options", "nosniff"), ("Cache-Control", "no-cache, must-revalidate")]
        if request.args.get("download", "0").lower() in _TRUE:
            safe = re.sub(r"[^A-Za-z0-9._-]+", "_", run).strip("._") or "run"
            headers.append(("Content-Disposition", f'attachment; filename="megascan-{safe}-merged.json"'))
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            headers += [("Content-Encoding", "gzip"), ("Content-Length", str(path.stat().st_size))]
            stream: Any = open(path, "rb")  # noqa: SIM115  (closed by the WSGI server through wrap_file)
        else:
            stream = gzip.open(path, "rb")
        body = wsgi.wrap_file(request.environ, stream)
        return wrappers.Response(body, mimetype="application/json", headers=headers, direct_passthrough=True)
