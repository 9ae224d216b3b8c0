"""Who may say what on Corral's NATS: one user per role, each allowed only its own subjects.

The table below is the whole authorisation policy, derived from `shared.subjects` (the subjects
each service publishes and subscribes to): a llumlet's credentials cannot publish a migration
order or a generate order, a gateway's cannot publish a load report or a token chunk, and so on.
`server_config` turns it into nats-server's `authorization` block (what `corral up` gives the
embedded server; deploy/ carries the same table); `client_options` gives one process its
credentials and TLS settings, from the environment that the `--nats-creds`/`--nats-tls-*` flags
set (every NATS connection a process opens, whichever service or tool opens it, reads one place).

Request/reply: a requester subscribes to its inbox (`_INBOX.>`), a responder answers through
`allow_responses` (only the reply subject of a message it received, once) and needs no publish
right on inboxes. The gateway's token stream is a plain subject, published by llumlets.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import shutil
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared import subjects

INBOX = "_INBOX.>"
JWT_CREDS_HEADER = "-----BEGIN NATS USER JWT-----"
ENV_CREDS, ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY = (
    "CORRAL_NATS_CREDS", "CORRAL_NATS_TLS_CA", "CORRAL_NATS_TLS_CERT", "CORRAL_NATS_TLS_KEY")


def _any(subject_of_id: str) -> str:
    """A subject built for the placeholder id `ID`, with the id as a wildcard token."""
    return ".".join("*" if token == "ID" else token for token in subject_of_id.split("."))


def _migration_verbs() -> list[str]:
    return [_any(subjects.migration("ID", verb)) for verb in ("prealloc", "abort", "commit", "notice")]


@dataclass(frozen=True)
class Permissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool  # answers requests (allow_responses)


ROLES: dict[str, Permissions] = {
    # Runs one engine: reports load, streams tokens to gateways, migrates to other llumlets.
    "llumlet": Permissions(
        publish=(_any(subjects.load_report("ID")), _any(subjects.gateway_output("ID")), *_migration_verbs(),
                 _any(subjects.kv_events("ID")), _any(subjects.kv_snapshot("ID")), subjects.HANDOFF),
        subscribe=(*(_any(subjects.llumlet("ID", v)) for v in ("generate", "drain", "migrate", "kv_snapshot")),
                   subjects.ABORT_ALL,
                   *_migration_verbs(), subjects.GATEWAY_HEARTBEATS_ALL, INBOX),
        responds=True),
    # Dispatch answers and migration orders.
    "scheduler": Permissions(
        publish=(_any(subjects.llumlet("ID", "migrate")), _any(subjects.llumlet("ID", "kv_snapshot")),
                 subjects.SCHEDULER_HEARTBEAT),
        subscribe=(subjects.LOAD_REPORTS_ALL, subjects.DISPATCH, subjects.HANDOFF, subjects.SCHEDULER_HEARTBEAT,
                   subjects.KV_ALL, INBOX),
        responds=True),
    # Client requests in: dispatch, generate and abort orders; tokens back.
    "gateway": Permissions(
        publish=(subjects.DISPATCH, _any(subjects.llumlet("ID", "generate")), subjects.ABORT_ALL,
                 _any(subjects.gateway_heartbeat("ID"))),
        subscribe=(_any(subjects.gateway_output("ID")), subjects.LOAD_REPORTS_ALL, INBOX),
        responds=False),
    # Drains instances it scales in and tells observers.
    "autoscaler": Permissions(
        publish=(_any(subjects.llumlet("ID", "drain")), subjects.SCALING_EVENTS),
        subscribe=(subjects.LOAD_REPORTS_ALL, INBOX),
        responds=False),
    # An operator's tools (`corral drain`, dashboards): drain orders, and watching.
    "admin": Permissions(
        publish=(_any(subjects.llumlet("ID", "drain")),),
        subscribe=(subjects.LOAD_REPORTS_ALL, subjects.SCALING_EVENTS, INBOX),
        responds=False),
}


@dataclass(frozen=True)
class Credential:
    user: str
    password: str

    def line(self) -> str:
        return f"{self.user}:{self.password}\n"


def new_credentials() -> dict[str, Credential]:
    """A fresh random password for every role (user name = role)."""
    return {role: Credential(role, secrets.token_urlsafe(24)) for role in ROLES}


def write_credentials(directory: Path, credentials: dict[str, Credential]) -> dict[str, Path]:
    """One `<role>.creds` file per role (`user:password`, mode 0600) in a 0700 directory."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(directory, 0o700)
    paths = {}
    for role, credential in credentials.items():
        path = directory / f"{role}.creds"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(credential.line())
        paths[role] = path
    return paths


def _quoted(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f'"{item}"' for item in items) + "]"


def authorization_block(credentials: dict[str, Credential]) -> str:
    """nats-server's `authorization { users = [...] }` for these credentials and `ROLES`."""
    users = []
    for role, credential in credentials.items():
        perms = ROLES[role]
        responses = "\n        allow_responses: true" if perms.responds else ""
        users.append(
            f'    {{user: "{credential.user}", password: "{credential.password}", permissions: {{\n'
            f"        publish: {{allow: {_quoted(perms.publish)}}}\n"
            f"        subscribe: {{allow: {_quoted(perms.subscribe)}}}{responses}\n"
            f"    }}}}")
    return "authorization {\n  users = [\n" + ",\n".join(users) + "\n  ]\n}\n"


