//! A minimal RESP2 client over a std TCP or Unix stream, for the few commands the Redis store
//! sends (`AUTH`, `SELECT`, `PING`, `GET`, `SET`, `EXISTS`, and in cluster mode `CLUSTER SLOTS`,
//! `ASKING`).
//!
//! Invariants:
//! - connecting takes at most its budget, name resolution included: a host name is resolved on a
//!   helper thread the caller waits for only until the budget ends (at most [`MAX_RESOLVERS`]
//!   lookups outstanding, so a hung resolver cannot pile up threads), and a Unix socket whose
//!   listener's backlog is full is retried without blocking until the budget ends;
//! - every exchange runs under one [`Deadline`]: before each read and each write the socket's
//!   timeout is set to the time left, so a server that hangs, drips a byte at a time or sends half
//!   a reply fails the exchange with [`WireError::Timeout`] once the deadline has passed (plus one
//!   scheduling delay), never later — the `redis` crate's per-read timeout restarted at every
//!   byte and every pipelined reply;
//! - a bulk reply's length prefix is read and handed to the caller before any of its bytes are:
//!   the caller checks it against the one frame it expects and reads the bytes straight into its
//!   own buffer, so no reply makes this module allocate more than its fixed read buffer;
//! - after any error the connection may hold an unread (part of a) reply: callers drop it.
use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Bytes read from the socket at a time (replies to `EXISTS`, `SET`, the bulk prefix).
const READ_BUF: usize = 16 << 10;
/// The longest status, error or integer line accepted.
const MAX_LINE: usize = 4096;
/// Name lookups running at once on helper threads; past this, connecting to a host name fails at
/// once (a resolver that hangs holds each of its threads until it answers).
pub(crate) const MAX_RESOLVERS: usize = 4;
static RESOLVERS: AtomicUsize = AtomicUsize::new(0);
/// Limits of [`WireConn::read_value`] (small structured replies such as `CLUSTER SLOTS`).
const MAX_ARRAY: usize = 1 << 16;
const MAX_DEPTH: usize = 4;
const MAX_SMALL_BULK: usize = 4096;

/// Why an exchange failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WireError {
    /// The deadline passed before the exchange completed.
    #[error("deadline of {0:?} passed")]
    Timeout(Duration),
    /// Connecting failed: refused, unreachable, no such socket.
    #[error("connect: {0}")]
    Refused(io::Error),
    /// The connection broke (reset, closed mid-reply).
    #[error("{0}")]
    Io(io::Error),
    /// The server sent something that is not the RESP reply expected.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The server answered with an error reply (`-ERR ...`).
    #[error("server error: {0}")]
    Server(String),
    /// Not sent: the node's circuit breaker is open (cluster mode).
    #[error("{0}")]
    NodeDown(String),
}

impl WireError {
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, WireError::Timeout(_))
    }
}

/// The end of one exchange.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline {
    at: Instant,
    budget: Duration,
}

impl Deadline {
    pub(crate) fn after(budget: Duration) -> Self {
        Deadline {
            at: Instant::now() + budget,
            budget,
        }
    }

    /// A deadline at half of the time left (the same budget reported on expiry).
    pub(crate) fn half(&self) -> Deadline {
        let left = self.at.saturating_duration_since(Instant::now());
        Deadline {
            at: Instant::now() + left / 2,
            budget: self.budget,
        }
    }

    /// Whether no usable time is left.
    pub(crate) fn expired(&self) -> bool {
        self.left().is_err()
    }

    /// Time left, or `Timeout` when none is.
    fn left(&self) -> Result<Duration, WireError> {
        let left = self.at.saturating_duration_since(Instant::now());
        // A zero socket timeout means "block forever": never hand it one.
        if left < Duration::from_micros(100) {
            return Err(WireError::Timeout(self.budget));
        }
        Ok(left)
    }
}

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Addr {
    Tcp(String, u16),
    Unix(PathBuf),
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn set_timeouts(&self, t: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
            Stream::Unix(s) => {
                s.set_read_timeout(Some(t))?;
                s.set_write_timeout(Some(t))
            }
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }

    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
}

/// Maps a socket error under `dl` to a `WireError` (a timed-out read or write is `Timeout`).
fn io_err(e: io::Error, dl: &Deadline) -> WireError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => WireError::Timeout(dl.budget),
        _ => WireError::Io(e),
    }
}

/// One connection to a Redis-protocol server. See the module docs.
pub(crate) struct WireConn {
    stream: Stream,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
}

