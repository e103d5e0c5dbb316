"""The deploy files agree with each other and with the code.

docker-compose.yml, the Dockerfile, deploy/prometheus.yml, deploy/nginx.conf and the Grafana
provisioning + dashboard are checked by plain functions over parsed data; each returns a list
of problems (empty when consistent). Every check also has a test feeding it a mutated copy
(a renamed service, path, port or metric) and expecting the problem to be reported, so a check
that silently passes everything would fail here.
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib
import json
import re
import shlex
from pathlib import Path, PurePosixPath

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
MAKEFILE = ROOT / "Makefile"
README = ROOT / "README.md"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
NGINX = ROOT / "deploy" / "nginx.conf"
GRAFANA = ROOT / "deploy" / "grafana"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "igserve.yml"
DASHBOARD = GRAFANA / "dashboards" / "igserve.json"

SCALEOUT = "scaleout"
PROMETHEUS_PORT = 9090
GRAFANA_PORT = 3000


# --------------------------------------------------------------------------- parsing helpers

def load_yaml(path: Path):
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def makefile_targets(text: str) -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_.\-]+)\s*:(?!=)", text, flags=re.M))


def makefile_default(text: str, var: str) -> str | None:
    m = re.search(rf"^{re.escape(var)}\s*\??=\s*(.*?)\s*$", text, flags=re.M)
    return m.group(1) if m else None


@functools.lru_cache(maxsize=None)
def default_port() -> int:
    """The port `igserve serve` listens on by default.

    server.cli.DEFAULT_PORT if it exists, else the --port default of the serve subcommand's
    parser (the module server.cli dispatches `serve` to), else the Makefile's PORT.
    """
    try:
        cli = importlib.import_module("server.cli")
    except ModuleNotFoundError as exc:
        if exc.name not in ("server", "server.cli"):
            raise
        cli = None
    if getattr(cli, "DEFAULT_PORT", None) is not None:
        return int(cli.DEFAULT_PORT)
    serve = next((module for words, module, *_ in getattr(cli, "COMMANDS", []) if tuple(words) == ("serve",)),
                 None)
    if serve is not None:
        try:
            module = importlib.import_module(serve)
        except ModuleNotFoundError as exc:
            if exc.name != serve:
                raise
            module = None
        if module is not None and hasattr(module, "add_arguments"):
            parser = argparse.ArgumentParser()
            module.add_arguments(parser)
            if parser.get_default("port") is not None:
                return int(parser.get_default("port"))
    return int(makefile_default(MAKEFILE.read_text(), "PORT"))


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    return out


def dockerfile_env(instrs) -> dict[str, str]:
    env = {}
    for instr, args in instrs:
        if instr == "ENV":
            for token in shlex.split(args):
                key, sep, value = token.partition("=")
                if sep:
                    env[key] = value
    return env


def dockerfile_cmd(instrs) -> str:
    cmds = [args for instr, args in instrs if instr == "CMD"]
    if not cmds:
        return ""
    cmd = cmds[-1]
    if cmd.startswith("["):
        return " ".join(json.loads(cmd))
    return cmd


def parse_port(spec) -> tuple[int | None, int]:
    """(published host port or None, container port) from a compose `ports` entry."""
    if isinstance(spec, dict):
        published = spec.get("published")
        return (int(published) if published is not None else None, int(spec["target"]))
    parts = str(spec).split("/")[0].split(":")
    if len(parts) == 1:
        return None, int(parts[0])
    return int(parts[-2]), int(parts[-1])


def volume_mounts(service: dict) -> list[tuple[str, str]]:
    """(source, target) for every volume of a service; source is a host path or a volume name."""
    out = []
    for spec in service.get("volumes", []) or []:
        if isinstance(spec, dict):
            out.append((str(spec.get("source", "")), str(spec["target"])))
        else:
            parts = str(spec).split(":")
            out.append((parts[0], parts[1] if len(parts) > 1 else parts[0]))
    return out


def is_bind(source: str) -> bool:
    return source.startswith((".", "/", "~"))


def host_path(source: str, root: Path) -> Path:
    return (root / source).resolve()


def service_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def healthcheck_text(service: dict) -> str:
    test = (service.get("healthcheck") or {}).get("test", "")
    return " ".join(test) if isinstance(test, list) else str(test)


def igserve_services(compose: dict) -> dict[str, dict]:
    """Services built from this repository's Dockerfile: the igserve replicas."""
    out = {}
    for name, svc in (compose.get("services") or {}).items():
        build = svc.get("build")
        if build is None:
            continue
        context = build if isinstance(build, str) else build.get("context", ".")
        dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
        if (ROOT / context / dockerfile).resolve() == DOCKERFILE.resolve():
            out[name] = svc
    return out


