//! What a serve has served, per client address: `/metrics` in Prometheus' text format, and a
//! progress line on stderr while bytes go out.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::Duration;

#[derive(Default)]
struct Client {
    bytes: u64,
    /// Answers by status code.
    requests: BTreeMap<u16, u64>,
}

/// Counters of one serve.
#[derive(Default)]
pub struct Metrics {
    clients: Mutex<BTreeMap<IpAddr, Client>>,
}

impl Metrics {
    /// `n` body bytes sent to `client`.
    pub fn sent(&self, client: IpAddr, n: u64) {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        clients.entry(client).or_default().bytes += n;
    }

    /// One answer with `code` to `client`.
    pub fn answered(&self, client: IpAddr, code: u16) {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        *clients
            .entry(client)
            .or_default()
            .requests
            .entry(code)
            .or_default() += 1;
    }

    /// Bytes sent to everyone, and to how many clients.
    pub fn totals(&self) -> (u64, usize) {
        let clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        (clients.values().map(|c| c.bytes).sum(), clients.len())
    }

    /// The Prometheus text of these counters and of what the serve holds.
    pub fn render(&self, files_held: usize, bytes_held: u64) -> String {
        let clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        let mut out = String::new();
        out.push_str("# HELP fastload_serve_bytes_total Body bytes sent, per client address.\n");
        out.push_str("# TYPE fastload_serve_bytes_total counter\n");
        for (ip, c) in clients.iter() {
            let _ = writeln!(
                out,
                "fastload_serve_bytes_total{{client=\"{ip}\"}} {}",
                c.bytes
            );
        }
        out.push_str("# HELP fastload_serve_requests_total Answers, per client and status.\n");
        out.push_str("# TYPE fastload_serve_requests_total counter\n");
        for (ip, c) in clients.iter() {
            for (code, n) in &c.requests {
                let _ = writeln!(
                    out,
                    "fastload_serve_requests_total{{client=\"{ip}\",code=\"{code}\"}} {n}"
                );
            }
        }
        out.push_str("# HELP fastload_serve_files_held Files whose bytes are all at the serve.\n");
        out.push_str("# TYPE fastload_serve_files_held gauge\n");
        let _ = writeln!(out, "fastload_serve_files_held {files_held}");
        out.push_str("# HELP fastload_serve_bytes_held Bytes of the files held.\n");
        out.push_str("# TYPE fastload_serve_bytes_held gauge\n");
        let _ = writeln!(out, "fastload_serve_bytes_held {bytes_held}");
        out
    }
}

/// Every `every`, while bytes went out since the last line: one line on stderr with the total,
/// the clients and the rate since the last line. Runs until the serve stops.
pub async fn progress(metrics: std::sync::Arc<Metrics>, every: Duration) {
    let mut last = 0u64;
    loop {
        tokio::time::sleep(every).await;
        let (bytes, clients) = metrics.totals();
        if bytes == last {
            continue;
        }
        let rate = (bytes - last) as f64 / every.as_secs_f64();
        let s = if clients == 1 { "" } else { "s" };
        eprintln!(
            "fastload serve: {:.3} GB sent to {clients} client{s} ({:.1} MB/s)",
            bytes as f64 / 1e9,
            rate / 1e6,
        );
        last = bytes;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_and_answers_are_counted_per_client() {
        let m = Metrics::default();
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let b: IpAddr = "127.0.0.2".parse().unwrap();
        m.sent(a, 10);
        m.sent(a, 5);
        m.sent(b, 7);
        m.answered(a, 206);
        m.answered(a, 206);
        m.answered(b, 404);
        let text = m.render(2, 99);
        assert!(text.contains("fastload_serve_bytes_total{client=\"127.0.0.1\"} 15\n"));
        assert!(text.contains("fastload_serve_bytes_total{client=\"127.0.0.2\"} 7\n"));
        assert!(text.contains("requests_total{client=\"127.0.0.1\",code=\"206\"} 2\n"));
        assert!(text.contains("requests_total{client=\"127.0.0.2\",code=\"404\"} 1\n"));
        assert!(text.contains("fastload_serve_files_held 2\n"));
        assert!(text.contains("fastload_serve_bytes_held 99\n"));
        assert_eq!(m.totals(), (22, 2));
    }
}
