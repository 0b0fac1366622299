"""The link rule of ``scan.analysis.rules``: which ordered links move their bytes slower than their peers
(``kind="link"``).

The contract: p2p transfers matched per link (``measure.link_transfers``, through the context) in, ``link``
suspects out (the sender is the suspect's ``rank``, the receiver its ``peer``), with the statistics of
``scan.analysis.compare``. Links are compared per byte within a class (direction, and whether both ends share a
host: NVLink and network links are not peers); spans holding several ops and transfers a slow host paced are
left out where the clean ones suffice (``link_suspects``).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from lightning_megatron.scan.analysis.compare import compare_with_peers, levels_of, pooled_sigma
from lightning_megatron.scan.analysis.measure import Link, Transfer, clock_sigma
from lightning_megatron.scan.analysis.report import Suspect
from lightning_megatron.scan.analysis.rules_common import DetectionContext, flagged, make_suspect

__all__ = ["link_suspects"]

_MIN_CLEAN = 3  # transfers per link with both ends alone in their spans, to compare only those


def link_suspects(context: DetectionContext) -> list[Suspect]:
    """Compare the links' transfer time per byte within a link class (direction, and whether both ends are on
    one host: NVLink and network links are not peers).

    A span that holds several ops (megatron-core's ``send-forward-recv-backward``) ends when the slowest of
    them is done and starts before the last of them is posted, so a transfer measured through it can only come
    out too long: a delayed send to Q also stretches the receive from Q in the same span, and the healthy
    reverse link would look slow too. Where every link of a class has at least ``_MIN_CLEAN`` transfers with
    both ends alone in their spans (pipeline warm-up and cool-down have them), only those are compared."""
    traces, transfers, notes = context.traces, context.transfers, context.notes
    min_slowdown, min_z, min_impact_us = context.min_slowdown, context.min_z, context.min_impact_us
    classes: dict[tuple[str, bool], list[Link]] = defaultdict(list)
    for link in transfers:
        src, dst, direction = link
        classes[(direction, traces[src].host == traces[dst].host)].append(link)
    # Two stages have one link each way: no link has a peer in its direction. Activations forward and their
    # gradients backward have the same shape, so the two directions become one class there (per byte).
    for same_host in (False, True):
        lone = [key for key, links in classes.items() if key[1] == same_host and len(links) < 2]
        if len(lone) == 2:
            classes[("both", same_host)] = [link for key in lone for link in classes.pop(key)]
    # Transfers whose span measured a slow host, not the link (``measure.host_paced``), are left out; a class
    # with a link left too few of them is not compared.
    paced = {link: [t for t in samples if not t.host_paced] for link, samples in transfers.items()}
    for key, links in list(classes.items()):
        if any(len(paced[link]) < _MIN_CLEAN for link in links):
            if any(len(paced[link]) < len(transfers[link]) for link in links):
                notes.append(
                    f"{key[0]} links: fewer than {_MIN_CLEAN} transfers of a link were not paced by their host; "
                    "links not compared"
                )
            del classes[key]
    transfers = paced
    chosen: dict[Link, list[Transfer]] = {}
    for links in classes.values():
        clean = all(sum(t.clean for t in transfers[link]) >= _MIN_CLEAN for link in links)
        for link in links:
            chosen[link] = [t for t in transfers[link] if t.clean or not clean]
    everywhere = pooled_sigma([t.us / t.bytes for t in samples] for samples in chosen.values())
    suspects = []
    for (direction, same_host), links in sorted(classes.items()):
        if len(links) < 2:
            continue
        floor = max(pooled_sigma([t.us / t.bytes for t in chosen[link]] for link in links), everywhere)
        levels = {}
        for link in links:
            samples = chosen[link]
            level = levels_of({"per_byte": [t.us / t.bytes for t in samples]}, floor)["per_byte"]
            # a clock error is systematic for a link: no number of samples averages it away. It counts when
            # the median rests on cross-clock samples.
            if sum(t.cross_clock for t in samples) >= 0.25 * len(samples):
                typical_bytes = statistics.median(t.bytes for t in samples)
                level.se = math.hypot(level.se, clock_sigma(traces[link[0]], traces[link[1]]) / typical_bytes)
            levels[link] = {"per_byte": level}
        for c in compare_with_peers(levels):
            if not flagged(c, min_slowdown, min_z):
                continue
            src, dst, _ = c.member
            samples = chosen[c.member]
            median_us = statistics.median(t.us for t in samples)
            per_step = len(transfers[c.member]) / max(len({t.step for t in transfers[c.member]}), 1)
            impact_us = per_step * median_us * c.excess / (1 + c.excess)
            if impact_us < min_impact_us:
                continue
            evidence = {
                "direction": direction,
                "link_class": f"{direction} {'intra-host' if same_host else 'inter-host'}",
                "median_us_per_mb": c.median * 1e6,
                "baseline_us_per_mb": c.baseline * 1e6,
                "median_transfer_ms": median_us / 1000,
                "transfers": len(samples),
                "clean_only": len(samples) < len(transfers[c.member]),
                "transfers_per_step": per_step,
                "z": round(c.z, 2),
                "superiority": round(c.superiority, 3),
                "compared_links": len(links) - 1,
                "impact_ms": impact_us / 1000,
            }
            suspects.append(make_suspect(traces[src], "link", c.excess, evidence, peer=dst))
    return suspects