def server_config(credentials: dict[str, Credential] | None, tls_cert: str | None = None,
                  tls_key: str | None = None) -> str:
    """A nats-server configuration file's text: authorisation per role, TLS when given."""
    text = authorization_block(credentials) if credentials else ""
    if tls_cert and tls_key:
        text += f'tls {{\n  cert_file: "{tls_cert}"\n  key_file: "{tls_key}"\n}}\n'
    return text


# ---------------------------------------------------------------------------------------------
# The client side: one process's credentials and TLS
# ---------------------------------------------------------------------------------------------


def read_credentials(path: str) -> dict[str, str]:
    """nats.connect's options for a credentials file: a NATS JWT `.creds` file (nkeys, from an
    operator's `nsc`) as it is, or Corral's own `user:password` line."""
    text = Path(path).read_text()
    if JWT_CREDS_HEADER in text:
        return {"user_credentials": path}
    user, sep, password = text.strip().partition(":")
    if not sep or not user or not password or "\n" in password:
        raise ValueError(f"{path}: expected one line 'user:password' or a NATS .creds file")
    return {"user": user, "password": password}


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext | None:
    """TLS to NATS: the server verified against `ca` (or the system's), a client certificate
    when `cert`/`key` are given (the server may require one: mutual TLS). None: no TLS."""
    if not (ca or cert):
        return None
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context


def client_options(environ: os._Environ | dict[str, str] = os.environ) -> dict:
    """What this process adds to nats.connect: credentials and TLS, from CORRAL_NATS_* variables."""
    options: dict = {}
    creds = environ.get(ENV_CREDS)
    if creds:
        options.update(read_credentials(creds))
    context = tls_context(environ.get(ENV_TLS_CA), environ.get(ENV_TLS_CERT), environ.get(ENV_TLS_KEY))
    if context is not None:
        options["tls"] = context
    return options


_FLAGS = (
    ("--nats-creds", "nats_creds", ENV_CREDS, "NATS credentials: a file 'user:password' or a NATS .creds file"),
    ("--nats-tls-ca", "nats_tls_ca", ENV_TLS_CA, "CA certificate to verify the NATS server with (turns TLS on)"),
    ("--nats-tls-cert", "nats_tls_cert", ENV_TLS_CERT, "client certificate for NATS (mutual TLS)"),
    ("--nats-tls-key", "nats_tls_key", ENV_TLS_KEY, "the client certificate's key"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--nats-creds and --nats-tls-{ca,cert,key}, each with its CORRAL_* variable."""
    for flag, dest, variable, text in _FLAGS:
        parser.add_argument(flag, dest=dest, default=os.environ.get(variable), help=f"{text} (env {variable})")


def export(args: argparse.Namespace) -> None:
    """Put the flags given into the environment, where `client_options` reads them (and child
    processes inherit them). Called when a command runs, not while parsing: parsing a command
    line (tests, manifests checks) changes nothing."""
    for _, dest, variable, _ in _FLAGS:
        value = getattr(args, dest, None)
        if value:
            os.environ[variable] = value


# ---------------------------------------------------------------------------------------------
# `corral up`: the embedded server's users, and each child's credentials
# ---------------------------------------------------------------------------------------------


@dataclass
class EmbeddedAuth:
    """Fresh credentials for one `corral up` run, in a private directory removed at the end."""

    directory: Path
    config: Path  # the server's configuration (holds the passwords: 0600 too)
    paths: dict[str, Path]  # role -> its credentials file

    @classmethod
    def create(cls, tls_cert: str | None = None, tls_key: str | None = None) -> EmbeddedAuth:
        directory = Path(tempfile.mkdtemp(prefix="corral-nats-"))  # 0700
        credentials = new_credentials()
        paths = write_credentials(directory, credentials)
        config = directory / "nats-server.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(server_config(credentials, tls_cert, tls_key))
        return cls(directory, config, paths)

    def argv_for(self, argv: list[str]) -> list[str]:
        """A child's command line (`<service> …`) with its role's credentials; an autoscaler's
        llumlets (its --llumlet-args) get the llumlet's."""
        role = argv[0]
        argv = [*argv, "--nats-creds", str(self.paths[role])]
        if "--llumlet-args" in argv:
            at = argv.index("--llumlet-args") + 1
            argv[at] = shlex.join([*shlex.split(argv[at]), "--nats-creds", str(self.paths["llumlet"])])
        return argv

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# A deployment's credentials (docker compose's one-shot `credentials` service runs this)
# ---------------------------------------------------------------------------------------------

KV_SECRET_FILE = "kv.secret"
SERVER_CONFIG_FILE = "nats-server.conf"


def write_deployment(directory: Path, tls_cert: str | None = None, tls_key: str | None = None) -> bool:
    """Credentials for every role, the server's configuration and a KV secret, in `directory`;
    kept as they are when there already (False), so restarts keep one set. True: made now."""
    if (directory / SERVER_CONFIG_FILE).exists():
        return False
    credentials = new_credentials()
    write_credentials(directory, credentials)
    for name, text in ((SERVER_CONFIG_FILE, server_config(credentials, tls_cert, tls_key)),
                       (KV_SECRET_FILE, secrets.token_urlsafe(32) + "\n")):
        fd = os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
    return True


if __name__ == "__main__":  # python -m shared.nats_auth DIR
    import sys

    made = write_deployment(Path(sys.argv[1]))
    print(f"{'made' if made else 'kept'} Corral's NATS credentials and KV secret in {sys.argv[1]}")
