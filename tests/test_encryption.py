"""Encrypted checkpoints (``keyset=``): safetensors files encrypted whole by Google's ``tink``
package (streaming AEAD, ``AES256_GCM_HKDF_1MB`` and ``AES128_GCM_HKDF_4KB``) load bitwise equal
to the plain file, from local files, S3 (SeaweedFS), plain HTTP, the mock Hub and the local cache;
a slice reads only the segments holding it (counted at the HTTP server); what fastload encrypts,
tink decrypts; and every failure (a flipped byte, a truncation, a wrong key, another primitive's
keyset, no keyset) is a ``FastloadError`` naming the file (and the segment) that hands out no
tensor from an unauthenticated segment, and never shows the key.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import fastload
import helpers
import pytest
import safetensors.torch
import torch
from helpers import assert_same_tensor, assert_same_tensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from servers import http as http_server
from servers import hub as hub_server
from servers import s3 as s3_server

tink = pytest.importorskip("tink")
from tink import aead, cleartext_keyset_handle, streaming_aead  # noqa: E402

streaming_aead.register()
aead.register()

TEMPLATES = streaming_aead.streaming_aead_key_templates
MIB = 1 << 20


def new_keyset(template=TEMPLATES.AES256_GCM_HKDF_1MB) -> tuple[str, object]:
    """A fresh keyset as cleartext JSON, and tink's StreamingAead of it."""
    handle = tink.new_keyset_handle(template)
    out = io.StringIO()
    cleartext_keyset_handle.write(tink.JsonKeysetWriter(out), handle)
    return out.getvalue(), handle.primitive(streaming_aead.StreamingAead)


def key_values(keyset: str) -> list[str]:
    """The secret parts of a keyset JSON: each key's base64 protobuf (which holds the key)."""
    return [k["keyData"]["value"] for k in json.loads(keyset)["key"]]


def tink_encrypt(primitive, plain: bytes, associated_data: bytes = b"") -> bytes:
    class Sink(io.BytesIO):
        def close(self) -> None:  # tink closes its destination; keep the bytes
            pass

    sink = Sink()
    with primitive.new_encrypting_stream(sink, associated_data) as w:
        w.write(plain)
    return sink.getvalue()


def tink_decrypt(primitive, ciphertext: bytes, associated_data: bytes = b"") -> bytes:
    with primitive.new_decrypting_stream(io.BytesIO(ciphertext), associated_data) as r:
        return r.read()


@pytest.fixture(scope="module")
def plain_file(tmp_path_factory) -> Path:
    """A checkpoint of about 4.2 MB: five 1 MiB segments, a big 2-D tensor across them, and
    small tensors of several dtypes."""
    path = tmp_path_factory.mktemp("enc") / "plain.safetensors"
    tensors = {
        "w": helpers.pattern((1024, 1024), torch.float32, seed=1),
        "b": helpers.pattern((1024,), torch.bfloat16, seed=2),
        "ids": helpers.pattern((7, 3), torch.int64, seed=3),
        "s": helpers.pattern((), torch.float16, seed=4),
        "e": helpers.pattern((0, 3), torch.float32),
    }
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def big_keyset():
    return new_keyset()


@pytest.fixture(scope="module")
def encrypted(plain_file, big_keyset, tmp_path_factory) -> Path:
    """`plain_file` encrypted by tink with AES256_GCM_HKDF_1MB."""
    path = tmp_path_factory.mktemp("enc") / "model.safetensors"
    path.write_bytes(tink_encrypt(big_keyset[1], plain_file.read_bytes()))
    return path


@pytest.fixture(scope="module")
def small(dtypes_file, tmp_path_factory):
    """The all-dtypes file encrypted with AES128_GCM_HKDF_4KB (many small segments): keyset JSON,
    primitive, ciphertext."""
    keyset, primitive = new_keyset(TEMPLATES.AES128_GCM_HKDF_4KB)
    return keyset, primitive, tink_encrypt(primitive, dtypes_file.read_bytes())


def test_lazy_slices_of_a_local_encrypted_file_are_read_not_mapped(
    plain_file, encrypted, big_keyset
):
    """The engines' lazy tensors over a local encrypted file: its ciphertext cannot be mapped
    as tensors, so regions are read and decrypted; bitwise the plain file's."""
    from fastload._lazy import Checkpoint

    want = helpers.reference(plain_file)
    ckpt = Checkpoint(str(encrypted), keyset=big_keyset[0])
    got = dict(ckpt)
    rows = torch.empty(100, 1024).copy_(got["w"][500:600])
    cols = torch.empty(1024, 8).copy_(got["w"][:, 8:16])
    bits = torch.int32
    assert torch.equal(rows.view(bits), want["w"][500:600].view(bits))
    assert torch.equal(cols.view(bits), want["w"][:, 8:16].contiguous().view(bits))
    b = torch.empty(1024, dtype=torch.bfloat16).copy_(got["b"])
    assert torch.equal(b.view(torch.int16), want["b"].view(torch.int16))
    assert got["w"]._source.mapped is False


def test_an_encrypted_file_with_method_direct_is_decrypted_through_the_page_cache(
    plain_file, encrypted, big_keyset
):
    # Its reads are cut on its segments, not on whole pages: none goes around the page cache.
    helpers.evict(encrypted)
    with fastload.stream(str(encrypted), keyset=big_keyset[0], method="direct") as s:
        got = dict(s)
        stats = s.stats()
    assert_same_tensors(got, helpers.reference(plain_file))
    assert stats["direct_bytes"] == 0, stats
    assert "encrypted" in stats["direct_refused"], stats


