//! Closed sets of names: the values that cross a module or process boundary as text (a
//! state in a stored record, an audit outcome, a verdict on the control socket) and become
//! metric labels. [`named_enum!`](crate::named_enum) declares one: each variant with its exact
//! text, `as_str`, `ALL` (every variant, so a label set is derived rather than kept by hand),
//! `parse`, `Display`, and serde as that text.

#[doc(hidden)]
pub use serde as __serde;

/// A fieldless enum whose variants each have one text:
///
/// ```
/// common::named_enum! {
///     /// How a door is.
///     pub enum Door {
///         Open => "open",
///         Shut => "shut",
///     }
/// }
/// assert_eq!(Door::ALL.iter().map(|d| d.as_str()).collect::<Vec<_>>(), ["open", "shut"]);
/// assert_eq!(Door::parse("shut"), Some(Door::Shut));
/// assert_eq!(Door::parse("ajar"), None);
/// ```
///
/// Serialized as its text; deserializing any other text fails (`unknown variant`).
#[macro_export]
macro_rules! named_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident => $text:literal ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every variant, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// The texts of [`Self::ALL`], in the same order.
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            /// The variant's text: on the wire, in records and logs, and as a metric label.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $( $name::$variant => $text, )+
                }
            }

            /// The variant whose text is `text`, if any.
            pub fn parse(text: &str) -> Option<$name> {
                Self::ALL.iter().copied().find(|v| v.as_str() == text)
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl $crate::names::__serde::Serialize for $name {
            fn serialize<S: $crate::names::__serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> $crate::names::__serde::Deserialize<'de> for $name {
            fn deserialize<D: $crate::names::__serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Text;
                impl $crate::names::__serde::de::Visitor<'_> for Text {
                    type Value = $name;
                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        f.write_str(concat!("a ", stringify!($name), " name"))
                    }
                    fn visit_str<E: $crate::names::__serde::de::Error>(self, v: &str) -> Result<$name, E> {
                        $name::parse(v).ok_or_else(|| E::unknown_variant(v, $name::NAMES))
                    }
                }
                d.deserialize_str(Text)
            }
        }
    };
}

#[cfg(test)]
mod tests {
    crate::named_enum! {
        /// A test set.
        enum Door {
            Open => "open",
            /// Documented variants work too.
            Shut => "shut",
        }
    }

    #[test]
    fn a_named_enum_has_its_texts_both_ways() {
        assert_eq!(Door::ALL, [Door::Open, Door::Shut]);
        assert_eq!(Door::NAMES, ["open", "shut"]);
        for d in Door::ALL {
            assert_eq!(Door::parse(d.as_str()), Some(*d));
            assert_eq!(d.to_string(), d.as_str());
        }
        assert_eq!(Door::parse("ajar"), None);
    }

    #[test]
    fn a_named_enum_is_serialized_as_its_text() {
        let mut buf = Vec::new();
        crate::channel::write_message(&mut buf, &Door::Shut).unwrap();
        let back: Door = crate::channel::read_message(&mut buf.as_slice()).unwrap();
        assert_eq!(back, Door::Shut);
    }
}
