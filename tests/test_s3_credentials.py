"""S3 credentials found the ways the AWS CLI finds them, through aws-config's chain
(src/store/aws_credentials.rs): a `credential_process` program, SSO from a cached token
and a portal of ours, an EKS-style container credential endpoint of ours, a role assumed through
moto's STS (from a source profile, and from `credential_source = Ec2InstanceMetadata`), and IMDSv2
of ours. Every server is on 127.0.0.1: AWS_EC2_METADATA_DISABLED stays set, except where
AWS_EC2_METADATA_SERVICE_ENDPOINT names our own metadata server.

Each success proves the credentials were used: SeaweedFS (SigV4 enforced) accepts only its own
keys, which only the flow under test hands out; where the flow adds a session token (SeaweedFS
takes those for its own STS tokens and refuses them), the store is moto behind a recording relay
that shows which key signed every request. Each flow also has a failure with a clear message.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import fastload
import helpers
import pytest
from helpers import assert_same_tensors, reference
from servers import s3 as s3_server
from servers.s3 import ACCESS_KEY, BUCKET, REGION, SECRET_KEY, closed_port, upload

moto_s3 = s3_server.moto_s3
aws_env = s3_server.aws_env

URI = f"s3://{BUCKET}/all.safetensors"
ERROR_DEADLINE = 60.0


def iso_in(seconds: float) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def bucket(s3_store):
    return s3_store.server


@pytest.fixture
def home(aws_env, monkeypatch, tmp_path) -> Path:
    """An empty HOME with ~/.aws/config as the config file; region set, no keys anywhere."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".aws").mkdir()
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / ".aws" / "config"))
    monkeypatch.setenv("AWS_REGION", REGION)
    return tmp_path