def test_tink_files_load_bitwise_through_every_entry_point(plain_file, encrypted, big_keyset):
    keyset = big_keyset[0]
    want = helpers.reference(plain_file)
    assert_same_tensors(fastload.load(encrypted, keyset=keyset), want)
    assert_same_tensors(dict(fastload.stream(str(encrypted), keyset=keyset)), want)
    assert_same_tensors(fastload.load_file(encrypted, keyset=keyset), want)
    assert_same_tensors(fastload.load(encrypted, keyset=keyset, method="mmap"), want)
    with fastload.safe_open(encrypted, "pt", keyset=keyset) as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(want)
        for name in want:
            assert_same_tensor(f.get_tensor(name), want[name], name)
        assert_same_tensor(f.get_slice("w")[1000:1003, 7:9], want["w"][1000:1003, 7:9].clone())
    report = fastload.inspect(encrypted, keyset=keyset)
    assert report["files"][0]["size"] == plain_file.stat().st_size


def test_small_segments_and_every_keyset_form(dtypes_file, small, tmp_path, monkeypatch):
    """AES128_GCM_HKDF_4KB (the params come from the key); the keyset as JSON, as a path (str
    and os.PathLike) and as FASTLOAD_KEYSET."""
    keyset, _, ciphertext = small
    path = tmp_path / "small.safetensors"
    path.write_bytes(ciphertext)
    want = helpers.reference(dtypes_file)
    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(keyset)
    for form in (keyset, str(keyset_file), keyset_file):
        assert_same_tensors(fastload.load(path, keyset=form, block_size="4KiB"), want)
    monkeypatch.setenv("FASTLOAD_KEYSET", str(keyset_file))
    assert_same_tensors(fastload.load(path), want)


def test_associated_data_and_keys_tried_as_tink_does(plain_file, tmp_path):
    """associated_data= (bytes or str) must match; a keyset of several keys decrypts a file any
    enabled key encrypted, as tink does (the primary first)."""
    want = helpers.reference(plain_file)
    first, _ = new_keyset(TEMPLATES.AES128_GCM_HKDF_4KB)
    second, primitive = new_keyset()
    path = tmp_path / "ad.safetensors"
    path.write_bytes(tink_encrypt(primitive, plain_file.read_bytes(), b"model-v1"))
    for ad in (b"model-v1", "model-v1"):
        assert_same_tensors(fastload.load(path, keyset=second, associated_data=ad), want)
    with pytest.raises(fastload.FormatError) as e:
        fastload.load(path, keyset=second)
    assert e.value.segment == 0 and str(path) in str(e.value)
    both = json.loads(first)
    both["key"] += json.loads(second)["key"]
    assert both["primaryKeyId"] == json.loads(first)["primaryKeyId"]
    got = fastload.load(path, keyset=json.dumps(both), associated_data=b"model-v1")
    assert_same_tensors(got, want)


def fastload_encrypt(keyset: str, plain: bytes, ad: bytes, tmp_path: Path) -> bytes:
    """``plain`` as fastload encrypts a file on its way (``copy(keyset=)`` encrypts every
    ``.safetensors`` file whatever its bytes, as ``save_file(keyset=)`` writes)."""
    src, dst = tmp_path / "plain.safetensors", tmp_path / "encrypted.safetensors"
    src.write_bytes(plain)
    fastload.copy(src, dst, keyset=keyset, associated_data=ad or None, progress=False)
    out = dst.read_bytes()
    dst.unlink()
    return out


def test_what_fastload_encrypts_tink_decrypts(plain_file, big_keyset, small, tmp_path):
    """The write direction (src/tink/segment.rs `encrypt`): tink reads it back, with and
    without associated data, for both templates, at the segment boundaries (nothing, one byte,
    the first segment full); fastload loads it too."""
    plain = plain_file.read_bytes()
    for keyset, primitive in (big_keyset, small[:2]):
        for ad in (b"", b"ad"):
            ciphertext = fastload_encrypt(keyset, plain, ad, tmp_path)
            assert ciphertext != fastload_encrypt(keyset, plain, ad, tmp_path)  # fresh salt
            assert tink_decrypt(primitive, ciphertext, ad) == plain
        for data in (b"", b"x", plain[: 4096 - 16 - 24], plain[: 3 * MIB]):
            assert tink_decrypt(primitive, fastload_encrypt(keyset, data, b"", tmp_path)) == data
    path = tmp_path / "ours.safetensors"
    path.write_bytes(fastload_encrypt(big_keyset[0], plain, b"", tmp_path))
    assert_same_tensors(fastload.load(path, keyset=big_keyset[0]), helpers.reference(plain_file))


@pytest.fixture
def served(plain_file, encrypted):
    server = http_server.start_server({"/model.safetensors": encrypted.read_bytes()})
    yield server
    server.close()


def data_gets(server) -> list[tuple[int, int]]:
    """(begin, end) of each ranged GET the server answered so far."""
    out = []
    for command, _, rng, status in list(server.behaviour.log):
        if command == "GET" and rng and status == 206:
            begin, _, end = rng.removeprefix("bytes=").partition("-")
            out.append((int(begin), int(end) + 1))
    return out


