//! criterion benches for the Rust hot spots: header parsing and planning of a 100k-tensor
//! checkpoint, and the block pipeline over an in-memory object store (no disk, no network).
//! Run: `cargo bench --bench hot`.

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use fastload::format::{self, Header};
use fastload::options::LoadOptions;
use fastload::pipeline::Loader;
use fastload::plan;
use fastload::source::object::RemoteObject;
use fastload::source::Shard;
use fastload::store::RetrySettings;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

/// A safetensors file of `n` tensors of `each` bytes (F32, 1-D), data zeroed.
fn file(n: usize, each: u64) -> Vec<u8> {
    let mut json = String::from("{");
    for i in 0..n {
        let b = i as u64 * each;
        if i > 0 {
            json.push(',');
        }
        json.push_str(&format!(
            r#""model.layers.{i}.weight":{{"dtype":"F32","shape":[{}],"data_offsets":[{b},{}]}}"#,
            each / 4,
            b + each
        ));
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.resize(out.len() + n * each as usize, 0);
    out
}

fn header_of(bytes: &[u8]) -> Header {
    format::parse(bytes, bytes.len() as u64).expect("valid header")
}

fn remote_shard(store: &Arc<dyn ObjectStore>, path: &Path, bytes: &[u8]) -> Shard {
    let name = format!("memory:///{path}");
    let size = bytes.len() as u64;
    Shard {
        name: name.clone(),
        size,
        header: header_of(bytes),
        source: Arc::new(RemoteObject::new(
            name,
            store.clone(),
            path.clone(),
            size,
            RetrySettings::default(),
        )),
    }
}

fn header_and_plan(c: &mut Criterion) {
    let bytes = file(100_000, 16);
    let json_end = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut g = c.benchmark_group("100k tensors");
    g.throughput(Throughput::Elements(100_000));
    g.bench_function("parse header", |b| {
        b.iter(|| format::parse(&bytes[..json_end], bytes.len() as u64).unwrap())
    });
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let path = Path::from("tiny.safetensors");
    g.bench_function("plan", |b| {
        b.iter_batched(
            || vec![remote_shard(&store, &path, &bytes)],
            |shards| plan::build(shards, None, 64 << 20).unwrap(),
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

fn pipeline(c: &mut Criterion) {
    let rt = fastload::runtime::get();
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let mut g = c.benchmark_group("pipeline, in-memory store");
    g.sample_size(10);
    for (label, n, each) in [
        ("256 MiB, 64 tensors", 64, 4 << 20),
        ("64 MiB, 100k tensors", 100_000, 640),
    ] {
        let bytes = file(n, each);
        let path = Path::from(format!("{n}.safetensors"));
        rt.block_on(store.put(&path, PutPayload::from(bytes.clone())))
            .unwrap();
        g.throughput(Throughput::Bytes(n as u64 * each));
        g.bench_function(label, |b| {
            b.iter_batched(
                || {
                    let opts = LoadOptions {
                        memory_limit: Some(256 << 20),
                        ..Default::default()
                    }
                    .resolve(true)
                    .unwrap();
                    let segment_size = plan::segment_size(opts.memory_limit, opts.block_size);
                    let p = plan::build(
                        vec![remote_shard(&store, &path, &bytes)],
                        None,
                        segment_size,
                    )
                    .unwrap();
                    (p, opts)
                },
                |(p, opts)| {
                    let mut loader = Loader::start(p, opts);
                    let mut tensors = 0;
                    while let Some(seg) = loader.next_segment() {
                        tensors += seg.unwrap().tensors.len();
                    }
                    assert_eq!(tensors, n);
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, header_and_plan, pipeline);
criterion_main!(benches);
