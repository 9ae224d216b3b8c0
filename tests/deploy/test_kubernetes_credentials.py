"""Every Corral workload on Kubernetes reads its own role's NATS credentials from the
corral-credentials Secret (and nothing else of it but what it needs), the llumlets the KV secret,
and the NATS servers the configuration made with the same table (SECURITY.md)."""

from __future__ import annotations

import pytest

from shared.nats_auth import ROLES
from tests.deploy.manifests import OVERLAYS, containers, render_overlay

EXTRA_FILES = {"llumlet": {"kv.secret", "admin.creds"}}  # the KV secret; its preStop drain's role


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_workload_mounts_only_its_roles_credentials(overlay):
    docs = render_overlay(overlay)
    seen = set()
    for doc in docs:
        if doc.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        spec = doc["spec"]["template"]["spec"]
        (secret,) = [v["secret"] for v in spec["volumes"] if v["name"] == "corral-credentials"]
        assert secret["secretName"] == "corral-credentials"
        files = {item["path"] for item in secret["items"]}
        (container,) = containers(doc)
        if doc["metadata"]["name"] == "nats":
            assert files == {"nats-server.conf"}
            continue
        role = container["args"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert role in ROLES and env["CORRAL_NATS_CREDS"] == f"/run/corral/{role}.creds", doc["metadata"]["name"]
        assert files == {f"{role}.creds", *EXTRA_FILES.get(role, ())}, doc["metadata"]["name"]
        if role == "llumlet":
            assert env["CORRAL_KV_SECRET_FILE"] == "/run/corral/kv.secret"
            assert container["lifecycle"]["preStop"]["exec"]["command"][-2:] == ["--nats-creds", "/run/corral/admin.creds"]
        seen.add(role)
    assert seen == {"scheduler", "gateway", "llumlet", "autoscaler"}