/// Appends one RESP bulk string made of `parts` to `out`.
pub(crate) fn push_bulk(out: &mut Vec<u8>, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    out.push(b'$');
    out.extend_from_slice(len.to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for p in parts {
        out.extend_from_slice(p);
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends one command of bulk-string arguments to `out`.
pub(crate) fn push_cmd(out: &mut Vec<u8>, args: &[&[u8]]) {
    out.push(b'*');
    out.extend_from_slice(args.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    for a in args {
        push_bulk(out, &[a]);
    }
}

impl WireConn {
    /// Connects within `min(connect_timeout, time left of dl)`, name resolution included.
    pub(crate) fn connect(
        addr: &Addr,
        connect_timeout: Duration,
        dl: &Deadline,
    ) -> Result<Self, WireError> {
        let budget = connect_timeout.min(dl.left()?);
        let until = Instant::now() + budget;
        let stream = match addr {
            Addr::Tcp(host, port) => {
                let addrs = resolve(host, *port, budget, |h, p| {
                    (h, p).to_socket_addrs().map(Iterator::collect)
                })?;
                let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
                let mut found = None;
                for a in addrs {
                    let left = until.saturating_duration_since(Instant::now());
                    if left < Duration::from_micros(100) {
                        return Err(WireError::Timeout(budget));
                    }
                    match TcpStream::connect_timeout(&a, left) {
                        Ok(s) => {
                            found = Some(s);
                            break;
                        }
                        Err(e) if e.kind() == io::ErrorKind::TimedOut => {
                            return Err(WireError::Timeout(budget))
                        }
                        Err(e) => last = e,
                    }
                }
                let s = found.ok_or(WireError::Refused(last))?;
                s.set_nodelay(true).map_err(WireError::Io)?;
                Stream::Tcp(s)
            }
            Addr::Unix(path) => Stream::Unix(connect_unix(path, until, budget)?),
        };
        Ok(WireConn {
            stream,
            buf: vec![0u8; READ_BUF].into_boxed_slice(),
            start: 0,
            end: 0,
        })
    }

    /// Writes all of `bytes` before `dl`.
    pub(crate) fn send(&mut self, mut bytes: &[u8], dl: &Deadline) -> Result<(), WireError> {
        while !bytes.is_empty() {
            self.stream
                .set_timeouts(dl.left()?)
                .map_err(WireError::Io)?;
            match self.stream.write(bytes) {
                Ok(0) => return Err(WireError::Io(io::ErrorKind::WriteZero.into())),
                Ok(n) => bytes = &bytes[n..],
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e, dl)),
            }
        }
        Ok(())
    }

    /// Reads more bytes into the buffer (which must be drained or compacted first).
    fn fill(&mut self, dl: &Deadline) -> Result<(), WireError> {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        loop {
            self.stream
                .set_timeouts(dl.left()?)
                .map_err(WireError::Io)?;
            match self.stream.read(&mut self.buf[self.end..]) {
                Ok(0) => {
                    return Err(WireError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "server closed the connection",
                    )))
                }
                Ok(n) => {
                    self.end += n;
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e, dl)),
            }
        }
    }

    /// One `\r\n`-terminated line (without the terminator) of at most `MAX_LINE` bytes.
    fn line(&mut self, dl: &Deadline) -> Result<Vec<u8>, WireError> {
        let mut scanned = 0;
        loop {
            let avail = &self.buf[self.start..self.end];
            if let Some(i) = avail[scanned..].windows(2).position(|w| w == b"\r\n") {
                let line = avail[..scanned + i].to_vec();
                self.start += scanned + i + 2;
                return Ok(line);
            }
            scanned = avail.len().saturating_sub(1);
            if avail.len() > MAX_LINE {
                return Err(WireError::Protocol("reply line too long".into()));
            }
            self.fill(dl)?;
        }
    }

    /// Reads exactly `out.len()` bytes: first what is buffered, then straight from the socket.
    pub(crate) fn read_exact(&mut self, out: &mut [u8], dl: &Deadline) -> Result<(), WireError> {
        let have = (self.end - self.start).min(out.len());
        out[..have].copy_from_slice(&self.buf[self.start..self.start + have]);
        self.start += have;
        let mut done = have;
        while done < out.len() {
            self.stream
                .set_timeouts(dl.left()?)
                .map_err(WireError::Io)?;
            match self.stream.read(&mut out[done..]) {
                Ok(0) => {
                    return Err(WireError::Io(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "server closed the connection mid-reply",
                    )))
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e, dl)),
            }
        }
        Ok(())
    }

    /// The `\r\n` that ends a bulk string.
    pub(crate) fn read_crlf(&mut self, dl: &Deadline) -> Result<(), WireError> {
        let mut t = [0u8; 2];
        self.read_exact(&mut t, dl)?;
        if &t != b"\r\n" {
            return Err(WireError::Protocol("bulk string not terminated".into()));
        }
        Ok(())
    }

    /// The next reply's type byte and line; an error reply becomes `WireError::Server`.
    fn reply_line(&mut self, dl: &Deadline) -> Result<(u8, Vec<u8>), WireError> {
        let line = self.line(dl)?;
        let Some((&kind, rest)) = line.split_first() else {
            return Err(WireError::Protocol("empty reply line".into()));
        };
        if kind == b'-' || kind == b'!' {
            return Err(WireError::Server(
                String::from_utf8_lossy(rest).into_owned(),
            ));
        }
        Ok((kind, rest.to_vec()))
    }

    /// A status reply (`+OK`, `+PONG`).
    pub(crate) fn read_status(&mut self, dl: &Deadline) -> Result<(), WireError> {
        match self.reply_line(dl)? {
            (b'+', _) => Ok(()),
            (k, _) => Err(unexpected(k, "a status")),
        }
    }

    /// An integer reply (`:1`).
    pub(crate) fn read_int(&mut self, dl: &Deadline) -> Result<i64, WireError> {
        match self.reply_line(dl)? {
            (b':', n) => parse_num(&n),
            (k, _) => Err(unexpected(k, "an integer")),
        }
    }

    /// The length prefix of a bulk-string reply: `None` for a nil reply. The caller then reads
    /// exactly that many bytes ([`WireConn::read_exact`]) and [`WireConn::read_crlf`], or drops
    /// the connection.
    pub(crate) fn read_bulk_len(&mut self, dl: &Deadline) -> Result<Option<u64>, WireError> {
        match self.reply_line(dl)? {
            (b'$', n) if n == b"-1" => Ok(None),
            (b'_', _) => Ok(None),
            (b'$', n) => {
                let v = parse_num(&n)?;
                u64::try_from(v)
                    .map(Some)
                    .map_err(|_| WireError::Protocol(format!("bulk length {v}")))
            }
            (k, _) => Err(unexpected(k, "a bulk string")),
        }
    }

    /// A small reply of nested arrays, integers, status lines and bulk strings of at most
    /// `MAX_SMALL_BULK` bytes, at most `MAX_DEPTH` deep with at most `MAX_ARRAY` elements per
    /// array (a `CLUSTER SLOTS` answer); anything larger is a protocol error.
    pub(crate) fn read_value(&mut self, dl: &Deadline) -> Result<Value, WireError> {
        self.read_value_at(dl, 0)
    }

    fn read_value_at(&mut self, dl: &Deadline, depth: usize) -> Result<Value, WireError> {
        match self.reply_line(dl)? {
            (b'+', s) => Ok(Value::Bytes(s)),
            (b':', n) => parse_num(&n).map(Value::Int),
            (b'_', _) => Ok(Value::Nil),
            (b'$', n) if n == b"-1" => Ok(Value::Nil),
            (b'*', n) if n == b"-1" => Ok(Value::Nil),
            (b'$', n) => {
                let len = usize::try_from(parse_num(&n)?)
                    .ok()
                    .filter(|&l| l <= MAX_SMALL_BULK)
                    .ok_or_else(|| WireError::Protocol("bulk string too long".into()))?;
                let mut v = vec![0u8; len];
                self.read_exact(&mut v, dl)?;
                self.read_crlf(dl)?;
                Ok(Value::Bytes(v))
            }
            (b'*', n) => {
                let len = usize::try_from(parse_num(&n)?)
                    .ok()
                    .filter(|&l| l <= MAX_ARRAY && depth < MAX_DEPTH)
                    .ok_or_else(|| WireError::Protocol("array too long or too deep".into()))?;
                let mut items = Vec::with_capacity(len.min(1024));
                for _ in 0..len {
                    items.push(self.read_value_at(dl, depth + 1)?);
                }
                Ok(Value::Array(items))
            }
            (k, _) => Err(unexpected(k, "a value")),
        }
    }
}

