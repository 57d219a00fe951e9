"""Workload files: the YAML that says what load ``loom loadtest`` (and the simulator) generate.

One file describes who calls (tenants, their keys, their share of the traffic, their priority mix),
when (the arrival process: Poisson, constant, on/off bursts, or a sweep of rates), what (prompt and
output length distributions, seeded) and for how long (arrival window, request cap, wall-clock cap).
The same file drives the served system and the simulator, so a what-if on the simulator and a
measurement on the served system answer the same question.

A bad file fails before anything is sent, with every problem named by its path in the file
(``tenants.1.priorities.urgent: ...``), because a load test that starts and then dies on a typo in
minute three wastes the machine it ran on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from common import Priority


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the file and every bad field."""


class _Strict(BaseModel):
    # Unknown keys are errors: a misspelt ``burst_rate`` silently ignored would measure the wrong load.
    model_config = ConfigDict(extra="forbid", frozen=True)


Front = Literal["grpc", "http"]  # the gateway's gRPC service, or its OpenAI-compatible HTTP front


# ---- length distributions -----------------------------------------------------------------------


class LognormalLength(_Strict):
    """Long-tailed lengths (most short, a few very long): the case where static batching loses."""

    dist: Literal["lognormal"] = "lognormal"
    median: float = Field(gt=0)
    sigma: float = Field(ge=0, le=4)
    min: int = Field(1, ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> LognormalLength:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self


class UniformLength(_Strict):
    dist: Literal["uniform"] = "uniform"
    min: int = Field(ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> UniformLength:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self


class ConstantLength(_Strict):
    dist: Literal["constant"] = "constant"
    value: int = Field(ge=1)


class ChoiceLength(_Strict):
    dist: Literal["choice"] = "choice"
    values: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)
    weights: list[Annotated[float, Field(ge=0)]] | None = None

    @model_validator(mode="after")
    def _weights(self) -> ChoiceLength:
        if self.weights is not None:
            if len(self.weights) != len(self.values):
                raise ValueError(f"{len(self.weights)} weights for {len(self.values)} values")
            if sum(self.weights) <= 0:
                raise ValueError("weights must not all be zero")
        return self


LengthDist = Annotated[
    LognormalLength | UniformLength | ConstantLength | ChoiceLength, Field(discriminator="dist")
]


# ---- arrival processes --------------------------------------------------------------------------


class PoissonArrival(_Strict):
    """Independent arrivals at a mean rate: the open-loop default (clients do not wait for each other)."""

    process: Literal["poisson"] = "poisson"
    rate: float = Field(gt=0, description="requests per second")


class ConstantArrival(_Strict):
    """Evenly spaced arrivals: no burstiness at all, a lower bound on queueing."""

    process: Literal["constant"] = "constant"
    rate: float = Field(gt=0)


class BurstyArrival(_Strict):
    """On/off Poisson: ``burst_rate`` during ``burst_s`` of every ``period_s``, ``base_rate`` otherwise.

    ``phase_s`` shifts the bursts, so several tenants can burst out of phase (the case pooling wins).
    """

    process: Literal["bursty"] = "bursty"
    base_rate: float = Field(0.0, ge=0)
    burst_rate: float = Field(gt=0)
    period_s: float = Field(gt=0)
    burst_s: float = Field(gt=0)
    phase_s: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _burst_fits(self) -> BurstyArrival:
        if self.burst_s > self.period_s:
            raise ValueError(f"burst_s ({self.burst_s}) is longer than period_s ({self.period_s})")
        return self

    @property
    def mean_rate(self) -> float:
        on = self.burst_s / self.period_s
        return on * self.burst_rate + (1 - on) * self.base_rate


class SweepArrival(_Strict):
    """A series of stages at growing offered rates, each ``stage_s`` long: finds the knee."""

    process: Literal["sweep"] = "sweep"
    rates: list[Annotated[float, Field(gt=0)]] = Field(min_length=1)
    stage_s: float | None = Field(None, gt=0, description="default: the workload's duration_s")
    shape: Literal["poisson", "constant"] = "poisson"


Arrival = Annotated[
    PoissonArrival | ConstantArrival | BurstyArrival | SweepArrival, Field(discriminator="process")
]


# ---- the workload --------------------------------------------------------------------------------

PriorityMix = dict[Priority, Annotated[float, Field(ge=0)]]


def _check_mix(mix: PriorityMix | None) -> PriorityMix | None:
    if mix is not None and (not mix or sum(mix.values()) <= 0):
        raise ValueError("a priority mix needs at least one class with a positive weight")
    return mix


class TenantLoad(_Strict):
    """One tenant of the load: its key, its share of the traffic and its own mix."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    api_key: str | None = Field(None, description="the key itself (prefer api_key_env)")
    api_key_env: str | None = Field(None, description="name of the environment variable holding the key")
    share: float = Field(1.0, gt=0, description="weight in the workload-wide arrival process")
    arrival: Arrival | None = Field(None, description="an arrival process of its own (not a sweep)")
    priorities: PriorityMix | None = None
    prompt: LengthDist | None = None
    output: LengthDist | None = None
    weight: float = Field(
        1.0, gt=0, description="its fair-share weight in the tenant store (the simulator uses it)"
    )
    front: Front | None = Field(
        None, description="the front its requests go through; default: the workload's"
    )

    @field_validator("priorities")
    @classmethod
    def _mix(cls, value: PriorityMix | None) -> PriorityMix | None:
        return _check_mix(value)

    @model_validator(mode="after")
    def _no_sweep(self) -> TenantLoad:
        if isinstance(self.arrival, SweepArrival):
            raise ValueError("a sweep is workload-wide: put it under the top-level 'arrival'")
        return self


class Target(_Strict):
    address: str = Field("127.0.0.1:50051", min_length=1, description="the gateway's gRPC host:port")
    http_address: str = Field(
        "127.0.0.1:8000", min_length=1, description="the OpenAI-compatible HTTP front's host:port"
    )
    model: str = Field("smollm2-135m-instruct", min_length=1)
    metrics_url: str | None = Field(
        "http://127.0.0.1:9464/metrics", description="the gateway's Prometheus endpoint; null: none"
    )

    @model_validator(mode="before")
    @classmethod
    def _no_driver(cls, data: Any) -> Any:
        if isinstance(data, dict) and "driver" in data:
            raise ValueError(
                "'target.driver' is now the workload's (or a tenant's) 'front: grpc|http'; move it there"
            )
        return data


class Slo(_Strict):
    """A request is 'good' when it succeeded, its TTFT and its mean inter-token gap are within these."""

    ttft_s: float = Field(1.0, gt=0)
    itl_s: float = Field(0.2, gt=0)


class Workload(_Strict):
    name: str = Field(min_length=1, max_length=80, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    target: Target = Field(default_factory=Target)
    seed: int = 0
    duration_s: float = Field(30.0, gt=0, le=3600, description="arrival window (per stage in a sweep)")
    max_requests: int = Field(1000, ge=1, le=1_000_000, description="requests sent, all stages together")
    max_seconds: float = Field(
        300.0, gt=0, le=4 * 3600, description="wall-clock cap of the whole run, draining included"
    )
    drain_s: float = Field(30.0, ge=0, description="after the last arrival, how long streams may finish")
    max_in_flight: int = Field(512, ge=1, description="above this the client drops (and counts) arrivals")
    request_timeout_s: float = Field(120.0, gt=0)
    arrival: Arrival | None = Field(None, description="shared by tenants without an arrival of their own")
    priorities: PriorityMix = Field(default_factory=lambda: {Priority.STANDARD: 1.0})
    prompt: LengthDist = Field(
        default_factory=lambda: LognormalLength(median=48, sigma=0.6, min=4, max=512),
        description="prompt length in words (about one token each for SmolLM2's tokenizer)",
    )
    output: LengthDist = Field(
        default_factory=lambda: LognormalLength(median=48, sigma=1.0, min=4, max=512),
        description="max_tokens of each request (long-tailed by default)",
    )
    temperature: float = Field(0.0, ge=0, le=2)
    chat: bool = Field(False, description="send messages (chat template) instead of a raw prompt")
    front: Front = Field(
        "grpc", description="grpc (loom.v1.Inference) or http (/v1/completions, chat: /v1/chat/completions)"
    )
    slo: Slo = Field(default_factory=Slo)
    tenants: list[TenantLoad] = Field(min_length=1)

    @field_validator("priorities")
    @classmethod
    def _mix(cls, value: PriorityMix | None) -> PriorityMix | None:
        return _check_mix(value)

    @model_validator(mode="after")
    def _coherent(self) -> Workload:
        names = [t.name for t in self.tenants]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"tenant names must be unique; repeated: {', '.join(dupes)}")
        shared = [t.name for t in self.tenants if t.arrival is None]
        if shared and self.arrival is None:
            raise ValueError(
                f"tenants {', '.join(shared)} have no arrival of their own and the workload has none"
            )
        if isinstance(self.arrival, SweepArrival):
            own = [t.name for t in self.tenants if t.arrival is not None]
            if own:
                raise ValueError(f"in a sweep every tenant shares its rate; {', '.join(own)} set their own")
        return self

    def front_of(self, tenant: str) -> str:
        """The front ``tenant``'s requests go through: its own ``front``, else the workload's."""
        for t in self.tenants:
            if t.name == tenant:
                return t.front or self.front
        raise KeyError(tenant)

    @property
    def fronts(self) -> dict[str, str]:
        """{tenant: front} for every tenant."""
        return {t.name: t.front or self.front for t in self.tenants}

    @property
    def is_sweep(self) -> bool:
        return isinstance(self.arrival, SweepArrival)

    def stage_s(self) -> float:
        if isinstance(self.arrival, SweepArrival) and self.arrival.stage_s is not None:
            return self.arrival.stage_s
        return self.duration_s

    def resolve_keys(
        self, overrides: dict[str, str] | None = None, env: dict[str, str] | None = None
    ) -> dict[str, str]:
        """Each tenant's API key: ``--api-key NAME=KEY`` first, then ``api_key``, then ``api_key_env``."""
        overrides = overrides or {}
        env = dict(os.environ) if env is None else env
        unknown = sorted(set(overrides) - {t.name for t in self.tenants})
        if unknown:
            raise WorkloadError(f"--api-key for tenants not in the workload: {', '.join(unknown)}")
        keys: dict[str, str] = {}
        missing: list[str] = []
        for t in self.tenants:
            key = overrides.get(t.name) or t.api_key or (env.get(t.api_key_env) if t.api_key_env else None)
            if key:
                keys[t.name] = key
            else:
                where = f"${t.api_key_env} is unset" if t.api_key_env else "no api_key or api_key_env"
                missing.append(f"{t.name} ({where})")
        if missing:
            raise WorkloadError(
                "no API key for tenants: " + "; ".join(missing) + " (give one with --api-key NAME=KEY)"
            )
        return keys


def _format_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_workload(data: Any, source: str = "<workload>") -> Workload:
    """Validate already-loaded YAML data; every problem is reported at once."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: the top level must be a mapping, not {type(data).__name__}")
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        raise WorkloadError(f"{source}: invalid workload:\n{_format_errors(exc)}") from None


def load_workload(path: str | Path) -> Workload:
    """Read and validate a workload file; WorkloadError names the file, the line or the bad fields."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read the workload file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise WorkloadError(f"{path}: not valid YAML{where}: {problem}") from None
    return parse_workload(data, str(path))