def test_http_slice_reads_only_its_segments(served, plain_file, big_keyset, encrypted):
    """A row of `w` (4 KiB in the middle of the file) is one or two 1 MiB segments fetched:
    counted at the server, beyond what opening reads (the first segment, with the header, and
    the last, which proves the file whole)."""
    url = served.url("model.safetensors")
    want = helpers.reference(plain_file)["w"]
    with fastload.safe_open(url, "pt", keyset=big_keyset[0]) as f:
        opened = len(data_gets(served))
        assert opened <= 3, data_gets(served)
        row = f.get_slice("w")[600:601]
        gets = data_gets(served)[opened:]
    assert_same_tensor(row, want[600:601].clone())
    size = encrypted.stat().st_size
    assert 1 <= len(gets) <= 2, gets
    fetched = sum(e - b for b, e in gets)
    assert fetched <= 2 * MIB, (fetched, gets)
    # Segment-aligned: each read starts and ends on the ciphertext's segment boundaries.
    for b, e in gets:
        assert b % MIB == 0 and (e % MIB == 0 or e == size), (b, e)


def test_http_load_fetches_each_segment_once(served, plain_file, big_keyset, encrypted):
    """A whole load over HTTP with 2 MiB blocks: the blocks are cut between segments, so no
    segment is fetched by two reads (counted at the server: the GETs' ranges never overlap, and
    add up to no more than the file)."""
    url = served.url("model.safetensors")
    got = fastload.load(url, keyset=big_keyset[0], block_size="2MiB", concurrency=4)
    assert_same_tensors(got, helpers.reference(plain_file))
    gets = sorted(data_gets(served))
    for (_, e1), (b2, _) in zip(gets, gets[1:]):
        assert e1 <= b2, gets
    assert sum(e - b for b, e in gets) <= encrypted.stat().st_size, gets


def test_auto_reads_encrypted_local_files_and_says_why(encrypted, plain_file, big_keyset):
    with fastload.stream(str(encrypted), keyset=big_keyset[0]) as s:
        got = dict(s)
        stats = s.stats()
    assert stats["method"] == "read", stats
    assert "encrypted" in stats["method_reason"] and str(encrypted) in stats["method_reason"]
    assert_same_tensors(got, helpers.reference(plain_file))


