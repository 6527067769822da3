"""The servers the tests and benches start on 127.0.0.1.

- `base`: `Server`, the one threaded server base (daemon threads, quiet about clients that hang
  up, `url()`, `close()`) and `Handler`, the handler base (HTTP/1.1 keep-alive, no access log);
- `ranges`: the one reading of `Range` and `If-Match` (206 with Content-Range, 416, 412) and the
  one body writer;
- `http`: a plain Range server with misbehaviours (http(s):// tests, the cache, the soak);
- `hub`: a mock Hugging Face Hub, its signed storage host and a Xet-style bridge (hf:// tests);
- `azure`: an Azure Blob server with SharedKey verified (az:// tests);
- `gcs`: fake-gcs-server and an authenticating proxy in front of it (gs:// tests);
- `s3`: SeaweedFS and moto, and the fault-injecting proxies (s3:// tests);
- `answer`: a server that answers as the test's function says (hostile bodies, echoed secrets).
"""