def container_ports(service: dict) -> set[int]:
    ports = {parse_port(p)[1] for p in service.get("ports", []) or []}
    ports |= {int(str(p).split("/")[0]) for p in service.get("expose", []) or []}
    return ports


def profiles(service: dict) -> list[str]:
    return list(service.get("profiles") or [])


def prometheus_targets(prom: dict) -> list[tuple[str, str, int]]:
    """(job, host, port) for every static or DNS-discovered target."""
    out = []
    for job in prom.get("scrape_configs", []):
        for sc in job.get("static_configs", []) or []:
            for target in sc.get("targets", []):
                host, _, port = str(target).rpartition(":")
                out.append((job["job_name"], host, int(port)))
        for dc in job.get("dns_sd_configs", []) or []:
            for name in dc.get("names", []):
                out.append((job["job_name"], name, int(dc["port"])))
    return out


def nginx_upstream_servers(conf: str) -> list[tuple[str, int]]:
    servers = []
    for block in re.findall(r"upstream\s+\S+\s*\{(.*?)\}", conf, flags=re.S):
        for host, port in re.findall(r"^\s*server\s+([^\s:;]+):(\d+)", block, flags=re.M):
            servers.append((host, int(port)))
    return servers


def nginx_listen_ports(conf: str) -> set[int]:
    return {int(p) for p in re.findall(r"^\s*listen\s+(?:[\d.]+:)?(\d+)", conf, flags=re.M)}


def mounted_host_path(service: dict, container_path: str, root: Path) -> Path | None:
    """Host path that a container path of a service resolves to through its bind mounts."""
    target = PurePosixPath(container_path)
    for source, mount in volume_mounts(service):
        if not is_bind(source):
            continue
        mount = PurePosixPath(mount)
        if target == mount or mount in target.parents:
            return host_path(source, root) / target.relative_to(mount)
    return None


@pytest.fixture(scope="module")
def deploy() -> dict:
    """Everything parsed once; tests deep-copy before mutating."""
    return {
        "compose": load_yaml(COMPOSE),
        "prometheus": load_yaml(PROMETHEUS),
        "nginx": NGINX.read_text(),
        "datasources": load_yaml(DATASOURCES),
        "providers": load_yaml(DASHBOARD_PROVIDERS),
        "dashboard": json.loads(DASHBOARD.read_text()),
        "dockerfile": DOCKERFILE.read_text(),
        "makefile": MAKEFILE.read_text(),
        "readme": README.read_text() if README.exists() else None,
    }


# --------------------------------------------------------------------------- compose checks

def check_compose_services(compose: dict) -> list[str]:
    errors = []
    services = compose.get("services") or {}
    for name in ("igserve", "prometheus", "grafana"):
        if name not in services:
            errors.append(f"compose: service {name!r} missing")
        elif profiles(services[name]):
            errors.append(f"compose: service {name!r} must run without a profile")
    if "igserve" in services and "igserve" not in igserve_services(compose):
        errors.append("compose: service 'igserve' is not built from the repository Dockerfile")
    replicas = [n for n, s in igserve_services(compose).items() if SCALEOUT in profiles(s)]
    if len(replicas) < 2:
        errors.append(f"compose: profile {SCALEOUT!r} needs >= 2 igserve replicas, has {replicas}")
    if "nginx" not in services:
        errors.append("compose: service 'nginx' (load balancer) missing")
    elif SCALEOUT not in profiles(services["nginx"]):
        errors.append(f"compose: service 'nginx' must be in profile {SCALEOUT!r}")
    return errors


