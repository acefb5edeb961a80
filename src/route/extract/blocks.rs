//! The routing text of the newer APIs' conversation fields: OpenAI Responses (`instructions`,
//! `input`) and Anthropic Messages (`system`, `messages`). Both nest text in items, messages,
//! content parts and blocks of many types; the text is what a prefix cache sees of them, in
//! order, joined by single spaces as chat's contents are, so turn 2 of a conversation carries
//! turn 1's text as a prefix.
//!
//! One rule covers both APIs: a string is a piece; an array contributes its elements; an
//! object contributes its `text` (when a string), then its `content` and `output` (read by the
//! same rule), in the order they appear. That takes Responses message items (string or
//! `input_text` / `output_text` parts) and `function_call_output` items, and Messages text
//! blocks and `tool_result` contents; images, tool calls, thinking and other fields contribute
//! nothing.

use super::{Key, Sink, Skip};
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use std::fmt;

/// The visitor methods [`Blocks`] and [`TextField`] share: a string is a piece for the sink
/// (borrowed from the body when it needs no unescaping), any other scalar contributes nothing.
macro_rules! strings_into_the_sink {
    ($de:lifetime) => {
        fn visit_borrowed_str<E: de::Error>(self, v: &$de str) -> Result<(), E> {
            self.0.borrowed(v);
            Ok(())
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
            self.0.transient(v);
            Ok(())
        }
        fn visit_u64<E: de::Error>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E: de::Error>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E: de::Error>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_bool<E: de::Error>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E: de::Error>(self) -> Result<(), E> {
            Ok(())
        }
    };
}

/// Text pieces of a Responses or Messages field, written into a [`Sink`] (see the module
/// docs for the rule).
pub(super) struct Blocks<'s, 'a>(pub(super) &'s mut Sink<'a>);

impl<'de> DeserializeSeed<'de> for Blocks<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.0.full() {
            return Skip::deserialize(d).map(|_| ());
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Blocks<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a string, an array of items or a content block")
    }
    strings_into_the_sink!('de);
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Blocks(&mut *self.0))?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(k) = map.next_key::<Key>()? {
            match k {
                Key::Text => map.next_value_seed(TextField(&mut *self.0))?,
                Key::Content | Key::Output => map.next_value_seed(Blocks(&mut *self.0))?,
                _ => {
                    map.next_value::<Skip>()?;
                }
            }
        }
        Ok(())
    }
}

/// A list of [`Blocks`] (Messages' `messages` must be an array).
pub(super) struct BlockList<'s, 'a>(pub(super) &'s mut Sink<'a>);

impl<'de> DeserializeSeed<'de> for BlockList<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(Blocks(self.0))
    }
}

/// An object's `text`: a piece when it is a string; anything else (a format object, say) is
/// skipped.
struct TextField<'s, 'a>(&'s mut Sink<'a>);

impl<'de> DeserializeSeed<'de> for TextField<'_, 'de> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        if self.0.full() {
            return Skip::deserialize(d).map(|_| ());
        }
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TextField<'_, 'de> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }
    strings_into_the_sink!('de);
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element::<Skip>()?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while map.next_entry::<Skip, Skip>()?.is_some() {}
        Ok(())
    }
}

#[cfg(test)]
mod tests;