def test_bench_cold_evicts_encrypted_local_files(encrypted, big_keyset, tmp_path):
    """`fastload bench --cold` of an encrypted local file treats it as the local file it is
    (evicted before each run), not as an object read over the network."""
    import os
    import subprocess
    import sys

    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(big_keyset[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    env["FASTLOAD_KEYSET"] = str(keyset_file)
    argv = ["bench", str(encrypted), "--cold", "--repeat", "1", "--compare", "none", "--json"]
    run = subprocess.run(
        [sys.executable, "-m", "fastload._cli", *argv], capture_output=True, text=True, env=env
    )
    assert run.returncode == 0, run.stderr
    assert "evicts local files only" not in run.stderr, run.stderr
    report = json.loads(run.stdout)
    assert report["modes"]["cold"]["read_from"] in ("storage", "page cache"), report["modes"]
    assert big_keyset[0] not in run.stdout + run.stderr


def test_bench_peers_do_not_compare_on_encrypted_files(encrypted, big_keyset, tmp_path):
    """The peers read plain safetensors files only: on an encrypted file they would read the
    ciphertext (and fail with "header too large"), so the comparison says it does not apply;
    fastload's own driver row still loads it with the keyset."""
    import os
    import subprocess
    import sys

    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(big_keyset[0])
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    env["FASTLOAD_KEYSET"] = str(keyset_file)

    def bench(*args: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, "-m", "fastload._cli", "bench", str(encrypted), "--repeat", "1"]
        run = subprocess.run([*argv, *args], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr
        assert big_keyset[0] not in run.stdout + run.stderr
        return run

    why = "not applicable: the files are encrypted, and peers read plain safetensors files only"
    table = bench().stdout
    assert "\nno peer beside it: the files are encrypted, and peers read plain" in table, table
    assert "header too large" not in table, table
    compare = json.loads(bench("--compare=safetensors", "--json").stdout)["compare"]
    assert compare["not_run"] == [{"loader": "safetensors", "reason": why}], compare
    assert list(compare["loaders"]) == ["fastload"], compare
    assert compare["loaders"]["fastload"]["warm"]["bytes"] == plain_bytes(encrypted, big_keyset)


def plain_bytes(path: Path, keyset) -> int:
    """The tensors' bytes of an encrypted file, from its plaintext header."""
    return fastload.inspect(str(path), keyset=keyset[0])["total"]["bytes"]


def test_http_load_and_cache(served, plain_file, big_keyset, tmp_path):
    """Over HTTP, and through the local cache: the cache keeps the ciphertext, and a second load
    reads it (no GET of the object), decrypting it again."""
    url = served.url("model.safetensors")
    want = helpers.reference(plain_file)
    cache = tmp_path / "cache"
    assert_same_tensors(fastload.load(url, keyset=big_keyset[0], cache=cache), want)
    fastload.cache_stats()  # waits for the copy to be published (a load returns before)
    copies = [p for p in cache.rglob("*") if p.is_file() and p.stat().st_size > MIB]
    assert copies and all(b"__metadata__" not in p.read_bytes() for p in copies)
    before = len(data_gets(served))
    assert_same_tensors(fastload.load(url, keyset=big_keyset[0], cache=cache), want)
    assert len(data_gets(served)) == before


def test_s3_seaweed(seaweed, plain_file, encrypted, big_keyset):
    s3_server.upload(seaweed.client(), s3_server.BUCKET, {"enc/model.safetensors": encrypted})
    got = fastload.load(
        f"s3://{s3_server.BUCKET}/enc/model.safetensors",
        keyset=big_keyset[0],
        storage_options=seaweed.storage_options(),
    )
    assert_same_tensors(got, helpers.reference(plain_file))


def test_mock_hub(plain_file, encrypted, big_keyset, tmp_path, monkeypatch):
    hub = hub_server.MockHub()
    try:
        hub.add("org/secret", {"model.safetensors": encrypted.read_bytes()})
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        got = fastload.load(
            "hf://org/secret/model.safetensors",
            keyset=big_keyset[0],
            storage_options={"endpoint": hub.base},
        )
    finally:
        hub.close()
    assert_same_tensors(got, helpers.reference(plain_file))


def failure(fn) -> fastload.FastloadError:
    with pytest.raises(fastload.FastloadError) as e:
        fn()
    return e.value


def assert_hides(err: BaseException, keyset: str) -> None:
    text = str(err) + repr(err) + repr(err.args)
    for secret in key_values(keyset):
        assert secret not in text and secret[:16] not in text, text


def test_failures_name_the_file_and_segment_and_hide_the_key(encrypted, big_keyset, tmp_path):
    keyset = big_keyset[0]
    ciphertext = encrypted.read_bytes()
    path = tmp_path / "bad.safetensors"

    # No keyset: the file is recognised as Tink's.
    e = failure(lambda: fastload.load(encrypted))
    assert isinstance(e, fastload.FormatError) and str(encrypted) in str(e)
    assert "Tink-encrypted" in str(e) and "keyset=" in str(e)

    # A wrong key.
    other, _ = new_keyset()
    e = failure(lambda: fastload.load(encrypted, keyset=other))
    assert isinstance(e, fastload.FormatError) and e.segment == 0 and str(encrypted) in str(e)
    assert_hides(e, other)

    # Truncated: by a few bytes, at a segment boundary (the last segment is checked at open).
    for cut in (ciphertext[:-1000], ciphertext[: 3 * MIB], ciphertext[:30]):
        path.write_bytes(cut)
        e = failure(lambda: fastload.load(path, keyset=keyset))
        assert isinstance(e, fastload.FormatError) and str(path) in str(e), e
        assert_hides(e, keyset)

    # A flipped byte in the third segment: that segment is named, from load and from a slice.
    flipped = bytearray(ciphertext)
    flipped[2 * MIB + 12345] ^= 0x01
    path.write_bytes(bytes(flipped))
    e = failure(lambda: fastload.load(path, keyset=keyset))
    assert isinstance(e, fastload.FormatError) and e.segment == 2 and "segment 2" in str(e)
    assert_hides(e, keyset)
    with fastload.safe_open(path, "pt", keyset=keyset) as f:
        f.get_slice("w")[0:1]  # in the first segment: fine
        e = failure(lambda: f.get_slice("w")[600:601])
        assert e.segment == 2

    # A keyset of another primitive (AEAD, not streaming AEAD), and junk: ConfigError.
    handle = tink.new_keyset_handle(aead.aead_key_templates.AES256_GCM)
    out = io.StringIO()
    cleartext_keyset_handle.write(tink.JsonKeysetWriter(out), handle)
    e = failure(lambda: fastload.load(encrypted, keyset=out.getvalue()))
    assert isinstance(e, fastload.ConfigError) and e.option == "keyset"
    assert "AesGcmKey" in str(e) and "AesGcmHkdfStreamingKey" in str(e)
    assert_hides(e, out.getvalue())
    broken = keyset.replace('"keyId"', '"keyId" 3')
    e = failure(lambda: fastload.load(encrypted, keyset=broken))
    assert isinstance(e, fastload.ConfigError)
    assert_hides(e, keyset)
    e = failure(lambda: fastload._fastload.resolve_options(keyset=str(tmp_path / "none.json")))
    # Not read, and not shown either: a keyset value may be key material, whatever its form.
    assert isinstance(e, fastload.ConfigError) and "No such file" in str(e)
    assert EXPECTED in str(e) and "none.json" not in str(e)


def test_stream_hands_out_only_authenticated_tensors(dtypes_file, small, tmp_path):
    """A flip in one segment of a many-segment file: the stream may yield tensors of the other
    segments first, each bitwise right, then raises naming the segment."""
    keyset, _, ciphertext = small
    want = helpers.reference(dtypes_file)
    flipped = bytearray(ciphertext)
    flipped[len(ciphertext) // 2] ^= 0x80
    path = tmp_path / "flipped.safetensors"
    path.write_bytes(bytes(flipped))
    got = {}
    with pytest.raises(fastload.FormatError) as e:
        for name, t in fastload.stream(str(path), keyset=keyset, block_size="4KiB"):
            got[name] = t
    assert e.value.segment == (len(ciphertext) // 2) // 4096
    assert len(got) < len(want)
    for name, t in got.items():
        assert_same_tensor(t, want[name], name)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_random_byte_flips_always_fail(small, tmp_path, data):
    """Any flipped bit anywhere in the file (header, salt, nonce prefix, ciphertext, tags) fails
    the load with a FormatError naming the file; none loads."""
    keyset, _, ciphertext = small
    at = data.draw(st.integers(0, len(ciphertext) - 1), label="offset")
    bit = data.draw(st.integers(0, 7), label="bit")
    flipped = bytearray(ciphertext)
    flipped[at] ^= 1 << bit
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(bytes(flipped))
    e = failure(lambda: fastload.load(path, keyset=keyset, block_size="4KiB"))
    assert isinstance(e, fastload.FormatError) and str(path) in str(e), e


def test_gpu_staging_reads_plaintext(fake_cuda, plain_file, encrypted, big_keyset, tmp_path):
    """The GPU path (page-locked ring, copy stream) on the simulated driver (tests/cuda_sim.py):
    an encrypted file lands bitwise equal to the plain one, with the keyset from
    FASTLOAD_KEYSET."""
    import cuda_sim
    from test_cuda_driver import LOAD

    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(big_keyset[0])
    code = (
        LOAD
        + """
got, stats = load(sys.argv[1], block_size="256KiB", memory_limit="2MiB")
emit(ok=got == expected(sys.argv[2]), n=len(got))
"""
    )
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log, FASTLOAD_KEYSET=str(keyset_file))
    out = helpers.run_probe(code, str(encrypted), str(plain_file), env=env)
    assert out["ok"] and out["n"] == 5, out
    assert cuda_sim.log(log)["violations"] == 0


def test_engines_extra_config_takes_the_keyset(big_keyset, tmp_path):
    """vLLM's and SGLang's model_loader_extra_config: `keyset` and `associated_data` pass on to
    the load, and a keyset that cannot be used fails at engine start naming the key."""
    from fastload import _integration

    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(big_keyset[0])
    extra = {"keyset": str(keyset_file), "associated_data": "v1"}
    options = _integration.Options.parse("fastload", extra, _integration.KEYS)
    assert options.stream_kwargs == extra
    e = failure(
        lambda: _integration.Options.parse(
            "fastload", {"keyset": str(tmp_path / "missing.json")}, _integration.KEYS
        )
    )
    assert isinstance(e, fastload.ConfigError) and e.option == "keyset"


def test_extra_config_repr_hides_the_keyset(big_keyset):
    from fastload import _integration

    options = _integration.Options.parse("fastload", {"keyset": big_keyset[0]}, _integration.KEYS)
    assert_hides(AssertionError(repr(options)), big_keyset[0])


def test_sharded_checkpoint_with_a_plain_index(sharded_dir, small, tmp_path):
    """Every shard encrypted, the index left plain (as docs/encryption.md says to encrypt a
    checkpoint): the folder loads as the plain one does."""
    keyset, primitive, _ = small
    for p in sharded_dir.iterdir():
        data = p.read_bytes()
        if p.suffix == ".safetensors":
            data = tink_encrypt(primitive, data)
        (tmp_path / p.name).write_bytes(data)
    want = helpers.reference(*helpers.indexed_files(sharded_dir))
    assert_same_tensors(fastload.load(tmp_path, keyset=keyset), want)


def test_command_line_takes_the_keyset_from_the_environment(encrypted, big_keyset, tmp_path):
    import os
    import subprocess
    import sys

    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(big_keyset[0])
    cli = [sys.executable, "-m", "fastload._cli", "inspect", str(encrypted)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    ok = subprocess.run(
        cli, capture_output=True, text=True, env={**env, "FASTLOAD_KEYSET": str(keyset_file)}
    )
    assert ok.returncode == 0 and "[1024, 1024]" in ok.stdout, ok.stderr
    refused = subprocess.run(cli, capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "FASTLOAD_KEYSET" in refused.stderr


def run_cli(*args: str, keyset_env: str | None = None) -> subprocess.CompletedProcess[str]:
    """`fastload ARGS` (the wheel's script) with FASTLOAD_* cleared, FASTLOAD_KEYSET set to
    `keyset_env` when given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    if keyset_env is not None:
        env["FASTLOAD_KEYSET"] = keyset_env
    cli = [sys.executable, "-m", "fastload._cli", *args]
    return subprocess.run(cli, capture_output=True, text=True, env=env, timeout=300)


EXPECTED = "a keyset JSON, or a path to one"


def not_json_forms(keyset: str) -> dict[str, str]:
    """A keyset as it is handed over by mistake: base64 (a Kubernetes secret's data), the JSON in
    quotes, the JSON cut at its first brace."""
    return {
        "base64": base64.b64encode(keyset.encode()).decode(),
        "quoted": json.dumps(keyset),
        "no brace": keyset.strip()[1:],
    }


def assert_shows_none_of(text: str, keyset: str, form: str) -> None:
    """No key value of `keyset` nor any 12-character run of `form` (its key material as it was
    given) is in `text`."""
    for secret in key_values(keyset):
        assert secret[:12] not in text, text
    for i in range(len(form) - 11):
        assert form[i : i + 12] not in text, (form[i : i + 12], text)


def test_a_keyset_that_is_not_json_is_never_shown(
    plain_file, encrypted, big_keyset, to_save, tmp_path, monkeypatch
):
    """A keyset that is not JSON (nor a file) is refused by every entry point, Python's
    arguments, FASTLOAD_KEYSET and the command line alike, saying what was expected and showing
    no part of it (it used to be quoted whole as a file name that was "too long")."""
    keyset = big_keyset[0]
    for name, form in not_json_forms(keyset).items():
        calls = {
            "load": lambda k: fastload.load(encrypted, keyset=k),
            "safe_open": lambda k: fastload.safe_open(encrypted, "pt", keyset=k).__enter__(),
            "save_file": lambda k: fastload.save_file(to_save, tmp_path / "w", keyset=k),
            "copy": lambda k: fastload.copy(plain_file, tmp_path / "c", keyset=k, progress=False),
        }
        for entry, call in calls.items():
            with pytest.raises(fastload.ConfigError) as e:
                call(form)
            text = str(e.value) + repr(e.value.args)
            assert e.value.option == "keyset" and EXPECTED in text, (entry, name, text)
            assert_shows_none_of(text, keyset, form)
        with monkeypatch.context() as m:
            m.setenv("FASTLOAD_KEYSET", form)
            with pytest.raises(fastload.ConfigError) as e:
                fastload.load(encrypted)
            assert e.value.option == "FASTLOAD_KEYSET" and EXPECTED in str(e.value)
            assert_shows_none_of(str(e.value), keyset, form)
        for args in (
            ["inspect", str(encrypted)],
            ["bench", str(encrypted), "--json", "--repeat", "1", "--compare=none"],
            ["copy", str(plain_file), str(tmp_path / "c"), "--encrypt"],
        ):
            out = run_cli(*args, keyset_env=form)
            assert out.returncode == 1 and EXPECTED in out.stderr, (args, out.stderr)
            assert_shows_none_of(out.stdout + out.stderr, keyset, form)
    assert list(tmp_path.iterdir()) == []
    # The base64 form says what it is.
    with pytest.raises(fastload.ConfigError, match="base64-encoded JSON"):
        fastload.load(encrypted, keyset=not_json_forms(keyset)["base64"])


def test_a_byte_order_mark_before_the_keyset_is_read(plain_file, encrypted, big_keyset, tmp_path):
    """A keyset JSON after a UTF-8 byte-order mark (as some editors save it), given as a value,
    as a file, in FASTLOAD_KEYSET or through --keyset FILE: read as the JSON it is."""
    with_bom = "\ufeff" + big_keyset[0]
    want = helpers.reference(plain_file)
    assert_same_tensors(fastload.load(encrypted, keyset=with_bom), want)
    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(with_bom, encoding="utf-8")
    assert_same_tensors(fastload.load(encrypted, keyset=keyset_file), want)
    for out in (
        run_cli("inspect", str(encrypted), keyset_env=with_bom),
        run_cli("inspect", str(encrypted), "--keyset", str(keyset_file)),
    ):
        assert out.returncode == 0 and "[1024, 1024]" in out.stdout, out.stderr


def test_the_command_line_takes_a_keyset_file_and_names_its_own_flags(
    plain_file, encrypted, big_keyset, tmp_path
):
    """`--keyset FILE` reads an encrypted file (inspect, bench) and encrypts a copy (with
    --encrypt); the command line's messages name its flags (`--keyset FILE`, `--encrypt`) where
    Python's name its arguments (`keyset=`), and the keyset's JSON on the command line is
    refused without being shown."""
    keyset = big_keyset[0]
    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(keyset)
    out = run_cli("inspect", str(encrypted))
    assert out.returncode == 1 and "pass --keyset FILE (or set FASTLOAD_KEYSET)" in out.stderr
    assert "keyset=" not in out.stderr, out.stderr
    with pytest.raises(fastload.FormatError) as e:
        fastload.load(encrypted)
    python_says = str(e.value)
    assert "pass keyset= (or set FASTLOAD_KEYSET)" in python_says and "--keyset" not in python_says

    out = run_cli("inspect", str(encrypted), "--keyset", str(keyset_file), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["total"]["tensors"] == 5
    args = ["--keyset", str(keyset_file), "--json", "--repeat", "1", "--compare=none"]
    out = run_cli("bench", str(encrypted), *args)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["tensors"] == 5
    out = run_cli("inspect", str(encrypted), "--keyset", keyset)
    assert out.returncode == 1 and "invalid option --keyset" in out.stderr, out.stderr
    assert_shows_none_of(out.stderr, keyset, keyset)

    # Encrypting a copy: --keyset FILE goes with --encrypt; an encrypted source is refused.
    copied = tmp_path / "copied.safetensors"
    out = run_cli("copy", str(plain_file), str(copied), "--encrypt", "--keyset", str(keyset_file))
    assert out.returncode == 0, out.stderr
    assert_same_tensors(fastload.load(copied, keyset=keyset), helpers.reference(plain_file))
    assert run_cli("copy", str(plain_file), str(tmp_path / "x"), "--keyset", "k").returncode == 2
    again = ["copy", str(encrypted), str(tmp_path / "twice.safetensors"), "--encrypt"]
    out = run_cli(*again, "--keyset", str(keyset_file))
    assert out.returncode == 1, out.stderr
    assert "invalid option --encrypt" in out.stderr and "copy it without --encrypt" in out.stderr
    assert "keyset=" not in out.stderr
    with pytest.raises(fastload.ConfigError) as e:
        fastload.copy(encrypted, tmp_path / "twice.safetensors", keyset=keyset, progress=False)
    assert e.value.option == "keyset" and "copy it without keyset=" in str(e.value)
    assert "--encrypt" not in str(e.value)
    assert not (tmp_path / "twice.safetensors").exists()


# Writing encrypted files: save_file / save / copy with keyset=.

aws_env = s3_server.aws_env


@pytest.fixture(scope="module")
def to_save() -> dict[str, torch.Tensor]:
    """About 10 MB: more than one 8 MiB batch of segments the writer seals at a time, a tensor
    across many 1 MiB segments, and small tensors of several dtypes."""
    return {
        "w": helpers.pattern((2560, 1024), torch.float32, seed=5),
        "b": helpers.pattern((1000,), torch.bfloat16, seed=6),
        "ids": helpers.pattern((7, 3), torch.int64, seed=7),
        "e": helpers.pattern((0, 3), torch.float32),
    }


def test_save_file_with_a_keyset_writes_what_tink_decrypts(to_save, big_keyset, small, tmp_path):
    """save_file(keyset=...) writes Tink's streaming AEAD of the very bytes safetensors writes
    (both templates, with and without associated data, an empty file too); fastload reads it back
    with the keyset, and refuses the wrong key or associated data naming the segment."""
    want = safetensors.torch.save(to_save)
    cases = ((big_keyset, b""), (small[:2], b"v1"), (big_keyset, "v2"))
    for i, ((keyset, primitive), ad) in enumerate(cases):
        path = tmp_path / f"m{i}.safetensors"
        fastload.save_file(to_save, path, keyset=keyset, associated_data=ad or None)
        data = path.read_bytes()
        assert b"__metadata__" not in data and b'"ids"' not in data
        ad_bytes = ad.encode() if isinstance(ad, str) else ad
        assert tink_decrypt(primitive, data, ad_bytes) == want
        assert_same_tensors(fastload.load(path, keyset=keyset, associated_data=ad or None), to_save)
    empty = tmp_path / "empty.safetensors"
    fastload.save_file({}, empty, keyset=big_keyset[0])
    assert tink_decrypt(big_keyset[1], empty.read_bytes()) == safetensors.torch.save({})
    # Tink's file of the same plaintext has the same size (the same segmentation).
    first = tmp_path / "m0.safetensors"
    assert first.stat().st_size == len(tink_encrypt(big_keyset[1], want))
    err = failure(lambda: fastload.load(first, keyset=small[0]))
    assert str(first) in str(err)
    assert getattr(err, "segment", None) == 0
    err = failure(lambda: fastload.load(first, keyset=big_keyset[0], associated_data=b"other"))
    assert getattr(err, "segment", None) == 0


def test_writing_with_a_bad_keyset_fails_before_writing_and_hides_it(to_save, tmp_path):
    """A keyset of another primitive, or associated_data without a keyset: a ConfigError naming
    the option, nothing written, no key in the message."""
    handle = tink.new_keyset_handle(aead.aead_key_templates.AES256_GCM)
    out = io.StringIO()
    cleartext_keyset_handle.write(tink.JsonKeysetWriter(out), handle)
    other = out.getvalue()
    path = tmp_path / "m.safetensors"
    with pytest.raises(fastload.ConfigError) as e:
        fastload.save_file(to_save, path, keyset=other)
    assert e.value.option == "keyset" and "AesGcmHkdfStreamingKey" in str(e.value)
    assert_hides(e.value, other)
    with pytest.raises(fastload.ConfigError) as e:
        fastload.save_file(to_save, path, associated_data=b"x")
    assert e.value.option == "associated_data"
    with pytest.raises(fastload.ConfigError):
        fastload.copy(tmp_path, tmp_path / "out", keyset=other, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_save_to_s3_encrypts_the_shards_and_leaves_the_index_plain(
    seaweed, to_save, big_keyset, tmp_path
):
    """save(keyset=...) to SeaweedFS, a shard large enough for a multipart upload: each shard is
    tink's encryption of the shard a plain save writes; the index is the same plain JSON (it
    names the tensors); the folder loads back with the keyset."""
    client = seaweed.client()
    s3_server.upload(client, s3_server.BUCKET, {})
    prefix = "enc-save/"
    common = {"max_shard_size": 6 * MIB, "metadata": {"run": "1"}}
    names = fastload.save(
        to_save,
        f"s3://{s3_server.BUCKET}/{prefix}",
        keyset=big_keyset[0],
        storage_options=seaweed.storage_options(),
        part_size="5MiB",
        **common,
    )
    assert names[-1] == "model.safetensors.index.json" and len(names) == 3
    fastload.save(to_save, tmp_path, **common)
    for name in names:
        got = client.get_object(Bucket=s3_server.BUCKET, Key=prefix + name)["Body"].read()
        plain = (tmp_path / name).read_bytes()
        if name.endswith(".safetensors"):
            assert tink_decrypt(big_keyset[1], got) == plain
        else:
            assert got == plain and b'"ids"' in got
    got = fastload.load(
        f"s3://{s3_server.BUCKET}/{prefix}",
        keyset=big_keyset[0],
        storage_options=seaweed.storage_options(),
    )
    assert_same_tensors(got, to_save)


def test_copy_from_the_hub_to_s3_with_a_keyset_then_load_it(
    sharded_dir, small, big_keyset, seaweed, aws_env, tmp_path, monkeypatch
):
    """copy(hf://..., s3://..., keyset=...): the shards arrive encrypted (tink decrypts them to
    the Hub's bytes), the index and config as they are; the copy loads with the keyset, and a
    wrong key fails naming a segment; a rerun skips every file; copying the encrypted folder
    again with a keyset is refused (no double encryption), without one it is copied as is."""
    keyset, primitive, _ = small
    tree = {p.name: p.read_bytes() for p in sharded_dir.iterdir()}
    tree["config.json"] = b'{"model_type": "llama"}'
    hub = hub_server.MockHub()
    try:
        hub.add("org/plain", tree)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
        monkeypatch.setenv("HF_ENDPOINT", hub.base)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        aws_env(seaweed)
        client = seaweed.client()
        s3_server.upload(client, s3_server.BUCKET, {})
        dst = f"s3://{s3_server.BUCKET}/enc-copy/"
        out = fastload.copy("hf://org/plain", dst, keyset=keyset, progress=False)
        assert len(out["copied"]) == len(tree)
        for name, plain in tree.items():
            got = client.get_object(Bucket=s3_server.BUCKET, Key="enc-copy/" + name)["Body"].read()
            if name.endswith(".safetensors"):
                assert got != plain and tink_decrypt(primitive, got) == plain
            else:
                assert got == plain
        want = helpers.reference(*helpers.indexed_files(sharded_dir))
        assert_same_tensors(fastload.load(dst, keyset=keyset), want)
        err = failure(lambda: fastload.load(dst, keyset=big_keyset[0]))
        assert getattr(err, "segment", None) == 0 and "enc-copy/" in str(err)
        again = fastload.copy("hf://org/plain", dst, keyset=keyset, progress=False)
        assert again["copied"] == [] and len(again["skipped"]) == len(tree)
    finally:
        hub.close()
    with pytest.raises(fastload.ConfigError, match="already"):
        fastload.copy(dst, tmp_path / "twice", keyset=keyset, progress=False)
    fastload.copy(dst, tmp_path / "as-is", progress=False)
    assert_same_tensors(fastload.load(tmp_path / "as-is", keyset=keyset), want)


def test_command_line_copy_encrypts_with_the_environment_keyset(sharded_dir, small, tmp_path):
    import os
    import subprocess
    import sys

    keyset, primitive, _ = small
    keyset_file = tmp_path / "keyset.json"
    keyset_file.write_text(keyset)
    cli = [sys.executable, "-m", "fastload._cli", "copy", str(sharded_dir), str(tmp_path / "o")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    refused = subprocess.run([*cli, "--encrypt"], capture_output=True, text=True, env=env)
    assert refused.returncode != 0 and "FASTLOAD_KEYSET" in refused.stderr
    assert not (tmp_path / "o").exists()
    ok = subprocess.run(
        [*cli, "--encrypt"],
        capture_output=True,
        text=True,
        env={**env, "FASTLOAD_KEYSET": str(keyset_file)},
    )
    assert ok.returncode == 0, ok.stderr
    for p in sharded_dir.iterdir():
        got = (tmp_path / "o" / p.name).read_bytes()
        if p.suffix == ".safetensors":
            assert tink_decrypt(primitive, got) == p.read_bytes()
        else:
            assert got == p.read_bytes()


def test_transformers_from_pretrained_with_load_options_keyset(small, tmp_path):
    """A sharded transformers checkpoint whose shards tink encrypted (index and configs plain):
    fastload.transformers.from_pretrained(..., load_options={"keyset": ...}) builds the same model
    as transformers from the plain folder; without the keyset it fails asking for one."""
    pytest.importorskip("transformers")
    import fastload.transformers
    from hf_models import assert_same_state, write_llama
    from transformers import LlamaForCausalLM

    keyset, primitive, _ = small
    plain = write_llama(tmp_path / "plain", max_shard_size="20KB")
    enc = tmp_path / "enc"
    enc.mkdir()
    for p in plain.iterdir():
        data = p.read_bytes()
        (enc / p.name).write_bytes(
            tink_encrypt(primitive, data) if p.suffix == ".safetensors" else data
        )
    assert len(list(enc.glob("*.safetensors"))) > 2
    got = fastload.transformers.from_pretrained(
        LlamaForCausalLM, enc, load_options={"keyset": keyset}
    )
    assert_same_state(got, LlamaForCausalLM.from_pretrained(plain))
    err = failure(lambda: fastload.transformers.from_pretrained(LlamaForCausalLM, enc))
    assert "keyset" in str(err)


def test_an_encrypted_file_to_a_gpu_with_mmap_is_read_not_lent(
    fake_cuda, plain_file, encrypted, big_keyset, tmp_path
):
    # Its pages hold ciphertext: lending them would copy ciphertext to the device. The load
    # says it could not lend them and decrypts through the ring (on the simulated driver).
    import cuda_sim

    keyset = tmp_path / "keyset.json"
    keyset.write_text(big_keyset[0])
    code = """
import fastload, torch
from fastload import _fastload, _torch
from safetensors.torch import load_file
enc, plain, keyset = sys.argv[1], sys.argv[2], sys.argv[3]
def allocate(sizes):
    ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return None, [(t, t.data_ptr()) for t in ts]
s = _fastload.Stream([enc], target="cuda:0", allocate=allocate, method="mmap", keyset=keyset,
                     block_size="256KiB", memory_limit="4MiB")
got = {}
for batch in s:
    for item in batch:
        got[item.name] = _torch.from_bytes(item.dtype, item.shape, item.data, enc)
want = load_file(plain)
flat = lambda t: t.reshape(-1).view(torch.uint8)
bad = [n for n in want if n not in got or not torch.equal(flat(got[n]), flat(want[n]))]
emit(bad=bad, stats=s.stats().as_dict())
"""
    log = tmp_path / "log"
    out = helpers.run_probe(code, encrypted, plain_file, keyset, env=cuda_sim.env(fake_cuda, log))
    assert out["bad"] == []
    stats = out["stats"]
    assert stats["lent_bytes"] == 0 and "cannot be mapped" in stats["lend_refused"], stats
    counters = cuda_sim.log(log)
    assert counters.get("calls.cuMemHostRegister", 0) == 0 and counters["violations"] == 0