def check_igserve_services(compose: dict, dockerfile: str, port: int) -> list[str]:
    errors = []
    instrs = dockerfile_instructions(dockerfile)
    image_env = dockerfile_env(instrs)
    services = igserve_services(compose)
    declared = set((compose.get("volumes") or {}).keys())
    if not services:
        return ["compose: no service is built from the Dockerfile"]
    for name, svc in services.items():
        if port not in container_ports(svc):
            errors.append(f"compose: {name} does not expose/publish the server port {port}")
        cache = service_env(svc).get("IGSERVE_CACHE") or image_env.get("IGSERVE_CACHE")
        if not cache:
            errors.append(f"compose: {name}: IGSERVE_CACHE is set neither in compose nor in the Dockerfile")
        else:
            cache_volumes = [s for s, t in volume_mounts(svc) if t == cache and s in declared]
            if not cache_volumes:
                errors.append(f"compose: {name}: no named volume mounted at IGSERVE_CACHE={cache}")
        if image_env.get("IGSERVE_CACHE") and cache != image_env["IGSERVE_CACHE"]:
            errors.append(f"compose: {name}: IGSERVE_CACHE={cache} differs from the Dockerfile's "
                          f"{image_env['IGSERVE_CACHE']} (where `make model` put the model)")
        hc = healthcheck_text(svc)
        if f":{port}/health" not in hc:
            errors.append(f"compose: {name}: healthcheck does not hit :{port}/health ({hc!r})")
    published = [parse_port(p) for p in (compose["services"].get("igserve") or {}).get("ports", [])]
    if (port, port) not in published:
        errors.append(f"compose: igserve must publish {port}:{port}, has {published}")
    exposed = {int(a.split("/")[0]) for i, args in instrs if i == "EXPOSE" for a in args.split()}
    if port not in exposed:
        errors.append(f"Dockerfile: EXPOSE {port} missing (has {sorted(exposed)})")
    cmd = dockerfile_cmd(instrs)
    m = re.search(r"--port[= ](\d+)", cmd)
    if "igserve serve" not in cmd or not m or int(m.group(1)) != port:
        errors.append(f"Dockerfile: CMD must run `igserve serve ... --port {port}` ({cmd!r})")
    if "--host 0.0.0.0" not in cmd:
        errors.append("Dockerfile: CMD must listen on --host 0.0.0.0")
    if f":{port}/health" not in " ".join(a for i, a in instrs if i == "HEALTHCHECK"):
        errors.append(f"Dockerfile: HEALTHCHECK does not hit :{port}/health")
    return errors


def check_mounts(compose: dict, root: Path) -> list[str]:
    errors = []
    declared = set((compose.get("volumes") or {}).keys())
    for name, svc in (compose.get("services") or {}).items():
        for source, target in volume_mounts(svc):
            if is_bind(source):
                path = host_path(source, root)
                if not path.exists():
                    errors.append(f"compose: {name} mounts {source} -> {target}, but {source} does not exist")
                elif root.resolve() not in path.parents:
                    errors.append(f"compose: {name} mounts {source}, which is outside the repository")
            elif source not in declared:
                errors.append(f"compose: {name} uses volume {source!r} not declared under volumes:")
    return errors


def check_prometheus(compose: dict, prom: dict, port: int, root: Path) -> list[str]:
    errors = []
    services = compose.get("services") or {}
    replicas = igserve_services(compose)
    scraped = set()
    for job, host, target_port in prometheus_targets(prom):
        if host not in services:
            errors.append(f"prometheus: job {job} scrapes {host}:{target_port}, not a compose service")
            continue
        if host in replicas and target_port != port:
            errors.append(f"prometheus: job {job} scrapes {host}:{target_port}, igserve listens on {port}")
        elif target_port not in container_ports(services[host]):
            errors.append(f"prometheus: job {job} scrapes {host}:{target_port}, a port {host} does not expose")
        scraped.add(host)
    for job in prom.get("scrape_configs", []):
        if job.get("metrics_path", "/metrics") != "/metrics":
            errors.append(f"prometheus: job {job['job_name']} scrapes {job['metrics_path']}, not /metrics")
    for name in replicas:
        if name not in scraped:
            errors.append(f"prometheus: igserve replica {name!r} is not scraped")
    svc = services.get("prometheus") or {}
    config = next((a.split("=", 1)[1] for a in svc.get("command", []) or []
                   if str(a).startswith("--config.file=")), "/etc/prometheus/prometheus.yml")
    source = mounted_host_path(svc, config, root)
    if source is None or source != PROMETHEUS.resolve():
        errors.append(f"compose: prometheus reads {config}, which is not deploy/prometheus.yml ({source})")
    if PROMETHEUS_PORT not in container_ports(svc):
        errors.append(f"compose: prometheus does not publish {PROMETHEUS_PORT}")
    return errors


