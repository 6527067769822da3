"""What only az:// has, beside the conformance suite (test_object_stores.py, which reads the same
server like every other store): paged listings, signatures, every documented way to configure it,
and credentials that must not leak.

A small Azure Blob server on 127.0.0.1 (servers/azure.py: SharedKey signatures verified, ranged
GETs, HEAD, paged List Blobs; started in conftest.py, holding stores.py's objects).

Azurite itself is npm only; servers/azure.py implements the part of the Blob REST API that
object_store's client uses to read, with the service's headers, XML and error codes.
"""

from __future__ import annotations

import base64
import os

import fastload
import helpers
import pytest
from helpers import assert_same_tensors, indexed_files, reference
from servers.azure import EMULATOR_ACCOUNT, EMULATOR_KEY, AzureBlobServer
from servers.s3 import closed_port
from stores import AZURE_ACCOUNT as ACCOUNT
from stores import AZURE_CONTAINER as CONTAINER
from stores import AZURE_KEY as KEY

ERROR_DEADLINE = 30.0


@pytest.fixture(scope="module")
def azure(azure_store):
    """The server, holding the session's checkpoints in the test account and Azurite's (for the
    emulator settings), plus a public container (uploaded once, see stores.py); it lists three
    entries a page so that every prefix load follows `NextMarker`."""
    return azure_store.server


@pytest.fixture(autouse=True)
def azure_env(monkeypatch):
    """No Azure settings of the caller's; managed identity, should anything ask it, at a closed
    local port instead of the instance-metadata address."""
    for var in list(os.environ):
        if var.startswith(("AZURE_", "AZURITE_")) or var in ("IDENTITY_ENDPOINT", "MSI_ENDPOINT"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("AZURE_MSI_ENDPOINT", f"http://127.0.0.1:{closed_port()}/token")


def options(server: AzureBlobServer, **extra) -> dict[str, str]:
    return {
        "account_name": ACCOUNT,
        "access_key": KEY,
        "endpoint": server.endpoint(ACCOUNT),
        **extra,
    }


def az(path: str, container: str = CONTAINER) -> str:
    return f"az://{container}/{path}"


def timed_error(exc_type, fn, deadline: float = ERROR_DEADLINE):
    return helpers.timed_error(exc_type, fn, deadline)


# ---------------------------------------------------------------------------------------------
# Listings, signatures and storage_options


def test_prefix_without_index_follows_next_marker(azure, dtypes_file, tiny_file):
    before = azure.stats.count(comp="list")
    got = fastload.load(az("plain/"), storage_options=options(azure))
    assert_same_tensors(got, reference(dtypes_file, tiny_file))
    # 4 entries (a, b, notes.txt, sub/) at 3 per page: two list requests.
    assert azure.stats.count(comp="list") - before == 2


def test_every_request_was_signed_and_verified(azure, dtypes_file):
    before = len(azure.stats.requests)
    fastload.load(az("all.safetensors"), storage_options=options(azure))
    statuses = {s for _, _, _, s in azure.stats.requests[before:]}
    assert statuses <= {200, 206}, statuses


def test_connection_string_option(azure, dtypes_file):
    cs = (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint={azure.endpoint(ACCOUNT)};"
    )
    got = fastload.load(az("all.safetensors"), storage_options={"connection_string": cs})
    assert_same_tensors(got, reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# The environment


def test_object_store_variables(azure, monkeypatch, sharded_dir):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", KEY)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azure.endpoint(ACCOUNT))
    assert_same_tensors(fastload.load(az("sharded/")), reference(*indexed_files(sharded_dir)))


def test_connection_string_variable(azure, monkeypatch, tiny_file):
    # What the Azure CLI and SDKs read, in the form Azurite's documentation gives.
    monkeypatch.setenv(
        "AZURE_STORAGE_CONNECTION_STRING",
        f"DefaultEndpointsProtocol=http;AccountName={EMULATOR_ACCOUNT};AccountKey={EMULATOR_KEY};"
        f"BlobEndpoint={azure.endpoint(EMULATOR_ACCOUNT)};",
    )
    assert_same_tensors(fastload.load(az("tiny.safetensors")), reference(tiny_file))


def test_cli_variables(azure, monkeypatch, dtypes_file):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_KEY", KEY)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azure.endpoint(ACCOUNT))
    assert_same_tensors(fastload.load(az("all.safetensors")), reference(dtypes_file))


def test_emulator_switch(azure, monkeypatch, dtypes_file):
    # object_store's Azurite mode: the well-known account and key at AZURITE_BLOB_STORAGE_URL.
    monkeypatch.setenv("AZURE_STORAGE_USE_EMULATOR", "true")
    monkeypatch.setenv("AZURITE_BLOB_STORAGE_URL", azure.base)
    assert_same_tensors(fastload.load(az("all.safetensors")), reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# Errors: the right exception, naming the URI, within a bounded time, without secrets


def test_missing_container_names_the_error_code(azure):
    uri = az("model.safetensors", "no-such-container")
    err = timed_error(
        fastload.StorageError, lambda: fastload.load(uri, storage_options=options(azure))
    )
    assert not isinstance(err, FileNotFoundError)
    assert uri in str(err)
    assert "ContainerNotFound" in str(err) or "container not found" in str(err)


def test_bad_key_is_a_storage_error_without_secrets(azure):
    wrong = base64.b64encode(b"wrong key for the fastload azure tests, 48 bytes").decode()
    uri = az("all.safetensors")
    err = timed_error(
        fastload.StorageError,
        lambda: fastload.load(uri, storage_options=options(azure, access_key=wrong)),
    )
    text = str(err)
    assert not isinstance(err, FileNotFoundError)
    assert uri in text
    assert wrong not in text and KEY not in text
    # The service's error body echoes the signature and the string to sign: dropped.
    assert "MAC signature" not in text and "string to sign" not in text
    assert azure.stats.count(status=403) >= 1


def test_bad_key_in_a_connection_string_is_not_echoed(azure):
    wrong = base64.b64encode(b"another wrong key for fastload").decode()
    cs = f"AccountName={ACCOUNT};AccountKey={wrong};BlobEndpoint={azure.endpoint(ACCOUNT)}"
    err = timed_error(
        fastload.StorageError,
        lambda: fastload.load(az("all.safetensors"), storage_options={"connection_string": cs}),
    )
    assert wrong not in str(err)


def test_wrong_account_name_is_a_storage_error(azure):
    opts = options(azure, account_name=EMULATOR_ACCOUNT)  # endpoint still names ACCOUNT
    timed_error(
        fastload.StorageError, lambda: fastload.load(az("all.safetensors"), storage_options=opts)
    )


def test_unsigned_requests_to_a_private_container_are_refused(azure):
    opts = {"account_name": ACCOUNT, "endpoint": azure.endpoint(ACCOUNT), "skip_signature": "true"}
    before = azure.stats.count(status=401)
    err = timed_error(
        fastload.StorageError, lambda: fastload.load(az("all.safetensors"), storage_options=opts)
    )
    assert not isinstance(err, FileNotFoundError)
    assert azure.stats.count(status=401) > before


def test_malformed_connection_string_is_a_config_error_without_its_value():
    secretish = "AccountKey:fastload-not-a-pair-0123456789"
    cs = f"AccountName={ACCOUNT};{secretish}"
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(az("all.safetensors"), storage_options={"connection_string": cs})
    assert secretish not in str(info.value)
    assert "connection_string" in str(info.value)
