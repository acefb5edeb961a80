//! Deterministic English-like filler text. Prompts must be real words (a BPE tokenizer then
//! yields about four characters a token, like natural English), reproducible from a seed, and
//! distinct between entities that should not share a prefix. Lengths are given in tokens and
//! converted at [`CHARS_PER_TOKEN`].

use crate::rng::Rng;

/// Characters per token assumed when turning a token count into text. The word list below
/// averages 4.16 characters a word (leading space included); common short English words are one
/// BPE token each, and the simulated worker's `approx` tokenizer counts 4 characters a token.
pub const CHARS_PER_TOKEN: usize = 4;

/// 256 short, common English words (so one draw is one byte of randomness).
const WORDS: [&str; 256] = [
    "a", "an", "the", "of", "and", "to", "in", "is", "it", "you", "he", "was", "for", "on", "are",
    "as", "his", "at", "be", "or", "one", "had", "by", "but", "not", "all", "we", "can", "use",
    "she", "do", "how", "if", "up", "out", "so", "her", "him", "has", "two", "go", "see", "no",
    "way", "my", "who", "its", "now", "day", "did", "get", "may", "new", "me", "our", "man", "say",
    "too", "old", "any", "boy", "why", "ask", "men", "us", "try", "big", "act", "put", "end",
    "set", "off", "air", "sun", "eye", "let", "saw", "far", "sea", "run", "few", "car", "cut",
    "red", "dog", "top", "map", "fly", "low", "box", "sky", "yes", "sit", "am", "ox", "ax", "add",
    "age", "ago", "aid", "aim", "ant", "ape", "arc", "arm", "art", "bad", "bag", "ban", "bar",
    "bat", "bay", "bed", "bee", "bet", "bid", "bit", "bow", "bud", "bug", "bus", "buy", "cab",
    "cap", "cat", "cow", "cry", "cup", "dad", "den", "dew", "die", "dig", "dim", "dip", "dot",
    "dry", "due", "dug", "ear", "eat", "egg", "elf", "elk", "era", "eve", "fan", "fat", "fed",
    "fig", "fin", "fit", "fix", "fog", "fox", "fry", "fun", "fur", "gap", "gas", "gel", "gum",
    "gun", "guy", "gym", "ham", "hat", "hay", "hen", "hid", "hip", "hit", "hot", "hub", "hue",
    "hug", "hum", "hut", "ice", "ill", "ink", "inn", "ion", "jam", "jar", "jaw", "jet", "job",
    "jog", "joy", "jug", "key", "kid", "kin", "kit", "lab", "lad", "lap", "law", "lay", "with",
    "they", "this", "have", "from", "what", "were", "when", "your", "said", "there", "each",
    "which", "their", "will", "other", "about", "many", "then", "them", "these", "some", "would",
    "make", "like", "into", "time", "look", "more", "could", "than", "first", "been", "call",
    "find", "long", "down", "come", "made", "part", "over", "sound", "take", "only", "work",
    "know", "place", "year", "live", "back", "give", "most", "very", "after", "thing", "just",
];

/// Append about `tokens` tokens of words drawn from `rng`, each word preceded by a space. Stops
/// at the first word that reaches the character target, so the text ends on a whole word and
/// overshoots by at most one word.
pub fn push_words(out: &mut String, rng: &mut Rng, tokens: usize) {
    let target = tokens * CHARS_PER_TOKEN;
    out.reserve(target + 8);
    let start = out.len();
    let mut bits = 0u64;
    let mut left = 0u32;
    while out.len() - start < target {
        if left == 0 {
            bits = rng.next_u64();
            left = 8;
        }
        let word = WORDS[(bits & 0xff) as usize];
        bits >>= 8;
        left -= 1;
        out.push(' ');
        out.push_str(word);
    }
}

/// A fresh string of about `tokens` tokens from the stream `(seed, label)`: the same pair always
/// gives the same text, different labels give texts that differ from the first word on (with
/// probability 255/256 per word).
pub fn words(seed: u64, label: u64, tokens: usize) -> String {
    let mut rng = Rng::fork(seed, label);
    let mut s = String::new();
    push_words(&mut s, &mut rng, tokens);
    s
}

/// Exactly `chars` characters of text from the stream `(seed, label)`: the text of
/// [`words`] cut to length (all ASCII, so any cut is a char boundary). A shorter cut of the same
/// pair is always a prefix of a longer one, which trace replay relies on to truncate the last
/// block of a prompt.
pub fn exact_chars(seed: u64, label: u64, chars: usize, out: &mut String) {
    let mut rng = Rng::fork(seed, label);
    let start = out.len();
    push_words(out, &mut rng, chars.div_ceil(CHARS_PER_TOKEN));
    out.truncate(start + chars);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_list_is_distinct_ascii_and_about_four_chars_a_token() {
        let mut sorted = WORDS.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), WORDS.len());
        assert!(WORDS
            .iter()
            .all(|w| w.bytes().all(|b| b.is_ascii_lowercase())));
        let avg = WORDS.iter().map(|w| w.len() + 1).sum::<usize>() as f64 / 256.0;
        assert!((3.8..4.4).contains(&avg), "{avg}");
    }

    #[test]
    fn deterministic_and_sized() {
        let a = words(7, 1, 500);
        assert_eq!(a, words(7, 1, 500));
        assert_ne!(a, words(7, 2, 500));
        assert_ne!(a, words(8, 1, 500));
        assert!(a.len() >= 2000 && a.len() < 2010, "{}", a.len());
        // About one word per token: the word count is close to the token count.
        let n = a.split_whitespace().count();
        assert!((430..=560).contains(&n), "{n} words");
    }

    #[test]
    fn exact_chars_cuts_are_prefixes() {
        let mut long = String::new();
        exact_chars(3, 9, 2048, &mut long);
        assert_eq!(long.len(), 2048);
        let mut short = String::from("x");
        exact_chars(3, 9, 777, &mut short);
        assert_eq!(short.len(), 778);
        assert!(long.starts_with(&short[1..]));
    }
}
