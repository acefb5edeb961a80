//! Unguessable bytes from the kernel (`getrandom(2)`), for what a client must not predict: the
//! request ids the gateway makes up (an id names a request to `/abort_request`). The per-core
//! [`super::rng::Rng`] is fast but predictable from a few outputs, fine for tie-breaks only.
//! Read in blocks so a request costs no system call most of the time.

/// Bytes fetched per `getrandom` call.
const BLOCK: usize = 512;

/// A buffer of kernel randomness, one per core.
pub struct Entropy {
    buf: [u8; BLOCK],
    at: usize,
}

impl Default for Entropy {
    fn default() -> Self {
        Entropy {
            buf: [0; BLOCK],
            at: BLOCK,
        }
    }
}

impl std::fmt::Debug for Entropy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Entropy")
    }
}

impl Entropy {
    /// The next random byte.
    pub fn byte(&mut self) -> u8 {
        if self.at == BLOCK {
            fill_from_kernel(&mut self.buf);
            self.at = 0;
        }
        let b = self.buf[self.at];
        // Used bytes are not kept around.
        self.buf[self.at] = 0;
        self.at += 1;
        b
    }

    /// A character of `alphabet` (at most 256 of them) chosen uniformly: bytes past the largest
    /// multiple of the alphabet's size are drawn again, so no character is likelier.
    pub fn pick(&mut self, alphabet: &[u8]) -> u8 {
        let n = alphabet.len().clamp(1, 256);
        let limit = 256 - 256 % n;
        loop {
            let b = usize::from(self.byte());
            if b < limit {
                return alphabet[b % n];
            }
        }
    }
}

/// Fill `buf` from the kernel's CSPRNG; `/dev/urandom` where `getrandom(2)` is missing.
fn fill_from_kernel(buf: &mut [u8]) {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: the pointer and length describe `rest`, a live, writable slice; getrandom
        // writes at most `rest.len()` bytes into it.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n > 0 {
            done += n as usize;
            continue;
        }
        if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        use std::io::Read;
        match std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(rest)) {
            Ok(()) => return,
            // No kernel randomness at all (no getrandom, no /dev/urandom): nothing unguessable
            // exists on this machine; the time at least differs per call.
            Err(_) => {
                let t = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos());
                for (i, b) in rest.iter_mut().enumerate() {
                    *b = (t >> ((i % 16) * 8)) as u8;
                }
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_look_random_and_picks_are_uniform() {
        let mut e = Entropy::default();
        let bytes: Vec<u8> = (0..4096).map(|_| e.byte()).collect();
        let ones: u32 = bytes.iter().map(|b| b.count_ones()).sum();
        assert!((15_000..17_800).contains(&ones), "{ones} of 32768 bits set");
        let alphabet = b"abc";
        let mut counts = [0u32; 3];
        for _ in 0..30_000 {
            counts[(e.pick(alphabet) - b'a') as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_400..10_600).contains(&c)),
            "{counts:?}"
        );
        // Two generators do not agree.
        let mut f = Entropy::default();
        let a: Vec<u8> = (0..32).map(|_| e.byte()).collect();
        let b: Vec<u8> = (0..32).map(|_| f.byte()).collect();
        assert_ne!(a, b);
    }
}
