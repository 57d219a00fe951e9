"""A real multi-node Ray run of the RayService's own Serve config, on this machine, with a node killed.

    python -m deploy.multinode                       # the cpu-dev overlay; results to loadtest/results/
    python -m deploy.multinode --out /tmp/mn --max-tokens 48

What KubeRay would do with the rendered overlay, done with ``ray start`` instead of pods:

1. a head node (``ray start --head --block`` on free ports, never 6379, its own ``--temp-dir``) that
   also plays the gateway pod (the gateway group's CPUs and ``loom_gateway`` resource), and one
   worker node per engine pod of the overlay, each with the engine group's CPUs and ``loom_engine``
   resource: separate raylets, so engine replicas land on worker nodes as they would on GPU pods;
2. Redis with a password, tenants created with ``loom admin`` as docs/deploy.md shows;
3. the manifest's ``serveConfigV2``, sent to the dashboard's Serve REST API as the KubeRay operator
   sends it (Ray token auth on, as ``authOptions: {mode: token}`` turns it on), with the pods'
   environment (the ConfigMap and Secrets resolved as the kubelet would);
4. greedy streams from two tenants over gRPC with TLS (a reference run), the same streams again with
   the worker node serving some of them killed mid-stream (every process of its session, SIGKILL: a
   pod or machine lost), then a node rejoining.

Checked and reported (``--out``.json/.md): the in-flight streams resume and their tokens equal the
reference run's, the pool serves new requests on the remaining node, Serve brings the replica count
back when a node rejoins, and how long each step took.

Every process it starts is in a session of its own, marked in its environment with this run's id;
``stop`` (also run on any failure, and by the test after a timeout, from ``pids.json``) kills exactly
those sessions. ``ray stop`` is never used: it stops every Ray on the machine, other users' included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from deploy.manifests import (
    ROOT,
    Manifest,
    container_env,
    one,
    pod_templates,
    ray_custom_resources,
    ray_groups,
    ray_num_cpus,
    ray_num_gpus,
    render_overlay,
    secret_refs,
    serve_config,
)

REPO = ROOT.parent
RESULTS = REPO / "loadtest" / "results" / "multinode"
RUN_MARKER = "DEPLOY_MULTINODE_RUN"  # in every started process's environment
APP = "loom"
ENGINE_DEPLOYMENT = "engine-shared"
# Raw completions (no chat template) whose greedy continuations run to max_tokens, so every stream
# is still going when the node dies.
PROMPTS = (
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Monday, Tuesday, Wednesday, Thursday,",
    "a b c d e f g h",
    "January, February, March, April,",
)
TENANTS = ("tenant-a", "tenant-b")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log(message: str) -> None:
    print(f"[multinode {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- processes -----------------------------------------------------------------------------------


def _session_members(leader: int, marker: str) -> list[int]:
    """Processes in ``leader``'s session whose environment carries ``marker`` (never anyone else's)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            if os.getsid(pid) != leader:
                continue
            if marker.encode() not in (entry / "environ").read_bytes():
                continue
        except (ProcessLookupError, PermissionError, FileNotFoundError, OSError):
            continue
        members.append(pid)
    return members


