"""A real S3 API on localhost for the fsspec tests: moto's threaded server, and a way to make it check
credentials (by default moto accepts any key and secret, so a wrong secret would go unnoticed).

Moto keeps its buckets and its auth switch per process, not per server: servers started by two test
modules share buckets (give each module its own bucket names), and :func:`enforced_auth` holds for every
server of the process until it exits.
"""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock
from urllib.parse import quote, unquote

_HELD: list[socket.socket] = []


def refused_port() -> int:
    """A port on 127.0.0.1 that refuses every connection for the rest of the process: an unreachable
    endpoint. Its socket stays bound and never listens, so no other process (another pytest-xdist worker's
    server) can take the port meanwhile, as one merely found free could be."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _HELD.append(s)
    return s.getsockname()[1]


@contextmanager
def moto_s3() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the duration; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    # Port 0: the kernel picks a free port as the server binds it. A port merely found free beforehand
    # can be taken in between by another test process (pytest-xdist's workers each start servers), and then
    # ThreadedMotoServer.start() waits forever for a server that failed to bind.
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    finally:
        server.stop()


def client(endpoint: str, service: str = "s3", **credentials: str):
    """A boto3 client of the server; credentials from the environment unless given
    (``aws_access_key_id=``, ``aws_secret_access_key=``)."""
    import boto3

    return boto3.client(service, endpoint_url=endpoint, region_name="us-east-1", **credentials)


def options(endpoint: str, **extra) -> dict:
    """s3fs storage options for the server: one attempt per request, so a refusal fails fast."""
    return {
        "client_kwargs": {"endpoint_url": endpoint},
        "config_kwargs": {"retries": {"max_attempts": 1}},
        **extra,
    }


def _requoted(path: str) -> str:
    """``path`` with its query values percent-encoded again. Moto's server hands its signature check the
    query decoded (``prefix=data/`` where the client signed ``prefix=data%2F``), so every listing with a
    "/" in its prefix fails with SignatureDoesNotMatch under enforced auth (getmoto/moto#5948)."""
    base, sep, query = path.partition("?")
    if not sep:
        return path
    pairs = (pair.partition("=") for pair in query.split("&"))
    return base + "?" + "&".join(k + eq + quote(unquote(v), safe="-_.~") for k, eq, v in pairs)


@contextmanager
def enforced_auth(endpoint: str) -> Iterator[tuple[str, str]]:
    """Make moto check every request's signature and permissions; yields a real IAM user's (key id,
    secret), allowed everything: the good credentials. Other keys, and a wrong secret for this key, are
    refused with 403. Process-global (``moto.settings.INITIAL_NO_AUTH_ACTION_COUNT``, read on each
    request): restored on exit."""
    from moto import settings
    from moto.core.authorization import ActionAuthenticatorMixin
    from moto.iam.access_control import IAMRequestBase

    iam = client(endpoint, "iam", aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
    user = f"vlfast-test-{uuid.uuid4().hex[:12]}"
    iam.create_user(UserName=user)
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    iam.put_user_policy(UserName=user, PolicyName="everything", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]

    create_request = IAMRequestBase._create_aws_request

    def requoted_request(self):
        self._path = _requoted(self._path)
        return create_request(self)

    saved = settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count
    settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = 0, 0
    try:
        with mock.patch.object(IAMRequestBase, "_create_aws_request", requoted_request):
            yield key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        settings.INITIAL_NO_AUTH_ACTION_COUNT, ActionAuthenticatorMixin.request_count = saved