/// The addresses of `host:port` within `budget`: an IP literal at once, a name through `lookup`
/// on a helper thread (see the module invariants). A lookup still running when the budget ends is
/// left to finish on its thread; its answer is dropped.
pub(crate) fn resolve<F>(
    host: &str,
    port: u16,
    budget: Duration,
    lookup: F,
) -> Result<Vec<SocketAddr>, WireError>
where
    F: FnOnce(&str, u16) -> io::Result<Vec<SocketAddr>> + Send + 'static,
{
    let literal = host.trim_start_matches('[').trim_end_matches(']');
    if let Ok(ip) = literal.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    if RESOLVERS.fetch_add(1, Ordering::AcqRel) >= MAX_RESOLVERS {
        RESOLVERS.fetch_sub(1, Ordering::AcqRel);
        return Err(WireError::Timeout(budget));
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let name = host.to_string();
    let spawned = std::thread::Builder::new()
        .name("kvtier-resolve".into())
        .spawn(move || {
            let r = lookup(&name, port);
            RESOLVERS.fetch_sub(1, Ordering::AcqRel);
            // The caller may have given up: then nobody receives.
            let _ = tx.send(r);
        });
    if let Err(e) = spawned {
        RESOLVERS.fetch_sub(1, Ordering::AcqRel);
        return Err(WireError::Refused(e));
    }
    match rx.recv_timeout(budget) {
        Ok(r) => r.map_err(WireError::Refused),
        Err(_) => Err(WireError::Timeout(budget)),
    }
}

/// Connects to the Unix socket `path` before `until`: the socket is non-blocking while
/// connecting, so a listener whose backlog is full (Linux answers `EAGAIN`) is retried, never
/// waited on without a bound.
fn connect_unix(path: &Path, until: Instant, budget: Duration) -> Result<UnixStream, WireError> {
    use socket2::{Domain, SockAddr, Socket, Type};
    let sock = Socket::new(Domain::UNIX, Type::STREAM, None).map_err(WireError::Refused)?;
    sock.set_nonblocking(true).map_err(WireError::Refused)?;
    let to = SockAddr::unix(path).map_err(WireError::Refused)?;
    let mut pause = Duration::from_micros(200);
    loop {
        match sock.connect(&to) {
            Ok(()) => break,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.raw_os_error() == Some(libc::EAGAIN) =>
            {
                let left = until.saturating_duration_since(Instant::now());
                if left < Duration::from_micros(100) {
                    return Err(WireError::Timeout(budget));
                }
                std::thread::sleep(pause.min(left));
                pause = (pause * 2).min(Duration::from_millis(20));
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(WireError::Refused(e)),
        }
    }
    sock.set_nonblocking(false).map_err(WireError::Io)?;
    Ok(UnixStream::from(sock))
}

/// A small structured reply (see [`WireConn::read_value`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Value {
    Nil,
    Int(i64),
    Bytes(Vec<u8>),
    Array(Vec<Value>),
}

fn unexpected(kind: u8, wanted: &str) -> WireError {
    WireError::Protocol(format!(
        "reply of type {:?} where {wanted} was expected",
        char::from(kind)
    ))
}

fn parse_num(s: &[u8]) -> Result<i64, WireError> {
    std::str::from_utf8(s)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| WireError::Protocol(format!("bad number {:?}", String::from_utf8_lossy(s))))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A server that sends `reply` in pieces of `chunk` bytes every `gap`, then keeps the
    /// connection open for `hold`.
    fn serve(reply: Vec<u8>, chunk: usize, gap: Duration, hold: Duration) -> Addr {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for piece in reply.chunks(chunk.max(1)) {
                if s.write_all(piece).is_err() {
                    return;
                }
                std::thread::sleep(gap);
            }
            std::thread::sleep(hold);
        });
        Addr::Tcp("127.0.0.1".into(), port)
    }

    #[test]
    fn replies_parse() {
        let a = serve(
            b"+OK\r\n:1\r\n:0\r\n$-1\r\n$3\r\nabc\r\n-ERR nope\r\n".to_vec(),
            3,
            Duration::ZERO,
            Duration::from_millis(200),
        );
        let dl = Deadline::after(Duration::from_secs(2));
        let mut c = WireConn::connect(&a, Duration::from_secs(1), &dl).unwrap();
        c.read_status(&dl).unwrap();
        assert_eq!(c.read_int(&dl).unwrap(), 1);
        assert_eq!(c.read_int(&dl).unwrap(), 0);
        assert_eq!(c.read_bulk_len(&dl).unwrap(), None);
        assert_eq!(c.read_bulk_len(&dl).unwrap(), Some(3));
        let mut out = [0u8; 3];
        c.read_exact(&mut out, &dl).unwrap();
        c.read_crlf(&dl).unwrap();
        assert_eq!(&out, b"abc");
        assert!(matches!(c.read_status(&dl), Err(WireError::Server(m)) if m == "ERR nope"));
    }

    /// A server that drips one byte every 20 ms never extends the deadline.
    #[test]
    fn dripping_server_hits_the_one_deadline() {
        let a = serve(
            vec![b':'; 1000],
            1,
            Duration::from_millis(20),
            Duration::ZERO,
        );
        let dl = Deadline::after(Duration::from_millis(300));
        let t = Instant::now();
        let mut c = WireConn::connect(&a, Duration::from_secs(1), &dl).unwrap();
        let r = c.read_int(&dl);
        assert!(r.as_ref().is_err_and(WireError::is_timeout), "{r:?}");
        assert!(
            t.elapsed() < Duration::from_millis(600),
            "{:?}",
            t.elapsed()
        );
    }

    /// Regression (#28): the name was resolved inline, outside every deadline; a resolver that
    /// hangs now costs the connect budget, no more.
    #[test]
    fn a_hung_name_lookup_ends_with_the_budget() {
        let t = Instant::now();
        let r = resolve(
            "kvtier.invalid",
            6379,
            Duration::from_millis(200),
            |_, _| {
                std::thread::sleep(Duration::from_secs(3));
                Ok(Vec::new())
            },
        );
        assert!(matches!(r, Err(WireError::Timeout(_))), "{r:?}");
        assert!(
            t.elapsed() < Duration::from_millis(1500),
            "{:?}",
            t.elapsed()
        );
        // An IP literal needs no lookup.
        let r = resolve("[::1]", 7, Duration::from_millis(1), |_, _| unreachable!());
        assert_eq!(r.unwrap(), vec!["[::1]:7".parse().unwrap()]);
    }

    /// A resolver that hangs holds at most `MAX_RESOLVERS` threads: past them, connecting to a
    /// host name fails at once instead of starting another thread.
    #[test]
    fn hung_lookups_hold_a_bounded_number_of_threads() {
        let budget = Duration::from_millis(20);
        let mut waited = 0;
        for _ in 0..=MAX_RESOLVERS {
            let t = Instant::now();
            let r = resolve("kvtier.invalid", 1, budget, |_, _| {
                std::thread::sleep(Duration::from_secs(2));
                Ok(Vec::new())
            });
            assert!(matches!(r, Err(WireError::Timeout(_))), "{r:?}");
            if t.elapsed() >= budget {
                waited += 1;
            } else {
                // Refused without waiting: the cap was reached (other tests may hold slots too).
                assert!(waited <= MAX_RESOLVERS, "{waited} lookups started");
                return;
            }
        }
        panic!("{} hung lookups all started threads", MAX_RESOLVERS + 1);
    }

    /// Regression (#28): `UnixStream::connect` blocks while the listener's backlog is full (a
    /// stalled server that stopped accepting); connecting now ends with its budget.
    #[test]
    fn a_full_unix_backlog_ends_with_the_budget() {
        use socket2::{Domain, SockAddr, Socket, Type};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("redis.sock");
        let to = SockAddr::unix(&path).unwrap();
        let l = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
        l.bind(&to).unwrap();
        l.listen(0).unwrap();
        let mut held = Vec::new();
        for _ in 0..16 {
            let c = Socket::new(Domain::UNIX, Type::STREAM, None).unwrap();
            c.set_nonblocking(true).unwrap();
            if c.connect(&to).is_err() {
                break;
            }
            held.push(c);
        }
        assert!(held.len() < 16, "the backlog never filled");
        let dl = Deadline::after(Duration::from_millis(300));
        let t = Instant::now();
        let r = WireConn::connect(&Addr::Unix(path), Duration::from_secs(1), &dl);
        assert!(matches!(r, Err(WireError::Timeout(_))), "{:?}", r.err());
        let took = t.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_millis(1500),
            "{took:?}"
        );
        drop(l);
    }

    #[test]
    fn small_values_parse_and_large_ones_are_refused() {
        let a = serve(
            b"*2\r\n*3\r\n:0\r\n:5460\r\n*2\r\n$9\r\n127.0.0.1\r\n:7000\r\n$-1\r\n$5000\r\n"
                .to_vec(),
            7,
            Duration::ZERO,
            Duration::from_millis(200),
        );
        let dl = Deadline::after(Duration::from_secs(2));
        let mut c = WireConn::connect(&a, Duration::from_secs(1), &dl).unwrap();
        assert_eq!(
            c.read_value(&dl).unwrap(),
            Value::Array(vec![
                Value::Array(vec![
                    Value::Int(0),
                    Value::Int(5460),
                    Value::Array(vec![Value::Bytes(b"127.0.0.1".to_vec()), Value::Int(7000)]),
                ]),
                Value::Nil,
            ])
        );
        assert!(matches!(c.read_value(&dl), Err(WireError::Protocol(_))));
    }
}
