"""The benchmark reports rendered from their Jinja2 templates (loadtest/templates/) are the committed ones.

Each committed ``results/*.json`` renders, through its writer, to exactly the committed Markdown beside
it: moving a report's prose into a template must not change a byte. The other tests cover branches the
committed runs do not take, and the helper's strictness.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import pytest

from loadtest import markdown

RESULTS = Path(__file__).resolve().parents[2] / "loadtest" / "results"

# (module, writer, the committed report without its extension)
REPORTS = [
    ("bench_engine", "to_markdown", "engine"),
    ("bench_engine", "to_markdown", "engine-vs-vllm/seqs32/engine"),
    ("bench_engine", "to_markdown", "engine-vs-vllm/seqs64/engine"),
    ("bench_gateway", "to_markdown", "gateway"),
    ("bench_lora", "to_markdown", "lora"),
    ("bench_structured", "to_markdown", "structured"),
    ("bench_fairness", "to_markdown", "fairness"),
    ("bench_noisy", "to_markdown", "noisy"),
    ("bench_slo", "to_markdown", "slo"),
    ("bench_guidellm", "to_markdown", "guidellm"),
    ("bench_speculative", "to_markdown", "speculative"),
    ("bench_isolation", "to_markdown", "isolation"),
    ("bench_admission", "markdown", "admission"),
    ("calibrate", "to_markdown", "calibration"),
    ("soak", "to_markdown", "soak"),
    ("soak", "fuzz_markdown", "fuzz"),
    ("sim_experiments", "to_markdown", "simulator"),
    ("bench_stream_cost", "to_markdown", "stream-cost"),
    ("bench_stream_cost", "to_markdown", "stream-cost-per-item"),
    ("bench_served_peer", "to_markdown", "served-vs-vllm"),
    ("bench_stream_cost", "sweep_markdown", "stream-cost-gateways"),
    *(
        ("report", "to_markdown", f"served/{p.parent.name}/report")
        for p in sorted(RESULTS.glob("served/*/report.json"))
    ),
]


def _writer(module: str, name: str) -> Callable[[dict[str, Any]], str]:
    return getattr(importlib.import_module(f"loadtest.{module}"), name)  # type: ignore[no-any-return]


def _load(stem: str) -> dict[str, Any]:
    return json.loads((RESULTS / f"{stem}.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize(("module", "name", "stem"), REPORTS, ids=[r[2] for r in REPORTS])
def test_committed_report_renders_to_the_committed_markdown(module: str, name: str, stem: str) -> None:
    assert _writer(module, name)(_load(stem)) == (RESULTS / f"{stem}.md").read_text()


def test_served_summary_renders_to_the_committed_markdown() -> None:
    from loadtest.bench_served import to_markdown

    served = _load("served")
    assert to_markdown(served["summary"], served["meta"]) == (RESULTS / "served.md").read_text()


def test_every_template_belongs_to_a_report() -> None:
    used = {"engine", "gateway", "lora", "isolation", "admission", "calibration", "soak", "fuzz"}
    used |= {"simulator", "served", "report", "stream-cost", "served-vs-vllm", "stream-cost-gateways"}
    used |= {"structured", "fairness", "noisy", "slo", "speculative", "guidellm"}
    assert {p.name.removesuffix(".md.j2") for p in markdown.TEMPLATES_DIR.glob("*.md.j2")} == used


def test_engine_report_without_native_bf16_and_optional_sections() -> None:
    report = _load("engine")
    report["native_bf16"] = False
    for key in ("peer", "agreement", "roofline", "roofline_points"):
        report.pop(key)
    del report["modes"]["continuous"]["mean_batch_size"]
    md = _writer("bench_engine", "to_markdown")(report)
    assert "No bfloat16 rows: this CPU has no native bf16" in md
    assert "| continuous | float32 | 6.699 | 491.0 | - | 49% | 2.9% | 19.1 |\n" in md
    assert "Peer:" not in md and "roofline" not in md and "Greedy top-1" not in md
    assert md.endswith(". Date 2026-12-02.\n")


def test_soak_report_growth_rates_and_no_leak_section() -> None:
    report = _load("soak")
    report["memory"]["gateway"]["mb_per_min_at_end"] = 1.25
    report["config"]["max_growth_mb_per_min"] = 2.5
    report["leaks"] = {}
    del report["tenants"]
    md = _writer("soak", "to_markdown")(report)
    assert "| gateway | 359.8 | 373.5 | 375.2 | 13.6 | 1.25 |\n" in md
    assert "| processes whose memory still grows over 2.5 MiB/min at the end | 0 |\n" in md
    assert "leases left" not in md and "Per tenant" not in md


def test_fuzz_report_lists_ten_problems() -> None:
    report = _load("fuzz")
    report["problems"] = []
    without = _writer("soak", "fuzz_markdown")(report)
    report["problems"] = [
        {"kind": f"k{i}", "note": "n", "code": "INTERNAL", "problems": ["internals"]} for i in range(12)
    ]
    md = _writer("soak", "fuzz_markdown")(report)
    assert md == without + "".join(f"- k{i} (n): INTERNAL: ['internals']\n" for i in range(10))


def test_calibration_report_marks_unmeasured_packed_rows() -> None:
    report = _load("calibration")
    report["gemm_paths_ms"]["packed"][2] = None
    md = _writer("calibrate", "to_markdown")(report)
    assert "| prepacked oneDNN | 1.17 | 1.35 | - | 4.45 | 2.12 | 2.93 |\n" in md


def test_a_missing_field_is_an_error_not_an_empty_cell() -> None:
    report = _load("gateway")
    del report["added"]["gateway_over_engine_p50_ms"]
    with pytest.raises(jinja2.UndefinedError):
        _writer("bench_gateway", "to_markdown")(report)


def test_render_helpers() -> None:
    assert markdown.render("lora.md.j2", report=_load("lora")) == (RESULTS / "lora.md").read_text()
    assert markdown._cell({"a": 0.5}, "a", ".0%") == "50%"
    assert markdown._cell({}, "a", ".0%") == "-"


def test_load_test_report_utilization_with_bandwidth_restarts_and_no_knee() -> None:
    report = _load("served/knee/report")
    report["sweep"].update(knee=None, max_sustained=None)
    u = report["stages"][0]["utilization"]
    u.update(copy_bandwidth_gbs=12.5, skipped=["r1", "r2"])
    replica = next(iter(u["replicas"].values()))
    replica.update(restarts=2, mbu=0.5, mbu_wall=0.25)
    report["stages"][1]["utilization"] = {"replicas": {}, "all": None}
    md = _writer("report", "to_markdown")(report)
    assert "\nKnee: none (p99 TTFT over the SLO at every rate).\n\n![knee](knee.png)\n" in md
    assert " (2 restarts) | " in md and "| 50.0% / 25.0% |\n" in md
    assert "the copy bandwidth given (12.5 GB/s, --copy-bandwidth-gbs)" in md
    assert "\n\nFewer than two scrapes in the window, not reported: r1, r2.\n\n## Stage 0.5 req/s\n" in md
    assert "\n\nUtilization: no replica had two scrapes" in md
