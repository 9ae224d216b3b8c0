"""Reading the deploy files as the tools do: overlays rendered by `kubectl kustomize`, the compose
file resolved by a compose implementation, and each container's command parsed by `corral`'s own
argument parser (so a manifest can only run an entry point that exists, with flags it takes)."""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml

from tests.support.cluster import REPO

KUBERNETES = REPO / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (KUBERNETES / "overlays").iterdir() if (p / "kustomization.yaml").exists())


def render_overlay(name: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    out = subprocess.run([kubectl, "kustomize", str(KUBERNETES / "overlays" / name)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def find(docs: list[dict], kind: str, name: str) -> dict:
    matches = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def llumlet_deployments(docs: list[dict]) -> list[dict]:
    """The llumlet Deployments: `corral-llumlet`, or one per prefill/decode pool (the -pd overlays)."""
    found = [d for d in docs if d["kind"] == "Deployment"
             and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/name") == "corral-llumlet"]
    assert found, "no llumlet Deployment"
    return found


def containers(doc: dict) -> list[dict]:
    return doc["spec"]["template"]["spec"]["containers"]


def parse_corral(argv: list[str]) -> argparse.Namespace:
    """`corral ARGV` as the CLI parses it; a SystemExit (unknown command or flag) fails the test."""
    from services.cli import build_parser

    parser = build_parser()
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"`corral {shlex.join(argv)}` does not parse") from exc


def corral_argv_of_shell(script: str, rest: list[str]) -> list[str]:
    """The corral argv an `sh -c SCRIPT NAME ARGS…` entry point runs, found by running it with `sh`
    and stand-ins for `corral` (prints its arguments) and `hostname -i` (prints 10.0.0.7)."""
    script = script.replace("$$", "$")  # compose's escape, kept by some implementations' `config`
    with tempfile.TemporaryDirectory() as shims:
        for name, body in (("corral", 'printf "%s\\0" corral "$@"'), ("hostname", "echo 10.0.0.7")):
            path = Path(shims) / name
            path.write_text(f"#!/bin/sh\n{body}\n")
            path.chmod(0o755)
        done = subprocess.run(["sh", "-c", script, *rest], capture_output=True, text=True, timeout=30,
                              env={"PATH": f"{shims}:/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    argv = done.stdout.split("\0")[:-1]
    assert argv[:1] == ["corral"], f"{script!r} does not run corral: {argv}"
    return argv[1:]


def compose_command() -> list[str] | None:
    """A compose implementation that can resolve the file without a Docker engine."""
    for candidate in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(candidate[0]) is None:
            continue
        probe = subprocess.run([*candidate, "version"], capture_output=True, text=True)
        if probe.returncode == 0:
            return candidate
    return None


def compose_config(command: list[str], profile: str | None, env: dict[str, str]) -> dict:
    argv = [*command, "-f", str(REPO / "docker-compose.yml")]
    if profile:
        argv += ["--profile", profile]
    done = subprocess.run([*argv, "config"], capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


def active_services(config: dict, profiles: set[str]) -> dict[str, dict]:
    """What `up` starts with these profiles: services without profiles, and those in one of them."""
    return {name: svc for name, svc in config["services"].items()
            if not svc.get("profiles") or profiles & set(svc["profiles"])}


def repo_path(path: str) -> Path:
    return (REPO / path).resolve()
