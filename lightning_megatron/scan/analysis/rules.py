"""Detection as a declared pipeline: every rule of ``scan.analysis.detect``, in the order it runs.

Each ``Rule`` (``rules_common``) says what it is (``name``), the suspect kind it names (``names``), and which rules
before it it reads (``reads``): to add its evidence to their suspects, to leave their ranks out (one cause, one
name), or to judge them. Rules that find suspects append them to ``DetectionContext.suspects``; the others
(attribution, merging) return the revised list. The order matters where a rule reads another: the compute rules
come first, so that attribution judges all of them before links and waits are compared, and the rules that keep
one name per rank run last.

Why declared here: the order and the dependencies are what a maintainer must know to add or change a rule, and
they were implicit in one long function. ``run_rules`` is all ``detect`` does between measuring and reporting.
"""

from __future__ import annotations

from lightning_megatron.scan.analysis.attribution import attribute_busy, attribute_host, fold_consequences
from lightning_megatron.scan.analysis.compute_rules import compute_suspects, own_history_suspects, step_suspects
from lightning_megatron.scan.analysis.cpu_rules import cpu_wait_rule
from lightning_megatron.scan.analysis.link_rules import link_suspects
from lightning_megatron.scan.analysis.report import Suspect
from lightning_megatron.scan.analysis.rules_common import DetectionContext, Rule
from lightning_megatron.scan.analysis.stage_rules import cross_stage_step_suspects, cross_stage_suspects
from lightning_megatron.scan.analysis.wait_rules import data_wait_suspects, host_gap_suspects, host_in_step_suspects

__all__ = ["RULES", "run_rules"]

_COMPUTE = ("compute per op", "compute per step", "compute across stages", "typical layer across stages")
_ATTRIBUTION = ("GPU busy time", "host pacing")
_HOST = (*_ATTRIBUTION, "host gaps", "host inside steps")

RULES: tuple[Rule, ...] = (
    Rule("compute per op", "compute", (), compute_suspects),
    Rule("compute per step", "compute", ("compute per op",), step_suspects),
    Rule("compute across stages", "compute", (), cross_stage_suspects),
    Rule("typical layer across stages", "compute", _COMPUTE[:3], cross_stage_step_suspects),
    Rule("compute against itself", "compute", _COMPUTE, own_history_suspects),
    Rule(
        "GPU busy time", "compute -> host or none", (*_COMPUTE, "compute against itself"), attribute_busy, finds=False
    ),
    Rule(
        "host pacing",
        "compute -> host or none",
        (*_COMPUTE, "compute against itself", "GPU busy time"),
        attribute_host,
        finds=False,
    ),
    Rule("links", "link", (), link_suspects),
    Rule("data waits", "data", (), data_wait_suspects),
    Rule("host gaps", "host", _ATTRIBUTION, host_gap_suspects),
    Rule("host inside steps", "host", _HOST[:3], host_in_step_suspects),
    Rule("waits for a CPU", "host", (*_COMPUTE, "compute against itself", *_HOST), cpu_wait_rule, finds=False),
    Rule("one cause per rank", "host, link -> evidence", (*_COMPUTE, *_HOST, "links"), fold_consequences, finds=False),
)
"""The rules in the order they run."""


def run_rules(context: DetectionContext, rules: tuple[Rule, ...] = RULES) -> list[Suspect]:
    """Run ``rules`` in order on ``context``; returns its suspects, most costly per step first."""
    for rule in rules:
        rule.apply(context)
    return sorted(context.suspects, key=lambda s: (-s.impact_ms, -s.slowdown, s.rank))