def check_nginx(compose: dict, conf: str, port: int, root: Path) -> list[str]:
    errors = []
    services = compose.get("services") or {}
    svc = services.get("nginx") or {}
    source = mounted_host_path(svc, "/etc/nginx/nginx.conf", root)
    if source is None or source != NGINX.resolve():
        errors.append(f"compose: nginx does not mount deploy/nginx.conf at /etc/nginx/nginx.conf ({source})")
    upstream = nginx_upstream_servers(conf)
    replicas = igserve_services(compose)
    for host, upstream_port in upstream:
        if host not in replicas:
            errors.append(f"nginx: upstream server {host}:{upstream_port} is not an igserve service")
        elif upstream_port != port:
            errors.append(f"nginx: upstream server {host}:{upstream_port}, igserve listens on {port}")
    missing = set(replicas) - {h for h, _ in upstream}
    if missing:
        errors.append(f"nginx: replicas not behind the load balancer: {sorted(missing)}")
    depends = set(svc.get("depends_on") or [])
    if set(replicas) - depends:
        errors.append(f"compose: nginx must depend on every replica, misses {sorted(set(replicas) - depends)}")
    listen = nginx_listen_ports(conf)
    published = {parse_port(p)[1] for p in svc.get("ports", []) or []}
    if not listen or not published or not published <= listen:
        errors.append(f"nginx: listens on {sorted(listen)}, compose publishes {sorted(published)}")
    hc = healthcheck_text(svc)
    if not any(f":{p}/health" in hc for p in listen):
        errors.append(f"compose: nginx healthcheck does not hit /health through the balancer ({hc!r})")
    return errors


def check_grafana(compose: dict, datasources: dict, providers: dict, dashboard: dict,
                  root: Path) -> list[str]:
    errors = []
    services = compose.get("services") or {}
    svc = services.get("grafana") or {}
    prov = mounted_host_path(svc, "/etc/grafana/provisioning", root)
    if prov is None or prov != (GRAFANA / "provisioning").resolve() or not prov.is_dir():
        errors.append(f"compose: grafana must mount deploy/grafana/provisioning at /etc/grafana/provisioning ({prov})")
    if GRAFANA_PORT not in container_ports(svc):
        errors.append(f"compose: grafana does not publish {GRAFANA_PORT}")
    uids = set()
    for ds in datasources.get("datasources", []):
        uids.add(ds.get("uid"))
        if ds.get("type") == "prometheus":
            m = re.fullmatch(r"https?://([^:/]+):(\d+)/?", str(ds.get("url", "")))
            if not m:
                errors.append(f"grafana: datasource url {ds.get('url')!r} is not http://HOST:PORT")
            elif m.group(1) not in services or int(m.group(2)) not in container_ports(services[m.group(1)]):
                errors.append(f"grafana: datasource url {ds['url']} does not name the prometheus service and port")
            elif m.group(1) != "prometheus" or int(m.group(2)) != PROMETHEUS_PORT:
                errors.append(f"grafana: datasource url {ds['url']} is not http://prometheus:{PROMETHEUS_PORT}")
    dashboard_dirs = []
    for provider in providers.get("providers", []):
        path = (provider.get("options") or {}).get("path", "")
        host = mounted_host_path(svc, path, root)
        if host is None or not host.is_dir():
            errors.append(f"grafana: dashboard provider path {path} is not mounted from a repository directory")
        else:
            dashboard_dirs.append(host)
    if DASHBOARD.resolve().parent not in dashboard_dirs:
        errors.append("grafana: no dashboard provider loads deploy/grafana/dashboards")
    home = service_env(svc).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        host = mounted_host_path(svc, home, root)
        if host is None or not host.is_file():
            errors.append(f"grafana: home dashboard {home} is not a mounted file")
    used = set()
    for panel in iter_panels(dashboard):
        for obj in [panel] + list(panel.get("targets", [])):
            ds = obj.get("datasource")
            if isinstance(ds, dict) and ds.get("uid") and not str(ds["uid"]).startswith("$"):
                used.add(ds["uid"])
    if used - uids:
        errors.append(f"grafana: dashboard uses datasource uids {sorted(used - uids)}, provisioned: {sorted(uids)}")
    return errors


