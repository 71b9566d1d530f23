"""The deployment examples parse, run the router as the CLI accepts it, and scale on metrics
the router exports."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml
from prometheus_client import generate_latest

from tandem.router.app import RouterMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _router_parser() -> argparse.ArgumentParser:
    from tandem.router.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_docker_compose_runs_a_router_over_its_workers():
    doc = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    router = doc["services"]["router"]["command"]
    args = _router_parser().parse_args(router[1:])
    workers = {name for name in doc["services"] if name.startswith("worker")}
    assert {u.split("//")[1].split(":")[0] for u in args.worker} == workers


def test_the_kubernetes_router_and_the_autoscaler_agree_on_names_and_metrics():
    docs = list(yaml.safe_load_all((DEPLOY / "kubernetes" / "router.yaml").read_text()))
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("Deployment", "tandem-router") in kinds and ("Deployment", "tandem-worker") in kinds
    router = next(
        d for d in docs if d["metadata"]["name"] == "tandem-router" and d["kind"] == "Deployment"
    )
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert _router_parser().parse_args(args[1:]).worker_file == "/workers/urls"
    (scaler,) = yaml.safe_load_all((DEPLOY / "kubernetes" / "keda-scaledobject.yaml").read_text())
    assert scaler["spec"]["scaleTargetRef"]["name"] == "tandem-worker"
    exported = generate_latest(RouterMetrics().registry).decode()
    for trigger in scaler["spec"]["triggers"]:
        metric = trigger["metadata"]["query"].split("(")[1].rstrip(")")
        assert f"# TYPE {metric} gauge" in exported


def test_the_kubernetes_manifests_are_valid_against_kubernetes_own_schemas():
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    checked = []
    for path in sorted((DEPLOY / "kubernetes").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc["apiVersion"].startswith("keda.sh/"):
                continue  # a KEDA custom resource: no schema in Kubernetes' own (fields checked above)
            kubernetes_validate.validate(doc, version, strict=True)
            checked.append(doc["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= set(checked)


def test_the_hpa_scales_the_worker_deployment_on_the_routers_desired_workers():
    hpa = yaml.safe_load((DEPLOY / "kubernetes" / "hpa.yaml").read_text())
    assert hpa["spec"]["scaleTargetRef"]["name"] == "tandem-worker"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["external"]["metric"]["name"] == "tandem_router_desired_workers"
    exported = generate_latest(RouterMetrics().registry).decode()
    assert "# TYPE tandem:router_desired_workers gauge" in exported