def kill_sessions(leaders: list[int], marker: str, grace_s: float = 5.0) -> list[int]:
    """SIGTERM, then SIGKILL after ``grace_s``, every marked process of these sessions; returns the
    pids still alive afterwards (none, normally)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        pids = [p for leader in leaders for p in _session_members(leader, marker)]
        if not pids:
            return []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
            _reap()
    return [p for leader in leaders for p in _session_members(leader, marker)]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


@dataclass
class Node:
    name: str
    process: subprocess.Popen[bytes]
    ports: dict[str, int]

    @property
    def session(self) -> int:
        return self.process.pid


@dataclass
class LocalCluster:
    """The processes of one run: Redis and the Ray nodes, each a session of its own."""

    workdir: Path
    run_id: str = field(default_factory=lambda: secrets.token_hex(8))
    nodes: list[Node] = field(default_factory=list)
    redis: subprocess.Popen[bytes] | None = None
    redis_port: int = 0
    ray_root: Path = field(init=False)

    def __post_init__(self) -> None:
        # Ray's socket paths (ROOT/r-h/session_<date>_<pid>/sockets/plasma_store) must fit in 107
        # bytes: a long work directory gets its Ray files in a short one under /tmp instead.
        short = len(str(self.workdir)) <= 40
        self.ray_root = self.workdir if short else Path(tempfile.mkdtemp(prefix="lmn-", dir="/tmp"))

    @property
    def marker(self) -> str:
        return f"{RUN_MARKER}={self.run_id}"

    def _record(self) -> None:
        """pids.json: what to kill if this process itself dies before ``stop``."""
        record = {
            "marker": self.marker,
            "sessions": [n.session for n in self.nodes],
            "redis": [self.redis.pid, self.redis_port] if self.redis else None,
        }
        (self.workdir / "pids.json").write_text(json.dumps(record))

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        out = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv,
            env={**env, RUN_MARKER: self.run_id},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=self.workdir,
        )
        out.close()
        return proc

    def start_redis(self, password: str) -> int:
        port = free_port()
        argv = [
            shutil.which("redis-server") or "redis-server",
            "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
            "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
        ]  # fmt: skip
        self.redis, self.redis_port = self.spawn("redis", argv, dict(os.environ)), port
        self._record()
        return port

    def start_node(self, name: str, argv: list[str], env: dict[str, str], ports: dict[str, int]) -> Node:
        node = Node(name, self.spawn(name, argv, env), ports)
        self.nodes.append(node)
        self._record()
        return node

    def kill_node(self, node: Node) -> None:
        """Every process of the node's session, SIGKILL at once: a lost pod, not a drain."""
        for pid in _session_members(node.session, self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.process.wait(10)

    def stop(self) -> list[int]:
        left = kill_sessions([n.session for n in self.nodes], self.marker)
        if self.redis is not None:
            kill_redis(self.redis.pid, self.redis_port)
        for proc in [n.process for n in self.nodes] + ([self.redis] if self.redis else []):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        return left


def stop_recorded(workdir: Path) -> list[int]:
    """Kill what a run recorded in ``workdir/pids.json`` (for a caller whose run was cut short)."""
    path = workdir / "pids.json"
    if not path.exists():
        return []
    record = json.loads(path.read_text())
    if record.get("redis"):
        kill_redis(*record["redis"])
    return kill_sessions(record["sessions"], record["marker"])


def kill_redis(pid: int, port: int) -> None:
    """Our redis-server (it rewrites its environment for its process title, so no marker there: it is
    recognised by its pid and the port in its title)."""
    try:
        title = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return
    if b"redis-server" in title and f":{port}".encode() in title:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


# ---- what the manifests say, turned into local processes -----------------------------------------


def _ray_start(
    *, head: bool, cpus: int, gpus: int, resources: dict[str, float], gcs: int, temp_dir: Path
) -> tuple[list[str], dict[str, int]]:
    ports = {
        name: free_port()
        for name in ("node_manager", "object_manager", "agent_http", "agent_grpc", "runtime_env", "metrics")
    }
    ray = str(Path(sys.executable).parent / "ray")
    argv = [
        ray, "start", "--block", "--disable-usage-stats", "--node-ip-address", "127.0.0.1",
        "--num-cpus", str(cpus), "--num-gpus", str(gpus),
        "--resources", json.dumps(resources),
        "--object-store-memory", str(200 * 2**20),
        "--node-manager-port", str(ports["node_manager"]),
        "--object-manager-port", str(ports["object_manager"]),
        "--dashboard-agent-listen-port", str(ports["agent_http"]),
        "--dashboard-agent-grpc-port", str(ports["agent_grpc"]),
        "--runtime-env-agent-port", str(ports["runtime_env"]),
        "--metrics-export-port", str(ports["metrics"]),
        "--temp-dir", str(temp_dir),  # per node: sockets and logs of separate raylets never mix
    ]  # fmt: skip
    if head:
        ports |= {"gcs": gcs, "dashboard": free_port(), "client": free_port()}
        argv += [
            "--head", "--port", str(gcs),
            "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(ports["dashboard"]), "--ray-client-server-port", str(ports["client"]),
        ]  # fmt: skip
    else:
        argv += ["--address", f"127.0.0.1:{gcs}"]
    return argv, ports


@dataclass
class Plan:
    """The overlay's pods as local nodes, and what was changed for one machine (all recorded)."""

    overlay: str
    env: dict[str, str]
    head: dict[str, Any]
    engine: dict[str, Any]
    engine_nodes: int
    serve_config: Manifest
    overrides: dict[str, str]
    gateway_port: int
    metrics_port: int
    tls_ca: Path


def plan(overlay: str, workdir: Path, redis_port: int, redis_password: str, threads: int) -> Plan:
    objects = render_overlay(overlay)
    ray_service = one(objects, "RayService")
    groups = ray_groups(ray_service)
    tenancy_secret = secrets.token_hex(32)
    values = {}
    for pod in pod_templates(objects):
        for ref in secret_refs(pod.containers[0]):
            values[ref] = {"password": redis_password, "secret": tenancy_secret}[ref[1]]
    (gateway_pod,) = [p for p in pod_templates(objects) if p.group == "gateway"]
    env = container_env(gateway_pod.containers[0], objects, values)
    cert, key = _certificate(workdir)
    url = urllib.parse.urlsplit(env["LOOM_TENANCY_REDIS_URL"])
    local_url = url._replace(netloc=f"127.0.0.1:{redis_port}").geturl()  # its password: its own variable
    gateway_port, http_port, metrics_port = free_port(), free_port(), free_port()
    overrides = {
        # one machine, shared: listen on loopback, on free ports
        "LOOM_GATEWAY_HOST": "127.0.0.1",
        "LOOM_GATEWAY_METRICS_HOST": "127.0.0.1",
        "LOOM_GATEWAY_PORT": str(gateway_port),
        "LOOM_GATEWAY_HTTP_PORT": str(http_port),
        "LOOM_GATEWAY_METRICS_PORT": str(metrics_port),
        # the Secret volume's files, made here (a self-signed certificate for 127.0.0.1)
        "LOOM_GATEWAY_TLS_CERT_FILE": str(cert),
        "LOOM_GATEWAY_TLS_KEY_FILE": str(key),
        # the redis Service is a local redis-server (the same password, from the same Secret)
        "LOOM_TENANCY_REDIS_URL": local_url,
        # 2 replicas and a gateway share this machine's cores
        "LOOM_ENGINE_NUM_THREADS": str(threads),
    }
    for name in overrides:
        if name not in env and name != "LOOM_ENGINE_NUM_THREADS":
            raise KeyError(f"the manifest no longer sets {name}: update deploy/multinode.py")
    env |= overrides
    # What KubeRay's authOptions {mode: token} gives every Ray container.
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(24)}
    head, gateway, engine = groups["head"], groups["gateway"], groups["engine"]
    config = serve_config(ray_service)
    # Serve's own HTTP proxy is unused (route_prefix: null; clients reach the gateway's servers):
    # off here, so it takes no port and no CPU on a shared machine.
    config |= {"proxy_location": "Disabled", "http_options": {"host": "127.0.0.1", "port": free_port()}}
    return Plan(
        overlay=overlay,
        env=env,
        # the head plays the gateway pod too: its CPUs and its loom_gateway resource
        head={
            "cpus": ray_num_cpus(head) + ray_num_cpus(gateway),
            "gpus": 0,
            "resources": {**ray_custom_resources(head), **ray_custom_resources(gateway)},
        },
        engine={
            "cpus": ray_num_cpus(engine),
            "gpus": ray_num_gpus(engine),
            "resources": ray_custom_resources(engine),
        },
        engine_nodes=int(engine["replicas"]),
        serve_config=config,
        overrides={k: v for k, v in overrides.items() if "TLS" not in k} | {"TLS": "self-signed, 127.0.0.1"},
        gateway_port=gateway_port,
        metrics_port=metrics_port,
        tls_ca=cert,
    )


