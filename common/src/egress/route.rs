//! Placeholder until the route module lands.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ProxySetting {
    Direct,
    Environment(Vec<(String, String)>),
    Url(String),
}