def check_dockerfile(dockerfile: str, makefile: str, readme: str | None, root: Path) -> list[str]:
    errors = []
    instrs = dockerfile_instructions(dockerfile)
    froms = [args.split()[0] for i, args in instrs if i == "FROM"]
    if not froms or froms[0] != "python:3.11-slim":
        errors.append(f"Dockerfile: base image must be python:3.11-slim, is {froms}")
    if not any(i == "ARG" and args.split("=")[0] == "TORCH_VARIANT" for i, args in instrs):
        errors.append("Dockerfile: ARG TORCH_VARIANT (cpu|cuda) missing")
    runs = " && ".join(args for i, args in instrs if i == "RUN")
    make_targets = re.findall(r"\bmake\s+([A-Za-z0-9_.\-]+)", runs)
    defined = makefile_targets(makefile)
    for target in ("install", "model"):
        if target not in make_targets:
            errors.append(f"Dockerfile: does not run `make {target}`")
    if readme is None:
        errors.append("README.md missing: the Dockerfile must follow README's install steps")
    for target in make_targets:
        if target not in defined:
            errors.append(f"Dockerfile: runs `make {target}`, which the Makefile does not define")
        if readme is not None and not re.search(rf"\bmake\s+{re.escape(target)}\b", readme):
            errors.append(f"Dockerfile: runs `make {target}`, which README.md does not name")
    if re.search(r"\bpip3?\s+install\b", runs):
        errors.append("Dockerfile: installs with pip directly; use the Makefile targets README uses")
    env = dockerfile_env(instrs)
    for var, make_var in (("IGSERVE_MODEL", "MODEL"), ("IGSERVE_BANK", "BANK")):
        if env.get(var) != makefile_default(makefile, make_var):
            errors.append(f"Dockerfile: {var}={env.get(var)!r} differs from the Makefile's "
                          f"{make_var}={makefile_default(makefile, make_var)!r}")
    bank = env.get("IGSERVE_BANK")
    from server.config import DEFAULT_BANK

    if makefile_default(makefile, "BANK") != DEFAULT_BANK:
        errors.append(f"Makefile: BANK={makefile_default(makefile, 'BANK')!r} differs from igserve serve's "
                      f"default bank {DEFAULT_BANK!r}")
    if bank and not (root / bank).is_file():
        errors.append(f"Dockerfile: IGSERVE_BANK={bank} does not exist in the repository")
    return errors


# --------------------------------------------------------------------------- dashboard vs metrics

SERIES_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "unknown": ("",),
}
# Labels Prometheus adds to every scraped series, plus histogram buckets' `le`.
TARGET_LABELS = {"job", "instance", "__name__"}


def metrics_registry():
    """The registry server.metrics exports on /metrics."""
    module = importlib.import_module("server.metrics")
    registry = getattr(module, "REGISTRY", None)
    if registry is None:  # metrics registered on prometheus_client's default registry
        import prometheus_client

        registry = prometheus_client.REGISTRY
    return registry


def exported_series(registry) -> tuple[set[str], dict[str, set[str]]]:
    """Series names the registry exposes (histograms/counters expanded) and each one's labels."""
    names: set[str] = set()
    family_labels: dict[str, set[str]] = {}
    # Label names of labelled metrics with no child yet are only on the collector objects.
    for collector in list(getattr(registry, "_collector_to_names", {})):
        name = getattr(collector, "_name", None)
        labelnames = getattr(collector, "_labelnames", None)
        if name and labelnames is not None:
            family_labels[name] = set(labelnames)
    labels: dict[str, set[str]] = {}
    for family in registry.collect():
        series = {family.name + s for s in SERIES_SUFFIXES.get(family.type, ("",))}
        series |= {sample.name for sample in family.samples}
        fam_labels = family_labels.get(family.name)
        if fam_labels is None and family.samples:
            fam_labels = set().union(*(set(s.labels) for s in family.samples)) - {"le", "quantile"}
        for s in series:
            extra = {"le"} if s.endswith("_bucket") else set()
            labels[s] = None if fam_labels is None else fam_labels | extra
        names |= series
    return names, labels


def iter_panels(dashboard: dict):
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop(0)
        yield panel
        stack[0:0] = panel.get("panels", []) or []


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query template variable."""
    out = []
    for panel in iter_panels(dashboard):
        for target in panel.get("targets", []) or []:
            if target.get("expr"):
                out.append((f"panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]))
    for var in (dashboard.get("templating") or {}).get("list", []):
        if var.get("type") == "query":
            query = var.get("query")
            query = query.get("query") if isinstance(query, dict) else query
            if query:
                out.append((f"variable ${var.get('name')}", query))
    return out


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_METRIC = re.compile(r"(?<![\w:$.])(igserve_[A-Za-z0-9_:]*)")


def promql_metric_names(expr: str) -> set[str]:
    """igserve_* metric names an expression (or a Grafana label_values() query) selects."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))


