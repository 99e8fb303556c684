"""/metrics of N replicas as one exposition: every replica's samples with a ``replica`` label,
and their sum without one (a mean for the fractions: KV usage is not additive).

Also reads the load gauges routing wants (waiting requests, KV usage) from one replica's text.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

WAITING = "jaxserve:num_requests_waiting"
RUNNING = "jaxserve:num_requests_running"
KV_USAGE = "jaxserve:kv_cache_usage_perc"
_MEANS = {KV_USAGE}  # fractions: the replicas' mean, not their sum
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def load_gauges(text: str) -> dict[str, float]:
    """{WAITING, RUNNING, KV_USAGE} -> value, summed over label sets, from one replica."""
    found = {WAITING: 0.0, RUNNING: 0.0, KV_USAGE: 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name] += sample.value
    return found


def merge_expositions(texts: Sequence[str | None], extra: str = "") -> str:
    """One Prometheus text exposition of every replica's (None: a replica that did not
    answer, left out of the sums), then ``extra`` (the front's own lines)."""
    families: dict[str, tuple[str, str]] = {}  # name -> (type, help), first seen
    samples: dict[str, list[str]] = defaultdict(list)
    sums: dict[str, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for index, text in enumerate(texts):
        if text is None:
            continue
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            for sample in family.samples:
                labels = dict(sample.labels)
                sums[family.name][(sample.name, tuple(sorted(labels.items())))].append(sample.value)
                labels["replica"] = str(index)
                samples[family.name].append(_line(sample.name, labels, sample.value))
    lines = []
    for name, (kind, doc) in families.items():
        lines.append(f"# HELP {name} {_escape_help(doc)}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples[name])
        for (sample_name, labels), values in sums[name].items():
            total = sum(values) / len(values) if sample_name in _MEANS else sum(values)
            lines.append(_line(sample_name, dict(labels), total))
    return "\n".join(lines) + "\n" + extra


def _line(name: str, labels: dict[str, str], value: float) -> str:
    if labels:
        inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items())
        return f"{name}{{{inner}}} {_number(value)}"
    return f"{name} {_number(value)}"


def _number(value: float) -> str:
    if value == float("inf"):
        return "+Inf"
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n")
