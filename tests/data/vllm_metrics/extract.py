"""Writes vllm_0.32.0_metrics.json beside it: the metrics vLLM 0.32.0 registers, by name, with
their type, labels and (histograms) bucket edges, read from the installed package's source.

    ~/.cache/peers/vllm-venv/bin/python tests/data/vllm_metrics/extract.py

Reads vllm/v1/metrics/loggers.py (the Prometheus stat logger: every engine and request metric)
and vllm/v1/spec_decode/metrics.py (speculative decoding) with ``ast``, without running vLLM
(its logger needs a whole engine config): each call with ``name="vllm:..."`` is one metric, its
type from the constructor (``_gauge_cls``, ``_counter_cls``, ``_histogram_cls``), its buckets
from the ``histogram_buckets(family)`` the call's ``buckets=`` variable was made by, and that
family's edges from vllm/v1/metrics/buckets.py (imported: it is plain Python). Counters are
listed as registered (prometheus_client exports them with ``_total``).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import vllm
from vllm.v1.metrics import buckets as vllm_buckets

SOURCES = ("v1/metrics/loggers.py", "v1/spec_decode/metrics.py")
KINDS = ("histogram", "counter", "gauge")


def _kind(func: ast.expr) -> str | None:
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return next((k for k in KINDS if k in name.lower()), None)


def _families(tree: ast.AST) -> dict[str, str]:
    """variable -> bucket family, from ``var = histogram_buckets("family", ...)``."""
    out = {}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "histogram_buckets" and node.value.args
                and isinstance(node.value.args[0], ast.Constant)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.args[0].value
    return out


def _edges(family: str) -> list[float] | str:
    if family == "request_tokens":  # vLLM's 1-2-5 series up to the served max_model_len
        return "1-2-5 series up to max_model_len"
    return list(vllm_buckets.histogram_buckets(family))


def extract(root: Path) -> dict[str, dict]:
    metrics: dict[str, dict] = {}
    for rel in SOURCES:
        path = root / rel
        tree = ast.parse(path.read_text())
        families = _families(tree)
        labels_var = next((ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                           and getattr(n.targets[0], "id", "") == "labelnames" and isinstance(n.value, ast.List)),
                          ["model_name", "engine"])
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            kw = {k.arg: k.value for k in node.keywords if k.arg}
            name = kw.get("name")
            if not (isinstance(name, ast.Constant) and str(name.value).startswith("vllm:")):
                continue
            kind = _kind(node.func)
            if kind is None:
                continue
            entry: dict = {"type": kind, "source": f"vllm/{rel}"}
            doc = kw.get("documentation")
            if isinstance(doc, ast.Constant):
                entry["documentation"] = doc.value
            elif isinstance(doc, ast.JoinedStr | ast.BinOp) or doc is not None:
                try:
                    entry["documentation"] = ast.literal_eval(doc)
                except ValueError:
                    pass
            labels = kw.get("labelnames")
            if isinstance(labels, ast.List | ast.Tuple) and all(isinstance(e, ast.Constant) for e in labels.elts):
                entry["labels"] = [e.value for e in labels.elts]
            elif isinstance(labels, ast.Name) and labels.id == "labelnames":
                entry["labels"] = labels_var
            if kind == "histogram":
                b = kw.get("buckets")
                family = families.get(b.id) if isinstance(b, ast.Name) else None
                if family is not None:
                    entry["bucket_family"] = family
                    entry["buckets"] = _edges(family)
            metrics[name.value] = entry
        for node in ast.walk(tree):
            # counters made in a loop over [(name, documentation), ...] (speculative decoding), and
            # the info gauge made from ``name = "vllm:cache_config_info"``
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.List):
                target = getattr(node.targets[0], "id", "")
                kind = _kind(ast.Name(id=target))
                for elt in node.value.elts:
                    if (kind and isinstance(elt, ast.Tuple) and isinstance(elt.elts[0], ast.Constant)
                            and str(elt.elts[0].value).startswith("vllm:")):
                        metrics.setdefault(elt.elts[0].value, {"type": kind, "source": f"vllm/{rel}",
                                                               "documentation": ast.literal_eval(elt.elts[1]),
                                                               "labels": labels_var})
            elif (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "name"
                  and isinstance(node.value, ast.Constant) and str(node.value.value).endswith("_info")):
                metrics.setdefault(node.value.value, {"type": "gauge", "source": f"vllm/{rel}",
                                                      "labels": "the config's metrics_info() keys and engine"})
    return dict(sorted(metrics.items()))


if __name__ == "__main__":
    root = Path(vllm.__file__).parent
    out = {"vllm_version": "0.32.0", "metrics": extract(root)}
    target = Path(__file__).with_name("vllm_0.32.0_metrics.json")
    target.write_text(json.dumps(out, indent=1) + "\n")
    print(f"{len(out['metrics'])} metrics -> {target}", file=sys.stderr)