def promql_label_names(expr: str) -> set[str]:
    """Label names used in grouping clauses, selectors and label_values(..., label)."""
    code = _STRING.sub('""', expr)
    labels = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", code):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    for selector in re.findall(r"\{([^}]*)\}", code):
        labels |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", selector))
    m = re.match(r"\s*label_values\((?:.*,)?\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", code)
    if m:
        labels.add(m.group(1))
    return labels


def check_dashboard_metrics(dashboard: dict, exported: set[str],
                            labels: dict[str, set[str] | None] | None = None) -> list[str]:
    """Every igserve_* metric a query names is exported; every label it uses exists on it."""
    errors = []
    labels = labels or {}
    for where, expr in dashboard_queries(dashboard):
        metrics = promql_metric_names(expr)
        for name in sorted(metrics - exported):
            errors.append(f"{where}: metric {name!r} is not exported by server.metrics")
        known = [labels.get(m) for m in metrics if m in exported]
        if not known or any(k is None for k in known):
            continue
        allowed = TARGET_LABELS.union(*known)
        for label in sorted(promql_label_names(expr) - allowed):
            errors.append(f"{where}: label {label!r} is not on {sorted(metrics)}")
    return errors


REQUIRED_PANELS = {
    "request rate": r"rate\(igserve_request_success_total",
    "latency p50": r"histogram_quantile\(0\.5\b.*igserve_e2e_request_latency_seconds_bucket",
    "latency p95": r"histogram_quantile\(0\.95\b.*igserve_e2e_request_latency_seconds_bucket",
    "latency p99": r"histogram_quantile\(0\.99\b.*igserve_e2e_request_latency_seconds_bucket",
    "TTFT p50": r"histogram_quantile\(0\.5\b.*igserve_time_to_first_token_seconds_bucket",
    "TTFT p95": r"histogram_quantile\(0\.95\b.*igserve_time_to_first_token_seconds_bucket",
    "TTFT p99": r"histogram_quantile\(0\.99\b.*igserve_time_to_first_token_seconds_bucket",
    "tokens/s": r"rate\(igserve_generation_tokens_total",
    "skip ratio over time": r"igserve_skip_ratio_(sum|count|bucket)",
    "requests per mask": r"by \(mask\).*igserve_requests_by_mask_total",
    "queue depth": r"igserve_num_requests_waiting",
    "errors by type": r"by \(error_type\).*igserve_request_errors_total",
    "requests per budget": r"by \(budget\).*igserve_requests_by_budget_total",
    "adaptive-depth admissions": r"rate\(igserve_adaptive_depth_requests_total",
    "OOD fallbacks": r"rate\(igserve_router_fallbacks_total",
}


def check_dashboard_coverage(dashboard: dict) -> list[str]:
    exprs = [expr for _, expr in dashboard_queries(dashboard)]
    return [f"dashboard: no panel shows {what} (/{pattern}/)"
            for what, pattern in REQUIRED_PANELS.items()
            if not any(re.search(pattern, e) for e in exprs)]


def check_dashboard_structure(dashboard: dict) -> list[str]:
    errors = []
    ids = [p.get("id") for p in iter_panels(dashboard)]
    if len(ids) != len(set(ids)):
        errors.append("dashboard: panel ids are not unique")
    if not dashboard.get("uid"):
        errors.append("dashboard: uid missing (provisioned dashboards need a stable uid)")
    for panel in iter_panels(dashboard):
        if panel.get("type") == "row":
            continue
        targets = panel.get("targets") or []
        if not targets or not all(t.get("expr") for t in targets):
            errors.append(f"dashboard: panel {panel.get('title')!r} has a target without a query")
        refs = [t.get("refId") for t in targets]
        if len(refs) != len(set(refs)):
            errors.append(f"dashboard: panel {panel.get('title')!r} repeats a refId")
    return errors


# --------------------------------------------------------------------------- tests: real files

def test_compose_services(deploy):
    assert check_compose_services(deploy["compose"]) == []


def test_igserve_services_port_cache_healthcheck(deploy):
    assert check_igserve_services(deploy["compose"], deploy["dockerfile"], default_port()) == []


def test_compose_mounts_exist(deploy):
    assert check_mounts(deploy["compose"], ROOT) == []


def test_prometheus_scrapes_every_replica(deploy):
    assert check_prometheus(deploy["compose"], deploy["prometheus"], default_port(), ROOT) == []


