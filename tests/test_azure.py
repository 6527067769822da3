"""Loading from az://: a small Azure Blob server on 127.0.0.1 (azure_server.py: SharedKey
signatures verified, ranged GETs, HEAD, paged List Blobs), bitwise parity with
`safetensors.torch.load_file`, every documented way to configure it, and clean, bounded failures.

Azurite itself is npm only; azure_server.py implements the part of the Blob REST API that
object_store's client uses to read, with the service's headers, XML and error codes. Listings are
paged three entries at a time so that every prefix load follows `NextMarker`.
"""

from __future__ import annotations

import base64
import os

import fastload
import helpers
import pytest
from azure_server import EMULATOR_ACCOUNT, EMULATOR_KEY, AzureBlobServer, start_azure
from helpers import assert_same_tensors, indexed_files, reference
from s3_server import closed_port

ACCOUNT = "fastloadtest"
KEY = base64.b64encode(b"fastload azure test key, 64 bytes long, not used anywhere else!!").decode()
CONTAINER = "models"
PUBLIC = "public"
ERROR_DEADLINE = 30.0
QUICK_RETRIES = {"max_retries": "2", "retry_timeout": "10", "connect_timeout": "2"}


@pytest.fixture(scope="module")
def azure(dtypes_file, sharded_dir, tiny_file):
    """The session's checkpoints in the test account (and Azurite's account, for the emulator
    settings), plus a public container readable without credentials."""
    server = start_azure({ACCOUNT: KEY, EMULATOR_ACCOUNT: EMULATOR_KEY}, page_size=3)
    files = {
        **helpers.bucket_objects(dtypes_file, tiny_file),
        "plain/sub/c.safetensors": dtypes_file,  # not directly under plain/: not loaded
    }
    for account in (ACCOUNT, EMULATOR_ACCOUNT):
        server.put(account, CONTAINER, files)
        server.put_dir(account, CONTAINER, "sharded", sharded_dir)
    server.put(ACCOUNT, PUBLIC, {"open/all.safetensors": dtypes_file})
    server.public.add((ACCOUNT, PUBLIC))
    yield server
    server.close()


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
# Parity (storage_options only)


def test_single_object_parity(azure, dtypes_file):
    got = fastload.load(az("all.safetensors"), storage_options=options(azure))
    assert_same_tensors(got, reference(dtypes_file))


def test_many_tiny_tensors_parity(azure, tiny_file):
    got = fastload.load(az("tiny.safetensors"), storage_options=options(azure))
    assert_same_tensors(got, reference(tiny_file))


def test_prefix_with_index_reads_exactly_the_indexed_shards(azure, sharded_dir):
    want = reference(*indexed_files(sharded_dir))
    for uri in (az("sharded/"), az("sharded"), az("sharded/model.safetensors.index.json")):
        assert_same_tensors(fastload.load(uri, storage_options=options(azure)), want)


def test_prefix_without_index_follows_next_marker(azure, dtypes_file, tiny_file):
    before = azure.stats.count(comp="list")
    got = fastload.load(az("plain/"), storage_options=options(azure))
    assert_same_tensors(got, reference(dtypes_file, tiny_file))
    # 4 entries (a, b, notes.txt, sub/) at 3 per page: two list requests.
    assert azure.stats.count(comp="list") - before == 2


def test_names_subset(azure, sharded_dir):
    want = reference(*indexed_files(sharded_dir))
    names = ["embed.weight", "layers.5.weight"]
    got = fastload.load(az("sharded/"), names=names, storage_options=options(azure))
    assert_same_tensors(got, {n: want[n] for n in names})


def test_stream_with_small_blocks(azure, sharded_dir):
    got = {}
    for name, tensor in fastload.stream(
        az("sharded/"), block_size=4096, concurrency=16, storage_options=options(azure)
    ):
        assert name not in got
        got[name] = tensor
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))


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


def test_anonymous_access_to_a_public_container(azure, dtypes_file):
    anonymous = {"account_name": ACCOUNT, "endpoint": azure.endpoint(ACCOUNT)}
    got = fastload.load(
        az("open/all.safetensors", PUBLIC), storage_options=anonymous | {"skip_signature": "true"}
    )
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


def test_options_override_the_environment(azure, monkeypatch, dtypes_file):
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", EMULATOR_KEY)  # another account's key
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azure.endpoint(ACCOUNT))
    with pytest.raises(fastload.StorageError):
        fastload.load(az("all.safetensors"))
    got = fastload.load(az("all.safetensors"), storage_options={"access_key": KEY})
    assert_same_tensors(got, reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# Errors: the right exception, naming the URI, within a bounded time, without secrets


def test_missing_blob_is_file_not_found(azure):
    uri = az("no-such-model.safetensors")
    err = timed_error(FileNotFoundError, lambda: fastload.load(uri, storage_options=options(azure)))
    assert isinstance(err, fastload.NotFoundError)
    assert uri in str(err)


def test_empty_prefix_is_file_not_found(azure):
    uri = az("nothing-here/")
    err = timed_error(FileNotFoundError, lambda: fastload.load(uri, storage_options=options(azure)))
    assert uri in str(err)


def test_missing_container_is_a_storage_error(azure):
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


def test_refused_connection_is_a_storage_error():
    uri = az("all.safetensors")
    opts = {
        "account_name": ACCOUNT,
        "access_key": KEY,
        "endpoint": f"http://127.0.0.1:{closed_port()}/{ACCOUNT}",
        **QUICK_RETRIES,
    }
    err = timed_error(fastload.StorageError, lambda: fastload.load(uri, storage_options=opts))
    assert uri in str(err)


def test_malformed_connection_string_is_a_config_error_without_its_value():
    secretish = "AccountKey:fastload-not-a-pair-0123456789"
    cs = f"AccountName={ACCOUNT};{secretish}"
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(az("all.safetensors"), storage_options={"connection_string": cs})
    assert secretish not in str(info.value)
    assert "connection_string" in str(info.value)


def test_unknown_option_is_a_config_error():
    with pytest.raises(fastload.ConfigError, match="acount_name"):
        fastload.load(az("x.safetensors"), storage_options={"acount_name": ACCOUNT})
