"""MegaScan against a rank's own history: where in a run a slowdown can begin and still be found (CPU, synthetic).

    python benchmarks/megascan_onsets.py --out benchmarks/results/megascan/megascan_onsets_synthetic.json
    python benchmarks/megascan_onsets.py --seeds 5 --onsets 8 17 --out /tmp/onsets.json     # a quick look

One process, ``--steps`` steps (34 by default, as ``megascan_eval.py --layouts single``), traced by the synthetic
generator (``scan/evaluation/synthetic.py``: GPU busy time and queue fields, 2 % jitter per span). Its compute slows
1.8x from an onset step on, in every step (continuous) or in a random 60 % / 50 % of them (bursts); ``detect`` runs on
the traces as at fit end. A run counts as found when the only suspect is the rank with kind ``compute``. Clean runs
(the same seeds, no fault) count the false alarms. Every case runs the same seeds, so two versions of the rules
are compared on identical traces.

The GPU counterpart, with real faults, is ``megascan_eval.py --layouts single --onset F``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path

from provenance import provenance  # noqa: E402  (benchmarks/ is the script's directory)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FRACTIONS = {"continuous": 1.0, "bursts-60%": 0.6, "bursts-50%": 0.5}


def detected(
    out_dir: Path, *, seed: int, steps: int, onset: int | None, fraction: float, jitter: float
) -> list[tuple[int, str]]:
    """The (rank, kind) suspects of one synthetic one-process run; ``onset`` None: a clean run."""
    from lightning_megatron.scan.analysis.detect import detect
    from lightning_megatron.scan.evaluation.synthetic import generate_traces

    fault = {} if onset is None else dict(slow_ranks={0: 1.8}, slow_from_step=onset, slow_step_fraction=fraction)
    shape = dict(dp=1, pp=1, tp=1, steps=steps, gpu_busy=True, gpu_queue=True, seed=seed, jitter=jitter)
    generate_traces(out_dir, **shape, **fault)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = detect(out_dir)
    return [(s.rank, s.kind) for s in report.suspects]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=34)
    parser.add_argument("--onsets", type=int, nargs="*", default=[4, 8, 12, 17, 22, 26, 29, 31])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--clean-seeds", type=int, default=200, help="clean runs (cheap: a false alarm is rare)")
    parser.add_argument("--faults", nargs="*", default=list(FRACTIONS), choices=list(FRACTIONS))
    parser.add_argument("--jitter", type=float, default=0.02, help="relative noise of every span")
    parser.add_argument("--label", default="", help="names this version of the rules in the output")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--append", action="store_true", help="add this run to the ones already in --out")
    args = parser.parse_args()

    report = {
        "what": "one-process synthetic runs, compute 1.8x from an onset step: found (only suspect: rank 0 compute) "
        "of --seeds seeds, and false alarms in clean runs of the same seeds",
        **provenance(),
        "runs": [],
    }
    if args.append and args.out.exists():
        previous = json.loads(args.out.read_text())
        report["runs"] = previous["runs"]
        report["commands"] = previous.get("commands", [previous["command"]]) + [report["command"]]
    run: dict = {"label": args.label, "steps": args.steps, "jitter": args.jitter, "seeds": args.seeds, "found": {}}
    run["wrong"] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for fault in args.faults:
            found_row, wrong_row = {}, {}
            for onset in args.onsets:
                found = wrong = 0
                for seed in range(args.seeds):
                    out = Path(tmp, f"{fault}-{onset}-{seed}")
                    named = detected(
                        out, seed=seed, steps=args.steps, onset=onset, fraction=FRACTIONS[fault], jitter=args.jitter
                    )
                    found += named == [(0, "compute")]
                    wrong += any(suspect != (0, "compute") for suspect in named)
                found_row[str(onset)], wrong_row[str(onset)] = found, wrong
                print(f"{fault:>12}  onset {onset:>3}: found {found:>3} of {args.seeds}, wrong suspects {wrong}")
            run["found"][fault], run["wrong"][fault] = found_row, wrong_row
        alarms = sum(
            bool(
                detected(
                    Path(tmp, f"clean-{seed}"),
                    seed=seed,
                    steps=args.steps,
                    onset=None,
                    fraction=1.0,
                    jitter=args.jitter,
                )
            )
            for seed in range(args.clean_seeds)
        )
    run["clean_runs"], run["clean_false_alarms"] = args.clean_seeds, alarms
    run["seconds"] = round(time.perf_counter() - started, 1)
    print(f"clean runs with a suspect: {alarms} of {args.clean_seeds} ({run['seconds']} s)")
    report["runs"].append(run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