def test_nginx_balances_every_replica(deploy):
    assert check_nginx(deploy["compose"], deploy["nginx"], default_port(), ROOT) == []


def test_grafana_provisioning(deploy):
    assert check_grafana(deploy["compose"], deploy["datasources"], deploy["providers"],
                         deploy["dashboard"], ROOT) == []


def test_dockerfile_follows_readme_and_makefile(deploy):
    assert check_dockerfile(deploy["dockerfile"], deploy["makefile"], deploy["readme"], ROOT) == []


def test_dashboard_structure_and_coverage(deploy):
    assert check_dashboard_structure(deploy["dashboard"]) == []
    assert check_dashboard_coverage(deploy["dashboard"]) == []


def test_dashboard_metrics_are_exported(deploy):
    exported, labels = exported_series(metrics_registry())
    assert any(name.startswith("igserve_") for name in exported), "server.metrics exports no igserve_* metric"
    assert check_dashboard_metrics(deploy["dashboard"], exported, labels) == []


# --------------------------------------------------------------------------- tests: mutations

def _rename_service(compose: dict, old: str, new: str) -> dict:
    compose = copy.deepcopy(compose)
    compose["services"] = {(new if k == old else k): v for k, v in compose["services"].items()}
    return compose


def test_renamed_igserve_service_is_rejected(deploy):
    compose = _rename_service(deploy["compose"], "igserve", "igserve-main")
    port = default_port()
    assert check_compose_services(compose)
    assert any("igserve:" in e for e in check_prometheus(compose, deploy["prometheus"], port, ROOT))
    assert any("igserve-main" in e for e in check_prometheus(compose, deploy["prometheus"], port, ROOT))
    assert check_nginx(compose, deploy["nginx"], port, ROOT)


def test_renamed_replica_is_rejected(deploy):
    compose = _rename_service(deploy["compose"], "igserve-2", "igserve-b")
    port = default_port()
    assert any("igserve-b" in e for e in check_prometheus(compose, deploy["prometheus"], port, ROOT))
    assert any("igserve-b" in e for e in check_nginx(compose, deploy["nginx"], port, ROOT))


def test_renamed_mount_path_is_rejected(deploy):
    compose = copy.deepcopy(deploy["compose"])
    compose["services"]["prometheus"]["volumes"][0] = "./deploy/prom.yml:/etc/prometheus/prometheus.yml:ro"
    assert any("prom.yml" in e for e in check_mounts(compose, ROOT))
    assert check_prometheus(compose, deploy["prometheus"], default_port(), ROOT)
    compose = copy.deepcopy(deploy["compose"])
    compose["services"]["grafana"]["volumes"][1] = "./deploy/grafana/boards:/etc/grafana/dashboards:ro"
    assert check_mounts(compose, ROOT)
    assert check_grafana(compose, deploy["datasources"], deploy["providers"], deploy["dashboard"], ROOT)


def test_wrong_ports_are_rejected(deploy):
    port = default_port()
    compose = copy.deepcopy(deploy["compose"])
    compose["services"]["igserve"]["ports"] = [f"{port + 1}:{port + 1}"]
    assert check_igserve_services(compose, deploy["dockerfile"], port)
    prom = copy.deepcopy(deploy["prometheus"])
    prom["scrape_configs"][0]["static_configs"][0]["targets"] = [f"igserve:{port + 1}"]
    assert check_prometheus(deploy["compose"], prom, port, ROOT)
    prom = copy.deepcopy(deploy["prometheus"])
    prom["scrape_configs"][0]["dns_sd_configs"][0]["port"] = port + 1
    assert check_prometheus(deploy["compose"], prom, port, ROOT)
    assert check_nginx(deploy["compose"], deploy["nginx"].replace(f":{port}", f":{port + 1}"), port, ROOT)
    assert check_nginx(deploy["compose"], deploy["nginx"].replace("listen 8080", "listen 8081"), port, ROOT)
    assert check_igserve_services(deploy["compose"], deploy["dockerfile"].replace(f"--port {port}", "--port 9"), port)


