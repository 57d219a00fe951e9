"""``loom bench guidellm``'s pieces that do not need guidellm: the scenario it hands each process and
how it reads a report back (guidellm itself runs in its own venv, ``make peer-guidellm``)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest.bench_guidellm import OUTPUT_TOKENS, PROMPT_TOKENS, RATE, _guidellm_tokens, _shares, scenario


def test_each_tenant_gets_a_scenario_with_its_own_key_and_the_local_tokenizer(tmp_path: Path) -> None:
    spec = scenario("127.0.0.1:8000", "sk-light", tmp_path / "tok", 60.0, tmp_path / "out.json", 3)["spec"]
    assert spec["backend"] == {
        "kind": "openai_http",
        "target": "http://127.0.0.1:8000",
        "model": "smollm2-135m-instruct",
        "api_key": "sk-light",
        "request_format": "/v1/completions",
    }
    assert spec["profile"] == {"kind": "poisson", "rate": [RATE]}
    assert spec["data"] == [
        {"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}
    ]
    assert spec["tokenizer"] == {"kind": "hf_auto", "model": str(tmp_path / "tok")}
    assert spec["constraints"] == [{"kind": "max_duration", "seconds": 60.0}]
    assert spec["outputs"] == [{"kind": "json", "path": str(tmp_path / "out.json")}]


def test_a_report_counts_the_tokens_of_requests_still_streaming_at_the_end(tmp_path: Path) -> None:
    def req(tokens: int | None, ttft: float | None) -> dict[str, object]:
        return {"output_tokens": tokens, "time_to_first_token_ms": ttft}

    report = {
        "benchmarks": [
            {
                "duration": 20.0,
                "requests": {
                    "successful": [req(64, 100.0), req(64, 300.0)],
                    "incomplete": [req(10, 200.0), req(None, None)],
                    "errored": [req(5, 50.0)],
                },
            }
        ]
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    got = _guidellm_tokens(path)
    assert got == {"output_tokens": 138.0, "seconds": 20.0, "requests": 2.0, "ttft_p50_ms": 200.0}
    shares = _shares(
        {"light": got, "heavy": {**got, "output_tokens": 414.0}}, {"light": 100.0, "heavy": 290.0}
    )
    assert abs(shares["client_ratio"] - 3.0) < 1e-9 and shares["server_ratio"] == 2.9
