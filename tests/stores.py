"""The five remote stores of the conformance suite (test_object_stores.py), behind one interface:
four object stores and the Hugging Face Hub (hf://, the mock Hub of servers/hub.py).

Each `Store` is a server on 127.0.0.1 (servers in servers/s3.py, servers/gcs.py, servers/azure.py,
servers/http.py, servers/hub.py) holding the same objects under the same keys, plus what fastload
needs to reach it: the URI of a key or prefix, the environment variables or storage options that
configure access on their own, and what the store cannot do, with the reason. `at(endpoint)` gives
the same store seen through another address (a relay, or a closed port); `data_via(endpoint)` has
the bytes of objects go through a relay (the Hub's come from its storage host, not the Hub).

Credentials are always explicit, and `isolate()` removes every cloud setting of the caller and
points the cloud metadata services at a closed local port, so that nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
from pathlib import Path
from typing import ClassVar

import helpers
from servers.azure import EMULATOR_ACCOUNT, EMULATOR_KEY, AzureBlobServer
from servers.gcs import BUCKET as GCS_BUCKET
from servers.gcs import FakeGcs
from servers.http import RangeServer
from servers.hub import MockHub
from servers.s3 import BUCKET as S3_BUCKET
from servers.s3 import PUBLIC_BUCKET, SECRET_KEY, Server, closed_port

AZURE_ACCOUNT = "fastloadtest"
AZURE_KEY = base64.b64encode(
    b"fastload azure test key, 64 bytes long, not used anywhere else!!"
).decode()
AZURE_CONTAINER = "models"
AZURE_PUBLIC = "public"

# Where a public object lives in the stores that tell public from private.
PUBLIC_KEY = "open/all.safetensors"
# The shard that broken/'s index names but nobody uploaded.
MISSING_SHARD = "model-gone.safetensors"


def objects(
    dtypes_file: Path, tiny_file: Path, sharded_dir: Path, multi_block_file: Path
) -> dict[str, Path | bytes]:
    """Every key each store holds: the single files, `plain/` (no index; `plain/sub/` below it is
    not directly under the prefix), `sharded/` (an index, plus a stray file it does not name),
    `broken/` (an index naming a shard that is not there), `partial/`, `mixed/` and
    `mixed-indexed/` (incomplete or mixed shard sets), a multi-block file and a copy of it that
    lacks its last 1000 bytes."""
    files: dict[str, Path | bytes] = {
        **helpers.bucket_objects(dtypes_file, tiny_file),
        "plain/sub/c.safetensors": dtypes_file,
        "big.safetensors": multi_block_file,
        "truncated.safetensors": multi_block_file.read_bytes()[:-1000],
    }
    for p in sorted(sharded_dir.iterdir()):
        files[f"sharded/{p.name}"] = p
        if p.suffix == ".safetensors":
            files[f"broken/{p.name}"] = p
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra.weight"] = MISSING_SHARD
    files["broken/model.safetensors.index.json"] = json.dumps(index).encode()
    # A save that stopped part-way (`partial/`: shards 1 and 3 of 3, no index), and an older
    # save's single file beside the shards, without (`mixed/`) and with (`mixed-indexed/`) the
    # index that settles which set loads.
    shards = sorted(sharded_dir.glob("model-*-of-*.safetensors"))
    for p in (shards[0], shards[-1]):
        files[f"partial/{p.name}"] = p
    for prefix in ("mixed", "mixed-indexed"):
        files.update({f"{prefix}/{p.name}": p for p in shards})
        files[f"{prefix}/model.safetensors"] = dtypes_file
    files["mixed-indexed/model.safetensors.index.json"] = (
        sharded_dir / "model.safetensors.index.json"
    )
    return files


@dataclasses.dataclass(frozen=True)
class Store:
    """One backend. Subclasses say how to address, configure and fill it."""

    endpoint: str  # http://127.0.0.1:port of the server (or of a relay in front of it)

    # How the suite's loads configure access: the environment (True) or storage_options (False).
    via_env: ClassVar[bool] = False
    # Why the store cannot list a prefix, or None when it can. Without a listing, a URI names one
    # object, and a prefix is read only through the index found under it.
    no_listing: ClassVar[str | None] = None
    # Why the store has no buckets (so no missing-bucket error), or None when it has them.
    no_buckets: ClassVar[str | None] = None
    # Why the store takes no access settings from the environment, or None when it does.
    no_env_settings: ClassVar[str | None] = None

    def at(self, endpoint: str) -> Store:
        """The same store, reached at another address."""
        return dataclasses.replace(self, endpoint=endpoint)

    def names(self, uri: str, message: str) -> bool:
        """Whether an error message names the object or prefix `uri` loaded."""
        return uri in message

    def data_port(self) -> int:
        """The port of the server that sends objects' bytes."""
        return int(self.endpoint.rsplit(":", 1)[1])

    @contextlib.contextmanager
    def data_via(self, endpoint: str):
        """The same store, with objects' bytes read through `endpoint` (a relay to
        `data_port()`)."""
        yield self.at(endpoint)

    def refused(self) -> Store:
        """The same store at a port where nothing listens."""
        return self.at(f"http://127.0.0.1:{closed_port()}")

    def max_connections(self, in_flight: int) -> int:
        """The most connections a relay may see for `in_flight` reads at a time: one each, plus
        the ones the client's pool (hyper) opens when it races a new connection against one being
        given back, and keeps both. The race is won more often the faster the server answers a
        4 KiB read and the busier the machine: 64 reads in flight saw 64 to 71 connections with
        fake-gcs-server, 67 once with SeaweedFS on a loaded CI machine, 85 with SeaweedFS on a
        machine running three test suites at once (load average 11 on 2 cores). Half as many
        again bounds that and is still far from a connection per request (about 750 here); the
        lower bound of the test tells 64 in flight from the next setting down."""
        return in_flight + max(2, in_flight // 2)

    def uri(self, key: str) -> str:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        """Variables that on their own let fastload read the store."""
        return {}

    def options(self) -> dict[str, str] | None:
        """storage_options that on their own let fastload read the store."""
        return None

    def load_options(self, **extra: str) -> dict[str, str] | None:
        """What the suite passes as storage_options: `options()` unless the environment
        configures access, plus `extra`."""
        merged = {**((not self.via_env and self.options()) or {}), **extra}
        return merged or None

    def public(self) -> tuple[str, dict[str, str] | None]:
        """URI and storage_options that read the object at PUBLIC_KEY without credentials."""
        raise NotImplementedError

    def spoiled(self) -> tuple[dict[str, str], dict[str, str]]:
        """Variables that make loads fail, and the storage_options that override them."""
        raise NotImplementedError(self.no_env_settings)

    def missing_bucket(self) -> str:
        """The URI of an object in a bucket (container) that does not exist."""
        raise NotImplementedError(self.no_buckets)

    def put(self, files: dict[str, Path | bytes]) -> None:
        raise NotImplementedError


def filled(store: Store, files: dict[str, Path | bytes]) -> Store:
    store.put(files)
    return store


@dataclasses.dataclass(frozen=True)
class S3(Store):
    server: Server

    via_env = True  # as most S3 users do: AWS_* variables (test_s3.py covers storage_options)

    def uri(self, key: str) -> str:
        return f"s3://{S3_BUCKET}/{key}"

    def env(self) -> dict[str, str]:
        return {**self.server.env(), "AWS_ENDPOINT_URL": self.endpoint}

    def options(self) -> dict[str, str]:
        return {**self.server.storage_options(), "endpoint": self.endpoint}

    def public(self) -> tuple[str, dict[str, str] | None]:
        return (
            f"s3://{PUBLIC_BUCKET}/{PUBLIC_KEY}",
            {"endpoint": self.endpoint, "skip_signature": "true"},
        )

    def spoiled(self) -> tuple[dict[str, str], dict[str, str]]:
        return {"AWS_SECRET_ACCESS_KEY": "not-the-secret"}, {"secret_access_key": SECRET_KEY}

    def missing_bucket(self) -> str:
        return "s3://no-such-bucket-fastload/model.safetensors"

    def put(self, files: dict[str, Path | bytes]) -> None:
        from servers import s3 as s3_server

        s3_server.upload(self.server.client(), S3_BUCKET, files)
        s3_server.upload(
            self.server.client(), PUBLIC_BUCKET, {PUBLIC_KEY: files["all.safetensors"]}
        )


@dataclasses.dataclass(frozen=True)
class Gcs(Store):
    server: FakeGcs

    def uri(self, key: str) -> str:
        return f"gs://{GCS_BUCKET}/{key}"

    def env(self) -> dict[str, str]:
        return {"GOOGLE_BASE_URL": self.endpoint, "GOOGLE_SKIP_SIGNATURE": "true"}

    def options(self) -> dict[str, str]:
        # fake-gcs-server takes any request; credentials are checked in test_gcs.py (AuthProxy).
        return {"endpoint": self.endpoint, "skip_signature": "true"}

    def public(self) -> tuple[str, dict[str, str] | None]:
        return self.uri("all.safetensors"), self.options()

    def spoiled(self) -> tuple[dict[str, str], dict[str, str]]:
        dead = f"http://127.0.0.1:{closed_port()}"
        return {"GOOGLE_BASE_URL": dead, "GOOGLE_SKIP_SIGNATURE": "true"}, {
            "endpoint": self.endpoint
        }

    def missing_bucket(self) -> str:
        return "gs://no-such-bucket-fastload/model.safetensors"

    def put(self, files: dict[str, Path | bytes]) -> None:
        self.server.upload(GCS_BUCKET, files)


@dataclasses.dataclass(frozen=True)
class Azure(Store):
    server: AzureBlobServer

    def uri(self, key: str) -> str:
        return f"az://{AZURE_CONTAINER}/{key}"

    def account_endpoint(self) -> str:
        return f"{self.endpoint}/{AZURE_ACCOUNT}"

    def env(self) -> dict[str, str]:
        return {
            "AZURE_STORAGE_ACCOUNT_NAME": AZURE_ACCOUNT,
            "AZURE_STORAGE_ACCOUNT_KEY": AZURE_KEY,
            "AZURE_STORAGE_ENDPOINT": self.account_endpoint(),
        }

    def options(self) -> dict[str, str]:
        return {
            "account_name": AZURE_ACCOUNT,
            "access_key": AZURE_KEY,
            "endpoint": self.account_endpoint(),
        }

    def public(self) -> tuple[str, dict[str, str] | None]:
        anonymous = {"account_name": AZURE_ACCOUNT, "endpoint": self.account_endpoint()}
        return f"az://{AZURE_PUBLIC}/{PUBLIC_KEY}", anonymous | {"skip_signature": "true"}

    def spoiled(self) -> tuple[dict[str, str], dict[str, str]]:
        return self.env() | {"AZURE_STORAGE_ACCOUNT_KEY": EMULATOR_KEY}, {"access_key": AZURE_KEY}

    def missing_bucket(self) -> str:
        return "az://no-such-container/model.safetensors"

    def put(self, files: dict[str, Path | bytes]) -> None:
        # Azurite's well-known account holds them too, for test_azure.py's emulator settings.
        for account in (AZURE_ACCOUNT, EMULATOR_ACCOUNT):
            self.server.put(account, AZURE_CONTAINER, files)
        self.server.put(AZURE_ACCOUNT, AZURE_PUBLIC, {PUBLIC_KEY: files["all.safetensors"]})
        self.server.public.add((AZURE_ACCOUNT, AZURE_PUBLIC))


@dataclasses.dataclass(frozen=True)
class Http(Store):
    server: RangeServer

    no_listing = (
        "a plain HTTP server has no listing (object_store would ask WebDAV's PROPFIND, which "
        "it answers 501): a URI is one object, a prefix is read through its index"
    )
    no_buckets = "a plain HTTP URL has no bucket: the server and path are the whole address"
    no_env_settings = "plain HTTP takes no access settings: the URL is the whole address"

    def uri(self, key: str) -> str:
        return f"{self.endpoint}/{key}"

    def public(self) -> tuple[str, dict[str, str] | None]:
        # Everything is public: no request is ever signed.
        return self.uri("all.safetensors"), None

    def put(self, files: dict[str, Path | bytes]) -> None:
        self.server.put(files)


HUB_REPO = "org/models"


@dataclasses.dataclass(frozen=True)
class Hub(Store):
    """The Hugging Face Hub (servers/hub.py's MockHub): a repo is the bucket, its files the
    objects; `*.safetensors` files are in LFS, so their bytes come from the storage host."""

    server: MockHub

    no_buckets = "a Hub repo is not a bucket: a missing repo is test_hub.py's (401 RepoNotFound)"
    no_env_settings = (
        "HF_ENDPOINT is the Hub's only address setting, and storage_options' endpoint overrides "
        "it (test_hub.py); nothing else to spoil"
    )

    def uri(self, key: str) -> str:
        return f"hf://{HUB_REPO}/{key}"

    def env(self) -> dict[str, str]:
        return {"HF_ENDPOINT": self.endpoint}

    def options(self) -> dict[str, str]:
        return {"endpoint": self.endpoint}

    def public(self) -> tuple[str, dict[str, str] | None]:
        # The repo is public: no token is sent or needed.
        return self.uri(PUBLIC_KEY), self.options()

    def names(self, uri: str, message: str) -> bool:
        # Files are named at the commit the revision resolved to (hf://org/name@<commit>/path),
        # and a failure before one is known names the repo at the revision asked for.
        path = uri.removeprefix(f"hf://{HUB_REPO}/").rstrip("/")
        return f"hf://{HUB_REPO}@" in message and (path in message or "@main" in message)

    def data_port(self) -> int:
        return self.server.storage.server_address[1]

    @contextlib.contextmanager
    def data_via(self, endpoint: str):
        # The Hub hands out storage URLs on the relay's address; the Hub itself stays direct.
        self.server.storage.public_url = endpoint
        try:
            yield self
        finally:
            self.server.storage.public_url = None

    def put(self, files: dict[str, Path | bytes]) -> None:
        tree = {k: v if isinstance(v, bytes) else Path(v).read_bytes() for k, v in files.items()}
        tree[PUBLIC_KEY] = tree["all.safetensors"]
        self.server.add(HUB_REPO, tree)


def isolate(monkeypatch, home: Path) -> None:
    """No cloud settings of the caller's, no credentials in HOME, and every metadata service
    (EC2, GCE, Azure managed identity) at a closed local port, should anything ask it."""
    for var in list(os.environ):
        if var.startswith(("AWS_", "GOOGLE_", "GCE_", "AZURE_", "AZURITE_", "HF_")) or var in (
            "STORAGE_EMULATOR_HOST",
            "SERVICE_ACCOUNT",
            "NO_GCE_CHECK",
            "IDENTITY_ENDPOINT",
            "MSI_ENDPOINT",
        ):
            monkeypatch.delenv(var)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / "hf_home"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    dead = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("GCE_METADATA_HOST", dead)
    monkeypatch.setenv("GCE_METADATA_IP", dead)
    monkeypatch.setenv("AZURE_MSI_ENDPOINT", f"http://{dead}/token")