def _certificate(workdir: Path) -> tuple[Path, Path]:
    cert, key = workdir / "tls.crt", workdir / "tls.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "2", "-subj", "/CN=loom-gateway", "-keyout", str(key), "-out", str(cert),
            "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


def node_env(plan_: Plan) -> dict[str, str]:
    """The pods' environment on top of this machine's basics (PATH, HOME); no LOOM_* or RAY_* of
    the caller leaks in."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LOOM_", "RAY_", "REDIS_"))}
    return base | plan_.env


# ---- talking to the cluster ----------------------------------------------------------------------


class Dashboard:
    """The head's dashboard: the Serve REST API KubeRay uses, and the state API."""

    def __init__(self, port: int, token: str) -> None:
        self.http = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=30
        )

    async def wait_up(self, deadline: float, head: Node) -> None:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await self.http.get("/api/version")).status_code == 200:
                    return
            if head.process.poll() is not None:
                raise RuntimeError(f"the head node exited ({head.process.returncode}): see {head.name}.log")
            _check(deadline, "the dashboard did not come up")
            await asyncio.sleep(0.5)

    async def alive_nodes(self) -> list[dict[str, Any]]:
        return [n for n in await self.nodes() if n["state"] == "ALIVE"]

    async def nodes(self) -> list[dict[str, Any]]:
        r = await self.http.get("/api/v0/nodes", params={"limit": 100, "detail": "true"})
        r.raise_for_status()
        return list(r.json()["data"]["result"]["result"])

    async def deploy(self, config: Manifest) -> None:
        r = await self.http.put("/api/serve/applications/", json=config)
        if r.status_code != 200:
            raise RuntimeError(f"Serve refused the config: {r.status_code} {r.text[:2000]}")

    async def app(self) -> dict[str, Any]:
        r = await self.http.get("/api/serve/applications/")
        r.raise_for_status()
        return r.json().get("applications", {}).get(APP, {})

    async def engine_replicas(self) -> list[dict[str, Any]]:
        app = await self.app()
        return app.get("deployments", {}).get(ENGINE_DEPLOYMENT, {}).get("replicas", [])


