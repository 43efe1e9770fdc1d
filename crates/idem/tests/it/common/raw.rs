//! A raw HTTP/1.1 upstream's reading side: tests that answer with bytes of their own (a dropped
//! connection, garbage, a stall) read requests with this.

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// A request as the raw upstream read it.
pub struct Head {
    pub method: String,
    pub path: String,
    pub key: String,
    pub attempt: String,
}

/// Reads one request (head and `Content-Length` body) from `stream`.
pub async fn read_request(stream: &mut TcpStream) -> Option<Head> {
    let mut buf = Vec::new();
    let mut chunk = [0_u8; 4096];
    let end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let header = |name: &str| {
        head.lines()
            .find_map(|line| {
                let (n, v) = line.split_once(':')?;
                n.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
            })
            .unwrap_or_default()
    };
    let length: usize = header("content-length").parse().unwrap_or(0);
    while buf.len() < end + length {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(Head {
        method: head.split(' ').next().unwrap_or_default().to_owned(),
        path: head.split(' ').nth(1).unwrap_or("/").to_owned(),
        key: header("idempotency-key"),
        attempt: header("idempotency-attempt"),
    })
}