def serve(handler: Callable[[http.server.BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering every request with `handler`; yields its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            handler(self)

        do_POST = do_PUT = do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def reply(req: http.server.BaseHTTPRequestHandler, status: int, body: dict, **headers) -> None:
    data = json.dumps(body).encode()
    req.send_response(status)
    req.send_header("Content-Type", "application/json")
    req.send_header("Content-Length", str(len(data)))
    for k, v in headers.items():
        req.send_header(k.replace("_", "-"), v)
    req.end_headers()
    req.wfile.write(data)


# ---------------------------------------------------------------------------------------------
# credential_process


def credential_script(home: Path, expires_in: float) -> tuple[Path, Path]:
    """A credential_process program handing out the SeaweedFS keys, counting its runs."""
    runs = home / "runs"
    script = home / "creds.py"
    script.write_text(
        "import json, sys\n"
        f"open({str(runs)!r}, 'a').write('run\\n')\n"
        f"json.dump({{'Version': 1, 'AccessKeyId': {ACCESS_KEY!r}, "
        f"'SecretAccessKey': {SECRET_KEY!r}, 'Expiration': {iso_in(expires_in)!r}}}, sys.stdout)\n"
    )
    return script, runs


def test_credential_process(bucket, home, monkeypatch, dtypes_file):
    script, runs = credential_script(home, 3600)
    (home / ".aws" / "config").write_text(
        f"[profile proc]\ncredential_process = {sys.executable} {script}\n\n"
        f"[profile broken]\ncredential_process = {sys.executable} -c "
        "\"import sys; sys.stderr.write('sso session gone'); sys.exit(3)\"\n"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint)
    monkeypatch.setenv("AWS_PROFILE", "proc")
    assert_same_tensors(fastload.load(URI), reference(dtypes_file))
    # Run once for the load's many requests: the credentials are cached until near expiry.
    assert runs.read_text() == "run\n"

    monkeypatch.setenv("AWS_PROFILE", "broken")
    err = helpers.timed_error(fastload.StorageError, lambda: fastload.load(URI), ERROR_DEADLINE)
    text = str(err)
    assert text.startswith(URI), text
    assert 'profile "broken"' in text and "credential_process" in text, text
    # The program's exit status and what it wrote to stderr (the URI holds a "3" of its own).
    assert "exit status: 3" in text and "sso session gone" in text, text


def test_credentials_near_expiry_are_fetched_again(bucket, home, monkeypatch, dtypes_file):
    """Credentials that expire within five minutes are not reused: each request of the load
    (a HEAD and at least one ranged GET) runs the program again."""
    script, runs = credential_script(home, 60)
    (home / ".aws" / "config").write_text(
        f"[profile proc]\ncredential_process = {sys.executable} {script}\n"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint)
    monkeypatch.setenv("AWS_PROFILE", "proc")
    assert_same_tensors(fastload.load(URI), reference(dtypes_file))
    assert runs.read_text().count("run") >= 2


# ---------------------------------------------------------------------------------------------
# SSO: a token cached by `aws sso login`, and the portal's GetRoleCredentials


SSO_TOKEN = "sso-access-token-for-fastload"
ACCOUNT = "111122223333"
ROLE = "ModelReader"


@pytest.fixture
def sso_portal(monkeypatch) -> Iterator[list[dict]]:
    """GET /federation/credentials, answering with the SeaweedFS keys (no session token) for the
    right bearer token, account and role; 401 otherwise. Yields the requests it saw."""
    seen: list[dict] = []

    def handle(req):
        path, _, query = req.path.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        token = req.headers.get("x-amz-sso_bearer_token")
        seen.append({"path": path, "token": token, **params})
        ok = (
            path == "/federation/credentials"
            and token == SSO_TOKEN
            and params.get("account_id") == ACCOUNT
            and params.get("role_name") == ROLE
        )
        if not ok:
            reply(
                req,
                401,
                {"message": "Session token not found or invalid"},
                x_amzn_ErrorType="UnauthorizedException",
            )
            return
        expiration = int((time.time() + 3600) * 1000)
        creds = {"accessKeyId": ACCESS_KEY, "secretAccessKey": SECRET_KEY, "expiration": expiration}
        reply(req, 200, {"roleCredentials": creds})

    for url in serve(handle):
        monkeypatch.setenv("AWS_ENDPOINT_URL_SSO", url)
        yield seen


@pytest.mark.parametrize("form", ["sso_session", "legacy"])
def test_sso_from_the_cached_token(bucket, home, monkeypatch, sso_portal, dtypes_file, form):
    start_url = "https://fastload-test.awsapps.com/start"
    role = f"sso_account_id = {ACCOUNT}\nsso_role_name = {ROLE}\n"
    if form == "sso_session":
        config = (
            f"[profile corp]\nsso_session = corp\n{role}\n"
            f"[sso-session corp]\nsso_start_url = {start_url}\nsso_region = {REGION}\n"
        )
        cache_key = "corp"
    else:
        config = f"[profile corp]\nsso_start_url = {start_url}\nsso_region = {REGION}\n{role}"
        cache_key = start_url
    (home / ".aws" / "config").write_text(config)
    cache = home / ".aws" / "sso" / "cache"
    cache.mkdir(parents=True)
    token_file = cache / (hashlib.sha1(cache_key.encode()).hexdigest() + ".json")

    def cache_token(expires_in: float, value: str = SSO_TOKEN) -> None:
        token = {
            "accessToken": value,
            "expiresAt": iso_in(expires_in),
            "region": REGION,
            "startUrl": start_url,
        }
        token_file.write_text(json.dumps(token))

    cache_token(3600)
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint)
    got = fastload.load(URI, storage_options={"profile": "corp"})
    assert_same_tensors(got, reference(dtypes_file))
    assert [s["token"] for s in sso_portal] == [SSO_TOKEN]

    # An expired token (which the portal no longer takes): a clear error naming the profile and
    # SSO. With an sso-session, aws-config sees the expiry itself and does not ask the portal.
    expired = "expired-sso-token-for-fastload"
    cache_token(-3600, expired)
    sso_portal.clear()
    err = helpers.timed_error(
        fastload.StorageError,
        lambda: fastload.load(URI, storage_options={"profile": "corp"}),
        ERROR_DEADLINE,
    )
    text = str(err)
    assert 'profile "corp"' in text and "SSO" in text, text
    assert expired not in text
    if form == "sso_session":
        assert "expired" in text.lower(), text
        assert sso_portal == []
    else:
        assert "Session token not found or invalid" in text, text
        assert [s["token"] for s in sso_portal] == [expired]


# ---------------------------------------------------------------------------------------------
# Credentials with a session token, proved on moto behind a relay that records who signed


class Recorder:
    """Relays HTTP requests to `target` and records, per request, the method, the path, the key
    that signed it (SigV4 `Credential=`), its session token, and the body of POST responses."""

    def __init__(self, target: str) -> None:
        self.target = target.removeprefix("http://")
        self.requests: list[dict] = []

    def __call__(self, req: http.server.BaseHTTPRequestHandler) -> None:
        length = int(req.headers.get("Content-Length") or 0)
        body = req.rfile.read(length) if length else b""
        conn = http.client.HTTPConnection(self.target, timeout=30)
        headers = {k: v for k, v in req.headers.items() if k.lower() != "connection"}
        conn.request(req.command, req.path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        signed = re.search(r"Credential=([^/]+)/", req.headers.get("Authorization", ""))
        self.requests.append(
            {
                "method": req.command,
                "path": req.path,
                "key": signed.group(1) if signed else None,
                "token": req.headers.get("x-amz-security-token"),
                "body": data.decode(errors="replace") if req.command == "POST" else "",
            }
        )
        req.send_response(resp.status)
        for k, v in resp.getheaders():
            # A HEAD answer keeps the object's length; other bodies are relayed whole.
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                req.send_header(k, v)
            elif k.lower() == "content-length" and req.command == "HEAD":
                req.send_header(k, v)
        if req.command != "HEAD":
            req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)


@pytest.fixture
def recorded_moto(moto_s3, home, monkeypatch, dtypes_file) -> Iterator[Recorder]:
    """moto (S3 and STS) behind a Recorder, which AWS_ENDPOINT_URL names."""
    upload(moto_s3.client(), BUCKET, {"all.safetensors": dtypes_file})
    recorder = Recorder(moto_s3.endpoint)
    for url in serve(recorder):
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        yield recorder


def s3_requests(recorder: Recorder) -> list[dict]:
    return [r for r in recorder.requests if r["path"].startswith(f"/{BUCKET}/")]


CONTAINER_TOKEN = "eks-pod-identity-token-for-fastload"
CONTAINER_KEY = "ASIACONTAINERKEYFORTEST"
CONTAINER_SESSION = "container-session-token-for-fastload"


def test_eks_container_endpoint(recorded_moto, home, monkeypatch, dtypes_file):
    asked: list[str | None] = []

    def handle(req):
        asked.append(req.headers.get("Authorization"))
        if req.headers.get("Authorization") != CONTAINER_TOKEN:
            reply(req, 401, {"Code": "AccessDenied", "Message": "bad pod identity token"})
            return
        creds = {
            "AccessKeyId": CONTAINER_KEY,
            "SecretAccessKey": "container-secret-for-fastload",
            "Token": CONTAINER_SESSION,
            "Expiration": iso_in(3600),
        }
        reply(req, 200, creds)

    token_file = home / "eks-token"
    for url in serve(handle):
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{url}/v1/credentials")
        monkeypatch.setenv("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", str(token_file))
        token_file.write_text(CONTAINER_TOKEN)
        assert_same_tensors(fastload.load(URI), reference(dtypes_file))
        assert asked == [CONTAINER_TOKEN]
        signed = s3_requests(recorded_moto)
        assert signed and all(r["key"] == CONTAINER_KEY for r in signed), signed
        assert all(r["token"] == CONTAINER_SESSION for r in signed), signed

        token_file.write_text("not-the-token")
        err = helpers.timed_error(fastload.StorageError, lambda: fastload.load(URI), ERROR_DEADLINE)
        text = str(err)
        assert text.startswith(URI) and "container credential endpoint" in text, text
        assert "401" in text or "bad pod identity token" in text, text
        assert "not-the-token" not in text


ROLE_ARN = "arn:aws:iam::123456789012:role/reader"


def test_assume_role_through_moto_sts(recorded_moto, home, monkeypatch, dtypes_file):
    """A profile with role_arn and source_profile: the source profile's keys sign AssumeRole at
    moto's STS, and the role's temporary keys sign every S3 request."""
    (home / ".aws" / "config").write_text(
        "[profile base]\naws_access_key_id = BASEKEYFORFASTLOAD\n"
        "aws_secret_access_key = base-secret-for-fastload\n\n"
        f"[profile reader]\nrole_arn = {ROLE_ARN}\nsource_profile = base\n"
        "role_session_name = fastload-test\n"
    )
    # STS through the same relay (AWS_ENDPOINT_URL names it; the STS variable wins for STS).
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", os.environ["AWS_ENDPOINT_URL"])
    monkeypatch.setenv("AWS_PROFILE", "reader")
    assert_same_tensors(fastload.load(URI), reference(dtypes_file))
    sts = [r for r in recorded_moto.requests if r["method"] == "POST"]
    assert len(sts) == 1 and sts[0]["key"] == "BASEKEYFORFASTLOAD", sts
    assert "AssumeRole" in sts[0]["body"]
    issued = re.search(r"<AccessKeyId>([^<]+)</AccessKeyId>", sts[0]["body"]).group(1)
    token = re.search(r"<SessionToken>([^<]+)</SessionToken>", sts[0]["body"]).group(1)
    signed = s3_requests(recorded_moto)
    assert signed and all(r["key"] == issued and r["token"] == token for r in signed), signed

    # STS unreachable: a clear error naming the profile and the role flow, within a bound.
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", f"http://127.0.0.1:{closed_port()}")
    err = helpers.timed_error(fastload.StorageError, lambda: fastload.load(URI), ERROR_DEADLINE)
    text = str(err)
    assert 'profile "reader"' in text and "role_arn" in text, text
    assert "base-secret-for-fastload" not in text


IMDS_SESSION = "imds-v2-session-token-for-fastload"
IMDS_KEY = "ASIAINSTANCEKEYFORTEST"
IMDS_ROLE = "fastload-instance-role"


@pytest.fixture
def imds(home, monkeypatch) -> Iterator[list[tuple[str, str, str | None]]]:
    """IMDSv2 of ours, which AWS_EC2_METADATA_SERVICE_ENDPOINT names (metadata enabled): a
    session token first, then the instance role's credentials. Yields the requests it saw."""
    asked: list[tuple[str, str, str | None]] = []
    base = "/latest/meta-data/iam/security-credentials"

    def handle(req):
        session = req.headers.get("x-aws-ec2-metadata-token")
        asked.append((req.command, req.path, session))
        path = req.path.rstrip("/")
        if req.command == "PUT" and path == "/latest/api/token":
            body = IMDS_SESSION.encode()
        elif session != IMDS_SESSION:
            body = None
            req.send_response(401)
        elif path == base:
            body = IMDS_ROLE.encode()
        elif path == f"{base}/{IMDS_ROLE}":
            creds = {
                "Code": "Success",
                "Type": "AWS-HMAC",
                "AccessKeyId": IMDS_KEY,
                "SecretAccessKey": "instance-secret-for-fastload",
                "Token": "instance-session-for-fastload",
                "Expiration": iso_in(3600),
            }
            body = json.dumps(creds).encode()
        else:
            body = None
            req.send_response(404)
        if body is not None:
            req.send_response(200)
            req.send_header("Content-Type", "text/plain")
            if req.command == "PUT":
                req.send_header("x-aws-ec2-metadata-token-ttl-seconds", "21600")
        req.send_header("Content-Length", str(len(body or b"")))
        req.end_headers()
        req.wfile.write(body or b"")

    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    for url in serve(handle):
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", url)
        yield asked


def test_instance_metadata_v2(recorded_moto, imds, dtypes_file):
    """No credentials anywhere and the metadata service on: the instance role's credentials."""
    assert_same_tensors(fastload.load(URI), reference(dtypes_file))
    assert imds[0][:2] == ("PUT", "/latest/api/token"), imds
    assert all(session == IMDS_SESSION for _, _, session in imds[1:]), imds
    signed = s3_requests(recorded_moto)
    assert signed and all(r["key"] == IMDS_KEY for r in signed), signed


def test_assume_role_from_instance_metadata(recorded_moto, imds, home, monkeypatch, dtypes_file):
    """`credential_source = Ec2InstanceMetadata`: the instance role's keys sign AssumeRole."""
    (home / ".aws" / "config").write_text(
        f"[profile onec2]\nrole_arn = {ROLE_ARN}\ncredential_source = Ec2InstanceMetadata\n"
    )
    monkeypatch.setenv("AWS_ENDPOINT_URL_STS", os.environ["AWS_ENDPOINT_URL"])
    got = fastload.load(URI, storage_options={"profile": "onec2"})
    assert_same_tensors(got, reference(dtypes_file))
    sts = [r for r in recorded_moto.requests if r["method"] == "POST"]
    assert len(sts) == 1 and sts[0]["key"] == IMDS_KEY, sts
    issued = re.search(r"<AccessKeyId>([^<]+)</AccessKeyId>", sts[0]["body"]).group(1)
    signed = s3_requests(recorded_moto)
    assert signed and all(r["key"] == issued for r in signed), signed