def test_broken_healthcheck_and_cache_are_rejected(deploy):
    compose = copy.deepcopy(deploy["compose"])
    svc = compose["services"]["igserve"]
    svc["healthcheck"] = dict(svc["healthcheck"], test=["CMD", "true"])
    assert any("healthcheck" in e for e in check_igserve_services(compose, deploy["dockerfile"], default_port()))
    compose = copy.deepcopy(deploy["compose"])
    compose["services"]["igserve-1"]["environment"] = dict(
        compose["services"]["igserve-1"]["environment"], IGSERVE_CACHE="/somewhere/else")
    assert any("IGSERVE_CACHE" in e for e in check_igserve_services(compose, deploy["dockerfile"], default_port()))


def test_grafana_renames_are_rejected(deploy):
    datasources = copy.deepcopy(deploy["datasources"])
    datasources["datasources"][0]["url"] = "http://prom:9090"
    assert check_grafana(deploy["compose"], datasources, deploy["providers"], deploy["dashboard"], ROOT)
    datasources = copy.deepcopy(deploy["datasources"])
    datasources["datasources"][0]["uid"] = "other"
    assert any("uid" in e for e in check_grafana(deploy["compose"], datasources, deploy["providers"],
                                                 deploy["dashboard"], ROOT))
    providers = copy.deepcopy(deploy["providers"])
    providers["providers"][0]["options"]["path"] = "/var/lib/grafana/dashboards"
    assert check_grafana(deploy["compose"], deploy["datasources"], providers, deploy["dashboard"], ROOT)


def test_dockerfile_mutations_are_rejected(deploy):
    df, mk, readme = deploy["dockerfile"], deploy["makefile"], deploy["readme"] or ""
    readme = readme + "\nmake install\nmake model\nmake setup\n"
    assert check_dockerfile(df.replace("make install", "make setup"), mk, readme, ROOT)
    assert check_dockerfile(df.replace("make model", "pip install ."), mk, readme, ROOT)
    assert check_dockerfile(df.replace("FROM python:3.11-slim", "FROM python:3.12"), mk, readme, ROOT)
    assert any("README" in e for e in check_dockerfile(df, mk, "nothing here", ROOT))


def test_dashboard_checker_reports_bogus_metric_and_label():
    exported = {"igserve_requests_by_mask_total", "igserve_skip_ratio_bucket"}
    labels = {"igserve_requests_by_mask_total": {"model_name", "mask"},
              "igserve_skip_ratio_bucket": {"model_name", "le"}}
    fake = {"panels": [
        {"type": "row", "id": 1, "title": "row", "panels": [
            {"type": "timeseries", "id": 2, "title": "nested", "targets": [
                {"refId": "A", "expr": 'sum by (mask) (rate(igserve_requests_by_mask_total{mask!="igserve_x"}[5m]))'},
                {"refId": "B", "expr": "rate(igserve_no_such_metric_total[5m])"}]}]},
        {"type": "timeseries", "id": 3, "title": "bogus label", "targets": [
            {"refId": "A",
             "expr": "histogram_quantile(0.5, sum by (le, mask_id) (rate(igserve_skip_ratio_bucket[5m])))"}]},
        {"type": "timeseries", "id": 4, "title": "bare histogram", "targets": [
            {"refId": "A", "expr": "igserve_skip_ratio"}]},
    ], "templating": {"list": [{"name": "m", "type": "query",
                                "query": {"query": "label_values(igserve_bogus_gauge, model_name)"}}]}}
    errors = check_dashboard_metrics(fake, exported, labels)
    assert len(errors) == 4, errors
    assert any("igserve_no_such_metric_total" in e and "'nested'" in e for e in errors)
    assert any("'mask_id'" in e for e in errors)
    assert any("'igserve_skip_ratio'" in e for e in errors)  # a histogram has no bare series
    assert any("igserve_bogus_gauge" in e and "$m" in e for e in errors)
    assert not any("igserve_x" in e for e in errors)  # names inside strings are not metrics
    assert check_dashboard_coverage(fake)


def test_exported_series_expands_histograms_and_counters():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()
    Histogram("igserve_h_seconds", "h", ["model_name"], registry=registry)
    Counter("igserve_c", "c", ["model_name", "mask"], registry=registry)
    Gauge("igserve_g", "g", ["model_name"], registry=registry)
    names, labels = exported_series(registry)
    assert {"igserve_h_seconds_bucket", "igserve_h_seconds_sum", "igserve_h_seconds_count",
            "igserve_c_total", "igserve_g"} <= names
    assert "igserve_h_seconds" not in names and "igserve_c" not in names
    assert labels["igserve_c_total"] == {"model_name", "mask"}
    assert labels["igserve_h_seconds_bucket"] == {"model_name", "le"}