def _check(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(what)


async def wait_for(predicate: Any, deadline: float, what: str, interval: float = 0.25) -> float:
    """Poll an async predicate; the time it took."""
    started = time.monotonic()
    while not await predicate():
        _check(deadline, what)
        await asyncio.sleep(interval)
    return time.monotonic() - started


# ---- streams -------------------------------------------------------------------------------------


@dataclass
class Stream:
    tenant: str
    prompt: str
    request_id: str
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    times: list[float] = field(default_factory=list)  # monotonic arrival of each delta
    finish: str = ""
    error: str = ""


async def run_stream(client: Any, model: str, stream: Stream, max_tokens: int) -> Stream:
    from gateway.grpc.stubs import pb

    request = pb.GenerateRequest(
        model=model,
        prompt=stream.prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        request_id=stream.request_id,
    )
    try:
        async for chunk in client.generate_call(request, timeout=300):
            if chunk.token_ids:
                stream.tokens += list(chunk.token_ids)
                stream.text += chunk.text
                stream.times.append(time.monotonic())
            if chunk.finish_reason:
                stream.finish = pb.FinishReason.Name(chunk.finish_reason)
    except Exception as exc:  # recorded: a failed stream fails the run's checks
        stream.error = f"{type(exc).__name__}: {exc}"
    return stream


async def running_by_replica(metrics_port: int) -> dict[str, float]:
    """``loom:num_requests_running`` of each engine replica, from the gateway's Prometheus endpoint."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    out = {}
    for m in re.finditer(r"^loom:num_requests_running\{([^}]*)\} ([0-9.e+-]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels["replica"]] = float(m.group(2))
    return out


# ---- the run -------------------------------------------------------------------------------------


@dataclass
class Result:
    overlay: str
    machine: dict[str, Any]
    cluster: dict[str, Any]
    local_overrides: dict[str, str]
    timings_s: dict[str, float] = field(default_factory=dict)
    streams: list[dict[str, Any]] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())


async def run(args: argparse.Namespace, cluster: LocalCluster, progress: dict[str, Any]) -> Result:
    deadline = time.monotonic() + args.timeout
    started = time.monotonic()
    password = secrets.token_hex(24)
    redis_port = cluster.start_redis(password)
    p = plan(args.overlay, cluster.workdir, redis_port, password, args.threads)
    env = node_env(p)
    token = p.env["RAY_AUTH_TOKEN"]
    result = Result(
        overlay=p.overlay,
        machine={
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "system": platform.platform(),
            "load_average_1m_at_start": round(os.getloadavg()[0], 2),
        },
        cluster={"head": p.head, "engine_node": p.engine, "engine_nodes": p.engine_nodes},
        local_overrides=p.overrides,
    )
    t = result.timings_s
    progress["result"] = result  # what is known so far, if a step fails

    # 1. the nodes
    for attempt in (1, 2):  # a free port can be taken between picking and binding it: retry once
        gcs = free_port()
        temp = cluster.ray_root / f"r-h{attempt}"
        argv, ports = _ray_start(head=True, gcs=gcs, temp_dir=temp, **p.head)
        head = cluster.start_node(f"head{attempt}", argv, env, ports)
        dash = Dashboard(ports["dashboard"], token)
        try:
            await dash.wait_up(deadline, head)
            break
        except RuntimeError as exc:
            await dash.http.aclose()
            if attempt == 2:
                raise
            result.notes.append(f"the first head start failed ({exc}); started again on other ports")
    engines = []
    for i in range(p.engine_nodes):
        argv, ports = _ray_start(head=False, gcs=gcs, temp_dir=cluster.ray_root / f"r-{i}", **p.engine)
        engines.append(cluster.start_node(f"engine-{i}", argv, env, ports))
    await wait_for(lambda: _nodes(dash, p.engine_nodes + 1), deadline, "the engine nodes did not join")
    t["cluster_up"] = time.monotonic() - started
    log(f"cluster up: head + {p.engine_nodes} engine nodes ({t['cluster_up']:.1f} s)")

    # 2. tenants, as docs/deploy.md creates them
    keys = {tenant: _create_tenant(tenant, env) for tenant in TENANTS}

    # 3. the manifest's Serve config, as the operator submits it
    t0 = time.monotonic()
    await dash.deploy(p.serve_config)
    await wait_for(lambda: _app_running(dash), deadline, "the Serve application did not reach RUNNING", 0.5)
    t["deploy_to_running"] = time.monotonic() - t0
    replicas = await dash.engine_replicas()
    result.checks["one engine replica per engine node"] = sorted(
        _node_of(r, engines) for r in replicas if r["state"] == "RUNNING"
    ) == sorted(n.name for n in engines)
    log(f"Serve application RUNNING ({t['deploy_to_running']:.1f} s)")

    from gateway.grpc.client import LoomClient

    address = f"127.0.0.1:{p.gateway_port}"
    ca = p.tls_ca.read_bytes()
    clients = {tenant: LoomClient(address, key, root_certificates=ca) for tenant, key in keys.items()}
    try:
        model = (await clients[TENANTS[0]].list_models())[0].id

        def streams(tag: str) -> list[Stream]:
            return [
                Stream(tenant, PROMPTS[(i * 2 + j) % len(PROMPTS)], f"{tag}-{tenant}-{j}")
                for i, tenant in enumerate(TENANTS)
                for j in range(args.streams_per_tenant)
            ]

        # 4a. the reference: both engine nodes up
        t0 = time.monotonic()
        reference = await asyncio.gather(
            *(run_stream(clients[s.tenant], model, s, args.max_tokens) for s in streams("ref"))
        )
        t["reference_run"] = time.monotonic() - t0
        result.checks["reference streams complete"] = all(not s.error and s.tokens for s in reference)

        # 4b. the same streams; a node dies under them
        faulted = streams("fault")
        tasks = [
            asyncio.create_task(run_stream(clients[s.tenant], model, s, args.max_tokens)) for s in faulted
        ]
        await wait_for(
            _async(lambda: all(len(s.tokens) >= args.kill_after_tokens for s in faulted)),
            deadline,
            "the streams did not start",
            0.02,
        )
        # Replicas publish their load once a second: wait for a publication showing these streams, or
        # the lookup may pick a node whose replica only looked idle at its last publication.
        victim, victim_node_id, running = await _busiest_engine_node(p.metrics_port, dash, engines)
        while running <= 0 and not all(task.done() for task in tasks):
            _check(deadline, "no engine replica reported running requests")
            await asyncio.sleep(0.1)
            victim, victim_node_id, running = await _busiest_engine_node(p.metrics_port, dash, engines)
        before = {s.request_id: len(s.tokens) for s in faulted}
        killed_at = time.monotonic()
        cluster.kill_node(victim)
        watchers = {
            "serve_marks_replica_lost": asyncio.create_task(
                wait_for(lambda: _running_replicas(dash, p.engine_nodes - 1), deadline, "replica loss")
            ),
            "gcs_marks_node_dead": asyncio.create_task(
                wait_for(lambda: _node_dead(dash, victim_node_id), deadline, "node death", 0.5)
            ),
        }
        t_kill = time.monotonic() - killed_at
        log(f"killed {victim.name} (its replica had {running:g} running requests) in {t_kill:.2f} s")
        result.cluster["killed"] = victim.name

        # the pool goes on: a new request per tenant while the node is gone
        fresh = [Stream(tenant, "Hello, my name is", f"after-kill-{tenant}") for tenant in TENANTS]
        fresh_done = await asyncio.gather(*(run_stream(clients[s.tenant], model, s, 8) for s in fresh))
        t["new_request_after_kill"] = max(s.times[-1] for s in fresh_done if s.times) - killed_at
        await asyncio.gather(*tasks)
        t["streams_done_after_kill"] = time.monotonic() - killed_at

        t["serve_marks_replica_lost"] = await watchers.pop("serve_marks_replica_lost")
        pending = [r["state"] for r in await dash.engine_replicas() if r["state"] != "RUNNING"]
        result.notes.append(
            f"while no node offers `loom_engine` for it, Serve shows the replacement replica as {pending}"
        )

        # 5. a node rejoins: Serve places the pending replica on it
        rejoin_at, rejoin_wall_ms = time.monotonic(), time.time() * 1000
        argv, ports = _ray_start(head=False, gcs=gcs, temp_dir=cluster.ray_root / "r-j", **p.engine)
        engines.append(cluster.start_node("engine-rejoined", argv, env, ports))
        await wait_for(lambda: _node_joined(dash, rejoin_wall_ms), deadline, "the node did not rejoin")
        t["rejoin_node_alive"] = time.monotonic() - rejoin_at
        await wait_for(
            lambda: _running_replicas(dash, p.engine_nodes), deadline, "Serve did not restore the replicas"
        )
        t["rejoin_to_replicas_restored"] = time.monotonic() - rejoin_at
        t["kill_to_replicas_restored"] = time.monotonic() - killed_at
        replicas = await dash.engine_replicas()
        result.checks["replica count restored, one per live engine node"] = sorted(
            _node_of(r, engines) for r in replicas if r["state"] == "RUNNING"
        ) == sorted(n.name for n in engines if n is not victim)

        # 6. after recovery the same streams give the same tokens again
        after = await asyncio.gather(
            *(run_stream(clients[s.tenant], model, s, args.max_tokens) for s in streams("after"))
        )
        gcs = watchers.pop("gcs_marks_node_dead")
        if gcs.done() and not gcs.exception():
            t["gcs_marks_node_dead"] = gcs.result()
        else:
            gcs.cancel()
            result.notes.append("the GCS had not marked the killed node dead by the end of the run")
    finally:
        for c in clients.values():
            with contextlib.suppress(Exception):
                await c.close()
        await dash.http.aclose()

    resumed_ids = _resumed_request_ids(cluster.ray_root)
    for ref, got, again in zip(reference, faulted, after, strict=True):
        gap_after_kill = [b - a for a, b in zip(got.times, got.times[1:], strict=False) if b >= killed_at]
        result.streams.append(
            {
                "tenant": got.tenant,
                "request_id": got.request_id,
                "tokens": len(got.tokens),
                "tokens_before_kill": before[got.request_id],
                "resumed": any(r.rsplit("/", 1)[-1] == got.request_id for r in resumed_ids),
                "text": got.text[:80],
                "first_token_after_kill_s": round(
                    next((x - killed_at for x in got.times if x >= killed_at), -1.0), 3
                ),
                "longest_gap_after_kill_s": round(max(gap_after_kill, default=0.0), 3),
                "finish": got.finish,
                "error": got.error,
                "equal_to_reference": got.tokens == ref.tokens and got.text == ref.text,
                "equal_after_recovery": again.tokens == ref.tokens,
            }
        )
    s = result.streams
    result.checks |= {
        "every stream completed, none failed": all(not x["error"] and x["finish"] for x in s),
        "a stream was in flight on the killed node and resumed": any(x["resumed"] for x in s),
        "greedy tokens equal the uninterrupted run": all(x["equal_to_reference"] for x in s),
        "new requests served while the node was down": all(not f.error and f.tokens for f in fresh_done),
        "same tokens after recovery": all(x["equal_after_recovery"] for x in s),
    }
    resumed_first = [x["first_token_after_kill_s"] for x in s if x["resumed"]]
    if resumed_first:
        t["resumed_stream_first_token_after_kill"] = max(resumed_first)
    t["total"] = time.monotonic() - started
    result.machine["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
    result.timings_s = {k: round(v, 2) for k, v in t.items()}
    return result


def _async(fn: Any) -> Any:
    async def predicate() -> bool:
        return bool(fn())

    return predicate


async def _nodes(dash: Dashboard, n: int) -> bool:
    # A state API still starting may answer 200 with a body that is not JSON yet (ValueError): not
    # up, like a refused connection (seen once in CI on a loaded machine).
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        return len(await dash.alive_nodes()) == n
    return False


async def _app_running(dash: Dashboard) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError):
        app = await dash.app()
        if app.get("status") == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {app.get('message', '')[:2000]}")
        return app.get("status") == "RUNNING"
    return False


async def _node_dead(dash: Dashboard, node_id: str) -> bool:
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        return any(n["node_id"] == node_id and n["state"] == "DEAD" for n in await dash.nodes())
    return False


async def _node_joined(dash: Dashboard, since_ms: float) -> bool:
    """An engine node started after ``since_ms`` (epoch) is alive."""
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        return any(
            n["start_time_ms"] >= since_ms - 1000 and "loom_engine" in n["resources_total"]
            for n in await dash.alive_nodes()
        )
    return False


async def _running_replicas(dash: Dashboard, n: int) -> bool:
    with contextlib.suppress(httpx.HTTPError, KeyError, ValueError):
        return sum(r["state"] == "RUNNING" for r in await dash.engine_replicas()) == n
    return False


def _node_of(replica: dict[str, Any], nodes: list[Node]) -> str:
    """Which of our nodes runs a replica: its process's session is the node's ``ray start``."""
    try:
        sid = os.getsid(int(replica["pid"]))
    except (ProcessLookupError, KeyError, TypeError, ValueError):
        return "?"
    return next((n.name for n in nodes if n.session == sid), "?")


async def _busiest_engine_node(
    metrics_port: int, dash: Dashboard, engines: list[Node]
) -> tuple[Node, str, float]:
    """The engine node whose replica runs the most requests right now (so killing it cuts streams):
    our process, its Ray node id, and how many requests its replica was running."""
    running = await running_by_replica(metrics_port)
    replicas = [r for r in await dash.engine_replicas() if r["state"] == "RUNNING"]
    best = max(replicas, key=lambda r: running.get(r["replica_id"], 0.0))
    name = _node_of(best, engines)
    node = next(n for n in engines if n.name == name)
    return node, str(best["node_id"]), running.get(best["replica_id"], 0.0)


def _create_tenant(tenant: str, env: dict[str, str]) -> str:
    loom = str(Path(sys.executable).parent / "loom")
    admin = [loom, "admin", "--store", "redis", "--actor", "deploy.multinode"]
    subprocess.run(
        [*admin, "tenant", "create", tenant, "--rpm", "600", "--tpm", "1000000", "--max-concurrent", "16"],
        env=env,
        check=True,
        capture_output=True,
    )
    out = subprocess.run(
        [*admin, "--json", "key", "create", tenant], env=env, check=True, capture_output=True
    )
    return str(json.loads(out.stdout)["key"])


def _resumed_request_ids(ray_temp: Path) -> set[str]:
    """Request ids the gateway logged as resumed on another replica (gateway/resume.py's warning)."""
    found: set[str] = set()
    for path in ray_temp.glob("r-*/session_*/logs/**/*"):
        if path.is_file() and path.suffix in (".log", ".err", ".out"):
            with contextlib.suppress(OSError):
                text = path.read_text(errors="replace")
                found |= set(re.findall(r"request (\S+) lost its replica after \d+ tokens; resuming", text))
    return found


# ---- reporting -----------------------------------------------------------------------------------


def write(result: Result, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(result) | {"passed": result.passed}
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    t = result.timings_s
    lines = [
        f"# Multi-node run of the `{result.overlay}` RayService on one machine",
        "",
        "`python -m deploy.multinode` (tests/deploy/test_multinode.py runs it): a Ray head and "
        f"{result.cluster.get('engine_nodes', '?')} engine worker nodes (separate raylets, `loom_engine` "
        "resource), the overlay's own `serveConfigV2` deployed through the dashboard's Serve REST API, "
        "two tenants streaming greedily over gRPC with TLS; then one engine node killed mid-stream "
        "(SIGKILL to every process of its session) and a node rejoining.",
        "",
        f"Machine: {result.machine.get('cpus')} CPUs, Python {result.machine.get('python')}, load "
        f"average {result.machine.get('load_average_1m_at_start')} at the start and "
        f"{result.machine.get('load_average_1m_at_end')} at the end (a shared machine: the times "
        f"stretch with its load). Passed: **{result.passed}**.",
        "",
        "| step | seconds |",
        "|---|---|",
    ]
    labels = {
        "cluster_up": "head + engine nodes up",
        "deploy_to_running": "Serve config deployed to RUNNING (build_app, model loads)",
        "reference_run": "reference streams (no fault)",
        "resumed_stream_first_token_after_kill": "kill -> first token of a resumed stream",
        "new_request_after_kill": "kill -> a new request completed on the remaining node",
        "streams_done_after_kill": "kill -> every in-flight stream finished",
        "serve_marks_replica_lost": "kill -> Serve counts one replica fewer running",
        "gcs_marks_node_dead": "kill -> the GCS marks the node dead",
        "rejoin_node_alive": "node rejoin -> node alive in the cluster",
        "rejoin_to_replicas_restored": "node rejoin -> replica count restored",
        "kill_to_replicas_restored": "kill -> replica count restored (rejoin started after Serve noticed)",
        "total": "whole run",
    }
    lines += [f"| {label} | {t[k]:.2f} |" for k, label in labels.items() if k in t]
    lines += ["", "| check | |", "|---|---|"]
    lines += [f"| {name} | {'yes' if ok else '**no**'} |" for name, ok in result.checks.items()]
    lines += ["", "| stream | tokens | before kill | resumed | first token after kill (s) | = reference |"]
    lines += ["|---|---|---|---|---|---|"]
    lines += [
        f"| {s['request_id']} | {s['tokens']} | {s['tokens_before_kill']} | {s['resumed']} | "
        f"{s['first_token_after_kill_s']} | {s['equal_to_reference']} |"
        for s in result.streams
    ]
    lines += ["", "Changed from the pods for one shared machine:", ""]
    lines += [
        f"- `{k}` = {'a free port' if k.endswith('_PORT') else f'`{v}`'}"
        for k, v in result.local_overrides.items()
        if "REDIS_URL" not in k
    ]
    lines += [
        "- the Redis URL points at a local `redis-server` with the same kind of password;",
        "- Ray nodes listen on 127.0.0.1 on free ports, object stores are 200 MiB, and Serve's own HTTP "
        "proxy is off (unused: `route_prefix: null`);",
        "- the head node also plays the gateway pod (the gateway group's CPUs and `loom_gateway`).",
        *[f"- {n}" for n in result.notes],
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.multinode", description=__doc__.split("\n")[0])
    parser.add_argument("--overlay", default="cpu-dev")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results: OUT.json and OUT.md")
    parser.add_argument("--workdir", type=Path, default=None, help="default: a new temporary directory")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams-per-tenant", type=int, default=2)
    parser.add_argument("--kill-after-tokens", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine replica")
    parser.add_argument("--timeout", type=float, default=420.0, help="the whole run, seconds")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="loom-mn-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(workdir)
    log(f"work directory {workdir} (Ray's files: {cluster.ray_root})")
    progress: dict[str, Any] = {}
    try:
        result = asyncio.run(run(args, cluster, progress))
    except Exception as exc:  # the run failed: report how far it got, then fail
        result = progress.get("result") or Result(args.overlay, {}, {}, {})
        result.checks["the run completed"] = False
        result.notes.append(f"failed: {type(exc).__name__}: {exc}")
        log(f"failed: {type(exc).__name__}: {exc}")
    finally:  # also on KeyboardInterrupt: no process of this run outlives it
        left = cluster.stop()
        if left:
            log(f"processes still alive after stop: {left}")
    if args.keep or left or not result.passed:
        log(f"logs kept in {workdir} and {cluster.ray_root}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(cluster.ray_root, ignore_errors=True)
    write(result, args.out)
    log(f"{'passed' if result.passed else 'FAILED'}: {args.out.with_suffix('.md')}")
    print(yaml.safe_dump({"passed": result.passed, "timings_s": result.timings_s, "checks": result.checks}))
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
