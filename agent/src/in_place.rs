//! Strings read where the deserializer holds them: what a value makes of its text (an address
//! parsed, a name compared with a few known ones) without a `String` of its own, for fields
//! that repeat by the hundred thousand (a Kubernetes list's endpoints, the node's last mesh).

use std::fmt;

use serde::Deserializer;
use serde::de::{Error, Visitor};

/// Reads a string and returns what `read` makes of it; `what` names the value in errors.
pub fn read_str<'de, D, T>(
    deserializer: D,
    what: &'static str,
    read: impl FnOnce(&str) -> T,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
{
    deserializer.deserialize_str(Text { what, read })
}

struct Text<F> {
    what: &'static str,
    read: F,
}

impl<T, F: FnOnce(&str) -> T> Visitor<'_> for Text<F> {
    type Value = T;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.what)
    }

    fn visit_str<E: Error>(self, text: &str) -> Result<T, E> {
        Ok((self.read)(text))
    }
}
