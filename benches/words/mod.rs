//! Pseudo-text for the tree benches (`tree`, `tree_writer`): one generator, so both weigh and
//! time the tree on the same kind of prompts. Deterministic from a seed.

/// splitmix64: deterministic, fast, good enough for text generation.
#[derive(Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo)
    }
}

/// Pseudo-words (a few with non-ASCII characters) drawn with a skew, like natural text.
pub struct Words {
    /// Goes on drawing after the vocabulary (callers draw from it too).
    pub rng: Rng,
    vocab: Vec<String>,
}

impl Words {
    pub fn new(seed: u64) -> Self {
        const SYL: [&str; 24] = [
            "ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "en", "or", "al", "is", "qu", "ph",
            "th", "sh", "de", "re", "co", "ma", "ti", "on", "é", "ü",
        ];
        let mut rng = Rng(seed);
        let vocab = (0..4000)
            .map(|i| {
                let mut w = String::new();
                for _ in 0..rng.range(1, 5) {
                    w.push_str(SYL[rng.below(SYL.len())]);
                }
                if i % 97 == 0 {
                    w.push_str("中文");
                }
                w
            })
            .collect();
        Words { rng, vocab }
    }

    /// Appends words until `out` grew by at least `chars` bytes.
    pub fn push(&mut self, out: &mut String, chars: usize) {
        let start = out.len();
        while out.len() - start < chars {
            // Skewed pick: the square of a uniform favours the first words.
            let u = self.rng.below(1 << 16) as u64;
            let i = ((u * u * self.vocab.len() as u64) >> 32) as usize;
            out.push_str(&self.vocab[i]);
            out.push(if self.rng.below(12) == 0 { '.' } else { ' ' });
        }
    }

    #[allow(dead_code)] // not every bench that includes this module uses it
    pub fn text(&mut self, chars: usize) -> String {
        let mut s = String::with_capacity(chars + 16);
        self.push(&mut s, chars);
        s
    }
}
